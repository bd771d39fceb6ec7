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

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import InputError, UnsupportedError
from . import numerics as nx
from .gptq import GridScales
from .qdq_targets import (FLOAT_TYPES, FP4_IR_VERSION, FP4_OPSET, OFFSET_SUFFIXES, SCHEMES, TRT_DOMAIN, EmbeddingTable,
                          QuantOptions, add_side_branch, block_sum_matrix, float16_constant, is_excluded, quantized_tables,
                          unique_name, weight_matmuls)
from .weight_codes import KeepInProto, StoredWeight, TensorSink, store_table, store_weight

StoreWeight = Callable[[str], StoredWeight]  # weight initializer -> its stored form
StoreTable = Callable[[EmbeddingTable], StoredWeight]


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


def graph_names(model: onnx.ModelProto) -> set[str]:
    """Every tensor, initializer and node name of the graph (new names must avoid them)."""
    graph = model.graph
    return ({n for node in graph.node for n in (*node.input, *node.output)} | {i.name for i in graph.initializer}
            | {n.name for n in graph.node})


def quantize_model(model: onnx.ModelProto, options: QuantOptions, act_amax: dict[str, float] | None = None,
                   weight_clip: dict[str, np.ndarray] | None = None, weight_grid: dict[str, GridScales] | None = None) -> QuantReport:
    """Rewrite `model` in place (weights must be loaded). `act_amax` is needed for fp8 and nvfp4.

    `weight_clip` (INT4 / NVFP4): per weight, the clipping ratio of every block (engines/methods.py);
    `weight_grid`: per weight, the scales GPTQ quantized it with (engines/gptq.py), stored as they are."""
    weight_clip = weight_clip or {}
    weight_grid = weight_grid or {}
    inits = {i.name: i for i in model.graph.initializer}
    taken = graph_names(model)
    sink = KeepInProto()

    def weight(name: str) -> StoredWeight:
        grid = weight_grid.get(name)
        w = grid.weight if grid is not None and grid.weight is not None else numpy_helper.to_array(inits[name]).astype(np.float32)
        return store_weight(name, w, inits[name].data_type, options, sink, taken, weight_clip.get(name), grid)

    def table(t: EmbeddingTable) -> StoredWeight:
        grid = weight_grid.get(t.name)
        value = grid.weight.T if grid is not None and grid.weight is not None else numpy_helper.to_array(inits[t.name]).astype(np.float32)
        return store_table(t.name, value, inits[t.name].data_type, options, sink, taken, weight_clip.get(t.name), grid)

    return rewrite_qdq(model, options, act_amax, weight, table, taken, sink)


@dataclass
class QdqPlan:
    """Which MatMul nodes (by index) get a quantized weight, and the embedding tables stored quantized."""

    targets: set[int]
    tables: list[EmbeddingTable]


def plan_qdq(model: onnx.ModelProto, options: QuantOptions, act_amax: dict[str, float] | None, report: QuantReport,
             check_heads: bool = True) -> QdqPlan:
    """Decide per weight MatMul and table from the graph's structure (and which activations have a range); the
    exclusions and skips go to `report`. `check_heads`: refuse a tied lm_head whose input needs a range it lacks."""
    inits = {i.name: i for i in model.graph.initializer}
    scheme = options.scheme
    targets: set[int] = set()
    for index, act, weight in weight_matmuls(model):
        if is_excluded(weight, options.exclude):
            if weight not in report.excluded:
                report.excluded.append(weight)
            continue
        k = inits[weight].dims[0]
        if scheme == "int8" and k % options.int8_block:
            report.skipped[weight] = f"K={k} is not a multiple of {options.int8_block}"
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
    tables = quantized_tables(model, options)
    for table in tables if check_heads else ():
        if options.head_activation_quantized and table.head is not None and table.head_input not in act_amax:
            raise InputError(f"{table.name}: the tied lm_head input {table.head_input} was not calibrated")
    return QdqPlan(targets, tables)


def quantized_weights(model: onnx.ModelProto, options: QuantOptions, act_amax: dict[str, float] | None) -> list[str]:
    """The MatMul weights the Q/DQ pass will store quantized, in graph order."""
    plan = plan_qdq(model, options, act_amax, QuantReport(options.scheme))
    nodes = model.graph.node
    return list(dict.fromkeys(nodes[i].input[1] for i in sorted(plan.targets)))


