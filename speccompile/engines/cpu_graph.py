"""A quantized build's fused ONNX Runtime CPU graph: its weights stay packed and run in the quantized kernels.

The Q/DQ contract graph of an INT4 / INT8 build (`target.onnx`) is what TensorRT and every execution provider
runs; on the CPU it runs with its weights dequantized to fp32 at load (runtime/backends/ort_quantized.py), so it
is no smaller and no faster than fp32. This pass writes the build's `target.ort.onnx` instead: the export's fused
CPU graph (export/ort_fused_graph.py: GroupQueryAttention over an in-place KV buffer, fused norms) in which every
node that read a weight the build quantized is replaced by what the quantized contract graph computes there
(its codes, scales, offset and low-rank branches, AWQ input scales: the build's numbers, produced once), with

* `MatMul(x, DequantizeLinear(codes))` and the tied lm_head's `Gemm(x, DequantizeLinear(table), transB=1)` as
  `com.microsoft` MatMulNBits (4 or 8 bits, blocks of KERNEL_BLOCK along K, ACCURACY_LEVEL);
* the embedding `Gather(DequantizeLinear(table), ids)` as GatherBlockQuantized over the same packed bytes (a tied
  table is stored once for both readers).

Why these settings (benchmarks/nbits_rows.py, docs/cpu.md): at accuracy level 4 MatMulNBits quantizes each row's
activations to int8 per block and sums integer dot products; with blocks of 32 a row's result is the same bits in
a pass of any number of rows (1..64 measured, 1 and 2 threads) as alone, so a verify pass reproduces plain
decoding's logits bit for bit with no padding row. Levels 0/1 (fp32 compute) give a one-row pass other bits than a
multi-row one, and blocks of 64/128 at level 4 give the last row of an odd pass other bits. Coarser grids are
written as blocks of 32 with each scale repeated (the same weights).

Which fused-graph initializer is which contract weight: the exporter points the fused graph at the contract's
bytes (or writes equal bytes), so weights are matched by their bytes, not their names; equal small tensors (norm
weights of a fresh model) are matched in the order the graphs first read them. Whatever the quantized contract
graph changed besides (norm weights AWQ folded its scales into) is read from it by name.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..errors import UnsupportedError, with_article
from ..manifest import GraphSpec
from ..onnx_versions import required_onnxruntime, save_model
from ..weights_file import StoredBytes, WeightsWriter, external_location, external_tensor, read_tensor
from ..export.moe_ops import reads_rows
from .block_sums import reduce_block_sums
from .head_fold import fold_head_reshapes
from .nbits import ACCURACY_LEVEL, NBitsPacker

SMALL_TENSOR = 1 << 20  # bytes: tensors below this are matched by content (equal norm weights), larger by location
MAX_REGION = 64  # nodes the quantized contract graph may use for one weight reader (DQ, side branches, input scale)


@dataclasses.dataclass
class _Graph:
    """A graph's structure and the folder its external data is relative to."""

    model: onnx.ModelProto
    folder: Path

    def __post_init__(self):
        self.inits = {i.name: i for i in self.model.graph.initializer}
        self.producers = {o: n for n in self.model.graph.node for o in n.output if o}

    def array(self, name: str) -> np.ndarray:
        return read_tensor(self.inits[name], self.folder)

    def first_use_order(self) -> list[str]:
        """Initializer names in the order the nodes first read them."""
        seen: dict[str, None] = {}
        for node in self.model.graph.node:
            for name in node.input:
                if name in self.inits:
                    seen.setdefault(name)
        return list(seen)

    def content_key(self, name: str) -> tuple:
        init = self.inits[name]
        raw = np.ascontiguousarray(self.array(name)).view(np.uint8) if init.data_type != TensorProto.STRING else b""
        return init.data_type, tuple(init.dims), hashlib.blake2b(memoryview(raw).cast("B"), digest_size=16).digest()

    def nbytes(self, name: str) -> int:
        stored = external_location(self.inits[name])
        return stored.length if stored is not None else len(self.inits[name].raw_data)


def _location_key(graph: _Graph, name: str) -> tuple | None:
    stored = external_location(graph.inits[name])
    if stored is None:
        return None
    return (graph.folder / stored.location).resolve(), stored.offset, stored.length


