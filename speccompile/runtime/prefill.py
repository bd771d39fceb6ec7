"""The prompt's side of a generation: chunked prefill, then the first token (`PromptPrefill`, a part of
runtime/generate.py's `Generation`).

A prompt is prefilled in passes of `prefill_chunk` tokens from position 0 (or after the rows a prefix cache
supplied); the drafter hears each chunk (`Drafter.observe`, with its hidden states). After the last chunk the first
token is chosen from the prompt's last logits (penalties and a grammar's mask applied), or taken from the graph's
ArgMax when nothing adjusts the logits of a greedy request (the [q, vocab] logits then never leave the device).
A batch decoder runs the chunks between other requests' passes (`prefill_next_chunk`, `defer_prefill`).
"""

from __future__ import annotations

import time
import numpy as np

from .backends.base import StepOutput
from .drafters.base import Observation
from .kvcache import causal_mask
from .output import choose_first_token

class PromptPrefill:
    """The prefill steps of a `Generation` (runtime/generate.py), which holds the state they read and write:
    `prompt_ids`, `cache`, `generator`, `config`, `drafter`, `stats`, `output`, `rules`, `tokens`."""

    prompt_ids: list[int]
    tokens: list[int]
    prompt_logits: np.ndarray | None  # the prompt's last logits once prefilled (None: the graph's ArgMax chose)
    _prefilled_rows: int  # prompt rows in the cache (a prefix cache's, then the chunks run)
    _first_chosen: bool

    @property
    def prefilling(self) -> bool:
        """Whether the prompt is not prefilled yet (no first token; `defer_prefill`)."""
        return not self._first_chosen

    @property
    def prefill_remaining(self) -> int:
        """Prompt tokens still to prefill."""
        return len(self.prompt_ids) - self._prefilled_rows if self.prefilling else 0

    @property
    def prefill_last_chunk(self) -> bool:
        """Whether the prompt's next prefill chunk is its last."""
        return self.prefilling and self.prefill_remaining <= self.config.prefill_chunk

    def prefill_next_chunk(self) -> None:
        """The next `prefill_chunk` tokens of the prompt (chunks start at position 0, or after whole cached
        chunks, as in a prefill at once) in a pass of its own; after the last one, the first token."""
        ids, positions = self.next_prefill_chunk()
        mask = self.cache.attention_mask(causal_mask(len(ids)))
        self.prefilled_chunk(self.generator.target.run(ids, positions, mask, self.cache, last_logits_only=True))

    def next_prefill_chunk(self) -> tuple[np.ndarray, np.ndarray]:
        """The token ids and positions of the prompt's next chunk (a batch decoder may run several prompts' chunks
        in shared passes, then hand each its output: `prefilled_chunk`)."""
        if not self.prefilling:
            raise RuntimeError("the prompt is prefilled already")
        start = self._prefilled_rows
        ids = self.prompt_ids[start: start + self.config.prefill_chunk]
        return np.asarray(ids), np.arange(start, start + len(ids))

    def prefilled_chunk(self, out: StepOutput) -> None:
        """Commit the pass over the chunk `next_prefill_chunk` named (its last row's logits at least): its KV rows,
        the drafter's observation; after the last chunk, the first token."""
        prompt, start = self.prompt_ids, self._prefilled_rows
        ids = prompt[start: start + self.config.prefill_chunk]
        q = len(ids)
        self.cache.append(out.presents, range(q), q)
        self.stats.prefill_passes += 1
        if self.drafter is not None:
            following = prompt[start + q] if start + q < len(prompt) else None
            self.drafter.observe(Observation(list(ids), out.hidden, following))
        self._prefilled_rows = start + q
        if self._prefilled_rows == len(prompt):
            if (out.greedy_tokens is not None and self.params.greedy and self.rules is None and self._logit_trace is None
                    and not self.config.adjusts_logits):
                self._first_token(None, int(out.greedy_tokens[-1]))  # the [q, vocab] logits are never copied back
            else:
                self._first_token(out.logits[-1])

    def _first_token(self, last_logits: np.ndarray | None, chosen: int | None = None) -> None:
        """The prompt is prefilled: choose (from `last_logits`, unless the graph's ArgMax `chosen` it) and emit the
        first token."""
        self.prompt_logits = last_logits
        self._first_chosen = True
        self.stats.time_prefill = time.perf_counter() - self._started
        self.stats.target_passes = 1 if self.stats.prefill_passes else 0  # none on a whole-prompt cache hit
        if chosen is None:
            if self.config.adjusts_logits:
                last_logits = self.config.penalties.first_row(last_logits, self.prompt_ids)
            if self.rules is not None:
                last_logits = self.rules.first_logits(last_logits)
            chosen = choose_first_token(last_logits, self.params, self.rng)
            if self._logit_trace is not None:
                self._logit_trace.append(np.array(last_logits))
        self.tokens = self.prompt_ids + [chosen]
        self.done = self.output.push(chosen)
        if self.rules is not None:
            self.rules.emit(last_logits[None], [chosen], len(self.output.tokens))
        self.output.flush()
        self.finish = self.output.finish
