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
    greedy_tokens: np.ndarray | None = None  # [q] int64 argmax of each row, when the graph computes it (GPU graph)


class Session(Protocol):
    """A loaded verify graph: run new tokens against a KV cache."""

    spec: GraphSpec

    def new_cache(self) -> KVCache:
        """An empty KV cache in this backend's tensor type."""

    def run(self, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray, cache: KVCache) -> StepOutput:
        """input_ids/position_ids int64 [q], attention_mask bool [1, q, past + q]; does not modify `cache`."""


BACKENDS = ("ort-cpu", "ort-cuda", "ort-trt", "tensorrt")


def open_session(directory, spec: GraphSpec, backend: str = "ort-cpu", threads: int | None = None, **options: Any) -> Session:
    """Create the backend session for one graph of an artifact."""
    from ...errors import InputError

    if spec.extra.get("kv_layout") == "buffer" and "ort-cuda" in spec.extra.get("backends", ()):
        from .ort_cuda import OrtCudaSession

        return OrtCudaSession(directory, spec, "cuda" if backend == "ort-cuda" else "cpu", options.get("max_context"), threads=threads)
    if spec.extra.get("kv_layout") == "buffer":
        from .ort import OrtBufferSession

        return OrtBufferSession(directory, spec, backend, threads, options.get("max_context"), options.get("spinning", False))
    if backend in ("ort-cpu", "ort-cuda", "ort-trt"):
        from .ort import OrtSession

        return OrtSession(directory, spec, backend, threads, options.get("spinning", False))
    if backend == "tensorrt":
        from .tensorrt_graphs import open_tensorrt_session

        return open_tensorrt_session(directory, spec, **options)
    raise InputError(f"--backend must be one of {', '.join(BACKENDS)}, got {backend}")
