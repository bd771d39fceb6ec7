"""`speccompile build`: quantize an exported artifact (FP8 / NVFP4 / INT4 Q/DQ) and build TensorRT engines."""

from __future__ import annotations

from pathlib import Path

import click

from ..errors import InputError


@click.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--out", "out", required=True, type=click.Path(path_type=Path), help="Artifact directory to write.")
@click.option("--fp8", is_flag=True, help="FP8 E4M3 weights (per channel) and activations (per tensor, calibrated). Ada/Hopper/Blackwell.")
@click.option("--fp4", is_flag=True, help="NVFP4 weights and dynamic activations (blocks of 16, FP8 scales). Blackwell only.")
@click.option("--int4", is_flag=True, help="INT4 weight-only, blockwise (see --int4-block). Also runs in ONNX Runtime CPU.")
@click.option("--int8", is_flag=True, help="INT8 weight-only in blocks of 32 along the reduction axis (Q8_0's grid), round to "
              "nearest, no calibration: the accuracy-first choice for ONNX Runtime CPU (needs --onnx-only; docs/cpu.md). "
              "A GGUF's tensors on a symmetric grid (Q8_0, Q6_K, Q5_0, Q4_0) keep their codes.")
@click.option("--weight-only", is_flag=True,
              help="With --fp8 / --fp4: quantize the weights only; activations stay in the graph's float type (W8A16 / W4A16, "
                   "a DQ prologue into a 16-bit GEMM). Verify passes of a few tokens are bound by weight reads, which it "
                   "shrinks the same; it keeps far more of the model (docs/quantization.md).")
@click.option("--no-quantize", is_flag=True, help="Quantize nothing: engines of the graphs as exported (with --onnx-only: only the trtexec script).")
@click.option("--fp16", "float16", is_flag=True,
              help="Run the layers that stay unquantized in FP16. Needs an artifact exported with --dtype fp16 (strongly typed "
                   "TensorRT takes the precision from the graph), or, on TensorRT 10, --weakly-typed (sets the builder's FP16 flag).")
@click.option("--bf16", "bfloat16", is_flag=True, help="Run the layers that stay unquantized in BF16 (same rules as --fp16, with --dtype bf16).")
@click.option("--max-context", type=int, default=None, help="Longest context the engine profiles cover [default: the export's].")
@click.option("--max-verify-tokens", type=int, default=None, help="Most tokens per verify pass the profiles cover [default: the export's].")
@click.option("--max-batch", type=int, default=None, help="Largest batch the profiles cover [default: the export's].")
@click.option("--onnx-only", is_flag=True, help="Write the quantized ONNX artifact and trtexec commands; build no engine (no TensorRT needed).")
@click.option("--calib", "--calib-prompts", "calib", type=click.Path(path_type=Path), default=None, help="Calibration text: .jsonl of {prompt|text, chat?} or plain text (paragraphs) [default: built-in prompts].")
@click.option("--calib-samples", type=int, default=16, show_default=True, help="Most calibration samples used.")
@click.option("--calib-max-tokens", type=int, default=256, show_default=True, help="Tokens per calibration sample (longer ones are cut).")
@click.option("--exclude", multiple=True, help="Weight name pattern (fnmatch) to keep unquantized, added to the defaults (repeatable).")
@click.option("--quantize-lm-head", is_flag=True,
              help="Also quantize lm_head and the embedding table (excluded by default). A tied table is stored once, "
                   "quantized; the lm_head and the embedding Gather both read its DequantizeLinear.")
@click.option("--table-format", type=click.Choice(["int8", "int8-row", "fp16", "scheme"]), default="int8", show_default=True,
              help="Format of the embedding table with --quantize-lm-head: INT8 per row (weight-only on the Gather and "
                   "the lm_head, whatever the scheme; a GGUF's table on a symmetric grid, Q8_0 or Q6_K, keeps its blocks), int8-row (INT8 per row even "
                   "for a Q8_0 table: a tied lm_head then runs as an integer matrix product on the CPU graph, cheaper in "
                   "verify passes), float16 (half the fp32 size, the most accurate), or the build's weight format "
                   "(smaller with INT4).")
