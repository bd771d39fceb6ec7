"""ONNX Runtime session settings that keep quantized graphs exact under speculative decoding.

A verify pass must give each row the logits that a one-token pass would: then speculative output is
token-identical to plain decoding. ONNX Runtime CPU breaks that for Q/DQ graphs in two ways:

- By default it keeps weight DequantizeLinear nodes out of constant folding (to fuse Q/DQ groups). The
  MatMul then reads a weight computed at run time, which it cannot prepack, and MLAS multiplies a
  single row (q = 1) with a dedicated kernel whose summation order differs from the multi-row kernel.
  A last-bit difference then crosses an FP8 activation rounding step and grows layer by layer.
- INT4 weights are fused into MatMulNBits, whose single-row and multi-row kernels also sum differently
  (even at accuracy level 0, fp32 compute).

`session.disable_quant_qdq=1` turns the Q/DQ fusions off, so constant folding dequantizes the weights
once at load: every weight MatMul runs on a prepacked fp32 weight (row-independent, like an fp32
graph) and the activation QuantizeLinear/DequantizeLinear pairs, elementwise with static scales, stay.
The TensorRT EP needs the Q/DQ nodes intact, so it gets nothing here.
"""

from __future__ import annotations

from ...manifest import GraphSpec


def quantized_session_config(spec: GraphSpec, backend: str) -> dict[str, str]:
    """Session config entries for `spec` on ONNX Runtime `backend` (empty for unquantized graphs)."""
    scheme = spec.extra.get("quantization")
    if not scheme or backend == "ort-trt":
        return {}
    if backend == "ort-cpu":
        return {"session.disable_quant_qdq": "1"}
    if scheme == "int4":
        # CUDA EP: MatMulNBits with fp32 compute instead of int8-rounded activations.
        return {"session.qdq_matmulnbits_accuracy_level": "0"}
    return {}
