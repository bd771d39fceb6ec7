"""The draft -> verify -> accept loop: chunked prefill, exact verification, stops, streaming, stats."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..errors import InputError
from .adaptive import AdaptiveController, PassCosts
from .backends.base import Session
from .backends.shape_invariant import exact_acceptance
from .drafters.base import ChainDrafter, Draft
from .sampling import SamplingParams, process_logits, sample, verify_chain, verify_tree
from .tokenizer import TextTokenizer


@dataclass
class GenerationConfig:
    max_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    num_draft_tokens: int = 8
    adaptive: bool = True
    prefill_chunk: int = 256
    ignore_eos: bool = False

    def validate(self) -> "GenerationConfig":
        if self.max_tokens is None or self.max_tokens < 1:
            raise InputError(f"--max-tokens must be >= 1, got {self.max_tokens}")
        if self.num_draft_tokens < 0:
            raise InputError(f"--num-draft-tokens must be >= 0, got {self.num_draft_tokens}")
        if self.prefill_chunk < 1:
            raise InputError(f"--prefill-chunk must be >= 1, got {self.prefill_chunk}")
        self.sampling.validate()
        return self


@dataclass
class GenerationStats:
    """Counters of one generation; times in seconds."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    target_passes: int = 0  # passes that produced tokens: the last prefill chunk + every decode pass
    prefill_passes: int = 0
    draft_steps: int = 0
    drafted: list[int] = field(default_factory=list)  # per draft position: how often a token was drafted there
    accepted: list[int] = field(default_factory=list)  # per draft position: how often it was accepted
    time_total: float = 0.0
    time_prefill: float = 0.0
    time_draft: float = 0.0
    time_verify: float = 0.0
    time_engine: float = 0.0  # inside engine calls (target and draft graphs)
    compactions: int = 0

    def count_draft(self, drafted: int, accepted: int) -> None:
        while len(self.drafted) < drafted:
            self.drafted.append(0)
            self.accepted.append(0)
        for i in range(drafted):
            self.drafted[i] += 1
            self.accepted[i] += int(i < accepted)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per target pass (1.0 for plain decoding)."""
        return self.generated_tokens / self.target_passes if self.target_passes else 0.0

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
            "target_passes": self.target_passes,
            "prefill_passes": self.prefill_passes,
            "draft_steps": self.draft_steps,
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


class TimedSession:
    """Wraps a Session to add the time spent inside engine calls to a shared counter."""

    def __init__(self, session: Session, clock: list[float]):
        self._session = session
        self._clock = clock
        self.spec = session.spec

    def new_cache(self):
        return self._session.new_cache()

    def run(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self._session.run(*args, **kwargs)
        finally:
            self._clock[0] += time.perf_counter() - start


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


class Generator:
    """Speculative (or plain, with no drafter) generation over a target verify graph."""

    def __init__(
        self,
        target: Session,
        tokenizer: TextTokenizer | None,
        max_context: int,
        eos_token_ids: list[int],
        drafter: ChainDrafter | None = None,
        max_verify_tokens: int = 64,
        pass_costs: PassCosts | None = None,
    ):
        self.engine_clock = [0.0]
        self.target = TimedSession(target, self.engine_clock)
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.eos_ids = set(eos_token_ids)
        self.drafter = drafter
        self.max_verify_tokens = max_verify_tokens
        self.pass_costs = pass_costs if pass_costs is not None else PassCosts()  # the target's measured pass times

    def _prefill(self, cache, prompt: list[int], chunk: int, stats: GenerationStats, drafter=None) -> np.ndarray:
        logits = None
        for start in range(0, len(prompt), chunk):
            ids = prompt[start: start + chunk]
            q = len(ids)
            mask = cache.attention_mask(np.tril(np.ones((q, q), dtype=bool)))
            out = self.target.run(np.asarray(ids), np.arange(start, start + q), mask, cache)
            cache.append(out.presents, range(q), q)
            logits = out.logits[-1]
            stats.prefill_passes += 1
            if drafter is not None and out.hidden is not None and hasattr(drafter, "observe"):
                following = prompt[start + q] if start + q < len(prompt) else None
                drafter.observe(out.hidden, list(ids), following)
        return logits

    def generate(
        self,
        prompt_ids: list[int],
        config: GenerationConfig,
        on_text: Callable[[str], None] | None = None,
    ) -> GenerationResult:
        """Generate up to `config.max_tokens` tokens after `prompt_ids`."""
        config.validate()
        if not prompt_ids:
            raise InputError("--prompt: the prompt is empty")
        if len(prompt_ids) + 1 > self.max_context:
            raise InputError(f"--prompt: {len(prompt_ids)} tokens exceed the artifact's max_context {self.max_context}")
        params = config.sampling
        rng = params.rng()
        stats = GenerationStats(prompt_tokens=len(prompt_ids))
        self.engine_clock[0] = 0.0
        started = time.perf_counter()
        controller = AdaptiveController(
            max_k=config.num_draft_tokens,
            enabled=config.adaptive,
            deterministic=params.seed is not None and not params.greedy,
            relative_draft_cost=getattr(self.drafter, "relative_cost", 0.0),
            costs=self.pass_costs,
        )
        drafter = self.drafter if config.num_draft_tokens > 0 else None
        if drafter is not None:
            drafter.reset()
            if hasattr(drafter, "plan_with"):  # static trees: adaptive = the planner sizes each step's tree
                drafter.plan_with(controller.relative_costs if config.adaptive else None, fresh=controller.deterministic)
        cache = self.target.new_cache()
        output = _Output(self.tokenizer, config, self.eos_ids, on_text)

        last_logits = self._prefill(cache, list(prompt_ids), config.prefill_chunk, stats, drafter)
        stats.time_prefill = time.perf_counter() - started
        stats.target_passes = 1
        first = int(np.argmax(last_logits)) if params.greedy else sample(process_logits(last_logits, params), rng)
        tokens = list(prompt_ids) + [first]
        done = output.push(first)
        output.flush()
        finish = output.finish
        while not done:
            remaining = config.max_tokens - len(output.tokens)
            room = self.max_context - cache.length - 1  # draft rows that still fit next to the pending token
            budget = max(0, min(config.num_draft_tokens, remaining - 1, self.max_verify_tokens - 1, room))
            draft, draft_seconds, key = Draft([]), 0.0, None
            if drafter is not None and budget > 0:
                cheap = getattr(drafter, "cheap_proposals", False)
                sizes_itself = cheap or getattr(drafter, "plans_tree", False)
                k = budget if sizes_itself else min(budget, controller.choose_k(nodes=getattr(drafter, "draft_nodes", None)))
                if k > 0:
                    t0 = time.perf_counter()
                    draft = drafter.propose(tokens, k)
                    draft_seconds = time.perf_counter() - t0
                    stats.time_draft += draft_seconds
                if cheap and draft.tokens and draft.tree is None:
                    # cheap drafters propose the most they can; keep what pays for this kind of proposal
                    key = getattr(drafter, "proposal_key", None)
                    draft.tokens = draft.tokens[: controller.choose_k(key, len(draft.tokens))]
            if len(draft.tokens) > room:  # a tree wider than the room left: verify the pending token alone
                draft = Draft([])
            q = 1 + len(draft.tokens)
            cache.maybe_compact(q, self.max_context)
            if cache.length + q > self.max_context:
                finish = "context"
                break
            past = cache.length
            if draft.tree is not None:
                new_mask, positions = draft.tree.ancestry, past + draft.tree.depths
            else:
                new_mask, positions = np.tril(np.ones((q, q), dtype=bool)), np.arange(past, past + q)
            t0 = time.perf_counter()
            out = self.target.run(np.asarray([tokens[-1], *draft.tokens]), positions, cache.attention_mask(new_mask), cache)
            verify_seconds = time.perf_counter() - t0
            stats.time_verify += verify_seconds
            controller.record_pass(q, verify_seconds)
            accepted_rows, emitted = _verify_draft(draft, tokens[-1], out.logits, params, rng)
            if out.plain_exact is not None:  # shape-invariant mode: only rows computed as plain decoding count
                accepted_rows, emitted = exact_acceptance(accepted_rows, emitted, out.plain_exact)
            keep = [0, *accepted_rows]
            cache.append(out.presents, keep, q)
            stats.target_passes += 1
            if draft.tokens:
                stats.draft_steps += 1
                stats.count_draft(draft.depth, len(accepted_rows))
                controller.record_draft(draft.depth, len(accepted_rows), draft_seconds, key, draft.drafted_levels)
                if hasattr(drafter, "record_verdict"):
                    drafter.record_verdict(draft, accepted_rows)
            if drafter is not None and out.hidden is not None and hasattr(drafter, "observe"):
                row_tokens = [tokens[-1], *[draft.tokens[r - 1] for r in accepted_rows]]
                drafter.observe(out.hidden[keep], row_tokens, emitted[-1])
            for token in emitted:
                tokens.append(token)
                if output.push(token):
                    done = True
                    break
            output.flush()
            finish = output.finish
            if done:
                cache.truncate(len(tokens) - 1)  # never keep rows past the stop
        output.flush(final=True)
        stats.generated_tokens = len(output.tokens)
        stats.time_total = time.perf_counter() - started
        stats.time_engine = self.engine_clock[0]
        stats.compactions = cache.compactions
        text = output.text if config.stop else (self.tokenizer.decode(output.tokens) if self.tokenizer else "")
        return GenerationResult(output.tokens, text, finish or "length", stats)


def _verify_draft(draft: Draft, pending: int, logits: np.ndarray, params: SamplingParams, rng) -> tuple[list[int], list[int]]:
    """Exact verification of a chain or tree draft: (accepted row indices 1.., emitted tokens)."""
    if draft.tree is not None:
        node_tokens = [pending, *draft.tokens]
        if params.greedy:
            result = verify_tree(draft.tree, node_tokens, logits, None, greedy=True)
        else:
            probs = process_logits(logits, params)
            child = None if draft.child_probs is None else [None if c is None else _align_vocab(c[None], probs.shape[-1])[0] for c in draft.child_probs]
            result = verify_tree(draft.tree, node_tokens, probs, rng, child_probs=child, mode=draft.mode)
        return list(result.path), list(result.tokens)
    if params.greedy:
        result = verify_chain(draft.tokens, logits, None, greedy=True)
    else:
        probs = process_logits(logits, params)
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
