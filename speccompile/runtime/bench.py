"""`bench` and `verify`: plain vs speculative on the same backend, measured in the same run."""

from __future__ import annotations

import json
import statistics
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from ..errors import InputError
from .options import RunOptions
from .sampling import SamplingParams
from .session import Runner

BUILTIN_PROMPTS = [
    {"id": "builtin-copy", "chat": True, "prompt": "Repeat this list exactly: apples, pears, plums, cherries, apples, pears, plums, cherries."},
    {"id": "builtin-story", "chat": True, "prompt": "Write a short story about a lighthouse keeper."},
    {"id": "builtin-code", "chat": True, "prompt": "Rename the variable x to total in: def f(x):\n    x = x + 1\n    return x * x"},
]


def load_workload(path: Path, limit: int | None = None) -> list[dict[str, Any]]:
    """Read a JSONL workload: one {"id", "prompt", "chat"} object per line."""
    if not path.is_file():
        raise InputError(f"--workload {path}: no such file")
    items = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            prompt = item["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise InputError(f"--workload {path}: line {number} is not a JSON object with a 'prompt'") from None
        if not isinstance(prompt, str) or not prompt.strip():
            raise InputError(f"--workload {path}: line {number} has an empty prompt")
        items.append({"id": str(item.get("id", number)), "prompt": prompt, "chat": bool(item.get("chat", True))})
    if not items:
        raise InputError(f"--workload {path}: no prompts")
    return items[:limit] if limit else items


@contextmanager
def prompt_source(label: str) -> Iterator[None]:
    """Errors about the prompt raised inside name `label` (a file, a workload line) instead of --prompt."""
    try:
        yield
    except InputError as exc:
        message = str(exc)
        if not message.startswith("--prompt: "):
            raise
        raise InputError(f"{label}: {message.removeprefix('--prompt: ')}") from None


class PromptProgress:
    """A rich progress bar over the prompts of a run, on a stderr console; silent without one."""

    def __init__(self, progress=None, task=None) -> None:
        self._progress, self._task = progress, task

    def start(self, label: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, description=label, refresh=True)

    def done(self) -> None:
        if self._progress is not None:
            self._progress.advance(self._task)


@contextmanager
def prompt_progress(total: int, console=None) -> Iterator[PromptProgress]:
    """A `PromptProgress` over `total` prompts drawn on `console` (removed when finished); None: silent."""
    if console is None:
        yield PromptProgress()
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        yield PromptProgress(progress, progress.add_task("prompts", total=total))


def _sum_lists(a: list[int], b: list[int]) -> list[int]:
    out = list(a) + [0] * max(0, len(b) - len(a))
    for i, x in enumerate(b):
        out[i] += x
    return out


def run_bench(artifact, options: RunOptions, workloads, max_tokens, limit, warmup, progress_console=None) -> dict[str, Any]:
    """Every prompt plain then speculative (greedy); paired speedups, acceptance, identity.
    With `progress_console` (a rich Console on stderr), a progress bar counts the prompts."""
    runner = Runner(artifact, options)
    if runner.drafter_name == "none":
        raise InputError("--drafter none: bench compares plain with a drafter; pick one (ngram, draft-model, ...)")
    sampling = SamplingParams()
    report: dict[str, Any] = {"artifact": str(artifact), "backend": options.backend, "graph": runner.artifact.target.spec.file,
                              "drafter": runner.drafter_name, "shape_invariant": runner.shape_invariant,
                              "row_invariant": runner.artifact.target.row_invariant,
                              "num_draft_tokens": runner.num_draft_tokens, "max_tokens": max_tokens, "workloads": {}}
    loaded = [(Path(w).stem, load_workload(Path(w), limit)) for w in workloads]
    if warmup:
        first = loaded[0][1][0]
        runner.generate(first["prompt"], first["chat"], 16, sampling, drafter="none")
        runner.generate(first["prompt"], first["chat"], 16, sampling)
    with prompt_progress(sum(len(items) for _, items in loaded), progress_console) as bar:
        _bench_workloads(runner, loaded, max_tokens, sampling, report, bar)
    report["verify_ms_by_q"] = {str(q): round(1000 * t, 2) for q, t in sorted(runner.pass_costs.by_q.items())}
    return report


def _bench_workloads(runner: Runner, loaded, max_tokens: int, sampling: SamplingParams, report: dict[str, Any],
                     bar: PromptProgress) -> None:
    for name, items in loaded:
        rows = []
        drafted: list[int] = []
        accepted: list[int] = []
        totals = {"plain_tokens": 0, "plain_time": 0.0, "spec_tokens": 0, "spec_time": 0.0, "passes": 0, "engine": 0.0}
        for item in items:
            bar.start(f"{name}: {item['id']}")
            with prompt_source(f"--workload {name}: prompt {item['id']}"):
                ids = runner.artifact.tokenizer.prompt_ids(item["prompt"], item["chat"])
                plain = runner.generate_ids(ids, max_tokens, sampling, drafter="none")
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
            bar.done()
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


REPORT_ROWS = (  # (label, how a workload's value is shown)
    ("prompts", lambda w: str(w["prompts"])),
    ("plain tok/s", lambda w: f"{w['plain_tok_s']:.1f}"),
    ("speculative tok/s", lambda w: f"{w['spec_tok_s']:.1f}"),
    ("median speedup", lambda w: f"{w['median_speedup']:.2f}x"),
    ("tokens per pass", lambda w: f"{w['mean_accepted_length']:.2f}"),
    ("runtime overhead", lambda w: f"{100 * w['overhead_fraction']:.1f}%"),
    ("identical to plain", lambda w: f"{w['identical']}/{w['prompts']}"),
    ("acceptance by position", lambda w: " ".join(f"{x:.2f}" for x in w["acceptance_per_position"][:8]) or "-"),
)


def print_report(report: dict[str, Any], console=None) -> None:
    """The bench report: one column per workload, one row per measure (readable at 80 columns)."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = console or Console()
    console.print(Text(f"{report['artifact']}: backend {report['backend']}, graph {report['graph']}, drafter {report['drafter']}, "
                       f"k={report['num_draft_tokens']}, max_tokens={report['max_tokens']}, greedy, {_mode(report)}"))
    table = Table()
    table.add_column("", no_wrap=True)
    for name in report["workloads"]:
        table.add_column(Text(name), overflow="fold", justify="right")
    for label, show in REPORT_ROWS:
        table.add_row(label, *(Text(show(w)) for w in report["workloads"].values()))
    console.print(table)
    costs = report.get("verify_ms_by_q") or {}
    if costs:
        console.print(Text("target pass, ms (EMA) by tokens verified: " + "  ".join(f"{q}: {ms:.1f}" for q, ms in costs.items())))


def _mode(report: dict[str, Any]) -> str:
    """How the verify passes are made to compute plain decoding's logits (docs/DESIGN.md, equal logits)."""
    rows = report.get("shape_invariant", 0)
    mode = f"shape-invariant ({rows} rows)" if rows else "shape-invariant off"
    return mode + (", row-invariant graph" if report.get("row_invariant") else "")


def run_verify(artifact, options: RunOptions, workloads, max_tokens, limit, progress_console=None) -> dict[str, Any]:
    """Greedy speculative vs plain for every prompt: {drafter, shape_invariant, identical, logits_bitwise, prompts:
    [{id, identical, first_difference, tokens, mean_accepted_length, logits_bitwise, max_logit_difference,
    logit_positions}]}. With `progress_console` (a rich Console on
    stderr), a progress bar counts the prompts."""
    runner = Runner(artifact, options)
    items = [item for w in workloads for item in load_workload(Path(w), limit)] if workloads else BUILTIN_PROMPTS[:limit]
    results = []
    with prompt_progress(len(items), progress_console) as bar:
        for item in items:
            bar.start(item["id"])
            with prompt_source(f"prompt {item['id']}"):
                results.append(_verify_prompt(runner, item, max_tokens))
            bar.done()
    return {"drafter": runner.drafter_name, "shape_invariant": runner.shape_invariant,
            "row_invariant": runner.artifact.target.row_invariant, "identical": all(r["identical"] for r in results),
            "logits_bitwise": all(r["logits_bitwise"] for r in results), "prompts": results}


def print_verify_report(report: dict[str, Any]) -> None:
    """One line per prompt (identical, or the first differing token) and the total."""
    results = report["prompts"]
    for r in results:
        status = "identical" if r["identical"] else f"DIFFERS at token {r['first_difference']}"
        logits = "logits bitwise equal" if r["logits_bitwise"] else f"logits differ by up to {r['max_logit_difference']:.2g}"
        print(f"{r['id']}: {status}, {logits} ({r['tokens']} tokens, {r['mean_accepted_length']:.2f} tokens/pass)")
    bitwise = sum(r["logits_bitwise"] for r in results)
    print(f"{sum(r['identical'] for r in results)}/{len(results)} identical, logits bitwise equal in {bitwise}/{len(results)} "
          f"({report['drafter']} vs plain, {_mode(report)})")


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
