"""How the commands show what the library returns: rich tables and lines for people (`--json` prints the data)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..console import report_console


def _shape(shape: list[Any]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _io_rows(specs: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """(name, dtype, shape) rows, with the per-layer past/present KV tensors folded into one row."""
    rows, kv = [], []
    for t in specs:
        if t["name"].startswith(("past_key_values.", "present.")):
            kv.append(t)
        else:
            rows.append((t["name"], t["dtype"], _shape(t["shape"])))
    if kv:
        prefix = kv[0]["name"].split(".")[0]
        rows.append((f"{prefix}.{{0..{len(kv) // 2 - 1}}}.key/value", kv[0]["dtype"], _shape(kv[0]["shape"])))
    return rows


def format_value(value: Any) -> str:
    """A manifest value as text a person reads: key=value pairs, bare lists, tree paths counted."""
    if isinstance(value, dict):
        return ", ".join(f"{k}=({format_value(v)})" if isinstance(v, dict) and v else f"{k}={format_value(v)}"
                         for k, v in value.items()) or "none"
    if isinstance(value, list):
        if value and all(isinstance(v, list) for v in value):
            return f"{len(value)} paths"
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    return str(value)


def print_summary(summary: dict[str, Any], console: Console | None = None) -> None:
    """`inspect`: the artifact summary (inspect_artifact.summarize) as rich tables (readable at 80 columns)."""
    console = console or report_console()
    model = summary["model"]
    console.print(Text(f"{summary['artifact']}", style="bold") + Text(f"  (schema {summary['schema_version']}, {summary['created_by']})"))
    facts = Table.grid(padding=(0, 2))
    facts.add_column(style="bold", no_wrap=True)
    facts.add_column(overflow="fold")
    facts.add_row("model", Text(f"{model['name']}: {model['architecture']}, {model['layers']} layers, hidden {model['hidden_size']}, "
                           f"{model['heads']} heads / {model['kv_heads']} KV heads, vocab {model['vocab_size']}"))
    facts.add_row("limits", Text(format_value(summary["limits"])))
    sections = {"drafter": {k: v for k, v in (summary["drafter"] or {}).items() if k != "config"},
                "precision": summary["precision"] or {}, "engine": summary["engine"] or {}}
    for section, entries in sections.items():
        for key, value in entries.items():
            facts.add_row(section, Text(f"{key}: {format_value(value)}"))
            section = ""
    console.print(facts)
    for name, g in summary["graphs"].items():
        table = Table(title=Text(f"{name}: {g['file']} ({g['role']}, {g['dtype']}, {g['size_mb']:.1f} MB)"), title_justify="left")
        table.add_column("", no_wrap=True)
        table.add_column("tensor", no_wrap=True)
        table.add_column("dtype", no_wrap=True)
        table.add_column("shape", overflow="fold")
        for direction in ("inputs", "outputs"):
            for i, row in enumerate(_io_rows(g[direction])):
                table.add_row(direction[:-1] if i == 0 else "", *(Text(cell) for cell in row))
        console.print(table)
    console.print(f"total: {summary['total_size_mb']:.1f} MB in {len(summary['files'])} files")


BENCH_ROWS = (  # (label, how a workload's value is shown)
    ("prompts", lambda w: str(w["prompts"])),
    ("plain tok/s", lambda w: f"{w['plain_tok_s']:.1f}"),
    ("speculative tok/s", lambda w: f"{w['spec_tok_s']:.1f}"),
    ("median speedup", lambda w: f"{w['median_speedup']:.2f}x"),
    ("tokens per pass", lambda w: f"{w['mean_accepted_length']:.2f}"),
    ("runtime overhead", lambda w: f"{100 * w['overhead_fraction']:.1f}%"),
    ("identical to plain", lambda w: f"{w['identical']}/{w['prompts']}"),
    ("acceptance by position", lambda w: " ".join(f"{x:.2f}" for x in w["acceptance_per_position"][:8]) or "-"),
)


def print_bench_report(report: dict[str, Any], console: Console | None = None) -> None:
    """`bench` (runtime/bench.run_bench): one column per workload, one row per measure (readable at 80 columns)."""
    console = console or report_console()
    console.print(Text(f"{report['artifact']}: backend {report['backend']}, graph {report['graph']}, drafter {report['drafter']}, "
                       f"k={report['num_draft_tokens']}, max_tokens={report['max_tokens']}, greedy, {_mode(report)}"))
    table = Table()
    table.add_column("", no_wrap=True)
    for name in report["workloads"]:
        table.add_column(Text(name), overflow="fold", justify="right")
    for label, show in BENCH_ROWS:
        table.add_row(label, *(Text(show(w)) for w in report["workloads"].values()))
    console.print(table)
    costs = report.get("verify_ms_by_q") or {}
    if costs:
        console.print(Text("target pass, ms (EMA) by tokens verified: " + "  ".join(f"{q}: {ms:.1f}" for q, ms in costs.items())))


def print_verify_report(report: dict[str, Any], console: Console | None = None) -> None:
    """`verify` (runtime/bench.run_verify): one line per prompt (identical, or the first differing token), the total."""
    console = console or Console(highlight=False, soft_wrap=True)  # one line per prompt, never wrapped
    results = report["prompts"]
    for r in results:
        status = "identical" if r["identical"] else f"DIFFERS at token {r['first_difference']}"
        logits = "logits bitwise equal" if r["logits_bitwise"] else f"logits differ by up to {r['max_logit_difference']:.2g}"
        console.print(Text(f"{r['id']}: {status}, {logits} ({r['tokens']} tokens, {r['mean_accepted_length']:.2f} tokens/pass)"))
    bitwise = sum(r["logits_bitwise"] for r in results)
    console.print(Text(f"{sum(r['identical'] for r in results)}/{len(results)} identical, logits bitwise equal in "
                       f"{bitwise}/{len(results)} ({report['drafter']} vs plain, {_mode(report)})"))


def _mode(report: dict[str, Any]) -> str:
    """How the verify passes are made to compute plain decoding's logits (docs/DESIGN.md, equal logits)."""
    rows = report.get("shape_invariant", 0)
    mode = f"shape-invariant ({rows} rows)" if rows else "shape-invariant off"
    return mode + (", row-invariant graph" if report.get("row_invariant") else "")
