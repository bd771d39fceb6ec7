"""The batch decoder's mode over the slotted GPU verify graph (backends/ort_cuda_slots.py): every round is one slot
pass, every request's pending token and chain draft in its own slot, the same rows per slot (a bucket).

Each request keeps its KV rows in one physical slot of the graph from join to leave (device buffers do not move:
`moved` changes nothing, the cache names its slot); a request's prefill chunks run as slot passes of their own
(`SlotSession`), after the round's commits: a round is one pass, so a newcomer waits for one pass as in the other
modes, and no pass overwrites the round's outputs or pending KV rows before they are committed. Plans are each request's own (`plan_step()`, its controller's costs): drafts ride in the shared
pass. No prefix cache (the device rows are not copied out).
"""

from __future__ import annotations

import time
from typing import Callable

from ..errors import UnsupportedError
from .backends.base import StepOutput
from .backends.ort_cuda_slots import OrtCudaSlotSession, SlotKVCache
from .batch_passes import Plans, RoundPasses
from .generate import Generation


class SlotGraphPasses(RoundPasses):
    """Up to the graph's slots requests; each round one pass of the slotted GPU graph over all of them."""

    fixed = True
    shares_passes = True
    passes_within_round = False  # its outputs (and pending KV rows) live in the graph's buffers until committed

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

    def round(self, active: list[Generation], after_pass: Callable[[], None]) -> tuple[Plans, dict[int, StepOutput]]:
        plans: Plans = [None if generation.prefilling else generation.plan_step() for generation in active]
        if any(p is not None and p.draft.tree is not None for p in plans):
            raise UnsupportedError("the slotted GPU graph is causal: tree drafts run the contract graph")
        steps = {g.cache.slot: (p.ids, p.positions) for g, p in zip(active, plans) if p is not None}
        if not steps:
            return plans, {}
        t0 = time.perf_counter()
        outs = self.session.run_slots(steps)
        seconds = time.perf_counter() - t0
        self.slot_passes += 1
        active[0].charge_engine(seconds)
        outputs = {}
        for i, (generation, planned) in enumerate(zip(active, plans)):
            if planned is not None:
                generation.shared_pass(seconds, len(planned.ids))  # what a draft costs in this pass
                outputs[i] = outs[generation.cache.slot]
        return plans, outputs
