"""One weight at a time: its quantized numbers (`WeightCodes`) and the initializers + DequantizeLinear nodes that
store them (`StoredWeight`).

`matmul_weight_codes` / `table_codes` are the per-weight API every graph writer shares (the Q/DQ pass here, the
streaming build, CPU graphs that pack the same codes differently): plain numpy in, codes and scales out, nothing
about the graph. `store_weight` / `store_table` turn them into initializers, handed to a `TensorSink` (kept in
the proto, or appended to an external data file as they come) and the nodes that read them; the Q/DQ pass
(engines/quantize.py) puts those nodes in front of the MatMuls.

Layouts (W [K, N] a MatMul's B, K the reduction axis; T [V, H] an embedding table):
  fp8    codes float8_e4m3fn [K, N], scale [N] (per output channel)         DQ axis 1
  int4   codes int8 in [-8, 7] [K, N], scale [K/B, N] (blocks along K)       DQ axis 0, block_size B
  int8   codes int8 in [-127, 127] [K, N], scale [K/B, N] (B = 32 or the source grid's)  DQ axis 0, block_size B
  nvfp4  codes uint8 E2M1 [N, K] (W^T), FP8 block scales [N, K/16], FP32 global scale
         DQ(scale_fp8, global) -> DQ(codes, ., axis -1, block 16) -> Transpose
  tables per row (fp8, int8: axis 0), blocks along H (int4: axis 1; a Q8_0 grid: int8 axis 1), or float16.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from . import numerics as nx
from .gptq import GridScales
from .int8_weights import quantize_int8_blockwise
from .qdq_targets import FLOAT_TYPES, INT8_TABLE_FORMATS, OFFSET_SUFFIXES, QuantOptions, float16_constant, unique_name


@dataclass
class WeightCodes:
    """A weight's stored numbers. `codes` in the layout of the module docstring; `scale` the DequantizeLinear scale
    (nvfp4: the FP8 block scales, times `global_scale`); `block` along the blocked axis (None: per channel)."""

    kind: str  # fp8 | int4 | nvfp4 | int8 | fp16
    codes: np.ndarray
    scale: np.ndarray | None = None
    global_scale: np.float32 | None = None
    block: int | None = None
    axis: int = 0


def _nvfp4(w_t: np.ndarray, block: int, clip: np.ndarray | None, grid: GridScales | None):
    """NVFP4 codes, block scales and global scale of W^T [N, K] (on GPTQ's grid when it chose one)."""
    if grid is None:
        return nx.nvfp4_quantize(w_t, block=block, clip=clip)
    return nx.nvfp4_quantize(w_t, grid.global_scale, block, block_scale=grid.scale)


def matmul_weight_codes(w: np.ndarray, options: QuantOptions, clip: np.ndarray | None = None,
                        grid: GridScales | None = None) -> WeightCodes:
    """W [K, N] (float32) in `options.scheme`: `clip` the per-block range ratios of the clipping search, `grid` the
    scales GPTQ or the source grid fixed (a source grid also fixes the INT4 block)."""
    k, _ = w.shape
    if options.scheme == "fp8":
        q, scale = nx.quantize_fp8_per_channel(w, axis=1, scale=grid.scale if grid else None)
        return WeightCodes("fp8", q, scale, axis=1)
    if options.scheme == "int4":
        block = grid.block if grid is not None and grid.block else nx.pick_block(k, options.int4_block)
        q, scale = nx.quantize_int4_blockwise(w, block, clip, grid.scale if grid else None)
        return WeightCodes("int4", q, scale, block=block, axis=0)
    if options.scheme == "int8":  # engines/int8_weights.py: blocks of --int8-block along K (or the source grid's)
        block = grid.block if grid is not None and grid.block else options.int8_block
        q, scale = quantize_int8_blockwise(w, block, grid.scale if grid is not None and grid.block else None)
        return WeightCodes("int8", q, scale, block=block, axis=0)
    codes, s_fp8, s2 = _nvfp4(w.T, options.fp4_block, clip, grid)  # W^T [N, K], blocks along K (last axis)
    return WeightCodes("nvfp4", codes, s_fp8, s2, options.fp4_block, axis=-1)


def table_codes(t: np.ndarray, options: QuantOptions, clip: np.ndarray | None = None,
                grid: GridScales | None = None) -> WeightCodes:
    """T [V, H] (float32) in the table format of `options`: every reader (Gather, tied lm_head) sees the same values."""
    if options.table_format == "fp16":
        return WeightCodes("fp16", t)
    if options.table_format == "int8" and grid is not None and grid.block:  # on its own blocked INT8 grid (Q8_0)
        scale = np.ascontiguousarray(grid.scale.T)  # [V, H/B]
        q = np.clip(np.rint(t / np.repeat(scale, grid.block, axis=1)), -127, 127).astype(np.int8)
        return WeightCodes("int8", q, scale, block=grid.block, axis=1)
    if options.table_format in INT8_TABLE_FORMATS:  # per row, weight-only (int8-row: even where the source has blocks)
        q, scale = nx.quantize_int8_per_row(t)
        return WeightCodes("int8", q, scale, axis=0)
    if options.scheme == "fp8":  # one scale per row: the lm_head's output channel, the Gather's token
        q, scale = nx.quantize_fp8_per_channel(t, axis=0, scale=grid.scale if grid else None)
        return WeightCodes("fp8", q, scale, axis=0)
    if options.scheme == "int4":  # blocks along H (axis 1): the lm_head's reduction axis
        block = nx.pick_block(t.shape[1], options.table_block)
        q, scale = nx.quantize_int4_blockwise(t.T, block, clip, grid.scale if grid else None)  # [H, V] blocks along H
        return WeightCodes("int4", np.ascontiguousarray(q.T), np.ascontiguousarray(scale.T), block=block, axis=1)
    codes, s_fp8, s2 = _nvfp4(t, options.fp4_block, clip, grid)  # [V, H] is already [N, K]
    return WeightCodes("nvfp4", codes, s_fp8, s2, options.fp4_block, axis=-1)


class TensorSink(Protocol):
    """Where new initializers go: `put` returns the TensorProto the graph lists (the same one, or one whose bytes
    now live in an external data file)."""

    def put(self, tensor: onnx.TensorProto) -> onnx.TensorProto: ...


class KeepInProto:
    """A sink that leaves every initializer's data in the proto (a graph held in memory)."""

    def put(self, tensor: onnx.TensorProto) -> onnx.TensorProto:
        return tensor


@dataclass
class OffsetBranch:
    """The block offsets O [K/B, N] of a weight on an asymmetric source grid: `tensor` (O as the graph reads it, made
    by `nodes`: a Cast from float16, or none), K and the block B (engines/quantize.py adds x E O)."""

    tensor: str
    nodes: list[onnx.NodeProto]
    k: int
    block: int


@dataclass
class StoredWeight:
    """A quantized weight as the graph holds it: `output` (what its readers read) made by `nodes` (they read only
    `initializers`), the INT4 block actually used, and the source-grid block when it was stored on its own grid."""

    kind: str
    output: str
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    initializers: list[onnx.TensorProto] = field(default_factory=list)
    block: int | None = None
    source_block: int | None = None
    offset: OffsetBranch | None = None


def raw_tensor(name: str, data_type: int, dims, raw: bytes) -> onnx.TensorProto:
    t = onnx.TensorProto()
    t.name = name
    t.data_type = data_type
    t.dims.extend(int(d) for d in dims)
    t.raw_data = raw
    return t


def _codes_tensor(name: str, codes: WeightCodes, shape) -> onnx.TensorProto:
    if codes.kind == "fp8":
        return raw_tensor(name, TensorProto.FLOAT8E4M3FN, shape, codes.codes.view(np.uint8).tobytes())
    if codes.kind == "int4":
        return raw_tensor(name, TensorProto.INT4, shape, nx.pack_nibbles(codes.codes.view(np.uint8)).tobytes())
    if codes.kind == "nvfp4":
        return raw_tensor(name, TensorProto.FLOAT4E2M1, shape, nx.pack_nibbles(codes.codes).tobytes())
    return numpy_helper.from_array(codes.codes, name)


def _store(stem: str, codes: WeightCodes, elem: int, sink: TensorSink, taken: set[str], shape, transpose: bool) -> StoredWeight:
    """Initializers and DQ nodes of `codes` for a weight or table named `stem` (in that order of names, as the
    single-pass writer always named them); `transpose`: an NVFP4 weight read as W = (W^T)^T."""
    np_float = FLOAT_TYPES[elem]
    out = unique_name(f"{stem}_dq", taken)
    stored = StoredWeight(codes.kind, out, block=codes.block)

    def add(tensor: onnx.TensorProto) -> str:
        stored.initializers.append(sink.put(tensor))
        return tensor.name

    node = helper.make_node
    if codes.kind == "fp16":  # float16 behind a Cast (the lm_head input stays unquantized)
        init, cast, stored.output = float16_constant(unique_name(f"{stem}_fp16", taken), codes.codes, elem, out)
        add(init)
        stored.nodes.extend(cast)
        return stored
    if codes.kind in ("fp8", "int4", "int8"):
        qn = add(_codes_tensor(unique_name(f"{stem}_{codes.kind}", taken), codes, shape))
        sn = add(numpy_helper.from_array(codes.scale.astype(np_float), unique_name(f"{stem}_scale", taken)))
        attrs = {"axis": codes.axis} | ({"block_size": codes.block} if codes.block else {})
        stored.nodes.append(node("DequantizeLinear", [qn, sn], [out], name=f"{stem}/DequantizeLinear", **attrs))
        return stored
    qn = add(_codes_tensor(unique_name(f"{stem}_fp4", taken), codes, shape))
    bn = add(raw_tensor(unique_name(f"{stem}_fp4_scale", taken), TensorProto.FLOAT8E4M3FN, codes.scale.shape,
                        codes.scale.view(np.uint8).tobytes()))
    gn = add(numpy_helper.from_array(np.array(codes.global_scale, dtype=np_float), unique_name(f"{stem}_fp4_global_scale", taken)))
    scale_out = unique_name(f"{stem}_fp4_block_scale", taken)
    values = unique_name(f"{stem}_dq_nk", taken) if transpose else out
    stored.nodes.append(node("DequantizeLinear", [bn, gn], [scale_out], name=f"{stem}/DequantizeLinear_scale"))
    stored.nodes.append(node("DequantizeLinear", [qn, scale_out], [values], name=f"{stem}/DequantizeLinear", axis=-1,
                             block_size=codes.block))
    if transpose:
        stored.nodes.append(node("Transpose", [values], [out], name=f"{stem}/Transpose", perm=[1, 0]))
    return stored


def store_weight(name: str, w: np.ndarray, elem: int, options: QuantOptions, sink: TensorSink, taken: set[str],
                 clip: np.ndarray | None = None, grid: GridScales | None = None) -> StoredWeight:
    """MatMul weight `name` (value `w` [K, N] float32, graph float type `elem`) quantized and stored."""
    codes = matmul_weight_codes(w, options, clip, grid)
    k, n = w.shape
    stored = _store(name, codes, elem, sink, taken, (n, k) if codes.kind == "nvfp4" else (k, n), transpose=True)
    if grid is not None and grid.block:
        stored.source_block = grid.block
    if grid is not None and grid.offset is not None:
        offset_name = unique_name(f"{name}{OFFSET_SUFFIXES[1]}", taken)
        if np.array_equal(grid.offset.astype(np.float16).astype(np.float32), grid.offset):
            init, cast, tensor = float16_constant(offset_name, grid.offset, elem)
        else:  # float16 would round it: the graph's float type
            init, cast, tensor = numpy_helper.from_array(grid.offset.astype(FLOAT_TYPES[elem]), offset_name), [], offset_name
        stored.initializers.append(sink.put(init))
        stored.offset = OffsetBranch(tensor, cast, k, grid.block)
    return stored


def store_table(name: str, t: np.ndarray, elem: int, options: QuantOptions, sink: TensorSink, taken: set[str],
                clip: np.ndarray | None = None, grid: GridScales | None = None) -> StoredWeight:
    """Embedding table `name` (value `t` [V, H] float32) stored once in the table format; every reader reads `output`."""
    codes = table_codes(t, options, clip, grid)
    stored = _store(name, codes, elem, sink, taken, t.shape, transpose=False)
    if codes.kind == "int8" and codes.block:
        stored.source_block = codes.block
    return stored
