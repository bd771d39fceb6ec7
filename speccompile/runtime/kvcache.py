"""KV cache bookkeeping for verify graphs: commit accepted tokens, drop rejected ones, lazily.

The graph appends the q new rows to the cache on every call (`present = concat(past, new)`), so after
a verify step the cache physically holds the rejected candidates too. Instead of copying the cache to
cut them out on every step, this class marks their slots dead; the next attention mask hides dead slots
(positions are explicit inputs, so RoPE does not care where a row lives). Dead rows are squeezed out
("compaction", one gather per layer) only when they exceed `max_dead` or the context limit is near.

What each step copies:
  * accepted step, nothing rejected: nothing on the Python side (the present OrtValues become the past);
  * a step with rejections: nothing until the next compaction;
  * compaction: one gather of the live rows of every layer (the only full-cache copy).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Callable, Sequence

import numpy as np


@lru_cache(maxsize=256)
def causal_mask(q: int) -> np.ndarray:
    """[q, q] bool, row i sees rows 0..i: the new tokens' own mask of a chain step (read-only: shared by every
    caller, built once per q)."""
    mask = np.tril(np.ones((q, q), dtype=bool))
    mask.flags.writeable = False
    return mask


class KVCache:
    """Per-layer key/value tensors plus a liveness mask over physical slots."""

    def __init__(
        self,
        empty: Sequence[Any],
        to_numpy: Callable[[Any], np.ndarray] = np.asarray,
        from_numpy: Callable[[np.ndarray], Any] = lambda a: a,
        max_dead: int = 64,
    ):
        self.tensors: list[Any] = list(empty)
        self.live = np.zeros(0, dtype=bool)
        self._to_numpy = to_numpy
        self._from_numpy = from_numpy
        self.max_dead = max_dead
        self.compactions = 0
        self.row_slots: np.ndarray | None = None  # set by a session that ran the last pass's rows in another order

    def to_numpy(self, tensor: Any) -> np.ndarray:
        """One of `tensors` as a host array (a copy for device tensors)."""
        return self._to_numpy(tensor)

    def from_numpy(self, array: np.ndarray) -> Any:
        """A host array as a tensor of this cache's backend."""
        return self._from_numpy(array)

    @property
    def physical_len(self) -> int:
        return int(self.live.shape[0])

    @property
    def length(self) -> int:
        """Number of committed (live) tokens."""
        return int(self.live.sum())

    @property
    def dead(self) -> int:
        return self.physical_len - self.length

    def attention_mask(self, new_mask: np.ndarray) -> np.ndarray:
        """[1, q, physical_len + q] mask: live past slots + the new tokens' own (causal or tree) mask."""
        q = new_mask.shape[0]
        past = np.broadcast_to(self.live, (q, self.physical_len))
        return np.concatenate([past, new_mask.astype(bool)], axis=1)[None]

    def append(self, presents: Sequence[Any], keep: Sequence[int], num_new: int) -> None:
        """Adopt the graph's present tensors; of the `num_new` new rows only indices in `keep` stay live."""
        self.tensors = list(presents)
        new_live = np.zeros(num_new, dtype=bool)
        if len(keep):
            keep = np.asarray(keep, dtype=np.int64)
            new_live[keep if self.row_slots is None else self.row_slots[keep]] = True
        self.row_slots = None
        self.live = np.concatenate([self.live, new_live])

    def truncate(self, length: int) -> None:
        """Keep only the first `length` live tokens (drop later ones, e.g. after a stop inside a run)."""
        live_idx = np.flatnonzero(self.live)
        self.live[live_idx[length:]] = False

    def maybe_compact(self, incoming: int, max_context: int) -> None:
        """Squeeze dead rows out when there are many, or when `incoming` rows would exceed the limit."""
        if self.dead == 0:
            return
        if self.dead > self.max_dead or self.physical_len + incoming > max_context:
            self.compact()

    def compact(self) -> None:
        """Gather live rows of every layer into a dense cache (one copy of the cache)."""
        idx = np.flatnonzero(self.live)
        if len(idx) == self.physical_len:
            return
        dense_prefix = len(idx) and idx[-1] == len(idx) - 1
        packed = []
        for tensor in self.tensors:
            array = self._to_numpy(tensor)
            array = array[:, :, : len(idx)] if dense_prefix else np.take(array, idx, axis=2)
            packed.append(self._from_numpy(np.ascontiguousarray(array)))
        self.tensors = packed
        self.live = np.ones(len(idx), dtype=bool)
        self.compactions += 1


