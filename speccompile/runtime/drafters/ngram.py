"""N-gram prompt lookup: copy what followed the latest earlier occurrence of the current suffix."""

from __future__ import annotations

import numpy as np

from ...errors import InputError
from .base import Draft


class NgramDrafter:
    """Prompt-lookup decoding over prompt + generated tokens (deterministic: one-hot q)."""

    name = "ngram"
    cheap_proposals = True  # proposing costs ~nothing: the loop asks for the most and trims per match length

    @property
    def proposal_key(self) -> int:
        """Reliability class of the last proposal for adaptive speculation: the matched suffix length."""
        return self.last_match_len

    def __init__(self, min_match: int = 1, max_match: int = 4):
        if not 1 <= min_match <= max_match:
            raise InputError(f"--ngram-min/--ngram-max: need 1 <= min <= max, got {min_match}, {max_match}")
        self.min_match = min_match
        self.max_match = max_match
        self.last_match_len = 0

    def reset(self) -> None:
        self.last_match_len = 0

    def propose(self, tokens: list[int], k: int) -> Draft:
        """Longest suffix (max_match .. min_match tokens) seen earlier wins; its latest occurrence is copied."""
        self.last_match_len = 0
        if k <= 0 or len(tokens) < self.min_match + 1:
            return Draft([])
        seq = np.asarray(tokens, dtype=np.int64)
        n_total = len(seq)
        for n in range(min(self.max_match, n_total - 1), self.min_match - 1, -1):
            suffix = seq[n_total - n:]
            # candidate starts: windows seq[i:i+n] == suffix with i + n < n_total (something follows)
            windows = np.lib.stride_tricks.sliding_window_view(seq[: n_total - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                proposal = seq[start: start + k].tolist()
                if proposal:
                    self.last_match_len = n
                    return Draft(proposal)
        return Draft([])
