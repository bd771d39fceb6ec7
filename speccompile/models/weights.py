"""Checkpoint weights by Hugging Face name, read one tensor at a time from the memory-mapped file.

`WeightSource` is what the loaders return: it knows every tensor's shape and storage type from the file
headers alone, and `read(name)` returns one tensor as a numpy array (a read-only memory map of the
checkpoint where the file stores it as is). Nothing is read before it is asked for, and nothing read is
kept: a pass over every weight (the exporter writing the graph's external data) holds one tensor at a
time, so its memory is bounded by the largest tensor, not by the model.

Three sources: safetensors files (headers parsed here, tensors mapped with `np.memmap`), GGUF files
(gguf's memory-mapped reader, quantized types dequantized per tensor, llama.cpp's q/k row order undone per
tensor) and `ArraySource` (arrays already in memory: tests, heads). `to_torch()` materialises torch tensors
for the code that needs the torch reference model (training, tests, `build_decoder`).
"""

from __future__ import annotations

import json
import struct
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from ..errors import InputError


def _bfloat16():
    import ml_dtypes

    return ml_dtypes.bfloat16


# safetensors dtype name -> numpy dtype (ml_dtypes' bfloat16 / float8 for the types numpy lacks)
_SAFETENSORS_TYPES: dict[str, Callable[[], Any]] = {
    "F64": lambda: np.float64, "F32": lambda: np.float32, "F16": lambda: np.float16, "BF16": _bfloat16,
    "I64": lambda: np.int64, "I32": lambda: np.int32, "I16": lambda: np.int16, "I8": lambda: np.int8,
    "U8": lambda: np.uint8, "BOOL": lambda: np.bool_,
}


@dataclass(frozen=True)
class TensorInfo:
    """A tensor's shape and the numpy dtype it is stored as (float32 for dequantized GGUF types)."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


class WeightSource(ABC, Mapping[str, np.ndarray]):
    """Tensors by Hugging Face name; `source[name]` (= `read(name)`) reads one, nothing is cached."""

    @abstractmethod
    def info(self, name: str) -> TensorInfo:
        """Shape and storage dtype of tensor `name` (KeyError if there is none), without reading it."""

    @abstractmethod
    def read(self, name: str) -> np.ndarray:
        """Tensor `name` as a numpy array (possibly a read-only memory map: copy it to write to it)."""

    @abstractmethod
    def names(self) -> list[str]:
        """Every tensor name, in file order."""

    def __getitem__(self, name: str) -> np.ndarray:
        return self.read(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def __contains__(self, name: object) -> bool:
        try:
            self.info(str(name))
        except KeyError:
            return False
        return True

    def shape(self, name: str) -> tuple[int, ...]:
        return self.info(name).shape

    def read_float32(self, name: str) -> np.ndarray:
        """Tensor `name` converted to float32 (a new array)."""
        return np.asarray(self.read(name), dtype=np.float32)

    def nbytes(self) -> int:
        """Bytes of every tensor as stored (what reading all of them reads)."""
        return sum(self.info(n).nbytes for n in self.names())

    def torch_tensor(self, name: str):
        """Tensor `name` as a torch tensor of its storage dtype (bfloat16 included), owning its memory."""
        import torch

        array = self.read(name)
        if array.dtype == _bfloat16():
            return torch.from_numpy(np.array(array.view(np.int16))).view(torch.bfloat16)
        return torch.from_numpy(np.array(array))

    def to_torch(self) -> dict[str, Any]:
        """Every tensor as torch (the whole model in memory: for the torch reference, training and tests)."""
        return {name: self.torch_tensor(name) for name in self.names()}

    def without(self, dropped: set[str]) -> "WeightSource":
        """This source minus the tensors named in `dropped`."""
        return _Filtered(self, dropped)

    def renamed(self, names: Mapping[str, str]) -> "WeightSource":
        """This source with tensor `old` shown as `names[old]` (nothing read)."""
        return _Renamed(self, dict(names)) if names else self


    def with_arrays(self, arrays: Mapping[str, Any]) -> "WeightSource":
        """This source plus `arrays` (in memory) under their names."""
        return _Joined(self, ArraySource(arrays))


class _Joined(WeightSource):
    def __init__(self, inner: WeightSource, extra: WeightSource):
        self._inner, self._extra = inner, extra

    def _of(self, name: str) -> WeightSource:
        return self._extra if name in self._extra.names() else self._inner

    def info(self, name: str) -> TensorInfo:
        return self._of(name).info(name)

    def read(self, name: str) -> np.ndarray:
        return self._of(name).read(name)

    def names(self) -> list[str]:
        return [*self._inner.names(), *self._extra.names()]


class _Renamed(WeightSource):
    def __init__(self, inner: WeightSource, names: dict[str, str]):
        self._inner = inner
        self._old = {names.get(n, n): n for n in inner.names()}

    def info(self, name: str) -> TensorInfo:
        return self._inner.info(self._old[name])

    def read(self, name: str) -> np.ndarray:
        return self._inner.read(self._old[name])

    def names(self) -> list[str]:
        return list(self._old)


class _Filtered(WeightSource):
    def __init__(self, inner: WeightSource, dropped: set[str]):
        self._inner = inner
        self._names = [n for n in inner.names() if n not in dropped]
        self._kept = set(self._names)

    def info(self, name: str) -> TensorInfo:
        if name not in self._kept:
            raise KeyError(name)
        return self._inner.info(name)

    def read(self, name: str) -> np.ndarray:
        self.info(name)
        return self._inner.read(name)

    def names(self) -> list[str]:
        return list(self._names)


class ArraySource(WeightSource):
    """Arrays (numpy or torch) held in memory, under their names."""

    def __init__(self, arrays: Mapping[str, Any]):
        self._arrays = {name: _as_numpy(value) for name, value in arrays.items()}

    def info(self, name: str) -> TensorInfo:
        array = self._arrays[name]
        return TensorInfo(tuple(array.shape), array.dtype)

    def read(self, name: str) -> np.ndarray:
        return self._arrays[name]

    def names(self) -> list[str]:
        return list(self._arrays)


def _as_numpy(value: Any) -> np.ndarray:
    """A numpy view of a numpy array or a (CPU) torch tensor; torch bfloat16 becomes ml_dtypes' bfloat16."""
    if isinstance(value, np.ndarray):
        return value
    import torch

    tensor = value.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        return tensor.contiguous().view(torch.int16).numpy().view(_bfloat16())
    return tensor.numpy()


