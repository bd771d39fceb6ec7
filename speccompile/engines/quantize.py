"""Quantization passes on an exported ONNX graph: FP8, INT4 (weight-only, blockwise) and NVFP4 Q/DQ.

Which MatMuls: every `MatMul(activation, W)` whose B input is a 2-D initializer (the exporter names them
`<module>.weight_t`, [in, out]) and whose name does not match an exclude pattern (fnmatch; by default
`lm_head*` and `*embed_tokens*`). Attention MatMuls (both inputs are activations) stay unquantized.

What each scheme inserts (x = activation, W = weight [K, N], K = reduction axis):

  fp8    x -> QuantizeLinear(s_x, zp=fp8 0) -> DequantizeLinear -> MatMul      per-tensor static s_x = amax/448
         W_fp8 [K, N] -> DequantizeLinear(axis=1, s_w [N]) -> MatMul           per output channel
  int4   W_int4 [K, N] -> DequantizeLinear(axis=0, block_size=B, s [K/B, N]) -> MatMul    (weight-only;
         ONNX Runtime fuses this into MatMulNBits, TensorRT runs it as INT4 weight-only GEMM)
  nvfp4  x -> trt::TRT_FP4DynamicQuantize(s2_x, axis=-1, block_size=16) -> (x_fp4, s_fp8)
              DequantizeLinear(s_fp8, s2_x) -> DequantizeLinear(x_fp4, ., axis=-1, block_size=16) -> MatMul
         W^T fp4 [N, K] (packed) ; DequantizeLinear(s_fp8 [N, K/16], s2_w) ->
              DequantizeLinear(W_fp4, ., axis=-1, block_size=16) -> Transpose -> MatMul
         (the layout ModelOpt exports and TensorRT's NVFP4 GEMMs expect: blocks along the last axis)

Embedding tables (`QuantOptions.tables`, `build --quantize-lm-head`): an initializer T [V, H] read by
`Gather(T, ids)` is stored once in the scheme's weight format with blocks / channels chosen so that every
reader sees the same DequantizeLinear output: per row (fp8, axis 0), blocks along H (int4: axis 1,
`table_block`; nvfp4: blocks of 16 on the last axis). When the same T is the tied lm_head
(`Gemm(x, T, transB=1)`: H is the reduction axis, rows are output channels) the Gemm reads that DQ too,
with its input quantized like any other quantized MatMul's (fp8, nvfp4); the Gather reads DQ(T) -> Gather,
the weight-only embedding pattern TensorRT and ModelOpt's ONNX INT4 mode (gather_quantize_axis) use.
`table_format="int8"` stores the table INT8 per row instead, for every scheme, weight-only on both readers;
`table_format="fp16"` stores it float16 behind a Cast to the graph's float type (half the fp32 size; on SmolLM2
within 0.002 top-1 of the fp32 table, docs/quantization.md).

Weights already on a block grid (engines/source_grid.py, passed in `weight_grid` with `block` set): INT4 with
that block size and those scales, plus `x E O`, a float16 side branch adding the blocks' offsets
(`_add_offset_branches`) where the grid has them; an INT8 table on a blocked grid (Q8_0) as blocked INT8
(DequantizeLinear axis 1, block_size B).

`weight_only` (fp8, nvfp4): the weight chains above and no activation quantization: each MatMul reads its
unquantized input (W8A16 / W4A16, a DQ prologue into a 16-bit GEMM); calibration then serves only the methods.

One Q/DQ pair is shared by all MatMuls that read the same activation (q/k/v, gate/up), as TensorRT's
Q/DQ fusion wants. Scales are in the graph's float type (float32 graphs: float32 scales).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import InputError, UnsupportedError
from . import numerics as nx
from .gptq import GridScales
from .int8_weights import INT8_BLOCK, quantize_int8_blockwise

SCHEMES = ("fp8", "int4", "nvfp4", "int8")
WEIGHT_ONLY_SCHEMES = ("int4", "int8")  # no activation quantization whatever --weight-only says
DEFAULT_EXCLUDE = ("lm_head*", "*embed_tokens*")
LOW_RANK_SUFFIXES = (".low_rank_a", ".low_rank_b")  # float16 factors of a low-rank branch (engines/methods.py)
OFFSET_SUFFIXES = (".block_sum", ".block_offset")  # the offset branch of a weight on an asymmetric source grid
SIDE_BRANCH_SUFFIXES = LOW_RANK_SUFFIXES + OFFSET_SUFFIXES  # side-branch factors: never quantized
TRT_DOMAIN = "trt"
FP4_OPSET = 23  # FLOAT4E2M1 in DequantizeLinear
FP4_IR_VERSION = 11
_FLOAT_TYPES = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}


@dataclass
class QuantOptions:
    scheme: str
    exclude: tuple[str, ...] = DEFAULT_EXCLUDE
    int4_block: int = 128
    fp4_block: int = nx.NVFP4_BLOCK
    tables: bool = False  # also quantize embedding tables (and the tied lm_head reading one)
    table_block: int = 64  # INT4 block along H of an embedding table (TensorRT: 64 or 128)
    table_format: str = "int8"  # "int8": INT8 per row, weight-only; "fp16": float16; "scheme": the scheme's weight format
    weight_only: bool = False  # fp8 / nvfp4: weights only, activations stay in the graph's float type

    @property
    def table_weight_only(self) -> bool:
        """Whether a table's readers keep their inputs unquantized (INT8 and float16 tables)."""
        return self.table_format != "scheme"

    @property
    def quantizes_activations(self) -> bool:
        """Whether quantized MatMuls get an activation Q/DQ (fp8, nvfp4; not INT4 or a weight-only build)."""
        return self.scheme not in WEIGHT_ONLY_SCHEMES and not self.weight_only

    @property
    def defaults_key(self) -> str:
        """Which per-scheme method defaults apply (engines/gptq.py): a weight-only build has its own."""
        return f"{self.scheme}-weight-only" if self.weight_only and self.scheme not in WEIGHT_ONLY_SCHEMES else self.scheme

    @property
    def head_activation_quantized(self) -> bool:
        """Whether a tied lm_head's input gets the scheme's activation quantization."""
        return self.quantizes_activations and not self.table_weight_only

    def for_table(self) -> "QuantOptions":
        """The options whose weight quantizer gives a table's numbers (as W = T^T [H, V])."""
        return dataclasses.replace(self, int4_block=self.table_block)


