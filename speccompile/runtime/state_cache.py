"""The cache of a hybrid linear-attention target (Qwen3-Next, Qwen3.5): KV rows for its attention layers, and for
each gated delta net layer its (conv, recurrent) states plus the *pending rows* (docs/DESIGN.md, "Hybrid linear
attention").

A linear layer's state cannot be rolled back, so a pass never commits its own rows: it takes the states as of some
token (`past_state.{i}.conv`, `past_state.{i}.recurrent`) and the accepted rows after it that are not folded in yet
(`past_state.{i}.rows`: each row's conv input, b and a), first folds those rows in, one token at a time (their states
out: `present_state.{i}.conv` / `.recurrent`), then runs its own rows from there and returns their inputs
(`present_state.{i}.rows`). Committing k accepted rows keeps the folded states and the pass's first k rows as the
next pending rows, so the states are always plain decoding's bits: every row goes through the same per-token ops,
whatever pass it comes in (plain decoding: one pending row a pass); rejected rows cost nothing to drop. There is
always a pending row (the first pass's: a zero row, which leaves the zero states zero). Only chains
commit (accepted rows 0..k-1): trees and padded passes are refused for such targets (a head drafts `--tree chain`,
without the n-gram lookup branch; the suffix drafter drafts chains: `Runner`), and the batch decoder runs one pass
per request (`Runner.batch_problem`).

A target with no attention layer at all (pure Mamba-2, an all-recurrent hybrid) has states alone and no KV input: the
caches hold no KV tensor and count the committed tokens themselves (`StateCache`: KVCache's liveness mask over the
pass rows, `BufferStateCache`: BufferKVCache's `length`), which the positions and the graphs' length inputs come from.
Its graphs still declare attention's inputs (`attention_mask`; the fused graph's `attention_bias`, `seqlens_k`,
`total_sequence_length`, `attention_pad`), unread: the runtime binds them as for any target and ONNX Runtime takes them.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from ..errors import UnsupportedError
from ..manifest import GraphSpec, Manifest
from .kvcache import BufferKVCache, KVCache

_NP = {"float32": np.float32, "float16": np.float16}


def state_inputs(spec: GraphSpec, rows: bool = False) -> list[int]:
    """Positions, among the graph's cache inputs (past_key_values.* and past_state.*, in order), of the states and
    pending rows (`rows`: of the pending rows alone)."""
    cache = [t.name for t in spec.inputs if t.name.startswith(("past_key_values.", "past_state."))]
    return [k for k, name in enumerate(cache) if name.startswith("past_state.") and (not rows or name.endswith(".rows"))]


def is_hybrid(manifest: Manifest) -> bool:
    """Whether the artifact's target holds recurrent states (hybrid linear attention)."""
    return "target" in manifest.graphs and bool(state_inputs(manifest.graphs["target"]))


def check_hybrid_run(manifest: Manifest, backend: str, drafter: str, where: str, shape_invariant: bool | int = False,
                     chain: bool = True) -> None:
    """UnsupportedError (one line) unless a hybrid target runs on ort-cpu, its passes as given, drafting chains
    (`chain`: what `drafter` drafts is one path, `DraftConfig.is_chain`; a head's tree is refused)."""
    if not is_hybrid(manifest):
        return
    if backend != "ort-cpu":
        raise UnsupportedError(f"{where}: a hybrid linear-attention target runs on backend ort-cpu only", "backend")
    if shape_invariant:  # padding rows would run through the recurrence and be cut out of the states as KV rows
        raise UnsupportedError(f"{where}: shape_invariant: a hybrid linear-attention target runs its passes as given "
                               "(its rows are the same bits in every pass on ort-cpu already)", "shape_invariant")
    if not chain:
        raise UnsupportedError(f"{where}: tree: drafter {drafter}: a hybrid linear-attention target verifies chains only "
                               "(its recurrent state cannot branch): draft with --tree chain", "tree")


def zero_state(spec: Any) -> np.ndarray:
    """A state input's value before the first token, batch 1: zero states and one zero pending row (ONNX Runtime's
    Scan takes no empty sequence; a zero row leaves zero states zero, bit for bit: its conv input, q, k, v are 0)."""
    return np.zeros([1, *(1 if isinstance(d, str) else int(d) for d in spec.shape[1:])], dtype=_NP.get(spec.dtype, np.float32))


def with_zero_states(kv: list[Any], spec: GraphSpec, wrap: Callable[[np.ndarray], Any]) -> list[Any]:
    """The empty KV buffers `kv` with each state input's value before the first token in its place."""
    cache = [t for t in spec.inputs if t.name.startswith(("past_key_values.", "past_state."))]
    out = list(kv)
    for k in state_inputs(spec):
        out.insert(k, wrap(zero_state(cache[k])))
    return out