def rewrite_qdq(model: onnx.ModelProto, options: QuantOptions, act_amax: dict[str, float] | None, weight: StoreWeight,
                table: StoreTable, taken: set[str], sink: TensorSink) -> QuantReport:
    """Put each target MatMul's weight (`weight(name)`, asked once per weight, in graph order) and each quantized
    table (`table(t)`) in the graph, with the activation Q/DQ of the scheme; drop the float initializers they replace."""
    scheme = _checked_scheme(options, act_amax)
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    report = QuantReport(scheme)
    plan = plan_qdq(model, options, act_amax, report)
    consumers = _consumer_counts(graph)
    heads = {id(t.head): t for t in plan.tables if t.head is not None}
    gathers = {id(g): t for t in plan.tables for g in t.gathers}
    new_nodes, new_inits = [], []  # the nodes and initializers the rewritten graph gets
    stored: dict[str, StoredWeight] = {}
    act_dq: dict[str, str] = {}
    removed: set[str] = set()

    def place(name: str, value: StoredWeight) -> str:
        stored[name] = value
        new_inits.extend(value.initializers)
        new_nodes.extend(value.nodes)
        return value.output

    def activation(act: str, elem: int) -> str:
        if act not in act_dq:
            report.activations[act] = float(act_amax[act])
            value = quantize_activation(act, float(act_amax[act]), scheme, options.fp4_block, FLOAT_TYPES[elem], taken)
            act_dq[act] = place(act, value)
        return act_dq[act]

    table_dq = {t.name: place(t.name, table(t)) for t in plan.tables}  # DQ nodes first: they read initializers only
    for t in plan.tables:
        _record_blocks(report, t.name, stored[t.name], ("int4",))  # an INT8 table's rows are its blocks: not listed
        report.tables[t.name] = "gather+lm_head" if t.head is not None else "gather"
    removed.update(table_dq)
    for index, node in enumerate(graph.node):
        if id(node) in gathers:
            node.input[0] = table_dq[gathers[id(node)].name]
        elif id(node) in heads:
            if options.head_activation_quantized:
                node.input[0] = activation(node.input[0], inits[node.input[1]].data_type)
            node.input[1] = table_dq[heads[id(node)].name]
        elif index in plan.targets:
            act, name = node.input[0], node.input[1]
            if options.quantizes_activations:
                node.input[0] = activation(act, inits[name].data_type)
            if name not in stored:
                value = weight(name)
                place(name, value)
                report.quantized.append(name)
                _record_blocks(report, name, value, ("int4", "int8"))
            node.input[1] = stored[name].output
            consumers[name] -= 1
            if consumers[name] == 0:
                removed.add(name)
        new_nodes.append(node)

    _replace_contents(graph, removed, new_inits, new_nodes)
    _finish(model, report, stored, inits, taken, sink)
    return report


def _checked_scheme(options: QuantOptions, act_amax: dict[str, float] | None) -> str:
    """The pass's scheme, refused when unknown or when it quantizes activations without their calibration."""
    if options.scheme not in SCHEMES:
        raise InputError(f"unknown quantization scheme {options.scheme!r} (one of {', '.join(SCHEMES)})")
    if options.quantizes_activations and act_amax is None:
        raise InputError(f"{options.scheme} quantizes activations and needs calibration (act_amax)")
    return options.scheme


def _replace_contents(graph: onnx.GraphProto, removed: set[str], new_inits: list[onnx.TensorProto],
                      new_nodes: list[onnx.NodeProto]) -> None:
    """The graph's initializers less `removed` plus `new_inits`, and `new_nodes` as its nodes."""
    kept = [i for i in graph.initializer if i.name not in removed]
    del graph.initializer[:]
    graph.initializer.extend(kept + new_inits)
    del graph.node[:]
    graph.node.extend(new_nodes)


def _consumer_counts(graph: onnx.GraphProto) -> dict[str, int]:
    """Tensor name -> how many node inputs read it."""
    consumers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            consumers[name] = consumers.get(name, 0) + 1
    return consumers


def _record_blocks(report: QuantReport, name: str, value: StoredWeight, blocked: tuple[str, ...]) -> None:
    """Note a stored weight's or table's block size (when its kind is one of `blocked`) and the source grid it kept."""
    if value.kind in blocked:
        report.blocks[name] = value.block
    if value.source_block:
        report.source_grid[name] = value.source_block


