"""Ours vs NVIDIA ModelOpt ONNX PTQ on the same contract graph and calibration prompts, in one table.

    python benchmarks/modelopt_compare.py EXPORTED --modelopt-python /tmp/quant/mo/bin/python \
        --modes fp8 int8 int4 --ours fp8=BUILT_FP8 --ours int4=BUILT_INT4 --work /tmp/quant/mo-work

ModelOpt runs in its own interpreter (`--modelopt-python`): `nvidia-modelopt[onnx]` pins onnx and installs
onnxruntime-gpu, which the project's environment must not change, so it lives in a separate venv:

    python3 -m venv /tmp/quant/mo
    echo /path/to/project/.venv/lib/python3.11/site-packages > /tmp/quant/mo/lib/python3.11/site-packages/zz_main.pth
    /tmp/quant/mo/bin/pip install "nvidia-modelopt[onnx]"

For every mode: `python -m modelopt.onnx.quantization` on EXPORTED/target.onnx with the calibration prompts
(built-in, as `speccompile build` uses them; one prefill pass each, cut to --calib-tokens so they stack),
the result wrapped as an artifact next to the export's tokenizer, then `speccompile eval`'s library on the
held-out text: top-1 agreement, KL, perplexity, target size, and the graph's quantization op pattern.
Other ModelOpt settings: `--variant NAME --modelopt-args="..."` (with `=`: the value starts with `--`; e.g.
`--variant matmul --modelopt-args="--op_types_to_quantize MatMul"`), written to modelopt-MODE-NAME* in
--work and named in the rows.

A ModelOpt graph with a QuantizeLinear scale that is not finite is evaluated twice: as written, and as a
copy with those QuantizeLinear -> DequantizeLinear pairs removed (the tensor stays fp32), its row saying
which. ModelOpt 0.47 (fp8 and int8 modes) puts a Q/DQ pair on the contract graph's attention mask, whose
masked entries are float32's lowest value; the int8 scale is computed by onnxruntime.quantization's
`compute_scale_zp`, whose symmetric range width rmax - rmin = 2 x 3.4e38 overflows float32 to inf (fp8
then multiplies it by 448 / 127). With scale inf, Q gives 0 and DequantizeLinear 0 x inf = NaN.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODELOPT_METHOD = {"fp8": "max", "int8": "max", "int4": "awq_clip"}


def calibration_npz(exported: Path, path: Path, tokens: int) -> Path:
    """The built-in calibration prompts as one stacked batch of contract-graph inputs."""
    from speccompile.engines.calibrate import load_calibration_texts, prefill_feeds, tokenize_calibration
    from speccompile.manifest import read_manifest
    from speccompile.tokenizer import TextTokenizer

    manifest = read_manifest(exported, verify_files=False)
    tokenizer = TextTokenizer(exported, manifest.tokenizer.get("eos_token_ids"))
    samples = [ids for ids in tokenize_calibration(load_calibration_texts(None), tokenizer, 16, tokens) if len(ids) >= tokens]
    if not samples:
        raise SystemExit(f"no calibration prompt has {tokens} tokens; lower --calib-tokens")
    spec = manifest.graph("target")
    feeds = [prefill_feeds(spec, ids[:tokens]) for ids in samples]
    np.savez(path, **{name: np.concatenate([f[name] for f in feeds]) for name in feeds[0]})
    return path


def nonfinite_quantizers(graph) -> list:
    """The QuantizeLinear nodes of `graph` whose scale holds inf or NaN."""
    from speccompile.accel.compat import stored_values

    quantizers = [n for n in graph.node if n.op_type == "QuantizeLinear"]
    scales = stored_values(graph, {q.input[1] for q in quantizers})
    return [q for q in quantizers if q.input[1] in scales and not np.isfinite(scales[q.input[1]]).all()]


def drop_nonfinite_qdq(model) -> list[str]:
    """Remove, in place, each QuantizeLinear -> DequantizeLinear pair whose scale holds inf or NaN.

    The DequantizeLinear consumers read the tensor the QuantizeLinear quantized, in full precision; the
    pair's scale and zero point go too where nothing else reads them. Returns those tensors' names. A pair
    whose QuantizeLinear feeds anything but DequantizeLinear, or whose output is a graph output, stays."""
    graph = model.graph
    consumers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    outputs = {o.name for o in graph.output}
    replace: dict[str, str] = {}
    removed: list = []
    for q in nonfinite_quantizers(graph):
        dqs = consumers.get(q.output[0], [])
        if not dqs or q.output[0] in outputs or any(d.op_type != "DequantizeLinear" or d.output[0] in outputs for d in dqs):
            continue
        replace.update({d.output[0]: q.input[0] for d in dqs})
        removed += [q, *dqs]
    gone = {out for node in removed for out in node.output}
    kept = [n for n in graph.node if n.output[0] not in gone]
    for node in kept:
        for i, name in enumerate(node.input):
            node.input[i] = replace.get(name, name)
    del graph.node[:]
    graph.node.extend(kept)
    used = {name for node in kept for name in node.input} | outputs
    orphans = {name for node in removed for name in node.input[1:]} - used
    inits = [i for i in graph.initializer if i.name not in orphans]
    del graph.initializer[:]
    graph.initializer.extend(inits)
    return [q.input[0] for q in removed if q.op_type == "QuantizeLinear"]


def wrap_as_artifact(exported: Path, onnx_path: Path, out: Path, scheme: str, finite_scales: bool = False) -> tuple[Path, list[str]]:
    """An artifact directory: the export's files with target.onnx replaced by `onnx_path` (weights external).

    `finite_scales`: the graph goes in with `drop_nonfinite_qdq` applied; returns the tensors it affected."""
    import dataclasses

    import onnx

    from speccompile.manifest import read_manifest

    manifest = read_manifest(exported, verify_files=False)
    spec = manifest.graph("target")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    fused = {n for n, g in manifest.graphs.items() if g.extra.get("variant_of")}
    skip = {spec.file, spec.file + ".data"} | {f for n in fused for f in manifest.files if f.startswith(manifest.graphs[n].file)}
    for name in manifest.files:
        if name not in skip:
            shutil.copy2(exported / name, out / name)
    for name in fused:
        del manifest.graphs[name]
    model = onnx.load(str(onnx_path), load_external_data=True)
    dropped = drop_nonfinite_qdq(model) if finite_scales else []
    onnx.save_model(model, str(out / spec.file), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=spec.file + ".data", size_threshold=1024)
    manifest.graphs["target"] = dataclasses.replace(spec, extra={**spec.extra, "quantization": scheme})
    manifest.files = {}
    manifest.record_files(out, sorted(p.name for p in out.iterdir() if p.is_file()))
    manifest.write(out)
    return out, dropped


def has_nonfinite_scale(onnx_path: Path) -> bool:
    import onnx

    return bool(nonfinite_quantizers(onnx.load(str(onnx_path), load_external_data=True).graph))


def op_pattern(directory: Path) -> tuple[str, bool, int]:
    import onnx

    from speccompile.accel.compat import check_tensorrt_compat

    model = onnx.load(str(directory / "target.onnx"), load_external_data=False)
    counts = Counter(f"{n.domain + '::' if n.domain else ''}{n.op_type}" for n in model.graph.node)
    types = Counter(onnx.TensorProto.DataType.Name(i.data_type).lower() for i in model.graph.initializer if len(i.dims) == 2)
    quant = {k: v for k, v in counts.items() if "quant" in k.lower() or k in ("Mul", "MatMulNBits")}
    text = ", ".join(f"{k} {v}" for k, v in sorted(quant.items())) + "; 2-D weights: " + ", ".join(f"{k} {v}" for k, v in sorted(types.items()))
    compat = check_tensorrt_compat(model)
    return text, compat.ok, len(compat.warnings)


def _compat_cell(row: dict) -> str:
    """The TensorRT-check column: ok, ok with warnings (e.g. INT4 blocks TensorRT does not take), or errors."""
    if not row["tensorrt_compat"]:
        return "errors"
    return f"ok, {row['tensorrt_warnings']} warnings" if row["tensorrt_warnings"] else "ok"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("exported", type=Path)
    parser.add_argument("--modelopt-python", required=True, help="interpreter with nvidia-modelopt[onnx]")
    parser.add_argument("--modes", nargs="*", default=["fp8", "int8", "int4"])
    parser.add_argument("--ours", action="append", default=[], help="SCHEME=BUILT_ARTIFACT of ours to put in the table")
    parser.add_argument("--work", type=Path, default=Path("/tmp/speccompile-modelopt"))
    parser.add_argument("--calib-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--exclude-nodes", nargs="*", default=["/Gemm"],
                        help="nodes ModelOpt leaves unquantized (default: the lm_head Gemm, which ours excludes too)")
    parser.add_argument("--modelopt-args", default="",
                        help="more arguments for ModelOpt, after the script's (a repeated option overrides), "
                             "as --modelopt-args=\"--op_types_to_quantize MatMul\"; needs --variant")
    parser.add_argument("--variant", default="", help="name of this ModelOpt setting, in its file names and rows")
    parser.add_argument("--reuse", action="store_true", help="take ModelOpt outputs already in --work instead of quantizing again")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.modelopt_args and not args.variant:
        parser.error("--modelopt-args needs --variant NAME (its outputs must not be taken for the plain run's)")

    from speccompile.evaluation import EvalOptions, evaluate

    args.work.mkdir(parents=True, exist_ok=True)
    npz = calibration_npz(args.exported, args.work / "calib.npz", args.calib_tokens)
    candidates: dict[str, Path] = {}
    failures: dict[str, str] = {}
    # ModelOpt rewrites the graph file it is given (node names, value infos): it gets a copy, never the export
    source = args.work / "source"
    if not (source / "target.onnx").is_file():
        source.mkdir(parents=True, exist_ok=True)
        for name in ("target.onnx", "target.onnx.data"):
            shutil.copy2(args.exported / name, source / name)
    for mode in args.modes:
        stem = f"modelopt-{mode}" + (f"-{args.variant}" if args.variant else "")
        label = f"modelopt {mode}" + (f" [{args.variant}: {args.modelopt_args}]" if args.variant else "")
        onnx_out = args.work / f"{stem}.onnx"
        if not (onnx_out.is_file() and args.reuse):
            command = [args.modelopt_python, "-m", "modelopt.onnx.quantization", "--onnx_path", str(source / "target.onnx"),
                       "--quantize_mode", mode, "--calibration_method", MODELOPT_METHOD[mode], "--calibration_data_path", str(npz),
                       "--calibration_eps", "cpu", "--output_path", str(onnx_out), "--use_external_data_format",
                       "--disable_mha_qdq", "--high_precision_dtype", "fp32", "--nodes_to_exclude", *args.exclude_nodes,
                       *shlex.split(args.modelopt_args)]
            print(" ".join(command), file=sys.stderr)
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0 or not onnx_out.is_file():
                failures[label] = (done.stderr.strip().splitlines() or ["no output"])[-1]
                continue
        candidates[label], _ = wrap_as_artifact(args.exported, onnx_out, args.work / stem, mode)
        if has_nonfinite_scale(onnx_out):
            path, dropped = wrap_as_artifact(args.exported, onnx_out, args.work / f"{stem}-finite", mode, finite_scales=True)
            candidates[f"{label}, Q/DQ with a non-finite scale removed ({', '.join(dropped)} stays fp32)"] = path
    for item in args.ours:
        scheme, _, path = item.partition("=")
        candidates[f"ours {scheme}"] = Path(path)
    rows = {}
    for name, path in candidates.items():
        try:
            report = evaluate(path, args.exported, EvalOptions(threads=args.threads))
        except Exception as exc:  # noqa: BLE001 - one failing candidate must not hide the others
            failures[name] = f"eval: {str(exc).splitlines()[0]}"
            continue
        pattern, trt_ok, trt_warnings = op_pattern(path)
        rows[name] = {"top1_agreement": report["top1_agreement"], "kl_divergence": report["kl_divergence"],
                      "perplexity": report["perplexity"]["artifact"], "reference_perplexity": report["perplexity"]["reference"],
                      "size_mb": report["size_mb"]["artifact"], "tensorrt_compat": trt_ok,
                      "tensorrt_warnings": trt_warnings, "ops": pattern}
    if args.json:
        print(json.dumps({"rows": rows, "failures": failures}, indent=2))
        return
    print("| candidate | top-1 | KL | perplexity (fp32 %s) | target MB | TensorRT check | quantization ops / weight types |"
          % next(iter(rows.values()), {}).get("reference_perplexity", "-"))
    print("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['top1_agreement']:.4f} | {r['kl_divergence']:.4f} | {r['perplexity']:.2f} | {r['size_mb']:.1f} | "
              f"{_compat_cell(r)} | {r['ops']} |")
    for name, why in failures.items():
        print(f"| {name} | failed: {why} | | | | | |")


if __name__ == "__main__":
    main()
