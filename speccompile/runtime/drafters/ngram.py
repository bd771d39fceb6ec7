"""N-gram prompt lookup: copy what followed an earlier occurrence of the current suffix.

A match close to the end of the history copies past it as a repetition (`periodic_continuation`).

Which occurrence: the one closest to where the previous proposal was copying from, if it lies just
after it (an edit task copies its source in order, so after a rewritten token the copy resumes a
little further on), else the latest one. The source pointer advances by the tokens emitted since the
last proposal, which the drafter reads off the token history: it needs no callback from the loop.

With an `NgramCorpus` (`--ngram-corpus`), a history without any match falls back to what usually follows
the last tokens in the corpus; those proposals get their own acceptance class (negative keys).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from typing import TYPE_CHECKING

from ...errors import InputError
from .base import Draft, Drafter, DrafterRequest, GenerationStart
from .ngram_corpus import NgramCorpus

if TYPE_CHECKING:
    from ..adaptive import Sizing


HISTORY_CHECK = 16  # tokens compared to tell a grown history from another one (a step costs O(1), not O(history))


class _NgramIndex:
    """Where every n-gram of a history (n in `sizes`) ended, kept up to date as the history grows: a proposal
    then costs a few dictionary lookups instead of a scan of the whole history."""

    def __init__(self, sizes: range):
        self.sizes = sizes
        self.tokens: list[int] = []  # the history indexed so far
        self.ends: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in sizes}  # n-gram -> ascending ends

    def update(self, tokens: list[int]) -> None:
        """Index what `tokens` added to the history (another history: start over). Another history is told by its
        length or its last HISTORY_CHECK indexed tokens: one that differs only before them keeps a stale index,
        which costs acceptance, never exactness (every draft is verified)."""
        known = len(self.tokens)
        if len(tokens) < known or tokens[max(0, known - HISTORY_CHECK): known] != self.tokens[-HISTORY_CHECK:]:
            self.tokens, self.ends = [], {n: {} for n in self.sizes}
            known = 0
        for end in range(known + 1, len(tokens) + 1):
            for n in self.sizes:
                if end >= n:
                    self.ends[n].setdefault(tuple(tokens[end - n: end]), []).append(end)
        self.tokens.extend(tokens[known:])

    def earlier_ends(self, n: int) -> tuple[list[int], int]:
        """Where the history's last n tokens occurred before: the first `count` of the ascending list (the
        suffix itself, always its last entry, excluded)."""
        ends = self.ends[n].get(tuple(self.tokens[-n:]), [])
        return ends, len(ends) - 1 if ends and ends[-1] == len(self.tokens) else len(ends)


class NgramDrafter(Drafter):
    """Prompt-lookup decoding over prompt + generated tokens (deterministic: one-hot q). Looking up costs ~nothing,
    so a proposal is the longest lookup, cut to what pays for its reliability class (`Draft.key`: the matched
    suffix length, minus the corpus context length for a corpus proposal); a plain step can still ask it for a
    guess (`guesses`)."""

    name = "ngram"
    guesses = True
    grows = True  # a copy accepted whole at the full length tends to go on (docs/benchmarks.md, Gemma 3 copy)

    def __init__(self, min_match: int = 1, max_match: int = 4, resume_window: int = 16, resume_back: int = 2,
                 corpus: NgramCorpus | None = None):
        if not 1 <= min_match <= max_match:
            raise InputError(f"min_match, max_match: need 1 <= min_match <= max_match, got {min_match}, {max_match}")
        self.default_matches = (min_match, max_match)  # a generation's DraftTuning may give its own
        self.min_match, self.max_match = min_match, max_match
        self.resume_window = resume_window  # how far past the source pointer an occurrence still counts as "resuming"
        self.resume_back = resume_back
        self.corpus = corpus
        self.start(GenerationStart())

    def start(self, start: GenerationStart) -> None:
        tuning, (low, high) = start.tuning, self.default_matches
        self.min_match = tuning.min_match if tuning.min_match is not None else min(low, tuning.max_match or low)
        self.max_match = tuning.max_match if tuning.max_match is not None else max(high, self.min_match)
        self._index = _NgramIndex(range(self.min_match, self.max_match + 1))
        self._copied_from: int | None = None  # history index the last proposal copied from
        self._proposed_at = 0  # history length when it was made

    def _source_pointer(self, history_len: int) -> int | None:
        """Where the copy would continue: the last proposal's start advanced by the tokens emitted since."""
        if self._copied_from is None or history_len < self._proposed_at:
            return None
        return self._copied_from + (history_len - self._proposed_at)

    def propose(self, tokens: list[int], sizing: "Sizing") -> Draft:
        """The longest lookup, cut to the length that pays for its class (a guess: one token, not sized)."""
        draft = self.lookup(tokens, sizing.room)
        if draft.tokens:
            draft.tokens = draft.tokens[: sizing.choose_k(draft.key, len(draft.tokens))]
        return draft

    def lookup(self, tokens: list[int], k: int) -> Draft:
        """Up to k tokens copied after an earlier occurrence of the history's suffix (`Draft.key`: the match
        length). The longest suffix (max_match .. min_match tokens) seen earlier wins; among its occurrences the
        one resuming the previous copy is preferred, else the latest."""
        pointer = self._source_pointer(len(tokens))
        self._copied_from = None
        if k <= 0 or len(tokens) < self.min_match + 1:
            return Draft([], key=0)
        self._index.update(tokens)
        history = self._index.tokens
        n_total = len(history)
        for n in range(min(self.max_match, n_total - 1), self.min_match - 1, -1):
            # candidate continuations: where the suffix occurred earlier, something following it
            starts, count = self._index.earlier_ends(n)
            if not count:
                continue
            start = starts[count - 1]
            if pointer is not None:
                low = bisect_left(starts, pointer - self.resume_back, 0, count)
                high = bisect_right(starts, pointer + self.resume_window, 0, count)
                if low < high:  # the closest occurrence resuming the copy (the first of equals, as ascending)
                    start = min(starts[low:high], key=lambda s: abs(s - pointer))
            proposal = periodic_continuation(history, start, k)
            if proposal:
                self._copied_from, self._proposed_at = start, n_total
                return Draft(proposal, key=n)
        if self.corpus is not None:
            proposal, context = self.corpus.continue_from(tokens, k)
            return Draft(proposal, key=-context)
        return Draft([], key=0)


def periodic_continuation(history: list[int], start: int, k: int) -> list[int]:
    """Up to k tokens from `history[start]` on, continued past the history's end as the repetition the match
    implies: the suffix recurring `period` tokens back means the text repeats with that period, so token i of
    the copy is token i - period of the copy itself (an overlapping copy, as LZ77 decodes one). A run like
    "a b a b" otherwise yields a 2-token draft however long it goes on."""
    period = len(history) - start
    proposal = list(map(int, history[start: start + k]))
    while 0 < period <= len(proposal) < k:
        proposal.append(proposal[len(proposal) - period])
    return proposal


def make_ngram(request: DrafterRequest) -> NgramDrafter:
    """The registry's factory (drafters/registry.py)."""
    return NgramDrafter(corpus=request.ngram_corpus)
