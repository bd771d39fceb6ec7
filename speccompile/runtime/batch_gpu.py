"""The batch decoder's mode over the slotted GPU verify graph (backends/ort_cuda_slots.py): every round is one slot
pass, every request's pending token and chain draft in its own slot, the same rows per slot (a bucket).

Each request keeps its KV rows in one physical slot of the graph from join to leave (device buffers do not move:
`moved` changes nothing, the cache names its slot); prefill chunks run as slot passes of their own (prompt rows
only), after the round's commits: a round is one pass, so a newcomer waits for one pass as in the other modes, and no pass
overwrites the round's outputs or pending KV rows before they are committed. Prompts that wait together prefill
together (`prefill`): each slot pass carries the next rows (up to the largest bucket) of every waiting prompt's
chunk, so eight prompts arriving at once take the passes of the longest one, not eight prompts' passes; with one
bucket (shape-invariant mode) every pass has the same shapes and each prompt's rows compute the bits they get alone.
Plans are each request's own (`plan_step()`, its controller's costs): drafts ride in the shared pass. No prefix
cache (the device rows are not copied out).
Tree drafts (EAGLE / EAGLE-3 / Medusa heads, DFlash's static trees, the suffix drafter's) run in the graph's tree
form (`OrtCudaSlotSession.trees`, a per-slot attention bias in every pass), main path first: a verdict is cut at
the first accepted node off the main path (`StepOutput.plain_exact`), so the rows a slot keeps are its first ones.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np

from ..errors import UnsupportedError
from .backends.base import StepOutput
from .backends.ort_cuda import DeviceLogitsOutput
from .backends.ort_cuda_slots import OrtCudaSlotSession, SlotKVCache
from .batch_passes import Plans, RoundPasses
from .generate import Generation


class SlotGraphPasses(RoundPasses):
    """Up to the graph's slots requests; each round one pass of the slotted GPU graph over all of them."""

    fixed = True
    shares_passes = True
    shares_prefill = True
    passes_within_round = False  # its outputs (and pending KV rows) live in the graph's buffers until committed
    mode = {"passes": "gpu-slots", "slot_passes": "all"}  # every round one slot pass

    def __init__(self, session: OrtCudaSlotSession, slots: int, max_context: int):
        super().__init__(session)
        self.slots = max(1, min(slots, session.slots))
        self.max_context = max_context
        self._free = list(range(self.slots))  # physical slots no request holds

    @property
    def rows(self) -> int:
        return self.max_context

    @property
    def kv_bytes(self) -> int:
        return self.session.kv_bytes

    def cache(self, slot: int) -> SlotKVCache:
        return self.session.slot_cache(self._free.pop(0))

    def release(self, cache) -> None:
        self._free.append(cache.slot)

    def prefill(self, generations: Sequence[Generation]) -> None:
        """The next chunk of each generation's prompt, in shared slot passes: pass i carries rows [iR, (i+1)R) of
        every chunk that long (R: the largest bucket, as a chunk alone is split); a chunk's output is committed
        right after its last pass (before the next one overwrites the device rows), its earlier passes' greedy
        tokens and hidden states copied out."""
        most = self.session.buckets[-1]
        running = {g.cache.slot: (g, *g.next_prefill_chunk()) for g in generations}
        past = {slot: g.cache.length for slot, (g, _, _) in running.items()}
        pieces: dict[int, list[DeviceLogitsOutput]] = {slot: [] for slot in running}
        start = 0
        while running:
            steps = {slot: (ids[start: start + most], positions[start: start + most]) for slot, (_, ids, positions) in running.items()}
            t0 = time.perf_counter()
            try:
                for slot, (generation, _, _) in running.items():
                    generation.cache.length = past[slot] + start  # a piece attends to the rows before it
                outs = self.session.run_slots(steps)
            finally:
                for slot, (generation, _, _) in running.items():
                    generation.cache.length = past[slot]
            seconds = time.perf_counter() - t0
            self.prefill_passes += 1
            next(iter(running.values()))[0].charge_engine(seconds)
            for slot in [s for s, (_, ids, _) in running.items() if start + most >= len(ids)]:
                generation = running.pop(slot)[0]
                generation.prefilled_chunk(_chunk_output([*pieces.pop(slot), outs[slot]]))
            for slot in running:
                pieces[slot].append(outs[slot])
            start += most

    def round(self, active: list[Generation], after_pass: Callable[[], None]) -> tuple[Plans, dict[int, StepOutput]]:
        plans: Plans = [None if generation.prefilling else generation.plan_step() for generation in active]
        trees = {g.cache.slot: p.new_mask for g, p in zip(active, plans) if p is not None and p.draft.tree is not None}
        if trees and not self.session.trees:
            raise UnsupportedError("the slotted GPU graph is causal: tree drafts need its tree form "
                                   "(target.ort-cuda-tree-slots.onnx) or run the contract graph")
        steps = {g.cache.slot: (p.ids, p.positions) for g, p in zip(active, plans) if p is not None}
        if not steps:
            return plans, {}
        t0 = time.perf_counter()
        outs = self.session.run_slots(steps, trees=trees)
        seconds = time.perf_counter() - t0
        self.slot_passes += 1
        active[0].charge_engine(seconds)
        outputs = {}
        for i, (generation, planned) in enumerate(zip(active, plans)):
            if planned is not None:
                generation.shared_pass(seconds, len(planned.ids))  # what a draft costs in this pass
                outputs[i] = outs[generation.cache.slot]
        return plans, outputs


def _chunk_output(pieces: list[DeviceLogitsOutput]) -> DeviceLogitsOutput:
    """One prefill chunk's output from its passes' (the last one's logits still on the device: its last row, read
    before the next pass): the last row's logits, every row's greedy token and hidden state."""
    final = pieces[-1]
    tokens = np.concatenate([out.greedy_tokens for out in pieces])
    hidden = None if final.hidden is None else np.concatenate([out.hidden for out in pieces])
    return DeviceLogitsOutput(lambda: final.logits[-1:], final.presents, hidden, tokens)
