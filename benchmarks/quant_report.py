"""Quantized targets vs fp32: sizes, logit error, top-1 agreement, and n-gram speculative acceptance.

    python benchmarks/quant_report.py /tmp/smol --build fp8 int4 nvfp4-emulated --limit 2 --max-tokens 64

For every scheme an `--onnx-only` artifact is built (or taken from --artifact NAME=DIR). Per prompt the fp32
target greedily generates --max-tokens tokens; then every model scores prompt + continuation in one
teacher-forced pass, and the logits of the continuation positions are compared with fp32:
  * mean |dlogit| relative to mean |logit|, max |dlogit|
  * top-1 agreement (argmax equal), and KL(p_fp32 || p_quant) in nats
Then each quantized target generates on its own with the n-gram drafter (greedy) on the same backend:
tokens per target pass, acceptance per draft position, decode tok/s, and whether its text equals fp32's.

`nvfp4-emulated`: ONNX Runtime CPU cannot execute FP4 DequantizeLinear, so this builds an fp32 artifact
whose weights are the exact NVFP4 dequantized values (weights only; TensorRT's dynamic FP4 activation
quantization is NOT emulated, so real NVFP4 errors are larger).
Timings are printed, never asserted; the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def dir_size_mb(path: Path, prefix: str = "target.onnx") -> float:
    return sum(f.stat().st_size for f in path.iterdir() if f.name.startswith(prefix)) / 1e6


def build(src: Path, scheme: str, work: Path, threads: int | None) -> Path:
    from speccompile.engines.build import BuildOptions, build_artifact

    out = work / scheme
    if (out / "manifest.json").is_file():
        return out
    if scheme == "nvfp4-emulated":
        return emulate_nvfp4(src, out)
    build_artifact(src, out, BuildOptions(precision=scheme, onnx_only=True, threads=threads, force=True))
    return out


def emulate_nvfp4(src: Path, out: Path) -> Path:
    """fp32 copy of the artifact with every quantizable weight replaced by its NVFP4 round trip."""
    import onnx
    from onnx import numpy_helper

    from speccompile.engines import numerics as nx
    from speccompile.engines.qdq_targets import DEFAULT_EXCLUDE, is_excluded, weight_matmuls
    from speccompile.manifest import read_manifest

    tmp = out.parent / f".{out.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp, ignore=shutil.ignore_patterns("target.onnx*"))
    model = onnx.load(str(src / "target.onnx"))
    inits = {i.name: i for i in model.graph.initializer}
    for _i, _act, weight in weight_matmuls(model):
        if is_excluded(weight, DEFAULT_EXCLUDE) or inits[weight].dims[0] % 16:
            continue
        w = numpy_helper.to_array(inits[weight]).astype(np.float32)
        codes, s8, s2 = nx.nvfp4_quantize(w.T)
        inits[weight].CopyFrom(numpy_helper.from_array(nx.nvfp4_dequantize(codes, s8, s2).T.copy(), weight))
    onnx.save_model(model, str(tmp / "target.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="target.onnx.data", size_threshold=1024)
    manifest = read_manifest(tmp, verify_files=False)
    manifest.precision = {"target": {"scheme": "nvfp4-emulated (weights only)"}}
    manifest.record_files(tmp, ["target.onnx", "target.onnx.data"])
    manifest.write(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def teacher_forced_logits(session, ids: list[int]) -> np.ndarray:
    cache = session.new_cache()
    q = len(ids)
    mask = cache.attention_mask(np.tril(np.ones((q, q), dtype=bool)))
    return session.run(np.asarray(ids, np.int64), np.arange(q, dtype=np.int64), mask, cache).logits


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("fp32", type=Path, help="exported fp32 artifact")
    parser.add_argument("--build", nargs="*", default=["fp8", "int4", "nvfp4-emulated"], help="schemes to build (--onnx-only)")
    parser.add_argument("--artifact", action="append", default=[], help="NAME=DIR of an already built artifact")
    parser.add_argument("--work", type=Path, default=Path("/tmp/speccompile-quant-report"))
    parser.add_argument("--workload", type=Path, action="append", default=None)
    parser.add_argument("--limit", type=int, default=2, help="prompts per workload")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from speccompile.runtime.bench import load_workload
    from speccompile.runtime.session import Runner

    args.work.mkdir(parents=True, exist_ok=True)
    workloads = args.workload or [ROOT / "benchmarks/workloads/copy.jsonl", ROOT / "benchmarks/workloads/chat.jsonl"]
    prompts = [(w.stem, p) for w in workloads for p in load_workload(w, args.limit)]
    artifacts: dict[str, Path] = {}
    build_times = {}
    for scheme in args.build:
        t = time.time()
        artifacts[scheme] = build(args.fp32, scheme, args.work, args.threads)
        build_times[scheme] = round(time.time() - t, 1)
    for item in args.artifact:
        name, _, path = item.partition("=")
        artifacts[name] = Path(path)

    ref_runner = Runner(args.fp32, threads=args.threads, drafter="ngram")
    runners = {name: Runner(path, threads=args.threads, drafter="ngram") for name, path in artifacts.items()}
    report = {"fp32": str(args.fp32), "max_tokens": args.max_tokens, "prompts": len(prompts), "build_s": build_times,
              "sizes_mb": {"fp32": round(dir_size_mb(args.fp32), 1), **{n: round(dir_size_mb(p), 1) for n, p in artifacts.items()}},
              "models": {}}
    acc = {name: {"dl": [], "ref": [], "max": 0.0, "top1": [], "kl": [], "tpp": [], "tps": [], "same": 0, "first_div": [],
                  "acc_pos": []} for name in ["fp32", *artifacts]}
    for wl, p in prompts:
        ids = ref_runner.artifact.tokenizer.prompt_ids(p["prompt"], p["chat"])
        base = ref_runner.generate_ids(ids, args.max_tokens, drafter="none")
        seq = ids + list(base.tokens)
        ref_logits = teacher_forced_logits(ref_runner.artifact.target, seq)[len(ids) - 1: len(seq) - 1]
        ref_lp = log_softmax(ref_logits)
        spec = ref_runner.generate_ids(ids, args.max_tokens)
        a = acc["fp32"]
        a["tpp"].append(spec.stats.mean_accepted_length)
        a["tps"].append(spec.stats.tokens_per_second)
        a["acc_pos"].append(spec.stats.acceptance_per_position[:4])
        for name, runner in runners.items():
            logits = teacher_forced_logits(runner.artifact.target, seq)[len(ids) - 1: len(seq) - 1]
            a = acc[name]
            diff = np.abs(logits - ref_logits)
            a["dl"].append(float(diff.mean()))
            a["ref"].append(float(np.abs(ref_logits).mean()))
            a["max"] = max(a["max"], float(diff.max()))
            a["top1"].append(float((logits.argmax(-1) == ref_logits.argmax(-1)).mean()))
            a["kl"].append(float((np.exp(ref_lp) * (ref_lp - log_softmax(logits))).sum(-1).mean()))
            gen = runner.generate_ids(ids, args.max_tokens)
            a["tpp"].append(gen.stats.mean_accepted_length)
            a["tps"].append(gen.stats.tokens_per_second)
            a["acc_pos"].append(gen.stats.acceptance_per_position[:4])
            a["same"] += int(list(gen.tokens) == list(base.tokens))
            div = next((i for i, (x, y) in enumerate(zip(gen.tokens, base.tokens)) if x != y), min(len(gen.tokens), len(base.tokens)))
            a["first_div"].append(div)
        print(f"  done {wl}/{p['id']} ({len(ids)} prompt tokens)", file=sys.stderr)

    for name, a in acc.items():
        row = {
            "size_mb": report["sizes_mb"][name],
            "ngram_tokens_per_pass": round(float(np.mean(a["tpp"])), 2),
            "ngram_decode_tok_s": round(float(np.mean(a["tps"])), 1),
            "ngram_acceptance_pos1": round(float(np.mean([x[0] for x in a["acc_pos"] if x] or [0])), 2),
        }
        if name != "fp32":
            row.update({
                "rel_mean_abs_logit_err": round(float(np.sum(a["dl"]) / np.sum(a["ref"])), 4),
                "max_abs_logit_err": round(a["max"], 2),
                "top1_agreement": round(float(np.mean(a["top1"])), 4),
                "kl_nats": round(float(np.mean(a["kl"])), 4),
                "greedy_identical_to_fp32": f"{a['same']}/{len(prompts)}",
                "mean_first_divergence": round(float(np.mean(a["first_div"])), 1),
            })
        report["models"][name] = row
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"fp32 artifact {args.fp32}; {len(prompts)} prompts x {args.max_tokens} tokens; build times {build_times}")
    cols = ["size_mb", "rel_mean_abs_logit_err", "max_abs_logit_err", "top1_agreement", "kl_nats", "greedy_identical_to_fp32",
            "mean_first_divergence", "ngram_tokens_per_pass", "ngram_acceptance_pos1", "ngram_decode_tok_s"]
    print("| model | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for name, row in report["models"].items():
        print(f"| {name} | " + " | ".join(str(row.get(c, "-")) for c in cols) + " |")


if __name__ == "__main__":
    main()
