"""Activation calibration: run the unquantized graph in ONNX Runtime CPU and record each MatMul input's amax and rows.

The graph runs one segment at a time (engines/segments.py), every calibration sample through a segment before the
next one is loaded, so memory holds one segment's weights and the samples' activations at the segment boundary.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from ..errors import InputError
from ..manifest import GraphSpec
from ..weights_file import load_graph
from .segments import SEGMENT_PARAMETERS, SegmentRunner, cpu_session

BUILTIN_CALIBRATION = [
    {"prompt": "Write a short story about a lighthouse keeper who finds a message in a bottle.", "chat": True},
    {"prompt": "Explain how photosynthesis works to a ten year old.", "chat": True},
    {"prompt": "Rename the variable `x` to `total` in this function and return it:\n\ndef f(x):\n    x = x + 1\n    return x * x\n", "chat": True},
    {"prompt": "List five tips for writing clear documentation.", "chat": True},
    {"prompt": "The history of the printing press begins in the fifteenth century, when", "chat": False},
    {"prompt": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", "chat": False},
    {"prompt": "Translate to French: The weather is lovely today and we are going to the beach.", "chat": True},
    {"prompt": "What are the main differences between a list and a tuple in Python?", "chat": True},
]


def read_text_input(path: Path, flag: str) -> str:
    """The text of a user-given file; a one-line InputError naming `flag` when it is missing or unreadable."""
    if not path.is_file():
        raise InputError(f"{flag} {path}: no such file")
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{flag} {path}: cannot read ({exc})") from None


def load_calibration_texts(path: Path | None) -> list[dict]:
    """Calibration prompts: JSONL ({"prompt"|"text", "chat"?}) or plain text (paragraphs); built-in set when None."""
    if path is None:
        return list(BUILTIN_CALIBRATION)
    path = Path(path)
    content = read_text_input(path, "--calib")
    items: list[dict] = []
    if path.suffix in (".jsonl", ".json"):
        for number, line in enumerate(content.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                text = obj.get("prompt", obj.get("text")) if isinstance(obj, dict) else None
            except json.JSONDecodeError:
                text = None
            if not isinstance(text, str):
                raise InputError(f"--calib {path}: line {number} is not a JSON object with a 'prompt' or 'text'")
            if text.strip():
                items.append({"prompt": text, "chat": bool(obj.get("chat", False))})
    else:
        items = [{"prompt": p.strip(), "chat": False} for p in content.split("\n\n") if p.strip()]
    if not items:
        raise InputError(f"--calib {path}: the file has no calibration text")
    return items


def tokenize_calibration(texts: list[dict], tokenizer, max_samples: int, max_tokens: int) -> list[list[int]]:
    samples = []
    for item in texts[:max_samples]:
        chat = bool(item.get("chat", False)) and getattr(tokenizer, "chat_template", None) is not None
        try:
            ids = tokenizer.prompt_ids(item["prompt"], chat)
        except Exception:  # noqa: BLE001 - a template problem: fall back to raw text
            ids = tokenizer.encode(item["prompt"])
        if ids:
            samples.append(list(ids)[:max_tokens])
    if not samples:
        raise InputError("calibration: no text produced any tokens")
    return samples


def prefill_feeds(spec: GraphSpec, ids: Sequence[int] | np.ndarray) -> dict[str, np.ndarray]:
    """Inputs of one full-prompt pass of a contract graph on an empty KV cache (`ids` [T], or [B, T] rows)."""
    ids = np.atleast_2d(np.asarray(ids, dtype=np.int64))
    b, q = ids.shape
    feeds = {
        "input_ids": ids,
        "position_ids": np.tile(np.arange(q, dtype=np.int64), (b, 1)),
        "attention_mask": np.tile(np.tril(np.ones((q, q), dtype=bool)), (b, 1, 1)),
    }
    for t in spec.inputs:
        if t.name.startswith("past_key_values"):
            dtype = np.float16 if t.dtype == "float16" else np.float32
            feeds[t.name] = np.zeros((b, int(t.shape[1]), 0, int(t.shape[3])), dtype=dtype)
        elif t.name.startswith("past_state."):  # hybrid linear attention: the states before the first token
            feeds[t.name] = np.zeros((b, *(1 if isinstance(d, str) else int(d) for d in t.shape[1:])),  # (one zero pending row)
                                     dtype=np.float16 if t.dtype == "float16" else np.float32)
    return feeds


@dataclass
class ActivationStats:
    """What calibration saw of one activation tensor: its amax and a subset of its rows (tokens)."""

    channel_amax: np.ndarray  # [channels] max |x| over every calibration token
    rows: np.ndarray  # [tokens kept, channels] float32 (empty when rows were not asked for)

    @property
    def amax(self) -> float:
        return float(self.channel_amax.max()) if self.channel_amax.size else 0.0



class ActivationRecorder:
    """Accumulates `ActivationStats` of tensors from their values, sample after sample: the per-channel amax over
    every token and every `stride`-th row of each sample (rows kept in sample order), at most `max_rows`."""

    def __init__(self, tensors: Sequence[str], total_tokens: int, max_rows: int = 0):
        self.max_rows = max_rows
        self.stride = max(1, -(-total_tokens // max_rows)) if max_rows else 0
        self.amax: dict[str, np.ndarray | None] = {name: None for name in tensors}
        self.kept: dict[str, list[np.ndarray]] = {name: [] for name in tensors}

    def add(self, name: str, value: np.ndarray) -> None:
        value = np.asarray(value, dtype=np.float32).reshape(-1, np.shape(value)[-1])
        magnitude = np.where(np.isfinite(value), np.abs(value), 0.0).max(axis=0, initial=0.0)  # an expert may get no rows
        self.amax[name] = magnitude if self.amax[name] is None else np.maximum(self.amax[name], magnitude)
        if self.stride:
            self.kept[name].append(value[::self.stride])

    def pop(self, name: str) -> ActivationStats:
        """The stats of `name` (no more values of it will come); forgotten here."""
        kept = self.kept.pop(name)
        rows = np.concatenate(kept)[: self.max_rows] if kept else np.zeros((0, 0), np.float32)
        return ActivationStats(self.amax.pop(name), rows)


def calibration_steps(directory: Path, spec: GraphSpec, tensors: Sequence[str], samples: Sequence[Sequence[int]],
                      threads: int | None = None, workdir: Path | None = None, max_rows: int = 0,
                      parameters: int = SEGMENT_PARAMETERS) -> Iterator[dict[str, ActivationStats]]:
    """Full-prompt (prefill) passes of every sample through the unquantized graph, one segment of it at a time
    (engines/segments.py: memory holds one segment's weights); after each segment, the stats of the tensors it
    completed: their amax and up to `max_rows` rows (evenly spaced tokens over all samples) for the methods that
    search on activations. The values are the whole graph's, bit for bit (float32 graphs).

    `workdir` (default: the system temp dir) holds the segment graphs and hard links to the weight files."""
    if not tensors:
        return
    directory = Path(directory)
    model = load_graph(directory / spec.file)
    recorder = ActivationRecorder(tensors, sum(len(ids) for ids in samples), max_rows)
    runner = SegmentRunner(directory, model, threads, workdir)
    feeds = [prefill_feeds(spec, ids) for ids in samples]
    for completed in runner.steps(feeds, list(tensors), lambda _sample, name, value: recorder.add(name, value), parameters):
        yield {name: recorder.pop(name) for name in completed}


def calibrate_activations(directory: Path, spec: GraphSpec, tensors: Sequence[str], samples: Sequence[Sequence[int]],
                          threads: int | None = None, workdir: Path | None = None, max_rows: int = 0,
                          parameters: int = SEGMENT_PARAMETERS) -> dict[str, ActivationStats]:
    """`calibration_steps` gathered: the stats of every tensor."""
    stats: dict[str, ActivationStats] = {}
    for step in calibration_steps(directory, spec, tensors, samples, threads, workdir, max_rows, parameters):
        stats.update(step)
    return stats


def sample_continuations(directory: Path, spec: GraphSpec, prompts: Sequence[Sequence[int]], per_prompt: int, new_tokens: int,
                         seed: int = 0, threads: int | None = None, avoid: Sequence[int] = (), top_k: int = 64) -> list[list[int]]:
    """`per_prompt` continuations of each prompt, `new_tokens` long, sampled from the graph's own next-token
    distribution (temperature 1 over its top `top_k` tokens, never an id in `avoid`, e.g. end of sequence):
    text the model itself would write, for distilling it (LLM-QAT's data-free distillation). Returns prompt +
    continuation token lists."""
    session = cpu_session(str(Path(directory) / spec.file), threads)
    past = [t.name for t in spec.inputs if t.name.startswith("past_key_values")]
    present = [name.replace("past_key_values", "present", 1) for name in past]
    rng = np.random.default_rng(seed)
    rows: list[list[int]] = []
    for ids in prompts:
        ids = list(ids)
        feeds = prefill_feeds(spec, np.tile(np.asarray(ids, np.int64), (per_prompt, 1)))
        tokens = np.zeros((per_prompt, 0), np.int64)
        for step in range(new_tokens):
            logits, *cache = session.run(["logits", *present], feeds)
            nxt = _sample_top_k(logits[:, -1].astype(np.float64), top_k, avoid, rng)
            tokens = np.concatenate([tokens, nxt[:, None]], axis=1)
            total = len(ids) + step + 1
            feeds = {"input_ids": nxt[:, None], "position_ids": np.full((per_prompt, 1), total - 1, np.int64),
                     "attention_mask": np.ones((per_prompt, 1, total), bool), **dict(zip(past, cache))}
        rows += [ids + row.tolist() for row in tokens]
    return rows


def _sample_top_k(logits: np.ndarray, k: int, avoid: Sequence[int], rng: np.random.Generator) -> np.ndarray:
    """One token per row from softmax(logits) restricted to its top k (ids in `avoid` excluded)."""
    logits = logits.copy()
    logits[:, list(avoid)] = -np.inf
    top = np.argpartition(-logits, k - 1, axis=-1)[:, :k]
    chosen = np.take_along_axis(logits, top, axis=-1)
    p = np.exp(chosen - chosen.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.array([top[r, rng.choice(k, p=p[r])] for r in range(len(p))], dtype=np.int64)
