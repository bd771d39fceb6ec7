"""The suffix drafter's store of earlier responses: one suffix tree per tenant over the most recent
`max_requests` responses, evicted first in first out.

A tenant is a request's `user` (an OpenAI request field): one client's text never drafts for another's
request unless `share_tenants` pools them. One store serves every generation of a runner (all slots of a batch
decoder), and carries the runner's suffix drafting settings (runtime/drafters/suffix.py `make_suffix`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from ..errors import InputError
from .suffix_tree import SuffixTree

SOURCES = ("local", "global")  # where a suffix draft came from: the request's own text, or earlier responses


class SuffixCache:
    """Earlier responses, one `SuffixTree` per tenant, at most `max_requests` of them (oldest evicted first).

    One instance serves every generation of a runner (all slots of a batch decoder) and carries the runner's
    drafting settings (`make_suffix`); it is not thread-safe (the serving engine decodes on one worker thread).
    `max_requests` 0: no global store, each request drafts from its own text alone. Counters for metrics: `proposals`, `drafted`, `accepted`
    by source (`SOURCES`)."""

    def __init__(self, max_requests: int = 10000, max_depth: int = 24, share_tenants: bool = False,
                 min_prob: float = 0.1, spec_factor: float = 1.0, tree: bool = True):
        if max_requests < 0:
            raise InputError(f"suffix_cache_requests must be >= 0, got {max_requests}", "suffix_cache_requests")
        if max_depth < 1:
            raise InputError(f"suffix_max_depth must be >= 1, got {max_depth}", "suffix_max_depth")
        if not 0.0 <= min_prob <= 1.0:
            raise InputError(f"suffix_min_prob must be in [0, 1], got {min_prob}", "suffix_min_prob")
        if spec_factor <= 0:
            raise InputError(f"suffix_spec_factor must be > 0, got {spec_factor}", "suffix_spec_factor")
        self.max_requests = max_requests
        self.max_depth = max_depth
        self.share_tenants = share_tenants
        # how every drafter of the runner drafts (SuffixDrafter's arguments)
        self.min_prob, self.spec_factor, self.tree = min_prob, spec_factor, tree
        self._trees: dict[str | None, SuffixTree] = {}
        self._order: OrderedDict[int, str | None] = OrderedDict()  # cached response id -> its tenant, oldest first
        self._next_id = 0
        self.proposals = dict.fromkeys(SOURCES, 0)
        self.drafted = dict.fromkeys(SOURCES, 0)
        self.accepted = dict.fromkeys(SOURCES, 0)

    def _tenant(self, user: str | None) -> str | None:
        return None if self.share_tenants else user

    def open(self, user: str | None) -> int | None:
        """A new response of `user`'s (its id for `append`; None when the cache holds none), evicting the oldest."""
        if self.max_requests == 0:
            return None
        response, self._next_id = self._next_id, self._next_id + 1
        self._order[response] = self._tenant(user)
        while len(self._order) > self.max_requests:
            oldest, tenant = self._order.popitem(last=False)
            tree = self._trees[tenant]
            if oldest in tree:
                tree.remove(oldest)
            if not len(tree):
                del self._trees[tenant]
        return response

    def append(self, response: int | None, tokens: Sequence[int]) -> None:
        """Tokens the response `open` returned has generated since (ignored once it was evicted)."""
        tenant = self._order.get(response, False) if response is not None else False
        if tenant is False or not tokens:
            return
        tree = self._trees.get(tenant)
        if tree is None:
            tree = self._trees[tenant] = SuffixTree(self.max_depth)
        tree.extend(response, tokens)

    def clear(self) -> None:
        """Forget every cached response (the counters stay)."""
        self._trees.clear()
        self._order.clear()

    def tree_of(self, user: str | None) -> SuffixTree | None:
        """The tree `user`'s requests draft from (None: nothing cached for them)."""
        return self._trees.get(self._tenant(user))

    @property
    def requests(self) -> int:
        """Responses cached."""
        return len(self._order)

    @property
    def tokens(self) -> int:
        """Response tokens cached."""
        return sum(tree.tokens for tree in list(self._trees.values()))  # a scrape may run beside the worker

    def memory_bytes(self) -> int:
        """Bytes the trees hold (an estimate: runtime/suffix_tree.py `memory_bytes`)."""
        return sum(tree.memory_bytes() for tree in self._trees.values())

    def stats(self) -> dict[str, int]:
        """Counters for metrics: proposals, drafted and accepted tokens by source, and the cache's size."""
        out = {f"{name}_{source}": counts[source] for name, counts in
               (("proposals", self.proposals), ("drafted", self.drafted), ("accepted", self.accepted)) for source in SOURCES}
        out.update(requests=self.requests, tokens=self.tokens)
        return out
