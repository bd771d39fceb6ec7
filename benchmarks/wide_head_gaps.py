#!/usr/bin/env python
"""Ways to keep a head_dim > 128 position's bits pass-independent on the fused CPU graph (docs/DESIGN.md).

The runtime cuts head_dim-256 passes at slots 63 mod 128 (`WideHeadRule`, runtime/backends/wide_head.py) and lifts
other widths with padding rows off a remainder of 1..short modulo block (`attention_lift`). Per prompt length, a
position's logits in chain passes of q rows against q = 1, in four layouts:

  cuts   the cut rule (a pass that straddles a cut runs split);
  rows   the lift (padding rows);
  gap    before a pass whose total would be short, 65 - remainder dead slots (where depends on the passes);
  fixed  dead slots at places fixed by the position (block k - 1 .. block k + short - 1), passes cut there.

"=" where every position is the same bits as in one-row passes, else the largest difference and the positions.

  python benchmarks/wide_head_gaps.py ARTIFACT --threads 1     # e.g. /tmp/gemma-peer/int4
"""

from __future__ import annotations

import argparse

import numpy as np

from speccompile.runtime.artifact import open_artifact
from speccompile.runtime.backends.wide_head import WideHeadRule

CUT_BLOCK, CUT_HALF = 128, 64  # the padding-row layouts' block (the rule measured first, on an AMD EPYC)


def _dead(slot: int, block: int, short: int) -> bool:
    """`fixed`: slot in block k - 1 .. block k + short - 1 (the first block: 0 .. short - 1)."""
    rest = slot % block
    return rest < short or (rest == block - 1 and slot >= block - 1)


def decode(session, prompt: np.ndarray, tokens: np.ndarray, q: int, layout: str) -> np.ndarray:
    """Prefill `prompt`, decode `tokens` in passes of q rows in `layout`; every token row's logits."""
    rule = session.wide
    block, short = CUT_BLOCK, CUT_HALF
    session.wide = {"cuts": rule if rule.cuts else WideHeadRule(cuts=((block, short),)), "rows": WideHeadRule(lift=(block, short))}.get(layout, WideHeadRule())
    cache = session.new_cache(capacity=4096)
    live: list[bool] = []
    seq = np.concatenate([prompt, tokens])
    starts = [0, len(prompt), *range(len(prompt) + q, len(seq), q)]
    logits = []
    try:
        for a, b in zip(starts, [*starts[1:], len(seq)]):
            while a < b:
                n = b - a
                if layout == "fixed":
                    while _dead(len(live), block, short):
                        live.append(False)
                    n = next((i for i in range(1, n + 1) if _dead(len(live) + i - 1, block, short)), n + 1) - 1
                elif layout == "gap":
                    rest = (len(live) + n + (n == 1)) % block
                    if 1 <= rest <= short:
                        live += [False] * (short + 1 - rest)
                cache.length = len(live)
                own = np.tril(np.ones((n, n), bool))
                mask = np.concatenate([np.broadcast_to(np.array(live, bool), (n, len(live))), own], 1)[None]
                out = session.run(seq[a: a + n], np.arange(a, a + n), mask, cache)
                cache.append(out.presents, range(n), n)
                live += [True] * n
                if a + n > len(prompt):
                    logits.append(out.logits[max(0, len(prompt) - a):])
                a += n
    finally:
        session.wide = rule
    return np.concatenate(logits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--lengths", type=int, nargs="+", default=[52, 244, 250, 314, 430])
    parser.add_argument("--tokens", type=int, default=24)
    args = parser.parse_args()
    session = open_artifact(args.artifact, threads=args.threads).target
    if not session.wide.active:
        raise SystemExit(f"{args.artifact}: no attention_lift (head_dim <= 128)")
    rng = np.random.default_rng(3)
    vocab = int(session.spec.outputs[0].shape[-1])
    for length in args.lengths:
        prompt, tokens = rng.integers(3, min(vocab, 2000), length), rng.integers(3, min(vocab, 2000), args.tokens)
        for layout in ("cuts", "rows", "gap", "fixed"):
            one = decode(session, prompt, tokens, 1, layout)
            cells = []
            for q in (2, 3, 5, 8):
                other = decode(session, prompt, tokens, q, layout)
                rows = np.flatnonzero((other != one).any(1))
                cells.append("=" if not len(rows) else f"{np.abs(other - one).max():.1e} at {rows[0]}..{rows[-1]}")
            print(f"prompt {length:4d} {layout:5s} q=2,3,5,8: {' | '.join(cells)}", flush=True)


if __name__ == "__main__":
    main()
