"""`speccompile export | inspect`: write an artifact directory, show what one holds."""

from __future__ import annotations

from pathlib import Path

import click

from ..console import console, emit_json, progress_printer


@click.command()
@click.argument("model")
@click.option("--out", "out", required=True, type=click.Path(path_type=Path), help="Artifact directory to write.")
@click.option("--dtype", type=click.Choice(["fp32", "fp16", "bf16"]), default="fp32", show_default=True, help="Weight and activation dtype of the graphs.")
@click.option("--hidden-states", type=click.Choice(["none", "final", "eagle3"]), default=None, help="Extra target outputs for drafter heads (default: what --drafter needs).")
@click.option("--max-context", type=int, default=None, help="Longest context (prompt + generated) the artifact supports [default: the model's].")
@click.option("--max-verify-tokens", type=int, default=64, show_default=True, help="Most tokens verified in one target pass (chain or tree).")
@click.option("--drafter", default=None, help="Drafter to export with the target: ngram | draft-model:PATH | eagle:PATH | "
              "eagle3:PATH | medusa:PATH | mtp[:PATH] | dflash:PATH. eagle3 reads the speculators layout (Llama / Qwen3 layers, "
              "its norm flags, custom taps) and the flat LlamaForCausalLMEagle3 one (EAGLE authors' pytorch_model.bin, "
              "SGLang SpecForge, ModelOpt; safetensors shards); mtp reads DeepSeek-V3 / GLM-4.5 model.layers.N, "
              "Qwen3-Next / Qwen3.5 mtp.*, MiMo and speculators MTP modules, from MODEL itself when no PATH is given "
              "(a GGUF's blk.N.nextn.* too); dflash reads the z-lab and speculators layouts.")
@click.option("--tree", default=None, help="Tree preset name or JSON file of choice paths (for tree drafters).")
@click.option("--num-draft-tokens", type=int, default=None, help="Draft tokens per step recorded as the default for `run`.")
@click.option("--fused-cpu-graph/--no-fused-cpu-graph", default=True, show_default=True,
              help="Also write *.ort.onnx: the same model with ONNX Runtime's fused CPU operators and an in-place KV buffer (sharing the weights file).")
@click.option("--batch-slots", type=click.IntRange(0, 64), default=8, show_default=True,
              help="Also write *.ort-slots.onnx for a server decoding up to this many requests in one pass each step, "
                   "drafts included, every request's rows the bits it gets alone; with a GPU dtype also *.ort-cuda-slots.onnx, "
                   "the GPU graph's form for that many requests a pass, and *.ort-cuda-tree-slots.onnx, its form for tree "
                   "drafts (a per-slot attention bias; onnxruntime-gpu >= 1.28) (0: none; same weights file).")
@click.option("--draft-cpu-weights", type=click.Choice(["int8", "int4", "fp32"]), default="int8", show_default=True,
              help="Weights of the drafter's ONNX Runtime CPU graph (a head's <kind>.ort.onnx, fp32: none; the draft model's draft.ort.onnx, fp32: unquantized). Drafts may change, outputs never do.")
@click.option("--force", is_flag=True, help="Replace an existing output directory.")
@click.option("--json", "as_json", is_flag=True, help="Print the manifest summary as JSON.")
def export(model, out, as_json, **options):
    """Export MODEL (Hugging Face folder, .gguf file or alias such as smollm2-135m) to ONNX verify graphs."""
    from ..export.pipeline import ExportOptions, export_artifact

    options = ExportOptions(**options)  # every other option is an ExportOptions field of the same name
    export_artifact(model, out, options, progress_printer(as_json))
    report_artifact(out, as_json, f"[green]exported[/green] {model} -> {out}")


def report_artifact(out: Path, as_json: bool, headline: str) -> None:
    """After export/build: the artifact summary as JSON, or one line with its size."""
    from ..inspect_artifact import summarize

    summary = summarize(out)
    if as_json:
        emit_json(summary)
    else:
        console().print(f"{headline} ({summary['total_size_mb']:.1f} MB)")


@click.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
def inspect(artifact, as_json):
    """Show what an artifact directory holds: model, graphs, inputs/outputs, sizes, limits."""
    from ..inspect_artifact import summarize
    from .reports import print_summary

    summary = summarize(artifact)
    if as_json:
        emit_json(summary)
    else:
        print_summary(summary)


COMMANDS = [export, inspect]
