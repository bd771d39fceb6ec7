"""`open_session`: the one place in the runtime that turns a graph of an opened artifact into a backend session."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import InputError
from ...manifest import GraphSpec, Manifest
from ...errors import UnsupportedError
from .base import BACKENDS, FeatureSession, Session

if TYPE_CHECKING:
    from .ort_slots import OrtSlotSession
    from .shared_weights import SharedWeights


def open_session(directory: str | Path, spec: GraphSpec, backend: str = "ort-cpu", threads: int | None = None, *,
                 manifest: Manifest, max_context: int | None = None, spinning: str = "off",
                 device: int = 0, shape_invariant: int | None = None,
                 weights: "SharedWeights | None" = None) -> "Session | FeatureSession | OrtSlotSession":
    """The backend session for graph `spec` of the artifact in `directory` (whose manifest is `manifest`).

    A graph with KV inputs (target, draft model, EAGLE/EAGLE-3/MTP heads) opens as a `Session`; one
    without (the Medusa heads) as a `FeatureSession`; the slotted graphs (`export --batch-slots`) as the batch
    decoder's `OrtSlotSession` (ONNX Runtime CPU) or `OrtCudaSlotSession` (the GPU form). `max_context` bounds the fused CPU graph's KV
    buffers; `spinning`: when ONNX Runtime's threads busy-wait (ort.SPINNING, see `ort.session_options`); `device` is
    the GPU of the native TensorRT backend. `shape_invariant`: run every pass of a KV graph with this many
    query rows against a fixed KV extent (backends/shape_invariant.py; needs `max_context`); None = each
    pass with its own shapes. `weights`: the tensors the GPU graph shares with its slotted form, resident once
    (`SharedWeights`; the GPU graphs only).
    """
    if spec.extra.get("slots") and not is_gpu_graph(spec):
        if backend != "ort-cpu":
            raise UnsupportedError(f"{spec.file} (the slotted graph) runs on ort-cpu only, not {backend}")
        from .ort_slots import OrtSlotSession

        return OrtSlotSession(directory, manifest, spec, threads)
    if is_gpu_graph(spec):  # fixed shapes per q bucket already: shape-invariant = one bucket of that many rows
        from .ort_cuda import DEFAULT_BUCKETS, OrtCudaSession
        from .ort_cuda_slots import OrtCudaSlotSession

        verify = shape_invariant or int(manifest.limits.get("max_verify_tokens", 64))
        kind = OrtCudaSlotSession if spec.extra.get("slots") else OrtCudaSession  # the slotted form: N requests a pass
        return kind(directory, spec, "cuda" if backend == "ort-cuda" else "cpu", max_context, verify,
                    buckets=(shape_invariant,) if shape_invariant else DEFAULT_BUCKETS, device_id=device, threads=threads,
                    weights=weights)
    if backend == "tensorrt" and has_kv_cache(spec) and _tensorrt_buckets(manifest, spec):
        from .tensorrt_graphs import open_tensorrt_session  # static shapes per q bucket: the same as the GPU graph

        return open_tensorrt_session(directory, manifest, spec, device, rows=shape_invariant)
    session = _open_backend(directory, spec, backend, threads, manifest, max_context, spinning, device)
    if shape_invariant and has_kv_cache(spec):
        from .shape_invariant import ShapeInvariantSession

        return ShapeInvariantSession(session, shape_invariant, max_context)
    return session


def _open_backend(directory: str | Path, spec: GraphSpec, backend: str, threads: int | None, manifest: Manifest,
                  max_context: int | None, spinning: str, device: int) -> Session | FeatureSession:
    if backend not in BACKENDS:
        raise InputError(f"backend must be one of {', '.join(BACKENDS)}, got {backend}", "backend")
    if not has_kv_cache(spec):
        if backend == "tensorrt":
            from .tensorrt import TensorRTFeatureSession

            return TensorRTFeatureSession(directory, manifest, spec, device)
        from .ort import OrtFeatureSession

        return OrtFeatureSession(directory, manifest, spec, backend, threads)
    if spec.extra.get("kv_layout") == "buffer":
        from .ort import OrtBufferSession

        return OrtBufferSession(directory, manifest, spec, backend, threads, max_context, spinning)
    if backend == "tensorrt":
        from .tensorrt_graphs import open_tensorrt_session

        return open_tensorrt_session(directory, manifest, spec, device)
    from .ort import OrtSession

    return OrtSession(directory, manifest, spec, backend, threads, spinning)


def has_kv_cache(spec: GraphSpec) -> bool:
    """True for graphs that take a cache, KV rows or recurrent states (a `Session`); False for feature-only graphs
    (Medusa heads)."""
    return any(name.startswith(("past_key_values", "past_state.")) for name in spec.input_names())


def is_gpu_graph(spec: GraphSpec) -> bool:
    """True for the GPU verify graph (`target.ort-cuda.onnx`: in-place KV, CUDA graphs per q bucket)."""
    return spec.extra.get("kv_layout") == "buffer" and "ort-cuda" in spec.extra.get("backends", ())


def _tensorrt_buckets(manifest: Manifest, spec: GraphSpec) -> bool:
    """True when the graph's TensorRT engine was built with `--profiles buckets` (fixed shapes per q bucket)."""
    from .tensorrt_graphs import engine_bucket_layout

    return engine_bucket_layout(manifest, spec) is not None
