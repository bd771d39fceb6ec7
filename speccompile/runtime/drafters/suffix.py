"""Suffix decoding (SuffixDecoding, Arctic Inference's `method: "suffix"`): drafts from a suffix tree over the
request's own prompt and output, and from one over the responses the runner (a server) produced before.

Each round the history's last `max_depth` tokens are matched in both trees (runtime/suffix_tree.py); the
frequency-scored draft tree of the better match (summed estimated probabilities; the request's own tree on
ties) is proposed, at most `max_spec_factor` x the match length tokens. The tree is then cut to the prefix of
its best-first node order that pays at this round's pass costs: each node's estimated probability is
calibrated by the acceptance measured for its probability bucket (and capped by its parent's), and the
prefix with the highest expected speed is kept (`costs.best_prefix`, as the tree planner prices a static tree).
Proposals are deterministic (one-hot q, distinct tokens per parent), so tree verification stays exact.

The global store (runtime/suffix_cache.py) holds the runner's earlier responses per tenant; a response is added
token by token as it is generated (concurrent requests of a batch see each other's text). Seeded sampling drafts from its
own tree only: its output must depend on its own tokens alone, never on what other requests said.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from ..acceptance import AcceptanceRates
from ..costs import best_prefix
from ..suffix_cache import SOURCES, SuffixCache
from ..suffix_tree import Candidate, SuffixTree
from ..tree import TreeSpec
from .base import Draft, Drafter, DrafterRequest, GenerationStart, Observation

if TYPE_CHECKING:
    from ..adaptive import Sizing

__all__ = ["SOURCES", "SuffixCache", "SuffixDrafter", "make_suffix"]

BUCKETS = 10  # calibration classes of the estimated node probability


class SuffixDrafter(Drafter):
    """The request's suffix tree (prompt + output) and the shared `SuffixCache`; see the module docstring."""

    name = "suffix"
    guesses = True

    def __init__(self, cache: SuffixCache | None = None, max_depth: int = 24, min_prob: float = 0.1,
                 spec_factor: float = 1.0, spec_offset: float = 0.0, tree: bool = True, alpha: float = 0.08,
                 probe_every: int = 8):
        self.cache = cache
        self.max_depth = max_depth if cache is None else cache.max_depth
        self.min_prob = min_prob
        self.spec_factor = spec_factor
        self.defaults = (self.max_depth, min_prob, spec_factor)  # a generation's DraftTuning may give its own
        self.spec_offset = spec_offset
        self.tree = tree
        # P(node accepted) per (source, probability bucket): the bucket's probability until measured
        self.rates = AcceptanceRates(lambda key: (key[1] + 0.5) / BUCKETS, alpha, probe_every)
        self._local: SuffixTree | None = None
        self._synced = 0
        self._response: int | None = None
        self._user: str | None = None
        self._use_global = True
        self._last: tuple[list[tuple[str, int]], str] | None = None  # the last draft's node keys and source

    # -- the request's life ---------------------------------------------------------------------------

    def start(self, start: GenerationStart) -> None:
        tuning, (depth, min_prob, spec_factor) = start.tuning, self.defaults
        self.max_depth = min(tuning.max_depth or depth, depth)  # (Runner.check_drafting refuses deeper)
        self.min_prob = min_prob if tuning.min_prob is None else tuning.min_prob
        self.spec_factor = tuning.spec_factor or spec_factor
        self._use_global = not start.fresh
        if start.fresh:
            self.rates.forget()
        self._last = None
        self._begin(start.prompt_ids, start.user)

    def _begin(self, prompt_ids: Sequence[int], user: str | None) -> None:
        """A new history: the request's tree over `prompt_ids`, a response opened in the shared store."""
        self._user = user
        self._local = SuffixTree(self.max_depth)
        self._local.extend(0, prompt_ids)
        self._synced = len(prompt_ids)
        self._response = self.cache.open(user) if self.cache is not None else None

    def observe(self, observation: Observation) -> None:
        """The verdict on its last draft (`_record`); the finished history goes to the trees."""
        if observation.draft is not None:
            self._record(observation.accepted_rows)
        if observation.finished is not None:
            self._sync(observation.finished)
            self._local = None

    def _sync(self, tokens: Sequence[int]) -> None:
        """Add what `tokens` (the whole history) holds past what the trees saw; another history starts over."""
        if self._local is None or len(tokens) < self._synced:
            self._begin(tokens[:-1], self._user)
        new = tokens[self._synced:]
        if new:
            self._local.extend(0, new)
            if self.cache is not None:
                self.cache.append(self._response, new)
            self._synced = len(tokens)

    # -- drafting -------------------------------------------------------------------------------------

    def speculate(self, tokens: Sequence[int], room: int) -> tuple[Candidate, str]:
        """The better candidate of the two trees after `tokens` (at most `room` nodes), and its source."""
        self._sync(tokens)
        context = tokens[-self.max_depth:]
        args = (room, self.spec_factor, self.spec_offset, self.min_prob, self.tree)
        best, source = self._local.speculate(context, *args), "local"
        shared = self.cache.tree_of(self._user) if self.cache is not None and self._use_global else None
        if shared is not None:
            other = shared.speculate(context, *args)
            if other.score > best.score:
                best, source = other, "global"
        return best, source

    def propose(self, tokens: list[int], sizing: "Sizing") -> Draft:
        if sizing.guess:  # one token of the better candidate, not counted as a proposal
            candidate, _ = self.speculate(tokens, 1)
            return Draft(candidate.tokens[:1], key=candidate.match_len)
        self._last = None
        if sizing.room <= 0:
            self._sync(tokens)
            return Draft([])
        candidate, source = self.speculate(tokens, sizing.room)
        keys = [(source, min(BUCKETS - 1, int(p * BUCKETS))) for p in candidate.probs]
        n = self._paying_nodes(candidate, keys, sizing)
        if n == 0:
            return Draft([])
        self._last = (keys[:n], source)
        if self.cache is not None:
            self.cache.proposals[source] += 1
            self.cache.drafted[source] += n
        return _draft(candidate, n, candidate.match_len)

    def _paying_nodes(self, candidate: Candidate, keys: list[tuple[str, int]], sizing: "Sizing") -> int:
        """How many of the candidate's nodes (its best-first order) to verify: all when not adaptive, else the
        prefix with the highest expected speed at this round's pass costs (a due probe: at least one)."""
        count = len(candidate.tokens)
        if not sizing.adaptive:
            return count
        capped: list[float] = []
        for key, parent in zip(keys, candidate.parents):
            rate = self.rates.rate(key)
            capped.append(min(rate, capped[parent]) if parent >= 0 else rate)
        best_n = best_prefix(capped, [0] * count, sizing.costs, 0.0)  # a walk of the trie: no drafting time to price
        if count and self.rates.probe_due(None, idle=best_n == 0, allowed=sizing.probing):
            return 1
        return best_n

    def _record(self, accepted_rows: Sequence[int]) -> None:
        """Every drafted node was accepted (on the accepted path) or not: its probability bucket's rate."""
        if self._last is None:
            return
        keys, source = self._last
        on_path = set(int(r) for r in accepted_rows)
        for row, key in enumerate(keys, start=1):
            self.rates.observe(key, 1.0 if row in on_path else 0.0)
        if self.cache is not None:
            self.cache.accepted[source] += sum(1 for row in on_path if row <= len(keys))
        self._last = None


def _draft(candidate: Candidate, n: int, match_len: int) -> Draft:
    """The first n nodes of `candidate` as a Draft: a chain when they form one, else a deterministic tree."""
    parents = candidate.parents[:n]
    tokens = [int(t) for t in candidate.tokens[:n]]
    if all(parent == i - 1 for i, parent in enumerate(parents)):
        return Draft(tokens, key=match_len)
    return Draft(tokens, tree=TreeSpec.from_parents([-1, *(p + 1 for p in parents)]), mode="deterministic", key=match_len)


def make_suffix(request: DrafterRequest) -> SuffixDrafter:
    """The registry's factory (drafters/registry.py): the runner's shared cache, drafting as it says."""
    cache = request.suffix_cache or SuffixCache()
    return SuffixDrafter(cache, cache.max_depth, cache.min_prob, cache.spec_factor, tree=cache.tree)
