"""A separate, smaller LM as drafter, with its own KV cache kept in step with the committed tokens."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..backends.base import Session
from ..kvcache import causal_mask
from ..sampling import process_logits, sample
from ..timing import TimedSession
from .base import Draft, Drafter, DrafterRequest, GenerationStart

if TYPE_CHECKING:
    from ..adaptive import Sizing


class DraftModelDrafter(Drafter):
    """Autoregressive chain drafting with a draft LM.

    The drafter remembers which tokens its cache holds. On each `propose` it drops cache rows past
    the common prefix with the committed sequence (rejected drafts), feeds the missing tokens in one
    call, then drafts one token per call. Under sampling each draft token is drawn from the draft's
    processed distribution, which is returned as q for exact verification: with the generation's settings and
    generator (`start`; greedy and unseeded until then).
    """

    name = "draft-model"
    relative_cost = 0.15  # prior cost of one draft token in target passes (seeded adaptive mode)

    def __init__(self, session: Session, max_context: int):
        self.session = session
        self.max_context = max_context
        self.start(GenerationStart())

    def start(self, start: GenerationStart) -> None:
        self.params = start.sampling  # the generation's settings and its own generator
        self.rng = start.rng if start.rng is not None else np.random.default_rng()
        self.cache = self.session.new_cache()
        self.cached: list[int] = []

    def _feed(self, new_tokens: list[int]) -> np.ndarray:
        """Run new tokens through the draft model after the cached ones; return last-position logits."""
        q = len(new_tokens)
        self.cache.maybe_compact(q, self.max_context)
        start = len(self.cached)
        mask = self.cache.attention_mask(causal_mask(q))
        out = self.session.run(np.asarray(new_tokens), np.arange(start, start + q), mask, self.cache, last_logits_only=True)
        self.cache.append(out.presents, range(q), q)
        self.cached.extend(new_tokens)
        return out.logits[-1]

    def _sync(self, tokens: list[int]) -> list[int]:
        """Drop cached rows that disagree with `tokens`; return the tokens still to feed."""
        common = 0
        limit = min(len(self.cached), len(tokens) - 1)  # always feed at least the pending token
        while common < limit and self.cached[common] == tokens[common]:
            common += 1
        if common < len(self.cached):
            self.cache.truncate(common)
            del self.cached[common:]
        return tokens[common:]

    def propose(self, tokens: list[int], sizing: "Sizing") -> Draft:
        k = sizing.choose_k()
        if k <= 0:
            return Draft([])
        logits = self._feed(self._sync(tokens))
        drafted: list[int] = []
        rows = []
        for i in range(k):
            if self.params.greedy:
                token = int(np.argmax(logits))
            else:
                probs = process_logits(logits, self.params)
                token = sample(probs, self.rng)
                rows.append(probs)
            drafted.append(token)
            if i + 1 < k:
                logits = self._feed([token])
        return Draft(drafted, np.stack(rows) if rows else None)


def make_draft_model(request: DrafterRequest) -> DraftModelDrafter:
    """The artifact's draft model (on ort-cpu in the artifact's one shared session of its graph)."""
    section = request.exported_section()
    session = TimedSession(request.artifact.session(section.get("graph", "draft"), request.shared_session), request.clock)
    return DraftModelDrafter(session, request.artifact.max_context)