def match_weights(fused: _Graph, source: _Graph) -> dict[str, str]:
    """fused initializer -> the source contract initializer with the same bytes (see the module docstring)."""
    by_location: dict[tuple, str] = {}
    by_content: dict[tuple, list[str]] = {}
    for name in source.first_use_order():
        if source.nbytes(name) < SMALL_TENSOR:
            by_content.setdefault(source.content_key(name), []).append(name)
        else:
            key = _location_key(source, name)
            if key is not None:
                by_location.setdefault(key, name)
    taken: dict[tuple, int] = {}
    pairs: dict[str, str] = {}
    for name in fused.first_use_order():
        if fused.nbytes(name) >= SMALL_TENSOR:
            key = _location_key(fused, name)
            if key in by_location:
                pairs[name] = by_location[key]
                continue
            candidates = _large_candidates(fused, source, name)
            if candidates:
                pairs[name] = candidates[0]
            continue
        key = fused.content_key(name)
        names = by_content.get(key, [])
        if names:
            index = taken.get(key, 0)
            pairs[name] = names[min(index, len(names) - 1)]
            taken[key] = index + 1
    return pairs


def _large_candidates(fused: _Graph, source: _Graph, name: str) -> list[str]:
    """Source initializers with the bytes of large fused initializer `name` (compared by hash, same shape only)."""
    init = fused.inits[name]
    same_shape = [s for s, t in source.inits.items() if t.data_type == init.data_type and list(t.dims) == list(init.dims)]
    if not same_shape:
        return []
    key = fused.content_key(name)
    return [s for s in same_shape if source.content_key(s) == key]


WEIGHT_READERS = {"MatMul": 1, "Gemm": 1, "Gather": 0}  # operator -> the input that holds a weight


def _check_weights_matched(fused: _Graph, pairs: dict[str, str]) -> None:
    """Every weight the fused graph multiplies by or gathers from must be a contract weight: one that is not would
    stay fp32 (and unquantized) in a graph the manifest calls quantized."""
    for node in fused.model.graph.node:
        position = WEIGHT_READERS.get(node.op_type)
        if position is None or position >= len(node.input):
            continue
        name = node.input[position]
        init = fused.inits.get(name)
        if init is not None and len(init.dims) == 2 and init.data_type == TensorProto.FLOAT and name not in pairs:
            raise UnsupportedError(f"the fused graph's {name} is none of the contract graph's weights")


def region(graph: _Graph, outputs: list[str], boundary: set[str], foreign: set[str]) -> list[onnx.NodeProto]:
    """The nodes of `graph` that compute `outputs` from the `boundary` tensors and initializers, in graph order.
    `foreign`: tensors of the rest of the graph; reaching one means the region is not self-contained."""
    picked: set[int] = set()
    stack = [t for t in outputs if t]
    seen: set[str] = set()
    while stack:
        tensor = stack.pop()
        if tensor in boundary or tensor in graph.inits or tensor in seen or not tensor:
            continue
        seen.add(tensor)
        node = graph.producers.get(tensor)
        if node is None or (tensor in foreign and tensor not in outputs):
            raise UnsupportedError(f"the quantized graph computes {outputs[0]} from {tensor}, outside the weight's reader")
        if id(node) not in picked:
            picked.add(id(node))
            stack.extend(node.input)
        if len(picked) > MAX_REGION:
            raise UnsupportedError(f"the quantized graph computes {outputs[0]} with more than {MAX_REGION} nodes")
    return [n for n in graph.model.graph.node if id(n) in picked]