@click.option("--table-block", type=click.Choice(["64", "128"]), default="64", show_default=True,
              help="INT4 block size along the hidden axis of the embedding table (with --quantize-lm-head; TensorRT's INT4 blocks).")
@click.option("--int4-block", type=click.Choice(["32", "64", "128", "256"]), default="128", show_default=True, help="INT4 block size along the reduction axis (halved where it does not divide K). TensorRT takes 64 and 128; smaller blocks run on ONNX Runtime only.")
@click.option("--int8-block", type=click.Choice(["32", "64"]), default="32", show_default=True, help="INT8 block size along the reduction axis: 32 is llama.cpp's Q8_0 grid; 64 runs the packed CPU graph about 7 % faster, with coarser blocks (docs/cpu.md).")
@click.option("--act-calib", type=click.Choice(["max", "percentile", "mse"]), default="max", show_default=True, help="FP8 activation range from calibration: max, a percentile of |x| (--percentile) or the smallest fake-quant MSE.")
@click.option("--percentile", type=float, default=99.99, show_default=True, help="Percentile for --act-calib percentile.")
@click.option("--smoothquant", type=float, default=None, help="FP8: migrate activation outliers into the weights with SmoothQuant strength ALPHA (0..1).")
@click.option("--awq/--no-awq", default=True, show_default=True, help="INT4/NVFP4: activation-aware input-channel scales searched on calibration activations.")
@click.option("--clip-search/--no-clip-search", default=True, show_default=True, help="INT4/NVFP4: per-block clipping ratio search.")
@click.option("--act-headroom", type=float, default=None,
              help="FP8: activation ranges times this factor, room for values above the calibration's [default: 2].")
@click.option("--gptq/--no-gptq", default=None,
              help="GPTQ error compensation of the quantized weights: each input channel's rounding error is spread over the "
                   "channels not yet quantized, from the calibration activations' Hessian (INT4/NVFP4: after AWQ and clipping) [default: on for FP8, INT4 and weight-only NVFP4, off for NVFP4].")
@click.option("--gptq-damp", type=float, default=None,
              help="GPTQ damping: this fraction of the Hessian's mean diagonal is added to it (larger: closer to plain rounding) [default: fp8 0.1, int4 and nvfp4 3].")
@click.option("--gptq-act-order/--no-gptq-act-order", default=None,
              help="GPTQ in activation order: input channels by decreasing calibration energy (Hessian diagonal), each block's "
                   "scale fixed from the original weights first, so blocks stay contiguous along K [default: on for INT4 and weight-only NVFP4].")
@click.option("--low-rank", type=click.IntRange(0, None), default=0, show_default=True,
              help="Rank of a float16 side branch per quantized MatMul that carries the weight's principal part "
                   "(SVD weighted by calibration activations; SVDQuant's split); only the rest is quantized. 0: off.")
@click.option("--source-grid/--no-source-grid", default=True, show_default=True,
              help="Store weights that are already on a block grid (a GGUF's Q4_0 / Q4_1 / Q4_K / Q5_0 / Q6_K / Q8_0 tensors, a "
                   "dequantized GPTQ or AWQ checkpoint) on that grid: INT4 MatMul weights with --int4, symmetric INT8 ones "
                   "with --int8, the embedding table with --table-format int8. "
                   "Nothing is lost; blocks other than 64 / 128 run on ONNX Runtime only (docs/quantization.md).")
@click.option("--min-top1", type=float, default=None, help="Keep the most sensitive MatMuls unquantized until top-1 agreement with the unquantized graph is >= this on calibration prompts held back from the fitting (every fourth).")
@click.option("--keep-format", type=click.Choice(["fp32", "fp8"]), default="fp32", show_default=True,
              help="With --min-top1: store the weights it keeps in fp32 (unquantized) or FP8 weight-only per channel "
                   "(a quarter of the size; the search measures them in FP8).")