@dataclass
class QuantReport:
    """What a pass did (stored in the manifest's `precision` section)."""

    scheme: str
    quantized: list[str] = field(default_factory=list)  # weight initializer names
    excluded: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # weight -> reason (shape not blockable, ...)
    activations: dict[str, float] = field(default_factory=dict)  # activation tensor -> amax used
    blocks: dict[str, int] = field(default_factory=dict)  # weight -> INT4 block size actually used
    tables: dict[str, str] = field(default_factory=dict)  # embedding table -> "gather" | "gather+lm_head"
    source_grid: dict[str, int] = field(default_factory=dict)  # weight or table stored on its own grid -> block size
    offsets: int = 0  # of those, weights with an offset branch

    def summary(self) -> dict:
        out = {
            "scheme": self.scheme,
            "quantized_matmuls": len(self.quantized),
            "excluded": sorted(self.excluded),
            "skipped": dict(sorted(self.skipped.items())),
            "activation_tensors": len(self.activations),
        }
        if self.blocks:
            out[f"{'int8' if self.scheme == 'int8' else 'int4'}_block_sizes"] = sorted(set(self.blocks.values()))
        if self.tables:
            out["tables"] = dict(sorted(self.tables.items()))
        if self.source_grid:
            out["source_grid"] = {"weights": len(self.source_grid), "blocks": sorted(set(self.source_grid.values())),
                                  "with_offset": self.offsets}
        return out


def is_excluded(name: str, patterns: Iterable[str]) -> bool:
    """Match a weight initializer name (or its module prefix) against fnmatch patterns."""
    module = name[: -len(".weight_t")] if name.endswith(".weight_t") else name
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(module, p) for p in patterns)


