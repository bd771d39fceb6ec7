"""Quality of a quantized artifact against its fp32 reference: `speccompile eval`.

On a held-out text set (paragraphs of a plain-text file), both targets score every paragraph in one
teacher-forced pass: top-1 agreement per position, KL(reference || quantized) and the perplexity of each. The
artifact is scored on the graph `run` uses on ort-cpu (its packed or fused CPU graph, opened whole as `run` opens
it; the contract graph with `contract_graph` or where it has none); the reference's contract graph, and a scored
contract graph, run one segment at a time (engines/segments.py, with the session settings the runtime gives each
graph on ort-cpu), paragraphs in chunks whose logits fit `LOGITS_BYTES`, so that model is never whole in memory.
On JSONL workloads both generate greedily with the n-gram drafter at a fixed draft length (adaptive
drafting off: its choices follow each graph's measured pass times, which differ between an fp32 graph and a
Q/DQ graph on the CPU, so they would blur what is measured here, how well the quantized model keeps
accepting drafts): tokens per target pass and how many outputs are identical; generation opens both artifacts through
the runtime (whole). FP8 and INT4 graphs run on ONNX Runtime CPU as built; an NVFP4 graph runs as its exact fp32
emulation (engines/emulate.py) written, one weight at a time, to a temporary directory.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, NamedTuple

import numpy as np

from .engines.calibrate import prefill_feeds, read_text_input
from .engines.quality import LogitComparison
from .engines.segments import SEGMENT_PARAMETERS, SegmentRunner
from .errors import InputError, check_at_least
from .manifest import read_manifest
from .tokenizer import TextTokenizer
from .weights_file import load_graph

if TYPE_CHECKING:
    from .runtime.session import Runner

Progress = Callable[[str], None]
DEFAULT_TEXT = Path(__file__).resolve().parent.parent / "benchmarks" / "eval" / "heldout.txt"
LOGITS_BYTES = 256 << 20  # reference logits held at a time (a chunk of paragraphs)


@dataclass
class EvalOptions:
    text: Path | None = None  # default: benchmarks/eval/heldout.txt of a source checkout
    workloads: list[Path] = field(default_factory=list)
    limit: int = 4  # prompts per workload
    max_tokens: int = 64  # generated per prompt
    max_text_tokens: int = 256  # longest scored paragraph
    threads: int | None = None
    contract_graph: bool = False  # score the artifact's contract graph, not the CPU graph `run` uses
    segment_parameters: int = SEGMENT_PARAMETERS  # weights per segment of each graph (engines/segments.py)

    def validate(self) -> "EvalOptions":
        for name, least in (("limit", 1), ("max_tokens", 1), ("max_text_tokens", 2)):
            check_at_least(name, getattr(self, name), least)
        return self


def scored_sequences(tokenizer: TextTokenizer, paragraphs: list[str], max_tokens: int) -> list[list[int]]:
    """Each paragraph's ids as `run --raw` feeds a prompt: with the special tokens the tokenizer adds (Gemma's BOS,
    without which the model is far off what it was trained on and the comparison measures noise), cut to
    `max_tokens`; paragraphs of fewer than two tokens left out."""
    sequences = (tokenizer.prompt_ids(p, chat=False)[:max_tokens] for p in paragraphs)
    return [ids for ids in sequences if len(ids) >= 2]


def load_text_set(path: Path | None) -> tuple[Path, list[str]]:
    """Paragraphs (blank-line separated) of the text file; the bundled held-out set when `path` is None."""
    if path is None:
        if not DEFAULT_TEXT.is_file():
            raise InputError("text: no default held-out text here (it ships with the source checkout); give a text file", "text")
        path = DEFAULT_TEXT
    path = Path(path)
    try:
        content = read_text_input(path, "text")
    except InputError as exc:
        raise InputError(str(exc), "text") from None
    paragraphs = [p.strip("\n") for p in content.split("\n\n") if p.strip()]
    if not paragraphs:
        raise InputError(f"text {path}: the file has no text", "text")
    return path, paragraphs


def target_size_mb(directory: Path) -> float:
    """Size of the target graph and its weights file."""
    spec = read_manifest(directory, verify_files=False).graph("target")
    files = [Path(directory) / spec.file, Path(directory) / (spec.file + ".data")]
    return sum(f.stat().st_size for f in files if f.is_file()) / 1e6


def teacher_forced_logits(session, ids: list[int]) -> np.ndarray:
    """Logits of every position of `ids` from one prefill pass on a fresh cache (a whole target session)."""
    cache = session.new_cache()
    q = len(ids)
    mask = cache.attention_mask(np.tril(np.ones((q, q), dtype=bool)))
    return session.run(np.asarray(ids, np.int64), np.arange(q, dtype=np.int64), mask, cache).logits.reshape(q, -1)


class TargetLogits:
    """Teacher-forced logits of token sequences from an artifact's target graph: one prefill pass per sequence on an
    empty cache, the graph run one segment at a time with the runtime's ort-cpu settings for it."""

    def __init__(self, directory: Path, threads: int | None, parameters: int):
        from .runtime.backends.ort_quantized import quantized_session_config

        manifest = read_manifest(directory, verify_files=True)
        self.spec = manifest.graph("target")
        self.vocab = int(self.spec.outputs[0].shape[-1]) if self.spec.outputs and isinstance(self.spec.outputs[0].shape[-1], int) else 0
        model = load_graph(Path(directory) / self.spec.file)
        self.runner = SegmentRunner(directory, model, threads, session_config=quantized_session_config(self.spec, "ort-cpu"))
        self.parameters = parameters

    def __call__(self, sequences: list[list[int]]) -> list[np.ndarray]:
        out: list[np.ndarray] = [np.zeros(0)] * len(sequences)

        def keep(index: int, _name: str, value: np.ndarray) -> None:
            out[index] = value.reshape(len(sequences[index]), -1)

        self.runner.run([prefill_feeds(self.spec, ids) for ids in sequences], ["logits"], keep, self.parameters)
        return out


