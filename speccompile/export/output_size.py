"""How much an export writes, estimated from the weight shapes before anything is written, and the refusal
when the output's file system has less room than that."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from ..errors import InputError
from ..models.load import LoadedModel
from .recipes import expected_shapes, np_dtype

ALIGNMENT = 1 << 16  # WeightsWriter's alignment of large tensors: at most this much padding per tensor
MARGIN = 64 << 20  # graphs, manifest, tokenizer and what the estimate does not see


def estimate_export_bytes(model: LoadedModel, dtype: str, kv_rows: int, fused_cpu: bool, gpu_graph: bool,
                          drafter_bytes: int = 0) -> int:
    """Bytes the target's graphs take in `dtype` (the contract graph's weights; the fused graphs add only their
    rotary tables of `kv_rows` rows) plus `drafter_bytes` and a margin."""
    itemsize = np_dtype(dtype).itemsize
    shapes = expected_shapes(model.config)
    total = sum(int(np.prod(s, dtype=np.int64)) * itemsize + ALIGNMENT for s in shapes.values())
    rotary = 2 * (kv_rows + 1) * (model.config.head_dim // 2)
    if fused_cpu and dtype == "fp32":
        total += rotary * 4
    if gpu_graph and dtype != "fp32":
        total += rotary * itemsize
    return total + drafter_bytes + MARGIN


def drafter_estimate(model: LoadedModel, dtype: str, kind: str | None, path: str | None) -> int:
    """Bytes a drafter adds: a draft model's weights in `dtype`; a head's checkpoint in float32 plus the target
    tables (embedding, lm_head) that EAGLE/MTP head graphs carry, twice (its ONNX Runtime CPU variant)."""
    if kind is None or path is None:
        return 0
    source = Path(path)
    files = (sorted(source.glob("*.safetensors")) or sorted(f for f in source.glob("*") if f.suffix in (".bin", ".pt", ".pth"))
             if source.is_dir() else [source])  # a head's safetensors, else its pickled weights (pytorch_model.bin)
    stored = sum(f.stat().st_size for f in files if f.is_file())
    itemsize = np_dtype(dtype).itemsize
    if kind == "draft-model":
        return stored * max(1, itemsize // 2) + MARGIN
    tables = 2 * model.config.vocab_size * model.config.hidden_size * itemsize
    return 2 * (2 * stored + tables)


def check_disk_space(folder: Path, needed: int, out: Path, command: str = "export") -> None:
    """InputError about `out` (the output `command` writes in `folder`) when the file system of `folder` has fewer
    than `needed` bytes free."""
    free = shutil.disk_usage(folder).free
    if needed > free:
        raise InputError(f"out {out}: not enough disk space: the {command} writes about {needed / 1e9:.1f} GB, "
                         f"{free / 1e9:.1f} GB free there", "out")
