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


class Session(Protocol):
    """A loaded verify graph: run new tokens against a KV cache."""

    spec: GraphSpec

    def new_cache(self) -> KVCache:
        """An empty KV cache in this backend's tensor type."""

    def run(self, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray, cache: KVCache) -> StepOutput:
        """input_ids/position_ids int64 [q], attention_mask bool [1, q, past + q]; does not modify `cache`."""


BACKENDS = ("ort-cpu", "ort-cuda", "ort-trt", "tensorrt")

