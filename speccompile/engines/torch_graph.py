"""Run an ONNX graph with torch, so gradients reach chosen initializers (quantization-aware distillation).

`TorchGraph` evaluates the graph node by node with torch operations in float32 (float16 / bfloat16 tensors are
computed in float32), its constants prepared once on the chosen torch device (`cpu`, `cuda`, ...). Initializers named in `run(..., replace=...)` are taken from
the caller (e.g. fake-quantized trainable weights) instead of the graph. It covers the standard operators the
exported decoder graphs use; any other operator is an error naming it, never a silent approximation.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import SpecCompileError

_INT64_MAX = 2**63 - 1


def _torch():
    import torch

    return torch


def _dtype(elem: int):
    torch = _torch()
    if elem in (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE):
        return torch.float32
    return {TensorProto.INT64: torch.int64, TensorProto.INT32: torch.int32, TensorProto.BOOL: torch.bool,
            TensorProto.INT8: torch.int8, TensorProto.UINT8: torch.uint8}[elem]


def _as_tensor(array: np.ndarray):
    torch = _torch()
    if array.dtype.kind == "f":
        array = array.astype(np.float32)
    array = np.ascontiguousarray(array)
    return torch.from_numpy(array if array.flags.writeable else array.copy())


def _ints(t) -> list[int]:
    return [int(v) for v in t.reshape(-1).tolist()]


def _axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def _reshape(x, shape):
    target = _ints(shape)
    target = [x.shape[i] if v == 0 else v for i, v in enumerate(target)]
    return x.reshape(target)


def _unsqueeze(x, axes):
    rank = x.dim() + len(_ints(axes))
    for a in sorted(_axis(a, rank) for a in _ints(axes)):
        x = x.unsqueeze(a)
    return x


def _slice(x, starts, ends, axes=None, steps=None):
    starts, ends = _ints(starts), _ints(ends)
    axes = _ints(axes) if axes is not None else list(range(len(starts)))
    steps = _ints(steps) if steps is not None else [1] * len(starts)
    index = [slice(None)] * x.dim()
    for s, e, a, st in zip(starts, ends, axes, steps):
        if st != 1:
            raise SpecCompileError(f"torch graph: Slice with step {st} is not supported")
        size = x.shape[_axis(a, x.dim())]
        index[_axis(a, x.dim())] = slice(max(min(s, size), -size), min(e, size) if e < _INT64_MAX else None)
    return x[tuple(index)]


def _split(x, split=None, *, axis=0, num_outputs=None, count=1):
    torch = _torch()
    if split is not None:
        return torch.split(x, _ints(split), dim=axis)
    return torch.chunk(x, num_outputs or count, dim=axis)


def _gather(data, indices, *, axis=0):
    axis = _axis(axis, data.dim())
    idx = indices.long()
    idx = idx + (idx < 0) * data.shape[axis]
    out = data.index_select(axis, idx.reshape(-1))
    return out.reshape(*data.shape[:axis], *idx.shape, *data.shape[axis + 1:])


def _gemm(a, b, c=None, *, alpha=1.0, beta=1.0, transA=0, transB=0):
    a = a.transpose(0, 1) if transA else a
    b = b.transpose(0, 1) if transB else b
    out = alpha * (a @ b)
    return out if c is None else out + beta * c


def _reduce_mean(x, axes=None, *, keepdims=1, noop_with_empty_axes=0):
    if axes is None or not _ints(axes):
        return x if noop_with_empty_axes else x.mean(keepdim=bool(keepdims))
    return x.mean(dim=_ints(axes), keepdim=bool(keepdims))


def _expand(x, shape):
    torch = _torch()
    return x.expand(torch.broadcast_shapes(tuple(x.shape), tuple(_ints(shape))))


def _constant_of_shape(shape, *, value=None):
    torch = _torch()
    fill = numpy_helper.to_array(value) if value is not None else np.zeros(1, np.float32)
    return torch.full(_ints(shape), fill.reshape(-1)[0].item(), dtype=_as_tensor(fill).dtype, device=shape.device)


def _shape(x, *, start=0, end=None):
    torch = _torch()
    return torch.tensor(list(x.shape)[start:end], dtype=torch.int64, device=x.device)


def _cast(x, *, to, saturate=1):
    return x.to(_dtype(to))


def _softmax(x, *, axis=-1):
    return x.softmax(dim=axis)


def _transpose(x, *, perm=None):
    return x.permute(*(perm if perm is not None else reversed(range(x.dim()))))


def _ops() -> dict[str, Callable]:
    torch = _torch()
    return {
        "Add": torch.add, "Sub": torch.sub, "Mul": torch.mul, "Div": torch.div, "Pow": torch.pow,
        "MatMul": torch.matmul, "Neg": torch.neg, "Sqrt": torch.sqrt, "Cos": torch.cos, "Sin": torch.sin,
        "Sigmoid": torch.sigmoid, "Tanh": torch.tanh, "Exp": torch.exp, "Erf": torch.erf, "Reciprocal": torch.reciprocal,
        "Where": torch.where, "Equal": torch.eq, "Less": torch.lt, "Greater": torch.gt, "Not": torch.logical_not,
        "Concat": lambda *xs, axis: torch.cat(xs, dim=axis), "Tile": lambda x, r: x.repeat(*_ints(r)),
        "Identity": lambda x: x, "Reshape": lambda x, s, allowzero=0: _reshape(x, s), "Unsqueeze": _unsqueeze,
        "Squeeze": lambda x, axes=None: x.squeeze(_ints(axes)) if axes is not None else x.squeeze(),
        "Slice": _slice, "Split": _split, "Gather": _gather, "Gemm": _gemm, "ReduceMean": _reduce_mean,
        "Expand": _expand, "ConstantOfShape": _constant_of_shape, "Shape": _shape, "Cast": _cast,
        "Softmax": _softmax, "Transpose": _transpose,
    }


class TorchGraph:
    """One ONNX graph (default domain, weights loaded) as a differentiable torch function."""

    def __init__(self, model: onnx.ModelProto, device: str = "cpu"):
        graph = model.graph
        self.device = device
        self.ops = _ops()
        unknown = sorted({n.op_type for n in graph.node if n.op_type not in self.ops and n.op_type != "Constant"}
                         | {f"{n.domain}::{n.op_type}" for n in graph.node if n.domain not in ("", "ai.onnx")})
        if unknown:
            raise SpecCompileError(f"torch graph: operators not supported for distillation: {', '.join(unknown)}")
        self.constants = {i.name: _as_tensor(numpy_helper.to_array(i)).to(device) for i in graph.initializer}
        self.nodes = []
        for node in graph.node:
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            if node.op_type == "Constant":
                self.constants[node.output[0]] = _as_tensor(numpy_helper.to_array(attrs["value"])).to(device)
                continue
            if node.op_type == "Split" and "num_outputs" not in attrs and len(node.input) < 2:
                attrs["count"] = len(node.output)
            self.nodes.append((self.ops[node.op_type], list(node.input), list(node.output), attrs))
        self.outputs = [o.name for o in graph.output]

    def run(self, feeds: dict[str, np.ndarray], outputs: list[str] | None = None, replace: dict | None = None) -> dict:
        """Evaluate the graph on `feeds` (numpy, moved to the graph's device); `replace`: {initializer: torch tensor on
        that device} used instead of the graph's."""
        values = dict(self.constants)
        values.update(replace or {})
        values.update({name: _as_tensor(np.asarray(v)).to(self.device) for name, v in feeds.items()})
        for fn, inputs, outs, attrs in self.nodes:
            args = [values[n] if n else None for n in inputs]
            while args and args[-1] is None:
                args.pop()
            result = fn(*args, **attrs)
            if isinstance(result, (tuple, list)):
                values.update(zip(outs, result))
            else:
                values[outs[0]] = result
        return {name: values[name] for name in (outputs or self.outputs)}
