"""ONNX Runtime CUDA backend for the slotted GPU verify graph (`target.ort-cuda-slots.onnx`, `export --batch-slots
N` with a GPU dtype): N requests' rows in one pass.

Each pass runs every slot with the same number of rows R, a bucket (1, 2, 4, ... as `OrtCudaSession`'s), so each
bucket is one fixed set of shapes, one binding and, on CUDA, one captured graph. A slot's real rows come first and
its padding rows after them (attention is causal: the real rows never see them); a slot with nothing to run this
pass gets one dummy row past its committed KV rows (its output is dropped, the next pass overwrites its KV row).
The weight matmuls run over all N x R rows; each slot's GroupQueryAttention is a batch of one over its own KV
buffer per layer (export/fused_ops.py `GpuSlotInputs`). With one bucket (shape-invariant mode) every pass has the
same shapes, so a request's logits do not depend on what its batch-mates run.

The slotted graph verifies chains, as the single-sequence GPU graph; its tree form (`target.ort-cuda-tree-slots.onnx`,
`trees`) takes each slot's attention bias in every pass and verifies trees too: a tree's rows run main path first
(tree_layout.py), so the rows a verdict keeps are the slot's first rows and no KV row moves. On CUDA the bias sends
every pass of that graph to ONNX Runtime's unfused attention kernel (onnxruntime >= 1.28), trees or not, so a
request's logits do not depend on whether a pass held a tree. The same class runs the fp32 forms on ONNX Runtime
CPU (`device="cpu"`), as the tests do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ...errors import UnsupportedError
from ...manifest import GraphSpec
from .base import StepOutput
from .ort_cuda import DEFAULT_BUCKETS, BindingPlan, DeviceLogitsOutput, FixedKVCache, OrtCudaSession, binding_plan, bucket_for
from .ort_cuda import is_causal_step, pad_step
from .shared_weights import SharedWeights
from .tree_layout import MainPathLayout
from .wide_head import UNBOUNDED_ROWS

TREE_BIAS = "attention_bias"  # the tree form's input: every slot's additive mask [slots, 1, R, capacity]
FLOAT_MIN = float(np.finfo(np.float32).min)  # a masked key (the graph clamps it to its dtype's lowest finite value)

Step = tuple[np.ndarray, np.ndarray]  # a slot's token ids and positions this pass


class SlotKVCache(FixedKVCache):
    """One slot's KV rows in the slotted graph's per-slot buffers."""

    def __init__(self, tensors: list[Any], capacity: int, slot: int):
        super().__init__(tensors, capacity)
        self.slot = slot


class OrtCudaSlotSession(OrtCudaSession):
    """The slotted GPU graph with fixed bindings per bucket; `slot_cache(b)` is slot b's KV, `run_slots` one pass."""

    max_caches = None  # not a target Session: its caches are its slots (`slot_cache`, `SlotSession`)

    def __init__(self, directory: str | Path, spec: GraphSpec, device: str = "cuda", max_context: int | None = None,
                 max_verify_tokens: int = 64, buckets: Sequence[int] = DEFAULT_BUCKETS, device_id: int = 0,
                 threads: int | None = None, weights: SharedWeights | None = None):
        self.slots = int(spec.extra.get("slots", 0))
        if self.slots < 1:
            raise UnsupportedError(f"{spec.file} is not the slotted GPU graph (expected target.ort-cuda-slots.onnx)")
        self._slot_caches: list[SlotKVCache] = []
        self._bias: dict[int, tuple[np.ndarray, set[int]]] = {}  # per bucket: the host bias, the slots holding a tree
        super().__init__(directory, spec, device, max_context, max_verify_tokens, buckets=buckets, device_id=device_id,
                         threads=threads, weights=weights)

    def _plan(self, q: int) -> BindingPlan:
        return binding_plan(self.spec, q, self.capacity, self.slots)

    def _caches(self) -> list[SlotKVCache]:
        if not self._slot_caches:
            plan = self._plan(self.buckets[0])
            for b in range(self.slots):
                names = [n for n in self.past_names if n.split(".")[2] == str(b)]  # past_key_values.{layer}.{b}.*
                self._slot_caches.append(SlotKVCache([self._buffer(plan.inputs[n]) for n in names], self.capacity, b))
        return self._slot_caches

    def slot_cache(self, slot: int) -> SlotKVCache:
        """Slot `slot`'s KV cache, emptied (a new request's)."""
        cache = self._caches()[slot]
        cache.length, cache.row_slots = 0, None
        return cache

    @property
    def kv_bytes(self) -> int:
        """Bytes of every slot's KV buffers."""
        plan = self._plan(self.buckets[0])
        return sum(int(np.prod(plan.inputs[n].shape)) * (4 if plan.inputs[n].dtype == "float" else 2) for n in self.past_names)

    def new_cache(self, max_dead: int = 64, capacity: int | None = None) -> FixedKVCache:
        raise UnsupportedError("the slotted GPU graph's caches are its slots (slot_cache)")

    def warm_up(self, runs: int = 3) -> None:
        """Every bucket's pass `runs` times with a dummy row in each (empty) slot: CUDA graphs captured at open."""
        for bucket in self.buckets:
            for _ in range(runs):
                self.run_slots({}, bucket)
        for cache in self._caches():
            cache.length = 0

    @property
    def trees(self) -> bool:
        """Whether the graph verifies trees: its tree form (`target.ort-cuda-tree-slots.onnx`), whose every pass
        carries each slot's attention bias (all zero for chains, prefill and dummy rows)."""
        return self.spec.extra.get("masks") == "tree"

    def run_slots(self, steps: dict[int, Step], rows: int | None = None,
                  trees: dict[int, np.ndarray] | None = None) -> dict[int, DeviceLogitsOutput]:
        """One pass: slot b runs `steps[b]` after its committed rows, padded to the pass's bucket (the smallest that
        holds every step, or `rows`); every other slot one dummy row. Returns each stepped slot's output (valid
        until the next pass). `trees`: a slot's ancestry mask [q, q] where its rows are a tree (the tree form
        only): they run main path first (tree_layout.MainPathLayout) and come back in their own order, the main
        path's rows marked `plain_exact`, the slot's cache told where each row went (`row_slots`)."""
        layouts = {b: layout for b, mask in (trees or {}).items()
                   if (layout := MainPathLayout.of_tree(np.asarray(mask)[None], len(mask))) is not None}
        if layouts and not self.trees:
            raise UnsupportedError(f"{self.spec.file} is causal: tree drafts need its tree form (target.ort-cuda-tree-slots.onnx)")
        q = max([len(ids) for ids, _ in steps.values()] + [1])
        bucket = rows or bucket_for(q, self.buckets)
        if bucket is None or bucket < q:
            raise UnsupportedError(f"a slot pass holds at most {self.buckets[-1]} rows per slot, got {q}")
        caches = self._caches()
        ids = np.empty((self.slots, bucket), dtype=np.int64)
        positions = np.empty((self.slots, bucket), dtype=np.int64)
        seqlens = np.empty(self.slots, dtype=np.int32)
        for b, cache in enumerate(caches):
            step_ids, step_positions = steps.get(b, (np.zeros(1, np.int64), np.asarray([cache.length])))
            if b in layouts:
                step_ids, step_positions = layouts[b].rows(step_ids), layouts[b].rows(step_positions)
            cache.reserve(cache.length + bucket)
            ids[b: b + 1], positions[b: b + 1] = pad_step(np.asarray(step_ids), np.asarray(step_positions), bucket,
                                                          self.max_position)
            seqlens[b] = cache.length + bucket - 1
        binding, plan = self._binding(bucket)
        self._buffers[plan.inputs["input_ids"].key].update_inplace(ids)
        self._buffers[plan.inputs["position_ids"].key].update_inplace(positions)
        self._buffers["seqlens_k"].update_inplace(seqlens)
        if self.trees:
            self._write_bias(plan, bucket, {b: (layouts[b], trees[b]) for b in layouts})
        self.session.run_with_iobinding(binding, self._options(bucket))
        return self._outputs(plan, steps, layouts)

    def _write_bias(self, plan: BindingPlan, bucket: int, layouts: dict[int, tuple[MainPathLayout, np.ndarray]]) -> None:
        """The pass's attention bias: 0 but where a tree row must not see a new row (FLOAT_MIN); rewritten only when
        this pass or the last one of this bucket held a tree (the committed rows and causal attention need none)."""
        host, dirty = self._bias.setdefault(bucket, (np.zeros(plan.inputs[TREE_BIAS].shape, np.float32), set()))
        if not layouts and not dirty:
            return
        for b in dirty:
            host[b] = 0.0
        dirty.clear()
        caches = self._caches()
        for b, (layout, mask) in layouts.items():
            past, q = caches[b].length, len(mask)
            own = layout.mask(np.asarray(mask, dtype=bool)[None])[0]  # rows and columns in pass order
            host[b, 0, :q, past: past + q] = np.where(own, 0.0, FLOAT_MIN)
            dirty.add(b)
        self._buffers[plan.inputs[TREE_BIAS].key].update_inplace(host)

    def _outputs(self, plan: BindingPlan, steps: dict[int, Step], layouts: dict[int, MainPathLayout]) -> dict[int, DeviceLogitsOutput]:
        """Each stepped slot's rows of the pass's outputs (a tree's back in its own row order)."""
        caches = self._caches()
        outputs = {name: self._buffers[buffer.key] for name, buffer in plan.outputs.items()}
        tokens = outputs["next_tokens"].numpy()
        hidden = outputs[self.hidden_name].numpy() if self.hidden_name else None
        device_logits, fetched = outputs["logits"], []

        def logits() -> np.ndarray:  # every slot's rows, copied once
            if not fetched:
                fetched.append(device_logits.numpy())
            return fetched[0]

        results = {}
        for b, (step_ids, _) in steps.items():
            n, layout = len(step_ids), layouts.get(b)
            rows = np.arange(n) if layout is None else np.argsort(layout.order)  # original row r ran as pass row rows[r]
            caches[b].row_slots = None if layout is None else rows
            out = DeviceLogitsOutput(lambda b=b, n=n, rows=rows: logits()[b, :n][rows], caches[b].tensors,
                                     None if hidden is None else hidden[b, :n][rows], tokens[b, :n][rows])
            out.plain_exact = None if layout is None else layout.exact
            results[b] = out
        return results


