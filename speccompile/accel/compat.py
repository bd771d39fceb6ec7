"""Will the TensorRT ONNX parser take this graph? Operators and element types, checked without TensorRT.

The operator list follows onnx-tensorrt's operator support matrix (TensorRT 10.x / 11): standard-domain
operators the parser imports, plus the `trt` custom-domain quantization ops that TensorRT registers.
`export` can call `check_tensorrt_compat(path)` to warn early; `build` refuses a graph with errors.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

TRT_ONNX_OPS = frozenset("""
Abs Acos Acosh Add AffineGrid And ArgMax ArgMin Asin Asinh Atan Atanh AveragePool BatchNormalization Bernoulli
BitwiseAnd BitwiseNot BitwiseOr BitwiseXor BlackmanWindow Cast CastLike Ceil Celu CenterCropPad Clip Compress Concat
Constant ConstantOfShape Conv ConvTranspose Cos Cosh CumSum DFT DeformConv DepthToSpace DequantizeLinear Div Dropout
Einsum Elu Equal Erf Exp Expand EyeLike Flatten Floor GRU Gather GatherElements GatherND Gelu Gemm GlobalAveragePool
GlobalLpPool GlobalMaxPool Greater GreaterOrEqual GridSample GroupNormalization HammingWindow HannWindow HardSigmoid
HardSwish Hardmax Identity If ImageScaler InstanceNormalization IsInf IsNaN LRN LSTM LayerNormalization LeakyRelu Less
LessOrEqual Log LogSoftmax Loop LpNormalization LpPool MatMul Max MaxPool Mean MeanVarianceNormalization Min Mish Mod
Mul Neg NonMaxSuppression NonZero Not OneHot Or PRelu Pad ParametricSoftplus Pow QuantizeLinear RNN RandomNormal
RandomNormalLike RandomUniform RandomUniformLike Range Reciprocal ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp
ReduceMax ReduceMean ReduceMin ReduceProd ReduceSum ReduceSumSquare Relu Reshape Resize ReverseSequence RoiAlign Round
STFT ScaledTanh Scan Scatter ScatterElements ScatterND Selu Shape Shrink Sigmoid Sign Sin Sinh Size Slice Softmax
Softplus Softsign SpaceToDepth Split Sqrt Squeeze Sub Sum Tan Tanh ThresholdedRelu Tile TopK Transpose Trilu Unsqueeze
Upsample Where Xor
""".split())

# Newer standard ops only recent parsers import: a warning, not an error.
RECENT_ONNX_OPS = {"Attention": "TensorRT 10.14+", "RMSNormalization": "TensorRT 10.12+", "RotaryEmbedding": "TensorRT 10.14+"}

TRT_CUSTOM_OPS = frozenset({
    "TRT_FP4DynamicQuantize", "TRT_FP8QuantizeLinear", "TRT_FP8DequantizeLinear", "TRT_INT4QuantizeLinear",
    "TRT_INT4DequantizeLinear", "TRT_MXFP8DynamicQuantize", "TRT_MXFP8QuantizeLinear", "TRT_MXFP8DequantizeLinear",
})

SUPPORTED_TYPES = {
    TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.INT32, TensorProto.INT64,
    TensorProto.INT8, TensorProto.BOOL, TensorProto.UINT8,
}
TRT_INT4_BLOCKS = (64, 128)  # INT4 block quantization: the block sizes TensorRT supports
QDQ_OPS = frozenset({"QuantizeLinear", "DequantizeLinear", "TRT_FP4DynamicQuantize", "TRT_FP8QuantizeLinear",
                     "TRT_FP8DequantizeLinear", "TRT_INT4QuantizeLinear", "TRT_INT4DequantizeLinear"})
# Types only allowed as the quantized side of Q/DQ (weights or QuantizeLinear outputs).
QDQ_ONLY_TYPES = {TensorProto.FLOAT8E4M3FN, TensorProto.INT4, TensorProto.FLOAT4E2M1}
_TYPE_NAMES = {v: k for k, v in TensorProto.DataType.items()}


@dataclass
class CompatReport:
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    op_counts: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.errors

    def to_dict(self) -> dict:
        return {"ok": self.ok, "errors": self.errors, "warnings": self.warnings}


def _type_name(t: int) -> str:
    return _TYPE_NAMES.get(t, str(t)).lower()


def stored_values(graph: onnx.GraphProto, names: set[str]) -> dict[str, np.ndarray]:
    """The values of those of `names` that are Constant node outputs or initializers whose data the model
    holds (an initializer in external data that was not loaded is left out)."""
    values = {i.name: numpy_helper.to_array(i) for i in graph.initializer
              if i.name in names and i.data_location != TensorProto.EXTERNAL}
    for node in graph.node:
        if node.op_type == "Constant" and node.output[0] in names and node.attribute[0].name == "value":
            values[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    return values


def bad_scale(value: np.ndarray) -> float | None:
    """The first value of a Q/DQ scale TensorRT cannot take (not finite, or not > 0), else None."""
    wrong = ~(np.isfinite(value) & (value > 0))
    return float(value[wrong].flat[0]) if wrong.any() else None


def check_tensorrt_compat(model: onnx.ModelProto | str | Path) -> CompatReport:
    """Check operators, domains, element types and stored Q/DQ scales against what TensorRT supports."""
    if not isinstance(model, onnx.ModelProto):
        model = onnx.load(str(model), load_external_data=False)
    graph = model.graph
    report = CompatReport()
    _check_operators(graph, report)
    qdq_tensors = _check_qdq_nodes(graph, report)
    _check_element_types(graph, qdq_tensors, report)
    # TensorRT's Quantize/Dequantize layers take strictly positive scales; an inf one makes DQ give 0 x inf = NaN
    scales = {n.input[1] for n in graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear") and len(n.input) > 1}
    for name, value in sorted(stored_values(graph, scales).items()):
        if (wrong := bad_scale(value.astype(np.float32))) is not None:
            report.errors.append(f"Q/DQ scale {name}: {wrong} (TensorRT takes only finite scales > 0)")
    return report


def _check_operators(graph: onnx.GraphProto, report: CompatReport) -> None:
    """Operator counts, and the operators or domains the TensorRT ONNX parser does not take."""
    ops = Counter((n.domain or "", n.op_type) for n in graph.node)
    report.op_counts = {f"{d + '::' if d else ''}{o}": c for (d, o), c in sorted(ops.items())}
    for (domain, op), count in sorted(ops.items()):
        if domain in ("", "ai.onnx"):
            if op in RECENT_ONNX_OPS:
                report.warnings.append(f"{op} x{count}: needs {RECENT_ONNX_OPS[op]}")
            elif op not in TRT_ONNX_OPS:
                report.errors.append(f"operator {op} (x{count}) is not supported by the TensorRT ONNX parser")
        elif domain == "trt":
            if op not in TRT_CUSTOM_OPS:
                report.errors.append(f"operator trt::{op} (x{count}) is not a TensorRT custom op")
        else:
            report.errors.append(
                f"operator {domain}::{op} (x{count}) is from a non-ONNX domain (an ONNX Runtime contrib op?) "
                f"that TensorRT cannot parse without a plugin"
            )


def _check_qdq_nodes(graph: onnx.GraphProto, report: CompatReport) -> set[str]:
    """Block sizes TensorRT may not take, Casts to types it lacks; returns the tensors Q/DQ nodes read or write."""
    int4_values = {i.name for i in graph.initializer if i.data_type == TensorProto.INT4}
    int8_values = {i.name for i in graph.initializer if i.data_type == TensorProto.INT8}
    qdq_tensors: set[str] = set()
    for node in graph.node:
        if node.op_type in ("DequantizeLinear", "TRT_FP8DequantizeLinear", "TRT_INT4DequantizeLinear"):
            qdq_tensors.update(node.input)
            if node.op_type == "DequantizeLinear":
                block = next((a.i for a in node.attribute if a.name == "block_size"), 0)
                if block and node.input[0] in int4_values and block not in TRT_INT4_BLOCKS:
                    report.warnings.append(f"{node.name or node.output[0]}: INT4 block_size {block}: TensorRT takes "
                                           f"{' or '.join(map(str, TRT_INT4_BLOCKS))}")
                elif block and node.input[0] in int8_values:
                    report.warnings.append(f"{node.name or node.output[0]}: blocked INT8 (block_size {block}): TensorRT 10's "
                                           "Dequantize layer takes block scales for INT4 only")
                elif block and block not in (16, 32, 64, 128, 256):
                    report.warnings.append(f"{node.name or node.output[0]}: block_size {block} may not be supported")
        if node.op_type in ("QuantizeLinear", "TRT_FP4DynamicQuantize"):
            qdq_tensors.update(node.output)
            qdq_tensors.update(node.input[1:])
        if node.op_type == "Cast":
            to = next((a.i for a in node.attribute if a.name == "to"), None)
            if to is not None and to not in SUPPORTED_TYPES:
                report.errors.append(f"Cast {node.name or node.output[0]} to {_type_name(to)}: type not supported by TensorRT")
    return qdq_tensors


def _check_element_types(graph: onnx.GraphProto, qdq_tensors: set[str], report: CompatReport) -> None:
    """Element types TensorRT lacks; the Q/DQ-only types are fine on tensors only Q/DQ nodes read (an INT4 table
    read by a Gather is not)."""
    read_elsewhere = {name for node in graph.node if node.op_type not in QDQ_OPS for name in node.input}

    def check_value(kind: str, name: str, elem: int) -> None:
        if elem in SUPPORTED_TYPES or elem == TensorProto.UNDEFINED:
            return
        if elem in QDQ_ONLY_TYPES and name in qdq_tensors and name not in read_elsewhere:
            return
        report.errors.append(f"{kind} {name}: element type {_type_name(elem)} is not supported by TensorRT")

    for init in graph.initializer:
        check_value("initializer", init.name, init.data_type)
    for v in [*graph.input, *graph.output]:
        check_value("graph input/output", v.name, v.type.tensor_type.elem_type)
    for v in graph.value_info:
        check_value("tensor", v.name, v.type.tensor_type.elem_type)
    for node in graph.node:
        if node.op_type == "Constant":
            for a in node.attribute:
                if a.name == "value":
                    check_value("constant", node.output[0], a.t.data_type)
