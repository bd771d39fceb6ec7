"""The lowest ONNX IR version and opsets a graph needs, so that every onnx + onnxruntime pair we allow loads it.

`onnx.helper.make_model` and the exporters stamp a graph with the newest IR version the *installed*
onnx knows (onnx 1.23 writes IR 14); an older onnxruntime then refuses the file although none of its
operators needs anything new. `save_model` here lowers the stamp before writing:

* default-domain opset: the highest `since_version` among the operator versions the graph resolves to
  (lowering further would change what some operator means);
* IR version: the lowest one whose onnx release defines that opset (`onnx.helper.VERSION_TABLE`) and
  every element type the graph uses (float8: IR 9, int4/uint4: 10, float4e2m1: 11, float8e8m0: 12,
  int2/uint2: 13 -- the comments of onnx.proto's `Version` enum).

What each onnxruntime release loads (`ORT_LIMITS`) was measured, not copied from a table: the
onnxruntime 1.20.1, 1.21.1 and 1.22.0 wheels from PyPI loading a one-node graph stamped with IR 10..14
and opsets 21..25 (IR > 10 fails in all three, "Unsupported model IR version"; opset 22 fails in 1.20,
opset 23 in all three), and their operator schemas (`onnxruntime.capi.onnxruntime_pybind11_state.
get_all_operator_schema()`): `com.microsoft.GroupQueryAttention` has the inputs `position_ids` and
`attention_bias` (input 10 and 11, which the fused CPU graph uses) from 1.22.0 on; 1.20 and 1.21
stop at `sin_cache` (9 inputs); 8-bit `com.microsoft.MatMulNBits` (the int8 drafter-head variant) loads
from 1.22.0 on (1.20/1.21: "Only 4b quantization is supported for MatMulNBits op"). onnxruntime's own version matrix (docs/reference/compatibility.html)
gives the same opset/IR numbers for 1.20 (opset 21, IR 10).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:  # onnx is imported where a graph is handled: the runtime only asks about onnxruntime
    import onnx

MS_DOMAIN = "com.microsoft"


@dataclass(frozen=True)
class OrtLimits:
    """What one onnxruntime release loads."""

    max_ir_version: int
    max_opset: int  # default ONNX domain
    gqa_inputs: int  # inputs of com.microsoft.GroupQueryAttention
    matmul_nbits: tuple[int, ...]  # `bits` of com.microsoft.MatMulNBits its CPU kernel accepts


ORT_LIMITS: dict[tuple[int, int], OrtLimits] = {
    (1, 20): OrtLimits(max_ir_version=10, max_opset=21, gqa_inputs=9, matmul_nbits=(4,)),
    (1, 21): OrtLimits(max_ir_version=10, max_opset=22, gqa_inputs=9, matmul_nbits=(4,)),
    (1, 22): OrtLimits(max_ir_version=10, max_opset=22, gqa_inputs=11, matmul_nbits=(4, 8)),
}
MIN_ORT = (1, 20)  # pyproject.toml: onnxruntime>=1.20

# TensorProto element type -> the IR version that introduced it (types not listed exist since IR <= 8):
# FLOAT8E4M3FN, FLOAT8E4M3FNUZ, FLOAT8E5M2, FLOAT8E5M2FNUZ (17-20): 9; UINT4, INT4 (21, 22): 10;
# FLOAT4E2M1 (23): 11; FLOAT8E8M0 (24): 12; UINT2, INT2 (25, 26): 13. The numbers are fixed by onnx.proto.
_TYPE_IR = {17: 9, 18: 9, 19: 9, 20: 9, 21: 10, 22: 10, 23: 11, 24: 12, 25: 13, 26: 13}


def _graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """`graph` and every subgraph (If/Loop/Scan bodies)."""
    import onnx

    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _graphs(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for sub in attr.graphs:
                    yield from _graphs(sub)


def _opset(model: onnx.ModelProto, domain: str) -> int | None:
    return next((op.version for op in model.opset_import if op.domain in ((domain,) if domain else ("", "ai.onnx"))), None)


def lowest_opset(model: onnx.ModelProto) -> int | None:
    """The lowest default-domain opset under which every node resolves to the operator version it has now."""
    import onnx

    current = _opset(model, "")
    if current is None:
        return None
    needed = 1
    for graph in _graphs(model.graph):
        for node in graph.node:
            if node.domain not in ("", "ai.onnx"):
                continue
            try:
                needed = max(needed, onnx.defs.get_schema(node.op_type, current, "").since_version)
            except onnx.defs.SchemaError:  # an operator this onnx does not know: keep the opset as it is
                return current
    return min(current, needed)


def _element_types(model: onnx.ModelProto) -> set[int]:
    import onnx

    types: set[int] = set()

    def value_types(values) -> None:
        for value in values:
            if value.type.HasField("tensor_type"):
                types.add(value.type.tensor_type.elem_type)

    for graph in _graphs(model.graph):
        types.update(t.data_type for t in graph.initializer)
        value_types(graph.input)
        value_types(graph.output)
        value_types(graph.value_info)
        for node in graph.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.TENSOR:
                    types.add(attr.t.data_type)
                elif attr.name in ("to", "output_dtype", "scale_type") and attr.type == onnx.AttributeProto.INT:
                    types.add(int(attr.i))
    return types


def lowest_ir_version(model: onnx.ModelProto) -> int:
    """The lowest IR version that has the model's default-domain opset and every element type it uses."""
    import onnx
    from onnx import helper

    needed = 7  # onnxruntime loads nothing older than opset 7 / IR 3; 7 is what onnx 1.8 wrote
    opset = _opset(model, "")
    ml_opset = _opset(model, "ai.onnx.ml")
    for _release, ir, onnx_opset, ml, *_training in helper.VERSION_TABLE:
        if (opset is None or onnx_opset >= opset) and (ml_opset is None or ml >= ml_opset):
            needed = max(needed, ir)
            break
    else:
        needed = max(needed, onnx.IR_VERSION)
    for elem in _element_types(model):
        needed = max(needed, _TYPE_IR.get(elem, 0))
    return needed


