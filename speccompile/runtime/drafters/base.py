"""The drafter contract: what a drafter gives the decode loop (`Draft`), the three calls the loop makes (`Drafter`:
start, propose, observe; what they carry: `GenerationStart`, `Sizing`, `Observation`) and what a drafter is
built from (`DrafterRequest`, drafters/registry.py)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Hashable, Sequence

import numpy as np

from ...draft_config import DraftConfig
from ...errors import InputError
from ..options import DraftTuning
from ..sampling import SamplingParams
from ..timing import EngineClock
from ..tree import TreeSpec
from .ngram_corpus import NgramCorpus

if TYPE_CHECKING:
    from ..adaptive import Sizing  # the loop's sizing of a round
    from ...manifest import Manifest
    from ..artifact import Artifact
    from ..suffix_cache import SuffixCache


@dataclass
class Draft:
    """Proposed tokens: a chain, or a tree when `tree` is set.

    Chain: `tokens` continue the pending token; `probs` [k, V] is the distribution each token was drawn
    from (None = one-hot, a deterministic drafter).
    Tree: `tree`'s node 0 is the pending token and `tokens` are the tokens of nodes 1..n-1; `mode` is
    "deterministic" (top-k children) or "iid"/"iid_without_replacement" with `child_probs[u]` the
    distribution the children of node u were drawn from.
    `key`: the proposal's reliability class, for a per-class acceptance estimate (the n-gram match length;
    None: the drafter's one class). `levels`: the drafter calls behind it, when fewer than its depth (a
    lookup branch costs none). `carried`: the generation loop's own chain (the rest of a verdict cut at an
    inexact row, runtime/verification.py), not the drafter's proposal.
    """

    tokens: list[int]
    probs: np.ndarray | None = None
    tree: TreeSpec | None = None
    mode: str = "deterministic"
    child_probs: Sequence[np.ndarray | None] | None = None
    key: Hashable = None
    levels: int | None = None
    carried: bool = False

    @property
    def drafted_levels(self) -> int:
        """Levels the drafter ran to make this draft (what its drafting time is spread over)."""
        return self.depth if self.levels is None else self.levels

    @property
    def depth(self) -> int:
        """Draft positions covered (chain length, or tree depth)."""
        return int(self.tree.max_depth) if self.tree is not None else len(self.tokens)


@dataclass(frozen=True)
class GenerationStart:
    """What a drafter hears when a generation starts (`Drafter.start`): the prompt, who sent it (a server's
    `user`: whose earlier text it may draft from), the generation's sampling settings and a random generator
    for it alone (`SamplingParams.drafter_rng()`), and `fresh`: forget what was learnt across generations too
    (seeded sampling, whose output must depend on this generation alone); `tuning`: its own settings in place of
    the drafter's (runtime/options.py `DraftTuning`; the drafters that have them apply them here)."""

    prompt_ids: Sequence[int] = ()
    user: str | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    rng: np.random.Generator | None = None
    fresh: bool = False
    tuning: DraftTuning = field(default_factory=DraftTuning)


@dataclass(frozen=True)
class Observation:
    """What happened after a target pass (`Drafter.observe`).

    `tokens`: the tokens of the rows the pass committed (a prompt chunk, or the pending token + the accepted
    drafts); `hidden`: their hidden states [m, H] when the target graph returns them (else None);
    `next_token`: the token that follows the last row (None after the prompt's last chunk: the first token is
    not chosen yet).
    `draft`: the drafter's own proposal this pass verified (None: a prefill chunk, a plain step, a carried
    chain, or a proposal a grammar cut away entirely), `accepted_rows`: its accepted rows (1-based draft
    nodes, in path order). `finished`: the generation's whole history (prompt + output) once it ended; an
    event that carries it has no rows."""

    tokens: Sequence[int] = ()
    hidden: np.ndarray | None = None
    next_token: int | None = None
    draft: Draft | None = None
    accepted_rows: Sequence[int] = ()
    finished: Sequence[int] | None = None


