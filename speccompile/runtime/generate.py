"""The draft -> verify -> accept loop: chunked prefill, exact verification, stops, streaming, stats."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Hashable

import numpy as np

from ..errors import InputError
from ..tokenizer import TextTokenizer
from .adaptive import AdaptiveController, PassCosts
from .backends.base import Session, StepOutput
from .backends.tree_layout import exact_acceptance
from .constrained import GuidedPlan, OutputRules
from .logprobs import TokenLogprob
from .drafters.base import Draft, Drafter
from .kvcache import BufferKVCache, KVCache
from .options import GenerationConfig
from .sampling import SamplingParams, greedy_path, process_logits, sample, verify_chain, verify_tree
from .timing import EngineClock, TimedSession


@dataclass
class GenerationStats:
    """Counters of one generation; times in seconds."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    target_passes: int = 0  # passes that produced tokens: the last prefill chunk + every decode pass
    prefill_passes: int = 0
    cached_tokens: int = 0  # prompt rows taken from a prefix cache instead of prefilled
    draft_steps: int = 0
    drafted: list[int] = field(default_factory=list)  # per draft position: how often a token was drafted there
    accepted: list[int] = field(default_factory=list)  # per draft position: how often it was accepted
    time_total: float = 0.0
    time_prefill: float = 0.0
    time_draft: float = 0.0
    time_verify: float = 0.0
    time_engine: float = 0.0  # inside engine calls (target and draft graphs)
    compactions: int = 0
    end_tokens: int = 0  # the eos token that ended generation: produced by a target pass, not part of the output
    exact_cuts: int = 0  # verdicts cut at a tree row not computed as plain decoding (its rest carried to the next pass)

    def count_draft(self, drafted: int, accepted: int) -> None:
        while len(self.drafted) < drafted:
            self.drafted.append(0)
            self.accepted.append(0)
        for i in range(drafted):
            self.drafted[i] += 1
            self.accepted[i] += int(i < accepted)

    @property
    def produced_tokens(self) -> int:
        """Tokens the target passes produced: the output plus the eos that ended it."""
        return self.generated_tokens + self.end_tokens

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per target pass, the ending eos included (exactly 1.0 for plain decoding)."""
        return self.produced_tokens / self.target_passes if self.target_passes else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted, self.drafted)]

    @property
    def decode_time(self) -> float:
        return max(self.time_total - self.time_prefill, 1e-9)

    @property
    def tokens_per_second(self) -> float:
        """Decode speed: generated tokens after the first, over the time after prefill."""
        return max(self.generated_tokens - 1, 0) / self.decode_time

    @property
    def overhead_fraction(self) -> float:
        """Share of wall time spent outside engine calls (Python, sampling, drafting logic)."""
        return max(0.0, self.time_total - self.time_engine) / max(self.time_total, 1e-9)

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "end_tokens": self.end_tokens,
            "target_passes": self.target_passes,
            "prefill_passes": self.prefill_passes,
            "cached_tokens": self.cached_tokens,
            "draft_steps": self.draft_steps,
            "exact_cuts": self.exact_cuts,
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "drafted_per_position": self.drafted,
            "accepted_per_position": self.accepted,
            "acceptance_per_position": [round(x, 4) for x in self.acceptance_per_position],
            "tokens_per_second": round(self.tokens_per_second, 3),
            "time_total_s": round(self.time_total, 4),
            "time_prefill_s": round(self.time_prefill, 4),
            "time_draft_s": round(self.time_draft, 4),
            "time_verify_s": round(self.time_verify, 4),
            "time_engine_s": round(self.time_engine, 4),
            "overhead_fraction": round(self.overhead_fraction, 4),
            "kv_compactions": self.compactions,
        }


@dataclass
class GenerationResult:
    tokens: list[int]
    text: str
    finish_reason: str  # "stop" (eos or stop string), "length" (max_tokens) or "context" (limit reached)
    stats: GenerationStats
    logits: np.ndarray | None = None  # with GenerationConfig.trace_logits: [tokens, vocab], the logits each token was chosen from
    logprobs: list[TokenLogprob] | None = None  # with GenerationConfig.logprobs: one entry per token


class _Output:
    """Collects emitted tokens and applies eos / stop strings / max_tokens; streams text deltas."""

    def __init__(self, tokenizer: TextTokenizer | None, config: GenerationConfig, eos_ids: set[int], on_text):
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


def choose_first_token(prompt_logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """The first generated token, from the prompt's last logits (the generation's first draw of `rng`)."""
    return int(np.argmax(prompt_logits)) if params.greedy else sample(process_logits(prompt_logits, params), rng)


def opening_text(tokenizer: TextTokenizer, eos_ids: set[int], config: GenerationConfig, prompt_logits: np.ndarray) -> str | None:
    """The text a generation of `config` whose prompt ends in `prompt_logits` streams with its first token, known
    before it starts: a server sends it at once for a prompt whose logits a prefix cache holds. None when that
    text is not fixed by the logits (sampling without a seed), when the first token ends the generation, or
    when it streams nothing yet (held back for a stop string or an incomplete character)."""
    if not config.sampling.greedy and config.sampling.seed is None:
        return None
    sent: list[str] = []
    output = _Output(tokenizer, config, eos_ids, sent.append)
    if output.push(choose_first_token(prompt_logits, config.sampling, config.sampling.rng())):
        return None
    output.flush()
    return sent[0] if sent else None


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
    ):
        self.clock = clock or EngineClock()
        self.target = TimedSession(target, self.clock)
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.eos_ids = set(eos_token_ids)
        self.drafter = drafter
        self.max_verify_tokens = max_verify_tokens
        self.pass_costs = pass_costs if pass_costs is not None else PassCosts()  # the target's measured pass times

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
    """One round's draft and the target pass it needs: the pending token + the draft, their positions and mask."""

    draft: Draft
    draft_seconds: float
    ids: np.ndarray  # int64 [q]
    positions: np.ndarray  # int64 [q]
    new_mask: np.ndarray  # bool [q, q]: causal (chain) or ancestry (tree)
    guided: GuidedPlan | None = None  # with output rules (a grammar, logprobs): the draft before the grammar's cut, the rows' masks


