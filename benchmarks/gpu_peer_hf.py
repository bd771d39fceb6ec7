#!/usr/bin/env python
"""Peer benchmark on one GPU: speccompile on ort-cuda (plain and n-gram) side by side with Hugging Face
transformers (eager, eager + prompt lookup, static cache + torch.compile), same prompts, same tokens.

    python benchmarks/gpu_peer_hf.py --artifact /tmp/e16 [--workload benchmarks/workloads/copy.jsonl] \
        [--workload benchmarks/workloads/chat.jsonl] [--limit 6] [--max-tokens 128] [--no-compile] [--json]

The artifact is a `speccompile export smollm2-135m --dtype fp16` (or bf16) directory: the transformers
model is built from the same weights (speccompile's own loader, the model the artifact came from) in the
artifact's dtype, and every engine gets the prompt ids of speccompile's tokenizer (chat template for
workload lines with "chat": true). Greedy decoding, at most --max-tokens new tokens, stopping at EOS.

Timing (every engine alike): decode tok/s = tokens after the first / seconds after the first token;
total tok/s = new tokens / seconds including prefill. For transformers the first token's time is that of
a separate generate(max_new_tokens=1) of the same prompt (a streamer would add a device sync per token);
CUDA is synchronized before each clock read. Modes run
interleaved prompt by prompt (order reversed every other prompt), after one untimed warm-up each
(torch.compile compiles there). Printed: per workload, each mode's tok/s, the ratios of ours to each
transformers mode, and how many outputs are identical to ours plain (fp16 kernels differ between
engines, so a near-tie may flip; the number is reported, not asserted).

Needs a CUDA GPU, torch with CUDA, transformers and onnxruntime-gpu; anywhere else it stops with one line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODES = ("ours_plain", "ours_ngram", "hf_eager", "hf_lookup", "hf_compiled")


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def require_cuda() -> None:
    """One clear line (exit 2) unless torch and onnxruntime both see a CUDA GPU."""
    try:
        import torch
    except ImportError:
        fail("gpu_peer_hf.py needs torch with CUDA (import torch failed)")
    if not torch.cuda.is_available():
        fail("gpu_peer_hf.py needs a CUDA GPU: torch.cuda.is_available() is False here")
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        fail(f"gpu_peer_hf.py needs onnxruntime-gpu: onnxruntime {ort.__version__} here has no CUDAExecutionProvider")


def hf_model(artifact: Path, dtype: str, device: str = "cuda"):
    """A transformers causal LM with the artifact's source weights, on `device`, in the artifact's dtype."""
    import torch
    import transformers

    from speccompile.manifest import read_manifest
    from speccompile.models.load import load_model

    manifest = read_manifest(artifact, verify_files=False)
    loaded = load_model(manifest.model["source"])
    cfg = loaded.config
    classes = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
               "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}
    if cfg.architecture not in classes:
        fail(f"--artifact {artifact}: no transformers class for architecture {cfg.architecture}")
    hf_cfg = classes[cfg.architecture](
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta, rope_scaling=cfg.rope_scaling, max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings, bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_ids or None,
    )
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    missing, unexpected = model.load_state_dict(loaded.torch_weights(), strict=False)
    allowed = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    if set(missing) - allowed or unexpected:
        fail(f"weights do not fit the transformers model: missing {sorted(set(missing) - allowed)[:3]}, unexpected {sorted(unexpected)[:3]}")
    if cfg.tie_word_embeddings:
        model.tie_weights()
    torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    return model.to(device=device, dtype=torch_dtype).eval()


class HFEngine:
    """transformers generate() in one of three modes (`hf_compiled` compiles its model's forward: give it a
    model of its own; compile errors surface at the warm-up, which drops the mode)."""

    def __init__(self, model, eos_ids: list[int], mode: str, lookup_tokens: int):
        self.model, self.eos_ids, self.mode, self.lookup_tokens = model, eos_ids, mode, lookup_tokens
        if mode == "hf_compiled":
            import torch

            model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)

    def run(self, ids: list[int], max_tokens: int) -> dict:
        import torch

        kwargs = dict(max_new_tokens=max_tokens, do_sample=False, eos_token_id=self.eos_ids, pad_token_id=self.eos_ids[0])
        if self.mode == "hf_lookup":
            kwargs["prompt_lookup_num_tokens"] = self.lookup_tokens
        if self.mode == "hf_compiled":
            kwargs["cache_implementation"] = "static"
        prompt = torch.tensor([ids], device=self.model.device)
        sync = torch.cuda.synchronize if prompt.is_cuda else (lambda: None)

        def timed(new_tokens: int):
            sync()
            start = time.perf_counter()
            with torch.no_grad():
                out = self.model.generate(prompt, attention_mask=torch.ones_like(prompt), **{**kwargs, "max_new_tokens": new_tokens})
            sync()
            return out, time.perf_counter() - start

        _, first = timed(1)  # prefill + the first token
        out, total = timed(max_tokens)
        return _timing(out[0, len(ids):].tolist(), 0.0, first, total)


def _timing(tokens: list[int], start: float, first: float, end: float) -> dict:
    """Rates of one generation; a decode time that timing noise made non-positive counts as unmeasured (0)."""
    n = len(tokens)
    decode = max(end - first, 0.0)
    return {"tokens": tokens, "n_new": n, "prefill_s": first - start, "decode_s": decode,
            "decode_tps": (n - 1) / decode if n > 1 and decode > 0 else 0.0,
            "total_tps": n / (end - start) if end > start else 0.0}


class OursEngine:
    """speccompile on ort-cuda; `drafter` none (plain) or ngram; timed from its own statistics."""

    def __init__(self, runner, drafter: str):
        self.runner, self.drafter = runner, drafter

    def run(self, ids: list[int], max_tokens: int) -> dict:
        result = self.runner.generate_ids(ids, max_tokens=max_tokens, drafter=self.drafter)
        st = result.stats
        return {"tokens": list(result.tokens), "n_new": st.generated_tokens, "prefill_s": st.time_prefill,
                "decode_s": st.decode_time, "decode_tps": st.tokens_per_second,
                "total_tps": st.generated_tokens / max(st.time_total, 1e-9),
                "tokens_per_pass": st.mean_accepted_length, "overhead_fraction": st.overhead_fraction}


def summarize(name: str, results: list[dict], modes: list[str]) -> dict:
    out: dict = {"workload": name, "prompts": len(results), "modes": {}}
    for m in modes:
        rows = [r[m] for r in results if m in r]
        if not rows:
            continue
        decode_tokens = sum(max(r["n_new"] - 1, 0) for r in rows)
        out["modes"][m] = {
            "decode_tok_s": round(decode_tokens / sum(r["decode_s"] for r in rows), 1) if sum(r["decode_s"] for r in rows) > 0 else None,
            "total_tok_s": round(sum(r["n_new"] for r in rows) / max(sum(r["decode_s"] + r["prefill_s"] for r in rows), 1e-9), 1),
            "identical_to_ours_plain": sum(r["tokens"] == res["ours_plain"]["tokens"] for r, res in zip(rows, results)),
        }
    ratios = {}
    for ours in ("ours_plain", "ours_ngram"):
        for theirs in ("hf_eager", "hf_lookup", "hf_compiled"):
            pairs = [(r[ours]["decode_tps"], r[theirs]["decode_tps"]) for r in results if ours in r and theirs in r and r[theirs]["decode_tps"] > 0]
            if pairs:
                ratios[f"{ours}/{theirs}"] = round(statistics.median(a / b for a, b in pairs), 2)
    out["median_prompt_ratios"] = ratios
    return out


def print_summary(summary: dict) -> None:
    print(f"\n{summary['workload']} ({summary['prompts']} prompts)")
    print(f"  {'mode':<12} {'decode tok/s':>13} {'total tok/s':>12} {'same as ours plain':>19}")
    for m, s in summary["modes"].items():
        print(f"  {m:<12} {str(s['decode_tok_s']):>13} {str(s['total_tok_s']):>12} {s['identical_to_ours_plain']:>14}/{summary['prompts']}")
    print("  ratios (median over prompts of decode tok/s): "
          + ", ".join(f"{k} {v:.2f}x" for k, v in summary["median_prompt_ratios"].items()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", type=Path, required=True, help="speccompile artifact exported with --dtype fp16/bf16")
    ap.add_argument("--workload", action="append", type=Path, help="JSONL workload (repeatable; default copy + chat)")
    ap.add_argument("--limit", type=int, default=6, help="first N prompts of each workload")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--lookup-tokens", type=int, default=10, help="transformers prompt_lookup_num_tokens")
    ap.add_argument("--no-compile", action="store_true", help="skip the static cache + torch.compile mode")
    ap.add_argument("--json", action="store_true", help="also print the summaries as one JSON object")
    args = ap.parse_args(argv)
    if not (args.artifact / "manifest.json").is_file():
        fail(f"--artifact {args.artifact}: no manifest.json (expected `speccompile export MODEL --dtype fp16 --out DIR`)")
    require_cuda()
    import torch
    import onnxruntime as ort
    import transformers

    from speccompile.manifest import read_manifest
    from speccompile.runtime.session import Runner

    dtype = read_manifest(args.artifact, verify_files=False).graph("target").dtype
    runner = Runner(args.artifact, backend="ort-cuda", drafter="ngram")
    log(f"ours: {runner.artifact.target.spec.file} on ort-cuda ({dtype}); transformers {transformers.__version__}, "
        f"torch {torch.__version__}, onnxruntime {ort.__version__}, {torch.cuda.get_device_name(0)}")
    model = hf_model(args.artifact, dtype)
    eos = list(runner.artifact.eos_token_ids)
    engines = {"ours_plain": OursEngine(runner, "none"), "ours_ngram": OursEngine(runner, "ngram"),
               "hf_eager": HFEngine(model, eos, "hf_eager", args.lookup_tokens),
               "hf_lookup": HFEngine(model, eos, "hf_lookup", args.lookup_tokens)}
    if not args.no_compile:  # a model of its own: compiling patches the model's forward
        engines["hf_compiled"] = HFEngine(hf_model(args.artifact, dtype), eos, "hf_compiled", args.lookup_tokens)
    warm = runner.artifact.tokenizer.prompt_ids("Say hello.", chat=True)
    for name, engine in list(engines.items()):
        try:
            engine.run(warm, 16)
            engine.run(warm, 16)  # the second warm-up: CUDA graphs / torch.compile settle after the first
        except Exception as exc:  # noqa: BLE001 - a peer mode that does not work here is reported, not fatal
            log(f"{name}: skipped ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})")
            del engines[name]
    modes = [m for m in MODES if m in engines]
    summaries = []
    for workload in args.workload or [HERE / "workloads" / "copy.jsonl", HERE / "workloads" / "chat.jsonl"]:
        rows = [json.loads(line) for line in workload.read_text().splitlines() if line.strip()][: args.limit]
        results = []
        for i, row in enumerate(rows):
            ids = runner.artifact.tokenizer.prompt_ids(row["prompt"], bool(row.get("chat", False)))
            result = {"id": row["id"]}
            for m in modes if i % 2 == 0 else list(reversed(modes)):
                result[m] = engines[m].run(ids, args.max_tokens)
            results.append(result)
            log(f"[{workload.stem} {i + 1}/{len(rows)}] {row['id']}: " + " | ".join(f"{m} {result[m]['decode_tps']:.0f} tok/s" for m in modes))
        summary = summarize(workload.stem, results, modes)
        print_summary(summary)
        summaries.append(summary)
    if args.json:
        print(json.dumps({"artifact": str(args.artifact), "dtype": dtype, "max_tokens": args.max_tokens,
                          "gpu": torch.cuda.get_device_name(0), "summaries": summaries}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
