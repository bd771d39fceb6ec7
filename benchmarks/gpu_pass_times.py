#!/usr/bin/env python
"""Target pass time by q on ort-cuda: the GPU graph with CUDA graphs, without them, and the contract graph.

    python benchmarks/gpu_pass_times.py --artifact /tmp/e16 [--context 256] [--repeats 50] [--json]

After a prefill of --context tokens, each q in 1, 2, 4, ... 64 is timed --repeats times (median ms, after
warm-up runs; the KV rows a pass writes are never committed, so every pass sees the same context). The GPU
graph's passes go through OrtCudaSession (a q that is not a bucket size runs padded to its bucket); the
contract graph's through OrtSession on the CUDA EP. Needs onnxruntime-gpu and a GPU; else one line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

QS = (1, 2, 4, 8, 16, 32, 64)


def time_passes(session, context: int, qs, repeats: int) -> dict[int, float]:
    """Median ms of a q-row causal pass over `context` committed rows, per q."""
    import numpy as np

    rng = np.random.default_rng(0)
    cache = session.new_cache()
    out = session.run(rng.integers(10, 1000, context), np.arange(context),
                      cache.attention_mask(np.tril(np.ones((context, context), bool))), cache)
    cache.append(out.presents, range(context), context)
    times = {}
    for q in qs:
        ids, pos = rng.integers(10, 1000, q), np.arange(context, context + q)
        mask = cache.attention_mask(np.tril(np.ones((q, q), bool)))
        for _ in range(3):  # warm-up: ONNX Runtime captures the bucket's CUDA graph here
            session.run(ids, pos, mask, cache)
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            session.run(ids, pos, mask, cache)
            samples.append((time.perf_counter() - t0) * 1000)
        times[q] = round(statistics.median(samples), 3)
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", type=Path, required=True)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        print(f"error: gpu_pass_times.py needs onnxruntime-gpu and a GPU: onnxruntime {ort.__version__} here has no "
              "CUDAExecutionProvider", file=sys.stderr)
        return 2
    from speccompile.manifest import read_manifest, variant_name
    from speccompile.runtime.backends.ort import OrtSession
    from speccompile.runtime.backends.ort_cuda import OrtCudaSession

    manifest = read_manifest(args.artifact, verify_files=False)
    max_context = int(manifest.limits["max_context"])
    results = {}
    gpu_name = variant_name("target", "cuda")
    if gpu_name in manifest.graphs:
        spec = manifest.graph(gpu_name)
        for label, graphs in (("gpu graph + CUDA graphs", True), ("gpu graph, no CUDA graphs", False)):
            session = OrtCudaSession(args.artifact, spec, "cuda", max_context, cuda_graph=graphs)
            results[label] = time_passes(session, args.context, QS, args.repeats)
    else:
        print(f"note: {args.artifact} has no {gpu_name} (fp32 export?): contract graph only", file=sys.stderr)
    results["contract graph"] = time_passes(OrtSession(args.artifact, manifest.graph("target"), "ort-cuda"), args.context, QS, args.repeats)
    print(f"target pass ms by q ({args.context} cached rows, median of {args.repeats}; {manifest.graph('target').dtype})")
    print(f"  {'':<26}" + "".join(f"{'q=' + str(q):>9}" for q in QS))
    for label, times in results.items():
        print(f"  {label:<26}" + "".join(f"{times[q]:>9.3f}" for q in QS))
    if args.json:
        print(json.dumps({"context": args.context, "ms_by_q": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
