"""`speccompile run | bench | verify`: the runtime's command-line front ends."""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from pathlib import Path
from typing import Callable

import click

from ..console import emit_json, progress_bar_console
from ..errors import InputError, UnsupportedError
from ..runtime.backends.base import BACKENDS
from ..runtime.options import DRAFTER_CHOICES, RunOptions
from ..runtime.sampling import SamplingParams


def _prompt_label(prompt_file: Path | None) -> str:
    """How errors name the prompt's source: --prompt, --prompt-file FILE or --prompt-file standard input."""
    if prompt_file is None:
        return "--prompt"
    return f"--prompt-file {'standard input' if str(prompt_file) == '-' else prompt_file}"


def _read_prompt(prompt: str | None, prompt_file: Path | None) -> str:
    """The prompt from --prompt, --prompt-file FILE or --prompt-file - (standard input)."""
    if (prompt is None) == (prompt_file is None):
        raise InputError("give exactly one of --prompt TEXT or --prompt-file FILE (- reads standard input)")
    label = _prompt_label(prompt_file)
    if prompt_file is None:
        if not prompt.strip():
            raise InputError(f"{label}: the prompt is empty")
        return prompt
    try:
        text = sys.stdin.read() if str(prompt_file) == "-" else prompt_file.read_text(encoding="utf-8")
    except IsADirectoryError:
        raise InputError(f"{label}: is a directory, expected a text file") from None
    except FileNotFoundError:
        raise InputError(f"{label}: no such file") from None
    except UnicodeDecodeError:
        raise InputError(f"{label}: not UTF-8 text") from None
    except OSError as exc:
        raise InputError(f"{label}: cannot read ({exc.strerror})") from None
    if not text.strip():
        raise InputError(f"{label}: the prompt is empty")
    return text


def check_artifact_backend(artifact: Path, backend: str) -> None:
    """Refuse an artifact whose target the backend cannot run; say so when it runs but far slower than meant to."""
    from ..manifest import read_manifest

    manifest = read_manifest(artifact, verify_files=False)  # the runner checks the checksums
    if "target" not in manifest.graphs:
        return
    record = manifest.precision.get("target", {})
    scheme, runs_on = record.get("scheme"), record.get("runs_on")
    if runs_on and backend not in runs_on:
        raise UnsupportedError(f"{artifact}: a {scheme} target does not run on {backend} (it runs on {', '.join(runs_on)})")
    if backend != "ort-cpu":
        return
    dtype = manifest.graphs["target"].dtype.split("+")[0]
    if dtype == "bf16":
        raise UnsupportedError(f"{artifact}: a bf16 artifact does not run on ort-cpu (ONNX Runtime's CPU provider has no bf16 "
                               "kernels); run it on a GPU (--backend ort-cuda | ort-trt | tensorrt) or export with --dtype fp32")
    if dtype == "fp16" and scheme is None:
        _check_fp16_fits_cpu(artifact, manifest)
    if scheme in SLOW_ON_CPU:
        click.echo(f"warning: {artifact}: {SLOW_ON_CPU[scheme]} target, built for GPUs and TensorRT; on ONNX Runtime's CPU "
                   "provider it runs as fp32 without the fused CPU graph (speculative steps ~2-3x slower than the fp32 export)",
                   err=True)


SLOW_ON_CPU = {"fp8": "FP8", "int4": "INT4"}


