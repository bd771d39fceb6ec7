"""The cache of a hybrid linear-attention target (Qwen3-Next, Qwen3.5): KV rows for its attention layers, the
committed (conv, recurrent) states for its gated delta net layers (docs/DESIGN.md, "Hybrid linear attention").

The contract graph takes each linear layer's states as of the last committed token (`past_state.{i}.conv`,
`past_state.{i}.recurrent`) and returns its states after each row of the pass (`present_state.{i}.*`, [1, q, ...]),
every row computed by the same per-token ops whatever the pass's length. Committing k accepted rows of a chain
takes the states of row k - 1, so the committed states are bitwise those plain decoding (one row a pass) reaches;
rejected rows cost nothing to drop. A state cannot be rolled back, so only chains commit (accepted rows 0..k-1):
tree drafters and batched decoding are refused for such targets (`hybrid_problem`).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from ..errors import UnsupportedError
from ..manifest import GraphSpec, Manifest
from .kvcache import BufferKVCache, KVCache

HYBRID_DRAFTERS = ("ngram", "none", "draft-model")  # what a hybrid target drafts with: chains (artifact.CHAIN_DRAFTERS)
_NP = {"float32": np.float32, "float16": np.float16}


def state_inputs(spec: GraphSpec) -> list[int]:
    """Positions, among the graph's cache inputs (past_key_values.* and past_state.*, in order), of the states."""
    cache = [t.name for t in spec.inputs if t.name.startswith(("past_key_values.", "past_state."))]
    return [k for k, name in enumerate(cache) if name.startswith("past_state.")]


def is_hybrid(manifest: Manifest) -> bool:
    """Whether the artifact's target holds recurrent states (hybrid linear attention)."""
    return "target" in manifest.graphs and bool(state_inputs(manifest.graphs["target"]))


def check_hybrid_run(manifest: Manifest, backend: str, drafter: str, where: str, shape_invariant: bool | int = False) -> None:
    """UnsupportedError (one line) unless a hybrid target runs on ort-cpu, its passes as given, with a chain drafter."""
    if not is_hybrid(manifest):
        return
    if backend != "ort-cpu":
        raise UnsupportedError(f"{where}: a hybrid linear-attention target runs on backend ort-cpu only", "backend")
    if shape_invariant:  # padding rows would run through the recurrence and be cut out of the states as KV rows
        raise UnsupportedError(f"{where}: shape_invariant: a hybrid linear-attention target runs its passes as given "
                               "(its rows are the same bits in every pass on ort-cpu already)", "shape_invariant")
    if drafter not in HYBRID_DRAFTERS:
        raise UnsupportedError(f"{where}: drafter {drafter}: a hybrid linear-attention target verifies chains only "
                               f"(its recurrent state cannot branch): use {', '.join(HYBRID_DRAFTERS)}", "drafter")


def with_zero_states(kv: list[Any], spec: GraphSpec, wrap: Callable[[np.ndarray], Any]) -> list[Any]:
    """The empty KV buffers `kv` with each state input's zeros (the states before the first token) in its place."""
    cache = [t for t in spec.inputs if t.name.startswith(("past_key_values.", "past_state."))]
    out = list(kv)
    for k in state_inputs(spec):
        out.insert(k, wrap(np.zeros([1, *cache[k].shape[1:]], dtype=_NP.get(cache[k].dtype, np.float32))))
    return out