class SlotSession:
    """One slot of the slotted GPU graph as a target Session (a request's prefill chunks): its rows in its slot, a
    dummy row in every other; a chunk longer than the largest bucket runs as several passes. In the tree form a
    pass whose rows are a tree runs main path first (`run_slots`' `trees`), its main path's rows `plain_exact`."""

    row_invariant = False
    max_caches = None

    def __init__(self, slots: OrtCudaSlotSession):
        self.slots = slots
        self.spec = slots.spec

    def pass_rows(self, start: int) -> int:
        """Any number (Session.pass_rows)."""
        return UNBOUNDED_ROWS

    def new_cache(self) -> FixedKVCache:
        raise UnsupportedError("a slot's cache comes from the batch decoder (OrtCudaSlotSession.slot_cache)")

    def run(self, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray, cache: SlotKVCache,
            last_logits_only: bool = False) -> StepOutput:
        ids, positions = np.asarray(input_ids).reshape(-1), np.asarray(position_ids).reshape(-1)
        past, most = cache.length, self.slots.buckets[-1]
        if not is_causal_step(attention_mask, past):
            if not self.slots.trees:
                raise UnsupportedError(f"{self.spec.file} is causal: tree drafts need its tree form "
                                       "(target.ort-cuda-tree-slots.onnx) or the contract graph")
            tree = {cache.slot: tree_step(attention_mask, past)}
            return self.slots.run_slots({cache.slot: (ids, positions)}, trees=tree)[cache.slot]
        outs, earlier, pieces = [], [], range(0, ids.size, most)
        try:
            for start in pieces:
                cache.length = past + start  # the piece attends to the rows before it (committed by the caller after)
                out = self.slots.run_slots({cache.slot: (ids[start: start + most], positions[start: start + most])})[cache.slot]
                if start != pieces[-1] and not last_logits_only:
                    earlier.append(out.logits)  # copied before the next pass overwrites the device rows
                outs.append(out)
        finally:
            cache.length = past
        final = outs[-1]
        tokens = np.concatenate([out.greedy_tokens for out in outs])
        hidden = None if final.hidden is None else np.concatenate([out.hidden for out in outs])
        if last_logits_only:
            return DeviceLogitsOutput(lambda: final.logits[-1:], cache.tensors, hidden, tokens)
        return DeviceLogitsOutput(lambda: np.concatenate([*earlier, final.logits]), cache.tensors, hidden, tokens)


