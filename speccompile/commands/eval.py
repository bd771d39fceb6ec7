"""`speccompile eval`: quality of a quantized artifact against its fp32 reference (table or --json)."""

from __future__ import annotations

from pathlib import Path

import click

from ..console import emit_json, progress_printer, report_console


@click.command("eval")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--reference", required=True, type=click.Path(path_type=Path), help="The unquantized artifact ARTIFACT was built from.")
@click.option("--text", type=click.Path(path_type=Path), default=None,
              help="Plain text scored teacher-forced, one sequence per paragraph [default: benchmarks/eval/heldout.txt].")
@click.option("--workload", "workloads", multiple=True, type=click.Path(path_type=Path),
              help="JSONL prompts for greedy n-gram generation with both models (repeatable).")
@click.option("--limit", type=int, default=4, show_default=True, help="Prompts per workload.")
@click.option("--max-tokens", type=int, default=64, show_default=True, help="Tokens generated per prompt.")
@click.option("--max-text-tokens", type=int, default=256, show_default=True, help="Longest scored paragraph (longer ones are cut).")
@click.option("--threads", type=int, default=None, help="ONNX Runtime threads.")
@click.option("--contract-graph", is_flag=True,
              help="Score ARTIFACT's contract graph (target.onnx) instead of the CPU graph `run` uses on ort-cpu.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def eval_command(artifact, reference, text, workloads, limit, max_tokens, max_text_tokens, threads, contract_graph, as_json):
    """Compare ARTIFACT (e.g. from `speccompile build --fp8 --onnx-only`) with --reference on held-out text and workloads:
    ARTIFACT's graph is the one `run` uses (its CPU graph on ort-cpu), the report says which."""
    from ..evaluation import EvalOptions, evaluate

    options = EvalOptions(text=text, workloads=list(workloads), limit=limit, max_tokens=max_tokens,
                          max_text_tokens=max_text_tokens, threads=threads, contract_graph=contract_graph)
    report = evaluate(artifact, reference, options, progress_printer(as_json))
    if as_json:
        emit_json(report)
    else:
        print_report(report)


def print_report(report: dict) -> None:
    """The report as one table: metric | reference | artifact."""
    from rich.table import Table

    scheme = report["scheme"] + (" (exact fp32 emulation)" if report["emulated"] else "")
    text, graph = report["text"], report["graphs"]["artifact"]
    table = Table(title=f"{scheme} vs reference", title_justify="left", caption=f"text: {Path(text['file']).name}, "
                  f"{text['sequences']} paragraphs, {text['positions']} positions; scored: {graph['file']}, "
                  f"{graph['what']}", caption_justify="left")
    table.add_column("metric")
    table.add_column("reference", justify="right")
    table.add_column("artifact", justify="right")
    size = report["size_mb"]
    table.add_row("target size", f"{size['reference']:.1f} MB", f"{size['artifact']:.1f} MB ({size['artifact'] / size['reference']:.0%})")
    low, high = report["top1_interval_95"]
    table.add_row("top-1 agreement (95% interval)", "1", f"{report['top1_agreement']:.4f} ({low:.3f}-{high:.3f})")
    table.add_row("KL(ref || artifact)", "0", f"{report['kl_divergence']:.4f} (max {report['kl_divergence_max']:.2f})")
    ppl = report["perplexity"]
    table.add_row("perplexity", f"{ppl['reference']:.2f}", f"{ppl['artifact']:.2f}")
    for row in report["ngram"]:
        tpp = row["tokens_per_pass"]
        name = Path(row["workload"]).stem
        table.add_row(f"n-gram tok/pass (k={row['num_draft_tokens']}): {name}", f"{tpp['reference']:.2f}", f"{tpp['artifact']:.2f}")
        table.add_row(f"identical greedy: {name}", "", f"{row['identical_greedy']}/{row['prompts']}")
    report_console().print(table)


COMMANDS = [eval_command]