class Drafter(ABC):
    """What every drafter offers the decode loop: three calls, and declared capabilities.

    start(start)             a generation begins (`GenerationStart`: prompt, tenant, sampling, its own
                             generator, whether to forget learnt state)
    propose(tokens, sizing)  the round's draft after `tokens`: at most `sizing.room` positions (chain tokens,
                             tree depth), as many as pay (`sizing.choose_k`, or the tree planner); a tree is
                             declared in the `Draft` itself (`tree`, `mode`, `child_probs`). With
                             `sizing.guess` (only for a drafter that declares `guesses`): a plain step's
                             one-token guess, whose verdict the drafter never hears (the loop keeps measuring
                             its acceptance while a batch makes drafting too dear)
    observe(observation)     after every target pass: the verdict on its own draft's rows, the committed rows'
                             tokens and hidden states, the next token; and once, the finished history

    Declared capabilities: `reads_hidden_states` (observe() needs the target's hidden states of every row, the
    prompt's too), `guesses` (its proposals cost nothing: it may be asked for a plain step's guess),
    `grows` (its chains copy runs that go on: after a chain of the full `num_draft_tokens` was accepted whole, a
    single stream's next round may hold `DRAFT_GROWTH` times as many, runtime/generate.py),
    `relative_cost` (the prior cost of one draft position in one-token target passes: seeded sampling).

    One drafter object serves every sampling setting and seed: a Runner builds one for the generations it runs
    one after another, a batch one per request (their graphs in one shared session), so what a factory loads
    (sessions, weights) is loaded once. A drafter that samples its proposals takes the settings and the
    generator `start` hands it (made anew for every generation from the request's seed, never shared with
    another generation) and draws from that generator only: a seeded request's drafts then depend on the
    request alone, not on earlier generations or on the requests beside it.
    """

    name: str = "drafter"
    relative_cost: float = 0.0
    reads_hidden_states: bool = False
    guesses: bool = False
    grows: bool = False

    def start(self, start: GenerationStart) -> None:
        """A generation begins: forget per-sequence state (`start.fresh`: learnt statistics too)."""

    @abstractmethod
    def propose(self, tokens: list[int], sizing: "Sizing") -> Draft:
        """A draft that continues `tokens` (the committed sequence, last one pending), sized by `sizing`."""

    def observe(self, observation: Observation) -> None:
        """What the last target pass committed and what became of this drafter's draft (`Observation`)."""


@dataclass(frozen=True)
class DrafterRequest:
    """What a factory builds a drafter from: the opened artifact, what to draft (`draft.kind`, its tree and k)
    and the clock its graphs are timed on (no sampling settings: they come per generation, `Drafter.start`).
    `lookup_branch` (heads): add the n-gram lookup continuation to every tree; `ngram_corpus`: the n-gram
    drafter's fallback; `shared_session`: its graph runs in the artifact's shared session (`Artifact.session`);
    `suffix_cache`: the suffix drafter's store of earlier responses and settings (one per runner)."""

    artifact: "Artifact"
    draft: DraftConfig
    clock: EngineClock
    lookup_branch: bool = True
    ngram_corpus: NgramCorpus | None = None
    shared_session: bool = False
    suffix_cache: "SuffixCache | None" = None

    def exported_section(self) -> dict:
        """The artifact's drafter section (`exported_section`)."""
        return exported_section(self.artifact.manifest, self.draft.kind)


def exported_section(manifest: "Manifest", kind: str) -> dict:
    """The manifest's section of drafter `kind`; InputError when the artifact was exported without it."""
    section = manifest.drafter or {}
    if section.get("kind") != kind:
        raise InputError(f"drafter {kind}: this artifact was exported without it (re-export it with that drafter: "
                         f"speccompile export --drafter {kind}:PATH; exported drafter: {section.get('kind') or 'none'})",
                         "drafter")
    return section
