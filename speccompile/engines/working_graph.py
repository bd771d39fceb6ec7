"""A graph being rewritten one weight at a time: its structure in memory, each initializer's bytes where they are.

An initializer of the `WorkingGraph` is in one of four places:
  * in the source's external data file, not read yet (every weight, at first; `value` maps it);
  * in the proto (the small ones);
  * staged: a numpy array beside the structure, the value a pass gave it (`set`), never in the proto (a ModelProto's
    arena would keep every replaced value: engines/initializers.py);
  * in the output's external data file (`store`: written through an `ExternalSink` as soon as its value is final;
    `add`: a new initializer of the passes, straight through the sink).
So memory holds the structure, the small tensors and the unit at work. At the end `copy_sources` appends the
initializers nothing changed (embedding tables, excluded weights) to the output file, in pieces. `load_all` puts
every weight in the proto instead, for the passes that need the whole model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from ..weights_file import WeightsWriter, external_location, read_tensor

COPY_CHUNK = 16 << 20  # bytes read at a time when an initializer is copied across
SIZE_THRESHOLD = 1024  # bytes: smaller initializers stay in the proto (onnx.save's size_threshold of the builds before)


class ExternalSink:
    """Initializers of at least `threshold` bytes go to `writer`'s file as they come; smaller ones stay in the proto."""

    def __init__(self, writer: WeightsWriter, threshold: int = SIZE_THRESHOLD):
        self.writer = writer
        self.threshold = threshold

    def put(self, tensor: TensorProto) -> TensorProto:
        if tensor.data_location == TensorProto.EXTERNAL:
            return tensor
        raw = tensor.raw_data if tensor.HasField("raw_data") else numpy_helper.to_array(tensor).tobytes()
        if len(raw) < self.threshold:
            return tensor
        return self.writer.add_bytes(tensor.name, raw, tensor.data_type, tuple(tensor.dims))


class WorkingGraph:
    """The structure of `model` (weights external, in `directory`) and where each initializer's bytes are now; new
    and changed initializers go out through `sink` (an `Initializers`)."""

    def __init__(self, model: onnx.ModelProto, directory: Path, sink: ExternalSink):
        self.model = model
        self.directory = Path(directory)
        self.sink = sink
        self._source = {i.name: _copy(i) for i in model.graph.initializer if i.data_location == TensorProto.EXTERNAL}
        self._written: set[str] = set()
        self._staged: dict[str, np.ndarray] = {}

    def initializers(self) -> dict[str, TensorProto]:
        return {i.name: i for i in self.model.graph.initializer}

    def is_source(self, tensor: TensorProto) -> bool:
        """Whether `tensor`'s bytes are still the source's, unread."""
        return (tensor.data_location == TensorProto.EXTERNAL and tensor.name in self._source
                and tensor.name not in self._written)

    def value(self, name: str) -> np.ndarray:
        """The current value of initializer `name` (a read-only memory map while it is in the source file)."""
        if name in self._staged:
            return self._staged[name]
        init = self.initializers()[name]
        if self.is_source(init):
            return read_tensor(init, self.directory)
        if init.data_location == TensorProto.EXTERNAL:
            raise ValueError(f"{name}: already written out")
        return numpy_helper.to_array(init)

    def tensor(self, name: str) -> TensorProto:
        """Initializer `name` with its data in the proto (a copy, read from the source file if it is still there)."""
        init = self.initializers()[name]
        if not self.is_source(init):
            return _copy(init)
        loaded = _copy(init)
        loaded.ClearField("external_data")
        loaded.data_location = TensorProto.DEFAULT
        loaded.raw_data = np.ascontiguousarray(read_tensor(init, self.directory)).tobytes()
        return loaded

    def set(self, name: str, value: np.ndarray) -> None:
        """Stage a new value of initializer `name` (kept as an array until `store` or `drop`)."""
        self._staged[name] = np.asarray(value)

    def add(self, tensor: TensorProto) -> None:
        """A new initializer: its bytes go through the sink now, the graph lists what the sink returns."""
        self.model.graph.initializer.append(self.sink.put(tensor))

    def load_all(self) -> None:
        """Every weight read into the proto (the whole-model passes then change them in place)."""
        for init in self.model.graph.initializer:
            if self.is_source(init):
                init.CopyFrom(self.tensor(init.name))

    def store(self, names: Iterable[str]) -> None:
        """Write the staged values of `names` out through the sink (values final); unchanged ones stay in the source."""
        for init in self.model.graph.initializer:
            if init.name in self._staged and init.name in set(names):
                written = self.sink.put(numpy_helper.from_array(self._staged.pop(init.name), init.name))
                init.CopyFrom(written)
                self._written.add(init.name)

    def drop(self, names: Iterable[str]) -> None:
        """Forget the staged values of `names` (quantized: the graph will not read them)."""
        for name in names:
            self._staged.pop(name, None)

    def externalize(self) -> None:
        """Every initializer held in the proto that the sink takes goes out (a whole-model build's weights)."""
        for init in self.model.graph.initializer:
            if init.data_location != TensorProto.EXTERNAL:
                written = self.sink.put(init)
                if written is not init:
                    init.CopyFrom(written)
                    self._written.add(init.name)

    def copy_sources(self, writer: WeightsWriter) -> int:
        """Append every initializer still in the source file to `writer`'s file, COPY_CHUNK bytes at a time (plain
        reads: no mapping keeps the pages resident); returns how many."""
        count = 0
        for init in self.model.graph.initializer:
            if not self.is_source(init):
                continue
            stored = external_location(init)
            path = self.directory / stored.location
            length = stored.length if stored.length >= 0 else path.stat().st_size - stored.offset
            init.CopyFrom(writer.add_chunks(init.name, init.data_type, tuple(init.dims), _file_chunks(path, stored.offset, length), length))
            self._written.add(init.name)
            count += 1
        return count


def _file_chunks(path: Path, offset: int, length: int, chunk: int = COPY_CHUNK) -> Iterator[bytes]:
    with open(path, "rb") as fh:
        fh.seek(offset)
        while length > 0:
            data = fh.read(min(chunk, length))
            if not data:
                raise ValueError(f"{path}: ends {length} bytes before the tensor at offset {offset} does")
            length -= len(data)
            yield data


def _copy(tensor: TensorProto) -> TensorProto:
    copy = TensorProto()
    copy.CopyFrom(tensor)
    return copy