def weight_matmuls(model: onnx.ModelProto) -> list[tuple[int, str, str]]:
    """(node index, activation, weight initializer) for every MatMul whose B input is a 2-D float initializer."""
    inits = {i.name: i for i in model.graph.initializer}
    found = []
    for index, node in enumerate(model.graph.node):
        if node.op_type != "MatMul" or len(node.input) != 2:
            continue
        w = inits.get(node.input[1])
        if w is None or len(w.dims) != 2 or w.data_type not in _FLOAT_TYPES:
            continue
        if node.input[0] in inits or node.input[1].endswith(SIDE_BRANCH_SUFFIXES):
            continue
        found.append((index, node.input[0], node.input[1]))
    return found


@dataclass
class EmbeddingTable:
    """An initializer [V, H] that Gather nodes read as their data, and the tied lm_head Gemm if one reads it."""

    name: str
    gathers: list[onnx.NodeProto]
    head: onnx.NodeProto | None = None  # Gemm(x, table, transB=1)

    @property
    def head_input(self) -> str | None:
        return self.head.input[0] if self.head is not None else None


def embedding_tables(model: onnx.ModelProto) -> list[EmbeddingTable]:
    """Every 2-D float initializer read only by Gather (axis 0, as data) and at most one Gemm(x, T, transB=1)."""
    inits = {i.name: i for i in model.graph.initializer if len(i.dims) == 2 and i.data_type in _FLOAT_TYPES}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for position, name in enumerate(node.input):
            if name in inits:
                readers.setdefault(name, []).append((node, position))
    tables = []
    for name, uses in readers.items():
        gathers = [n for n, pos in uses if n.op_type == "Gather" and pos == 0 and _attr(n, "axis", 0) == 0]
        heads = [n for n, pos in uses if n.op_type == "Gemm" and pos == 1 and _attr(n, "transB", 0) == 1
                 and _attr(n, "transA", 0) == 0 and len(n.input) == 2]
        if gathers and len(gathers) + len(heads) == len(uses) and len(heads) <= 1:
            tables.append(EmbeddingTable(name, gathers, heads[0] if heads else None))
    return tables


def quantized_tables(model: onnx.ModelProto, options: QuantOptions) -> list[EmbeddingTable]:
    """The embedding tables the Q/DQ pass will quantize (`options.tables`, name not excluded, H blockable)."""
    if not options.tables:
        return []
    inits = {i.name: i for i in model.graph.initializer}
    found = []
    for table in embedding_tables(model):
        h = inits[table.name].dims[1]
        if is_excluded(table.name, options.exclude):
            continue
        if options.scheme == "int4" and not options.table_weight_only and nx.pick_block(h, options.table_block) is None:
            continue
        if options.scheme == "nvfp4" and not options.table_weight_only and h % options.fp4_block:
            continue
        found.append(table)
    return found


def _attr(node: onnx.NodeProto, name: str, default: int) -> int:
    return next((a.i for a in node.attribute if a.name == name), default)


def activation_tensors(model: onnx.ModelProto, options: QuantOptions) -> list[str]:
    """Activation tensors whose amax calibration needs (inputs of quantized MatMuls and tied lm_heads), in graph order."""
    if not options.quantizes_activations:
        return []
    seen: dict[str, None] = {}
    for _index, act, weight in weight_matmuls(model):
        if not is_excluded(weight, options.exclude):
            seen.setdefault(act)
    for table in quantized_tables(model, options):
        if table.head is not None and options.head_activation_quantized:
            seen.setdefault(table.head_input)
    return list(seen)


def _float_type(init: onnx.TensorProto) -> tuple[int, type]:
    return init.data_type, _FLOAT_TYPES[init.data_type]


def _raw_tensor(name: str, data_type: int, dims, raw: bytes) -> onnx.TensorProto:
    t = onnx.TensorProto()
    t.name = name
    t.data_type = data_type
    t.dims.extend(int(d) for d in dims)
    t.raw_data = raw
    return t


def float16_constant(name: str, value: np.ndarray, to: int, output: str | None = None) -> tuple[onnx.TensorProto, list[onnx.NodeProto], str]:
    """(initializer, nodes, tensor readers use): `value` stored float16 as `name`, read as type `to` through a
    Cast into `output` (default `name`_cast); no Cast when `to` is float16."""
    init = numpy_helper.from_array(np.asarray(value).astype(np.float16), name)
    if to == TensorProto.FLOAT16:
        return init, [], name
    output = output or f"{name}_cast"
    return init, [helper.make_node("Cast", [name], [output], name=f"{name}/Cast", to=to)], output


