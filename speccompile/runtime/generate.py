"""The decode loop: chunked prefill, then rounds of plan -> draft -> target pass -> verify -> commit.

A `Generation` is one prompt in progress. Its constructor prefills (runtime/prefill.py) and emits the first
token; each `step()` is one round, and `Generation.round` reads it top to bottom on one screen:

    1. plan    the draft positions that fit this round (`_draft_room`)
    2. draft   the carried chain, else `Drafter.propose` sized by the adaptive controller (`Sizing`)
    3. pass    one target pass over the pending token + the draft (`verify_pass`; the round yields it)
    4. verify  the request's logits, then the exact acceptance rule (`verify_draft`, runtime/verification.py)
    5. commit  KV rows kept, tokens emitted, the controller and the drafter told (`Drafter.observe`)

A batch decoder runs the same round per request through a narrow seam: `plan_step` (the round up to its
pass), the passes of several requests together, `complete_step` (the rest of the round); `Generation.SEAM`
names all it may use of a generation.
What one round hands the next is explicit: the verdict's `carried` tokens (a tree path accepted past a row
not computed as plain decoding) become `self.carried`, the next round's draft; a plain step's unverified
guess travels in its plan (`PlannedStep.guess`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Generator as Resumable, Hashable, Sequence

import numpy as np

from ..errors import InputError
from ..tokenizer import TextTokenizer
from .acceptance import AcceptanceRates
from .adaptive import GUESS, SEEDED_COSTS, AdaptiveController, Sizing
from .costs import FixedCosts, PassCostModel, PassCosts
from .backends.base import Session, StepOutput
from .constrained import GuidedPlan, OutputRules
from .drafters.base import Draft, Drafter, GenerationStart, Observation
from .kvcache import BufferKVCache, KVCache, causal_mask
from .options import GenerationConfig
from .output import TokenOutput, opening_text  # opening_text: served from here too
from .penalties import draft_paths
from .prefill import PromptPrefill
from .prefix_cache import check_resume
from .stats import GenerationResult, GenerationStats
from .timing import EngineClock, TimedSession
from .verification import Verdict, verify_draft

# A single stream's round after a chain of the full num_draft_tokens was accepted whole, from a drafter that `grows`,
# may hold this many times as many draft positions (replayed on greedy traces, docs/benchmarks.md "Gemma 3 copy":
# +2 % on Gemma 3's copy prompts, +8 % on its chat ones, SmolLM2's unchanged; a longer flat num_draft_tokens
# instead costs SmolLM2's copy 1-2 %)
DRAFT_GROWTH = 2


class Generator:
    """Speculative (or plain, with no drafter) generation over a target verify graph."""

    def __init__(
        self,
        target: Session,
        tokenizer: TextTokenizer | None,
        max_context: int,
        eos_token_ids: list[int],
        drafter: Drafter | None = None,
        max_verify_tokens: int = 64,
        pass_costs: PassCosts | None = None,
        clock: EngineClock | None = None,
        seeded_costs: FixedCosts | None = None,
        acceptance: AcceptanceRates | None = None,
        grow_drafts: bool = False,
    ):
        self.clock = clock or EngineClock()
        self.target = TimedSession(target, self.clock)
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.eos_ids = set(eos_token_ids)
        self.drafter = drafter
        self.max_verify_tokens = max_verify_tokens
        self.pass_costs = pass_costs if pass_costs is not None else PassCosts()  # the target's measured pass times
        self.seeded_costs = seeded_costs or SEEDED_COSTS  # seeded sampling's fixed ones (runtime/adaptive.py)
        # the draft acceptance its generations learn, carried from one to the next (None: each starts from the prior)
        self.acceptance = acceptance
        # a single stream's generations (not a batch's, whose passes are laid out for num_draft_tokens) let a drafter
        # that `grows` draft DRAFT_GROWTH x num_draft_tokens after a chain of num_draft_tokens was accepted whole
        self.growth = DRAFT_GROWTH if grow_drafts and drafter is not None and drafter.grows else 1

    def start(self, prompt_ids: list[int], config: GenerationConfig, on_text: Callable[[str], None] | None = None,
              cache: KVCache | BufferKVCache | None = None, prefilled: np.ndarray | None = None,
              cached_rows: int = 0, defer_prefill: bool = False) -> "Generation":
        """Prefill `prompt_ids` and emit the first token; `step()` the result until it is `done`.
        `cache`: the KV cache to decode into (default: a new one of the target's), empty or holding the
        prompt's first rows; `prefilled`: the prompt's last logits when `cache` holds all its rows already (a
        batched prefill, or a whole prompt from a prefix cache); `cached_rows`: rows `cache` holds from a
        prefix cache (runtime/prefix_cache.py): the prefill continues after them, so they must be rows a fresh prefill
        computes alike (any prefix on a row-invariant target, else whole `prefill_chunk`s; or the whole prompt, with
        `prefilled`).
        `defer_prefill`: prefill nothing yet; the caller runs `prefill_next_chunk()` until the generation is no
        longer `prefilling` (a batch driver interleaves the chunks with other requests' passes)."""
        return Generation(self, prompt_ids, config, on_text, cache, prefilled, cached_rows, defer_prefill)

    @property
    def resumes_prefill(self) -> bool:
        """Whether a generation may start from cached prompt rows with the drafter in the state a full
        prefill leaves: not when the drafter reads the target's hidden states of the prompt's passes."""
        return self.drafter is None or not self.drafter.reads_hidden_states

    def generate(self, prompt_ids: list[int], config: GenerationConfig,
                 on_text: Callable[[str], None] | None = None) -> GenerationResult:
        """Generate up to `config.max_tokens` tokens after `prompt_ids`."""
        generation = self.start(prompt_ids, config, on_text)
        while not generation.done:
            generation.step()
        return generation.result()


@dataclass
class PlannedStep:
    """One round's plan: the draft and the target pass it needs (the pending token + the draft, their positions
    and mask); for a plain step of a cheap drafter, its unverified one-token `guess` and that guess's proposal
    class (`plan_step(shadow=True)`)."""

    draft: Draft
    draft_seconds: float
    ids: np.ndarray  # int64 [q]
    positions: np.ndarray  # int64 [q]
    new_mask: np.ndarray  # bool [q, q]: causal (chain) or ancestry (tree)
    guess: tuple[int, Hashable] | None = None
    guided: GuidedPlan | None = None  # with output rules (a grammar, logprobs): the draft before the grammar's cut, the rows' masks
    rest: Resumable[PlannedStep, StepOutput, None] | None = field(default=None, repr=False)  # its round, after the pass


class Generation(PromptPrefill):
    """One prompt in progress: prefill, then `step()` until `done`, then `result()` (the module docstring
    shows a round)."""

    def __init__(self, generator: Generator, prompt_ids: list[int], config: GenerationConfig,
                 on_text: Callable[[str], None] | None, cache: KVCache | BufferKVCache | None = None,
                 prefilled: np.ndarray | None = None, cached_rows: int = 0, defer_prefill: bool = False):
        config.validate()
        if not prompt_ids:
            raise InputError("prompt: the prompt is empty", "prompt")
        if len(prompt_ids) + 1 > generator.max_context:
            raise InputError(f"prompt: {len(prompt_ids)} tokens exceed the artifact's max_context {generator.max_context}", "prompt")
        self.generator = generator
        self.config = config
        self.params = config.sampling
        self.rng = self.params.rng()
        self.stats = GenerationStats(prompt_tokens=len(prompt_ids), cached_tokens=cached_rows)
        if cached_rows or prefilled is not None:  # (a batched prefill: prefilled logits, no cached rows)
            check_resume(generator.drafter.name if not generator.resumes_prefill else None, generator.target.row_invariant,
                         config.prefill_chunk, len(prompt_ids), cached_rows, prefilled is not None)
        self._started = time.perf_counter()
        self._engine_start = generator.clock.seconds
        self.controller = AdaptiveController(
            num_draft_tokens=config.num_draft_tokens * generator.growth,  # the round's `room` is the cap (`_draft_room`)
            enabled=config.adaptive,
            deterministic=self.params.seed is not None and not self.params.greedy,
            relative_draft_cost=generator.drafter.relative_cost if generator.drafter is not None else 0.0,
            costs=generator.pass_costs,
            seeded=generator.seeded_costs,
            learned=generator.acceptance,
        )
        self.drafter = generator.drafter if config.num_draft_tokens > 0 else None
        self._whole_at_most = False  # the last round's chain held num_draft_tokens and was accepted whole
        self.cache = cache if cache is not None else generator.target.new_cache()
        self.output = TokenOutput(generator.tokenizer, config, generator.eos_ids, on_text)
        self.rules = (OutputRules(self.params, config.constraint, config.logprobs)
                      if config.constraint is not None or config.logprobs is not None else None)  # runtime/constrained.py
        if cached_rows and self.cache.length != cached_rows:
            raise ValueError(f"the cache holds {self.cache.length} rows, {cached_rows} expected")
        self.prompt_ids = list(prompt_ids)
        self.tokens = list(prompt_ids)
        if self.drafter is not None:  # this generation's own draws; seeded sampling forgets what was learnt
            self.drafter.start(GenerationStart(self.prompt_ids, config.user, self.params, self.params.drafter_rng(),
                                               fresh=self.controller.deterministic, tuning=config.draft_tuning))
        self.done, self.finish = False, None
        # the prompt's last logits (what a prefix cache keeps); None before the first token, and when the graph's ArgMax
        # chose it (greedy on a graph that computes it: the row stays on the device)
        self.prompt_logits: np.ndarray | None = None
        self._first_chosen = False
        self.carried: list[int] = []  # the last verdict's tokens past an exactness cut: the next round's draft
        self._logit_trace: list[np.ndarray] | None = [] if config.trace_logits else None
        self._prefilled_rows = cached_rows
        if prefilled is not None:
            self.stats.prefill_passes = int(cached_rows < len(prompt_ids))
            self._first_token(prefilled)
        elif not defer_prefill:
            while self.prefilling:
                self.prefill_next_chunk()

    # -- a round: plan -> draft -> pass -> verify -> commit ----------------------------------------------

    def step(self) -> None:
        """One round (sets `done` when the generation ends): `round`, with this generation's own target pass."""
        plan = self.plan_step()
        if plan is not None:
            self.complete_step(plan, self.verify_pass(plan))

    def round(self, drafting: bool = True, shadow: bool = False, costs: PassCostModel | None = None,
              probing: bool = True) -> Resumable[PlannedStep, StepOutput, None]:
        """One round, top to bottom. It stops at the target pass: it yields the pass it needs and resumes with
        that pass's output, so `step()` runs the pass itself and a batch decoder runs several requests' passes
        together (`plan_step`, then `complete_step`). The arguments: `plan_step`'s."""
        # 1. plan: how many draft positions fit this round (the context, the verify pass, max_tokens; 0: none)
        room = self._draft_room() if drafting else 0
        # 2. draft: the last verdict's tokens past an exactness cut, else the drafter's proposal, as many as pay
        carried, self.carried = self.carried, []
        draft, draft_seconds = Draft([]), 0.0
        if room > 0:
            draft, draft_seconds = ((Draft(carried[:room], carried=True), 0.0) if carried
                                    else self._propose(self.controller.sizing(room, costs, probing)))
        guided = None
        if self.rules is not None:  # the draft cut where the grammar refuses it; its rows' masks start computing
            draft, guided = self.rules.plan(draft, room)
        guess = self._guess() if shadow and not draft.tokens else None
        plan = self._lay_out(draft, draft_seconds, guess, guided)
        if plan is None:  # no room in the context for the pending token's pass
            self.finish, self.done = "context", True
            return
        # 3. pass: one target pass over the pending token + the draft, run by the caller (`verify_pass`)
        out = yield plan
        # 4. verify: the request's logits (penalties, its grammar's mask), then the exact acceptance rule
        if self.config.adjusts_logits:
            out = self._adjusted(plan, out)
        if guided is not None:
            out = self.rules.masked(guided, out)
        verdict = verify_draft(draft, self.tokens[-1], out, self.params, self.rng)
        # 5. commit: keep the accepted rows' KV, emit tokens until a stop, tell the controller and the drafter
        self.cache.append(out.presents, verdict.kept_rows, len(plan.ids))
        used = self._emit(verdict, out)
        self.carried = verdict.carried  # the next round's draft
        self.stats.exact_cuts += int(bool(verdict.carried))
        self.stats.target_passes += 1
        own, own_rows = self._learn(plan, verdict, used)
        if self.drafter is not None:
            rows = verdict.kept_rows
            hidden = out.hidden[rows] if out.hidden is not None else None
            self.drafter.observe(Observation([int(plan.ids[r]) for r in rows], hidden, verdict.tokens[-1], own, own_rows))
        if self.done:
            self.cache.truncate(len(self.tokens) - 1)  # never keep rows past the stop

    # -- the seam a batch decoder drives: plan_step, (its passes), complete_step ----------------------------

    def plan_step(self, drafting: bool = True, shadow: bool = False, costs: PassCostModel | None = None,
                  probing: bool = True) -> PlannedStep | None:
        """The next `round` up to its target pass: the draft (none unless `drafting`) and the pass's inputs; None
        when the context is full (then `done`). A batch driver runs the passes of several generations together
        between `plan_step` and `complete_step`, and prices the round: `costs`, the pass costs this request sees
        at the batch's load (default: its controller's), `probing`, whether a due probe may draft now. `shadow`: a
        plain step still asks a drafter that guesses for one token (`PlannedStep.guess`), and the commit tells
        the controller whether it was the token chosen (its acceptance keeps being measured while a batch makes
        drafting too dear to try)."""
        rest = self.round(drafting, shadow, costs, probing)
        plan = next(rest, None)
        if plan is not None:
            plan.rest = rest
        return plan

    def verify_pass(self, plan: PlannedStep) -> StepOutput:
        """One target pass over the pending token and the draft (chain: causal; tree: ancestry mask)."""
        t0 = time.perf_counter()
        out = self.generator.target.run(plan.ids, plan.positions, self.cache.attention_mask(plan.new_mask), self.cache)
        self.shared_pass(time.perf_counter() - t0, len(plan.ids))
        return out

    def complete_step(self, plan: PlannedStep, out: StepOutput) -> None:
        """The rest of the plan's `round` with its pass's output: verify, then commit."""
        try:
            plan.rest.send(out)
        except StopIteration:
            return
        raise RuntimeError("a round runs one target pass")

    # the rest of the seam: what a batch decoder asks of a generation besides its round (tests/test_code_shape.py
    # checks that runtime/batch*.py use only these, `done`, the prefill's steps and the cache it handed in)
    SEAM = ("plan_step", "verify_pass", "complete_step", "done", "cache",  # the round; the KV cache the passes handed in
            "prefilling", "prefill_remaining", "prefill_last_chunk", "prefill_next_chunk", "next_prefill_chunk",
            "prefilled_chunk",  # the prefill's steps (runtime/prefill.py)
            "pending_token", "paced_alone", "num_draft_tokens", "rows_wanted", "expected_tokens", "shared_pass",
            "charge_engine", "prompt_to_keep")

    @property
    def pending_token(self) -> int:
        """The last token chosen, not yet in the KV cache (a plain step's row)."""
        return self.tokens[-1]

    @property
    def paced_alone(self) -> bool:
        """Whether its draft sizing ignores the batch's load: seeded sampling (fixed costs) or not adaptive."""
        return self.controller.deterministic or not self.config.adaptive

    @property
    def num_draft_tokens(self) -> int:
        """The most draft positions a round of it may hold (the configured `num_draft_tokens`)."""
        return self.config.num_draft_tokens

    @property
    def rows_wanted(self) -> int:
        """KV rows its cache may need by the end of its next round (its rows and a verify pass)."""
        return self.cache.length + self.generator.max_verify_tokens

    def expected_tokens(self, plan: PlannedStep) -> float:
        """Tokens it expects from its planned step: 1 for a plain step, a carried chain's all (accepted once), else
        its controller's estimate for the draft's depth and kind."""
        draft = plan.draft
        if not draft.tokens:
            return 1.0
        if draft.carried:
            return 1.0 + len(draft.tokens)
        return self.controller.expected_tokens(draft.depth, draft.key)

    def shared_pass(self, seconds: float, rows: int | None = None) -> None:
        """Its pending rows ran in a target pass of `seconds` (shared, or its own): its verify time; `rows`: its rows
        in that pass, priced into its controller (what a pass over that many rows costs it)."""
        self.stats.time_verify += seconds
        if rows is not None:
            self.controller.record_pass(rows, seconds)

    def charge_engine(self, seconds: float) -> None:
        """Advance the engine clock its runner's generations share by a pass run outside `verify_pass`."""
        self.generator.clock.seconds += seconds

    def prompt_to_keep(self) -> tuple[list[int], np.ndarray, int] | None:
        """(prompt, its last logits, prefill_chunk) for a prefix cache once prefilled; None when its rows are not a
        fresh prefill's to share (a drafter reads the prompt's hidden states; the graph's ArgMax kept the logits)."""
        if self.prefilling or self.prompt_logits is None or not self.generator.resumes_prefill:
            return None
        return self.prompt_ids, self.prompt_logits, self.config.prefill_chunk

    # -- the round's steps, in detail ------------------------------------------------------------------

    def _draft_room(self) -> int:
        """Draft positions this round may hold: num_draft_tokens (x `Generator.growth` after a chain of that many was
        accepted whole), what fits in the context and in one verify pass from here (`Session.pass_rows`), what
        max_tokens leaves (0 without a drafter). The grammar's forced tokens extend a speculative chain up to it too."""
        if self.drafter is None:
            return 0
        fits = self._rows_here() - 1  # draft rows that fit next to the pending token
        remaining = self.config.max_tokens - len(self.output.tokens)
        most = self.config.num_draft_tokens * (self.generator.growth if self._whole_at_most else 1)
        return max(0, min(most, remaining - 1, self.generator.max_verify_tokens - 1, fits))

    def _propose(self, sizing: Sizing) -> tuple[Draft, float]:
        """The drafter's proposal and the seconds it took (empty: a tree wider than the context has room for)."""
        t0 = time.perf_counter()
        draft = self.drafter.propose(self.tokens, sizing)
        seconds = time.perf_counter() - t0
        self.stats.time_draft += seconds
        if len(draft.tokens) > self._rows_here() - 1:  # verify the pending token alone (a slot pass cannot split a tree)
            return Draft([]), seconds
        return draft, seconds

    def _rows_here(self) -> int:
        """Rows the next pass may hold: what the context leaves, and one pass of the target from here."""
        length = self.cache.length
        return min(self.generator.max_context - length, self.generator.target.pass_rows(length))

    def _guess(self) -> tuple[int, Hashable] | None:
        """The drafter's one-token guess for a plain step, and its proposal class (None: no guess)."""
        if self.drafter is None or not self.drafter.guesses or not self.config.adaptive or self.controller.deterministic:
            return None
        guess = self.drafter.propose(self.tokens, GUESS)
        return (int(guess.tokens[0]), guess.key) if guess.tokens else None

    def _lay_out(self, draft: Draft, draft_seconds: float, guess: tuple[int, Hashable] | None,
                 guided: GuidedPlan | None) -> PlannedStep | None:
        """The target pass over the pending token + `draft`: ids, positions by depth, a causal (chain) or ancestry
        (tree) mask; None when the context has no room for it."""
        q = 1 + len(draft.tokens)
        self.cache.maybe_compact(q, self.generator.max_context)
        if self.cache.length + q > self.generator.max_context:
            return None
        past = self.cache.length
        if draft.tree is not None:
            new_mask, positions = draft.tree.ancestry, past + draft.tree.depths
        else:
            new_mask, positions = causal_mask(q), np.arange(past, past + q)
        return PlannedStep(draft, draft_seconds, np.asarray([self.tokens[-1], *draft.tokens]), positions, new_mask, guess, guided)

    def _adjusted(self, plan: PlannedStep, out: StepOutput) -> StepOutput:
        """The pass's rows with the request's logit bias and penalties, each row after its own history: the output so
        far, then the draft tokens on its path (runtime/penalties.py); the graph's own argmax dropped."""
        rows, tree = len(plan.ids), plan.draft.tree
        paths = draft_paths(rows, plan.draft.tokens, None if tree is None else tree.parents)
        logits = self.config.penalties.apply(out.logits[:rows], self.prompt_ids, self.tokens[len(self.prompt_ids):], paths)
        return StepOutput(logits, out.presents, out.hidden, None, out.plain_exact)  # (a plain output: any backend's)

    def _emit(self, verdict: Verdict, out: StepOutput) -> int:
        """Push the verdict's tokens until a stop; returns how many were used (the stopping one included)."""
        if self._logit_trace is not None:  # the rows whose logits chose the emitted tokens, in order
            self._logit_trace += [np.array(out.logits[row]) for row in verdict.token_rows]
        used, before = 0, len(self.output.tokens)
        for token in verdict.tokens:
            used += 1
            self.tokens.append(token)
            if self.output.push(token):
                self.done = True
                break
        if self.rules is not None:  # the grammar advances over the used tokens; their logprobs from the rows that chose them
            self.rules.emit(out.logits[verdict.token_rows[:used]], verdict.tokens[:used], len(self.output.tokens) - before)
        self.output.flush()
        self.finish = self.output.finish
        return used

    def _learn(self, plan: PlannedStep, verdict: Verdict, used: int) -> tuple[Draft | None, Sequence[int]]:
        """Statistics and the controller's feedback from one verdict; returns the drafter's own proposal and its
        accepted rows, for the drafter to hear (None: the pass verified none of its proposal)."""
        draft = plan.draft
        self._whole_at_most = False  # (set below: this round's own chain of num_draft_tokens or more, accepted whole)
        if plan.guess is not None:
            token, key = plan.guess
            self.controller.rates.observe_chain(key, 1, int(verdict.tokens[0] == token))
        if not draft.tokens:
            return None, ()
        accepted = len(verdict.accepted_rows)
        self.stats.draft_steps += 1
        self.stats.count_draft(draft.depth, min(accepted, used - 1))  # drafts past a stop were not used
        if draft.carried:  # a carried chain is not the drafter's proposal: its verdict says nothing of it
            return None, ()
        if plan.guided is not None:  # the drafter and its controller hear of its own proposal (grammar: cut, forced tokens)
            own = plan.guided.drafted_depth(draft)
            if not own:
                return None, ()
            self.controller.record_draft(own, min(accepted, own), plan.draft_seconds, draft.key, draft.drafted_levels)
            return plan.guided.proposed, plan.guided.proposed_rows(verdict.accepted_rows)
        self.controller.record_draft(draft.depth, accepted, plan.draft_seconds, draft.key, draft.drafted_levels)
        self._whole_at_most = draft.tree is None and accepted == len(draft.tokens) >= self.config.num_draft_tokens
        return draft, verdict.accepted_rows

    # -- the end -----------------------------------------------------------------------------------

    def result(self) -> GenerationResult:
        """The finished generation (call once `done`)."""
        self.output.flush(final=True)
        if self.drafter is not None:
            self.drafter.observe(Observation(finished=self.tokens))
        stats = self.stats
        stats.generated_tokens = len(self.output.tokens)
        stats.end_tokens = int(self.finish == "stop" and self.tokens[-1] in self.generator.eos_ids and not self.config.ignore_eos)
        stats.time_total = time.perf_counter() - self._started
        stats.time_engine = self.generator.clock.seconds - self._engine_start
        stats.compactions = self.cache.compactions
        return self.output.result(self.finish, stats, self._logit_trace)

