"""Gemma 3n's image / audio tokens as its multimodal wrapper embeds them: transformers' Gemma3nModel gives a token id
in [embed_vision.vocab_offset, vocab_size) not the language model's embedding row but its embedder's output
(Gemma3nMultimodalEmbedder: the embedder's row, RMS-normed with its gain, projected to the text width, RMS-normed
without a gain). That output depends on the id alone, so the export computes it once per id, in float32, as
transformers does, into one table `SOFT_TABLE` [vocab_size - offset, hidden]; every graph takes a token at or past the
offset from it instead of the scaled embedding (ModelConfig.soft_token_offset)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..errors import UnsupportedError
from .weights import WeightSource

SOFT_TABLE = "model.soft_token_embeds.weight"
Part = tuple[str, int, int, float]  # (embedder: embed_vision | embed_audio, its vocab_offset, its rows, its rms_norm_eps)


def gemma3n_soft_tokens(full: Any, text: dict[str, Any], source: str) -> tuple[Part, ...]:
    """The embedders of transformers' Gemma3nConfig `full`, their rows covering [first offset, vocab_size) without a
    gap (else refused; so is a config transformers cannot read: None)."""
    if full is None:
        raise UnsupportedError(f"{source}: gemma3n's vision_config / audio_config are not readable by the installed transformers")
    parts = tuple((name, int(c.vocab_offset), int(c.vocab_size), float(c.rms_norm_eps))
                  for name, c in (("embed_vision", full.vision_config), ("embed_audio", full.audio_config)))
    ends = [parts[0][1], *(offset + rows for _, offset, rows, _ in parts)]
    if [p[1] for p in parts[1:]] != ends[1:-1] or ends[-1] != int(text["vocab_size"]):
        raise UnsupportedError(f"{source}: gemma3n embedders' vocab_offset / vocab_size {[p[1:3] for p in parts]} do not "
                               f"cover [{parts[0][1]}, vocab_size {text['vocab_size']}) without a gap")
    return parts


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.pow(x.pow(2).mean(-1, keepdim=True) + eps, -0.5)  # Gemma3nRMSNorm's form


def soft_token_table(stored: WeightSource, parts: tuple[Part, ...]) -> np.ndarray:
    """The embedders' outputs of every id they cover, in float32, in id order (`stored`: the wrapper's tensors)."""
    rows = []
    for name, _, _, eps in parts:
        def tensor(key: str) -> torch.Tensor:
            return torch.from_numpy(np.array(stored.read_float32(f"model.{name}.{key}.weight")))

        normed = _rms(tensor("embedding"), eps) * tensor("hard_embedding_norm")
        rows.append(_rms(normed @ tensor("embedding_projection").T, eps))
    return torch.cat(rows).numpy()
