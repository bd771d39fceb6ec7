"""Sampled exactness end to end: the first K tokens of many seeded sampled generations through a real `Runner`
against the target's own distribution of them, computed in torch over every prefix (temperature and top-k applied
here, not by the runtime), chi-square tested as tests/test_sampling.py does."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import numpy as np

EOS = -1  # an outcome that ended with an end-of-sequence token before K tokens


def exact_prefix_distribution(folder: Path, prompt: list[int], k: int, temperature: float, top_k: int,
                              eos_ids: list[int]) -> dict[tuple[int, ...], float]:
    """P(first k tokens) of the target in `folder` sampled with `temperature` and `top_k` (an eos ends an outcome)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), torch_dtype=torch.float32).eval()
    out: dict[tuple[int, ...], float] = {}

    def expand(prefix: list[int], prob: float) -> None:
        if len(prefix) == k:
            out[tuple(prefix)] = prob
            return
        with torch.no_grad():
            logits = model(torch.tensor([prompt + prefix])).logits[0, -1].double().numpy() / temperature
        top = np.argsort(-logits)[:top_k]
        p = np.exp(logits[top] - logits[top].max())
        for t, pt in zip(top, p / p.sum()):
            if int(t) in eos_ids:
                key = (*prefix, EOS)
                out[key] = out.get(key, 0.0) + prob * pt
            else:
                expand(prefix + [int(t)], prob * pt)

    expand([], 1.0)
    return out


def sampled_prefix_counts(runner, prompt: list[int], k: int, sampling, n: int, max_tokens: int | None = None) -> Counter:
    """Outcomes (first k tokens, or the tokens before an eos + EOS) of n generations of `max_tokens` (default k)
    seeded 0..n-1."""
    counts: Counter = Counter()
    for seed in range(n):
        result = runner.generate_ids(prompt, max_tokens or k, sampling=dataclasses.replace(sampling, seed=seed))
        tokens = tuple(result.tokens[:k])
        counts[tokens if len(tokens) == k else (*tokens, EOS)] += 1
    return counts


def p_value(counts: Counter, exact: dict[tuple[int, ...], float]) -> float:
    """Chi-square goodness of fit of `counts` to `exact` (an outcome `exact` gives no mass: 0)."""
    from test_sampling import chi_square_p_value

    if set(counts) - set(exact):
        return 0.0
    keys = sorted(exact)
    return chi_square_p_value(np.array([counts[key] for key in keys]), np.array([exact[key] for key in keys]))