def _available_memory() -> int | None:
    """Bytes of memory the host can give a new process without swapping (MemAvailable; None where unknown)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _check_fp16_fits_cpu(artifact: Path, manifest) -> None:
    """ONNX Runtime's CPU provider runs an fp16 graph as fp32 (it converts every fp16 weight when the session
    opens): refuse when that needs more memory than the host has available."""
    data = manifest.graphs["target"].file + ".data"
    need = 2 * (artifact / data).stat().st_size if (artifact / data).is_file() else 0
    available = _available_memory()
    if available is not None and need > available:
        raise UnsupportedError(
            f"{artifact}: an fp16 artifact runs on ort-cpu as fp32 (ONNX Runtime's CPU provider converts every fp16 "
            f"weight): about {need / 1e9:.1f} GB, {available / 1e9:.1f} GB available here; on this CPU run an fp32 export "
            "(export --dtype fp32) or an INT4 build of it (build --int4), or this one on a GPU (--backend ort-cuda | ort-trt | tensorrt)")


def backend_options(func):
    """--backend, --threads and --contract-graph, shared by run, bench and verify."""
    func = click.option(
        "--contract-graph", is_flag=True,
        help="On ort-cpu, run the portable contract graph (target.onnx) instead of the fused CPU graph (target.ort.onnx).",
    )(func)
    func = click.option(
        "--shape-invariant/--no-shape-invariant", default=None,
        help="Run every target pass with the same shapes (padded rows, fixed KV extent) so greedy output is bitwise "
             "identical to plain decoding on GPUs [default: on for GPU backends, off on ort-cpu].",
    )(func)
    func = click.option("--threads", type=int, default=None, help="Intra-op threads for ONNX Runtime [default: all usable cores].")(func)
    func = click.option("--backend", type=click.Choice(BACKENDS), default="ort-cpu", show_default=True, help="Inference engine.")(func)
    return func


def drafter_options(func):
    """--drafter, --tree, --lookup-branch, --ngram-corpus, --num-draft-tokens and --adaptive/--no-adaptive."""
    func = click.option(
        "--ngram-corpus", type=click.Path(path_type=Path), default=None,
        help="n-gram drafter: when the prompt and output have no match, propose what follows the last tokens in this "
             "corpus (JSONL of {\"text\"} or a text file; best: the model's own earlier answers).",
    )(func)
    func = click.option(
        "--lookup-branch/--no-lookup-branch", default=True, show_default=True,
        help="Head drafters: add the n-gram prompt-lookup continuation to each step's tree as one more branch.",
    )(func)
    func = click.option("--adaptive/--no-adaptive", default=True, show_default=True, help="Shorten or pause drafting when it does not pay.")(func)
    func = click.option("--tree", default=None, help="Head drafters: tree preset, JSON choice file, 'chain' or 'dynamic[-D-K-N[-pP]]' [default: the exported one].")(func)
    func = click.option("--num-draft-tokens", "-k", type=int, default=None, help="k: most draft positions per step (chain tokens, or tree depth) [default: the artifact's, else per drafter].")(func)
    func = click.option(
        "--drafter",
        type=click.Choice(DRAFTER_CHOICES),
        default="auto",
        show_default=True,
        help="auto = the drafter exported with the artifact, else n-gram lookup; none = plain decoding.",
    )(func)
    return func


RUN_OPTION_FIELDS = tuple(field.name for field in dataclasses.fields(RunOptions) if field.metadata.get("cli", True))  # one click option each


def run_options(func):
    """The drafter and backend options, handed to the command as one `options: RunOptions` argument."""

    @functools.wraps(func)
    def command(**kwargs):
        options = RunOptions(**{name: kwargs.pop(name) for name in RUN_OPTION_FIELDS})
        return func(options=options, **kwargs)

    return drafter_options(backend_options(command))


def _print_json_line(data: dict) -> None:
    sys.stdout.write(json.dumps(data) + "\n")
    sys.stdout.flush()


def _stream_printer(as_json: bool) -> Callable[[str], None]:
    """--stream: each text delta as it comes (as a {"delta": ...} JSON line under --json)."""
    def on_text(delta: str) -> None:
        if as_json:
            _print_json_line({"delta": delta})
        else:
            sys.stdout.write(delta)
            sys.stdout.flush()

    return on_text


@click.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--prompt", "-p", default=None, help="Prompt text.")
@click.option("--prompt-file", type=click.Path(path_type=Path, allow_dash=True), default=None, help="Read the prompt from a UTF-8 text file; - reads standard input.")
@click.option("--chat/--raw", default=True, show_default=True, help="Apply the model's chat template (one user turn) or feed raw text.")
@click.option("--max-tokens", type=int, default=128, show_default=True, help="Most tokens to generate.")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-k", type=int, default=0, show_default=True, help="0 = off.")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="1 = off.")
@click.option("--seed", type=int, default=None, help="Random seed for sampling.")
@click.option("--stop", multiple=True, help="Stop string (repeatable); output is cut before it.")
@run_options
@click.option("--stream", is_flag=True, help="Print text as it is generated (with --json: one JSON line per text delta, then the result).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with text, tokens, finish reason and stats.")
def run(artifact, prompt, prompt_file, chat, max_tokens, temperature, top_k, top_p, seed, stop, options, stream, as_json):
    """Generate from ARTIFACT with exact speculative decoding (output identical to the target alone)."""
    from ..runtime.bench import prompt_source
    from ..runtime.session import Runner

    text = _read_prompt(prompt, prompt_file)
    sampling = SamplingParams(temperature, top_k, top_p, seed).validate()
    check_artifact_backend(artifact, options.backend)
    runner = Runner(artifact, options)
    with prompt_source(_prompt_label(prompt_file)):
        result = runner.generate(text, chat, max_tokens, sampling, list(stop), _stream_printer(as_json) if stream else None)
    if as_json:
        final = {"text": result.text, "tokens": result.tokens, "finish_reason": result.finish_reason, "drafter": runner.drafter_name, "stats": result.stats.to_dict()}
        if stream:
            _print_json_line(final)
        else:
            emit_json(final)
        return
    if stream:
        sys.stdout.write("\n")
    else:
        click.echo(result.text)
    s = result.stats
    acc = ", ".join(f"{x:.2f}" for x in s.acceptance_per_position[:8]) or "-"
    click.echo(
        f"[{runner.drafter_name}] {s.generated_tokens} tokens, {s.tokens_per_second:.1f} tok/s, "
        f"{s.mean_accepted_length:.2f} tokens/pass, acceptance per position [{acc}], "
        f"overhead {100 * s.overhead_fraction:.1f}%, finish={result.finish_reason}",
        err=True,
    )


@click.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--workload", "workloads", type=click.Path(path_type=Path), multiple=True, required=True, help="JSONL file of {id, prompt, chat} (repeatable).")
@click.option("--max-tokens", type=int, default=128, show_default=True, help="Most tokens generated per prompt (plain and speculative alike).")
@click.option("--limit", type=int, default=None, help="Use only the first N prompts of each workload.")
@click.option("--warmup/--no-warmup", default=True, show_default=True, help="One untimed generation first.")
@run_options
@click.option("--json", "as_json", is_flag=True, help="Print results as JSON.")
def bench(artifact, workloads, max_tokens, limit, warmup, options, as_json):
    """Plain vs speculative on the same backend, prompt by prompt in alternation (greedy)."""
    from ..runtime.bench import print_report, run_bench

    check_artifact_backend(artifact, options.backend)
    report = run_bench(artifact, options, list(workloads), max_tokens, limit, warmup, progress_console=progress_bar_console(as_json))
    if as_json:
        emit_json(report)
    else:
        print_report(report)


@click.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--workload", "workloads", type=click.Path(path_type=Path), multiple=True, help="JSONL prompts [default: a few built-in prompts].")
@click.option("--max-tokens", type=int, default=64, show_default=True, help="Most tokens generated per prompt (plain and speculative alike).")
@click.option("--limit", type=int, default=None, help="Use only the first N prompts of each workload.")
@run_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: drafter, mode, identical, and per prompt the first differing token.")
def verify(artifact, workloads, max_tokens, limit, options, as_json):
    """Greedy speculative vs plain decoding, prompt by prompt; exit 1 on any divergence."""
    from ..runtime.bench import print_verify_report, run_verify

    check_artifact_backend(artifact, options.backend)
    report = run_verify(artifact, options, list(workloads), max_tokens, limit, progress_console=progress_bar_console(as_json))
    if as_json:
        emit_json(report)
    else:
        print_verify_report(report)
    if not report["identical"]:
        sys.exit(1)


COMMANDS = [run, bench, verify]