class Generation:
    """One prompt in progress. Each `step()` is one draft -> verify -> commit round:

    planned = self.plan_step()          the drafter's proposal (sized by the adaptive controller) + pass inputs
    out = self.verify_pass(planned)     one target pass over the pending token + the draft
    accepted, emitted = _verify_draft(draft, ...)   exact acceptance (greedy or the chain/tree rule)
    self._commit(draft, out, accepted, emitted)     KV rows kept, drafter told, tokens emitted
    """

    def __init__(self, generator: Generator, prompt_ids: list[int], config: GenerationConfig,
                 on_text: Callable[[str], None] | None, cache: KVCache | BufferKVCache | None = None,
                 prefilled: np.ndarray | None = None, cached_rows: int = 0, defer_prefill: bool = False):
        config.validate()
        if not prompt_ids:
            raise InputError("--prompt: the prompt is empty")
        if len(prompt_ids) + 1 > generator.max_context:
            raise InputError(f"--prompt: {len(prompt_ids)} tokens exceed the artifact's max_context {generator.max_context}")
        self.generator = generator
        self.config = config
        self.params = config.sampling
        self.rng = self.params.rng()
        self.stats = GenerationStats(prompt_tokens=len(prompt_ids), cached_tokens=cached_rows)
        if cached_rows:
            _check_resume(generator, config, len(prompt_ids), cached_rows, prefilled is not None)
        self._started = time.perf_counter()
        self._engine_start = generator.clock.seconds
        self.controller = AdaptiveController(
            max_k=config.num_draft_tokens,
            enabled=config.adaptive,
            deterministic=self.params.seed is not None and not self.params.greedy,
            relative_draft_cost=generator.drafter.relative_cost if generator.drafter is not None else 0.0,
            costs=generator.pass_costs,
        )
        self.drafter = generator.drafter if config.num_draft_tokens > 0 else None
        if self.drafter is not None:
            self.drafter.reset()
            self.drafter.plan_with(self.controller.relative_costs if config.adaptive else None, fresh=self.controller.deterministic)
        self.cache = cache if cache is not None else generator.target.new_cache()
        self.output = _Output(generator.tokenizer, config, generator.eos_ids, on_text)
        self.rules = (OutputRules(self.params, config.constraint, config.logprobs)
                      if config.constraint is not None or config.logprobs is not None else None)  # runtime/constrained.py
        if cached_rows and self.cache.length != cached_rows:
            raise ValueError(f"the cache holds {self.cache.length} rows, {cached_rows} expected")
        self.prompt_ids = list(prompt_ids)
        self.tokens = list(prompt_ids)
        self.done, self.finish = False, None
        self.prompt_logits: np.ndarray | None = None  # the prompt's last logits (what a prefix cache keeps)
        self._logit_trace: list[np.ndarray] | None = [] if config.trace_logits else None
        self._carried: list[int] = []  # an accepted tree path's tokens past an exactness cut: the next draft
        self._shadow: tuple[int, Hashable] | None = None  # a plain step's unverified guess (`plan_step(shadow=True)`)
        self._prefilled_rows = cached_rows
        if prefilled is not None:
            self.stats.prefill_passes = int(cached_rows < len(prompt_ids))
            self._first_token(prefilled)
        elif not defer_prefill:
            while self.prefilling:
                self.prefill_next_chunk()

    @property
    def prefilling(self) -> bool:
        """Whether the prompt is not prefilled yet (no first token; `defer_prefill`)."""
        return self.prompt_logits is None

    @property
    def prefill_remaining(self) -> int:
        """Prompt tokens still to prefill."""
        return len(self.prompt_ids) - self._prefilled_rows if self.prefilling else 0

    def prefill_next_chunk(self) -> None:
        """The next `prefill_chunk` tokens of the prompt (chunks start at position 0, or after whole cached
        chunks, as in a prefill at once); after the last one, the first token."""
        if not self.prefilling:
            raise RuntimeError("the prompt is prefilled already")
        prompt, start = self.prompt_ids, self._prefilled_rows
        ids = prompt[start: start + self.config.prefill_chunk]
        q = len(ids)
        mask = self.cache.attention_mask(np.tril(np.ones((q, q), dtype=bool)))
        out = self.generator.target.run(np.asarray(ids), np.arange(start, start + q), mask, self.cache, last_logits_only=True)
        self.cache.append(out.presents, range(q), q)
        self.stats.prefill_passes += 1
        if self.drafter is not None and out.hidden is not None:
            following = prompt[start + q] if start + q < len(prompt) else None
            self.drafter.observe(out.hidden, list(ids), following)
        self._prefilled_rows = start + q
        if self._prefilled_rows == len(prompt):
            self._first_token(out.logits[-1])

    def _first_token(self, last_logits: np.ndarray) -> None:
        """The prompt is prefilled: choose and emit the first token."""
        self.prompt_logits = last_logits
        self.stats.time_prefill = time.perf_counter() - self._started
        self.stats.target_passes = 1 if self.stats.prefill_passes else 0  # none on a whole-prompt cache hit
        if self.rules is not None:
            last_logits = self.rules.first_logits(last_logits)
        first = choose_first_token(last_logits, self.params, self.rng)
        if self._logit_trace is not None:
            self._logit_trace.append(np.array(last_logits))
        self.tokens = self.prompt_ids + [first]
        self.done = self.output.push(first)
        if self.rules is not None:
            self.rules.emit(last_logits[None], [first], len(self.output.tokens))
        self.output.flush()
        self.finish = self.output.finish

    # -- the steps ---------------------------------------------------------------------------------

    def step(self) -> None:
        """One draft -> verify -> commit round (sets `done` when generation ends)."""
        planned = self.plan_step()
        if planned is None:
            return
        self.complete_step(planned, self.verify_pass(planned))

    def plan_step(self, drafting: bool = True, shadow: bool = False) -> "PlannedStep | None":
        """The draft (none unless `drafting`) and the target pass inputs of the next round; None when the context
        is full (then `done`). A batch driver runs the passes of several generations together between
        `plan_step` and `complete_step`. `shadow`: a plain step of a cheap drafter still asks it for one token,
        and `complete_step` tells the controller whether it was the token chosen (its acceptance keeps being
        measured while a batch makes drafting too dear to try)."""
        carried, self._carried = self._carried, []
        draft, draft_seconds = self._choose_draft(carried) if drafting else (Draft([]), 0.0)
        guided = None
        if self.rules is not None:
            draft, guided = self.rules.plan(draft)
        self._shadow = None
        drafter = self.drafter
        if (shadow and not draft.tokens and drafter is not None and drafter.cheap_proposals and self.config.adaptive
                and not self.controller.deterministic):
            guess = drafter.propose(self.tokens, 1)
            if guess.tokens and guess.tree is None:
                self._shadow = (int(guess.tokens[0]), drafter.proposal_key)
        q = 1 + len(draft.tokens)
        self.cache.maybe_compact(q, self.generator.max_context)
        if self.cache.length + q > self.generator.max_context:
            self.finish, self.done = "context", True
            return None
        past = self.cache.length
        if draft.tree is not None:
            new_mask, positions = draft.tree.ancestry, past + draft.tree.depths
        else:
            new_mask, positions = np.tril(np.ones((q, q), dtype=bool)), np.arange(past, past + q)
        return PlannedStep(draft, draft_seconds, np.asarray([self.tokens[-1], *draft.tokens]), positions, new_mask, guided)

    def complete_step(self, planned: "PlannedStep", out: StepOutput) -> None:
        """Verify the pass's logits against the draft and commit the round."""
        draft = planned.draft
        if planned.guided is not None:
            out = self.rules.masked(planned.guided, out)
        accepted_rows, emitted = _verify_draft(draft, self.tokens[-1], out, self.params, self.rng)
        if self._shadow is not None and not draft.tokens:
            guess, key = self._shadow
            self.controller.rates.observe_chain(key, 1, int(emitted[0] == guess))
        if out.plain_exact is not None:  # a tree laid out main path first: only rows computed as plain decoding count
            verdict = emitted
            accepted_rows, emitted = exact_acceptance(accepted_rows, emitted, out.plain_exact)
            # what the cut left of the verdict is proposed again, as a chain the next pass computes exactly
            self._carried = verdict[len(emitted):]
            self.stats.exact_cuts += int(bool(self._carried))
        self._commit(planned, out, accepted_rows, emitted)

    def _choose_draft(self, carried: list[int] | None = None) -> tuple[Draft, float]:
        """The drafter's proposal for this step, sized by what pays and what fits (empty: a plain step).
        `carried`: the tokens an exactness cut left of the last verdict (`complete_step`), proposed again as a
        chain instead of asking the drafter."""
        drafter, controller = self.drafter, self.controller
        room = self.generator.max_context - self.cache.length - 1  # draft rows that fit next to the pending token
        remaining = self.config.max_tokens - len(self.output.tokens)
        budget = max(0, min(self.config.num_draft_tokens, remaining - 1, self.generator.max_verify_tokens - 1, room))
        if drafter is None or budget <= 0:
            return Draft([]), 0.0
        if carried:
            return Draft(carried[:budget], carried=True), 0.0
        sizes_itself = drafter.cheap_proposals or drafter.plans_tree
        k = budget if sizes_itself else min(budget, controller.choose_k(nodes=drafter.draft_nodes))
        if k <= 0:
            return Draft([]), 0.0
        t0 = time.perf_counter()
        draft = drafter.propose(self.tokens, k)
        seconds = time.perf_counter() - t0
        self.stats.time_draft += seconds
        if drafter.cheap_proposals and draft.tokens and draft.tree is None:
            # a cheap drafter proposed the most it could: keep what pays for this kind of proposal
            draft.tokens = draft.tokens[: controller.choose_k(drafter.proposal_key, len(draft.tokens))]
        if len(draft.tokens) > room:  # a tree wider than the room left: verify the pending token alone
            return Draft([]), seconds
        return draft, seconds

    def verify_pass(self, planned: "PlannedStep") -> StepOutput:
        """One target pass over the pending token and the draft (chain: causal; tree: ancestry mask)."""
        t0 = time.perf_counter()
        out = self.generator.target.run(planned.ids, planned.positions, self.cache.attention_mask(planned.new_mask), self.cache)
        seconds = time.perf_counter() - t0
        self.stats.time_verify += seconds
        self.controller.record_pass(len(planned.ids), seconds)
        return out

    def _commit(self, planned: PlannedStep, out: StepOutput, accepted_rows: list[int], emitted: list[int]) -> None:
        """Keep the accepted rows' KV, tell the controller and drafter, emit tokens until a stop."""
        draft, draft_seconds = planned.draft, planned.draft_seconds
        keep = [0, *accepted_rows]
        if self._logit_trace is not None:  # the rows whose logits chose the emitted tokens, in order
            self._logit_trace += [np.array(out.logits[row]) for row in keep[: len(emitted)]]
        self.cache.append(out.presents, keep, 1 + len(draft.tokens))
        self.stats.target_passes += 1
        if draft.tokens:
            self.stats.draft_steps += 1
            self.stats.count_draft(draft.depth, len(accepted_rows))
            if not draft.carried:  # a carried chain is not the drafter's proposal: its verdict says nothing of it
                key = self.drafter.proposal_key if self.drafter.cheap_proposals else None
                self.controller.record_draft(draft.depth, len(accepted_rows), draft_seconds, key, draft.drafted_levels)
                if planned.guided is not None:  # the drafter hears of its own proposal, before the grammar's cut
                    self.drafter.record_verdict(planned.guided.proposed, planned.guided.proposed_rows(accepted_rows))
                else:
                    self.drafter.record_verdict(draft, accepted_rows)
        if self.drafter is not None and out.hidden is not None:
            row_tokens = [self.tokens[-1], *[draft.tokens[r - 1] for r in accepted_rows]]
            self.drafter.observe(out.hidden[keep], row_tokens, emitted[-1])
        before, used = len(self.output.tokens), 0
        for token in emitted:
            self.tokens.append(token)
            used += 1
            if self.output.push(token):
                self.done = True
                break
        if self.rules is not None:
            self.rules.emit(out.logits[keep[:used]], emitted[:used], len(self.output.tokens) - before)
        self.output.flush()
        self.finish = self.output.finish
        if self.done:
            self.cache.truncate(len(self.tokens) - 1)  # never keep rows past the stop

    def result(self) -> GenerationResult:
        """The finished generation (call once `done`)."""
        self.output.flush(final=True)
        stats = self.stats
        stats.generated_tokens = len(self.output.tokens)
        stats.end_tokens = int(self.finish == "stop" and self.tokens[-1] in self.generator.eos_ids and not self.config.ignore_eos)
        stats.time_total = time.perf_counter() - self._started
        stats.time_engine = self.generator.clock.seconds - self._engine_start
        stats.compactions = self.cache.compactions
        output = self.output
        text = output.text if self.config.stop else (self.generator.tokenizer.decode(output.tokens) if self.generator.tokenizer else "")
        logits = np.stack(self._logit_trace[: len(output.tokens)]) if self._logit_trace else None
        logprobs = self.config.logprobs.entries[: len(output.tokens)] if self.config.logprobs is not None else None
        return GenerationResult(output.tokens, text, self.finish or "length", stats, logits, logprobs)


