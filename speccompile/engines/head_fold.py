"""The tied lm_head of a quantized CPU graph without its two Reshapes.

The fused CPU graph projects a tied head with `Gemm(Reshape(x, [-1, K]), table, transB=1)`, a 2-D operator, and
reshapes the [rows, V] result back to [batch, rows, V] (export/ort_fused_graph.py `_head`). Once the build has
turned the Gemm into MatMulNBits, which takes [batch, rows, K] as it is, both Reshapes only cost time: the last
one feeds the graph output `logits`, so ONNX Runtime copies the rows x V floats into the caller's bound buffer
after the projection instead of projecting into it (Gemma 3's 262144-token vocabulary: ~2.4 MB a row, 3 ms of a
9-row pass on a 2-core CPU). MatMulNBits computes each row alike whatever the leading shape (M = batch x rows),
so the logits keep their bits.
"""

from __future__ import annotations

import onnx

FLAT_SHAPE = "lm_head.flat_shape"  # the [-1, K] shape the exporter names (export/ort_fused_graph.py)
VOCAB = "lm_head.vocab"  # the [V] tail of the [batch, rows, V] shape it concatenates


def fold_head_reshapes(nodes: list[onnx.NodeProto], graph_outputs: set[str]) -> list[onnx.NodeProto]:
    """`nodes` with `MatMulNBits(Reshape(x, FLAT_SHAPE))` reshaped to [batch, rows, V] read as `MatMulNBits(x)`,
    where the flat and projected tensors have no other reader; the Shape/Concat that built the shape are dropped
    when nothing else reads them. Unchanged where the pattern is not there (untied heads, fp32 graphs)."""
    producer = {out: node for node in nodes for out in node.output if out}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in nodes:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    dropped: set[int] = set()
    for node in nodes:
        if node.op_type != "MatMulNBits":
            continue
        flat = producer.get(node.input[0])
        if flat is None or flat.op_type != "Reshape" or flat.input[1] != FLAT_SHAPE:
            continue
        after = readers.get(node.output[0], [])
        if len(after) != 1 or after[0].op_type != "Reshape" or len(readers.get(flat.output[0], [])) != 1:
            continue
        if node.output[0] in graph_outputs or flat.output[0] in graph_outputs:
            continue
        shape = producer.get(after[0].input[1])
        if shape is None or shape.op_type != "Concat" or VOCAB not in shape.input:
            continue
        node.input[0] = flat.input[0]
        node.output[0] = after[0].output[0]
        dropped.update({id(flat), id(after[0])})
        dropped.update(_dead_shape_nodes(shape, producer, readers, graph_outputs))
    return [node for node in nodes if id(node) not in dropped]


def _dead_shape_nodes(concat: onnx.NodeProto, producer: dict, readers: dict, graph_outputs: set[str]) -> set[int]:
    """The shape-building Concat and the Shape nodes feeding it, where the folded Reshape was their only reader."""
    if len(readers.get(concat.output[0], [])) != 1 or concat.output[0] in graph_outputs:
        return set()
    dead = {id(concat)}
    for name in concat.input:
        source = producer.get(name)
        if source is not None and source.op_type == "Shape" and len(readers.get(name, [])) == 1:
            dead.add(id(source))
    return dead
