"""A request's logit adjustments before sampling: logit bias and the repetition penalties (one place, used by plain
decoding and verification alike).

They change the target distribution, so speculation applies them to the target's logits exactly as plain decoding
does, row by row of a verify pass: the row after draft position j sees the history a plain decode would have had
if the drafts before it are accepted (the prompt, the generated tokens, then the drafts on its path). Order, as
vLLM's sampler: logit bias, then the repetition penalty, the frequency penalty, the presence penalty; then
runtime/sampling.py processes the result (temperature, min-p, top-k, top-p; or argmax when greedy).

* ``logit_bias``: added to the token's logit (OpenAI: -100..100).
* ``repetition``: (vLLM / Hugging Face) a token seen in the prompt or the output so far has its logit divided by
  the penalty when positive, multiplied by it when negative (1 = off).
* ``frequency`` / ``presence``: (OpenAI) subtract ``frequency * count`` and ``presence * (count > 0)``, where count
  is how often the token occurs in the output so far (the prompt excluded).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..errors import InputError


@dataclass(frozen=True)
class LogitPenalties:
    """The adjustments of one request (the defaults change nothing). `logit_bias`: (token id, bias) pairs."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def active(self) -> bool:
        """Whether any adjustment changes the logits."""
        return bool(self.presence or self.frequency or self.repetition != 1.0 or self.logit_bias)

    def validate(self, vocab_size: int | None = None) -> "LogitPenalties":
        """Raise InputError (naming the field) for out-of-range values (OpenAI's and vLLM's ranges); return self."""
        for name, value in (("presence_penalty", self.presence), ("frequency_penalty", self.frequency)):
            if not _finite(value) or not -2 <= value <= 2:
                raise InputError(f"{name} must be in [-2, 2], got {value}", name)
        if not _finite(self.repetition) or not self.repetition > 0:
            raise InputError(f"repetition_penalty must be > 0, got {self.repetition}", "repetition_penalty")
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            raise InputError("logit_bias: a token id is given twice", "logit_bias")
        for token, bias in self.logit_bias:
            if isinstance(token, bool) or not isinstance(token, (int, np.integer)) or token < 0 or (
                    vocab_size is not None and token >= vocab_size):
                limit = f"0..{vocab_size - 1}" if vocab_size is not None else ">= 0"
                raise InputError(f"logit_bias: token id {token} is outside the vocabulary ({limit})", "logit_bias")
            if not _finite(bias) or not -100 <= bias <= 100:
                raise InputError(f"logit_bias: the bias of token {token} must be in [-100, 100], got {bias}", "logit_bias")
        return self

    def first_row(self, logits: np.ndarray, prompt: Sequence[int]) -> np.ndarray:
        """The prompt's last logits [V] adjusted: the row the first token is chosen from."""
        return self.apply(logits, prompt, [], [[]])[0]

    def apply(self, logits: np.ndarray, prompt: Sequence[int], output: Sequence[int],
              paths: Sequence[Sequence[int]]) -> np.ndarray:
        """The adjusted logits [q, V] (float32, a new array) of a pass's rows: row r follows `prompt`, `output` (the
        tokens generated so far) and then `paths[r]` (the draft tokens on its path: none for the pending token's row)."""
        rows = np.array(logits, dtype=np.float32, ndmin=2)
        if len(paths) != rows.shape[0]:
            raise ValueError(f"{len(paths)} paths for {rows.shape[0]} rows")
        if self.logit_bias:
            ids = np.fromiter((t for t, _ in self.logit_bias), dtype=np.int64)
            rows[:, ids] += np.fromiter((b for _, b in self.logit_bias), dtype=np.float32)
        if self.repetition == 1.0 and not self.presence and not self.frequency:
            return rows
        drafted = [t for path in paths for t in path]
        seen = np.unique(np.asarray([*prompt, *output, *drafted], dtype=np.int64))  # every token a penalty may touch
        counts = np.zeros((rows.shape[0], len(seen)), dtype=np.float32)
        counts += _counts_in(seen, output)
        for r, path in enumerate(paths):
            if len(path):
                counts[r] += _counts_in(seen, path)
        block = rows[:, seen]
        if self.repetition != 1.0:
            penalised = (counts > 0) | np.isin(seen, np.asarray(prompt, dtype=np.int64))[None]
            scaled = np.where(block > 0, block / np.float32(self.repetition), block * np.float32(self.repetition))
            block = np.where(penalised, scaled, block)
        block = block - np.float32(self.frequency) * counts - np.float32(self.presence) * (counts > 0)
        rows[:, seen] = block
        return rows


def _counts_in(seen: np.ndarray, tokens: Sequence[int]) -> np.ndarray:
    """How often each of the sorted ids `seen` occurs in `tokens` (all of which are in `seen`)."""
    if not len(tokens):
        return np.zeros(len(seen), dtype=np.float32)
    return np.bincount(np.searchsorted(seen, np.asarray(tokens, dtype=np.int64)), minlength=len(seen)).astype(np.float32)


def draft_paths(num_rows: int, tokens: Sequence[int], parents: Sequence[int] | None) -> list[list[int]]:
    """For each row of a verify pass (row 0: the pending token, row i: draft token i-1), the draft tokens on its
    path from the pending token (that row's own token included): a chain's row i follows tokens[:i]; a tree's
    node follows its ancestors. `parents`: the tree's parent of each node (None: a chain)."""
    paths: list[list[int]] = [[]]
    for i in range(1, num_rows):
        parent = i - 1 if parents is None else int(parents[i])
        paths.append(paths[parent] + [int(tokens[i - 1])])
    return paths


def _finite(value: object) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool) and math.isfinite(value)