class BufferKVCache:
    """KV rows in preallocated per-layer buffers that the graph writes in place (the fused ORT CPU graph).

    The graph's `GroupQueryAttention` nodes receive the same buffer as past input and present output and
    write the q new rows at slots [length, length + q). Accepting tokens moves nothing for a chain (the
    accepted rows are already the next slots); rejected rows are simply overwritten by the next step.

    What each step copies:
      * chain step (any number rejected): nothing;
      * tree step: the accepted path's rows that do not already sit at their final slot, one row per layer
        each (at most the tree depth);
      * growing the buffers (capacity doubles, bounded by the context limit): one copy of the cache.
    """

    def __init__(self, shapes: Sequence[tuple[int, int]], dtype, wrap: Callable[[np.ndarray], Any],
                 capacity: int = 256, max_capacity: int | None = None):
        """`shapes`: each buffer's (kv_heads, head_dim) (layers may differ: Gemma 4)."""
        self._shapes = [(int(h), int(d)) for h, d in shapes]
        self._dtype = dtype
        self._wrap = wrap
        self.max_capacity = max_capacity
        self.length = 0
        self.compactions = 0
        self.row_slots: np.ndarray | None = None  # set by a session that ran the last pass's rows in another order
        self.binding: Any = None  # the session's I/O binding over these buffers (rebuilt when they grow)
        self.arrays: list[np.ndarray] = []
        self.tensors: list[Any] = []
        self.fixed = False  # views into a shared buffer (a slot of a batch): never reallocated
        self._allocate(capacity)

    @classmethod
    def over(cls, arrays: list[np.ndarray], wrap: Callable[[np.ndarray], Any]) -> "BufferKVCache":
        """An empty cache over existing [1, kv_heads, capacity, head_dim] arrays (one slot of a batched
        buffer); it cannot grow past their capacity."""
        cache = cls.__new__(cls)
        cache._shapes, cache._dtype, cache._wrap = [(a.shape[1], a.shape[3]) for a in arrays], arrays[0].dtype, wrap
        cache.max_capacity, cache.length, cache.compactions, cache.binding, cache.fixed = arrays[0].shape[2], 0, 0, None, True
        cache.row_slots = None
        cache.point_at(arrays)
        return cache

    def point_at(self, arrays: list[np.ndarray]) -> None:
        """Use `arrays` (holding this cache's rows already) from now on (a batch slot that moved)."""
        self.arrays = list(arrays)
        self.tensors = [self._wrap(a) for a in self.arrays]
        self.binding = None

    def _allocate(self, capacity: int) -> None:
        old = self.arrays
        self.arrays = [np.zeros((1, heads, capacity, dim), dtype=self._dtype) for heads, dim in self._shapes]
        for new, previous in zip(self.arrays, old):
            new[:, :, : self.length] = previous[:, :, : self.length]
        self.tensors = [self._wrap(a) for a in self.arrays]  # OrtValues viewing the numpy memory

    @property
    def capacity(self) -> int:
        return int(self.arrays[0].shape[2]) if self.arrays else 0

    @property
    def dead(self) -> int:
        return 0

    def reserve(self, total: int) -> None:
        """Make room for `total` rows (doubling, so growth copies the cache O(log n) times)."""
        if total <= self.capacity:
            return
        if self.fixed:
            raise ValueError(f"a batch slot holds {self.capacity} KV rows, {total} needed")
        capacity = max(total, 2 * self.capacity)
        if self.max_capacity:
            capacity = max(total, min(capacity, self.max_capacity))
        self._allocate(capacity)

    def attention_mask(self, new_mask: np.ndarray) -> np.ndarray:
        """[1, q, length + q]: every committed row is visible; the new tokens' own (causal or tree) mask."""
        q = new_mask.shape[0]
        return np.concatenate([np.ones((q, self.length), dtype=bool), new_mask.astype(bool)], axis=1)[None]

    def append(self, presents: Sequence[Any], keep: Sequence[int], num_new: int) -> None:
        """The graph wrote `num_new` rows at [length, ...); commit those in `keep` (ascending) as the next slots."""
        slots = self.row_slots
        self.row_slots = None
        for slot, source in enumerate(int(k if slots is None else slots[k]) for k in keep):
            if source != slot:
                for array in self.arrays:
                    array[:, :, self.length + slot] = array[:, :, self.length + source]
        self.length += len(keep)

    def truncate(self, length: int) -> None:
        """Keep only the first `length` tokens."""
        self.length = min(self.length, int(length))

    def maybe_compact(self, incoming: int, max_context: int) -> None:
        """Nothing to squeeze: rejected rows never stay in the buffer."""
