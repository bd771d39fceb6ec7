#!/usr/bin/env python
"""Target pass time by q on ort-cuda: the GPU graph with CUDA graphs, without them, and the contract graph.

    python benchmarks/gpu_pass_times.py --artifact /tmp/e16 [--context 256] [--repeats 50] [--json] [--device cpu]

After a prefill of --context tokens, each q in 1, 2, 4, ... 64 is timed --repeats times (median ms, after
warm-up runs; the KV rows a pass writes are never committed, so every pass sees the same context). The GPU
graph's passes go through OrtCudaSession (a q that is not a bucket size runs padded to its bucket); the
contract graph's through OrtSession on the CUDA EP. Needs onnxruntime-gpu and a GPU; else one line.
`--device cpu` runs the same sessions on ONNX Runtime CPU (no CUDA graphs): how the tests check this script.
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
    """Median ms of a q-row causal pass over `context` committed rows (random token ids), per q."""
    import numpy as np

    rng = np.random.default_rng(0)
    vocab = int(next(t.shape[-1] for t in session.spec.outputs if t.name == "logits"))
    cache = session.new_cache()
    out = session.run(rng.integers(0, vocab, context), np.arange(context),
                      cache.attention_mask(np.tril(np.ones((context, context), bool))), cache)
    cache.append(out.presents, range(context), context)
    times = {}
    for q in qs:
        ids, pos = rng.integers(0, vocab, q), np.arange(context, context + q)
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


def pass_sessions(artifact: Path, device: str) -> dict[str, object]:
    """The sessions to time, by label: the GPU graph with and without CUDA graphs (CUDA graphs on cuda only),
    and the contract graph."""
    from speccompile.manifest import read_manifest, variant_name
    from speccompile.runtime.backends.ort import OrtSession
    from speccompile.runtime.backends.ort_cuda import OrtCudaSession

    manifest = read_manifest(artifact, verify_files=False)
    max_context = int(manifest.limits["max_context"])
    sessions: dict[str, object] = {}
    gpu_name = variant_name("target", "cuda")
    if gpu_name in manifest.graphs:
        spec = manifest.graph(gpu_name)
        for label, graphs in (("gpu graph + CUDA graphs", True), ("gpu graph, no CUDA graphs", False)):
            if graphs and device != "cuda":
                continue
            sessions[label] = OrtCudaSession(artifact, spec, device, max_context, cuda_graph=graphs)
    else:
        print(f"note: {artifact} has no {gpu_name} (fp32 export?): contract graph only", file=sys.stderr)
    backend = "ort-cuda" if device == "cuda" else "ort-cpu"
    sessions["contract graph"] = OrtSession(artifact, manifest, manifest.graph("target"), backend)
    return sessions


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", type=Path, required=True)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    import onnxruntime as ort

    if args.device == "cuda" and "CUDAExecutionProvider" not in ort.get_available_providers():
        print(f"error: gpu_pass_times.py needs onnxruntime-gpu and a GPU: onnxruntime {ort.__version__} here has no "
              "CUDAExecutionProvider (--device cpu runs it on ONNX Runtime CPU)", file=sys.stderr)
        return 2
    from speccompile.manifest import read_manifest

    results = {label: time_passes(session, args.context, QS, args.repeats)
               for label, session in pass_sessions(args.artifact, args.device).items()}
    dtype = read_manifest(args.artifact, verify_files=False).graph("target").dtype
    print(f"target pass ms by q ({args.context} cached rows, median of {args.repeats}; {dtype}, {args.device})")
    print(f"  {'':<26}" + "".join(f"{'q=' + str(q):>9}" for q in QS))
    for label, times in results.items():
        print(f"  {label:<26}" + "".join(f"{times[q]:>9.3f}" for q in QS))
    if args.json:
        print(json.dumps({"context": args.context, "device": args.device, "ms_by_q": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
