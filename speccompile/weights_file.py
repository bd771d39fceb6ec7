"""External weight files of ONNX graphs, written one tensor at a time and read back as memory maps.

A graph's initializers live in a `<graph>.onnx.data` file beside it (ONNX external data: each TensorProto
names the file, an offset and a length). Writing goes through `WeightsWriter`: a tensor's bytes are appended
as soon as they exist and may be dropped right after, so the memory a graph takes to write is one tensor,
not the model; the sha256 the manifest records is computed on the way, so the file is never read back to
checksum it. Large tensors start on 64 KiB boundaries, which lets ONNX Runtime map them instead of copying
them (it maps an external initializer whose offset is a multiple of the allocation granularity: 4 KiB on
Linux, 64 KiB on Windows).

Reading goes through `read_tensor`: an external tensor comes back as a read-only `np.memmap` of its bytes,
so a pass over every weight of a model (a streaming build, a parity check) holds one weight at a time.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterable, NamedTuple

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ALIGN_LARGE = 1 << 16  # offset alignment of tensors of at least LARGE_TENSOR bytes (mappable everywhere)
ALIGN_SMALL = 64  # of the others (cache line)
LARGE_TENSOR = 1 << 16


@dataclass(frozen=True)
class StoredBytes:
    """Where a tensor's bytes are in an external data file."""

    location: str  # file name, relative to the graph
    offset: int
    length: int


def external_tensor(name: str, data_type: int, dims: tuple[int, ...] | list[int], stored: StoredBytes) -> TensorProto:
    """A TensorProto whose data is `stored` (no bytes in the proto)."""
    tensor = TensorProto()
    tensor.name = name
    tensor.data_type = data_type
    tensor.dims.extend(int(d) for d in dims)
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", stored.location), ("offset", str(stored.offset)), ("length", str(stored.length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    return tensor


class Piece(NamedTuple):
    """`nbytes` of a tensor that `fill(buffer)` writes into a uint8 buffer the writer lends (`add_chunks`):
    converting into reused memory costs a fraction of allocating the converted piece afresh."""

    nbytes: int
    fill: Callable[[np.ndarray], None]


def tensor_type_of(array: np.ndarray) -> int:
    """The ONNX data type of a numpy array (ml_dtypes' bfloat16 / float8 types included)."""
    return helper.np_dtype_to_tensor_dtype(array.dtype)


