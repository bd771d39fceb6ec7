"""How a batch decoder's rounds run their target passes: the interface, and the mode for any backend.

`BatchDecoder` (runtime/batch.py) owns the request lifecycle — join, step, leave, deferred prefills — and hands
each round to a `RoundPasses`, which decides where each request's KV rows live and which passes a round runs:

    FusedGraphPasses (batch_fused.py)   the fused ONNX Runtime CPU graph with a batch axis: KV slots in shared
                                        buffers, the plain rows of a round in one batched pass, drafts in
                                        passes of their own or in one slot pass (batch.py's docstring)
    SlotGraphPasses (batch_gpu.py)      the slotted GPU graph: every round one pass, each request's rows
                                        (pending token + chain draft) in its own slot, R rows a slot; the
                                        prompts waiting for their prefill share passes too
    OnePassPerRequest (here)            any target: each request its own KV cache (`target.new_cache()`, as
                                        `Runner.generate`), each round each request's planned pass in turn —
                                        the bits it gets alone; as many slots as the backend holds caches

A server on a backend without a batched graph (ort-cuda, tensorrt, the contract graph, a batch-1 export) or with
`--no-batching` (one slot) thus runs the same loop as the batched one: one request lifecycle.
"""

from __future__ import annotations

import abc
from typing import Callable, Sequence

import numpy as np

from .backends.base import StepOutput
from .generate import Generation, PlannedStep

Plans = list[PlannedStep | None]


class RoundPasses(abc.ABC):
    """Where a batch decoder's requests keep their KV rows and how one round's target passes run."""

    slots: int  # the most requests decoding at once
    fixed: bool  # whether a request's KV rows stay where they are while others join (joins between passes allowed)
    shares_passes: bool  # whether several requests' rows run in one pass (the server reports it as `batched`)
    keeps_prefixes = False  # whether prompt rows may come from (and go to) a prefix cache (runtime/prefix_cache.py)
    prefills_together = False  # whether prompts of one chunk may be prefilled in one pass (`prefill_batch`)
    # whether other passes (a newcomer's prefill chunk) may run between a round's passes and its commits; False when a
    # pass's outputs live in buffers the next pass overwrites: requests then join and prefill after the round
    passes_within_round = True
    # whether the prompts waiting for their prefill take their next chunks together, in shared passes (`prefill`)
    shares_prefill = False
    batched_passes = 0  # passes over several requests' plain rows
    slot_passes = 0  # rounds run as one slot pass
    prefill_passes = 0  # passes shared by prefill chunks (`shares_prefill`)

    def __init__(self, session) -> None:
        self.session = session  # the target's session (a prefix cache keys its entries by it)

    @property
    @abc.abstractmethod
    def rows(self) -> int:
        """KV rows one request may hold now."""

    @property
    @abc.abstractmethod
    def kv_bytes(self) -> int:
        """Bytes of KV memory this mode holds for its slots (0: each request's cache is its own)."""

    @abc.abstractmethod
    def cache(self, slot: int):
        """The KV cache of a request joining in `slot` (empty), or None: the target's own new cache."""

    def release(self, cache) -> None:
        """A request that held `cache` (from `cache`) left, or never joined: its slot is free again."""

    def make_room(self, active: Sequence[Generation], rows: int) -> None:
        """Let every slot hold `rows` KV rows (the active requests' rows kept)."""

    def moved(self, generation: Generation, source: int, slot: int) -> None:
        """`generation` now lives in `slot` instead of `source` (a request left; slots stay dense)."""

    @property
    def mode(self) -> dict[str, str]:
        """What this decoder runs, as a server reports it: `passes` (fused, gpu-slots, one-per-request) and
        `slot_passes` (off, drafts, all: the rounds that run as one slot pass)."""
        return {"passes": "one-per-request", "slot_passes": "off"}

    def prefill(self, generations: Sequence[Generation]) -> None:
        """One prefill chunk of each of `generations` (each in passes of its own unless `shares_prefill`)."""
        for generation in generations:
            generation.prefill_next_chunk()

    def prefill_batch(self, first_slot: int, prompts: list[np.ndarray]) -> list[np.ndarray]:
        """Prefill `prompts` in the slots from `first_slot` in one pass; their last logits (`prefills_together`)."""
        raise NotImplementedError(f"{type(self).__name__} prefills each prompt alone")

    @abc.abstractmethod
    def round(self, active: list[Generation], after_pass: Callable[[], None]) -> tuple[Plans, dict[int, StepOutput]]:
        """Plan one round for every active request (None: still prefilling, or its context is full) and run its
        passes, calling `after_pass` after each (when `passes_within_round`); returns the plans and the pass output
        of each planned index."""


class OnePassPerRequest(RoundPasses):
    """Any target session: each request decodes into its own KV cache (`target.new_cache()`), and each round runs
    each request's planned pass (`Generation.verify_pass`) in turn, so every request computes the bits it gets
    alone. `slots`: how many requests decode at once, at most the caches the session holds (`Session.max_caches`:
    1 for the GPU graph's one device KV buffer). Requests share no pass, and no prefix cache."""

    fixed = True  # each cache is its own: nothing moves when a request joins or leaves
    shares_passes = False

    def __init__(self, session, slots: int, max_context: int):
        super().__init__(session)
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.slots = slots
        self.max_context = max_context

    @property
    def rows(self) -> int:
        return self.max_context

    @property
    def kv_bytes(self) -> int:
        return 0

    def cache(self, slot: int):
        return None

    def round(self, active: list[Generation], after_pass: Callable[[], None]) -> tuple[Plans, dict[int, StepOutput]]:
        plans: Plans = [None if generation.prefilling else generation.plan_step() for generation in active]
        outputs = {}
        for i, planned in enumerate(plans):
            if planned is not None:
                outputs[i] = active[i].verify_pass(planned)
                after_pass()
        return plans, outputs


def slots_for(session, wanted: int) -> int:
    """Requests a session can decode at once with a KV cache each: `wanted`, bounded by `Session.max_caches`."""
    most = session.max_caches
    return wanted if most is None else max(1, min(wanted, most))