class RunGraphLogits:
    """Teacher-forced logits from the graph `run` uses on ort-cpu (the fused or packed CPU graph), opened whole
    as `run` opens it."""

    def __init__(self, directory: Path, threads: int | None):
        from .runtime.artifact import open_artifact

        self.session = open_artifact(directory, "ort-cpu", threads, fused=True, drafter="none").target

    def __call__(self, sequences: list[list[int]]) -> list[np.ndarray]:
        return [teacher_forced_logits(self.session, ids) for ids in sequences]


class ScoredGraph(NamedTuple):
    file: str
    what: str
    contract: bool  # the contract graph (run one segment at a time), not a CPU graph


def scored_graph(directory: Path, contract_graph: bool) -> ScoredGraph:
    """The target graph `eval` scores in `directory`: the one `run` uses on ort-cpu, or the contract graph where
    `contract_graph` asks for it."""
    from .runtime.artifact import runnable_spec

    manifest = read_manifest(directory, verify_files=False)
    contract = manifest.graph("target").file
    spec = runnable_spec(manifest, "target", "ort-cpu", fused=not contract_graph)
    if spec.file != contract:
        return ScoredGraph(spec.file, "the CPU graph `run` uses on ort-cpu", False)
    if contract_graph:
        return ScoredGraph(contract, "the contract graph (--contract-graph)", True)
    return ScoredGraph(contract, "the contract graph (what `run` uses: there is no CPU graph)", True)


def chunks(sequences: list[list[int]], vocab: int, limit: int = LOGITS_BYTES) -> list[list[list[int]]]:
    """Consecutive groups of sequences whose float32 logits take at most `limit` bytes (at least one sequence each)."""
    groups: list[list[list[int]]] = [[]]
    held = 0
    for ids in sequences:
        size = len(ids) * max(vocab, 1) * 4
        if groups[-1] and held + size > limit:
            groups.append([])
            held = 0
        groups[-1].append(ids)
        held += size
    return [g for g in groups if g]


def compare_targets(reference: Path, artifact: Path, sequences: list[list[int]], options: EvalOptions,
                    progress: Progress) -> LogitComparison:
    """LogitComparison of the two targets' teacher-forced logits on every sequence, chunk after chunk (the
    artifact's: of the graph `scored_graph` names)."""
    ref = TargetLogits(reference, options.threads, options.segment_parameters)
    got: TargetLogits | RunGraphLogits
    if scored_graph(artifact, options.contract_graph).contract:
        got = TargetLogits(artifact, options.threads, options.segment_parameters)
    else:
        got = RunGraphLogits(artifact, options.threads)
    comparison = LogitComparison()
    groups = chunks(sequences, ref.vocab)
    for number, group in enumerate(groups, 1):
        if len(groups) > 1:
            progress(f"  chunk {number}/{len(groups)}: {len(group)} paragraphs")
        for ids, ref_logits, logits in zip(group, ref(group), got(group)):
            comparison.add(ref_logits, logits, np.asarray(ids))
    return comparison


def _scheme(directory: Path) -> str:
    manifest = read_manifest(directory, verify_files=False)
    return str(manifest.graph("target").extra.get("quantization") or "none")


def evaluate(artifact: Path, reference: Path, options: EvalOptions, progress: Progress = lambda _: None) -> dict:
    """The quality report of `artifact` against `reference` (both artifact directories) as a dict."""
    from .engines.emulate import write_emulated_artifact
    from .runtime.bench import load_workload
    from .runtime.session import Runner

    options.validate()
    artifact, reference = Path(artifact), Path(reference)
    text_path, paragraphs = load_text_set(options.text)
    workloads = [(w, load_workload(Path(w), options.limit)) for w in options.workloads]
    scheme = _scheme(artifact)
    tokenizer = TextTokenizer(reference, read_manifest(reference, verify_files=False).tokenizer.get("eos_token_ids"))
    sequences = scored_sequences(tokenizer, paragraphs, options.max_text_tokens)
    if not sequences:
        raise InputError(f"text {text_path}: no paragraph has two or more tokens", "text")
    with tempfile.TemporaryDirectory(prefix="speccompile-eval-") as tmp:
        runnable = artifact
        if scheme == "nvfp4":
            progress("NVFP4: writing the exact fp32 emulation (folded FP4 weights, fake-quantized activations)")
            runnable = write_emulated_artifact(artifact, Path(tmp) / "emulated")
        progress(f"scoring {len(sequences)} paragraphs ({sum(map(len, sequences))} tokens) with both models, "
                 "one segment of each graph at a time")
        graph = scored_graph(runnable, options.contract_graph)
        comparison = compare_targets(reference, runnable, sequences, options, progress)
        ngram = []
        if workloads:
            progress(f"opening {reference} and {artifact}")
            ref_runner = Runner(reference, threads=options.threads, drafter="ngram", adaptive=False)
            runner = Runner(runnable, threads=options.threads, drafter="ngram", adaptive=False,
                            contract_graph=options.contract_graph)
        for path, prompts in workloads:
            progress(f"n-gram generation on {Path(path).name} ({len(prompts)} prompts x {options.max_tokens} tokens, both models)")
            ngram.append({"workload": str(path), **compare_generation(ref_runner, runner, prompts, options.max_tokens)})
    return {
        "artifact": str(artifact),
        "reference": str(reference),
        "scheme": scheme,
        "emulated": scheme == "nvfp4",
        "graphs": {"artifact": {"file": graph.file, "what": graph.what},
                   "reference": {"file": read_manifest(reference, verify_files=False).graph("target").file,
                                 "what": "the contract graph"}},
        "size_mb": {"artifact": round(target_size_mb(artifact), 1), "reference": round(target_size_mb(reference), 1)},
        "text": {"file": str(text_path), "sequences": len(sequences), "positions": comparison.positions},
        "top1_agreement": round(comparison.top1_agreement, 4),
        "top1_interval_95": [round(bound, 4) for bound in comparison.top1_interval()],
        "kl_divergence": round(comparison.kl_divergence, 5),
        "kl_divergence_max": round(comparison.kl_max, 4),
        "perplexity": {"artifact": round(comparison.perplexity("quantized"), 3),
                       "reference": round(comparison.perplexity("reference"), 3)},
        "ngram": ngram,
    }


def compare_logits(ref_runner: "Runner", runner: "Runner", sequences: list[list[int]]) -> LogitComparison:
    """Both targets' teacher-forced logits over every sequence, compared position by position."""
    comparison = LogitComparison()
    for ids in sequences:
        ref_logits = teacher_forced_logits(ref_runner.artifact.target, ids)
        logits = teacher_forced_logits(runner.artifact.target, ids)
        comparison.add(ref_logits, logits, np.asarray(ids))
    return comparison


def compare_generation(ref_runner: "Runner", runner: "Runner", prompts: list[dict], max_tokens: int) -> dict:
    """Greedy n-gram generation of every prompt with both runners: tokens per target pass and identical outputs."""
    passes = {"reference": [0, 0], "artifact": [0, 0]}
    identical = 0
    for prompt in prompts:
        ids = ref_runner.artifact.tokenizer.prompt_ids(prompt["prompt"], prompt["chat"])
        outputs = {}
        for name, r in (("reference", ref_runner), ("artifact", runner)):
            result = r.generate_ids(ids, max_tokens)
            passes[name][0] += result.stats.generated_tokens
            passes[name][1] += result.stats.target_passes
            outputs[name] = list(result.tokens)
        identical += int(outputs["reference"] == outputs["artifact"])
    return {
        "prompts": len(prompts),
        "max_tokens": max_tokens,
        "num_draft_tokens": runner.num_draft_tokens,  # every step drafts this many (adaptive off)
        "tokens_per_pass": {k: round(t / p, 3) if p else 0.0 for k, (t, p) in passes.items()},
        "identical_greedy": identical,
    }
