#!/usr/bin/env python
"""The batch decoder's round modes side by side, in process (no HTTP): a closed loop of N clients, each
sending its next prompt as soon as its last one finished (its prompts cycle through one workload per client
group), for --seconds in each mode, alternating:

  off     rounds without drafts as one batched pass; a request that drafts runs a verify pass of its own
  drafts  rounds with drafts as one slot pass (target.ort-slots.onnx) where they pay, the others batched
  all     every round of two or more requests a slot pass (batch invariance)

(`serve --slot-passes`).

Prompts come from the prefix cache after the first round (as `serve_load.py --warm-all`), so the numbers are
decoding, not prefill. Prints tokens/s per mode (every token generated in the window, finished or not), its ratio to the first mode measured in the same run, the slot and
batched passes, and how many finished requests differ from their greedy output alone (must be 0). Example:

  python benchmarks/batch_modes.py exported/smollm2 --workload benchmarks/workloads/copy.jsonl \\
      --workload benchmarks/workloads/chat.jsonl --clients 8 --seconds 20 --threads 2
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from speccompile.runtime import Runner  # noqa: E402
from speccompile.runtime.prefix_cache import PrefixCache  # noqa: E402




def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact")
    parser.add_argument("--workload", action="append", required=True, help="JSONL prompts; the clients are split evenly between the workloads.")
    parser.add_argument("--limit", type=int, default=4, help="Prompts of each workload.")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=20.0, help="Per mode and repeat.")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--modes", default="off,drafts,all", help="Values of --slot-passes, compared with the first.")
    parser.add_argument("--drafter", default="ngram")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    runner = Runner(args.artifact, drafter=args.drafter, threads=args.threads, shared_cores=True)  # as the server opens it
    tokenizer = runner.artifact.tokenizer
    workloads = []
    for path in args.workload:
        prompts = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()][: args.limit]
        workloads.append([tokenizer.prompt_ids(p["prompt"], p.get("chat", True)) for p in prompts])
    clients = [workloads[c * len(workloads) // args.clients] for c in range(args.clients)]
    clients = [prompts[c % len(prompts):] + prompts[: c % len(prompts)] for c, prompts in enumerate(clients)]
    alone = {tuple(ids): runner.generate_ids(ids, args.max_tokens).tokens for prompts in workloads for ids in prompts}
    cache = PrefixCache(1 << 30)
    results: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for mode in args.modes.split(","):
            decoder = runner.batch_decoder(args.clients, runner.artifact.max_context, prefix_cache=cache, slot_passes=mode)
            owner, sent = {}, [0] * args.clients
            mismatches = tokens = 0

            def start(client: int) -> None:
                prompt = clients[client][sent[client] % len(clients[client])]
                sent[client] += 1
                generation = decoder.join(prompt, runner.config(args.max_tokens))
                owner[id(generation)] = (client, prompt, generation)

            for client in range(args.clients):
                start(client)
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < args.seconds:
                for generation in decoder.step():
                    client, prompt, _ = owner.pop(id(generation))
                    out = generation.result().tokens
                    tokens += len(out)
                    mismatches += out != alone[tuple(prompt)]
                    start(client)
            wall = time.perf_counter() - t0
            for _, _, generation in owner.values():  # tokens of the requests still running count too
                tokens += len(generation.output.tokens)
                decoder.leave(generation)
            rate = tokens / wall
            results.setdefault(mode, []).append(rate)
            print(f"{mode:10s} {rate:7.1f} tok/s  slot passes {decoder.slot_passes:4d}  batched passes {decoder.batched_passes:4d}  "
                  f"mismatches {mismatches}", flush=True)
    first = next(iter(results))
    base = sum(results[first]) / len(results[first])
    for mode, rates in results.items():
        mean = sum(rates) / len(rates)
        print(f"mean {mode:10s} {mean:7.1f} tok/s  {mean / base:.2f}x {first}")


if __name__ == "__main__":
    main()
