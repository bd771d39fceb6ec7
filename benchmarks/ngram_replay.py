"""Replay n-gram drafting over recorded greedy outputs: tune lookup policies without timing noise.

Greedy speculative output equals plain output, so the tokens a policy would have had accepted can be
computed offline from one recorded generation per prompt. This script records them once (plain greedy
decoding of each workload prompt, cached as JSON), then replays `NgramDrafter` with the runtime's
adaptive controller in its fixed-cost mode (a pass over q tokens costs 1 + s (q - 1) one-token passes)
and prints tokens per pass and the modelled speedup over plain decoding for each setting.

    python benchmarks/ngram_replay.py --artifact exported/smollm2 --workload benchmarks/workloads/copy.jsonl \
        --k 8,12,16 --max-match 2,4,8

The modelled speedup ignores drafting time and runtime overhead (both ~1% for n-gram lookup); `bench`
and `peer_ortgenai.py` measure the real thing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def record(artifact: Path, workloads: list[Path], max_tokens: int, threads: int, cache: Path) -> list[dict]:
    """Prompt ids and greedy output of every workload prompt (cached in `cache`)."""
    if cache.exists():
        return json.loads(cache.read_text())
    from speccompile.runtime.bench import load_workload
    from speccompile.runtime.session import Runner

    runner = Runner(artifact, threads=threads, drafter="ngram")
    rows = []
    for workload in workloads:
        for item in load_workload(workload):
            ids = runner.artifact.tokenizer.prompt_ids(item["prompt"], item["chat"])
            result = runner.generate_ids(ids, max_tokens)  # n-gram speculative == plain greedy
            rows.append({"workload": workload.stem, "id": item["id"], "prompt": ids, "output": result.tokens})
            print(f"recorded {workload.stem}/{item['id']}: {len(result.tokens)} tokens", flush=True)
    cache.write_text(json.dumps(rows))
    return rows


def replay(rows: list[dict], k: int, max_match: int, slope: float) -> tuple[float, float]:
    """(tokens per target pass, modelled speedup over plain) of n-gram lookup with adaptive trimming."""
    from speccompile.runtime.adaptive import AdaptiveController
    from speccompile.runtime.costs import FixedCosts
    from speccompile.runtime.drafters.ngram import NgramDrafter

    tokens = passes = cost = 0.0
    for row in rows:
        drafter = NgramDrafter(1, max_match)
        controller = AdaptiveController(num_draft_tokens=k, deterministic=True)
        controller.costs = FixedCosts(1.0, slope)
        out = row["output"]
        history = list(row["prompt"]) + out[:1]  # the first token comes from the prefill
        pos = 1
        while pos < len(out):
            room = min(k, len(out) - pos - 1)
            proposal = drafter.propose(history, controller.sizing(room))
            draft = proposal.tokens if room > 0 else []
            accepted = 0
            while accepted < len(draft) and draft[accepted] == out[pos + accepted]:
                accepted += 1
            if draft:
                controller.record_draft(len(draft), accepted, 0.0, proposal.key)
            step = min(accepted + 1, len(out) - pos)
            history += out[pos: pos + step]
            pos += step
            passes += 1
            cost += 1 + slope * len(draft)
        tokens += len(out) - 1
    return tokens / passes, tokens / cost


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--artifact", type=Path, required=True)
    ap.add_argument("--workload", type=Path, action="append", required=True)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", type=Path, default=Path("ngram_replay_outputs.json"))
    ap.add_argument("--k", default="12", help="comma list of most draft tokens")
    ap.add_argument("--max-match", default="4", help="comma list of longest suffix lengths")
    ap.add_argument("--slope", type=float, default=0.06, help="extra cost of one verified token, in one-token passes")
    args = ap.parse_args()
    rows = record(args.artifact, args.workload, args.max_tokens, args.threads, args.cache)
    print(f"{'workload':10} {'k':>3} {'max-match':>9} {'tokens/pass':>12} {'modelled speedup':>17}")
    for name in sorted({r["workload"] for r in rows}):
        subset = [r for r in rows if r["workload"] == name]
        for k in (int(x) for x in args.k.split(",")):
            for m in (int(x) for x in args.max_match.split(",")):
                tpp, speed = replay(subset, k, m, args.slope)
                print(f"{name:10} {k:3d} {m:9d} {tpp:12.2f} {speed:16.2f}x")


if __name__ == "__main__":
    main()
