#!/usr/bin/env python
"""Resident memory of a quantized build on the CPU against the size of the weights its graph reads.

The packed CPU graph (engines/cpu_graph.py) must not hold fp32 copies of its weights: an 8B INT4 build has to fit
a 24 GB machine at <= 1.3x its weight file. This script measures that on a random Llama-shaped model of a chosen
size (no download): Hugging Face folder (random weights, a character tokenizer) -> `speccompile export` ->
`speccompile build --int4 | --int8 --quantize-lm-head --onnx-only` (round to nearest, no calibration) -> a fresh
process opens the artifact, prefills --prompt tokens and decodes 8, and reports VmRSS / VmHWM (and the anonymous
and file-backed parts) next to the bytes of the tensors the graph reads, and the same for an empty session (the
interpreter and ONNX Runtime alone). Everything is written under --work and kept for reruns (--force remakes).

  python benchmarks/cpu_memory.py --work /tmp/cpumem --hidden 2048 --intermediate 5632 --layers 8 --precision int4
  python benchmarks/cpu_memory.py --artifact BUILT          # an existing artifact (e.g. an 8B INT4 build)

Large models are big jobs here: run them under `flock /work/coord/bigjob.lock`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BUILD_FLAGS = {"int4": ["--int4", "--no-awq", "--no-clip-search", "--no-gptq"], "int8": ["--int8"]}


def make_model(folder: Path, args) -> None:
    """A random Llama of the given shape with a character tokenizer of --vocab entries."""
    import torch
    import transformers

    sys.path.insert(0, str(HERE.parent / "tests"))
    from conftest import write_char_tokenizer

    config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                                      num_key_value_heads=max(1, args.hidden // 256), max_position_embeddings=2048,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    write_char_tokenizer(folder, vocab_size=args.vocab)


def measure(artifact: Path | None, prompt: int, threads: int) -> dict:
    """Run in a fresh process: memory after loading `artifact` (None: an empty session) and after a short run."""
    code = f"""
import json, numpy as np
def mem():
    out = {{}}
    for line in open("/proc/self/status"):
        if line.startswith(("VmRSS", "VmHWM", "RssAnon", "RssFile")):
            key, value = line.split(":"); out[key] = round(int(value.split()[0]) / 1024, 1)
    return out
artifact = {str(artifact) if artifact else None!r}
if artifact is None:
    import onnxruntime, speccompile.runtime.session
    print(json.dumps({{"loaded": mem(), "ran": mem()}})); raise SystemExit
from speccompile.runtime.artifact import open_artifact
from speccompile.weights_file import external_location, load_graph
art = open_artifact(artifact, threads={threads}, drafter="none")
target = art.target
stored = {{external_location(t) for t in load_graph(art.directory / target.spec.file).graph.initializer}} - {{None}}
loaded = mem()
cache = target.new_cache()
ids = np.arange(10, 10 + {prompt})
out = target.run(ids, np.arange(len(ids)), cache.attention_mask(np.tril(np.ones((len(ids), len(ids)), bool))), cache)
cache.append(out.presents, list(range(len(ids))), len(ids))
for i in range(8):
    out = target.run(ids[:1], np.array([len(ids) + i]), cache.attention_mask(np.ones((1, 1), bool)), cache)
    cache.append(out.presents, [0], 1)
print(json.dumps({{"graph": target.spec.file, "weights_mb": round(sum(s.length for s in stored) / 2**20, 1),
                  "loaded": loaded, "ran": mem()}}))
"""
    env = dict(os.environ, PYTHONPATH=str(HERE.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--work", type=Path, default=None, help="where the random model and its builds are made (required without --artifact)")
    ap.add_argument("--artifact", type=Path, action="append", default=[],
                    help="measure this existing artifact instead (repeatable; with an empty session beside it)")
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--intermediate", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--precision", action="append", choices=sorted(BUILD_FLAGS), help="repeatable (default: int4)")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    if args.artifact:
        report = {"uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
                  "empty_session": measure(None, args.prompt, args.threads),
                  **{str(a): measure(a, args.prompt, args.threads) for a in args.artifact}}
        print_report(report)
        return 0
    if args.work is None:
        ap.error("--work is required without --artifact")
    cli = [sys.executable, "-m", "speccompile.cli"]
    hf, exported = args.work / "hf", args.work / "fp32"
    if args.force or not (hf / "config.json").exists():
        make_model(hf, args)
    if args.force or not (exported / "manifest.json").exists():
        subprocess.run([*cli, "export", str(hf), "--out", str(exported), "--batch-slots", "0", "--max-context", "512",
                        *(["--force"] if args.force else [])], check=True)
    report = {"shape": {k: getattr(args, k) for k in ("hidden", "intermediate", "layers", "vocab")},
              "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
              "empty_session": measure(None, args.prompt, args.threads), "fp32": measure(exported, args.prompt, args.threads)}
    for precision in args.precision or ["int4"]:
        built = args.work / precision
        if args.force or not (built / "manifest.json").exists():
            subprocess.run([*cli, "build", str(exported), "--out", str(built), "--onnx-only", "--quantize-lm-head",
                            *BUILD_FLAGS[precision], *(["--force"] if args.force else [])], check=True)
        report[precision] = measure(built, args.prompt, args.threads)
    print_report(report)
    (args.work / "report.json").write_text(json.dumps(report, indent=1))
    return 0


def print_report(report: dict) -> None:
    """One line per measured artifact: the weights its graph reads, memory loaded and after the run, the ratio."""
    for name, row in report.items():
        if isinstance(row, dict) and "ran" in row:
            weights = row.get("weights_mb")
            ratio = f"  RSS / weights {row['ran']['VmRSS'] / weights:.2f}  peak / weights {row['ran']['VmHWM'] / weights:.2f}" if weights else ""
            print(f"{name:14s} weights {weights or '-':>8} MB  loaded {row['loaded']}  ran {row['ran']}{ratio}")
    print(report["uptime"])


if __name__ == "__main__":
    sys.exit(main())