def pin_versions(model: onnx.ModelProto) -> onnx.ModelProto:
    """Set the model's default-domain opset and IR version to the lowest it needs (in place; returns it)."""
    opset = lowest_opset(model)
    if opset is not None:
        for op in model.opset_import:
            if op.domain in ("", "ai.onnx"):
                op.version = opset
    model.ir_version = lowest_ir_version(model)
    return model


def save_model(model: onnx.ModelProto, path: str | Path, **kwargs: Any) -> None:
    """`onnx.save_model` after `pin_versions`: what every graph speccompile writes goes through."""
    import onnx

    onnx.save_model(pin_versions(model), str(path), **kwargs)


def required_onnxruntime(model: onnx.ModelProto) -> tuple[int, int] | None:
    """The oldest onnxruntime release in `ORT_LIMITS` that loads `model`; None when none of them does."""
    opset = _opset(model, "") or 0
    contrib = [n for g in _graphs(model.graph) for n in g.node if n.domain == MS_DOMAIN]
    gqa = max((len(n.input) for n in contrib if n.op_type == "GroupQueryAttention"), default=0)
    bits = {a.i for n in contrib if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "bits"}
    for version in sorted(ORT_LIMITS):
        limits = ORT_LIMITS[version]
        if (model.ir_version <= limits.max_ir_version and opset <= limits.max_opset and gqa <= limits.gqa_inputs
                and bits <= set(limits.matmul_nbits)):
            return version
    return None


def installed_onnxruntime() -> tuple[int, int]:
    import onnxruntime

    major, minor = onnxruntime.__version__.split(".")[:2]
    return int(major), int(minor)


def onnxruntime_loads(required: str | None) -> bool:
    """Whether the installed onnxruntime is at least `required` ("1.22"; None = no requirement)."""
    if not required:
        return True
    return installed_onnxruntime() >= tuple(int(p) for p in required.split(".")[:2])


def version_string(version: tuple[int, int]) -> str:
    return ".".join(map(str, version))
