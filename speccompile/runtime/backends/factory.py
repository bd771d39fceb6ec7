"""`open_session`: the one place that turns a graph of an opened artifact into a backend session."""

from __future__ import annotations

from pathlib import Path

from ...errors import InputError
from ...manifest import GraphSpec, Manifest
from .base import BACKENDS, FeatureSession, Session


def open_session(directory: str | Path, spec: GraphSpec, backend: str = "ort-cpu", threads: int | None = None, *,
                 manifest: Manifest, max_context: int | None = None, spinning: bool = False,
                 device: int = 0) -> Session | FeatureSession:
    """The backend session for graph `spec` of the artifact in `directory` (whose manifest is `manifest`).

    A graph with KV inputs (target, draft model, EAGLE/EAGLE-3/MTP heads) opens as a `Session`; one
    without (the Medusa heads) as a `FeatureSession`. `max_context` bounds the fused CPU graph's KV
    buffers; `spinning` lets ONNX Runtime's threads busy-wait (see `ort.session_options`); `device` is
    the GPU of the native TensorRT backend.
    """
    if backend not in BACKENDS:
        raise InputError(f"--backend must be one of {', '.join(BACKENDS)}, got {backend}")
    if not any(name.startswith("past_key_values") for name in spec.input_names()):
        if backend == "tensorrt":
            from .tensorrt import TensorRTFeatureSession

            return TensorRTFeatureSession(directory, manifest, spec, device)
        from .ort import OrtFeatureSession

        return OrtFeatureSession(directory, manifest, spec, backend, threads)
    if spec.extra.get("kv_layout") == "buffer":
        from .ort import OrtBufferSession

        return OrtBufferSession(directory, manifest, spec, backend, threads, max_context, spinning)
    if backend == "tensorrt":
        from .tensorrt import TensorRTSession

        return TensorRTSession(directory, manifest, spec, device)
    from .ort import OrtSession

    return OrtSession(directory, manifest, spec, backend, threads, spinning)