def _chain(keep: Sequence[int]) -> int:
    """How many rows a verdict keeps; ValueError unless they are the pass's first rows (a chain)."""
    keep = [int(k) for k in keep]
    if keep != list(range(len(keep))):
        raise ValueError(f"a hybrid linear-attention cache commits chains only (rows {keep} kept)")
    return len(keep)


class StateCache(KVCache):
    """A KVCache whose tensors at `states` are a linear layer's (conv, recurrent, pending rows) instead of KV rows:
    the pass's folded states and its first k rows as the next pending ones; never compacted or truncated by row."""

    def __init__(self, empty: Sequence[Any], states: Sequence[int], to_numpy: Callable[[Any], np.ndarray],
                 from_numpy: Callable[[np.ndarray], Any], max_dead: int = 0, rows: Sequence[int] = ()):
        super().__init__(empty, to_numpy, from_numpy, max_dead)
        self.states, self.rows = frozenset(states), frozenset(rows)  # rows: the positions of the pending rows

    def append(self, presents: Sequence[Any], keep: Sequence[int], num_new: int) -> None:
        """The KV rows as KVCache; the states folded by the pass and its first k rows as the pending ones."""
        kept, old = _chain(keep), list(self.tensors)
        super().append(presents, keep, num_new)
        for k in self.states:  # nothing kept: the states and pending rows stay (the fold needs a row)
            self.tensors[k] = old[k] if not kept else self.tensors[k]
        for k in self.rows if kept else ():
            self.tensors[k] = self.from_numpy(np.ascontiguousarray(self.to_numpy(presents[k])[:, :kept]))

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
    """The fused CPU graph's cache of a hybrid target: KV buffers written in place (BufferKVCache), each linear
    layer's states and pending rows. A pass binds them and arrays for its outputs (`bind_states`); a pass cut in
    segments (head_dim > 128) runs each later segment from the previous one's folded states with its rows pending
    (`record`); the verdict keeps the first segment's folded states and the pass's first k rows (`append`)."""

    def __init__(self, spec: GraphSpec, shapes: Sequence[tuple[int, int]], dtype, wrap: Callable[[np.ndarray], Any],
                 capacity: int, max_capacity: int | None):
        super().__init__(shapes, dtype, wrap, capacity=capacity, max_capacity=max_capacity)
        self.inputs = {t.name: zero_state(t) for t in spec.inputs if t.name.startswith("past_state.")}
        self.folded: dict[str, np.ndarray] = {}  # the pass's first segment's outputs (the states after the pending rows)
        self.segment: dict[str, np.ndarray] = {}  # the inputs of the pass's next segment
        self.pass_rows: list[np.ndarray] = []  # each linear layer's rows of the pass so far, by input name

    def reserve(self, total: int) -> None:
        """Room for `total` KV rows (BufferKVCache); none to make without KV buffers (no attention layer)."""
        if self._shapes:
            super().reserve(total)

    def start_pass(self) -> None:
        """A new pass: it starts from the committed states and pending rows."""
        self.folded, self.segment, self.pass_rows = {}, dict(self.inputs), []

    def bind_states(self, binding: Any, q: int) -> dict[str, np.ndarray]:
        """Bind this (segment of a) pass's state inputs and arrays for its outputs; returns the outputs by name."""
        outputs = {}
        for name, value in self.segment.items():
            binding.bind_cpu_input(name, np.ascontiguousarray(value))
            shape = (1, q, value.shape[2]) if name.endswith(".rows") else value.shape
            outputs[name] = np.empty(shape, dtype=value.dtype)
            binding.bind_ortvalue_output(name.replace("past_state.", "present_state.", 1), self._wrap(outputs[name]))
        return outputs

    def record(self, outputs: dict[str, np.ndarray]) -> None:
        """A (segment of a) pass's outputs: the next segment starts from its folded states, its rows pending."""
        if not self.folded:
            self.folded = outputs
        self.pass_rows.append(outputs)
        self.segment = dict(outputs)

    def append(self, presents: Sequence[Any], keep: Sequence[int], num_new: int) -> None:
        """The KV rows as BufferKVCache; the states after the old pending rows, the pass's first k rows pending."""
        kept = _chain(keep)
        super().append(presents, keep, num_new)
        for name in self.inputs if kept and self.pass_rows else ():  # nothing kept: the states and pending rows stay
            if name.endswith(".rows"):
                self.inputs[name] = np.ascontiguousarray(np.concatenate([part[name] for part in self.pass_rows], axis=1)[:, :kept])
            else:
                self.inputs[name] = self.folded[name]
        self.folded, self.segment, self.pass_rows = {}, {}, []