def _check_resume(generator: Generator, config: GenerationConfig, prompt: int, cached_rows: int, whole: bool) -> None:
    """Refuse a start from cached rows that a fresh prefill would not reproduce bit for bit."""
    if not generator.resumes_prefill:
        raise ValueError(f"the {generator.drafter.name} drafter reads the prompt's hidden states: start without cached rows")
    if whole != (cached_rows == prompt):
        raise ValueError("the prompt's last logits come with all its rows cached, and only then")
    if whole:
        return
    if cached_rows >= prompt:
        raise ValueError(f"{cached_rows} cached rows of a {prompt}-token prompt leave no token to prefill")
    if not generator.target.row_invariant and cached_rows % config.prefill_chunk:
        raise ValueError(f"{cached_rows} cached rows of a {prompt}-token prompt: not whole prefill chunks of "
                         f"{config.prefill_chunk} (a fresh prefill on this graph would compute other bits)")


def _verify_draft(draft: Draft, pending: int, out: StepOutput, params: SamplingParams, rng) -> tuple[list[int], list[int]]:
    """Exact verification of a chain or tree draft: (accepted row indices 1.., emitted tokens).

    Greedy: each row's argmax, from the graph when it computes them (`out.greedy_tokens`, the GPU graph) or from
    the logits; sampling: the chain rule or the tree rule on the processed distributions."""
    node_tokens = [pending, *draft.tokens]
    if params.greedy:
        if out.greedy_tokens is not None:
            best = lambda row: int(out.greedy_tokens[row])  # noqa: E731
        else:
            best = lambda row: int(out.logits[row].argmax())  # noqa: E731
        return greedy_path(draft.tree, node_tokens, best)
    probs = process_logits(out.logits, params)
    if draft.tree is not None:
        child = None if draft.child_probs is None else [None if c is None else _align_vocab(c[None], probs.shape[-1])[0] for c in draft.child_probs]
        result = verify_tree(draft.tree, node_tokens, probs, rng, child_probs=child, mode=draft.mode)
        return list(result.path), list(result.tokens)
    result = verify_chain(draft.tokens, probs, rng, _align_vocab(draft.probs, probs.shape[-1]))
    return list(range(1, result.num_accepted + 1)), list(result.tokens)


def _align_vocab(probs: np.ndarray | None, vocab: int) -> np.ndarray | None:
    """Pad/cut a draft distribution to the target's vocabulary size (padded ids have zero mass)."""
    if probs is None or probs.shape[-1] == vocab:
        return probs
    if probs.shape[-1] > vocab:
        cut = probs[..., :vocab]
        return cut / cut.sum(axis=-1, keepdims=True)
    return np.pad(probs, [(0, 0)] * (probs.ndim - 1) + [(0, vocab - probs.shape[-1])])
