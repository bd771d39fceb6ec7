"""The suffix drafter's global store at scale: memory and per-token update time with N cached responses.

Synthetic agent traces (deterministic): each response is a tool call / SQL / code-edit template whose slots
are filled with random tokens from a 49k vocabulary (SmolLM2's size), so responses share structure and differ
in their values, as agent outputs do; `--random` makes every token random (the worst case: nothing shared).
Responses are added token by token (as generation adds them) into a store of `--requests` responses (FIFO);
then `--extra` more responses are added so that every one evicts the oldest. Reported: resident memory growth
of the process, the store's own estimate (`SuffixCache.memory_bytes`), microseconds per appended token (at
the cap: one append plus the eviction's share), ms per eviction, and ms per speculation against the full store.

    python benchmarks/suffix_scale.py --requests 10000 --tokens 200
"""

from __future__ import annotations

import argparse
import json
import random
import time

from speccompile.runtime.suffix_cache import SuffixCache

VOCAB = 49152
TEMPLATES = 24  # distinct response skeletons
SLOTS = 6  # random values per response


def resident_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def responses(count: int, length: int, seed: int, all_random: bool):
    """`count` token lists of `length` tokens: template skeletons with random slot values (or all random)."""
    rng = random.Random(seed)
    skeletons = [[rng.randrange(VOCAB) for _ in range(length)] for _ in range(TEMPLATES)]
    for _ in range(count):
        if all_random:
            yield [rng.randrange(VOCAB) for _ in range(length)]
            continue
        out = list(rng.choice(skeletons))
        for _ in range(SLOTS):
            at = rng.randrange(length - 4)
            out[at: at + 4] = [rng.randrange(VOCAB) for _ in range(4)]
        yield out


def add(cache: SuffixCache, tokens: list[int], step: int = 4) -> float:
    """One response, added as a server adds it: a few tokens per round; the seconds its `open` took (at the
    cap: the eviction of the oldest response)."""
    t0 = time.perf_counter()
    response = cache.open("agent")
    opened = time.perf_counter() - t0
    for at in range(0, len(tokens), step):
        cache.append(response, tokens[at: at + step])
    return opened


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10000)
    parser.add_argument("--tokens", type=int, default=200, help="tokens per response")
    parser.add_argument("--extra", type=int, default=500, help="responses added at the cap (each evicts one)")
    parser.add_argument("--max-depth", type=int, default=24)
    parser.add_argument("--random", action="store_true", help="all-random tokens (nothing shared between responses)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    cache = SuffixCache(args.requests, args.max_depth)
    stream = responses(args.requests + args.extra, args.tokens, args.seed, args.random)
    before = resident_bytes()
    t0 = time.perf_counter()
    for _ in range(args.requests):
        add(cache, next(stream))
    fill_s = time.perf_counter() - t0
    grown = resident_bytes() - before
    t0 = time.perf_counter()
    evict_s = sum(add(cache, next(stream)) for _ in range(args.extra))
    capped_s = time.perf_counter() - t0
    tree = cache.tree_of("agent")
    contexts = list(responses(200, args.tokens, args.seed, args.random))
    t0 = time.perf_counter()
    for tokens in contexts:
        tree.speculate(tokens[: args.tokens // 2], 24)
    speculate_ms = 1000 * (time.perf_counter() - t0) / len(contexts)
    print(json.dumps({
        "requests": cache.requests, "tokens": cache.tokens, "max_depth": args.max_depth, "random": args.random,
        "resident_growth_mb": round(grown / 2**20, 1), "estimated_mb": round(cache.memory_bytes() / 2**20, 1),
        "us_per_token_filling": round(1e6 * fill_s / (args.requests * args.tokens), 2),
        "us_per_token_at_cap": round(1e6 * capped_s / (args.extra * args.tokens), 2),
        "ms_per_eviction": round(1000 * evict_s / max(args.extra, 1), 3),
        "ms_per_speculation": round(speculate_ms, 3),
    }, indent=1))


if __name__ == "__main__":
    main()