@click.option("--qad-steps", type=click.IntRange(0, None), default=0, show_default=True,
              help="Quantization-aware distillation: train the quantized weights (on their grids), the norm weights and the "
                   "low-rank factors this many steps to match the unquantized model's next-token distributions (--qad-data; "
                   "weight-only builds: --int4, --fp8/--fp4 --weight-only; torch on --qad-device, on two CPU cores about 4-5 s a step for a 135M model). 0: off.")
@click.option("--qad-lr", type=float, default=0.002, show_default=True, help="QAD: Adam step of the quantized weights, in grid steps (0: their codes stay).")
@click.option("--qad-float-lr", type=float, default=0.0001, show_default=True,
              help="QAD: Adam step of the float parameters (norm weights, low-rank factors), relative to each one's RMS (0: they stay).")
@click.option("--qad-data", type=click.Choice(["generated", "calib"]), default="generated", show_default=True,
              help="QAD's text: the unquantized model's own continuations of the calibration prompts, or the calibration text.")
@click.option("--qad-samples", type=click.IntRange(1, None), default=64, show_default=True,
              help="QAD with --qad-data generated: continuations sampled (--calib-max-tokens tokens each).")
@click.option("--qad-batch", type=click.IntRange(1, None), default=2, show_default=True, help="QAD: rows of --calib-max-tokens tokens per step.")
@click.option("--qad-device", default="auto", show_default=True, metavar="auto|cpu|cuda|cuda:N",
              help="QAD: the torch device to train on (auto: a CUDA GPU when torch sees one, else the CPU).")
@click.option("--profiles", type=click.Choice(["single", "split", "buckets"]), default="single", show_default=True, help="One optimization profile, separate verify and prefill profiles, or static shapes per q bucket (CUDA graphs in the tensorrt backend).")
@click.option("--prefill-chunk", type=int, default=256, show_default=True, help="Longest prompt chunk the engine must accept (the runtime's prefill chunk).")
@click.option("--opt-q", type=int, default=None, help="q_len the kernels are tuned for [default: min(8, max_verify_tokens)].")
@click.option("--opt-context", type=int, default=None, help="past_len the kernels are tuned for [default: max_context / 4].")
@click.option("--workspace-mb", type=int, default=None, help="TensorRT workspace limit in MiB [default: TensorRT's].")
@click.option("--builder-optimization-level", type=click.IntRange(0, 5), default=3, show_default=True,
              help="TensorRT builder effort, 0-5: higher searches more kernels (slower builds, sometimes faster engines).")
@click.option("--timing-cache", type=click.Path(path_type=Path), default=None, help="Timing cache file to read and update (faster rebuilds).")
@click.option("--weakly-typed", is_flag=True, help="TensorRT 10 only: precision from builder flags instead of strong typing.")
@click.option("--threads", type=int, default=None, help="ONNX Runtime threads for calibration.")
@click.option("--force", is_flag=True, help="Replace an existing output directory.")
@click.option("--json", "as_json", is_flag=True, help="Print the resulting manifest summary as JSON.")
def build(artifact, out, as_json, **flags):
    """Quantize ARTIFACT (from `speccompile export`) and build TensorRT engines into --out."""
    from ..console import progress_printer
    from ..engines.build import BuildOptions, build_artifact
    from .artifacts import report_artifact

    precision, float_dtype = _precision(flags)
    methods, qad = _method_options(flags), _qad_options(flags)
    quantize_lm_head, exclude = flags.pop("quantize_lm_head"), flags.pop("exclude")
    _check_table_flags(click.get_current_context(), quantize_lm_head)
    options = BuildOptions(precision=precision, float_dtype=float_dtype, methods=methods, qad=qad,
                           exclude=_excluded(quantize_lm_head, exclude), quantize_tables=quantize_lm_head,
                           int4_block=int(flags.pop("int4_block")), int8_block=int(flags.pop("int8_block")),
                           table_block=int(flags.pop("table_block")),
                           **flags)  # every other option is a BuildOptions field of the same name
    build_artifact(artifact, out, options, progress_printer(as_json))
    what = "quantized ONNX" if options.onnx_only else "TensorRT engines"
    report_artifact(out, as_json, f"[green]built[/green] {artifact} -> {out} ({precision}, {what})")


