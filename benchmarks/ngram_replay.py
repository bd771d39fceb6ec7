"""Replay n-gram drafting over recorded greedy outputs: tune lookup policies without timing noise.

Greedy speculative output equals plain output, so the tokens a policy would have had accepted can be
computed offline from one recorded generation per prompt. This script records them once (greedy decoding of
each workload prompt, cached as JSON), then replays `NgramDrafter` the way a `Runner` sizes its drafts: the
adaptive controller at fixed pass costs, its acceptance estimates carried from prompt to prompt (the
runner's learned rates), a round of twice `--k` after a chain of `--k` was accepted whole (`DRAFT_GROWTH`),
and, with `--cut-block`, no pass across a head_dim-256 cut (runtime/backends/wide_head.py). It prints tokens
per pass and the modelled speedup over plain decoding (the sum of the passes' costs) for each setting.

Pass costs: `--costs`, t(q) / t(1) as JSON, measured on the target (`verify_ms_by_q` of `speccompile bench`, or
timed passes as in docs/benchmarks.md); without it, 1 + `--slope` (q - 1).

    python benchmarks/ngram_replay.py --artifact exported/smollm2 --workload benchmarks/workloads/copy.jsonl \
        --k 8,12,16 --max-match 2,4,8

The modelled speedup ignores drafting time and runtime overhead (both ~1-3 % for n-gram lookup); `bench`
and `peer_llamacpp.py` measure the real thing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from suffix_bound import cost_table

from speccompile.runtime.adaptive import AdaptiveController
from speccompile.runtime.backends.wide_head import WideHeadRule
from speccompile.runtime.costs import PassCosts
from speccompile.runtime.drafters.ngram import NgramDrafter
from speccompile.runtime.generate import DRAFT_GROWTH


def record(artifact: Path, workloads: list[Path], max_tokens: int, threads: int, cache: Path,
           raw: bool = False) -> list[dict]:
    """Prompt ids and greedy output of every workload prompt (cached in `cache`); `raw`: no chat template."""
    if cache.exists():
        return json.loads(cache.read_text())
    from speccompile.runtime.bench import load_workload
    from speccompile.runtime.session import Runner

    runner = Runner(artifact, threads=threads, drafter="ngram")
    rows = []
    for workload in workloads:
        for item in load_workload(workload):
            ids = runner.artifact.tokenizer.prompt_ids(item["prompt"], item["chat"] and not raw)
            result = runner.generate_ids(ids, max_tokens)  # n-gram speculative == plain greedy
            rows.append({"workload": workload.stem, "id": item["id"], "prompt": ids, "output": list(map(int, result.tokens))})
            print(f"recorded {workload.stem}/{item['id']}: {len(result.tokens)} tokens", flush=True)
    cache.write_text(json.dumps(rows))
    return rows


def replay(rows: list[dict], k: int, max_match: int, costs: PassCosts, growth: int = DRAFT_GROWTH,
           cut_block: int = 0) -> tuple[float, float]:
    """(tokens per target pass, modelled speedup over plain) of n-gram lookup sized as a runner sizes it
    (module docstring) at the pass costs `costs`."""
    rule = WideHeadRule(cuts=((cut_block, cut_block // 2),)) if cut_block else WideHeadRule()
    learned = AdaptiveController.learned_rates()
    tokens = passes = spent = 0.0
    for row in rows:
        drafter = NgramDrafter(1, max_match)
        controller = AdaptiveController(num_draft_tokens=k * growth, costs=costs, learned=learned)
        out = row["output"]
        history = list(row["prompt"]) + out[:1]  # the first token comes from the prefill
        pos, whole = 1, False
        while pos < len(out):
            room = min(k * (growth if whole else 1), len(out) - pos - 1, rule.rows_from(len(history) - 1) - 1)
            proposal = drafter.propose(history, controller.sizing(room)) if room > 0 else None
            draft = list(proposal.tokens) if proposal is not None else []
            accepted = 0
            while accepted < len(draft) and draft[accepted] == out[pos + accepted]:
                accepted += 1
            if draft:
                controller.record_draft(len(draft), accepted, 0.0, proposal.key)
            whole = accepted == len(draft) >= k
            step = min(accepted + 1, len(out) - pos)
            history += out[pos: pos + step]
            pos += step
            passes += 1
            spent += costs.seconds(len(draft) + 1)
        tokens += len(out) - 1
    return tokens / passes, tokens * costs.seconds(1) / spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--artifact", type=Path, required=True)
    ap.add_argument("--workload", type=Path, action="append", required=True)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--raw", action="store_true", help="record every prompt without the chat template (a base model)")
    ap.add_argument("--cache", type=Path, default=Path("ngram_replay_outputs.json"))
    ap.add_argument("--k", default="12", help="comma list of most draft tokens (num_draft_tokens)")
    ap.add_argument("--max-match", default="4", help="comma list of longest suffix lengths")
    ap.add_argument("--growth", type=int, default=DRAFT_GROWTH, help="a round's room after a whole accept, in --k")
    ap.add_argument("--cut-block", type=int, default=0, help="128 for a head_dim-256 target (Gemma 2 / 3)")
    ap.add_argument("--costs", default=None, help='t(q) / t(1) as JSON, e.g. {"1": 1, "2": 1.09, "5": 1.44, "9": 1.8}')
    ap.add_argument("--slope", type=float, default=0.06, help="without --costs: a verified token's cost, in one-token passes")
    args = ap.parse_args()
    ratios = {int(q): float(r) for q, r in json.loads(args.costs).items()} if args.costs else {1: 1.0, 2: 1.0 + args.slope}
    costs = cost_table(ratios)
    rows = record(args.artifact, args.workload, args.max_tokens, args.threads, args.cache, args.raw)
    print(f"{'workload':10} {'k':>3} {'max-match':>9} {'tokens/pass':>12} {'modelled speedup':>17}")
    for name in sorted({r["workload"] for r in rows}):
        subset = [r for r in rows if r["workload"] == name]
        for k in (int(x) for x in args.k.split(",")):
            for m in (int(x) for x in args.max_match.split(",")):
                tpp, speed = replay(subset, k, m, costs, args.growth, args.cut_block)
                print(f"{name:10} {k:3d} {m:9d} {tpp:12.2f} {speed:16.2f}x")


if __name__ == "__main__":
    main()
