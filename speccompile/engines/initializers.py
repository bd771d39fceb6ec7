"""How the passes read and change a graph's initializer values: through `Initializers`, never by editing the
TensorProtos in place.

A ModelProto keeps every bytes field it was ever given in its arena (python protobuf's upb backend frees the arena
with the message, not before): replacing a weight's `raw_data` in a long-lived model grows memory by the weight each
time. `ModelInitializers` is the plain in-memory model (the whole-model passes, tests); the streaming build's
`WorkingGraph` (engines/working_graph.py) keeps changed values as numpy arrays beside the structure and writes them
out, so the model's arena holds only structure.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import onnx
from onnx import numpy_helper


class Initializers(Protocol):
    """The values of a graph's initializers: read, replaced (same name and element type), or added."""

    def value(self, name: str) -> np.ndarray:
        """The current value (its element type as stored)."""

    def set(self, name: str, value: np.ndarray) -> None:
        """Replace the value of initializer `name`."""

    def add(self, tensor: onnx.TensorProto) -> None:
        """A new initializer of the graph (built outside the model: its bytes go wherever the values live)."""


class ModelInitializers:
    """A model's initializers with their data in the proto (a model held whole in memory)."""

    def __init__(self, model: onnx.ModelProto):
        self.model = model

    def _find(self, name: str) -> onnx.TensorProto:
        for init in self.model.graph.initializer:
            if init.name == name:
                return init
        raise KeyError(name)

    def value(self, name: str) -> np.ndarray:
        return numpy_helper.to_array(self._find(name))

    def set(self, name: str, value: np.ndarray) -> None:
        self._find(name).CopyFrom(numpy_helper.from_array(np.asarray(value), name))

    def add(self, tensor: onnx.TensorProto) -> None:
        self.model.graph.initializer.append(tensor)