# option name -> (its flag, the scheme it asks for)
PRECISION_FLAGS = {"fp8": ("--fp8", "fp8"), "fp4": ("--fp4", "nvfp4"), "int4": ("--int4", "int4"), "int8": ("--int8", "int8"),
                   "no_quantize": ("--no-quantize", "none")}


def _precision(flags: dict) -> tuple[str, str | None]:
    """The scheme and the float type of the unquantized layers the precision flags ask for (taken out of `flags`)."""
    chosen = [PRECISION_FLAGS[name] for name in PRECISION_FLAGS if flags.pop(name)]
    float16, bfloat16 = flags.pop("float16"), flags.pop("bfloat16")
    if len(chosen) > 1:
        raise InputError(f"{' and '.join(flag for flag, _ in chosen)} are mutually exclusive: pick one precision")
    if not chosen and not (float16 or bfloat16):
        raise InputError("build: name the precision: --fp8, --fp4, --int4 or --int8 (quantize), --fp16 / --bf16 (unquantized layers "
                         "in that type) or --no-quantize (the graphs as exported)")
    if float16 and bfloat16:
        raise InputError("--fp16 and --bf16 are mutually exclusive")
    return (chosen[0][1] if chosen else "none"), ("fp16" if float16 else "bf16" if bfloat16 else None)


def _method_options(flags: dict):
    """engines.methods.MethodOptions from its flags (taken out of `flags`); an unset tri-state keeps its default."""
    from ..engines.methods import MethodOptions

    given = {name: flags.pop(name) for name in ("act_calib", "percentile", "smoothquant", "awq", "low_rank", "source_grid")}
    optional = {name: flags.pop(name) for name in ("act_headroom", "gptq", "gptq_damp", "gptq_act_order")}
    return MethodOptions(clip=flags.pop("clip_search"), **given, **{k: v for k, v in optional.items() if v is not None})


def _qad_options(flags: dict):
    """engines.qad.QadOptions from the --qad-* flags (taken out of `flags`)."""
    from ..engines.qad import QadOptions

    qad = {name[len("qad_"):]: flags.pop(name) for name in [n for n in flags if n.startswith("qad_")]}
    qad["lr_free"] = qad.pop("float_lr")
    return QadOptions(**qad)


def _check_table_flags(ctx: click.Context, quantize_lm_head: bool) -> None:
    """--table-format / --table-block given without --quantize-lm-head would change nothing: said, exit 2."""
    given = [f"--{name.replace('_', '-')}" for name in ("table_format", "table_block")
             if ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE]
    if given and not quantize_lm_head:
        raise InputError(f"{' and '.join(given)}: the embedding table is quantized only with --quantize-lm-head; add it or drop "
                         f"{'them' if len(given) > 1 else 'it'}")


def _excluded(quantize_lm_head: bool, exclude: tuple[str, ...]) -> tuple[str, ...]:
    """Weight name patterns kept unquantized: BuildOptions' defaults (lm_head, embeddings) unless --quantize-lm-head,
    MoE routers always, plus --exclude."""
    from ..engines.build import BuildOptions
    from ..engines.qdq_targets import ROUTER_EXCLUDE

    return tuple([p for p in BuildOptions.exclude if not quantize_lm_head or p in ROUTER_EXCLUDE] + list(exclude))


COMMANDS = [build]