def describe_key_mismatch(missing: list[str], unexpected: list[str], shown: int = 6) -> str:
    """'missing keys: a, b ...; unexpected keys: c' for checkpoint errors."""
    parts = []
    for label, keys in (("missing keys", missing), ("unexpected keys", unexpected)):
        if keys:
            parts.append(f"{label}: {', '.join(keys[:shown])}{' ...' if len(keys) > shown else ''}")
    return "; ".join(parts)


# ---------------------------------------------------------------------------------------- safetensors

@dataclass(frozen=True)
class _Stored:
    path: Path
    offset: int  # from the start of the file
    info: TensorInfo


class SafetensorsSource(WeightSource):
    """The tensors of one or more safetensors files (a sharded checkpoint), mapped per tensor on reading.

    The headers are parsed here (8-byte little-endian length, then JSON: dtype, shape, data_offsets), so that
    opening reads a few kilobytes per shard; a header that is not valid, a dtype we do not read, or a tensor
    past the end of its file (a truncated download) is an InputError naming the file."""

    def __init__(self, files: list[Path]):
        self._tensors: dict[str, _Stored] = {}
        for path in files:
            self._tensors.update(_safetensors_header(Path(path)))

    def info(self, name: str) -> TensorInfo:
        return self._tensors[name].info

    def read(self, name: str) -> np.ndarray:
        stored = self._tensors[name]
        info = stored.info
        if info.nbytes == 0:
            return np.zeros(info.shape, info.dtype)
        return np.memmap(stored.path, dtype=info.dtype, mode="r", offset=stored.offset, shape=info.shape or (1,)).reshape(info.shape)

    def names(self) -> list[str]:
        return list(self._tensors)


def _safetensors_header(path: Path) -> dict[str, _Stored]:
    """Name -> where and what, from one safetensors file's header; InputError on anything malformed."""

    def bad(why: str) -> InputError:
        return InputError(f"{path}: not a readable safetensors file ({why})")

    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise bad("shorter than its 8-byte header length")
            (length,) = struct.unpack("<Q", head)
            if length > min(size - 8, 100 << 20):
                raise bad(f"header length {length} does not fit the file")
            header = json.loads(fh.read(length))
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise bad("its header is not JSON") from None
    if not isinstance(header, dict):
        raise bad("its header is not a JSON object")
    tensors: dict[str, _Stored] = {}
    data_start = 8 + length
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _SAFETENSORS_TYPES[entry["dtype"]]()
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(v) for v in entry["data_offsets"])
        except KeyError as exc:
            raise bad(f"tensor {name}: unknown dtype or missing {exc}") from None
        except (TypeError, ValueError):
            raise bad(f"tensor {name}: malformed entry") from None
        info = TensorInfo(shape, np.dtype(dtype))
        if end - begin != info.nbytes or data_start + end > size:
            raise bad(f"tensor {name} ends past the end of the file: truncated?")
        tensors[name] = _Stored(path, data_start + begin, info)
    return tensors


