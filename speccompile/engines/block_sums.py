"""The offset branch's block sums on the packed CPU graph: a reduction instead of a MatMul by a 0/1 matrix.

A weight on an asymmetric source grid (GGUF Q4_1 / Q4_K: w = d q + m per block of B inputs) is computed in the
quantized contract graph as x W = x DQ(codes) + (x E) O, where E [K, K/B] is 1 where input k is in block j
(engines/quantize.py, `block_sum_matrix`) and O [K/B, N] the blocks' offsets. MatMulNBits cannot take the
offsets itself (a real-valued zero point sends it to a fallback that dequantizes on every call, docs/cpu.md), so
the packed CPU graph keeps the branch; there, `x E` costs a full fp32 GEMM call per weight for what is a sum of
each block of B consecutive inputs. `reduce_block_sums` writes it as Reshape(x, [0, 0, K/B, B]) + ReduceSum over
the last axis: the same sums (summed in another order: the graph's own numbers, not the contract graph's bits),
each row's from its own inputs only, so a row's result still does not depend on the pass's row count
(tests/test_quantized_exact.py proves it on a Q4_1 build). The fused graph's activations are [batch, rows, K], a
MoE block's [rows, K] (tests/test_moe_gguf.py builds one from Q4_0 experts).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .quantize import block_sum_matrix


class ConstantSource(Protocol):
    """The quantized contract graph's initializers (engines/cpu_graph.py's _Graph)."""

    inits: dict[str, TensorProto]

    def array(self, name: str) -> np.ndarray: ...


def _block_of(graph: ConstantSource, name: str, producers: dict[str, onnx.NodeProto]) -> tuple[int, int] | None:
    """(K, B) when tensor `name` is a block-sum matrix E [K, K/B] (an initializer, or a Cast of one), else None."""
    node = producers.get(name)
    if node is not None:
        if node.op_type != "Cast" or node.input[0] not in graph.inits:
            return None
        name = node.input[0]
    init = graph.inits.get(name)
    if init is None or len(init.dims) != 2 or not init.dims[1] or init.dims[0] % init.dims[1]:
        return None
    k, groups = int(init.dims[0]), int(init.dims[1])
    if not np.array_equal(np.asarray(graph.array(name), np.float32), block_sum_matrix(k, k // groups)):
        return None
    return k, k // groups


def reduce_block_sums(nodes: list[onnx.NodeProto], graph: ConstantSource,
                      new_tensors: dict[str, TensorProto], rank: int = 3) -> list[onnx.NodeProto]:
    """`nodes` (a region of the quantized graph, in order) with every MatMul(x, E) as Reshape + ReduceSum (module
    docstring), and the Casts of E nothing reads any more dropped. `rank`: x's (3: [batch, rows, K]; 2: a MoE
    block's [rows, K]). The shape and axes constants are added to `new_tensors` (shared between regions by name)."""
    producers = {o: n for n in nodes for o in n.output}
    out: list[onnx.NodeProto] = []
    for node in nodes:
        found = _block_of(graph, node.input[1], producers) if node.op_type == "MatMul" and len(node.input) == 2 else None
        if found is None:
            out.append(node)
            continue
        k, block = found
        shape = _constant(new_tensors, f"block_sums/shape_{k}x{block}" + ("" if rank == 3 else f"_rank{rank}"),
                          [0] * (rank - 1) + [k // block, block])
        axes = _constant(new_tensors, "block_sums/last_axis", [-1])
        blocks = node.output[0] + "/blocks"
        out += [helper.make_node("Reshape", [node.input[0], shape], [blocks], name=f"{node.name}/blocks"),
                helper.make_node("ReduceSum", [blocks, axes], list(node.output), name=f"{node.name}/sum", keepdims=0)]
    read = {t for n in out for t in n.input}
    return [n for n in out if not (n.op_type == "Cast" and _block_of(graph, n.output[0], producers) and not any(o in read for o in n.output))]


def _constant(new_tensors: dict[str, TensorProto], name: str, values: list[int]) -> str:
    if name not in new_tensors:
        new_tensors[name] = numpy_helper.from_array(np.asarray(values, np.int64), name)
    return name
