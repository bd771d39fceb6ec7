"""A node writer that names nodes the way torch's ONNX exporter does, for graphs built without tracing.

Nodes are named `<scope>/<Op>[_k]` (`/layers.3/self_attn/MatMul_1`: the k-th node of that type in the
scope, counted from 0 without a suffix) and their outputs `<name>_output_<j>`; constants are `Constant`
nodes of the scope. The contract graph was traced from torch before it was built directly, and the passes
downstream (quantization reports, TensorRT names, calibration tensors) see the same names either way.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

INT64_MAX = np.iinfo(np.int64).max


class GraphBuilder:
    """Nodes and initializers of one graph under construction."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[TensorProto] = []
        self._counts: dict[tuple[str, str], int] = {}
        self._initializer_names: set[str] = set()

    def _name(self, scope: str, op: str) -> str:
        key = (scope, op)
        count = self._counts.get(key, 0)
        self._counts[key] = count + 1
        return f"{scope}/{op}" + (f"_{count}" if count else "")

    def op(self, scope: str, op: str, inputs: list[str], outputs: int | list[str] = 1, domain: str = "",
           **attrs) -> list[str]:
        """Add node `op` in `scope`; returns its output names (`outputs`: a count, or explicit names)."""
        name = self._name(scope, op)
        if isinstance(outputs, int):
            outputs = [f"{name}_output_{j}" for j in range(outputs)]
        self.nodes.append(helper.make_node(op, inputs, outputs, name=name, domain=domain, **attrs))
        return outputs

    def one(self, scope: str, op: str, inputs: list[str], output: str | None = None, **attrs) -> str:
        """Add a one-output node; returns its output (named `output` when given)."""
        return self.op(scope, op, inputs, [output] if output else 1, **attrs)[0]

    def with_last_row(self, scope: str, x: str) -> str:
        """`x` [b, h, rows, n] with a copy of its last row appended (models.decoder._with_last_row)."""
        last = self.one(scope, "Slice", [x, self.const(scope, [-1]), self.const(scope, [INT64_MAX]), self.const(scope, [2]),
                                         self.const(scope, [1])])
        return self.one(scope, "Concat", [x, last], axis=2)

    def const(self, scope: str, value, dtype=np.int64) -> str:
        """A Constant node holding `value`; returns its output."""
        array = np.asarray(value, dtype=dtype)
        return self.one(scope, "Constant", [], value=numpy_helper.from_array(array))

    def initializer(self, tensor: TensorProto) -> str:
        """Add `tensor` as an initializer (once per name); returns its name."""
        if tensor.name not in self._initializer_names:
            self._initializer_names.add(tensor.name)
            self.initializers.append(tensor)
        return tensor.name

    def model(self, name: str, inputs: list[onnx.ValueInfoProto], outputs: list[onnx.ValueInfoProto],
              opsets: dict[str, int]) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, name, inputs, outputs, self.initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()])
        model.producer_name = "speccompile"
        return model


def value(name: str, elem: int, shape: list) -> onnx.ValueInfoProto:
    """A graph input/output declaration (ints are fixed dims, strings named dynamic axes)."""
    return helper.make_tensor_value_info(name, elem, shape)
