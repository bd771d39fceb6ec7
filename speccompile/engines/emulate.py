"""NVFP4 graphs made runnable on ONNX Runtime CPU with the same numbers (for quality evaluation).

ONNX Runtime CPU has no FLOAT4E2M1 DequantizeLinear and no `trt::TRT_FP4DynamicQuantize`. `emulate_nvfp4`
rewrites a graph written by `quantize_model(scheme="nvfp4")` so that it computes what TensorRT computes:

  * weights: every constant chain DQ(DQ(s_fp8, s2), W_fp4) -> Transpose is folded into one float32
    initializer by `onnx.reference` (the ONNX specification's arithmetic: fp8 scale * s2, e2m1 * scale);
  * activations: TRT_FP4DynamicQuantize + its two DequantizeLinear become a fake-quantization subgraph of
    standard operators with the op's definition (per block of 16 along the last axis:
    s = fp8(block_amax / 6 / s2), x_q = e2m1(x / (s * s2)) * (s * s2)), e2m1 rounding with ties to the
    even code done by Round (half to even) on the three binades of the grid {0, .5, 1, 1.5, 2, 3, 4, 6}.

The result is an fp32 graph that only differs from the NVFP4 one by the summation order of the float32
matrix products (tests compare both against onnx.reference and numpy).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import InputError
from ..onnx_versions import save_model
from ..weights_file import WeightsWriter, load_graph
from . import numerics as nx
from .qdq_targets import TRT_DOMAIN
from .weight_codes import KeepInProto, TensorSink
from .working_graph import ExternalSink, WorkingGraph

_FOLDABLE = ("DequantizeLinear", "Transpose")


def emulate_nvfp4(model: onnx.ModelProto, read: Callable[[str], onnx.TensorProto] | None = None,
                  sink: TensorSink | None = None) -> int:
    """Rewrite an NVFP4 Q/DQ graph in place into an ORT-CPU runnable fp32 graph: weights loaded, or `read(name)` gives
    an initializer with its data; each folded weight goes through `sink` as soon as it exists (default: kept).

    Returns the number of activation quantizers replaced."""
    graph = model.graph
    _fold_constant_dequantize(model, read, sink or KeepInProto())
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    removed: set[int] = set()
    replacements: dict[int, list[onnx.NodeProto]] = {}
    new_inits: list[onnx.TensorProto] = []
    count = 0
    for node in graph.node:
        if node.domain != TRT_DOMAIN or node.op_type != "TRT_FP4DynamicQuantize":
            continue
        block = next((a.i for a in node.attribute if a.name == "block_size"), nx.NVFP4_BLOCK)
        codes, block_scale = node.output
        scale_dq = next(n for n in consumers[block_scale] if n.op_type == "DequantizeLinear")
        value_dq = next(n for n in consumers[codes] if n.op_type == "DequantizeLinear")
        stem = f"{node.name}/emulated"
        nodes, inits = fake_quant_nvfp4_nodes(node.input[0], node.input[1], value_dq.output[0], stem, block)
        new_inits += inits
        removed |= {id(scale_dq), id(value_dq)}
        replacements[id(node)] = nodes
        count += 1
    rewritten: list[onnx.NodeProto] = []
    for node in graph.node:
        if id(node) in removed:
            continue
        rewritten.extend(replacements.get(id(node), [node]))
    del graph.node[:]
    graph.node.extend(rewritten)
    graph.initializer.extend(new_inits)
    for op in list(model.opset_import):
        if op.domain == TRT_DOMAIN:
            model.opset_import.remove(op)
    return count


def _fold_constant_dequantize(model: onnx.ModelProto, read: Callable[[str], onnx.TensorProto] | None, sink: TensorSink) -> None:
    """Replace DequantizeLinear/Transpose nodes whose inputs are all constant by their float32 values, one weight's
    chain at a time (`onnx.reference` on that chain: the arithmetic of the whole graph's evaluation, one weight in
    memory)."""
    from onnx.reference import ReferenceEvaluator

    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    constant = set(inits)
    folded: list[onnx.NodeProto] = []
    for node in graph.node:
        if node.op_type in _FOLDABLE and node.domain in ("", "ai.onnx") and all(i in constant for i in node.input if i):
            folded.append(node)
            constant.update(node.output)
    if not folded:
        return
    folded_ids = {id(n) for n in folded}
    producer = {o: n for n in folded for o in n.output}
    needed = {o for n in graph.node if id(n) not in folded_ids for o in n.input} | {o.name for o in graph.output}
    used_inits = {i for n in folded for i in n.input}
    opsets = [o for o in model.opset_import if o.domain in ("", "ai.onnx")]
    values = []
    for name in sorted(set(producer) & needed):
        chain, stack = {}, [name]
        while stack:
            node = producer.get(stack.pop())
            if node is not None and id(node) not in chain:
                chain[id(node)] = node
                stack.extend(node.input)
        nodes = [n for n in folded if id(n) in chain]
        reads = sorted({i for n in nodes for i in n.input if i in inits})
        tensors = [inits[i] if read is None else read(i) for i in reads]
        sub = helper.make_graph(nodes, "fold", [], [helper.make_tensor_value_info(name, TensorProto.UNDEFINED, None)], tensors)
        sub_model = helper.make_model(sub, opset_imports=opsets)
        sub_model.ir_version = model.ir_version
        value = ReferenceEvaluator(sub_model).run([name], {})[0]
        values.append(sink.put(numpy_helper.from_array(np.asarray(value, dtype=np.float32), name)))
    keep = [i for i in graph.initializer if i.name not in used_inits or i.name in needed]
    del graph.initializer[:]
    graph.initializer.extend(keep)
    graph.initializer.extend(values)
    remaining = [n for n in graph.node if id(n) not in folded_ids]
    del graph.node[:]
    graph.node.extend(remaining)


def fake_quant_nvfp4_nodes(x: str, global_scale: str, out: str, stem: str, block: int = nx.NVFP4_BLOCK):
    """Standard-op nodes computing out = dequantize(TRT_FP4DynamicQuantize(x, global_scale)) along the last axis."""
    def name(suffix: str) -> str:
        return f"{stem}/{suffix}"

    def const(suffix: str, value, dtype=np.float32) -> onnx.TensorProto:
        return numpy_helper.from_array(np.asarray(value, dtype=dtype), name(suffix))

    inits = [
        const("blocks_shape", [-1, block], np.int64), const("axes", [1], np.int64), const("fp4_max", nx.FP4_MAX),
        const("one", 1.0), const("zero", 0.0), const("half", 0.5), const("two", 2.0), const("four", 4.0),
    ]
    zp = onnx.TensorProto()
    zp.name, zp.data_type, zp.raw_data = name("fp8_zero"), TensorProto.FLOAT8E4M3FN, b"\x00"
    inits.append(zp)
    n = helper.make_node
    nodes = [
        n("Shape", [x], [name("shape")], name=name("Shape")),
        n("Reshape", [x, name("blocks_shape")], [name("xb")], name=name("Reshape")),
        n("Abs", [name("xb")], [name("abs")], name=name("Abs")),
        n("ReduceMax", [name("abs"), name("axes")], [name("bamax")], name=name("ReduceMax"), keepdims=1),
        n("Div", [name("bamax"), name("fp4_max")], [name("s6")], name=name("Div6")),
        n("Div", [name("s6"), global_scale], [name("s")], name=name("DivGlobal")),
        # fp8 E4M3 rounding (saturating, nearest even) of the block scale: Q/DQ with scale 1
        n("QuantizeLinear", [name("s"), name("one"), name("fp8_zero")], [name("s_fp8")], name=name("ScaleQ")),
        n("DequantizeLinear", [name("s_fp8"), name("one"), name("fp8_zero")], [name("s_q")], name=name("ScaleDQ")),
        n("Mul", [name("s_q"), global_scale], [name("eff")], name=name("Effective")),
        n("Greater", [name("eff"), name("zero")], [name("pos")], name=name("Positive")),
        n("Div", [name("xb"), name("eff")], [name("raw")], name=name("Scale")),
        n("Where", [name("pos"), name("raw"), name("zero")], [name("scaled")], name=name("ZeroBlocks")),
        n("Abs", [name("scaled")], [name("mag0")], name=name("Mag")),
        n("Min", [name("mag0"), name("fp4_max")], [name("mag")], name=name("Saturate")),
        # e2m1 grid: step 0.5 below 2, 1 in [2, 4), 2 in [4, 6]; Round is half to even = the even code
        n("Mul", [name("mag"), name("two")], [name("m2")], name=name("Times2")),
        n("Round", [name("m2")], [name("r2")], name=name("Round2")),
        n("Mul", [name("r2"), name("half")], [name("q_lo")], name=name("Lo")),
        n("Round", [name("mag")], [name("q_mid")], name=name("Mid")),
        n("Mul", [name("mag"), name("half")], [name("mh")], name=name("Half")),
        n("Round", [name("mh")], [name("rh")], name=name("RoundHalf")),
        n("Mul", [name("rh"), name("two")], [name("q_hi")], name=name("Hi")),
        n("Less", [name("mag"), name("two")], [name("is_lo")], name=name("IsLo")),
        n("Less", [name("mag"), name("four")], [name("is_mid")], name=name("IsMid")),
        n("Where", [name("is_mid"), name("q_mid"), name("q_hi")], [name("q_upper")], name=name("PickUpper")),
        n("Where", [name("is_lo"), name("q_lo"), name("q_upper")], [name("q_mag")], name=name("PickLo")),
        n("Sign", [name("scaled")], [name("sign")], name=name("Sign")),
        n("Mul", [name("q_mag"), name("sign")], [name("q")], name=name("Signed")),
        n("Mul", [name("q"), name("eff")], [name("deq")], name=name("Dequantize")),
        n("Reshape", [name("deq"), name("shape")], [out], name=name("Restore")),
    ]
    return nodes, inits


def write_emulated_artifact(src: Path, dst: Path) -> Path:
    """Copy an NVFP4 `--onnx-only` artifact to `dst` with its target replaced by the emulated fp32 graph (written one
    weight at a time).

    The copy opens with the ONNX Runtime CPU backend (its manifest marks the target `nvfp4-emulated`)."""
    import dataclasses
    import shutil

    from ..manifest import read_manifest

    src, dst = Path(src), Path(dst)
    manifest = read_manifest(src, verify_files=True)
    spec = manifest.graph("target")
    if spec.extra.get("quantization") != "nvfp4":
        raise InputError(f"{src}: the target is not NVFP4-quantized (nothing to emulate)")
    dst.mkdir(parents=True, exist_ok=True)
    target_files = {spec.file, spec.file + ".data"}
    for name in manifest.files:
        if name not in target_files:
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / name, dst / name)
    with WeightsWriter(dst / (spec.file + ".data")) as writer:
        sink = ExternalSink(writer)
        work = WorkingGraph(load_graph(src / spec.file), src, sink)  # one weight at a time: nothing loaded whole
        emulate_nvfp4(work.model, work.tensor, sink)
        work.copy_sources(writer)
        save_model(work.model, dst / spec.file)
    manifest.graphs["target"] = dataclasses.replace(spec, extra={**spec.extra, "quantization": "nvfp4-emulated"})
    for name in target_files:
        manifest.files.pop(name, None)
    manifest.record_files(dst, sorted(target_files))
    manifest.write(dst)
    return dst