# ----------------------------------------------------------------------------------------------- GGUF

class GGUFSource(WeightSource):
    """The tensors of a GGUF file under their Hugging Face names, dequantized to float32 one at a time (each read
    from a memory map of its own bytes, released after).

    `rename(gguf_name)` gives a tensor's HF name (None: skipped, listed in `skipped`); a name with `*` is a stack along the leading
    axis (llama.cpp's 3-D MoE experts), shown as one tensor per index. `unpermute(gguf_name)` gives the head count
    whose interleaved-RoPE row permutation to undo (llama.cpp's q/k order), or None."""

    def __init__(self, reader, path: Path, rename: Callable[[str], str | None],
                 unpermute: Callable[[str], int | None]):
        self._path = path
        self._tensors: dict[str, tuple[Any, int | None]] = {}  # HF name -> (tensor, index along its leading axis)
        self._heads: dict[str, int | None] = {}
        self.skipped: list[str] = []  # the file's tensors `rename` gives no name
        for tensor in reader.tensors:
            hf = rename(tensor.name)
            if hf is None:
                self.skipped.append(tensor.name)
                continue
            indices = range(int(tensor.shape[-1])) if "*" in hf else [None]
            for index in indices:
                part = hf if index is None else hf.replace("*", str(index))
                self._tensors[part] = (tensor, index)
                self._heads[part] = unpermute(tensor.name)

    def info(self, name: str) -> TensorInfo:
        tensor, index = self._tensors[name]
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        if index is not None:
            shape = shape[1:]
        elif len(shape) == 1 and name.endswith("shared_expert_gate.weight"):
            shape = (1, *shape)  # llama.cpp keeps Qwen2-MoE's [1, hidden] shared-expert gate as [hidden]
        elif len(shape) == 2 and shape[0] == 1 and name.endswith("bias"):
            shape = shape[1:]  # a bias is 1-D (llama.cpp keeps ERNIE 4.5 MoE's score bias [1, experts])
        elif len(shape) == 2 and name.endswith(("conv.conv.weight", "conv1d.weight")):
            shape = (shape[0], 1, shape[1])  # llama.cpp keeps a depthwise conv [channels, 1, kernel] as [channels, kernel] (LFM2, Mamba-2)
        elif len(shape) == 2 and name.endswith(tuple(f"{m}.{t}" for m in ("mamba", "mixer") for t in ("A_log", "D", "norm.weight"))) \
                and (shape[1] == 1 or name.endswith("norm.weight")):  # (Mamba-1's A_log [inner, d_state] stays 2-D)
            shape = (shape[0] * shape[1],)  # llama.cpp's Mamba-2 A and D [heads, 1], the gated norm's gain [groups, inner / groups] (Nemotron-H: mixer.)
        return TensorInfo(shape, np.dtype(np.float32))

    def read(self, name: str) -> np.ndarray:
        import gguf

        tensor, index = self._tensors[name]
        try:  # a map of this tensor's bytes alone: its pages leave the resident set when it is dropped
            data = np.memmap(self._path, dtype=tensor.data.dtype, mode="r", offset=tensor.data_offset, shape=tensor.data.shape)
            array = gguf.quants.dequantize(data if index is None else data[index], tensor.tensor_type)
        except NotImplementedError:
            raise InputError(f"{self._path}: tensor {tensor.name} has unsupported type {tensor.tensor_type.name}") from None
        except Exception as exc:  # truncated data surfaces here as reshape errors
            raise InputError(f"{self._path}: tensor {tensor.name} is unreadable ({exc})") from None
        info = self.info(name)
        array = np.asarray(array, dtype=np.float32).reshape(info.shape)
        heads = self._heads[name]
        return unpermute_rope(array, heads) if heads else array

    def names(self) -> list[str]:
        return list(self._tensors)


def unpermute_rope(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaved-RoPE row permutation of q/k projections (Llama-style GGUF)."""
    rows = weight.shape[0]
    return np.ascontiguousarray(
        weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )
