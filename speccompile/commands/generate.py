"""`speccompile run | bench | verify`: the runtime's command-line front ends."""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from pathlib import Path
from typing import Callable

import click

from ..console import emit_json, progress_bar_console, prompt_progress_bar
from ..errors import InputError
from ..runtime.backends.base import BACKENDS
from ..runtime.constraints import ConstraintSpec
from ..runtime.options import DRAFTER_CHOICES, GenerationConfig, RunOptions
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
    text = _read_text(prompt_file, label)
    if not text.strip():
        raise InputError(f"{label}: the prompt is empty")
    return text


def check_artifact_backend(artifact: Path, backend: str, drafter: str = "none", fused: bool = True) -> None:
    """Refuse an artifact whose target the backend cannot run (runtime/artifact.check_backend, before anything
    loads); say so when it runs but far slower than meant to (`drafter`, `fused`: the run's --drafter and not
    --contract-graph)."""
    from ..manifest import read_manifest
    from ..runtime.artifact import check_backend, tree_form_note

    manifest = read_manifest(artifact, verify_files=False)  # the runner checks the checksums
    check_backend(artifact, manifest, backend)
    scheme = manifest.precision.get("target", {}).get("scheme")
    target = manifest.graphs["target"].file
    packed = any(spec.extra.get("variant_of") == target and spec.extra.get("cpu_kernels") for spec in manifest.graphs.values())
    if backend == "ort-cpu" and scheme in SLOW_ON_CPU and not packed:  # INT4 builds run packed (engines/cpu_graph.py)
        click.echo(f"warning: {artifact}: {SLOW_ON_CPU[scheme]} target, built for GPUs and TensorRT; on ONNX Runtime's CPU "
                   "provider it runs as fp32 without the fused CPU graph (speculative steps ~2-3x slower than the fp32 export)",
                   err=True)
    note = tree_form_note(manifest, backend, drafter, fused)
    if note is not None:
        click.echo(f"note: {artifact}: {note}", err=True)


SLOW_ON_CPU = {"fp8": "FP8", "int4": "INT4"}


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


def suffix_options(func):
    """The suffix drafter's --suffix-* options (runtime/drafters/suffix.py)."""
    func = click.option("--suffix-share-tenants", is_flag=True,
                        help="Suffix drafter: requests draft from every client's earlier responses (default: only from "
                             "those of the same `user`).")(func)
    func = click.option("--suffix-tree/--suffix-chain", default=True, show_default=True,
                        help="Suffix drafter: draft frequency-scored trees, or chains (the most frequent path).")(func)
    func = click.option("--suffix-spec-factor", type=float, default=1.0, show_default=True,
                        help="Suffix drafter: at most this many draft tokens per matched context token.")(func)
    func = click.option("--suffix-min-prob", type=float, default=0.1, show_default=True,
                        help="Suffix drafter: draft no token whose estimated probability is below this.")(func)
    func = click.option("--suffix-max-depth", type=int, default=24, show_default=True,
                        help="Suffix drafter: longest context matched (suffix tree depth).")(func)
    func = click.option("--suffix-cache-requests", type=int, default=10000, show_default=True,
                        help="Suffix drafter: earlier responses kept to draft from (oldest evicted first; 0: only the "
                             "request's own prompt and output).")(func)
    return func


