"""`open_session`: the one place that turns a graph of an opened artifact into a backend session."""

from __future__ import annotations

from pathlib import Path

from ...errors import InputError
from ...manifest import GraphSpec, Manifest
from .base import BACKENDS, Session


def open_session(directory: str | Path, spec: GraphSpec, backend: str = "ort-cpu", threads: int | None = None, *,
                 manifest: Manifest, max_context: int | None = None, spinning: bool = False, device: int = 0) -> Session:
    """The backend session for graph `spec` of the artifact in `directory` (whose manifest is `manifest`).

    `max_context` bounds the fused CPU graph's KV buffers; `spinning` lets ONNX Runtime's threads busy-wait
    (see `ort.session_options`); `device` is the GPU of the native TensorRT backend.
    """
    if backend not in BACKENDS:
        raise InputError(f"--backend must be one of {', '.join(BACKENDS)}, got {backend}")
    if spec.extra.get("kv_layout") == "buffer":
        from .ort import OrtBufferSession

        return OrtBufferSession(directory, manifest, spec, backend, threads, max_context, spinning)
    if backend == "tensorrt":
        from .tensorrt import TensorRTSession

        return TensorRTSession(directory, manifest, spec, device)
    from .ort import OrtSession

    return OrtSession(directory, manifest, spec, backend, threads, spinning)
