"""Log-probabilities of emitted tokens, as OpenAI's `logprobs` / `top_logprobs` report them.

A token's log-probability is taken from the distribution it was chosen from: the row of the pass that chose it
(the prefill's last row, or the verify pass's row that accepted it: no extra pass), after the request's
processing: the grammar's mask (runtime/constrained.py), then temperature, top-k and top-p, renormalised
(runtime/sampling.py `process_logits`). Greedy requests (temperature 0) report the masked distribution at
temperature 1 (their processed distribution is one-hot). Tokens outside top-k / top-p / the grammar get -inf.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .backends.base import Session
from .kvcache import causal_mask
from .sampling import SamplingParams, process_logits


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token: its log-probability and the `top` most likely tokens of its row (id, log-prob)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class LogprobRecorder:
    """Collects a generation's TokenLogprob entries, one per emitted token (the ending eos excluded), in order;
    a server reads `entries` as they grow. `top`: how many alternatives each entry lists (0..20)."""

    top: int = 0
    entries: list[TokenLogprob] = field(default_factory=list)

    def record(self, logits: np.ndarray, params: SamplingParams, token: int) -> None:
        """Add the entry of `token`, chosen from `logits` [V] (already masked by the grammar, if any)."""
        logprobs = processed_logprobs(logits, params)
        top: tuple[tuple[int, float], ...] = ()
        if self.top:
            best = np.argsort(-logprobs, kind="stable")[: self.top]
            top = tuple((int(t), float(logprobs[t])) for t in best)
        self.entries.append(TokenLogprob(int(token), float(logprobs[token]), top))

    def fresh(self) -> "LogprobRecorder":
        """An empty recorder with the same settings (one per generation)."""
        return dataclasses.replace(self, entries=[])


def processed_logprobs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """float64 [V]: the log of the processed distribution of one row (log-softmax at temperature 1 when greedy)."""
    if params.greedy:
        params = dataclasses.replace(params, temperature=1.0)
    probs = process_logits(np.asarray(logits), params)
    with np.errstate(divide="ignore"):
        return np.log(probs)


def prompt_logprobs(session: Session, prompt_ids: Sequence[int], top: int = 0, chunk: int = 256) -> list[TokenLogprob]:
    """The entries of prompt tokens 1..n-1 (the first has no context), each from the logits of the row before it at
    temperature 1 (OpenAI's `echo` with `logprobs`): the prompt runs in passes of its own (chunks of `chunk`
    tokens, every row's logits kept), apart from any generation."""
    recorder, cache, n = LogprobRecorder(top), session.new_cache(), len(prompt_ids)
    plain = SamplingParams(temperature=1.0)
    for start in range(0, n - 1, chunk):
        ids = np.asarray(prompt_ids[start: start + chunk], dtype=np.int64)
        q = len(ids)
        out = session.run(ids, np.arange(start, start + q), cache.attention_mask(causal_mask(q)), cache)
        cache.append(out.presents, range(q), q)
        for row in range(min(q, n - 1 - start)):
            recorder.record(out.logits[row], plain, int(prompt_ids[start + row + 1]))
    return recorder.entries
