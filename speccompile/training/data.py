"""The training data of a head: text read from files (`collect_texts`), tokenized into chunks, and the target's
features over them (hidden states and top-k next-token distributions), cached in `OUT/.cache/`."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import InputError
from .options import TrainOptions

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".jsonl", ".json", ".html", ".c", ".h", ".cpp", ".rs", ".go", ".js", ".ts", ".toml", ".yaml", ".yml", ".cfg", ".ini", ".sh"}
Progress = Callable[[str], None]


def collect_texts(paths: list[Path]) -> list[tuple[str, str]]:
    """(name, text) of every readable text file under the given files/dirs (sorted, deterministic)."""
    files: list[Path] = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES)
        elif p.is_file():
            files.append(p)
        elif p.exists():
            raise InputError(f"data {p}: not a text file or a folder of them (a device or a pipe?)", "data")
        else:
            raise InputError(f"data {p}: no such file or directory", "data")
    texts = []
    for f in files:
        try:
            raw = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if f.suffix.lower() == ".jsonl":
            for line in raw.splitlines():
                try:
                    item = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(item, dict) and isinstance(item.get("text"), str):
                    texts.append((f"{f}", item["text"]))
                elif isinstance(item, dict) and isinstance(item.get("prompt"), str):
                    texts.append((f"{f}", item["prompt"] + "\n" + str(item.get("response", ""))))
        elif raw.strip():
            texts.append((str(f), raw))
    if not texts:
        raise InputError(f"data: no readable text in {', '.join(str(p) for p in paths)}", "data")
    return texts


def tokenize_chunks(texts: list[tuple[str, str]], tokenizer, seq_len: int, max_tokens: int, bos: int | None) -> np.ndarray:
    """Concatenate tokenized documents (each starting with BOS when there is one) into [N, seq_len] rows."""
    stream: list[int] = []
    for _, text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        if bos is not None:
            stream.append(bos)
        stream.extend(ids)
        if len(stream) >= max_tokens:
            break
    stream = stream[:max_tokens]
    n = len(stream) // seq_len
    if n == 0:
        raise InputError(f"data: only {len(stream)} tokens, need at least seq_len = {seq_len}", "data")
    return np.asarray(stream[: n * seq_len], dtype=np.int64).reshape(n, seq_len)


def target_tokenizer(model):
    """The target's tokenizer (as the artifact would hold it)."""
    import tempfile

    from tokenizers import Tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        model.write_tokenizer(Path(tmp))
        return Tokenizer.from_file(str(Path(tmp) / "tokenizer.json"))


def compute_features(decoder, chunks: np.ndarray, label_k: int, progress: Progress, batch: int = 2) -> dict[str, np.ndarray]:
    """Run the target over every chunk: hidden features (fp16) and the top-k of its next-token distribution."""
    import torch

    from ..models.decoder import causal_mask

    n, t = chunks.shape
    hidden, top_idx, top_p = [], [], []
    started = time.time()
    with torch.no_grad():
        for start in range(0, n, batch):
            ids = torch.from_numpy(chunks[start: start + batch])
            b = ids.shape[0]
            out = decoder(ids, torch.arange(t).expand(b, t), causal_mask(t, 0, b), *decoder.empty_past(b))
            logits, feats = out[0], out[-1]
            probs = torch.softmax(logits.float(), dim=-1)
            p, i = probs.topk(label_k, dim=-1)
            hidden.append(feats.to(torch.float16).numpy())
            top_idx.append(i.to(torch.int32).numpy())
            top_p.append(p.to(torch.float16).numpy())
            done = min(start + batch, n)
            rate = done * t / max(time.time() - started, 1e-9)
            progress(f"target features {done}/{n} chunks ({rate:.0f} tok/s)")
    return {"tokens": chunks, "hidden": np.concatenate(hidden), "top_idx": np.concatenate(top_idx), "top_p": np.concatenate(top_p)}


def _cache_key(meta: dict) -> str:
    return hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:16]


def load_or_compute_features(model, chunks, options: TrainOptions, out: Path, progress: Progress) -> dict[str, np.ndarray]:
    """Target features of every chunk, cached in `out/.cache`; chunks an earlier run of the same target,
    taps and label_k already computed (e.g. before more data was added) are taken from its cache."""
    from safetensors.numpy import load_file, save_file

    from ..models.decoder import build_decoder

    mode = "eagle3" if options.method in ("eagle3", "dflash") else "final"  # dflash: the same taps
    kind = {"target": model.source_sha256, "mode": mode, "label_k": options.label_k}
    meta = {**kind, "chunks": hashlib.sha256(chunks.tobytes()).hexdigest(), "shape": list(chunks.shape)}
    cache = out / ".cache" / f"features-{_cache_key(meta)}.safetensors"
    if cache.is_file():
        progress(f"reusing cached target features {cache.name}")
        return load_file(str(cache))
    tag = json.dumps(kind, sort_keys=True)  # recorded in the cache file: which earlier runs can lend rows
    known = _features_from_earlier_runs(cache.parent, tag, chunks)
    todo = np.array([i for i in range(len(chunks)) if i not in known], dtype=np.int64)
    if known:
        progress(f"reusing target features of {len(known)}/{len(chunks)} chunks from earlier runs")
    fresh = {}
    if len(todo):
        decoder = build_decoder(model.config, model.weights, mode)
        fresh = compute_features(decoder, chunks[todo], options.label_k, progress)
    feats = {"tokens": chunks}
    for name in ("hidden", "top_idx", "top_p"):
        sample = fresh[name] if fresh else next(iter(known.values()))[name]
        rows = np.empty((len(chunks), *sample.shape[1:]), dtype=sample.dtype)
        if len(todo):
            rows[todo] = fresh[name]
        for i, row in known.items():
            rows[i] = row[name]
        feats[name] = rows
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(".tmp")
    save_file(feats, str(tmp), metadata={"speccompile_features": tag})
    tmp.replace(cache)
    return feats


def _features_from_earlier_runs(folder: Path, tag: str, chunks: np.ndarray) -> dict[int, dict[str, np.ndarray]]:
    """{chunk index: its feature rows} for chunks found in earlier caches with the same `tag` in `folder`."""
    from safetensors import safe_open

    wanted = {chunks[i].tobytes(): i for i in range(len(chunks))}
    found: dict[int, dict[str, np.ndarray]] = {}
    for path in sorted(folder.glob("features-*.safetensors")) if folder.is_dir() else []:
        with safe_open(str(path), framework="numpy") as f:
            if (f.metadata() or {}).get("speccompile_features") != tag:
                continue  # another target, taps or label_k (or a cache from before this was recorded)
            tokens = f.get_tensor("tokens")
            hits = [(r, i) for r, row in enumerate(tokens) if (i := wanted.get(row.tobytes())) is not None and i not in found]
            if not hits:
                continue
            arrays = {name: f.get_tensor(name) for name in ("hidden", "top_idx", "top_p")}
            for r, i in hits:
                found[i] = {name: a[r] for name, a in arrays.items()}
    return found
