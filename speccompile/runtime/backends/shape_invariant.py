"""Shape-invariant verification: every decode pass of the target has the same shapes.

Speculative decoding is exact with respect to the logits the verifier computes. On a GPU the logits of a
row also depend on the shape of the pass it was computed in: kernels, tile sizes and split-K / split-KV
reduction orders are chosen from the number of rows (q) and the KV length, so a near-tie can flip between
plain decoding (q = 1) and a verify pass (q = k + 1, a tree). This wrapper makes both compute every row
with the same shapes:

* **rows**: every pass with q <= `rows` real rows runs as exactly `rows` rows (the artifact's
  `max_verify_tokens` by default, so plain decoding, chains and trees all share it). Padding rows repeat
  the last real token and position and attend only to their own slot (finite, never seen by a real row:
  real rows' masks do not include them). Logits / hidden states are sliced back to the q real rows.
  Prompt chunks longer than `rows` run unpadded (they are the same for plain and speculative runs).
* **KV length**: the attention always sees the same KV extent.
  - Fused graph (buffer KV, GroupQueryAttention): one buffer of `max_context + rows` slots allocated up
    front, never grown (bounded by the graph's rotary tables, `kv_capacity` in its manifest entry: export
    writes `max_context + max_verify_tokens`; an older artifact pads less in its last passes); `total_sequence_length` is that capacity every pass and the additive
    `attention_bias` covers it (slots past the new rows masked). `seqlens_k` still says where the pass's
    rows go (`length + rows - 1`, as for one sequence of a padded batch). Every committed row sits at
    slot == position, in plain and speculative runs alike.
  - Contract graph (KV concatenated inside the graph): the new rows always follow the past, so a fixed
    KV length and "every key at slot == position" cannot both hold. Padding the past with dead rows to a
    fixed length was measured to break the second, and with it plain == chain even on ONNX Runtime CPU
    (docs/gpu.md). This mode keeps slot == position instead (rejected rows are squeezed out before each
    pass, one gather of the cache) and fixes the rows; the KV length grows with the context, as in plain
    decoding. The padding rows' KV is cut out after the pass (one host copy of the cache).

Trees run main path first (`tree_layout.MainPathLayout`): those rows are marked `plain_exact`, and the
loop cuts a verdict at the first accepted node off the main path (`verification.exact_acceptance`).

Rejected and padding rows' KV lands in slots that are never committed (buffer: overwritten by the next
pass; concat: cut out or marked dead by the cache), so the cache holds exactly what plain decoding writes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import InputError
from ..kvcache import BufferKVCache, KVCache
from .base import Session, StepOutput
from .tree_layout import MainPathLayout


class ShapeInvariantSession:
    """Runs every pass of `inner` with `rows` query rows, every key at slot == position and, on the fused
    graph, a fixed KV extent (see the module doc)."""

    row_invariant = False  # its passes pad to `rows`, a prefill chunk runs unpadded: not claimed

    def __init__(self, inner: Session, rows: int, max_context: int):
        if rows < 1:
            raise InputError(f"shape_invariant: the fixed number of rows must be >= 1, got {rows}", "shape_invariant")
        self.inner = inner
        self.spec = inner.spec
        self.rows = int(rows)
        self.max_context = int(max_context)
        self.buffer = inner.spec.extra.get("kv_layout") == "buffer"

    @property
    def max_caches(self) -> int | None:
        """The wrapped session's (backends/base.py)."""
        return self.inner.max_caches

    @property
    def capacity(self) -> int:
        """KV slots every pass sees: the context plus one pass of rows (the padding rows' slots), as far as
        the graph allows (the fused graph's rotary tables bound GroupQueryAttention's total length)."""
        wanted = self.max_context + self.rows
        return min(wanted, int(self.spec.extra.get("kv_capacity", self.max_context))) if self.buffer else wanted

    def pass_rows(self, start: int) -> int:
        """The wrapped session's (backends/base.py)."""
        return self.inner.pass_rows(start)

    def new_cache(self) -> KVCache | BufferKVCache:
        if self.buffer:
            return self.inner.new_cache(capacity=self.capacity)
        return self.inner.new_cache()

    def run(self, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray, cache,
            last_logits_only: bool = False) -> StepOutput:
        """One pass; a tree's rows run main path first (`cache.row_slots` tells the cache where each row
        went) and `plain_exact` marks the rows computed exactly as plain decoding computes them. Every row's
        logits come back (`last_logits_only` is not used: the pass keeps its fixed shapes)."""
        q = int(np.asarray(input_ids).size)
        rows = max(self.rows, q)
        layout = MainPathLayout.of(attention_mask, q)
        attention_mask = layout.mask(attention_mask)
        ids = self.pad_tokens(layout.rows(np.asarray(input_ids, dtype=np.int64)), rows)
        positions = _pad(layout.rows(np.asarray(position_ids, dtype=np.int64)), rows)
        if self.buffer:
            out = self._run_buffer(ids, positions, attention_mask, cache, q, rows)
        else:
            out = self._run_concat(ids, positions, attention_mask, cache, q, rows)
        return layout.restore(out, cache)

    def pad_tokens(self, input_ids: np.ndarray, rows: int) -> np.ndarray:
        """The pass's token ids padded to `rows` (padding rows repeat the last token)."""
        return _pad(input_ids, rows)

    def _run_buffer(self, ids, positions, attention_mask, cache: BufferKVCache, q: int, rows: int) -> StepOutput:
        length = cache.length
        if length + rows > self.capacity:  # an artifact exported without room for the padding rows: the
            rows = max(q, self.capacity - length)  # last passes before the context end are not padded fully
            ids, positions = ids[:rows], positions[:rows]
        mask = np.zeros((1, rows, self.capacity), dtype=bool)
        mask[0, :q, : attention_mask.shape[-1]] = attention_mask[0]
        pad = np.arange(q, rows)
        mask[0, pad, length + pad] = True  # padding rows see only their own slot
        return self.inner.run(ids, positions, mask, cache)

    def _run_concat(self, ids, positions, attention_mask, cache: KVCache, q: int, rows: int) -> StepOutput:
        physical = cache.physical_len
        new_mask = attention_mask[0, :, physical:]
        cache.compact()  # rejected rows out: every key at slot == position, as in plain decoding
        past = cache.physical_len
        mask = np.zeros((1, rows, past + rows), dtype=bool)
        mask[0, :q, :past] = True
        mask[0, :q, past: past + q] = new_mask
        pad = np.arange(q, rows)
        mask[0, pad, past + pad] = True  # padding rows see only their own slot
        out = self.inner.run(ids, positions, mask, cache)
        presents = [_cut(cache, tensor, past + q) for tensor in out.presents]  # the padding rows' KV out again
        return StepOutput(logits=out.logits, presents=presents, hidden=out.hidden)


def _cut(cache: KVCache, tensor: Any, rows: int) -> Any:
    """The first `rows` KV rows of a present tensor."""
    return cache.from_numpy(np.ascontiguousarray(cache.to_numpy(tensor)[:, :, :rows]))


def _pad(values: np.ndarray, rows: int) -> np.ndarray:
    """`values` followed by copies of its last element up to `rows` entries."""
    values = values.reshape(-1)
    if values.size >= rows:
        return values
    return np.concatenate([values, np.full(rows - values.size, values[-1], dtype=values.dtype)])
