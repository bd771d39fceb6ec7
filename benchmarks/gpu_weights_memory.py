#!/usr/bin/env python
"""Memory of the sessions an ort-cuda server opens (issue 46): the target's GPU graph, its slotted form over the
shared weights (what `serve --backend ort-cuda` opens), and one more slotted session that loads its own copy of the
weights (what it opened before the weights were shared).

    python benchmarks/gpu_weights_memory.py /tmp/e16s [--json] [--device cpu]

Prints the memory in use (cuda: nvidia-smi's memory.used of GPU 0; cpu: this process's RSS) before and after each
session opens, each session's KV buffers and the bytes of the shared weights: a slotted session over the shared
weights should add about its KV buffers, one with its own copy the weights on top. `--device cpu` runs the fp32
forms on ONNX Runtime's CPU EP (where prepacked MatMul weights stay each session's own: docs/gpu.md).
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import subprocess
import sys
from pathlib import Path


def memory_mib(device: str) -> float:
    """MiB in use: GPU 0's (nvidia-smi) on cuda, this process's resident set on cpu."""
    if device == "cuda":
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, check=True).stdout
        return float(out.strip().splitlines()[0])
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.device == "cuda" and shutil.which("nvidia-smi") is None:
        print("gpu_weights_memory: no nvidia-smi here (a GPU run; --device cpu runs the fp32 forms on the CPU EP)")
        return 2
    from speccompile.manifest import read_manifest, variant_name
    from speccompile.runtime.backends.factory import open_session
    from speccompile.runtime.backends.shared_weights import SharedWeights

    manifest = read_manifest(args.artifact)
    specs = [manifest.graphs.get(variant_name("target", form)) for form in ("cuda", "cuda-slots")]
    if None in specs:
        print(f"gpu_weights_memory: {args.artifact} has no GPU graph with its slotted form (export --batch-slots N)")
        return 2
    backend = "ort-cuda" if args.device == "cuda" else "ort-cpu"
    context = int(manifest.limits.get("max_context", 2048))
    pool = SharedWeights(args.artifact, [spec.file for spec in specs], args.device)

    def opened(spec, weights) -> tuple[object, float]:
        before = memory_mib(args.device)
        session = open_session(args.artifact, spec, backend, manifest=manifest, max_context=context, weights=weights)
        gc.collect()
        return session, round(memory_mib(args.device) - before, 1)

    start = memory_mib(args.device)
    target, target_mib = opened(specs[0], pool)
    shared, shared_mib = opened(specs[1], pool)
    own, own_mib = opened(specs[1], None)
    report = {"device": args.device, "start_mib": round(start, 1), "weights_shared_mib": round(pool.nbytes / 2**20, 1),
              "shared_tensors": shared.shared_tensors, "target_mib": target_mib,
              "slots_shared_weights_mib": shared_mib, "slots_own_weights_mib": own_mib,
              "slots_kv_mib": round(shared.kv_bytes / 2**20, 1), "in_use_mib": round(memory_mib(args.device), 1)}
    del target, shared, own
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key:>26}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