class WeightsWriter:
    """Appends tensors to one external data file; `close()` returns its sha256.

    `add` writes an array and returns its TensorProto; `add_bytes` writes already-encoded bytes (packed 4-bit
    codes, FP8) under an explicit data type and shape; `add_chunks` writes a tensor from consecutive pieces
    (a large weight converted a slice at a time). `stored(name)` tells where a tensor written earlier is,
    so another graph can point at the same bytes instead of writing them again.

    `threaded`: hashing and writing happen on a thread of their own (both release the GIL), so a caller that
    converts the next piece meanwhile keeps two cores busy; at most `QUEUED` pieces wait, which bounds the
    memory they hold. The caller must not modify an array it handed over until `close()`. A `Piece` is
    filled into one of `QUEUED + 2` buffers the writer reuses (a buffer goes back to the pool once written)."""

    QUEUED = 4

    def __init__(self, path: Path, threaded: bool = False):
        self.path = Path(path)
        self.location = self.path.name
        self._file: BinaryIO | None = open(self.path, "wb")
        self._digest = hashlib.sha256()
        self._size = 0
        self._stored: dict[str, StoredBytes] = {}
        self._sha256: str | None = None
        self._queue: queue.Queue | None = None
        self._failure: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._buffers: queue.Queue = queue.Queue()
        for _ in range(self.QUEUED + 2):
            self._buffers.put(np.empty(0, np.uint8))
        if threaded:
            self._queue = queue.Queue(maxsize=self.QUEUED)
            self._thread = threading.Thread(target=self._drain, name=f"write {self.location}", daemon=True)
            self._thread.start()

    def __enter__(self) -> "WeightsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def size(self) -> int:
        return self._size

    def add(self, name: str, array: np.ndarray) -> TensorProto:
        """Write `array` (C order, little-endian) as initializer `name`."""
        array = np.asarray(array)
        return self.add_chunks(name, tensor_type_of(array), array.shape, [array], array.nbytes)

    def add_bytes(self, name: str, data: bytes | memoryview, data_type: int, dims: tuple[int, ...] | list[int]) -> TensorProto:
        """Write encoded bytes as initializer `name` of `data_type` and shape `dims`."""
        return self.add_chunks(name, data_type, dims, [data], len(data))

    def add_chunks(self, name: str, data_type: int, dims: tuple[int, ...] | list[int],
                   chunks: Iterable[np.ndarray | bytes | memoryview | Piece], length: int) -> TensorProto:
        """Write initializer `name` (`data_type`, shape `dims`, `length` bytes in all) from consecutive pieces:
        C-order numpy arrays, bytes, or `Piece`s filled into the writer's buffers. Only the pieces in flight are
        in memory."""
        if self._file is None:
            raise ValueError(f"{self.path}: already closed")
        if name in self._stored:
            raise ValueError(f"{name}: written twice to {self.path.name}")
        self._pad(ALIGN_LARGE if length >= LARGE_TENSOR else ALIGN_SMALL)
        stored = StoredBytes(self.location, self._size, length)
        for chunk in chunks:
            if isinstance(chunk, Piece):
                self._write_piece(chunk)
            else:
                self._write(_as_bytes(chunk))
        if self._size - stored.offset != length:
            raise ValueError(f"{name}: {self._size - stored.offset} bytes written to {self.path.name}, expected {length}")
        self._stored[name] = stored
        return external_tensor(name, data_type, dims, stored)

    def stored(self, name: str) -> StoredBytes:
        """Where tensor `name` was written (KeyError if it was not)."""
        return self._stored[name]

    def has(self, name: str) -> bool:
        return name in self._stored

    def close(self) -> str:
        """Flush and close; returns the file's sha256 (hex). Closing twice returns the same digest."""
        if self._file is not None:
            if self._thread is not None:
                assert self._queue is not None
                self._queue.put(None)
                self._thread.join()
                self._thread = None
            file, self._file = self._file, None
            try:
                file.close()  # flushes the last buffered bytes: where a full disk often shows
            except OSError as exc:
                raise self._located(exc) from None
            self._raise_failure()
            self._sha256 = self._digest.hexdigest()
        assert self._sha256 is not None
        return self._sha256

    @property
    def sha256(self) -> str:
        if self._sha256 is None:
            raise ValueError(f"{self.path}: sha256 is known once the file is closed")
        return self._sha256

    def _pad(self, alignment: int) -> None:
        extra = (-self._size) % alignment
        if extra:
            self._write(bytes(extra))

    def _write_piece(self, piece: Piece) -> None:
        """Fill a pooled buffer (waiting for one the writer thread has finished with) and write it."""
        buffer = self._buffers.get()
        if len(buffer) < piece.nbytes:
            buffer = np.empty(piece.nbytes, np.uint8)
        view = buffer[:piece.nbytes]
        piece.fill(view)
        self._write(memoryview(view), buffer)

    def _write(self, data: bytes | memoryview, pooled: np.ndarray | None = None) -> None:
        """Hash and write `data` (on the writer thread when there is one); a `pooled` buffer goes back to the
        pool once written."""
        assert self._file is not None
        self._size += len(data)
        if self._queue is None:
            try:
                self._file.write(data)
            except OSError as exc:
                raise self._located(exc) from None
            self._digest.update(data)
            if pooled is not None:
                self._buffers.put(pooled)
            return
        self._raise_failure()
        self._queue.put((data, pooled))

    def _drain(self) -> None:
        """The writer thread: hash and write pieces in order until the None that `close` sends."""
        assert self._queue is not None and self._file is not None
        while (item := self._queue.get()) is not None:
            data, pooled = item
            if self._failure is None:
                try:
                    self._file.write(data)
                    self._digest.update(data)
                except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
                    self._failure = self._located(exc)
            if pooled is not None:
                self._buffers.put(pooled)

    def _located(self, exc: BaseException) -> BaseException:
        """An OSError of a write (a full disk) names the file it was writing, as one of `open` does."""
        if isinstance(exc, OSError) and exc.filename is None and exc.errno is not None:
            return OSError(exc.errno, exc.strerror or str(exc), str(self.path))
        return exc

    def _raise_failure(self) -> None:
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure


