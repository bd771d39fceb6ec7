#!/usr/bin/env python
"""Whether the batch decoder gives every request the bits it gets alone (head_dim > 128: docs/DESIGN.md).

Greedy generations with an n-gram drafter, each alone, then together in one `Runner.batch_decoder` (its default
`slot_passes`, which a head_dim > 128 artifact turns into "all"): per request, whether its tokens and the logits
that chose them are bitwise its own alone, and how the rounds ran. `--control` then decodes them again with the
batched one-row passes a head_dim <= 128 artifact uses (what the head_dim > 128 rule avoids) and prints the largest
logit difference.

  python benchmarks/batch_alone_bits.py ARTIFACT                # e.g. speccompile export gemma3-270m --batch-slots 4
  python benchmarks/batch_alone_bits.py ARTIFACT --threads 2 --max-tokens 40 --control
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from speccompile.runtime import Runner, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
           "1, 2, 3, 4, 5, 6, 7, 8,"]


def together(runner: Runner, prompts: list[list[int]], config) -> tuple[list, dict]:
    decoder = runner.batch_decoder(len(prompts))
    generations = decoder.join_many([(ids, config(), None) for ids in prompts])
    while decoder.active:
        decoder.step()
    rounds = {"slot_passes": decoder.slot_passes, "batched_passes": decoder.batched_passes, "mode": decoder.passes.mode}
    return [g.result() for g in generations], rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--control", action="store_true", help="also decode with batched one-row passes")
    args = parser.parse_args()
    runner = Runner(args.artifact, drafter="ngram", threads=args.threads)

    def config():
        traced = runner.config(args.max_tokens)
        traced.trace_logits = True
        return traced

    prompts = [runner.artifact.tokenizer.prompt_ids(text, chat=False) for text in PROMPTS]
    alone = [runner.generator(SamplingParams(), False).generate(ids, config()) for ids in prompts]
    results, rounds = together(runner, prompts, config)
    report = {"head_dim": runner.artifact.target.spec.head_dim, **rounds, "requests": [
        {"tokens_equal": a.tokens == b.tokens, "logits_bitwise": bool(np.array_equal(a.logits, b.logits)),
         "draft_steps": b.stats.draft_steps} for a, b in zip(alone, results)]}
    if args.control:
        from speccompile.runtime.backends.ort import OrtBufferSession

        OrtBufferSession.wide_head_passes = property(lambda self: False)  # the head_dim <= 128 rule: batched passes
        results, rounds = together(runner, prompts, config)
        report["control"] = {**rounds, "requests": [
            {"tokens_equal": a.tokens == b.tokens, "logits_bitwise": bool(np.array_equal(a.logits, b.logits)),
             "max_abs_diff": max(float(np.abs(x - y).max()) for x, y in zip(a.logits, b.logits))} for a, b in zip(alone, results)]}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
