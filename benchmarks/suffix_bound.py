"""What suffix decoding can gain on a workload's traces at given pass costs: the drafter as it sizes its trees,
and the bound of a drafter that knew which of the suffix tree's nodes will be accepted.

Replays greedy traces (`benchmarks/peer_suffix.py --artifact ART --traces T` writes them) as a server runs them
(requests in order, one shared store), with the pass costs of a target fixed to a table of t(q) / t(1) (the
`--costs` JSON, measured on the target: `verify_ms_by_q` of `speccompile bench`, or timed passes). Modelled time
is the sum of the passes' costs (no drafting or Python time: they are measured separately, docs/benchmarks.md).

- `drafter`: `SuffixDrafter.propose` with adaptive sizing at these costs (its acceptance estimates learn from
  the verdicts as in the runtime); `--chain` for chains instead of trees.
- `bound`: each round drafts exactly the accepted path of the suffix tree's candidate (up to `--max-spec`
  nodes at `--spec-factor`): the speed a perfect acceptance estimate would reach from this drafter's trees.

    python benchmarks/suffix_bound.py --traces T --costs '{"1": 1, "2": 0.9, "3": 1.2, "4": 1.3, "6": 1.6, "8": 1.95}'
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from peer_suffix import accepted_path, add_suffix_options

from speccompile.runtime.adaptive import AdaptiveController
from speccompile.runtime.costs import PassCosts
from speccompile.runtime.drafters.base import GenerationStart, Observation
from speccompile.runtime.drafters.suffix import SuffixCache, SuffixDrafter


def cost_table(ratios: dict[int, float]) -> PassCosts:
    """PassCosts holding the table (t(1) = 1), the line through its widest entry for the q between."""
    costs = PassCosts()
    for q, ratio in ratios.items():
        costs.set(q, ratio)
    widest = max(ratios)
    costs.slope = (ratios[widest] - 1) / max(widest - 1, 1)
    return costs


def replay(traces: list[dict], costs: PassCosts, args, bound: bool) -> dict:
    """Modelled speed over plain decoding, tokens per pass, drafted tokens per pass, acceptance."""
    cache = SuffixCache(args.cache_requests, args.max_depth, min_prob=args.min_prob, spec_factor=args.spec_factor, tree=args.tree)
    controller = AdaptiveController(num_draft_tokens=args.max_spec, costs=costs)
    rates = None
    spent = plain = 0.0
    passes = produced = drafted = accepted = 0
    for trace in traces:
        prompt, answer = list(trace["prompt"]), list(trace["answer"])
        drafter = SuffixDrafter(cache, args.max_depth, args.min_prob, args.spec_factor, tree=args.tree)
        drafter.rates = rates = rates or drafter.rates  # a runner's drafter keeps its estimates across requests
        drafter.start(GenerationStart(prompt_ids=prompt))
        history, done = prompt + answer[:1], 1  # the prefill chose the first token
        while done < len(answer):
            room = min(args.max_spec, len(answer) - done - 1)
            if bound:
                candidate, _ = drafter.speculate(history, room)
                ok = accepted_path(candidate.tokens, candidate.parents, answer[done:])
                rows = ok
            else:
                draft = drafter.propose(history, controller.sizing(room, costs))
                parents = [int(p) - 1 for p in draft.tree.parents[1:]] if draft.tree is not None else list(range(-1, len(draft.tokens) - 1))
                path = _accepted_rows(draft.tokens, parents, answer[done:])
                if draft.tokens:
                    drafter.observe(Observation(draft=draft, accepted_rows=path))
                ok, rows = len(path), len(draft.tokens)
            step = answer[done: done + ok + 1]
            history += step
            done += len(step)
            spent += costs.seconds(1 + rows)
            passes, drafted, accepted = passes + 1, drafted + rows, accepted + ok
        plain += (len(answer) - 1) * costs.seconds(1)
        produced += len(answer) - 1
        drafter.observe(Observation(finished=history))
    return {"speedup": round(plain / max(spent, 1e-12), 3), "tokens_per_pass": round(produced / max(passes, 1), 3),
            "drafted_per_pass": round(drafted / max(passes, 1), 2), "acceptance": round(accepted / max(drafted, 1), 3)}


def _accepted_rows(tokens: list[int], parents: list[int], answer: list[int]) -> list[int]:
    """The draft rows (1-based) on the longest path greedy verification accepts."""
    paths: dict[int, list[int]] = {-1: []}
    best: list[int] = []
    for i, (token, parent) in enumerate(zip(tokens, parents)):
        path = paths.get(parent)
        if path is not None and len(path) < len(answer) and answer[len(path)] == token:
            paths[i] = path + [i + 1]
            best = paths[i] if len(paths[i]) > len(best) else best
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=Path, required=True)
    parser.add_argument("--costs", required=True, help='t(q) / t(1) as JSON, e.g. {"1": 1, "4": 1.3}')
    add_suffix_options(parser)
    args = parser.parse_args()
    traces = json.loads(args.traces.read_text())
    ratios = {int(q): float(r) for q, r in json.loads(args.costs).items()}
    report = {"spec_factor": args.spec_factor, "tree": args.tree, "costs": ratios}
    for mode in ("drafter", "bound"):
        report[mode] = replay(traces, cost_table(ratios), args, mode == "bound")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
