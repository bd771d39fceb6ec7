"""The emitted side of a generation: stops (eos, stop strings, max_tokens), the text and its streamed deltas (and
the text a generation opens with, known before it starts: `opening_text`)."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from ..tokenizer import TextTokenizer
from .options import GenerationConfig
from .sampling import SamplingParams, process_logits, sample
from .stats import GenerationResult, GenerationStats


class TokenOutput:
    """Collects emitted tokens and applies eos / stop strings / max_tokens; streams text deltas."""

    def __init__(self, tokenizer: TextTokenizer | None, config: GenerationConfig, eos_ids: set[int],
                 on_text: Callable[[str], None] | None):
        self.tokens: list[int] = []
        self.tokenizer = tokenizer
        self.config = config
        self.eos_ids = eos_ids
        self.on_text = on_text
        self.finish: str | None = None
        self.text = ""
        self._streamed = 0
        self._holdback = max((len(s) for s in config.stop), default=1) - 1

    def push(self, token: int) -> bool:
        """Add one token; True when generation must stop (the token is kept unless it is eos)."""
        if token in self.eos_ids and not self.config.ignore_eos:
            self.finish = "stop"
            return True
        self.tokens.append(token)
        if self.config.stop and self.tokenizer is not None:
            self.text = self.tokenizer.decode(self.tokens)
            for stop in self.config.stop:
                cut = self.text.find(stop)
                if cut >= 0:
                    self.text = self.text[:cut]
                    self.finish = "stop"
                    return True
        if len(self.tokens) >= self.config.max_tokens:
            self.finish = "length"
            return True
        return False

    def flush(self, final: bool = False) -> None:
        if self.on_text is None or self.tokenizer is None:
            return
        if not self.config.stop:
            self.text = self.tokenizer.decode(self.tokens)
        text = self.text
        if text.endswith("\ufffd") and not final:
            return
        end = len(text) if final else max(self._streamed, len(text) - self._holdback)
        if end > self._streamed:
            self.on_text(text[self._streamed:end])
            self._streamed = end


    def result(self, finish: str | None, stats: GenerationStats, trace: list[np.ndarray] | None) -> GenerationResult:
        """The finished generation: its tokens and text, `stats`, the logits that chose its tokens (`trace`, when
        traced) and its logprobs (when recorded)."""
        text = self.text if self.config.stop else (self.tokenizer.decode(self.tokens) if self.tokenizer else "")
        logits = np.stack(trace[: len(self.tokens)]) if trace and self.tokens else (
            np.empty((0, *trace[0].shape), trace[0].dtype) if trace else None)  # no token kept (a stop string at once)
        logprobs = self.config.logprobs.entries[: len(self.tokens)] if self.config.logprobs is not None else None
        return GenerationResult(self.tokens, text, finish or "length", stats, logits, logprobs)


def choose_first_token(prompt_logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """The first generated token, from the prompt's last logits (the generation's first draw of `rng`)."""
    return int(np.argmax(prompt_logits)) if params.greedy else sample(process_logits(prompt_logits, params), rng)


def opening_text(tokenizer: TextTokenizer, eos_ids: set[int], config: GenerationConfig, prompt_logits: np.ndarray,
                 prompt_ids: Sequence[int] = ()) -> str | None:
    """The text a generation of `config` whose prompt ends in `prompt_logits` streams with its first token, known
    before it starts: a server sends it at once for a prompt whose logits a prefix cache holds. None when that
    text is not fixed by the logits (sampling without a seed), when the first token ends the generation, or
    when it streams nothing yet (held back for a stop string or an incomplete character). `prompt_ids`: the prompt
    (for the repetition penalty; runtime/penalties.py)."""
    if not config.sampling.greedy and config.sampling.seed is None:
        return None
    sent: list[str] = []
    output = TokenOutput(tokenizer, config, eos_ids, sent.append)
    if config.adjusts_logits:
        prompt_logits = config.penalties.first_row(prompt_logits, prompt_ids)
    if output.push(choose_first_token(prompt_logits, config.sampling, config.sampling.rng())):
        return None
    output.flush()
    return sent[0] if sent else None