class OneSlotSession(SlotSession):
    """The slotted GPU graph's tree form as a single stream's target Session (`speccompile run | bench | verify`, a
    Runner without a server, drafting trees on ort-cuda): every pass, plain or drafted, in slot 0 of the same graph,
    so plain decoding and tree verification compute a position's logits alike (one bucket in shape-invariant mode)."""

    max_caches = 1  # `new_cache` hands out slot 0's device buffers (as OrtCudaSession's one buffer)

    def new_cache(self) -> FixedKVCache:
        """Slot 0's KV, emptied: a session runs one generation at a time."""
        return self.slots.slot_cache(0)


def tree_step(attention_mask: np.ndarray, past: int) -> np.ndarray:
    """The new rows' ancestry [q, q] of a tree pass's mask [1, q, past + q]: every row sees every committed row and,
    of the new rows, itself and rows before it only (UnsupportedError for any other mask)."""
    mask = np.asarray(attention_mask, dtype=bool)[0]
    q = mask.shape[0]
    ancestry = mask[:, past: past + q]
    if mask.shape[1] != past + q or not mask[:, :past].all() or np.triu(ancestry, 1).any() or not ancestry.diagonal().all():
        raise UnsupportedError("the slotted GPU graph verifies chains and trees over every committed row, not this mask")
    return ancestry
