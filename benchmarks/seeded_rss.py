#!/usr/bin/env python
"""Resident memory of one Runner serving many distinct seeds with a sampling drafter (issue 48).

Every seeded request used to get a drafter of its own, each with its own copy of the draft model: memory grew with
the number of seeds. Now one drafter (one draft-model session) serves them all; this prints VmRSS after the first
and the last of --seeds sampled generations, each with another seed, and whether each seed's output repeats.

  python benchmarks/seeded_rss.py ARTIFACT                      # e.g. an export with --drafter draft-model:smollm2-135m
  python benchmarks/seeded_rss.py ARTIFACT --seeds 50 --max-tokens 16 --threads 2
"""

from __future__ import annotations

import argparse
import json
import time

from speccompile.runtime import Runner, SamplingParams


def memory_mb() -> dict[str, float]:
    """VmRSS and its anonymous and file-backed parts (weights ONNX Runtime maps from the artifact's files), MiB."""
    with open("/proc/self/status") as fh:
        fields = dict(line.split(":", 1) for line in fh)
    return {key: round(int(fields[key].split()[0]) / 1024, 1) for key in ("VmRSS", "RssAnon", "RssFile")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact")
    parser.add_argument("--drafter", default="draft-model")
    parser.add_argument("--seeds", type=int, default=50, help="distinct seeds, one generation each")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt", default="Name three colours and say why you like them.")
    parser.add_argument("--one-seed", action="store_true", help="the baseline: seed 0 every time (memory the "
                        "generations take whatever the seeds)")
    args = parser.parse_args()

    runner = Runner(args.artifact, drafter=args.drafter, threads=args.threads)
    sampling = lambda i: SamplingParams(temperature=0.8, top_p=0.95, seed=0 if args.one_seed else i)
    memory, first_tokens = [], []
    started = time.perf_counter()
    for i in range(args.seeds):
        first_tokens.append(runner.generate(args.prompt, max_tokens=args.max_tokens, sampling=sampling(i)).tokens)
        memory.append(memory_mb())
    repeats = all(runner.generate(args.prompt, max_tokens=args.max_tokens, sampling=sampling(i)).tokens == first_tokens[i]
                  for i in (0, args.seeds // 2, args.seeds - 1))
    rss = [m["VmRSS"] for m in memory]
    print(json.dumps({"artifact": args.artifact, "drafter": args.drafter, "seeds": 1 if args.one_seed else args.seeds,
                      "generations": args.seeds,
                      "first_rss_mb": rss[0], "last_rss_mb": rss[-1], "max_rss_mb": max(rss),
                      "growth": round(rss[-1] / rss[0] - 1, 4), "rss_mb": rss,
                      "first": memory[0], "last": memory[-1], "seeded_outputs_repeat": repeats,
                      "seconds": round(time.perf_counter() - started, 1)}))


if __name__ == "__main__":
    main()
