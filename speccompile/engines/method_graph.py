"""The graph edits of the quantization methods (engines/methods.py): an input scale s folded where it leaves the
float function unchanged, and the low-rank side branch.

`fold_target` finds, from the structure alone, where the 1/s of an activation's input scale can go exactly: the
RMSNorm weight that produced the activation, or the output columns of the MatMul whose Split half produced it
(the gated MLP's up projection); otherwise a Mul(x, 1/s) is inserted. Knowing the target before any weight is read
lets a streaming build load together the weights one fold ties together (engines/quantize_graph.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .initializers import Initializers
from .qdq_targets import LOW_RANK_SUFFIXES, add_side_branch, float16_constant


@dataclass(frozen=True)
class FoldTarget:
    """Where an input scale's 1/s goes: an initializer's values (a norm weight: `columns` None) or a range of a
    weight's output columns."""

    initializer: str
    columns: tuple[int, int] | None = None

    @property
    def kind(self) -> str:
        return "norm weight" if self.columns is None else "previous matmul"


def _graph_maps(graph: onnx.GraphProto):
    inits = {i.name: i for i in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}
    uses: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            uses[name] = uses.get(name, 0) + 1
    return inits, producers, uses


def fold_target(model: onnx.ModelProto, act: str, readers: list[onnx.NodeProto], channels: int) -> FoldTarget | None:
    """Where 1/s of a scale over the `channels` input channels of `act` (read by exactly `readers`) folds exactly;
    None: a Mul has to be inserted."""
    graph = model.graph
    inits, producers, uses = _graph_maps(graph)
    producer = producers.get(act)
    only_readers = uses.get(act, 0) == len(readers) and act not in {o.name for o in graph.output}
    if producer is None or producer.op_type != "Mul" or not only_readers:
        return None
    for side in producer.input:
        init = inits.get(side)
        if init is not None and uses.get(side) == 1 and int(np.prod(init.dims)) == channels:
            return FoldTarget(side)
    for side in producer.input:
        column = _split_columns(side, producers, inits, uses)
        if column is not None and column[2] - column[1] == channels:
            return FoldTarget(column[0], (column[1], column[2]))
    return None


def fold_input_scale(model: onnx.ModelProto, act: str, scale: np.ndarray, readers: list[onnx.NodeProto],
                     weights: Initializers) -> tuple[str, str]:
    """Make `readers` see act / scale (initializer values through `weights`). Returns (tensor they now read, where
    1/scale went)."""
    graph = model.graph
    target = fold_target(model, act, readers, scale.size)
    inits = {i.name: i for i in graph.initializer}
    if target is not None:
        stored = weights.value(target.initializer)
        value = stored.astype(np.float32)
        if target.columns is None:
            value = value / scale.reshape(value.shape)
        else:
            value = value.copy()
            value[:, target.columns[0]:target.columns[1]] /= scale[None, :]
        weights.set(target.initializer, value.astype(stored.dtype))
        return act, target.kind
    taken = {n for node in graph.node for n in (*node.input, *node.output)} | set(inits)
    inv_name, out = f"{act}_inv_input_scale", f"{act}_scaled"
    while inv_name in taken or out in taken:
        inv_name, out = inv_name + "_", out + "_"
    dtype = helper.tensor_dtype_to_np_dtype(inits[readers[0].input[1]].data_type)  # the activation's float type
    weights.add(numpy_helper.from_array((1.0 / scale).astype(dtype), inv_name))
    mul = helper.make_node("Mul", [act, inv_name], [out], name=f"{act}/InputScale")
    first = min(list(graph.node).index(r) for r in readers)
    graph.node.insert(first, mul)
    for reader in readers:
        reader.input[0] = out
    return out, "mul"


def _split_columns(tensor: str, producers, inits, uses) -> tuple[str, int, int] | None:
    """(weight, first column, end column) when `tensor` is one output of a last-axis Split of MatMul(x, weight)."""
    split = producers.get(tensor)
    if split is None or split.op_type != "Split" or uses.get(tensor) != 1 or len(split.input) < 2:
        return None
    axis = next((a.i for a in split.attribute if a.name == "axis"), 0)
    matmul = producers.get(split.input[0])
    if matmul is None or matmul.op_type != "MatMul" or matmul.input[1] not in inits:
        return None
    if uses.get(split.input[0]) != 1 or axis not in (-1, 1, 2):
        return None
    sizes = _constant(split.input[1], producers, inits)
    if sizes is None:
        return None
    sizes = sizes.astype(int).tolist()
    index = list(split.output).index(tensor)
    start = int(sum(sizes[:index]))
    return matmul.input[1], start, start + int(sizes[index])


def _constant(name: str, producers, inits) -> np.ndarray | None:
    """The value of an initializer or Constant-node output, else None."""
    if name in inits:
        return numpy_helper.to_array(inits[name])
    node = producers.get(name)
    if node is not None and node.op_type == "Constant":
        value = next((a for a in node.attribute if a.name == "value"), None)
        return numpy_helper.to_array(value.t) if value is not None else None
    return None


def insert_low_rank_branch(graph: onnx.GraphProto, matmul: onnx.NodeProto, weight: str, a: np.ndarray, b: np.ndarray,
                           dtype: np.dtype, weights: Initializers) -> None:
    """After `matmul` (y = x W): y = (x W) + (x A) B, A and B float16 behind their Casts (added through `weights`)."""
    factors = []
    at = list(graph.node).index(matmul)
    for suffix, value in zip(LOW_RANK_SUFFIXES, (a, b)):
        init, cast, name = float16_constant(weight + suffix, value, helper.np_dtype_to_tensor_dtype(np.dtype(dtype)))
        weights.add(init)
        for node in cast:
            graph.node.insert(at, node)
            at += 1
        factors.append(name)
    add_side_branch(graph, matmul, factors[0], factors[1], "low_rank")