class CpuGraphRewriter:
    """Rewrites fused CPU graphs of the source export over one quantized contract graph (module docstring).

    `source`: the export's contract graph (what the fused graph's weights are the bytes of); `quantized`: the
    build's contract graph, written in `out` (the new graphs point at its external data where they reuse a
    tensor unchanged); new tensors go to `writer`, one file for every rewritten graph."""

    def __init__(self, source: _Graph, quantized: _Graph, writer: WeightsWriter, accuracy_level: int = ACCURACY_LEVEL,
                 integer_head: bool = False):
        self.source = source
        self.quantized = quantized
        self.writer = writer
        self.packer = NBitsPacker(quantized, writer, accuracy_level)
        self.integer_head = integer_head
        self.source_tensors = {t for n in source.model.graph.node for t in (*n.input, *n.output)}
        self._readers_used: dict[tuple, int] = {}
        self._emitted_constants: set[str] = set()

    def rewrite(self, fused: _Graph) -> onnx.ModelProto:
        """The fused graph with every reader of a quantized weight replaced (a new ModelProto)."""
        pairs = match_weights(fused, self.source)
        _check_weights_matched(fused, pairs)
        quantized_away = {f for f, s in pairs.items() if s not in self.quantized.inits}
        self._readers_used = {}
        self._emitted_constants: set[str] = set()
        nodes: list[onnx.NodeProto] = []
        for node in fused.model.graph.node:
            if any(name in quantized_away for name in node.input):
                nodes += self._transplant(node, pairs)
            else:
                nodes.append(node)
        nodes = fold_head_reshapes(nodes, {o.name for o in fused.model.graph.output})
        if self.integer_head:  # after the fold: the integer head reads [batch, rows, K] as it is
            nodes = self.packer.integer_heads(nodes)
        inits: dict[str, TensorProto] = {}
        used = dict.fromkeys(t for n in nodes for t in n.input)  # in the order the nodes read them: the same file every build
        for name in fused.first_use_order():
            if name in used and name not in quantized_away:
                inits[name] = self._carried(fused, name, pairs.get(name))
        for name in used:
            if name not in inits and name not in fused.inits:
                tensor = self.packer.tensor(name)
                if tensor is not None:
                    inits[name] = tensor
        graph = helper.make_graph(nodes, fused.model.graph.name, list(fused.model.graph.input), list(fused.model.graph.output),
                                  list(inits.values()))
        model = helper.make_model(graph, opset_imports=list(fused.model.opset_import))
        model.ir_version = fused.model.ir_version
        model.producer_name = fused.model.producer_name
        return model

    def _carried(self, fused: _Graph, name: str, source_name: str | None) -> TensorProto:
        """Fused initializer `name` in the new graph: the quantized contract's tensor where the fused one is a
        contract weight (AWQ may have changed it), else the fused graph's own (rotary tables, constants)."""
        if source_name is not None:
            return self.packer.reuse(source_name, name)
        init = fused.inits[name]
        if external_location(init) is None:
            return init
        if not self.writer.has(name):
            return self.writer.add(name, np.asarray(fused.array(name)))
        stored: StoredBytes = self.writer.stored(name)
        return external_tensor(name, init.data_type, list(init.dims), stored)

    def _source_reader(self, node: onnx.NodeProto, pairs: dict[str, str]) -> onnx.NodeProto:
        """The source contract's node that `node` (of the fused graph) stands for: the same operator reading the same
        weights at the same inputs (the k-th such fused node is the k-th such source node)."""
        weights = tuple((i, pairs[t]) for i, t in enumerate(node.input) if t in pairs)
        found = [n for n in self.source.model.graph.node if n.op_type == node.op_type
                 and all(i < len(n.input) and n.input[i] == s for i, s in weights)]
        index = self._readers_used.get((node.op_type, weights), 0)
        if index >= len(found):
            raise UnsupportedError(f"{node.name}: no {node.op_type} of the contract graph reads {weights[0][1]}")
        self._readers_used[(node.op_type, weights)] = index + 1
        return found[index]

    def _transplant(self, node: onnx.NodeProto, pairs: dict[str, str]) -> list[onnx.NodeProto]:
        """The quantized contract graph's computation of `node`'s outputs, renamed into the fused graph."""
        source_node = self._source_reader(node, pairs)
        if len(source_node.input) != len(node.input) or len(source_node.output) != len(node.output):
            raise UnsupportedError(f"{node.name}: its contract-graph counterpart {source_node.name} has another signature")
        renames = {s: f for s, f in zip(source_node.input, node.input) if f not in pairs}
        renames.update(zip(source_node.output, node.output))
        q = self.quantized
        nodes = region(q, list(source_node.output), set(renames) - set(source_node.output), self.source_tensors)
        constants = self._constant_outputs(nodes)
        prefix = f"{node.name or node.op_type}/"
        out = []
        rank = 2 if any(reads_rows(t) for t in node.input if t in pairs) else 3  # a MoE block's MatMuls read [rows, K]
        for new in reduce_block_sums(self.packer.convert(nodes), q, self.packer.new_tensors, rank):  # engines/block_sums.py
            shared = all(not t or t in constants or t in q.inits or t in self.packer.new_tensors for t in new.input)
            for i, t in enumerate(new.input):
                if t in renames:
                    new.input[i] = renames[t]
                elif t in q.inits or t in constants:
                    new.input[i] = self.packer.name_of(t)
                elif t and t not in self.packer.new_tensors:
                    new.input[i] = prefix + t
            if shared and not any(o in renames for o in new.output):  # a constant of the quantized graph: emitted once
                new.output[:] = [self.packer.name_of(o) for o in new.output]
                if new.output[0] in self._emitted_constants:
                    continue
                self._emitted_constants.update(new.output)
                new.name = self.packer.name_of(new.name)
            else:
                new.output[:] = [renames.get(o, prefix + o) for o in new.output]
                new.name = prefix + new.name
            out.append(new)
        return out

    def _constant_outputs(self, nodes: list[onnx.NodeProto]) -> set[str]:
        """Outputs of the region's nodes that depend on initializers only."""
        constant: set[str] = set()
        for n in nodes:
            if all(not t or t in self.quantized.inits or t in constant for t in n.input):
                constant.update(n.output)
        return constant