def drafter_options(func):
    """--drafter, --tree, --lookup-branch, --ngram-corpus, --num-draft-tokens, --adaptive/--no-adaptive, --suffix-*."""
    func = suffix_options(func)
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
    func = click.option("--num-draft-tokens", "-k", type=int, default=None, help="num_draft_tokens: most draft positions per step (chain tokens, or tree depth; n-gram alone: twice that in the step after a chain that long was accepted whole) [default: the artifact's, else per drafter].")(func)
    func = click.option(
        "--drafter",
        type=click.Choice(DRAFTER_CHOICES),
        default="auto",
        show_default=True,
        help="auto = the drafter exported with the artifact, else n-gram lookup; suffix = suffix decoding over the "
             "prompt, the output and earlier responses; none = plain decoding.",
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


def constraint_options(func):
    """--json-schema, --regex, --grammar and --choice: the output must match one of them."""
    func = click.option("--choice", "choices", multiple=True, help="The output is exactly one of these strings (repeatable).")(func)
    func = click.option("--grammar", "grammar_file", type=click.Path(path_type=Path), default=None,
                        help="The output follows this EBNF grammar file (GBNF syntax; its rule `root`).")(func)
    func = click.option("--regex", default=None, help="The output matches this regular expression.")(func)
    func = click.option("--json-schema", "json_schema_file", type=click.Path(path_type=Path), default=None,
                        help="The output is JSON valid against this JSON schema file.")(func)
    return func


def _read_text(path: Path, label: str) -> str:
    """A UTF-8 text file (- : standard input), or a one-line InputError starting with `label`."""
    try:
        return sys.stdin.read() if str(path) == "-" else path.read_text(encoding="utf-8")
    except IsADirectoryError:
        raise InputError(f"{label}: is a directory, expected a text file") from None
    except FileNotFoundError:
        raise InputError(f"{label}: no such file") from None
    except UnicodeDecodeError:
        raise InputError(f"{label}: not UTF-8 text") from None
    except OSError as exc:
        raise InputError(f"{label}: cannot read ({exc.strerror})") from None


def constraint_from_flags(json_schema_file: Path | None, regex: str | None, grammar_file: Path | None,
                          choices: tuple[str, ...]) -> tuple[ConstraintSpec | None, str]:
    """The ConstraintSpec the flags ask for (at most one of them) and the flag, for error messages."""
    given = [(flag, value) for flag, value in (("--json-schema", json_schema_file), ("--regex", regex),
                                               ("--grammar", grammar_file), ("--choice", choices or None)) if value is not None]
    if len(given) > 1:
        raise InputError(f"give at most one of --json-schema, --regex, --grammar, --choice (got {', '.join(f for f, _ in given)})")
    if not given:
        return None, ""
    flag, value = given[0]
    label = flag if flag in ("--regex", "--choice") else f"{flag} {value}"
    try:
        if flag == "--json-schema":
            return ConstraintSpec("json_schema", _read_text(value, label)).validate(), label
        if flag == "--grammar":
            return ConstraintSpec("grammar", _read_text(value, label)).validate(), label
        if flag == "--regex":
            return ConstraintSpec("regex", value).validate(), label
        return ConstraintSpec("choice", tuple(value)).validate(), label
    except InputError as exc:
        raise InputError(exc.naming(dict.fromkeys(exc.fields, label))) from None


def compile_for_run(artifact: Path, spec: ConstraintSpec | None, label: str):
    """The spec compiled against the artifact's tokenizer, before the model loads (a bad one: one line, exit 2)."""
    if spec is None:
        return None
    from ..runtime.grammar import compiler_for

    try:
        return compiler_for(artifact).compile(spec)
    except InputError as exc:
        raise InputError(exc.naming(dict.fromkeys(exc.fields, label))) from None


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
@constraint_options
@run_options
@click.option("--stream", is_flag=True, help="Print text as it is generated (with --json: one JSON line per text delta, then the result).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with text, tokens, finish reason and stats.")
def run(artifact, prompt, prompt_file, chat, max_tokens, temperature, top_k, top_p, seed, stop, json_schema_file, regex,
        grammar_file, choices, options, stream, as_json):
    """Generate from ARTIFACT with exact speculative decoding (output identical to the target alone)."""
    from ..runtime.bench import prompt_source
    from ..runtime.session import Runner
    from ..runtime.stats import process_memory_mb

    text = _read_prompt(prompt, prompt_file)
    sampling = SamplingParams(temperature, top_k, top_p, seed)
    GenerationConfig(max_tokens=max_tokens, sampling=sampling, stop=list(stop)).validate()  # before anything loads
    spec, label = constraint_from_flags(json_schema_file, regex, grammar_file, choices)
    check_artifact_backend(artifact, options.backend, options.drafter, not options.contract_graph)
    constraint = compile_for_run(artifact, spec, label)
    runner = Runner(artifact, options)
    with prompt_source(_prompt_label(prompt_file)):
        result = runner.generate(text, chat, max_tokens, sampling, list(stop), _stream_printer(as_json) if stream else None,
                                 constraint=constraint)
    if as_json:
        final = {"text": result.text, "tokens": result.tokens, "finish_reason": result.finish_reason, "drafter": runner.drafter_name,
                 "stats": result.stats.to_dict(), "memory": process_memory_mb()}
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
        f"overhead {100 * s.overhead_fraction:.1f}%, finish={result.finish_reason}{_memory_note(process_memory_mb())}",
        err=True,
    )


