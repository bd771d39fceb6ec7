#!/usr/bin/env python
"""What attention costs in a CPU pass, and whether another form of it would be cheaper.

Two measurements, both printed, never asserted (docs/cpu.md, Limits, keeps the findings):

* `--artifact DIR`: CPU time of one pass of the artifact's target on ort-cpu by cached length and rows
  (`--lengths 30,600 --rows 1,2,4,8`, one thread, median of 12 passes after a prefill of random ids): the
  difference between lengths is what attention over the cache costs.
* always: one layer of attention of the given shape (SmolLM2-135M's by default: 9 query heads, 3 KV heads,
  head dim 64) in two forms over the same in-place KV buffers, by rows S at cached length --cached:
  `gqa`, com.microsoft GroupQueryAttention as the fused CPU graph runs it (rotary inside, packed QKV, additive
  bias); `decomposed`, RotaryEmbedding + TensorScatter (the new K/V rows written into the bound buffers in
  place) + MatMul(K, Q^T) with the cache as the GEMM's unpacked A operand + Softmax + MatMul(P, V), each KV
  head's query heads stacked as rows. Reports both times, their largest difference, whether the KV buffers
  came out equal, and whether the decomposed form gives a row the same bits in a 9-row pass as in a 3-row one.

    python benchmarks/attention_forms.py --artifact BUILT --lengths 30,600
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

FLOAT, INT64, INT32 = TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT32
OPSETS = [helper.make_opsetid("", 24), helper.make_opsetid("com.microsoft", 1)]


def _info(name: str, dtype: int, shape: list) -> object:
    return helper.make_tensor_value_info(name, dtype, shape)


def _model(nodes: list, inputs: list, heads: int, kv_heads: int, head_dim: int, capacity: int, inits: list):
    outputs = [_info("out", FLOAT, [1, "S", heads * head_dim]), _info("present_k", FLOAT, [1, kv_heads, capacity, head_dim]),
               _info("present_v", FLOAT, [1, kv_heads, capacity, head_dim])]
    model = helper.make_model(helper.make_graph(nodes, "attention", inputs, outputs, inits), opset_imports=OPSETS)
    model.ir_version = 10
    return model


def attention_models(heads: int, kv_heads: int, head_dim: int, capacity: int, max_position: int = 8192):
    """(GroupQueryAttention model, decomposed model) over the same inputs (module docstring)."""
    group = heads // kv_heads
    rng = np.random.default_rng(0)
    rotary = [numpy_helper.from_array(rng.random((max_position, head_dim // 2), np.float32), name) for name in ("cos", "sin")]
    common = [_info("qkv", FLOAT, [1, "S", (heads + 2 * kv_heads) * head_dim]),
              _info("past_k", FLOAT, [1, kv_heads, capacity, head_dim]), _info("past_v", FLOAT, [1, kv_heads, capacity, head_dim]),
              _info("pos", INT64, [1, "S"])]
    gqa = helper.make_node("GroupQueryAttention", ["qkv", "", "", "past_k", "past_v", "seqlens", "total", "cos", "sin", "pos", "bias"],
                           ["out", "present_k", "present_v"], domain="com.microsoft", do_rotary=1, kv_num_heads=kv_heads,
                           num_heads=heads, scale=head_dim ** -0.5)
    gqa_inputs = common + [_info("bias", FLOAT, [1, 1, "S", "T"]), _info("seqlens", INT32, [1]), _info("total", INT32, [])]
    inits = list(rotary)

    def const(name: str, values) -> str:
        inits.append(numpy_helper.from_array(np.asarray(values), name))
        return name

    kv_shape = const("kv_shape", np.array([1, -1, kv_heads, head_dim], np.int64))
    nodes = [
        helper.make_node("Split", ["qkv", const("split", np.array([heads, kv_heads, kv_heads], np.int64) * head_dim)], ["q", "k", "v"], axis=-1),
        helper.make_node("RotaryEmbedding", ["q", "pos", "cos", "sin"], ["q_rot"], domain="com.microsoft", num_heads=heads, interleaved=0),
        helper.make_node("RotaryEmbedding", ["k", "pos", "cos", "sin"], ["k_rot"], domain="com.microsoft", num_heads=kv_heads, interleaved=0),
        helper.make_node("Reshape", ["k_rot", kv_shape], ["k_heads"]),
        helper.make_node("Transpose", ["k_heads"], ["k_new"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["v", kv_shape], ["v_heads"]),
        helper.make_node("Transpose", ["v_heads"], ["v_new"], perm=[0, 2, 1, 3]),
        helper.make_node("TensorScatter", ["past_k", "k_new", "write_at"], ["present_k"], axis=2),
        helper.make_node("TensorScatter", ["past_v", "v_new", "write_at"], ["present_v"], axis=2),
        helper.make_node("Reshape", ["q_rot", const("q_shape", np.array([1, -1, kv_heads, group, head_dim], np.int64))], ["q_groups"]),
        helper.make_node("Transpose", ["q_groups"], ["q_cols"], perm=[0, 2, 4, 3, 1]),
        helper.make_node("Reshape", ["q_cols", const("qt_shape", np.array([1, kv_heads, head_dim, -1], np.int64))], ["q_t"]),
        helper.make_node("MatMul", ["present_k", "q_t"], ["scores_t"]),
        helper.make_node("Transpose", ["scores_t"], ["scores"], perm=[0, 1, 3, 2]),
        helper.make_node("Mul", ["scores", const("scale", np.array(head_dim ** -0.5, np.float32))], ["scaled"]),
        helper.make_node("Add", ["scaled", "bias_rows"], ["masked"]),
        helper.make_node("Softmax", ["masked"], ["probs"], axis=-1),
        helper.make_node("MatMul", ["probs", "present_v"], ["context"]),
        helper.make_node("Reshape", ["context", const("o_shape", np.array([1, kv_heads, group, -1, head_dim], np.int64))], ["o_groups"]),
        helper.make_node("Transpose", ["o_groups"], ["o_rows"], perm=[0, 3, 1, 2, 4]),
        helper.make_node("Reshape", ["o_rows", const("out_shape", np.array([1, -1, heads * head_dim], np.int64))], ["out"]),
    ]
    decomposed_inputs = common + [_info("bias_rows", FLOAT, [1, 1, "GS", capacity]), _info("write_at", INT64, [1])]
    return (_model([gqa], gqa_inputs, heads, kv_heads, head_dim, capacity, rotary),
            _model(nodes, decomposed_inputs, heads, kv_heads, head_dim, capacity, inits))


class LayerRunner:
    """Runs one form over KV buffers bound as both past and present (written in place, as the fused graph does)."""

    def __init__(self, model, decomposed: bool, heads: int, kv_heads: int, head_dim: int, capacity: int, threads: int):
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.log_severity_level = 3
        self.session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        self.decomposed, self.group, self.width, self.capacity = decomposed, heads // kv_heads, heads * head_dim, capacity

    def run(self, qkv: np.ndarray, past: int, buffers: list[np.ndarray]) -> tuple[np.ndarray, float]:
        """Rows qkv [1, S, .] at positions past..past+S-1 (causal); (output, CPU seconds of the run)."""
        rows = qkv.shape[1]
        binding = self.session.io_binding()
        for name, buffer in zip(("k", "v"), buffers):
            value = ort.OrtValue.ortvalue_from_numpy(buffer)
            binding.bind_ortvalue_input(f"past_{name}", value)
            binding.bind_ortvalue_output(f"present_{name}", value)
        positions = past + np.arange(rows)
        binding.bind_cpu_input("qkv", qkv)
        binding.bind_cpu_input("pos", positions[None])
        if self.decomposed:
            visible = np.arange(self.capacity)[None] <= positions[:, None]
            bias = np.tile(np.where(visible, np.float32(0), np.float32(-np.inf)), (self.group, 1))
            binding.bind_cpu_input("bias_rows", bias[None, None])
            binding.bind_cpu_input("write_at", np.array([past], np.int64))
        else:
            visible = np.arange(past + rows)[None] <= positions[:, None]
            binding.bind_cpu_input("bias", np.where(visible, np.float32(0), np.float32(-np.inf))[None, None])
            binding.bind_cpu_input("seqlens", np.array([past + rows - 1], np.int32))
            binding.bind_cpu_input("total", np.array(past + rows, np.int32))
        out = np.empty((1, rows, self.width), np.float32)
        binding.bind_ortvalue_output("out", ort.OrtValue.ortvalue_from_numpy(out))
        start = time.process_time()
        self.session.run_with_iobinding(binding)
        return out, time.process_time() - start


def compare_layer(heads: int = 9, kv_heads: int = 3, head_dim: int = 64, cached: int = 600, rows: tuple = (2, 3, 9),
                  repeats: int = 30, threads: int = 1) -> list[dict]:
    """One dict per row count: both forms' median microseconds, their largest difference, equal KV buffers; and
    a last dict with the decomposed form's row invariance (rows of a 9-row pass vs a 3-row and a 2-row pass)."""
    capacity = cached + max(rows) + 16
    gqa_model, decomposed_model = attention_models(heads, kv_heads, head_dim, capacity)
    gqa = LayerRunner(gqa_model, False, heads, kv_heads, head_dim, capacity, threads)
    decomposed = LayerRunner(decomposed_model, True, heads, kv_heads, head_dim, capacity, threads)
    rng = np.random.default_rng(1)
    past = [rng.standard_normal((1, kv_heads, capacity, head_dim), np.float32) for _ in range(2)]
    width = (heads + 2 * kv_heads) * head_dim
    results = []
    for count in rows:
        qkv = rng.standard_normal((1, count, width), np.float32)
        times: dict[str, list[float]] = {"gqa": [], "decomposed": []}
        for _ in range(repeats):
            buffers_gqa, buffers_dec = [p.copy() for p in past], [p.copy() for p in past]
            out_gqa, seconds = gqa.run(qkv, cached, buffers_gqa)
            times["gqa"].append(seconds)
            out_dec, seconds = decomposed.run(qkv, cached, buffers_dec)
            times["decomposed"].append(seconds)
        results.append({"rows": count, "cached": cached, "gqa_us": 1e6 * float(np.median(times["gqa"])),
                        "decomposed_us": 1e6 * float(np.median(times["decomposed"])),
                        "max_abs_diff": float(np.abs(out_gqa - out_dec).max()),
                        "kv_equal": all(np.array_equal(a, b) for a, b in zip(buffers_gqa, buffers_dec))})
    qkv = rng.standard_normal((1, 9, width), np.float32)
    whole, _ = decomposed.run(qkv, cached, [p.copy() for p in past])
    split = [p.copy() for p in past]
    first, _ = decomposed.run(qkv[:, :3], cached, split)
    second, _ = decomposed.run(qkv[:, 3:5], cached + 3, split)
    results.append({"row_invariant": bool(np.array_equal(whole[:, :3], first) and np.array_equal(whole[:, 3:5], second))})
    return results


