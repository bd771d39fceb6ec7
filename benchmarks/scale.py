"""Real-size models on one host: export (and build) cost next to the physical floor, and `run` speed.

Random-weight checkpoints of the real shapes (Llama-3.2-1B, Llama-3.2-3B, Llama-3.1-8B: bf16, sharded
safetensors with a `model.safetensors.index.json` like Hugging Face's, std 0.02, a tokenizer of the right
vocabulary size) are written tensor by tensor, so writing the 8B checkpoint never holds it in memory. Then, per
size and dtype, in the same run:

* the floor: reading every weight, converting it (bf16 -> the export dtype) and writing it once, with numpy;
* `speccompile export --dtype D` (and the `--builds` columns: `speccompile build` of that export);

each in a subprocess under /usr/bin/time (wall, CPU, peak RSS), the checkpoint's pages evicted from the page
cache first (posix_fadvise DONTNEED: both start cold); then `speccompile run` tokens/s and peak RSS on the
artifacts asked for. Results go to --results (JSON lines) and a markdown table on stdout.

    python benchmarks/scale.py checkpoints --sizes 1b,3b,8b --root /work/scale
    python benchmarks/scale.py measure --sizes 1b --dtypes fp32,fp16 --run fp32,fp16 --root /work/scale

Another column: add an entry to BUILDS (name -> `speccompile build` flags) and pass --builds NAME.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
SIZES = {  # the published configs (config.json of meta-llama/Llama-3.2-1B, -3.2-3B, -3.1-8B)
    "1b": dict(name="llama-3.2-1b", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, tie_word_embeddings=True, rope_factor=32.0),
    "3b": dict(name="llama-3.2-3b", hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
               num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, rope_factor=32.0),
    "8b": dict(name="llama-3.1-8b", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, tie_word_embeddings=False, rope_factor=8.0),
    # Mixtral's layer (8 experts, top 2, untied head) scaled to ~1.2B parameters, ~0.4B active per token
    "moe-1b": dict(name="mixtral-shape-1b", model_type="mixtral", hidden_size=1024, intermediate_size=2048,
                   num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8, head_dim=64, num_local_experts=8,
                   num_experts_per_tok=2, tie_word_embeddings=False),
}
VOCAB = 128256
SHARD_BYTES = 5 << 30  # Hugging Face's default max_shard_size ("5GB")
BUILDS: dict[str, list[str]] = {  # column name -> `speccompile build` flags (ONNX only: no TensorRT on the host)
    "int4": ["--int4", "--onnx-only"],
    "int4-rtn": ["--int4", "--onnx-only", "--no-awq", "--no-clip-search", "--no-gptq"],  # round to nearest: no calibration
    "fp8": ["--fp8", "--onnx-only"],
    "fp8-wo": ["--fp8", "--weight-only", "--onnx-only"],
    "fp8-wo-rtn": ["--fp8", "--weight-only", "--onnx-only", "--no-gptq"],  # per-channel scales, no GPTQ: no calibration
    "fp4": ["--fp4", "--onnx-only"],
    "fp4-wo": ["--fp4", "--weight-only", "--onnx-only"],
    "int8": ["--int8", "--onnx-only"],
    "fp8-rtn": ["--fp8", "--onnx-only", "--no-gptq"],  # activation ranges calibrated, weights per channel without GPTQ
    "fp4-rtn": ["--fp4", "--onnx-only", "--no-awq", "--no-clip-search"],
    "fp4-wo-rtn": ["--fp4", "--weight-only", "--onnx-only", "--no-awq", "--no-clip-search", "--no-gptq"],
}


def hf_config(size: str):
    """The transformers LlamaConfig (MixtralConfig) of a size."""
    from transformers import LlamaConfig, MixtralConfig

    s = dict(SIZES[size])
    s.pop("name")
    if s.pop("model_type", "llama") == "mixtral":
        return MixtralConfig(vocab_size=VOCAB, max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1e6,
                             sliding_window=None, bos_token_id=128000, eos_token_id=128001, torch_dtype="bfloat16", **s)
    factor = s.pop("rope_factor")
    return LlamaConfig(vocab_size=VOCAB, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                       rope_scaling={"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 8192},
                       bos_token_id=128000, eos_token_id=128001, torch_dtype="bfloat16", **s)


def parameter_shapes(config) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of the transformers model, from a meta-device instance (no memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return _mixtral_checkpoint_names(shapes) if config.model_type == "mixtral" else shapes


def _mixtral_checkpoint_names(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """transformers 5 holds Mixtral's experts fused ([experts, 2 * inter, hidden]); its checkpoints (and the hub's)
    name them per expert: block_sparse_moe.experts.{e}.w1 / w3 / w2 and block_sparse_moe.gate."""
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        prefix, _, rest = name.partition(".mlp.")
        if rest == "gate.weight":
            out[f"{prefix}.block_sparse_moe.gate.weight"] = shape
        elif rest == "experts.gate_up_proj":
            for e in range(shape[0]):
                out.update({f"{prefix}.block_sparse_moe.experts.{e}.{w}.weight": (shape[1] // 2, shape[2]) for w in ("w1", "w3")})
        elif rest == "experts.down_proj":
            out.update({f"{prefix}.block_sparse_moe.experts.{e}.w2.weight": shape[1:] for e in range(shape[0])})
        else:
            out[name] = shape
    return out


def write_checkpoint(size: str, folder: Path, seed: int = 0) -> Path:
    """A random bf16 checkpoint of `size` in `folder` with a tokenizer of its vocabulary size."""
    write_random_checkpoint(hf_config(size), folder, seed=seed)
    _write_tokenizer(folder, VOCAB)
    return folder


def write_random_checkpoint(config, folder: Path, shard_bytes: int = SHARD_BYTES, seed: int = 0) -> Path:
    """Random bf16 weights (std 0.02, norm gains 1) for the transformers `config`, sharded like save_pretrained
    (`model.safetensors.index.json` + `model-0000i-of-0000n.safetensors`), a block of rows in memory at a time;
    and config.json."""
    import ml_dtypes

    folder.mkdir(parents=True, exist_ok=True)
    shapes = parameter_shapes(config)
    shards, current, used = [], [], 0
    for name, shape in shapes.items():
        nbytes = int(np.prod(shape)) * 2
        if current and used + nbytes > shard_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += nbytes
    shards.append(current)
    rng = np.random.default_rng(seed)
    weight_map = {}
    for index, names in enumerate(shards):
        file = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        _write_shard(folder / file, {n: shapes[n] for n in names}, rng, ml_dtypes.bfloat16)
        weight_map.update({n: file for n in names})
    total = sum(int(np.prod(s)) * 2 for s in shapes.values())
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    config.to_json_file(str(folder / "config.json"))
    return folder


def _write_shard(path: Path, shapes: dict[str, tuple[int, ...]], rng, bf16) -> None:
    """One safetensors file: header (dtype, shape, offsets), then each tensor's bytes as it is drawn."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        nbytes = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little") + raw)
        for name, shape in shapes.items():
            if len(shape) == 1:  # norm gains
                fh.write(np.ones(shape, bf16))
                continue
            rows = max(1, (16 << 20) // int(np.prod(shape[1:])))
            for start in range(0, shape[0], rows):
                block = rng.standard_normal((min(rows, shape[0] - start), *shape[1:]), dtype=np.float32)
                fh.write((block * np.float32(0.02)).astype(bf16))
    tmp.replace(path)


def _write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer.json with `vocab_size` entries (characters first, then filler tokens)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = list(" abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;:!?'\"()[]{}<>=+-*/_|\n")
    vocab = {tok: i for i, tok in enumerate(["<unk>"] + chars)}
    for i in range(len(vocab), vocab_size):
        vocab[f"<t{i}>"] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<t128001>", "bos_token": "<t128000>"}))


# ------------------------------------------------------------------------------------------- measuring

def evict(paths: list[Path]) -> None:
    """Drop these files' clean pages from the page cache (both the floor and the export then start cold)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(cmd: list[str], env: dict | None = None) -> dict:
    """Run `cmd` under /usr/bin/time: wall and CPU seconds, peak RSS (GB of 10^9 bytes; %M is KiB), exit code, last output line."""
    fmt = "@@time %e %U %S %M"
    result = subprocess.run(["/usr/bin/time", "-f", fmt, *cmd], capture_output=True, text=True, env=env)
    lines = result.stderr.splitlines()
    wall, user, system, rss_kb = next(l for l in reversed(lines) if l.startswith("@@time")).split()[1:]
    errors = [l for l in lines if l.startswith("error:")] or [l for l in lines if l.strip() and not l.startswith("@@time")][-1:]
    return {"wall_s": float(wall), "cpu_s": float(user) + float(system), "peak_rss_gb": int(rss_kb) * 1024 / 1e9,
            "rc": result.returncode, "stdout": result.stdout, "error": errors[-1] if errors else ""}


def floor(checkpoint: Path, out: Path, dtype: str) -> None:
    """Read, convert (bf16 -> dtype) and write every weight once with numpy: what any export must at least do."""
    import ml_dtypes

    target = {"fp32": np.float32, "fp16": np.float16, "bf16": ml_dtypes.bfloat16}[dtype]
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    with open(out, "wb") as sink:
        for file in sorted(set(index["weight_map"].values())):
            path = checkpoint / file
            with open(path, "rb") as fh:
                length = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(length))
            for name, entry in header.items():
                if name == "__metadata__":
                    continue
                begin, end = entry["data_offsets"]
                count = (end - begin) // 2
                values = np.fromfile(path, dtype=ml_dtypes.bfloat16, count=count, offset=8 + length + begin)
                sink.write(values.astype(target))
                del values


def speccompile(*args: str) -> list[str]:
    return [sys.executable, "-m", "speccompile.cli", *args]


def du_gb(path: Path) -> float:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files) / 1e9


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def measure_size(size: str, dtypes: list[str], builds: list[str], run_dtypes: list[str], root: Path,
                 keep: set[str], record, existing: bool = False, run_builds: tuple[str, ...] = ()) -> None:
    """The floor, the export and the builds of one size, then `run` on the artifacts asked for. `existing`: build
    from the export already in ROOT/export (no floor, no export); `run_builds`: builds `run` and `verify` are timed
    on (each build is deleted after it was measured unless SIZE-DTYPE-BUILD is in `keep`)."""
    checkpoint = root / "ckpt" / SIZES[size]["name"]
    shards = sorted(checkpoint.glob("*.safetensors"))
    params = sum(int(np.prod(s["shape"])) for f in shards for n, s in _header(f).items() if n != "__metadata__")
    for dtype in dtypes:
        base = {"size": size, "params_b": round(params / 1e9, 3), "dtype": dtype, "uptime": uptime()}
        artifact = root / "export" / f"{SIZES[size]['name']}-{dtype}"
        if existing:
            _measure_builds(artifact, builds, base, root, keep, record, run_builds)
            continue
        floor_out = root / "tmp" / f"floor-{size}-{dtype}.bin"
        floor_out.parent.mkdir(parents=True, exist_ok=True)
        evict(shards)
        record({**base, "step": "numpy floor", **_slim(timed([sys.executable, __file__, "floor", str(checkpoint), str(floor_out), dtype])),
                "output_gb": du_gb(floor_out)})
        floor_out.unlink()
        evict(shards)
        result = timed(speccompile("export", str(checkpoint), "--out", str(artifact), "--dtype", dtype, "--force"))
        record({**base, "step": "export", **_slim(result), "output_gb": du_gb(artifact) if artifact.exists() else 0})
        _measure_builds(artifact, builds, base, root, keep, record, run_builds)
        if dtype in run_dtypes and artifact.exists():
            run_and_verify(artifact, base, "", record)
        if f"{size}-{dtype}" not in keep and artifact.exists():
            import shutil

            shutil.rmtree(artifact)


def _measure_builds(artifact: Path, builds: list[str], base: dict, root: Path, keep: set[str], record,
                    run_builds: tuple[str, ...]) -> None:
    """`speccompile build` of `artifact` per build column (then `run` and `verify` where asked), each deleted after."""
    import shutil

    for build in builds:
        built = root / "build" / f"{artifact.name}-{build}"
        result = timed(speccompile("build", str(artifact), "--out", str(built), "--force", *BUILDS[build]))
        row = {**base, "uptime": uptime(), "step": f"build {build}", **_slim(result), "output_gb": du_gb(built) if built.exists() else 0}
        if built.exists():
            row["weights_gb"] = sum(p.stat().st_size for p in built.glob("*.data")) / 1e9
            row["cpu_weights_gb"] = cpu_graph_weights_gb(built)
        record(row)
        if build in run_builds and built.exists():
            run_and_verify(built, {**base, "weights_gb": row["cpu_weights_gb"]}, f" {build}", record)
        if f"{base['size']}-{base['dtype']}-{build}" not in keep and built.exists():
            shutil.rmtree(built)


def run_and_verify(artifact: Path, base: dict, label: str, record) -> None:
    """Rows "run LABEL" (tokens/s, peak RSS) and "verify LABEL" (speculative == plain greedy) of `artifact`."""
    record({**base, "uptime": uptime(), "step": f"run{label}", **run_speed(artifact)})
    workload = root_tmp(artifact) / "raw-prompts.jsonl"  # the random checkpoints' tokenizer has no chat template
    workload.write_text("".join(json.dumps({"id": f"raw-{i}", "prompt": p, "chat": False}) + "\n" for i, p in enumerate(RAW_PROMPTS)))
    verified = timed(speccompile("verify", str(artifact), "--workload", str(workload), "--max-tokens", "16", "--json"))
    workload.unlink()
    identical = json.loads(verified["stdout"]).get("identical") if verified["rc"] == 0 else None
    record({**base, "uptime": uptime(), "step": f"verify{label}", **_slim(verified), "identical": identical})


RAW_PROMPTS = ("the quick brown fox", "once upon a time there was", "def main(): return")


def root_tmp(artifact: Path) -> Path:
    """ROOT/tmp for an artifact in ROOT/export or ROOT/build."""
    folder = artifact.parent.parent / "tmp"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def run_speed(artifact: Path, tokens: int = 32) -> dict:
    """`speccompile run` greedy decoding of `tokens` tokens: tokens/s (its own timer), the process's peak RSS
    (the session opening included: ONNX Runtime reads a weight before it prepacks it) and its resident memory
    after decoding (`run --json`'s "memory")."""
    result = timed(speccompile("run", str(artifact), "--prompt", "the quick brown fox", "--raw", "--max-tokens", str(tokens),
                               "--drafter", "none", "--json"))
    out = json.loads(result["stdout"]) if result["rc"] == 0 else {}
    stats, memory = out.get("stats", {}), out.get("memory", {})
    return {**_slim(result), "resident_gb": memory.get("resident_mb", 0) * 2**20 / 1e9 or None,
            "tokens_per_s": stats.get("tokens_per_second"), "generated": stats.get("generated_tokens")}


def cpu_graph_weights_gb(artifact: Path) -> float:
    """Bytes of the weights the graph `run` opens on ort-cpu reads (a build's packed graph reads its own data and
    the float tensors it shares with the contract graph; the contract's codes are TensorRT's)."""
    from speccompile.weights_file import external_location, load_graph

    graph = artifact / ("target.ort.onnx" if (artifact / "target.ort.onnx").exists() else "target.onnx")
    stored = {external_location(t) for t in load_graph(graph).graph.initializer} - {None}
    return sum(s.length for s in stored) / 1e9


def _slim(result: dict) -> dict:
    out = {k: result[k] for k in ("wall_s", "cpu_s", "peak_rss_gb", "rc")}
    if result["rc"] != 0:
        out["error"] = result["error"]
    return out


def _header(path: Path) -> dict:
    with open(path, "rb") as fh:
        length = int.from_bytes(fh.read(8), "little")
        return json.loads(fh.read(length))


def table(rows: list[dict]) -> str:
    """Markdown: one line per size, dtype and step, with the export's ratio to the floor of the same run, and a run's
    peak RSS over its weights files."""
    floors = {(r["size"], r["dtype"]): r["wall_s"] for r in rows if r["step"] == "numpy floor"}
    lines = ["| size | params (B) | dtype | step | wall s | x floor | CPU s | peak RSS GB | output GB | tokens/s | resident GB | resident / weights | peak / weights |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = r["wall_s"] / floors[(r["size"], r["dtype"])] if r["step"] == "export" and (r["size"], r["dtype"]) in floors else None
        step = r["step"] + {True: " (identical)", False: " (NOT identical)"}.get(r.get("identical"), "")
        cells = [r["size"], r["params_b"], r["dtype"], step + (f" (exit {r['rc']}: {r.get('error', '')})" if r["rc"] else ""),
                 f"{r['wall_s']:.1f}", f"{ratio:.2f}" if ratio else "", f"{r['cpu_s']:.1f}", f"{r['peak_rss_gb']:.2f}",
                 f"{r['output_gb']:.2f}" if "output_gb" in r else "", f"{r['tokens_per_s']:.2f}" if r.get("tokens_per_s") else "",
                 f"{r['resident_gb']:.2f}" if r.get("resident_gb") else "",
                 f"{r['resident_gb'] / r['weights_gb']:.2f}" if r.get("resident_gb") and r.get("weights_gb") else "",
                 f"{r['peak_rss_gb'] / r['weights_gb']:.2f}" if r["step"].startswith("run") and r.get("weights_gb") else ""]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["checkpoints", "measure", "floor", "table"])
    parser.add_argument("args", nargs="*", help="floor: CHECKPOINT OUT DTYPE")
    parser.add_argument("--sizes", default="1b", help="comma-separated: " + ",".join(SIZES))
    parser.add_argument("--dtypes", default="fp16", help="export dtypes (comma-separated)")
    parser.add_argument("--builds", default="", help="build columns: " + ",".join(BUILDS))
    parser.add_argument("--run", default="", help="export dtypes whose artifacts `run` is timed on")
    parser.add_argument("--keep", default="", help="SIZE-DTYPE artifacts to keep (e.g. 8b-fp16); the others are deleted")
    parser.add_argument("--existing", action="store_true", help="build from the exports already in ROOT/export (no floor or export)")
    parser.add_argument("--run-builds", default="", help="build columns whose builds `run` and `verify` are timed on")
    parser.add_argument("--root", type=Path, default=Path("/work/scale"))
    parser.add_argument("--results", type=Path, default=None, help="JSON lines file [default: ROOT/results.jsonl]")
    args = parser.parse_args(argv)
    if args.command == "floor":
        floor(Path(args.args[0]), Path(args.args[1]), args.args[2])
        return
    sizes = [s for s in args.sizes.split(",") if s]
    results = args.results or args.root / "results.jsonl"
    if args.command == "checkpoints":
        for size in sizes:
            folder = args.root / "ckpt" / SIZES[size]["name"]
            started = time.time()
            write_checkpoint(size, folder)
            print(f"{folder}: {du_gb(folder):.2f} GB in {time.time() - started:.0f} s")
        return
    if args.command == "table":
        print(table([json.loads(line) for line in results.read_text().splitlines() if line.strip()]))
        return
    rows: list[dict] = []

    def record(row: dict) -> None:
        rows.append(row)
        with open(results, "a") as fh:
            fh.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)

    for size in sizes:
        measure_size(size, args.dtypes.split(","), [b for b in args.builds.split(",") if b],
                     [d for d in args.run.split(",") if d], args.root, set(args.keep.split(",")), record, args.existing,
                     tuple(b for b in args.run_builds.split(",") if b))
    print(table(rows))


if __name__ == "__main__":
    main()