def _memory_note(memory: dict[str, float]) -> str:
    return f", resident {memory['resident_mb'] / 1024:.2f} GiB (peak {memory['peak_mb'] / 1024:.2f})" if memory else ""


@click.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--workload", "workloads", type=click.Path(path_type=Path), multiple=True, required=True, help="JSONL file of {id, prompt, chat} (repeatable).")
@click.option("--max-tokens", type=int, default=128, show_default=True, help="Most tokens generated per prompt (plain and speculative alike).")
@click.option("--limit", type=int, default=None, help="Use only the first N prompts of each workload.")
@click.option("--warmup/--no-warmup", default=True, show_default=True, help="One untimed generation first.")
@click.option("--chat/--raw", default=None, help="Apply the chat template to every prompt, or feed every prompt raw (a model without a chat template) [default: each workload line's \"chat\"].")
@click.option("--replay", is_flag=True,
              help="Suffix drafter: keep its store of earlier responses across the prompts, in workload order (agent "
                   "sessions replayed as a server sees them) [default: every prompt starts with an empty store].")
@run_options
@click.option("--json", "as_json", is_flag=True, help="Print results as JSON.")
def bench(artifact, workloads, max_tokens, limit, warmup, chat, replay, options, as_json):
    """Plain vs speculative on the same backend, prompt by prompt in alternation (greedy)."""
    from ..runtime.bench import run_bench
    from .reports import print_bench_report

    check_artifact_backend(artifact, options.backend, options.drafter, not options.contract_graph)
    with prompt_progress_bar(progress_bar_console(as_json)) as progress:
        report = run_bench(artifact, options, list(workloads), max_tokens, limit, warmup, progress, chat, replay)
    if as_json:
        emit_json(report)
    else:
        print_bench_report(report)


@click.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--workload", "workloads", type=click.Path(path_type=Path), multiple=True, help="JSONL prompts [default: a few built-in prompts].")
@click.option("--max-tokens", type=int, default=64, show_default=True, help="Most tokens generated per prompt (plain and speculative alike).")
@click.option("--limit", type=int, default=None, help="Use only the first N prompts of each workload.")
@click.option("--chat/--raw", default=None, help="Apply the chat template to every prompt, or feed every prompt raw (a model without a chat template) [default: each workload line's \"chat\"].")
@run_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: drafter, mode, identical, and per prompt the first differing token.")
def verify(artifact, workloads, max_tokens, limit, chat, options, as_json):
    """Greedy speculative vs plain decoding, prompt by prompt; exit 1 on any divergence."""
    from ..runtime.bench import run_verify
    from .reports import print_verify_report

    check_artifact_backend(artifact, options.backend, options.drafter, not options.contract_graph)
    with prompt_progress_bar(progress_bar_console(as_json)) as progress:
        report = run_verify(artifact, options, list(workloads), max_tokens, limit, progress, chat)
    if as_json:
        emit_json(report)
    else:
        print_verify_report(report)
    if not report["identical"]:
        sys.exit(1)


COMMANDS = [run, bench, verify]
