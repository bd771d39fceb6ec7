"""Logit-level quality of a quantized model against its reference (numpy only).

Used by `speccompile eval` and by the sensitivity search of the quantization pass: teacher-forced logits of
the same token sequences from both models give top-1 agreement, KL(reference || quantized) and perplexity.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@dataclass
class LogitComparison:
    """Accumulates per-position statistics over many sequences (pooled by position)."""

    positions: int = 0
    agree: int = 0
    kl_sum: float = 0.0
    kl_max: float = 0.0
    nll_reference: float = 0.0
    nll_quantized: float = 0.0
    scored: int = 0  # positions with a next token (perplexity)
    per_sequence: list[tuple[int, int]] = field(default_factory=list)  # (agreeing positions, positions) per sequence

    def add(self, reference: np.ndarray, quantized: np.ndarray, token_ids: np.ndarray | None = None) -> None:
        """reference/quantized logits [positions, vocab]; token_ids [positions] of the sequence (perplexity)."""
        reference = np.asarray(reference).reshape(-1, reference.shape[-1])
        quantized = np.asarray(quantized).reshape(-1, quantized.shape[-1])
        lp_ref, lp_q = log_softmax(reference), log_softmax(quantized)
        agree = lp_ref.argmax(-1) == lp_q.argmax(-1)
        kl = (np.exp(lp_ref) * (lp_ref - lp_q)).sum(-1)
        self.positions += len(agree)
        self.agree += int(agree.sum())
        self.kl_sum += float(kl.sum())
        self.kl_max = max(self.kl_max, float(kl.max(initial=0.0)))
        self.per_sequence.append((int(agree.sum()), len(agree)))
        if token_ids is not None and len(token_ids) > 1:
            nxt = np.asarray(token_ids[1:], dtype=np.int64)
            rows = np.arange(len(nxt))
            self.nll_reference -= float(lp_ref[rows, nxt].sum())
            self.nll_quantized -= float(lp_q[rows, nxt].sum())
            self.scored += len(nxt)

    @property
    def top1_agreement(self) -> float:
        return self.agree / self.positions if self.positions else 1.0

    def top1_interval(self, level: float = 0.95, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
        """A percentile-bootstrap interval of top-1 agreement that resamples whole sequences (positions within a
        text agree or not together, so resampling positions would claim too narrow an interval); deterministic."""
        counts = np.asarray(self.per_sequence, dtype=np.float64).reshape(-1, 2)
        if len(counts) < 2:
            return self.top1_agreement, self.top1_agreement
        picks = np.random.default_rng(seed).integers(0, len(counts), size=(resamples, len(counts)))
        pooled = counts[picks, 0].sum(axis=1) / np.maximum(counts[picks, 1].sum(axis=1), 1.0)
        tail = (1.0 - level) / 2.0 * 100.0
        low, high = np.percentile(pooled, [tail, 100.0 - tail])
        return float(low), float(high)

    @property
    def kl_divergence(self) -> float:
        return self.kl_sum / self.positions if self.positions else 0.0

    def perplexity(self, which: str) -> float:
        nll = self.nll_reference if which == "reference" else self.nll_quantized
        return float(np.exp(nll / self.scored)) if self.scored else float("nan")
