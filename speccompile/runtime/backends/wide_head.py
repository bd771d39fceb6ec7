"""How the fused CPU graph keeps a position's bits pass-independent at head_dim > 128 (docs/DESIGN.md, "The fused
CPU graph").

ONNX Runtime's CPU GroupQueryAttention multiplies a pass's queries by its keys with one MLAS SGEMM over N = the
pass's key slots (T) and K = head_dim. MLAS works through N in panels of 128 columns and, in a panel of at most 64
columns (the last panel, when T mod 128 is 1..64), through K in one stride instead of strides of 128: with head_dim
256 a score against a key of that panel sums its 256 products in another order. So a row's scores against
the keys of its own 128-slot block depend on where the pass ends: "short" when the pass's last slot E has
E mod 128 <= 63 in the row's block, "long" otherwise (measured on the operator, tests/test_wide_head_rule.py). The
values' SGEMM (K = T, N = head_dim) strides K by 128 from slot 0 whatever T is: a masked key adds an exact zero.

Two ways to make a row's bits its plain decoding's (a one-row pass with attention's padding row, E = p + 1: short
exactly when p mod 128 <= 62):

* **Cuts** (head_dim 256, Gemma 2 / 3): a pass's rows never straddle a cut at slot 63 mod 128. Within a segment
  [128 b + 63, 128 b + 190] a row before 128 (b + 1) ends its pass in a later block (long, as alone) and a row
  after it ends its pass at or before 128 (b + 1) + 63 (short, as alone). `rows_from` says how many rows a pass may
  hold from its first slot; the session splits a pass that would cross a cut, and a generation sizes its drafts
  so that it rarely has to (`Session.pass_rows`). No extra rows.
  head_dim 512 (Gemma 4's full layers) steps the same way with blocks of 64: a row in the first 32 slots of a
  64-slot block is short exactly when its pass ends in those 32 slots (measured on the operator,
  tests/test_wide_head_rule.py), so it cuts at 31 mod 64. A graph with both widths cuts at both (31, 63 and 95
  mod 128): a pass inside a segment of the union is inside a segment of each rule.
* **Lift** (other widths over 128, where neither rule was measured: 160 or 192 on the operator step elsewhere):
  padding rows move every pass's total off a remainder of 1..short modulo block (`attention_lift` [block, short]
  in the manifest), as measured for 256 before the cuts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

UNBOUNDED_ROWS = 1 << 30  # a pass of any size computes its rows' bits as alone (no cut)
CUT_BLOCK = 128  # MLAS SGEMM's column panel
CUT_HALF = 64  # a panel of at most this many columns strides K at once
CUT_BLOCKS = {256: CUT_BLOCK, 512: 64}  # head_dim -> the block its cut rule was measured with (cut at block / 2 - 1)


@dataclass(frozen=True)
class WideHeadRule:
    """A graph's rule for head_dim > 128: `cut_blocks` (head_dim 256: 128, 512: 64; each cuts at block / 2 - 1
    modulo it; (): none) and `lift` (other widths: [block, short] padding rows; (0, 0): none). Neither below 129."""

    cut_blocks: tuple[int, ...] = ()
    lift: tuple[int, int] = (0, 0)

    @classmethod
    def of(cls, recorded_lift: tuple[int, int], head_dims: Iterable[int]) -> "WideHeadRule":
        """The rule for a graph whose layers have `head_dims` and whose manifest records `recorded_lift` (as
        `recorded_lift` reads it; a graph without the padding input records none and gets no rule)."""
        wide = {int(d) for d in head_dims if int(d) > 128}
        if not recorded_lift[0] or not wide:
            return cls()
        blocks = tuple(sorted({CUT_BLOCKS[d] for d in wide if d in CUT_BLOCKS}, reverse=True))
        return cls(cut_blocks=blocks, lift=recorded_lift if wide - CUT_BLOCKS.keys() else (0, 0))

    @property
    def active(self) -> bool:
        """Whether passes need a layout of their own (a batched pass of one row per sequence has none)."""
        return bool(self.cut_blocks or self.lift[0])

    def rows_from(self, start: int) -> int:
        """The most rows a pass whose first row lands at KV slot `start` may hold (up to the next cut)."""
        if not self.cut_blocks:
            return UNBOUNDED_ROWS
        return min(1 + (block // 2 - 2 - start) % block for block in self.cut_blocks)

    def segments(self, start: int, rows: int) -> list[tuple[int, int]]:
        """[a, b) row ranges of a pass of `rows` rows from slot `start`, one per segment between cuts."""
        pieces, a = [], 0
        while a < rows:
            b = min(rows, a + self.rows_from(start + a))
            pieces.append((a, b))
            a = b
        return pieces


def recorded_lift(recorded: list[int] | tuple[int, ...] | None) -> tuple[int, int]:
    """A graph's `attention_lift` as the runtime applies it: manifests exported before the steps at 192 + 256 k
    were found record [256, 64] for head_dim 256, which missed them; modulo 128 covers both (export/fused_ops.py)."""
    block, short = (int(v) for v in recorded or (0, 0))
    return (128, short) if block == 256 else (block, short)


def lift_rows(lift: tuple[int, int], total: int, capacity: int | None = None) -> int:
    """Padding rows that move one sequence's attention total off a remainder of 1..short modulo block (`lift` =
    the graph's `attention_lift` [block, short]; (0, 0): none), 0 where a buffer of `capacity` rows (None: one
    that grows) cannot hold them (export/fused_ops.py `attention_lift`)."""
    block, short = lift
    rest = total % block if block else 0
    if not 1 <= rest <= short or (capacity is not None and total + short + 1 - rest > capacity):
        return 0
    return short + 1 - rest
