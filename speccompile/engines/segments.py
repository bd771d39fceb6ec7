"""Run an ONNX graph one segment at a time, so that memory holds one segment's weights, not the model's.

A graph whose weights do not fit in memory (or that should not be loaded whole: an 8B model on a 24 GB host)
is cut into consecutive segments of its node list (`plan_segments`), each holding about `parameters` weights
(SEGMENT_PARAMETERS: ONNX Runtime CPU holds them as float32, and MatMul weights once more, packed). `SegmentRunner.run`
sends every sample through the first segment, then every sample through the second, and so on (the way GPTQ
implementations calibrate models larger than memory): one ONNX Runtime CPU session per segment, created when its
turn comes and released after it, its weights read in place from the graph's own external data file (onnxruntime
>= 1.21 takes that folder as a session option; before, hard links in a work folder, as ONNX Runtime refuses data
reached through symbolic links), so nothing is copied. Between segments only the tensors a later segment still
reads are kept, per sample.

Cuts fall only on the inputs of weight MatMuls (`weight_inputs`): the tensor a cut hands over is already an
output of the node that made it, and the operators ONNX Runtime fuses (normalizations with their residual add,
attention, rotary embeddings) lie between two weight MatMuls, never across one, so every segment computes
what the whole graph computes: the same kernels on the same values (tests compare the two bit for bit).
Nodes that compute constants (`Constant`, an `Identity` or `DequantizeLinear` of initializers) go into every
segment that reads them, so constant folding sees what it sees in the whole graph.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..onnx_versions import installed_onnxruntime, save_model
from ..weights_file import external_location

EXTERNAL_FOLDER_KEY = "session.model_external_initializers_file_folder_path"
EXTERNAL_FOLDER_ORT = (1, 21)  # the first onnxruntime that takes it
SEGMENT_PARAMETERS = 32 << 20  # weights (elements) a segment reaches before it is cut at the next weight MatMul input

Consume = Callable[[int, str, np.ndarray], None]  # (sample index, tensor name, value)


@dataclass
class Segment:
    """Consecutive nodes of a graph: what they read from earlier segments, what they hand on, their weights."""

    nodes: list[onnx.NodeProto]
    inputs: list[str]
    outputs: list[str]
    initializers: list[str]
    weight_elements: int = 0
    last_use: dict[str, int] = field(default_factory=dict)  # (filled by plan_segments) tensor -> last segment reading it


def tensor_elements(tensor: TensorProto) -> int:
    """Elements of an initializer (from its dims): what a segment's weights cost ONNX Runtime CPU does not depend on
    how they are stored (fp16 and quantized weights become float32 at load, and MatMul weights are packed again)."""
    return int(np.prod(tensor.dims)) if len(tensor.dims) else 1


def constant_tensors(nodes: Sequence[onnx.NodeProto], initializers: Iterable[str]) -> tuple[set[str], dict[str, int]]:
    """(tensors computable from initializers alone, the index of the node making each): initializers, Constant
    outputs and the outputs of nodes whose every input is such a tensor."""
    constant = set(initializers)
    producers: dict[str, int] = {}
    for index, node in enumerate(nodes):
        if all(not name or name in constant for name in node.input):
            for out in node.output:
                constant.add(out)
                producers[out] = index
    return constant, producers


def weight_inputs(model: onnx.ModelProto) -> set[str]:
    """Activations that a MatMul / Gemm multiplies by a constant (a weight, or a weight's DequantizeLinear)."""
    nodes = list(model.graph.node)
    constant, _ = constant_tensors(nodes, (i.name for i in model.graph.initializer))
    return {node.input[0] for node in nodes if node.op_type in ("MatMul", "Gemm") and len(node.input) >= 2
            and node.input[1] in constant and node.input[0] not in constant}


def _needed(nodes: Sequence[onnx.NodeProto], wanted: Iterable[str]) -> list[int]:
    """Indices of the nodes `wanted` depends on, in graph order."""
    producer = {out: index for index, node in enumerate(nodes) for out in node.output}
    needed: set[int] = set()
    stack = list(wanted)
    seen: set[str] = set()
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        index = producer.get(name)
        if index is None or index in needed:
            continue
        needed.add(index)
        stack.extend(n for n in nodes[index].input if n)
    return sorted(needed)


def _constant_closure(names: Iterable[str], nodes: Sequence[onnx.NodeProto], const_producers: dict[str, int],
                      inits: set[str]) -> tuple[set[int], set[str]]:
    """(indices of the constant-computing nodes, initializers) behind tensors `names`."""
    found: set[int] = set()
    used: set[str] = set()
    stack = list(names)
    while stack:
        name = stack.pop()
        if name in inits:
            used.add(name)
        index = const_producers.get(name)
        if index is not None and index not in found:
            found.add(index)
            stack.extend(n for n in nodes[index].input if n)
    return found, used


def plan_segments(model: onnx.ModelProto, wanted: Sequence[str], parameters: int = SEGMENT_PARAMETERS) -> list[Segment]:
    """Cut the nodes `wanted` needs into segments of about `parameters` weights (0: one weight MatMul each).

    A segment ends right after the node that makes a weight MatMul's input once it holds `parameters` weights."""
    nodes = list(model.graph.node)
    inits = {i.name: i for i in model.graph.initializer}
    names = set(inits)
    constant, const_producers = constant_tensors(nodes, names)
    cuts = weight_inputs(model)
    groups: list[list[int]] = [[]]
    held: set[str] = set()
    size = 0
    for index in _needed(nodes, wanted):
        node = nodes[index]
        if all(out in constant for out in node.output):
            continue  # constants travel with the segments that read them
        groups[-1].append(index)
        _, used = _constant_closure([n for n in node.input if n in constant], nodes, const_producers, names)
        size += sum(tensor_elements(inits[name]) for name in used - held)
        held |= used
        if size >= parameters and any(out in cuts for out in node.output):
            groups.append([])
            held, size = set(), 0
    segments = []
    for group in (g for g in groups if g):
        produced = {out for i in group for out in nodes[i].output}
        reads = [name for i in group for name in nodes[i].input if name and name not in produced]
        const_nodes, used = _constant_closure([n for n in reads if n in constant], nodes, const_producers, names)
        members = [nodes[i] for i in sorted(const_nodes | set(group))]
        inputs = list(dict.fromkeys(name for name in reads if name not in constant))
        segments.append(Segment(members, inputs, [], sorted(used), sum(tensor_elements(inits[n]) for n in used)))
    wanted_set = set(wanted)
    last: dict[str, int] = {}
    for index, segment in enumerate(segments):
        for name in segment.inputs:
            last[name] = index
    for index, segment in enumerate(segments):
        produced = dict.fromkeys(out for node in segment.nodes for out in node.output)
        segment.outputs = [name for name in produced if last.get(name, -1) > index or name in wanted_set]
        segment.last_use = last
    return segments


def cpu_session(source: str | bytes, threads: int | None = None, config: dict[str, str] | None = None):
    """An ONNX Runtime CPU session on a graph file or serialized model (errors only logged; `config`: session
    config entries)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if threads:
        opts.intra_op_num_threads = threads
    for key, value in (config or {}).items():
        opts.add_session_config_entry(key, value)
    return ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"])


def _value_infos(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    """Type and shape of every tensor of the graph that shape inference can tell (structure only: no weights read)."""
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    infos = {v.name: v for v in (*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output)}
    return infos


def _external_files(model: onnx.ModelProto) -> set[str]:
    files = set()
    for init in model.graph.initializer:
        stored = external_location(init)
        if stored is not None:
            files.add(stored.location)
    return files


def link_weights(model: onnx.ModelProto, directory: Path, workdir: Path) -> None:
    """Hard links in `workdir` to every external data file of `model` (a copy across file systems)."""
    for location in _external_files(model):
        source, link = (Path(directory) / location).resolve(), Path(workdir) / location
        if link.exists():
            continue
        link.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(source, link)
        except OSError:
            shutil.copyfile(source, link)


class SegmentRunner:
    """Runs samples through a graph (structure in `model`, weights in `directory`) segment by segment."""

    def __init__(self, directory: Path, model: onnx.ModelProto, threads: int | None = None, workdir: Path | None = None,
                 session_config: dict[str, str] | None = None):
        self.directory = Path(directory)
        self.model = model
        self.threads = threads
        self.workdir = workdir
        self.session_config = session_config or {}
        self._infos: dict[str, onnx.ValueInfoProto] | None = None

    def infos(self) -> dict[str, onnx.ValueInfoProto]:
        if self._infos is None:
            self._infos = _value_infos(self.model)
        return self._infos

    def segment_model(self, segment: Segment) -> onnx.ModelProto:
        """One segment as a graph of its own (its initializers still pointing at the external data)."""
        infos = self.infos()
        inits = {i.name: i for i in self.model.graph.initializer}
        graph_inputs = {v.name: v for v in self.model.graph.input}
        graph_outputs = {v.name: v for v in self.model.graph.output}

        def info(name: str) -> onnx.ValueInfoProto:
            found = graph_inputs.get(name) or graph_outputs.get(name) or infos.get(name)
            if found is None or not found.type.tensor_type.elem_type:
                raise ValueError(f"segment boundary {name}: its type is unknown")
            return found

        graph = helper.make_graph(segment.nodes, "segment", [info(n) for n in segment.inputs], [info(n) for n in segment.outputs],
                                  [inits[n] for n in segment.initializers])
        sub = helper.make_model(graph, opset_imports=list(self.model.opset_import))
        sub.ir_version = self.model.ir_version
        return sub

    def steps(self, feeds: Sequence[dict[str, np.ndarray]], wanted: Sequence[str], consume: Consume,
              parameters: int = SEGMENT_PARAMETERS) -> Iterator[list[str]]:
        """Every sample of `feeds` (graph inputs) through every segment; `consume(sample, name, value)` gets each
        tensor of `wanted` as soon as it exists (dropped after, unless a later segment reads it). Yields, after each
        segment, the tensors of `wanted` it completed (every sample has passed them)."""
        segments = plan_segments(self.model, wanted, parameters)
        wanted_set = set(wanted)
        live: list[dict[str, np.ndarray]] = [dict(f) for f in feeds]
        with self._session_maker() as open_session:
            for index, segment in enumerate(segments):
                session = open_session(self.segment_model(segment), index)
                for sample, values in enumerate(live):
                    outputs = session.run(segment.outputs, {name: values[name] for name in segment.inputs})
                    for name, value in zip(segment.outputs, outputs):
                        if name in wanted_set:
                            consume(sample, name, value)
                        if segment.last_use.get(name, -1) > index:
                            values[name] = value
                    for name in segment.inputs:
                        if segment.last_use.get(name) == index:
                            values.pop(name, None)
                del session
                yield [name for name in segment.outputs if name in wanted_set]

    @contextmanager
    def _session_maker(self) -> Iterator[Callable[[onnx.ModelProto, int], object]]:
        """A function (segment graph, index) -> its ONNX Runtime session, reading the weights where they are: from the
        graph's folder (onnxruntime >= 1.21 takes the folder of external data as a session option), or through hard
        links in a temporary folder (ONNX Runtime refuses data reached through symbolic links)."""
        if installed_onnxruntime() >= EXTERNAL_FOLDER_ORT:
            config = {**self.session_config, EXTERNAL_FOLDER_KEY: str(self.directory.resolve())}
            yield lambda graph, _index: cpu_session(graph.SerializeToString(), self.threads, config)
            return
        with tempfile.TemporaryDirectory(prefix="speccompile-segments-", dir=self.workdir) as tmp:
            link_weights(self.model, self.directory, Path(tmp))

            def open_session(graph: onnx.ModelProto, index: int):
                path = Path(tmp) / f"segment{index}.onnx"
                save_model(graph, path)
                try:
                    return cpu_session(str(path), self.threads, self.session_config)
                finally:
                    path.unlink()

            yield open_session

    def run(self, feeds: Sequence[dict[str, np.ndarray]], wanted: Sequence[str], consume: Consume,
            parameters: int = SEGMENT_PARAMETERS) -> None:
        """`steps` to the end."""
        for _ in self.steps(feeds, wanted, consume, parameters):
            pass