def pass_times(artifact: str, lengths: list[int], rows: list[int], threads: int = 1, repeats: int = 12) -> dict[tuple, float]:
    """(cached length, rows) -> median CPU ms of one target pass on ort-cpu (module docstring)."""
    from speccompile.runtime.artifact import open_artifact

    opened = open_artifact(artifact, "ort-cpu", threads, True, "none")
    session, vocab = opened.target, opened.tokenizer.vocab_size
    times: dict[tuple, float] = {}
    rng = np.random.default_rng(0)
    for length in lengths:
        cache = session.new_cache(capacity=length + max(rows) + 1)
        ids = rng.integers(1, min(vocab, 1000), size=(1, length))
        session.run(ids, np.arange(length)[None], cache.attention_mask(np.tril(np.ones((length, length), bool))), cache,
                    last_logits_only=True)
        cache.append(None, list(range(length)), length)
        for count in rows:
            samples = []
            for _ in range(repeats):
                mask = cache.attention_mask(np.tril(np.ones((count, count), bool)))
                start = time.process_time()
                session.run(np.full((1, count), 1), np.arange(length, length + count)[None], mask, cache)
                samples.append(time.process_time() - start)
            times[(length, count)] = 1e3 * float(np.median(samples))
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--artifact", help="also time whole passes of this artifact's target by length and rows")
    ap.add_argument("--lengths", default="30,600")
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--cached", type=int, default=600, help="cached rows for the one-layer comparison")
    ap.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head dim")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    heads, kv_heads, head_dim = (int(v) for v in args.heads.split(","))
    if args.artifact:
        lengths, rows = [int(v) for v in args.lengths.split(",")], [int(v) for v in args.rows.split(",")]
        times = pass_times(args.artifact, lengths, rows, args.threads)
        for count in rows:
            line = "  ".join(f"length {length}: {times[(length, count)]:.2f} ms" for length in lengths)
            print(f"pass of {count} rows  {line}")
    for result in compare_layer(heads, kv_heads, head_dim, args.cached, threads=args.threads):
        if "row_invariant" in result:
            print(f"decomposed: a row's bits in a 9-row pass == in 3- and 2-row passes: {result['row_invariant']}")
        else:
            print(f"one layer, {result['rows']} rows over {result['cached']} cached: GroupQueryAttention {result['gqa_us']:.0f} us, "
                  f"decomposed {result['decomposed_us']:.0f} us (x{result['gqa_us'] / result['decomposed_us']:.2f}); "
                  f"max |diff| {result['max_abs_diff']:.1e}, KV buffers equal: {result['kv_equal']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
