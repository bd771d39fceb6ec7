"""`bench` and `verify`: plain vs speculative on the same backend, measured in the same run."""

from __future__ import annotations

import json
import statistics
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from ..errors import InputError
from .options import GenerationConfig, RunOptions
from .sampling import SamplingParams
from .session import Runner

BUILTIN_PROMPTS = [
    {"id": "builtin-copy", "chat": True, "prompt": "Repeat this list exactly: apples, pears, plums, cherries, apples, pears, plums, cherries."},
    {"id": "builtin-story", "chat": True, "prompt": "Write a short story about a lighthouse keeper."},
    {"id": "builtin-code", "chat": True, "prompt": "Rename the variable x to total in: def f(x):\n    x = x + 1\n    return x * x"},
]


def load_workload(path: Path, limit: int | None = None, chat: bool | None = None) -> list[dict[str, Any]]:
    """Read a JSONL workload: one {"id", "prompt", "chat"} object per line (`chat` not None: for every line)."""
    if not path.is_file():
        raise InputError(f"workloads {path}: no such file", "workloads")
    items = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            prompt = item["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise InputError(f"workloads {path}: line {number} is not a JSON object with a 'prompt'", "workloads") from None
        if not isinstance(prompt, str) or not prompt.strip():
            raise InputError(f"workloads {path}: line {number} has an empty prompt", "workloads")
        items.append({"id": str(item.get("id", number)), "prompt": prompt,
                      "chat": bool(item.get("chat", True)) if chat is None else chat})
    if not items:
        raise InputError(f"workloads {path}: no prompts", "workloads")
    return items[:limit] if limit else items


@contextmanager
def prompt_source(label: str, field: str | None = None) -> Iterator[None]:
    """Errors about the prompt raised inside name `label` (a file, a workload line; about `field`) instead."""
    try:
        yield
    except InputError as exc:
        if exc.field != "prompt":
            raise
        raise InputError(label + str(exc)[len("prompt"):], field) from None


PromptProgress = Callable[[str, int, int], None]  # (the prompt starting, or "" when all are done; prompts done; total)


def _counted(items: list, progress: PromptProgress | None) -> Iterator:
    """The items, telling `progress` as each starts and when all are done."""
    for done, item in enumerate(items):
        if progress is not None:
            progress(item["id"], done, len(items))
        yield item
    if progress is not None:
        progress("", len(items), len(items))


def _sum_lists(a: list[int], b: list[int]) -> list[int]:
    out = list(a) + [0] * max(0, len(b) - len(a))
    for i, x in enumerate(b):
        out[i] += x
    return out


def run_bench(artifact, options: RunOptions, workloads, max_tokens, limit, warmup,
              progress: PromptProgress | None = None, chat: bool | None = None, replay: bool = False) -> dict[str, Any]:
    """Every prompt plain then speculative (greedy); paired speedups, acceptance, identity. `progress` is told
    of each prompt as it starts; `chat` (not None) applies the chat template to every prompt or to none.
    `replay`: the suffix drafter keeps its store of earlier responses from prompt to prompt (in workload order);
    else each prompt starts with an empty one."""
    _check_request(max_tokens, limit)
    if options.drafter == "none":
        raise InputError("drafter none: bench compares plain with a drafter; pick one (ngram, draft-model, ...)", "drafter")
    loaded = [(Path(w).stem, load_workload(Path(w), limit, chat)) for w in workloads]
    if not loaded:
        raise InputError("workloads: bench needs at least one workload", "workloads")
    runner = Runner(artifact, options)
    sampling = SamplingParams()
    report: dict[str, Any] = {"artifact": str(artifact), "backend": options.backend, "graph": runner.artifact.target.spec.file,
                              "drafter": runner.drafter_name, "shape_invariant": runner.shape_invariant,
                              "row_invariant": runner.artifact.target.row_invariant,
                              "num_draft_tokens": runner.num_draft_tokens, "max_tokens": max_tokens, "replay": replay,
                              "workloads": {}}
    if warmup:
        name, first = loaded[0][0], loaded[0][1][0]
        with prompt_source(f"workloads {name}: prompt {first['id']}", "workloads"):
            runner.generate(first["prompt"], first["chat"], 16, sampling, drafter="none")
            runner.generate(first["prompt"], first["chat"], 16, sampling)
    forget = runner.suffix_cache.clear if runner.suffix_cache is not None and not replay else None
    if runner.suffix_cache is not None:
        runner.suffix_cache.clear()  # the warm-up's answer is not a prompt's
    _bench_workloads(runner, loaded, max_tokens, sampling, report, progress, forget)
    report["verify_ms_by_q"] = {str(q): round(1000 * t, 2) for q, t in sorted(runner.pass_costs.by_q.items())}
    return report


def _bench_workloads(runner: Runner, loaded, max_tokens: int, sampling: SamplingParams, report: dict[str, Any],
                     progress: PromptProgress | None, forget: Callable[[], None] | None = None) -> None:
    done, total = 0, sum(len(items) for _, items in loaded)
    for name, items in loaded:
        rows = []
        drafted: list[int] = []
        accepted: list[int] = []
        totals = {"plain_tokens": 0, "plain_time": 0.0, "spec_tokens": 0, "spec_time": 0.0, "passes": 0, "engine": 0.0}
        for item in items:
            if progress is not None:
                progress(f"{name}: {item['id']}", done, total)
            done += 1
            with prompt_source(f"workloads {name}: prompt {item['id']}", "workloads"):
                ids = runner.artifact.tokenizer.prompt_ids(item["prompt"], item["chat"])
                plain = runner.generate_ids(ids, max_tokens, sampling, drafter="none")
                if forget is not None:  # this prompt drafts from nothing earlier
                    forget()
                spec = runner.generate_ids(ids, max_tokens, sampling)
            ps, ss = plain.stats, spec.stats
            rows.append({
                "id": item["id"],
                "prompt_tokens": len(ids),
                "plain_tok_s": round(ps.tokens_per_second, 2),
                "spec_tok_s": round(ss.tokens_per_second, 2),
                "speedup": round(ss.tokens_per_second / max(ps.tokens_per_second, 1e-9), 3),
                "mean_accepted_length": round(ss.mean_accepted_length, 3),
                "identical": plain.tokens == spec.tokens,
                "overhead_fraction": round(ss.overhead_fraction, 4),
            })
            drafted = _sum_lists(drafted, ss.drafted)
            accepted = _sum_lists(accepted, ss.accepted)
            totals["plain_tokens"] += max(ps.generated_tokens - 1, 0)
            totals["plain_time"] += ps.decode_time
            totals["spec_tokens"] += max(ss.generated_tokens - 1, 0)
            totals["spec_time"] += ss.decode_time
            totals["passes"] += ss.target_passes
            totals["engine"] += ss.time_engine
            totals.setdefault("spec_total_time", 0.0)
            totals["spec_total_time"] += ss.time_total
            totals.setdefault("spec_generated", 0)
            totals["spec_generated"] += ss.produced_tokens
        report["workloads"][name] = {
            "prompts": len(rows),
            "plain_tok_s": round(totals["plain_tokens"] / max(totals["plain_time"], 1e-9), 2),
            "spec_tok_s": round(totals["spec_tokens"] / max(totals["spec_time"], 1e-9), 2),
            "median_speedup": round(statistics.median(r["speedup"] for r in rows), 3),
            "mean_accepted_length": round(totals["spec_generated"] / max(totals["passes"], 1), 3),
            "acceptance_per_position": [round(a / d, 3) if d else 0.0 for a, d in zip(accepted, drafted)],
            "overhead_fraction": round(1 - totals["engine"] / max(totals["spec_total_time"], 1e-9), 4),
            "identical": sum(r["identical"] for r in rows),
            "rows": rows,
        }
    if progress is not None:
        progress("", done, total)


def run_verify(artifact, options: RunOptions, workloads, max_tokens, limit, progress: PromptProgress | None = None,
               chat: bool | None = None) -> dict[str, Any]:
    """Greedy speculative vs plain for every prompt: {drafter, graph (the target's file), shape_invariant, identical, logits_bitwise, prompts:
    [{id, identical, first_difference, tokens, mean_accepted_length, logits_bitwise, max_logit_difference,
    logit_positions}]}. `progress` is told of each prompt as it starts; `chat` (not None) applies the chat
    template to every prompt or to none."""
    _check_request(max_tokens, limit)
    items = [item for w in workloads for item in load_workload(Path(w), limit)] if workloads else BUILTIN_PROMPTS[:limit]
    if chat is not None:
        items = [dict(item, chat=chat) for item in items]
    runner = Runner(artifact, options)
    results = []
    for item in _counted(items, progress):
        with prompt_source(f"prompt {item['id']}"):
            results.append(_verify_prompt(runner, item, max_tokens))
    return {"drafter": runner.drafter_name, "graph": runner.artifact.target.spec.file, "shape_invariant": runner.shape_invariant,
            "row_invariant": runner.artifact.target.row_invariant, "identical": all(r["identical"] for r in results),
            "logits_bitwise": all(r["logits_bitwise"] for r in results), "prompts": results}


def _check_request(max_tokens: int, limit: int | None) -> None:
    """Refuse, before anything loads, a length or prompt limit no run could use."""
    GenerationConfig(max_tokens=max_tokens).validate()
    if limit is not None and limit < 1:
        raise InputError(f"limit must be >= 1, got {limit}", "limit")


def _verify_prompt(runner: Runner, item: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    """Plain and speculative greedy decoding of one prompt: the tokens, and the logits each token was chosen
    from compared bit for bit (`logits_bitwise`: every compared position equal; `max_logit_difference`)."""
    ids = runner.artifact.tokenizer.prompt_ids(item["prompt"], item["chat"])
    plain, spec = (_traced(runner, ids, max_tokens, drafter) for drafter in ("none", None))
    first_diff = next((i for i, (a, b) in enumerate(zip(plain.tokens, spec.tokens)) if a != b), None)
    if first_diff is None and len(plain.tokens) != len(spec.tokens):
        first_diff = min(len(plain.tokens), len(spec.tokens))
    # positions whose logits both runs computed from the same tokens: up to and including the first difference
    compared = min(len(plain.logits), len(spec.logits), len(plain.tokens) if first_diff is None else first_diff + 1)
    difference = float(np.abs(plain.logits[:compared] - spec.logits[:compared]).max()) if compared else 0.0
    return {"id": item["id"], "identical": first_diff is None, "first_difference": first_diff,
            "tokens": len(plain.tokens), "mean_accepted_length": round(spec.stats.mean_accepted_length, 3),
            "logits_bitwise": difference == 0.0, "max_logit_difference": difference, "logit_positions": compared}


def _traced(runner: Runner, ids: list[int], max_tokens: int, drafter: str | None):
    """A greedy generation that keeps the logits each token was chosen from."""
    config = runner.config(max_tokens, SamplingParams(), drafter=drafter)
    config.trace_logits = True
    return runner.generator(SamplingParams(), plain=drafter == "none").generate(ids, config)