def add_side_branch(graph: onnx.GraphProto, matmul: onnx.NodeProto, first: str, second: str, label: str) -> None:
    """After `matmul` (y = x W): y = (x W) + (x first) second under y's name (its readers and graph outputs unchanged)."""
    x, y = matmul.input[0], matmul.output[0]
    main, low, branch = f"{y}_{label}_main", f"{y}_{label}_in", f"{y}_{label}_out"
    matmul.output[0] = main
    nodes = [helper.make_node("MatMul", [x, first], [low], name=f"{y}/{label}_first"),
             helper.make_node("MatMul", [low, second], [branch], name=f"{y}/{label}_second"),
             helper.make_node("Add", [main, branch], [y], name=f"{y}/{label}_add")]
    at = list(graph.node).index(matmul) + 1
    for offset, node in enumerate(nodes):
        graph.node.insert(at + offset, node)


def block_sum_matrix(k: int, block: int) -> np.ndarray:
    """E [K, K/B] with E[i, j] = 1 where input channel i is in block j: x E sums each block of x."""
    return np.repeat(np.eye(k // block, dtype=np.float32), block, axis=0)


def _unique(name: str, taken: set[str]) -> str:
    base, i = name, 1
    while name in taken:
        name = f"{base}_{i}"
        i += 1
    taken.add(name)
    return name


def quantize_model(model: onnx.ModelProto, options: QuantOptions, act_amax: dict[str, float] | None = None,
                   weight_clip: dict[str, np.ndarray] | None = None, weight_grid: dict[str, GridScales] | None = None) -> QuantReport:
    """Rewrite `model` in place (weights must be loaded). `act_amax` is needed for fp8 and nvfp4.

    `weight_clip` (INT4 / NVFP4): per weight, the clipping ratio of every block (engines/methods.py);
    `weight_grid`: per weight, the scales GPTQ quantized it with (engines/gptq.py), stored as they are."""
    weight_clip = weight_clip or {}
    weight_grid = weight_grid or {}
    scheme = options.scheme
    if scheme not in SCHEMES:
        raise InputError(f"unknown quantization scheme {scheme!r} (one of {', '.join(SCHEMES)})")
    if options.quantizes_activations and act_amax is None:
        raise InputError(f"{scheme} quantizes activations and needs calibration (act_amax)")
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    report = QuantReport(scheme)
    taken = {n for node in graph.node for n in (*node.input, *node.output)} | set(inits) | {n.name for n in graph.node}
    consumers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            consumers[name] = consumers.get(name, 0) + 1

    # Decide per weight.
    plan: dict[str, str] = {}  # weight -> dq output tensor name (filled while building)
    targets: set[int] = set()
    for index, act, weight in weight_matmuls(model):
        if is_excluded(weight, options.exclude):
            if weight not in report.excluded:
                report.excluded.append(weight)
            continue
        k = inits[weight].dims[0]
        if scheme == "int8" and k % INT8_BLOCK:
            report.skipped[weight] = f"K={k} is not a multiple of {INT8_BLOCK}"
            continue
        if scheme == "int4" and nx.pick_block(k, options.int4_block) is None:
            report.skipped[weight] = f"K={k} has no power-of-two block >= 16 dividing it"
            continue
        if scheme == "nvfp4" and k % options.fp4_block:
            report.skipped[weight] = f"K={k} is not a multiple of {options.fp4_block}"
            continue
        if options.quantizes_activations and act not in act_amax:
            report.skipped[weight] = "activation not calibrated"
            continue
        targets.add(index)
        plan[weight] = ""
    tables = quantized_tables(model, options)
    heads = {id(t.head): t for t in tables if t.head is not None}
    gathers = {id(g): t for t in tables for g in t.gathers}
    for table in tables:
        if options.head_activation_quantized and table.head is not None and table.head_input not in act_amax:
            raise InputError(f"{table.name}: the tied lm_head input {table.head_input} was not calibrated")

    new_nodes: list[onnx.NodeProto] = []
    new_inits: list[onnx.TensorProto] = []
    act_dq: dict[str, str] = {}
    removed_weights: set[str] = set()
    uses_fp4 = scheme == "nvfp4"

    def add_init(tensor: onnx.TensorProto) -> str:
        new_inits.append(tensor)
        return tensor.name

    def quantize_weight(weight: str) -> str:
        init = inits[weight]
        elem, np_float = _float_type(init)
        grid = weight_grid.get(weight)
        w = grid.weight if grid is not None and grid.weight is not None else numpy_helper.to_array(init).astype(np.float32)
        k, n = w.shape
        out = _unique(f"{weight}_dq", taken)
        if scheme == "fp8":
            q, scale = nx.quantize_fp8_per_channel(w, axis=1, scale=grid.scale if grid else None)
            qn = add_init(_raw_tensor(_unique(f"{weight}_fp8", taken), TensorProto.FLOAT8E4M3FN, q.shape, q.view(np.uint8).tobytes()))
            sn = add_init(numpy_helper.from_array(scale.astype(np_float), _unique(f"{weight}_scale", taken)))
            new_nodes.append(helper.make_node("DequantizeLinear", [qn, sn], [out], name=f"{weight}/DequantizeLinear", axis=1))
        elif scheme == "int8":  # engines/int8_weights.py: blocks of 32 along K (or the source grid's)
            block = grid.block if grid is not None and grid.block else INT8_BLOCK
            report.blocks[weight] = block
            q, scale = quantize_int8_blockwise(w, block, grid.scale if grid is not None and grid.block else None)
            qn = add_init(numpy_helper.from_array(q, _unique(f"{weight}_int8", taken)))
            sn = add_init(numpy_helper.from_array(scale.astype(np_float), _unique(f"{weight}_scale", taken)))
            new_nodes.append(helper.make_node("DequantizeLinear", [qn, sn], [out], name=f"{weight}/DequantizeLinear", axis=0, block_size=block))
        elif scheme == "int4":
            block = grid.block if grid is not None and grid.block else nx.pick_block(k, options.int4_block)
            report.blocks[weight] = block
            q, scale = nx.quantize_int4_blockwise(w, block, weight_clip.get(weight), grid.scale if grid else None)
            qn = add_init(_raw_tensor(_unique(f"{weight}_int4", taken), TensorProto.INT4, q.shape, nx.pack_nibbles(q.view(np.uint8)).tobytes()))
            sn = add_init(numpy_helper.from_array(scale.astype(np_float), _unique(f"{weight}_scale", taken)))
            new_nodes.append(helper.make_node("DequantizeLinear", [qn, sn], [out], name=f"{weight}/DequantizeLinear", axis=0, block_size=block))
        else:  # nvfp4: W^T [N, K], blocks along K (last axis)
            codes, s_fp8, s2 = _nvfp4(w.T, options.fp4_block, weight_clip.get(weight), grid)
            qn = add_init(_raw_tensor(_unique(f"{weight}_fp4", taken), TensorProto.FLOAT4E2M1, (n, k), nx.pack_nibbles(codes).tobytes()))
            bn = add_init(_raw_tensor(_unique(f"{weight}_fp4_scale", taken), TensorProto.FLOAT8E4M3FN, s_fp8.shape, s_fp8.view(np.uint8).tobytes()))
            gn = add_init(numpy_helper.from_array(np.array(s2, dtype=np_float), _unique(f"{weight}_fp4_global_scale", taken)))
            scale_out = _unique(f"{weight}_fp4_block_scale", taken)
            wt = _unique(f"{weight}_dq_nk", taken)
            new_nodes.append(helper.make_node("DequantizeLinear", [bn, gn], [scale_out], name=f"{weight}/DequantizeLinear_scale"))
            new_nodes.append(helper.make_node("DequantizeLinear", [qn, scale_out], [wt], name=f"{weight}/DequantizeLinear", axis=-1, block_size=options.fp4_block))
            new_nodes.append(helper.make_node("Transpose", [wt], [out], name=f"{weight}/Transpose", perm=[1, 0]))
        report.quantized.append(weight)
        if grid is not None and grid.block:
            report.source_grid[weight] = grid.block
        return out

    def quantize_table(table: EmbeddingTable) -> str:
        """T [V, H] stored once; returns the DequantizeLinear output every reader of T gets."""
        init = inits[table.name]
        elem, np_float = _float_type(init)
        grid = weight_grid.get(table.name)
        t = grid.weight.T if grid is not None and grid.weight is not None else numpy_helper.to_array(init).astype(np.float32)
        v, h = t.shape
        clip = weight_clip.get(table.name)
        out = _unique(f"{table.name}_dq", taken)
        if options.table_format == "fp16":  # float16 behind a Cast (the lm_head input stays unquantized)
            stored, cast, out = float16_constant(_unique(f"{table.name}_fp16", taken), t, elem, out)
            add_init(stored)
            new_nodes.extend(cast)
        elif options.table_format == "int8" and grid is not None and grid.block:  # on its own blocked INT8 grid (Q8_0)
            scale = np.ascontiguousarray(grid.scale.T)  # [V, H/B]
            q = np.clip(np.rint(t / np.repeat(scale, grid.block, axis=1)), -127, 127).astype(np.int8)
            qn = add_init(numpy_helper.from_array(q, _unique(f"{table.name}_int8", taken)))
            sn = add_init(numpy_helper.from_array(scale.astype(np_float), _unique(f"{table.name}_scale", taken)))
            new_nodes.append(helper.make_node("DequantizeLinear", [qn, sn], [out], name=f"{table.name}/DequantizeLinear",
                                              axis=1, block_size=grid.block))
            report.source_grid[table.name] = grid.block
        elif options.table_format == "int8":  # INT8 per row, weight-only (the lm_head input stays unquantized)
            q, scale = nx.quantize_int8_per_row(t)
            qn = add_init(numpy_helper.from_array(q, _unique(f"{table.name}_int8", taken)))
            sn = add_init(numpy_helper.from_array(scale.astype(np_float), _unique(f"{table.name}_scale", taken)))
            new_nodes.append(helper.make_node("DequantizeLinear", [qn, sn], [out], name=f"{table.name}/DequantizeLinear", axis=0))
        elif scheme == "fp8":  # one scale per row: the lm_head's output channel, the Gather's token
            q, scale = nx.quantize_fp8_per_channel(t, axis=0, scale=grid.scale if grid else None)
            qn = add_init(_raw_tensor(_unique(f"{table.name}_fp8", taken), TensorProto.FLOAT8E4M3FN, q.shape, q.view(np.uint8).tobytes()))
            sn = add_init(numpy_helper.from_array(scale.astype(np_float), _unique(f"{table.name}_scale", taken)))
            new_nodes.append(helper.make_node("DequantizeLinear", [qn, sn], [out], name=f"{table.name}/DequantizeLinear", axis=0))
        elif scheme == "int4":  # blocks along H (axis 1): the lm_head's reduction axis
            block = nx.pick_block(h, options.table_block)
            report.blocks[table.name] = block
            q, scale = nx.quantize_int4_blockwise(t.T, block, clip, grid.scale if grid else None)  # [H, V] blocks along H
            q, scale = np.ascontiguousarray(q.T), np.ascontiguousarray(scale.T)
            qn = add_init(_raw_tensor(_unique(f"{table.name}_int4", taken), TensorProto.INT4, q.shape, nx.pack_nibbles(q.view(np.uint8)).tobytes()))
            sn = add_init(numpy_helper.from_array(scale.astype(np_float), _unique(f"{table.name}_scale", taken)))
            new_nodes.append(helper.make_node("DequantizeLinear", [qn, sn], [out], name=f"{table.name}/DequantizeLinear", axis=1, block_size=block))
        else:  # nvfp4: [V, H] is already the [N, K] layout, blocks along the last axis
            codes, s_fp8, s2 = _nvfp4(t, options.fp4_block, clip, grid)
            qn = add_init(_raw_tensor(_unique(f"{table.name}_fp4", taken), TensorProto.FLOAT4E2M1, (v, h), nx.pack_nibbles(codes).tobytes()))
            bn = add_init(_raw_tensor(_unique(f"{table.name}_fp4_scale", taken), TensorProto.FLOAT8E4M3FN, s_fp8.shape, s_fp8.view(np.uint8).tobytes()))
            gn = add_init(numpy_helper.from_array(np.array(s2, dtype=np_float), _unique(f"{table.name}_fp4_global_scale", taken)))
            scale_out = _unique(f"{table.name}_fp4_block_scale", taken)
            new_nodes.append(helper.make_node("DequantizeLinear", [bn, gn], [scale_out], name=f"{table.name}/DequantizeLinear_scale"))
            new_nodes.append(helper.make_node("DequantizeLinear", [qn, scale_out], [out], name=f"{table.name}/DequantizeLinear", axis=-1, block_size=options.fp4_block))
        report.tables[table.name] = "gather+lm_head" if table.head is not None else "gather"
        removed_weights.add(table.name)
        return out

    def quantize_activation(act: str, elem: int, np_float) -> str:
        amax = float(act_amax[act])
        report.activations[act] = amax
        stem = act.strip("/").replace("/", ".")
        out = _unique(f"{stem}_dq", taken)
        if scheme == "fp8":
            sn = add_init(numpy_helper.from_array(np.array(nx.fp8_activation_scale(amax), dtype=np_float), _unique(f"{stem}_scale", taken)))
            zn = add_init(_raw_tensor(_unique(f"{stem}_zero_point", taken), TensorProto.FLOAT8E4M3FN, (), b"\x00"))
            qn = _unique(f"{stem}_fp8", taken)
            new_nodes.append(helper.make_node("QuantizeLinear", [act, sn, zn], [qn], name=f"{stem}/QuantizeLinear"))
            new_nodes.append(helper.make_node("DequantizeLinear", [qn, sn, zn], [out], name=f"{stem}/DequantizeLinear"))
        else:  # nvfp4 dynamic activation quantization (TensorRT custom op)
            gn = add_init(numpy_helper.from_array(np.array(nx.nvfp4_global_scale(amax), dtype=np_float), _unique(f"{stem}_fp4_global_scale", taken)))
            qn, bs = _unique(f"{stem}_fp4", taken), _unique(f"{stem}_fp4_scale", taken)
            scale_out = _unique(f"{stem}_fp4_block_scale", taken)
            new_nodes.append(helper.make_node(
                "TRT_FP4DynamicQuantize", [act, gn], [qn, bs], name=f"{stem}/TRT_FP4DynamicQuantize", domain=TRT_DOMAIN,
                axis=-1, block_size=options.fp4_block, scale_type=TensorProto.FLOAT8E4M3FN,
            ))
            new_nodes.append(helper.make_node("DequantizeLinear", [bs, gn], [scale_out], name=f"{stem}/DequantizeLinear_scale"))
            new_nodes.append(helper.make_node("DequantizeLinear", [qn, scale_out], [out], name=f"{stem}/DequantizeLinear", axis=-1, block_size=options.fp4_block))
        return out

    table_dq = {table.name: quantize_table(table) for table in tables}  # DQ nodes first: they read initializers only
    for index, node in enumerate(graph.node):
        if id(node) in gathers:
            node.input[0] = table_dq[gathers[id(node)].name]
        elif id(node) in heads:
            act = node.input[0]
            elem, np_float = _float_type(inits[node.input[1]])
            if options.head_activation_quantized:
                if act not in act_dq:
                    act_dq[act] = quantize_activation(act, elem, np_float)
                node.input[0] = act_dq[act]
            node.input[1] = table_dq[heads[id(node)].name]
        elif index in targets:
            act, weight = node.input[0], node.input[1]
            elem, np_float = _float_type(inits[weight])
            if options.quantizes_activations:
                if act not in act_dq:
                    act_dq[act] = quantize_activation(act, elem, np_float)
                node.input[0] = act_dq[act]
            if not plan[weight]:
                plan[weight] = quantize_weight(weight)
            node.input[1] = plan[weight]
            consumers[weight] -= 1
            if consumers[weight] == 0:
                removed_weights.add(weight)
        new_nodes.append(node)

    kept = [i for i in graph.initializer if i.name not in removed_weights]
    del graph.initializer[:]
    graph.initializer.extend(kept + new_inits)
    del graph.node[:]
    graph.node.extend(new_nodes)
    offset_grids = {w: weight_grid[w] for w in report.quantized if w in weight_grid and weight_grid[w].offset is not None}
    _add_offset_branches(graph, offset_grids, plan, inits, taken)
    report.offsets = len(offset_grids)
    if uses_fp4:
        _set_opset(model, "", FP4_OPSET)
        _set_opset(model, TRT_DOMAIN, 1)
        model.ir_version = max(model.ir_version, FP4_IR_VERSION)
    if not report.quantized:
        raise UnsupportedError(f"--{scheme}: no MatMul weight to quantize (all excluded or unsupported shapes)")
    return report


def _add_offset_branches(graph: onnx.GraphProto, grids: dict[str, GridScales], plan: dict[str, str],
                         inits: dict[str, onnx.TensorProto], taken: set[str]) -> None:
    """x W = x DQ(codes) + (x E) O for every weight whose source grid has offsets O [K/B, N] (E: block_sum_matrix,
    one per (K, B), shared). Both float16 behind a Cast; O in the graph's float type where float16 would round it."""
    sums: dict[tuple[int, int, int], str] = {}
    casts: list[onnx.NodeProto] = []  # they read initializers only: placed first
    readers = {}
    for node in graph.node:
        if node.op_type == "MatMul" and len(node.input) == 2:
            readers.setdefault(node.input[1], []).append(node)
    for weight, grid in grids.items():
        elem = inits[weight].data_type
        k = inits[weight].dims[0]
        key = (k, grid.block, elem)
        if key not in sums:
            init, cast, sums[key] = float16_constant(_unique(f"block_sum_{k}x{grid.block}{OFFSET_SUFFIXES[0]}", taken),
                                                     block_sum_matrix(k, grid.block), elem)
            graph.initializer.append(init)
            casts += cast
        offset_name = _unique(f"{weight}{OFFSET_SUFFIXES[1]}", taken)
        if np.array_equal(grid.offset.astype(np.float16).astype(np.float32), grid.offset):
            init, cast, offset = float16_constant(offset_name, grid.offset, elem)
        else:
            init, cast, offset = numpy_helper.from_array(grid.offset.astype(_FLOAT_TYPES[elem]), offset_name), [], offset_name
        graph.initializer.append(init)
        casts += cast
        for matmul in readers.get(plan[weight], []):
            add_side_branch(graph, matmul, sums[key], offset, "offset")
    for node in reversed(casts):
        graph.node.insert(0, node)


def _nvfp4(w_t: np.ndarray, block: int, clip: np.ndarray | None, grid: GridScales | None):
    """NVFP4 codes, block scales and global scale of W^T [N, K] (on GPTQ's grid when it chose one)."""
    if grid is None:
        return nx.nvfp4_quantize(w_t, block=block, clip=clip)
    return nx.nvfp4_quantize(w_t, grid.global_scale, block, block_scale=grid.scale)


def _set_opset(model: onnx.ModelProto, domain: str, version: int) -> None:
    for op in model.opset_import:
        if op.domain == domain:
            op.version = max(op.version, version)
            return
    model.opset_import.append(helper.make_opsetid(domain, version))


# ---------------------------------------------------------------- reference implementation of the TRT op

def trt_fp4_dynamic_quantize_reference():
    """An `onnx.reference` op class for trt::TRT_FP4DynamicQuantize (for ReferenceEvaluator(custom=[...]))."""
    from onnx.reference.op_run import OpRun

    class TRT_FP4DynamicQuantize(OpRun):  # noqa: N801 - ONNX op name
        op_domain = TRT_DOMAIN

        def _run(self, x, global_scale, axis=-1, block_size=16, scale_type=TensorProto.FLOAT8E4M3FN):
            import ml_dtypes

            x = np.asarray(x, dtype=np.float32)
            moved = np.moveaxis(x, axis, -1)
            codes, s_fp8, _ = nx.nvfp4_quantize(moved, np.float32(np.asarray(global_scale).reshape(())), block_size)
            values = np.moveaxis(codes, -1, axis).astype(np.uint8)
            fp4 = values.view(ml_dtypes.float4_e2m1fn)  # the reference runtime's FLOAT4E2M1 array type
            # ml_dtypes stores one E2M1 value per byte in the low nibble, same codes as ours.
            return (fp4, np.moveaxis(s_fp8, -1, axis))

    return TRT_FP4DynamicQuantize
