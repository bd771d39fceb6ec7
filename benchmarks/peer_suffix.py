"""Suffix decoding against its reference: speccompile's suffix trees vs Arctic Inference's `SuffixDecodingCache`
on the same token traces, with the same max depth, min token probability, spec factor and draft budget.

A trace is a workload's requests in order with the target's greedy answers (plain decoding, made here with
`--artifact`, or read back with `--traces`). Both caches replay it the way a server runs it: each request starts
with its prompt, every round drafts after the history (its own prompt + output, and earlier responses), the
draft is checked against the answer (the longest accepted path of the tree: greedy verification), and the
round's tokens (accepted + the target's one) are added before the next. Reported per cache: tokens per pass
(target passes a verifier would run), acceptance (accepted / drafted tokens), drafted tokens per pass, ms per
speculation.

Arctic Inference's C++ suffix tree is built on the CPU without CUDA (only csrc/suffix_decoding, with nanobind):

    pip download --no-deps --no-binary :all: arctic-inference==0.3.0   (or the sdist's URL; then tar xzf)
    python -m venv /tmp/arctic-venv && /tmp/arctic-venv/bin/pip install nanobind numpy
    cmake -S arctic_inference-0.3.0/csrc/suffix_decoding -B build -DPython_EXECUTABLE=/tmp/arctic-venv/bin/python
    make -C build   # -> build/_C.cpython-311-x86_64-linux-gnu.so
    mkdir -p pkg/arctic_inference/suffix_decoding && touch pkg/arctic_inference/__init__.py
    cp arctic_inference-0.3.0/arctic_inference/suffix_decoding/*.py build/_C*.so pkg/arctic_inference/suffix_decoding/

    python benchmarks/peer_suffix.py --artifact exported/smollm2 --arctic pkg --traces /tmp/agentic.traces.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

WORKLOAD = Path(__file__).with_name("workloads") / "agentic.jsonl"


def make_traces(artifact: Path, workload: Path, max_tokens: int, threads: int) -> list[dict]:
    """The workload's prompts (token ids) with the target's greedy answers, in order."""
    from speccompile.runtime import Runner
    from speccompile.runtime.bench import load_workload

    runner = Runner(artifact, drafter="none", threads=threads)
    traces = []
    for item in load_workload(workload):
        ids = runner.artifact.tokenizer.prompt_ids(item["prompt"], item["chat"])
        traces.append({"id": item["id"], "prompt": ids, "answer": runner.generate_ids(ids, max_tokens).tokens})
    return traces


def accepted_path(tokens: Sequence[int], parents: Sequence[int], answer: Sequence[int]) -> int:
    """How many draft tokens greedy verification accepts: the longest tree path that spells the answer's start."""
    depth = {-1: 0}
    best = 0
    for i, (token, parent) in enumerate(zip(tokens, parents)):
        d = depth.get(parent)
        if d is not None and d < len(answer) and answer[d] == token:
            depth[i] = d + 1
            best = max(best, d + 1)
    return best


Speculate = Callable[[int, list[int]], tuple[list[int], list[int]]]  # (request, history) -> (tokens, parents)


def replay(traces: list[dict], start: Callable[[int, list[int]], None], speculate: Speculate,
           add: Callable[[int, list[int]], None], stop: Callable[[int, list[int]], None]) -> dict:
    """Run every trace through one cache (module docstring); the totals."""
    passes = drafted = accepted = produced = 0
    seconds = 0.0
    for number, trace in enumerate(traces):
        prompt, answer = list(trace["prompt"]), list(trace["answer"])
        start(number, prompt)
        history, done = prompt + answer[:1], 1  # the prefill pass chose the first token
        add(number, answer[:1])
        passes += 1
        while done < len(answer):
            t0 = time.perf_counter()
            tokens, parents = speculate(number, history)
            seconds += time.perf_counter() - t0
            ok = accepted_path(tokens, parents, answer[done:])
            step = answer[done: done + ok + 1]
            passes, drafted, accepted = passes + 1, drafted + len(tokens), accepted + ok
            add(number, step)
            history += step
            done += len(step)
        produced += len(answer)
        stop(number, history)
    return {"tokens_per_pass": round(produced / max(passes, 1), 3), "acceptance": round(accepted / max(drafted, 1), 3),
            "drafted_per_pass": round(drafted / max(passes, 1), 2), "ms_per_speculation": round(1000 * seconds / max(passes, 1), 3),
            "passes": passes, "tokens": produced}


def ours(traces: list[dict], args) -> dict:
    from speccompile.runtime.drafters.base import GenerationStart, Observation
    from speccompile.runtime.drafters.suffix import SuffixCache, SuffixDrafter

    cache = SuffixCache(args.cache_requests, args.max_depth, min_prob=args.min_prob, spec_factor=args.spec_factor, tree=args.tree)
    drafters: dict[int, SuffixDrafter] = {}

    def start(number, prompt):
        drafters[number] = drafter = SuffixDrafter(cache, args.max_depth, args.min_prob, args.spec_factor, tree=args.tree)
        drafter.start(GenerationStart(prompt))

    def speculate(number, history):
        candidate, _ = drafters[number].speculate(history, args.max_spec)
        return candidate.tokens, candidate.parents

    return replay(traces, start, speculate, lambda number, step: None, lambda number, history: drafters.pop(number).observe(Observation(finished=history)))


def arctic(traces: list[dict], args) -> dict:
    sys.path.insert(0, str(args.arctic))
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    cache = SuffixDecodingCache(max_tree_depth=args.max_depth, max_cached_requests=args.cache_requests)

    def speculate(number, history):
        draft = cache.speculate(number, history[-args.max_depth:], max_spec_tokens=args.max_spec, max_spec_factor=args.spec_factor,
                                min_token_prob=args.min_prob, use_tree_spec=args.tree)
        return list(draft.token_ids), list(draft.parents)

    return replay(traces, cache.start_request, speculate, cache.add_active_response, lambda number, history: cache.stop_request(number))


def add_suffix_options(parser: argparse.ArgumentParser) -> None:
    """The suffix cache's settings, as Arctic Inference names them (this script and suffix_bound.py)."""
    parser.add_argument("--max-depth", type=int, default=24)
    parser.add_argument("--min-prob", type=float, default=0.1)
    parser.add_argument("--spec-factor", type=float, default=1.0)
    parser.add_argument("--max-spec", type=int, default=24, help="most draft tokens per pass")
    parser.add_argument("--cache-requests", type=int, default=10000)
    parser.add_argument("--chain", dest="tree", action="store_false", help="chains instead of trees")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", type=Path, help="make the traces with this artifact (greedy, plain decoding)")
    parser.add_argument("--traces", type=Path, help="JSON traces: read (without --artifact) or written (with it)")
    parser.add_argument("--workload", type=Path, default=WORKLOAD)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--arctic", type=Path, help="folder holding the built arctic_inference package (module docstring)")
    add_suffix_options(parser)
    args = parser.parse_args()
    if args.artifact is not None:
        traces = make_traces(args.artifact, args.workload, args.max_tokens, args.threads)
        if args.traces is not None:
            args.traces.write_text(json.dumps(traces))
    elif args.traces is not None:
        traces = json.loads(args.traces.read_text())
    else:
        parser.error("give --artifact (make traces) or --traces (read them)")
    report = {"requests": len(traces), "max_depth": args.max_depth, "min_prob": args.min_prob, "spec_factor": args.spec_factor,
              "max_spec": args.max_spec, "tree": args.tree, "speccompile": ours(traces, args)}
    if args.arctic is not None:
        report["arctic_inference"] = arctic(traces, args)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
