"""How the fused CPU graph keeps a position's bits pass-independent at head_dim > 128 (docs/DESIGN.md, "The fused
CPU graph").

ONNX Runtime's CPU GroupQueryAttention multiplies a pass's queries by its keys with one MLAS SGEMM over N = the
pass's key slots and K = head_dim. At head_dim > 128 MLAS sums a score's products in an order chosen per panel of
key slots, and the last panel's width follows the pass's last slot E: a row's scores against the keys of its own
block depend on which class E falls in. The blocks and classes depend on the kernel MLAS picks for the CPU, so
they are measured on the machine (backends/wide_head_probe.py `measured_cuts`: within a block of B slots,
thresholds t_1 < ... < t_m; AMD EPYC: B = 128, t = 64 at head_dim 256 and B = 64, t = 32 at 512; Intel Xeon with
AMX: B = 256, t = 64 at 256 and B = 128, t = 32, 64 at 512). The values' SGEMM (K = the slots, N = head_dim)
strides K from slot 0 whatever E is: a masked key adds an exact zero.

Two ways to make a row's bits its plain decoding's (a one-row pass with attention's padding row, E = p + 1):

* **Cuts** (every head_dim over 128: Gemma 2 / 3 / 4's 256 and 512, Qwen3-Next's 256, 160, 192, ...): a pass's
  rows never straddle a cut at slot t - 1 modulo B for a measured `(B, t)`. A row in the segment between two cuts
  is alone in the class its segment's end gives (a row before the segment's block end is in the last class
  whatever its pass, one after it ends its pass at or before the next cut, in the class of its own plain pass).
  `rows_from` says how many rows a pass may hold from its first slot; the session splits a pass that would cross
  a cut, and a generation sizes its drafts so that it rarely has to (`Session.pass_rows`). No extra rows. A graph
  with several widths cuts at the union; where the operator follows no such rule (`measured_cuts` None) every
  pass is one row.
* **Lift** (`lift`, [block, short] padding rows that move every pass's total off a remainder of 1..short modulo
  block: the graphs' `attention_lift`): what the runtime did for widths other than 256 before every width was
  measured. It no longer chooses it (on the Xeon the 128-slot lift leaves head_dim 192 inexact: its blocks are
  341 slots); the slotted graph and `benchmarks/wide_head_gaps.py` still take it when set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from .wide_head_probe import measured_cuts

UNBOUNDED_ROWS = 1 << 30  # a pass of any size computes its rows' bits as alone (no cut)


@dataclass(frozen=True)
class WideHeadRule:
    """A graph's rule for head_dim > 128: `cuts` ((block, threshold) pairs: a cut at threshold - 1 modulo block;
    (): none), `one_row` (a width whose operator follows no measured rule: every pass one row) and `lift`
    ([block, short] padding rows, set by hand only; (0, 0): none). None below 129."""

    cuts: tuple[tuple[int, int], ...] = ()
    lift: tuple[int, int] = (0, 0)
    one_row: bool = False

    @classmethod
    def of(cls, recorded_lift: tuple[int, int], head_dims: Iterable[int], threads: int) -> "WideHeadRule":
        """The rule for a graph whose layers have `head_dims`, run with `threads` threads: every width over 128
        measured (`measured_cuts`). `recorded_lift` is the manifest's (as `recorded_lift` reads it): a graph
        without the padding input records none and gets no rule."""
        wide = {int(d) for d in head_dims if int(d) > 128}
        if not recorded_lift[0] or not wide:
            return cls()
        measured = [measured_cuts(d, threads) for d in sorted(wide)]
        return cls(cuts=tuple(sorted({cut for found in measured if found for cut in found})), one_row=None in measured)

    @property
    def active(self) -> bool:
        """Whether passes need a layout of their own (a batched pass of one row per sequence has none)."""
        return bool(self.cuts or self.lift[0] or self.one_row)

    def rows_from(self, start: int) -> int:
        """The most rows a pass whose first row lands at KV slot `start` may hold (up to the next cut)."""
        if self.one_row:
            return 1
        if not self.cuts:
            return UNBOUNDED_ROWS
        return min(1 + (threshold - 2 - start) % block for block, threshold in self.cuts)

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