def reads_files(directory: Path, spec: GraphSpec, files: list[str]) -> bool:
    """Whether graph `spec` of the artifact in `directory` reads external data from any of `files`."""
    graph = onnx.load(str(Path(directory) / spec.file), load_external_data=False)
    return any(stored is not None and stored.location in files for stored in map(external_location, graph.graph.initializer))


PACKED_SCHEMES = ("int4", "int8")  # weights MatMulNBits takes (FP8 / NVFP4 codes are not integers on a grid)


def quantized_cpu_graphs(src_dir: Path, fused: dict[str, GraphSpec], contract: GraphSpec, out_dir: Path, scheme: str,
                         progress=lambda _: None, integer_head: bool = False) -> tuple[dict[str, GraphSpec], list[str]]:
    """`write_cpu_graphs` for the export's fused CPU variants of `contract` among `fused` (manifest name -> spec),
    when the build's weights can be packed; nothing (the contract graph runs, said in `progress`) otherwise."""
    variants = {name: spec for name, spec in fused.items()
                if spec.extra.get("variant_of") == contract.file and "ort-cpu" in spec.extra.get("backends", ())}
    if not variants:
        return {}, []
    if scheme not in PACKED_SCHEMES:
        progress(f"note: no fused CPU graph for {with_article(scheme)} build (ONNX Runtime CPU runs {contract.file}, weights dequantized at load)")
        return {}, []
    try:
        return write_cpu_graphs(src_dir, variants, contract, out_dir, scheme, progress, integer_head=integer_head)
    except UnsupportedError as exc:
        progress(f"note: no fused CPU graph ({exc}); ONNX Runtime CPU runs {contract.file}, weights dequantized at load")
        return {}, []


def write_cpu_graphs(src_dir: Path, fused_specs: dict[str, GraphSpec], contract: GraphSpec, out_dir: Path,
                     scheme: str, progress=lambda _: None, accuracy_level: int = ACCURACY_LEVEL,
                     integer_head: bool = False) -> tuple[dict[str, GraphSpec], list[str]]:
    """The quantized forms of the export's fused CPU graphs `fused_specs` (manifest name -> spec, variants of
    `contract`), written into `out_dir` next to the build's quantized `contract`; returns their specs and files.
    `accuracy_level`: MatMulNBits' (0: fp32 arithmetic, for tests: not row-exact, see the module docstring);
    `integer_head`: a tied lm_head over a per-row INT8 table runs as an integer product (engines/integer_head.py)."""
    if not fused_specs:
        return {}, []
    source = _Graph(onnx.load(str(Path(src_dir) / contract.file), load_external_data=False), Path(src_dir))
    quantized = _Graph(onnx.load(str(Path(out_dir) / contract.file), load_external_data=False), Path(out_dir))
    data_name = contract.file.removesuffix(".onnx") + ".ort.onnx.data"
    specs: dict[str, GraphSpec] = {}
    files = [data_name]
    with WeightsWriter(Path(out_dir) / data_name) as writer:
        rewriter = CpuGraphRewriter(source, quantized, writer, accuracy_level, integer_head)
        for name, spec in fused_specs.items():
            progress(f"writing {spec.file}: the fused CPU graph with packed weights (MatMulNBits, GatherBlockQuantized)")
            fused = _Graph(onnx.load(str(Path(src_dir) / spec.file), load_external_data=False), Path(src_dir))
            model = rewriter.rewrite(fused)
            save_model(model, Path(out_dir) / spec.file)
            onnx.checker.check_model(str(Path(out_dir) / spec.file))
            needs = required_onnxruntime(model)
            extra = {**spec.extra, "quantization": scheme, "cpu_kernels": rewriter.packer.summary()}
            if needs is not None:
                extra["min_onnxruntime"] = max(spec.extra.get("min_onnxruntime", "0"), ".".join(map(str, needs)),
                                               key=lambda v: tuple(int(p) for p in v.split(".")))
            specs[name] = dataclasses.replace(spec, dtype=f"{spec.dtype}+{scheme}", extra=extra)
            files.append(spec.file)
    return specs, files
