#!/usr/bin/env python
"""Is a row of ONNX Runtime CPU's MatMulNBits / GatherBlockQuantized the same bits in a pass of M rows as alone?

Speculative decoding is exact on the CPU graphs only if a position's logits are the same bits in a verify pass
(q rows) as in a plain pass (1 row, or 2 with the fused graph's attention padding row). This script measures,
for each MatMulNBits variant (bits, block, zero points none / uint8 / float, accuracy_level, threads, shapes of
SmolLM2-135M and Llama-3-8B layers), for M = 1..--max-rows:

  alone  fraction of rows r < M whose output in the M-row pass equals the bits of a 1-row pass of row r;
  pair   the same against a 2-row pass [x_r, x_r] (what a one-row pass becomes with a padding row);
  diff   the largest |difference| against `pair`, relative to the row's largest |output|;
  us(1), us(2), us(k): median microseconds of a 1-, 2- and k-row pass (k = --k).

On the large shapes the variants ONNX Runtime runs through its fallback (the weight dequantized on every call:
float zero points, 8 bits at accuracy levels 0/1) are left out; the small shapes show them. For
GatherBlockQuantized (4 and 8 bits): whether a gathered row depends on the other indices of the gather.
Prints one line per variant and, with --json, writes every number. Results are printed, never asserted:
docs/cpu.md keeps the findings. Example (the docs' table):
  python benchmarks/nbits_rows.py --json /tmp/nbits_rows.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from speccompile.engines.nbits import nbits_weight, pack_codes  # noqa: E402

SHAPES = {  # name -> (K, N)
    "smollm2.qkv": (576, 960), "smollm2.gate_up": (576, 3072), "smollm2.down": (1536, 576), "smollm2.lm_head": (576, 49152),
    "llama8b.qkv": (4096, 6144), "llama8b.down": (14336, 4096),
}
QUICK_ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 64)


def matmul_model(k: int, n: int, bits: int, block: int, zero: str, level: int, seed: int = 0) -> tuple[onnx.ModelProto, np.ndarray]:
    """One MatMulNBits node over a random weight; returns the model and the float32 weight it dequantizes to."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 2 ** bits, size=(k, n))
    scale = (rng.random((k // block, n)) * 0.02 + 0.001).astype(np.float32)
    zp = {"none": None, "uint8": rng.integers(0, 2 ** bits, size=(k // block, n)).astype(np.float32),
          "float": (rng.random((k // block, n)) * (2 ** bits - 1)).astype(np.float32)}[zero]
    w = nbits_weight(codes, scale, bits, block, zp)
    inits = [numpy_helper.from_array(w.packed, "B"), numpy_helper.from_array(w.scales, "scales")]
    inputs = ["A", "B", "scales"]
    if w.zero_points is not None:
        inits.append(numpy_helper.from_array(w.zero_points, "zp"))
        inputs.append("zp")
    node = helper.make_node("MatMulNBits", inputs, ["Y"], domain="com.microsoft", K=k, N=n, bits=bits, block_size=block,
                            accuracy_level=level)
    graph = helper.make_graph([node], "nbits", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    return model, w.dequantize()


def session(model: onnx.ModelProto, threads: int) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def timed(sess: ort.InferenceSession, feed: dict, repeats: int) -> float:
    sess.run(None, feed)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        sess.run(None, feed)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def row_independence(sess: ort.InferenceSession, x: np.ndarray, rows: list[int]) -> dict:
    """alone / pair fractions and the largest relative difference per M (see the module docstring)."""
    run = lambda a: sess.run(None, {"A": np.ascontiguousarray(a)})[0]  # noqa: E731
    alone = np.stack([run(x[r : r + 1])[0] for r in range(max(rows))])
    pair = np.stack([run(np.stack([x[r], x[r]]))[0] for r in range(max(rows))])
    per_m = {}
    for m in rows:
        y = run(x[:m])
        same_alone = np.all(y == alone[:m], axis=1)
        same_pair = np.all(y == pair[:m], axis=1)
        scale = np.abs(pair[:m]).max(axis=1) + 1e-30
        diff = float((np.abs(y - pair[:m]).max(axis=1) / scale).max())
        per_m[m] = {"alone": float(same_alone.mean()), "pair": float(same_pair.mean()), "diff": diff}
    return per_m


def measure_matmul(shape: str, bits: int, block: int, zero: str, level: int, threads: int, rows: list[int], k_rows: int,
                   repeats: int) -> dict:
    k, n = SHAPES[shape]
    model, w = matmul_model(k, n, bits, block, zero, level)
    try:
        sess = session(model, threads)
    except Exception as exc:  # an unsupported combination: say which
        return {"error": str(exc).splitlines()[0][:160]}
    x = np.random.default_rng(1).standard_normal((max(rows), k)).astype(np.float32)
    ref = x[:4].astype(np.float64) @ w.astype(np.float64)
    got = sess.run(None, {"A": x[:4]})[0]
    rel = float(np.abs(got - ref).max() / np.abs(ref).max())
    result = {"rows": row_independence(sess, x, rows), "rel_error_vs_fp64": rel}
    result["us"] = {m: timed(sess, {"A": x[:m]}, repeats) for m in (1, 2, k_rows)}
    return result


def gather_model(v: int, h: int, bits: int, block: int, zero: bool) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 2 ** bits, size=(v, h))
    inits = [numpy_helper.from_array(pack_codes(codes, bits), "data"),
             numpy_helper.from_array((rng.random((v, h // block)) * 0.02).astype(np.float32), "scales")]
    inputs = ["data", "ids", "scales"]
    if zero:
        inits.append(numpy_helper.from_array(pack_codes(rng.integers(0, 2 ** bits, size=(v, h // block)), bits), "zp"))
        inputs.append("zp")
    node = helper.make_node("GatherBlockQuantized", inputs, ["Y"], domain="com.microsoft", bits=bits, block_size=block,
                            gather_axis=0, quantize_axis=1)
    graph = helper.make_graph([node], "gbq", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, "M"])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, "M", h])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])


def measure_gather(bits: int, block: int, zero: bool, threads: int) -> dict:
    v, h = 49152, 576
    try:
        sess = session(gather_model(v, h, bits, block, zero), threads)
    except Exception as exc:
        return {"error": str(exc).splitlines()[0][:160]}
    ids = np.random.default_rng(2).integers(0, v, size=(1, 64))
    alone = np.concatenate([sess.run(None, {"ids": ids[:, r : r + 1]})[0] for r in range(64)], axis=1)
    same = [bool(np.array_equal(sess.run(None, {"ids": ids[:, :m]})[0], alone[:, :m])) for m in range(1, 65)]
    return {"all_rows_equal": all(same), "us_1": timed(sess, {"ids": ids[:, :1]}, 50)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--shapes", default="smollm2.qkv,smollm2.gate_up,smollm2.down,smollm2.lm_head,llama8b.qkv,llama8b.down")
    ap.add_argument("--bits", default="4,8")
    ap.add_argument("--blocks", default="32,64,128")
    ap.add_argument("--zeros", default="none,uint8,float")
    ap.add_argument("--levels", default="0,1,4")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--max-rows", type=int, default=64)
    ap.add_argument("--all-rows", action="store_true", help="every M in 1..max-rows (default: a spread incl. tile edges)")
    ap.add_argument("--k", type=int, default=5, help="rows of the timed k-row pass")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--json", help="write every number here")
    args = ap.parse_args()
    rows = list(range(1, args.max_rows + 1)) if args.all_rows else [m for m in QUICK_ROWS if m <= args.max_rows]
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"onnxruntime {ort.__version__}; uptime: {load}")
    results = {"onnxruntime": ort.__version__, "uptime": load, "matmul": [], "gather": []}
    grid = itertools.product(args.shapes.split(","), map(int, args.bits.split(",")), map(int, args.blocks.split(",")),
                             args.zeros.split(","), map(int, args.levels.split(",")), map(int, args.threads.split(",")))
    for shape, bits, block, zero, level, threads in grid:
        if SHAPES[shape][0] % block:
            continue  # MatMulNBits takes a partial last block, but no build writes one
        big = shape.startswith("llama8b") or shape.endswith("lm_head")
        if big and (zero == "float" or (bits == 8 and level < 4)):
            continue  # ONNX Runtime's fallback (weights dequantized on every call): measured on the small shapes
        r = measure_matmul(shape, bits, block, zero, level, threads, [m for m in rows if not big or m in QUICK_ROWS], args.k,
                           5 if big else args.repeats)
        key = dict(shape=shape, bits=bits, block=block, zero=zero, level=level, threads=threads)
        results["matmul"].append({**key, **r})
        label = f"{shape:16s} b{bits} B{block:<3d} zp={zero:5s} acc{level} t{threads}"
        if "error" in r:
            print(f"{label}  unsupported: {r['error']}", flush=True)
            continue
        per_m = r["rows"]
        bad_alone = [m for m, v in per_m.items() if v["alone"] < 1]
        bad_pair = [m for m, v in per_m.items() if m >= 2 and v["pair"] < 1]
        worst = max(v["diff"] for m, v in per_m.items() if m >= 2)
        us = r["us"]
        print(f"{label}  alone!=: {len(bad_alone):2d}/{len(per_m)} M  pair!= (M>=2): {bad_pair[:8]}"
              f"{'...' if len(bad_pair) > 8 else ''} maxdiff {worst:.1e}  err {r['rel_error_vs_fp64']:.1e}  "
              f"us 1/2/{args.k}: {us[1]:.0f}/{us[2]:.0f}/{us[args.k]:.0f}", flush=True)
    for bits, block, zero, threads in itertools.product((4, 8), (32, 64), (False, True), (1, 2)):
        r = measure_gather(bits, block, zero, threads)
        results["gather"].append(dict(bits=bits, block=block, zero=zero, threads=threads, **r))
        print(f"GatherBlockQuantized b{bits} B{block} zp={zero} t{threads}: {r}", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
