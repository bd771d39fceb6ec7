"""Weights resident once for several ONNX Runtime sessions of one artifact (the GPU graph and its slotted form).

Every ONNX Runtime session holds its own copy of each initializer on its device, so a server that opens the GPU verify
graph (`target.ort-cuda.onnx`) and its slotted form (`target.ort-cuda-slots.onnx`) would hold the model's weights
twice on the GPU. Both graphs are written over the same weight files (export/ort_fused_graph.py): they name the same
external tensors at the same file offsets. `SharedWeights` allocates each tensor that two or more of its graphs name
with the same key (`TensorKey`: name, element type, shape, file, offset, length: the same bytes by construction) once,
on the sessions' device, and gives it to every session of those graphs with `SessionOptions.add_initializer`.

ONNX Runtime uses a user-supplied initializer in place when it lives on the device the session plans it on
(session_state_utils.cc `use_user_supplied_initializer`; otherwise it warns and loads its own copy), and refuses a
tensor that owns its buffer ("Buffer containing the initializer must be owned by the user"): a tensor allocated on the
device by ONNX Runtime does, so each is handed over as a DLPack view of it (`OrtValue.from_dlpack`), which does not.
Tensors stored inline in a graph (small constants) stay each session's own. docs/gpu.md, "One copy of the weights".
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, NamedTuple, Sequence

import numpy as np

from ...manifest import GraphSpec, Manifest, variant_name
from ...weights_file import StoredBytes, external_location, external_tensor, load_graph, read_tensor

_SHARED_TYPES = {1, 2, 3, 6, 7, 10, 11, 16}  # ONNX element types: float, uint8, int8, int32, int64, float16, double, bfloat16
BFLOAT16 = 16  # the one element type shared that numpy has no type for (ml_dtypes' bfloat16 is read as uint16)


class TensorKey(NamedTuple):
    """An external initializer as a graph names it: two keys are equal only for the same bytes of the same file."""

    name: str
    data_type: int
    dims: tuple[int, ...]
    location: Path  # the weight file, resolved
    offset: int
    length: int


def external_initializers(path: Path) -> dict[str, TensorKey]:
    """The external initializers of the graph at `path` (of the element types shared), by name."""
    keys: dict[str, TensorKey] = {}
    for tensor in load_graph(path).graph.initializer:
        stored = external_location(tensor)
        if stored is not None and tensor.data_type in _SHARED_TYPES:
            keys[tensor.name] = TensorKey(tensor.name, tensor.data_type, tuple(int(d) for d in tensor.dims),
                                          (path.parent / stored.location).resolve(), stored.offset, stored.length)
    return keys


def device_tensor(host: np.ndarray, data_type: int, device: str, device_id: int = 0):
    """A tensor of ONNX element type `data_type` allocated by ONNX Runtime on `device` ("cpu" | "cuda"), holding
    `host`'s bytes (`host`: of that numpy type, or for bfloat16, which numpy lacks, uint16)."""
    import onnxruntime as ort

    host = np.ascontiguousarray(host)
    if data_type == BFLOAT16:  # the element type given as ONNX's, the bytes copied from a host tensor of that type
        value = ort.OrtValue.ortvalue_from_shape_and_type(list(host.shape), data_type, device, device_id)
        value.update_inplace(ort.OrtValue.ortvalue_from_numpy_with_onnx_type(host, data_type))
        return value
    value = ort.OrtValue.ortvalue_from_shape_and_type(list(host.shape), host.dtype, device, device_id)
    value.update_inplace(host)
    return value


class SharedWeights:
    """The tensors that two or more of `files` (graphs in `directory`) name with the same `TensorKey`, each allocated
    once on `device` when a session first asks for it (`add_to`) and kept for as long as this object lives (the
    sessions given them must not outlive it)."""

    def __init__(self, directory: str | Path, files: Sequence[str], device: str = "cpu", device_id: int = 0):
        self.device, self.device_id = device, device_id
        self.graphs = {name: external_initializers(Path(directory) / name) for name in files}
        seen = Counter(key for keys in self.graphs.values() for key in keys.values())
        self.keys = {key for key, count in seen.items() if count > 1}
        self._values: dict[TensorKey, tuple[Any, Any]] = {}  # key -> (the allocated tensor, the view sessions get)
        self.sessions = 0  # sessions given the shared tensors

    @property
    def names(self) -> set[str]:
        """Names of the tensors shared."""
        return {key.name for key in self.keys}

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors shared (allocated once, not once per session)."""
        return sum(key.length for key in self.keys)

    def value(self, name: str):
        """The shared tensor named `name`, as sessions are given it (one buffer: writing it changes what they read)."""
        return self._view(next(key for key in self.keys if key.name == name))

    def add_to(self, options, graph: str) -> int:
        """Give `options` (the session options of graph file `graph`, one of `files`) every shared tensor it names;
        returns how many."""
        keys = [key for key in self.graphs.get(graph, {}).values() if key in self.keys]
        for key in keys:
            options.add_initializer(key.name, self._view(key))
        self.sessions += bool(keys)
        return len(keys)

    def _view(self, key: TensorKey):
        """The tensor of `key` as sessions take it: a DLPack view of the tensor allocated once (ONNX Runtime takes
        only initializers whose buffer the caller owns)."""
        import onnxruntime as ort

        if key not in self._values:
            proto = _external_proto(key)
            host = read_tensor(proto, key.location.parent)
            host = host.view(np.uint16) if key.data_type == BFLOAT16 else host
            value = device_tensor(host, key.data_type, self.device, self.device_id)
            self._values[key] = (value, ort.OrtValue.from_dlpack(value))
        return self._values[key][1]


def _external_proto(key: TensorKey):
    """The TensorProto that `read_tensor` reads `key`'s bytes from."""
    return external_tensor(key.name, key.data_type, key.dims, StoredBytes(key.location.name, key.offset, key.length))


def gpu_form_weights(directory: str | Path, manifest: Manifest, backend: str, target: GraphSpec,
                     device_id: int = 0) -> SharedWeights | None:
    """The pool the target's GPU-form sessions share on the GPU when the backend is ort-cuda, `target` is the GPU
    verify graph and the artifact also has its slotted form (a server opens both: runtime/session.py
    `Runner._gpu_slot_decoder`); None otherwise. Not on the CPU EP: it maps 64 KiB-aligned external tensors from
    their file in place already, and prepacks each MatMul weight into a copy of each session's own, which a shared
    initializer does not avoid (docs/gpu.md, "One copy of the weights")."""
    single, slotted = (manifest.graphs.get(variant_name("target", form)) for form in ("cuda", "cuda-slots"))
    if backend != "ort-cuda" or single is None or slotted is None or target.file != single.file or not makes_views():
        return None
    return SharedWeights(directory, [target.file, slotted.file], "cuda", device_id)


def makes_views() -> bool:
    """Whether the installed onnxruntime's Python `OrtValue` makes DLPack views (`OrtValue.from_dlpack`, onnxruntime
    PR #27980, 2026-04): without one, a tensor ONNX Runtime allocated cannot be given as an initializer, and each
    session loads its own copy as before (a property of the library, not of our objects)."""
    import onnxruntime as ort

    return hasattr(ort.OrtValue, "from_dlpack")