def _finish(model: onnx.ModelProto, report: QuantReport, stored: dict[str, StoredWeight],
            inits: dict[str, onnx.TensorProto], taken: set[str], sink: TensorSink) -> None:
    """After the rewrite: the offset branches of weights on an asymmetric source grid, NVFP4's opsets, and the
    refusal when nothing was quantized."""
    offsets = {w: stored[w] for w in report.quantized if stored[w].offset is not None}
    _add_offset_branches(model.graph, offsets, inits, taken, sink)
    report.offsets = len(offsets)
    if report.scheme == "nvfp4":
        _set_opset(model, "", FP4_OPSET)
        _set_opset(model, TRT_DOMAIN, 1)
        model.ir_version = max(model.ir_version, FP4_IR_VERSION)
    if not report.quantized:
        raise UnsupportedError(f"--{report.scheme}: no MatMul weight to quantize (all excluded or unsupported shapes)")


def quantize_activation(act: str, amax: float, scheme: str, fp4_block: int, np_float, taken: set[str]) -> StoredWeight:
    """The activation Q/DQ of `scheme` on `act` (fp8: static per-tensor QuantizeLinear / DequantizeLinear; nvfp4:
    TensorRT's dynamic FP4 quantizer and its two DequantizeLinear), as nodes and their initializers."""
    stem = act.strip("/").replace("/", ".")
    out = unique_name(f"{stem}_dq", taken)
    value = StoredWeight(scheme, out)
    node = helper.make_node
    if scheme == "fp8":
        sn = unique_name(f"{stem}_scale", taken)
        value.initializers.append(numpy_helper.from_array(np.array(nx.fp8_activation_scale(amax), dtype=np_float), sn))
        zn = unique_name(f"{stem}_zero_point", taken)
        value.initializers.append(_scalar_fp8_zero(zn))
        qn = unique_name(f"{stem}_fp8", taken)
        value.nodes += [node("QuantizeLinear", [act, sn, zn], [qn], name=f"{stem}/QuantizeLinear"),
                        node("DequantizeLinear", [qn, sn, zn], [out], name=f"{stem}/DequantizeLinear")]
        return value
    gn = unique_name(f"{stem}_fp4_global_scale", taken)
    value.initializers.append(numpy_helper.from_array(np.array(nx.nvfp4_global_scale(amax), dtype=np_float), gn))
    qn, bs = unique_name(f"{stem}_fp4", taken), unique_name(f"{stem}_fp4_scale", taken)
    scale_out = unique_name(f"{stem}_fp4_block_scale", taken)
    value.nodes += [
        node("TRT_FP4DynamicQuantize", [act, gn], [qn, bs], name=f"{stem}/TRT_FP4DynamicQuantize", domain=TRT_DOMAIN,
             axis=-1, block_size=fp4_block, scale_type=TensorProto.FLOAT8E4M3FN),
        node("DequantizeLinear", [bs, gn], [scale_out], name=f"{stem}/DequantizeLinear_scale"),
        node("DequantizeLinear", [qn, scale_out], [out], name=f"{stem}/DequantizeLinear", axis=-1, block_size=fp4_block),
    ]
    return value


def _scalar_fp8_zero(name: str) -> onnx.TensorProto:
    t = onnx.TensorProto()
    t.name, t.data_type, t.raw_data = name, TensorProto.FLOAT8E4M3FN, b"\x00"
    return t


def _add_offset_branches(graph: onnx.GraphProto, stored: dict[str, StoredWeight], inits: dict[str, onnx.TensorProto],
                         taken: set[str], sink: TensorSink) -> None:
    """x W = x DQ(codes) + (x E) O for every weight whose source grid has offsets O [K/B, N] (E: block_sum_matrix,
    one per (K, B), shared; float16 behind a Cast). The Casts read initializers only: placed first."""
    sums: dict[tuple[int, int, int], str] = {}
    casts: list[onnx.NodeProto] = []
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        if node.op_type == "MatMul" and len(node.input) == 2:
            readers.setdefault(node.input[1], []).append(node)
    for weight, value in stored.items():
        branch = value.offset
        elem = inits[weight].data_type
        key = (branch.k, branch.block, elem)
        if key not in sums:
            init, cast, sums[key] = float16_constant(unique_name(f"block_sum_{branch.k}x{branch.block}{OFFSET_SUFFIXES[0]}", taken),
                                                     block_sum_matrix(branch.k, branch.block), elem)
            graph.initializer.append(sink.put(init))
            casts += cast
        casts += branch.nodes
        for matmul in readers.get(value.output, []):
            add_side_branch(graph, matmul, sums[key], branch.tensor, "offset")
    for node in reversed(casts):
        graph.node.insert(0, node)


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
