"""The premise of the cut rule (runtime/backends/wide_head.py), checked on ONNX Runtime's CPU GroupQueryAttention
itself at head_dim 256: a query row's output is the same bits in two passes exactly when both end in the same
"half" for the row's own 128-slot block (short: the pass's last slot E in that block with E mod 128 <= 63; long
otherwise); at head_dim 512 the same with 64-slot blocks (E mod 64 <= 31). Random rows, pass sizes and padding
rows; if a future onnxruntime changes the kernel, this fails."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

import pytest

from speccompile.runtime.backends.wide_head import CUT_BLOCK, CUT_BLOCKS, CUT_HALF, WideHeadRule

HEADS, CAPACITY = 4, 768


def _attention(dim: int) -> ort.InferenceSession:
    """One GroupQueryAttention (4 query heads, 1 KV head, head_dim `dim`) over a shared past/present buffer."""
    f = TensorProto.FLOAT
    node = helper.make_node("GroupQueryAttention", ["q", "k", "v", "pk", "pv", "seqlens_k", "total", "", "", "", "bias"],
                            ["out", "present_k", "present_v"], domain="com.microsoft", num_heads=HEADS, kv_num_heads=1,
                            scale=dim ** -0.5)
    inputs = [helper.make_tensor_value_info("q", f, [1, "S", HEADS * dim]), helper.make_tensor_value_info("k", f, [1, "S", dim]),
              helper.make_tensor_value_info("v", f, [1, "S", dim]), helper.make_tensor_value_info("pk", f, [1, 1, CAPACITY, dim]),
              helper.make_tensor_value_info("pv", f, [1, 1, CAPACITY, dim]),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
              helper.make_tensor_value_info("total", TensorProto.INT32, []),
              helper.make_tensor_value_info("bias", f, [1, 1, "S", "T"])]
    outputs = [helper.make_tensor_value_info("out", f, [1, "S", HEADS * dim]),
               helper.make_tensor_value_info("present_k", f, [1, 1, CAPACITY, dim]),
               helper.make_tensor_value_info("present_v", f, [1, 1, CAPACITY, dim])]
    model = helper.make_model(helper.make_graph([node], "gqa", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _row(session, data, p: int, first: int, pad: int) -> np.ndarray:
    """Row p's output from a pass of rows first..p (keys 0..first-1 cached) plus `pad` copies of row p after it."""
    keys, values, queries = data
    past_k, past_v = np.zeros((2, 1, 1, CAPACITY, keys.shape[1]), np.float32)
    past_k[0, 0, :first], past_v[0, 0, :first] = keys[:first], values[:first]
    rows = [*range(first, p + 1), *[p] * pad]
    total = first + len(rows)
    bias = np.full((1, 1, len(rows), total), -np.inf, np.float32)
    for i in range(len(rows)):
        bias[0, 0, i, : first + min(i, p - first) + 1] = 0
    out = session.run(["out"], {"q": queries[rows][None], "k": keys[rows][None], "v": values[rows][None], "pk": past_k,
                                "pv": past_v, "seqlens_k": np.array([total - 1], np.int32),
                                "total": np.array(total, np.int32), "bias": bias})[0]
    return out[0, p - first]


def _short(p: int, last: int, block: int = CUT_BLOCK) -> bool:
    return last // block == p // block and last % block <= block // 2 - 1


@pytest.mark.parametrize("dim", sorted(CUT_BLOCKS))
def test_a_rows_bits_follow_where_its_pass_ends(dim):
    session, rng, block = _attention(dim), np.random.default_rng(0), CUT_BLOCKS[dim]
    data = (rng.standard_normal((CAPACITY, dim), np.float32), rng.standard_normal((CAPACITY, dim), np.float32),
            rng.standard_normal((CAPACITY, HEADS * dim), np.float32))
    alone, agree, differ = {}, 0, 0
    for _ in range(120):
        p = int(rng.integers(1, 640))
        q, pad = int(rng.integers(1, min(p, 24) + 1)), int(rng.choice([0, 1, 3, 20, 66]))
        pad = max(pad, int(q == 1))
        if p not in alone:  # plain decoding: a one-row pass and its padding row
            alone[p] = _row(session, data, p, p, 1)
        same = np.array_equal(_row(session, data, p, p - q + 1, pad), alone[p])
        predicted = _short(p, p + pad, block) == _short(p, p + 1, block)
        assert same == predicted, (p, q, pad)
        agree += same
        differ += not same
    assert agree > 20 and differ > 5  # both kinds were met


def test_passes_within_a_segment_end_as_alone():
    """The cut rule's consequence: a pass whose rows lie between two cuts (plus a one-row pass's padding row) ends
    in the same half as each of its rows alone."""
    for blocks in ((CUT_BLOCK,), (64,), (CUT_BLOCK, 64)):  # head_dim 256, 512, both (Gemma 4): the union of the cuts
        rule = WideHeadRule(cut_blocks=blocks)
        for start in range(0, 600):
            rows = rule.rows_from(start)
            assert 1 <= rows <= min(blocks)
            for q in range(1, rows + 1):
                last = start + q - 1 + int(q == 1)
                assert all(_short(p, last, b) == _short(p, p + 1, b) for b in blocks for p in range(start, start + q)), (blocks, start, q)
    assert WideHeadRule(cut_blocks=(CUT_BLOCK,)).segments(60, 140) == [(0, 3), (3, 131), (131, 140)]
    assert WideHeadRule(cut_blocks=(CUT_BLOCK, 64)).segments(60, 140) == [(0, 3), (3, 35), (35, 99), (99, 131), (131, 140)]
