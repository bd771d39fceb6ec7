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
* **Lift** (other widths over 128, where the operator steps elsewhere: 512 at 32 and 64, and neither rule
  predicts 160 or 192 on the operator): padding rows move every pass's total off a remainder of 1..short modulo
  block (`attention_lift` [block, short] in the manifest), as measured for 256 before the cuts.
"""

from __future__ import annotations

from dataclasses import dataclass

UNBOUNDED_ROWS = 1 << 30  # a pass of any size computes its rows' bits as alone (no cut)
CUT_BLOCK = 128  # MLAS SGEMM's column panel
CUT_HALF = 64  # a panel of at most this many columns strides K at once
CUT_HEAD_DIM = 256  # the head_dim the cut rule was measured for (K = 2 x 128: two strides, or one)


@dataclass(frozen=True)
class WideHeadRule:
    """A graph's rule for head_dim > 128: `cut_block` (head_dim 256: cuts at CUT_HALF - 1 modulo it; 0: none) or
    `lift` (other widths: [block, short] padding rows; (0, 0): none). Neither below 129."""

    cut_block: int = 0
    lift: tuple[int, int] = (0, 0)

    @classmethod
    def of(cls, recorded_lift: tuple[int, int], head_dim: int) -> "WideHeadRule":
        """The rule for a graph of `head_dim` whose manifest records `recorded_lift` (as `recorded_lift` reads it)."""
        if not recorded_lift[0]:
            return cls()
        if head_dim == CUT_HEAD_DIM:
            return cls(cut_block=CUT_BLOCK)
        return cls(lift=recorded_lift)

    @property
    def active(self) -> bool:
        """Whether passes need a layout of their own (a batched pass of one row per sequence has none)."""
        return bool(self.cut_block or self.lift[0])

    def rows_from(self, start: int) -> int:
        """The most rows a pass whose first row lands at KV slot `start` may hold (up to the next cut)."""
        if not self.cut_block:
            return UNBOUNDED_ROWS
        cut = CUT_HALF - 1
        return 1 + (cut - start - 1) % self.cut_block

    def segments(self, start: int, rows: int) -> list[tuple[int, int]]:
        """[a, b) row ranges of a pass of `rows` rows from slot `start`, one per segment between cuts."""
        pieces, a = [], 0
        while a < rows:
            b = min(rows, a + self.rows_from(start + a))
            pieces.append((a, b))
            a = b
        return pieces
