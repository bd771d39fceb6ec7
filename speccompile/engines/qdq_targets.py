"""What the Q/DQ pass touches in a graph, found from its structure alone (no weight is read).

Which MatMuls: every `MatMul(activation, W)` whose B input is a 2-D initializer (the exporter names them
`<module>.weight_t`, [in, out]) and whose name does not match an exclude pattern (fnmatch; by default
`lm_head*`, `*embed_tokens*` and MoE routers: the routing stays float). Attention MatMuls (both inputs are activations) stay unquantized. Embedding
tables: an initializer read by `Gather` (and by a tied lm_head `Gemm(x, T, transB=1)`). Plus the small graph
helpers the passes share (side branches, float16 constants, unique names).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass
from typing import Iterable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from . import numerics as nx
from .int8_weights import INT8_BLOCK

SCHEMES = ("fp8", "int4", "nvfp4", "int8")
WEIGHT_ONLY_SCHEMES = ("int4", "int8")  # no activation quantization whatever --weight-only says
TABLE_FORMATS = ("int8", "int8-row", "fp16", "scheme")  # an embedding table's format (QuantOptions.table_format)
INT8_TABLE_FORMATS = ("int8", "int8-row")
ROUTER_EXCLUDE = ("*.mlp.router", "*.mlp.shared_expert_gate")  # MoE routers (export/moe_ops.py): float, as llama.cpp
DEFAULT_EXCLUDE = ("lm_head*", "*embed_tokens*", *ROUTER_EXCLUDE)
LOW_RANK_SUFFIXES = (".low_rank_a", ".low_rank_b")  # float16 factors of a low-rank branch (engines/methods.py)
OFFSET_SUFFIXES = (".block_sum", ".block_offset")  # the offset branch of a weight on an asymmetric source grid
SIDE_BRANCH_SUFFIXES = LOW_RANK_SUFFIXES + OFFSET_SUFFIXES  # side-branch factors: never quantized
TRT_DOMAIN = "trt"
FP4_OPSET = 23  # FLOAT4E2M1 in DequantizeLinear
FP4_IR_VERSION = 11
FLOAT_TYPES = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}


@dataclass
class QuantOptions:
    scheme: str
    exclude: tuple[str, ...] = DEFAULT_EXCLUDE
    int4_block: int = 128
    int8_block: int = INT8_BLOCK
    fp4_block: int = nx.NVFP4_BLOCK
    tables: bool = False  # also quantize embedding tables (and the tied lm_head reading one)
    table_block: int = 64  # INT4 block along H of an embedding table (TensorRT: 64 or 128)
    table_format: str = "int8"  # TABLE_FORMATS: "int8" INT8 per row (or the source's Q8_0 blocks), weight-only;
    # "int8-row" INT8 per row always (a tied head then runs as an integer product on the CPU: engines/integer_head.py);
    # "fp16": float16; "scheme": the scheme's weight format
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
        if w is None or len(w.dims) != 2 or w.data_type not in FLOAT_TYPES:
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
    inits = {i.name: i for i in model.graph.initializer if len(i.dims) == 2 and i.data_type in FLOAT_TYPES}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for position, name in enumerate(node.input):
            if name in inits:
                readers.setdefault(name, []).append((node, position))
    tables = []
    for name, uses in readers.items():
        gathers = [n for n, pos in uses if n.op_type == "Gather" and pos == 0 and node_attr(n, "axis", 0) == 0]
        heads = [n for n, pos in uses if n.op_type == "Gemm" and pos == 1 and node_attr(n, "transB", 0) == 1
                 and node_attr(n, "transA", 0) == 0 and len(n.input) == 2]
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


def node_attr(node: onnx.NodeProto, name: str, default: int) -> int:
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


def unique_name(name: str, taken: set[str]) -> str:
    base, i = name, 1
    while name in taken:
        name = f"{base}_{i}"
        i += 1
    taken.add(name)
    return name


