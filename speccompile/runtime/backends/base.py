"""The protocols every inference backend implements (ONNX Runtime CPU/CUDA/TensorRT EP, native TensorRT).

`factory.open_session` is the one place that opens a graph of an artifact; it returns a `Session` for
graphs with a KV cache (target, draft model, EAGLE/EAGLE-3/MTP heads) and a `FeatureSession` for the
stateless Medusa heads graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ...manifest import GraphSpec
from ..kvcache import KVCache

BACKENDS = ("ort-cpu", "ort-cuda", "ort-trt", "tensorrt")
FEATURE_INPUTS = ("hidden_states", "aux_hidden_states")  # a head graph's float inputs: the target's features
HIDDEN_OUTPUTS = ("hidden_states", "aux_hidden_states", "draft_hidden_states")  # the hidden output, if exported


@dataclass
class StepOutput:
    """What one graph call returns to the runtime."""

    logits: np.ndarray  # [q, vocab] float32
    presents: list[Any]  # backend-native KV tensors, adopted by the KVCache
    hidden: np.ndarray | None = None  # [q, H] final hidden states, [q, 3H] EAGLE-3 taps, or a head's draft hidden
    greedy_tokens: np.ndarray | None = None  # [q] int64 argmax of each row, when the graph computes it (GPU graph)
    plain_exact: np.ndarray | None = None  # [q] bool, a tree laid out main path first: rows computed exactly as plain decoding


def feature_inputs(spec: GraphSpec) -> list[str]:
    """Names of the graph's feature inputs (head graphs: `hidden_states`, EAGLE-3's `aux_hidden_states`)."""
    return [t.name for t in spec.inputs if t.name in FEATURE_INPUTS]


def hidden_output(spec: GraphSpec) -> str | None:
    """Name of the graph's hidden-state output, None when it has none."""
    names = spec.output_names()
    return next((n for n in HIDDEN_OUTPUTS if n in names), None)


class Session(Protocol):
    """A loaded graph with a KV cache: run q new tokens against the cache."""

    spec: GraphSpec
    # True when a position's KV rows and logits are the same bits whatever pass computed them (any number of
    # rows, any split of a prompt into passes): rows cached from one prompt may then stand in for any prefix of
    # another (runtime/prefix_cache.py). The fused CPU graph with its one-row attention padding; False elsewhere.
    row_invariant: bool
    # How many KV caches of this session may be live at once (None: as many as memory holds; 1: `new_cache` hands
    # out the session's one device buffer, the GPU graphs). The batch decoder's one-pass-per-request mode decodes
    # that many requests at once (runtime/batch_passes.py).
    max_caches: int | None

    def new_cache(self) -> KVCache:
        """An empty KV cache in this backend's tensor type."""

    def pass_rows(self, start: int) -> int:
        """The most rows a pass whose first row lands at KV slot `start` holds in one pass (more are run split,
        at a cost): a bound only where a graph's rounding depends on where a pass ends (backends/wide_head.py)."""

    def run(self, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray, cache: KVCache,
            last_logits_only: bool = False, **features: np.ndarray) -> StepOutput:
        """Run q new tokens: input_ids/position_ids int64 [q], attention_mask bool [1, q, cache slots + q],
        plus one float [q, width] array per name in `feature_inputs(spec)` (head graphs).
        `last_logits_only`: the caller reads only the last row's logits (a prefill chunk); a graph that can
        skip the other rows' vocabulary projection returns [1, vocab], others [q, vocab] as always.

        The committed rows of `cache` are never changed, and its bookkeeping (which slots are live, its
        length) is left to the caller, who adopts the step with `cache.append(out.presents, keep, q)`.
        The q new rows are either returned as new tensors holding past + new rows (`KVCache`: the cache
        object itself is untouched), or written in place into the cache's preallocated buffers right after
        its committed rows (`BufferKVCache`, the fused CPU graph: `run` may also grow those buffers, and
        the next `run` overwrites whatever the caller did not keep).
        """


class FeatureSession(Protocol):
    """A graph without a KV cache over the target's hidden states (the Medusa heads)."""

    spec: GraphSpec
    max_caches: None  # it keeps no state between runs (see Session)

    def run(self, hidden_states: np.ndarray) -> np.ndarray:
        """hidden_states [q, H] float -> logits [q, heads, vocab] float32."""
