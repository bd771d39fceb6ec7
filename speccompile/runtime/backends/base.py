"""The one protocol every inference backend implements (ONNX Runtime CPU/CUDA/TensorRT EP, native TensorRT)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ...manifest import GraphSpec
from ..kvcache import KVCache


@dataclass
class StepOutput:
    """What one verify-graph call returns to the runtime."""

    logits: np.ndarray  # [q, vocab] float32
    presents: list[Any]  # backend-native KV tensors, adopted by the KVCache
    hidden: np.ndarray | None = None  # [q, H] final hidden states or [q, 3H] EAGLE-3 taps, if exported
    plain_exact: np.ndarray | None = None  # [q] bool, shape-invariant mode: rows computed exactly as plain decoding


class Session(Protocol):
    """A loaded verify graph: run new tokens against a KV cache."""

    spec: GraphSpec

    def new_cache(self) -> KVCache:
        """An empty KV cache in this backend's tensor type."""

    def run(self, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray, cache: KVCache) -> StepOutput:
        """input_ids/position_ids int64 [q], attention_mask bool [1, q, past + q]; does not modify `cache`."""


BACKENDS = ("ort-cpu", "ort-cuda", "ort-trt", "tensorrt")


def open_session(directory, spec: GraphSpec, backend: str = "ort-cpu", threads: int | None = None,
                 shape_invariant: int | None = None, **options: Any) -> Session:
    """Create the backend session for one graph of an artifact.

    `shape_invariant`: run every pass with this many query rows against a fixed KV extent
    (backends/shape_invariant.py; needs `max_context`); None = each pass with its own shapes.
    """
    session = _open_backend(directory, spec, backend, threads, **options)
    if shape_invariant:
        from .shape_invariant import ShapeInvariantSession

        return ShapeInvariantSession(session, shape_invariant, options["max_context"])
    return session


def _open_backend(directory, spec: GraphSpec, backend: str, threads: int | None, **options: Any) -> Session:
    from ...errors import InputError

    if spec.extra.get("kv_layout") == "buffer":
        from .ort import OrtBufferSession

        return OrtBufferSession(directory, spec, backend, threads, options.get("max_context"), options.get("spinning", False))
    if backend in ("ort-cpu", "ort-cuda", "ort-trt"):
        from .ort import OrtSession

        return OrtSession(directory, spec, backend, threads, options.get("spinning", False))
    if backend == "tensorrt":
        from .tensorrt import TensorRTSession

        return TensorRTSession(directory, spec, **options)
    raise InputError(f"--backend must be one of {', '.join(BACKENDS)}, got {backend}")
