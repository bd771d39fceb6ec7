"""ONNX Runtime session settings that keep quantized graphs exact under speculative decoding.

A verify pass must give each row the logits that a one-token pass would: then speculative output is
token-identical to plain decoding. INT4 and INT8 builds run on the CPU as their packed fused graph
(`target.ort.onnx`, engines/cpu_graph.py: MatMulNBits at accuracy level 4 in blocks of 32, measured
row-exact, docs/cpu.md); this module concerns the Q/DQ contract graphs, which ONNX Runtime CPU runs for FP8
builds, for artifacts without a packed graph, and under `--contract-graph`. It breaks exactness for them in
two ways:

- By default it keeps weight DequantizeLinear nodes out of constant folding (to fuse Q/DQ groups). The
  MatMul then reads a weight computed at run time, which it cannot prepack, and MLAS multiplies a
  single row (q = 1) with a dedicated kernel whose summation order differs from the multi-row kernel.
  A last-bit difference then crosses an FP8 activation rounding step and grows layer by layer.
- INT4 weights are fused into MatMulNBits at the session's accuracy level and the graph's block size; at
  fp32 accuracy levels its single-row and multi-row kernels sum differently, and at level 4 blocks larger
  than 32 give the last row of an odd pass other bits (benchmarks/nbits_rows.py).

`session.disable_quant_qdq=1` turns the Q/DQ fusions off, so constant folding dequantizes the weights
once at load: every weight MatMul runs on a prepacked fp32 weight (row-independent, like an fp32
graph) and the activation QuantizeLinear/DequantizeLinear pairs, elementwise with static scales, stay.
The packed CPU graph gets the same entry: it has no weight DequantizeLinear left unless a weight could not be
packed, which the entry then folds the same way. The TensorRT EP needs the Q/DQ nodes intact, so it gets nothing.
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