class StateCache(KVCache):
    """A KVCache whose tensors at `states` are a linear layer's states instead of KV rows: appended by taking the
    last accepted row's states, never compacted or truncated row by row."""

    def __init__(self, empty: Sequence[Any], states: Sequence[int], to_numpy: Callable[[Any], np.ndarray],
                 from_numpy: Callable[[np.ndarray], Any], max_dead: int = 0):
        super().__init__(empty, to_numpy, from_numpy, max_dead)
        self.states = frozenset(states)

    def append(self, presents: Sequence[Any], keep: Sequence[int], num_new: int) -> None:
        """The KV rows as KVCache; each state: the one after the last kept row (a chain: rows 0..k-1)."""
        keep = [int(k) for k in keep]
        if keep != list(range(len(keep))):
            raise ValueError(f"a hybrid linear-attention cache commits chains only (rows {keep} kept)")
        old = self.tensors
        super().append(presents, keep, num_new)
        for k in self.states:
            if not keep:
                self.tensors[k] = old[k]
            else:
                rows = self.to_numpy(presents[k])
                self.tensors[k] = self.from_numpy(np.ascontiguousarray(rows[:, keep[-1]]))

    def truncate(self, length: int) -> None:
        """KV rows past `length` dropped; the states cannot roll back: only the end of a generation truncates."""
        super().truncate(length)

    def compact(self) -> None:
        """Gather live KV rows (the states are not rows)."""
        idx = np.flatnonzero(self.live)
        if len(idx) == self.physical_len:
            return
        for k, tensor in enumerate(self.tensors):
            if k not in self.states:
                self.tensors[k] = self.from_numpy(np.ascontiguousarray(np.take(self.to_numpy(tensor), idx, axis=2)))
        self.live = np.ones(len(idx), dtype=bool)
        self.compactions += 1


class BufferStateCache(BufferKVCache):
    """The fused CPU graph's cache of a hybrid target: KV buffers written in place (BufferKVCache) and each linear
    layer's committed states. A pass binds the states it starts from and fresh per-row outputs (`bind_states`); a
    pass cut in segments (head_dim > 128) starts each segment from the previous one's last row and gathers their
    rows (`record`); the verdict keeps the last accepted row's states (`append`)."""

    def __init__(self, spec: GraphSpec, shapes: Sequence[tuple[int, int]], dtype, wrap: Callable[[np.ndarray], Any],
                 capacity: int, max_capacity: int | None):
        super().__init__(shapes, dtype, wrap, capacity=capacity, max_capacity=max_capacity)
        inputs = {t.name: t for t in spec.inputs if t.name.startswith("past_state.")}
        self.committed = {name: np.zeros([1, *(int(d) for d in t.shape[1:])], dtype=_NP.get(t.dtype, np.float32))
                          for name, t in inputs.items()}
        self.rows: dict[str, np.ndarray] = {}  # past_state name -> the current pass's per-row states [1, rows, ...]

    def start_pass(self) -> None:
        """A new pass: its rows start from the committed states."""
        self.rows = {}

    def bind_states(self, binding: Any, q: int) -> dict[str, np.ndarray]:
        """Bind the states this (segment of a) pass starts from, and arrays for its q rows' states; returns those."""
        outputs = {}
        for name, state in self.committed.items():
            start = state if name not in self.rows else self.rows[name][:, -1]
            binding.bind_cpu_input(name, np.ascontiguousarray(start))
            outputs[name] = np.empty((1, q, *state.shape[1:]), dtype=state.dtype)
            binding.bind_ortvalue_output(name.replace("past_state.", "present_state.", 1), self._wrap(outputs[name]))
        return outputs

    def record(self, outputs: dict[str, np.ndarray]) -> None:
        """A (segment of a) pass's per-row states, after the rows before it."""
        self.rows = {name: rows if name not in self.rows else np.concatenate([self.rows[name], rows], axis=1)
                     for name, rows in outputs.items()}

    def append(self, presents: Sequence[Any], keep: Sequence[int], num_new: int) -> None:
        """The KV rows as BufferKVCache; each state: the one after the last kept row (a chain: rows 0..k-1)."""
        keep = [int(k) for k in keep]
        if keep != list(range(len(keep))):
            raise ValueError(f"a hybrid linear-attention cache commits chains only (rows {keep} kept)")
        super().append(presents, keep, num_new)
        if keep:
            self.committed = {name: np.ascontiguousarray(rows[:, keep[-1]]) for name, rows in self.rows.items()}
        self.rows = {}