def _as_bytes(chunk: np.ndarray | bytes | memoryview) -> bytes | memoryview:
    """A piece's bytes without copying (a numpy array: C order, little-endian)."""
    if isinstance(chunk, np.ndarray):
        if not chunk.flags.c_contiguous:
            chunk = chunk.copy(order="C")
        if chunk.dtype.byteorder == ">":
            chunk = chunk.astype(chunk.dtype.newbyteorder("<"))
        return memoryview(chunk.reshape(-1).view(np.uint8))
    return chunk


# ----------------------------------------------------------------------------------------------- reading

_NUMPY_TYPES = {
    TensorProto.FLOAT: np.float32,
    TensorProto.FLOAT16: np.float16,
    TensorProto.DOUBLE: np.float64,
    TensorProto.INT8: np.int8,
    TensorProto.UINT8: np.uint8,
    TensorProto.INT16: np.int16,
    TensorProto.UINT16: np.uint16,
    TensorProto.INT32: np.int32,
    TensorProto.UINT32: np.uint32,
    TensorProto.INT64: np.int64,
    TensorProto.UINT64: np.uint64,
    TensorProto.BOOL: np.bool_,
}


def _ml_dtype(data_type: int):
    import ml_dtypes

    return {
        TensorProto.BFLOAT16: ml_dtypes.bfloat16,
        TensorProto.FLOAT8E4M3FN: ml_dtypes.float8_e4m3fn,
        TensorProto.FLOAT8E5M2: ml_dtypes.float8_e5m2,
    }.get(data_type)


def external_location(tensor: TensorProto) -> StoredBytes | None:
    """Where an external tensor's bytes are (None for a tensor held in the proto)."""
    if tensor.data_location != TensorProto.EXTERNAL:
        return None
    info = {entry.key: entry.value for entry in tensor.external_data}
    return StoredBytes(info["location"], int(info.get("offset", 0)), int(info.get("length", -1)))


def read_tensor(tensor: TensorProto, base_dir: Path | str) -> np.ndarray:
    """Tensor values; an external tensor of a plain or ml_dtypes type comes back as a read-only memory map.

    Packed sub-byte types (INT4, UINT4, FLOAT4E2M1) come back as their raw bytes (uint8, one byte per two
    values), since numpy has no such element type."""
    stored = external_location(tensor)
    if stored is None:
        return numpy_helper.to_array(tensor)
    path = Path(base_dir) / stored.location
    dtype = _NUMPY_TYPES.get(tensor.data_type) or _ml_dtype(tensor.data_type)
    length = stored.length if stored.length >= 0 else os.path.getsize(path) - stored.offset
    if dtype is None:  # packed 4-bit (or another type numpy cannot hold): the raw bytes
        return np.memmap(path, dtype=np.uint8, mode="r", offset=stored.offset, shape=(length,))
    shape = tuple(int(d) for d in tensor.dims)
    count = int(np.prod(shape)) if shape else 1
    if count * np.dtype(dtype).itemsize != length:
        raise ValueError(f"{tensor.name}: {length} bytes in {stored.location} for shape {shape} of {np.dtype(dtype).name}")
    if count == 0:
        return np.zeros(shape, dtype)
    if not shape:  # a scalar: np.memmap has no 0-d form
        return np.array(np.memmap(path, dtype=dtype, mode="r", offset=stored.offset, shape=(1,))).reshape(())
    return np.memmap(path, dtype=dtype, mode="r", offset=stored.offset, shape=shape)


def load_graph(path: Path | str) -> onnx.ModelProto:
    """The graph structure of an ONNX file without its external weights (read them with `read_tensor`)."""
    return onnx.load(str(path), load_external_data=False)
