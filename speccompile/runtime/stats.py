"""What a generation reports: its counters and times (`GenerationStats`) and its result."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .logprobs import TokenLogprob


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
    logprobs: list[TokenLogprob] | None = None  # with GenerationConfig.logprobs: one entry per output token


def process_memory_mb() -> dict[str, float]:
    """This process's resident memory now (`resident_mb`, VmRSS) and at its peak (`peak_mb`, VmHWM: the session
    opening included, when ONNX Runtime reads weights it then prepacks), in MiB; empty where /proc is absent."""
    keys = {"VmRSS": "resident_mb", "VmHWM": "peak_mb"}
    try:
        with open("/proc/self/status") as fh:
            return {keys[k]: round(int(v.split()[0]) / 1024, 1) for k, v in (line.split(":", 1) for line in fh) if k in keys}
    except OSError:
        return {}
