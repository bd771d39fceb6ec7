"""The runtime's options: how to open an artifact and draft (RunOptions), what to generate (GenerationConfig)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InputError
from .backends.base import BACKENDS
from .constraints import CompiledConstraint
from .logprobs import LogprobRecorder
from .penalties import LogitPenalties
from .sampling import SamplingParams

DRAFTER_CHOICES = ("auto", "none", "ngram", "suffix", "draft-model", "eagle", "eagle3", "medusa", "mtp", "dflash")
SLOT_PASSES = ("off", "drafts", "all")  # batch rounds run as one pass of the slotted graph (Runner.batch_decoder)


@dataclass
class RunOptions:
    """How a Runner opens an artifact and drafts; the same choices as `speccompile run`'s options.

    drafter: `auto` (the drafter exported with the artifact, else n-gram lookup), `none` (plain decoding),
    or a kind. num_draft_tokens: most draft positions per step (chain tokens, or tree depth; a single stream's n-gram
    drafter twice that after a chain that long was accepted whole, runtime/generate.py `DRAFT_GROWTH`; see
    speccompile/draft_config.py) [default: the artifact's, else per drafter]. tree: head drafters only, a tree
    to draft instead of the exported one. contract_graph: on ort-cpu, run target.onnx instead of the fused
    CPU graph. suffix_*: the suffix drafter's (runtime/drafters/suffix.py): responses kept for drafting across
    requests, suffix tree depth, least estimated token probability drafted, draft tokens per matched token, trees
    or chains, and whether tenants (`user`) draft from each other's responses. shape_invariant: every target pass
    of a generation with the same padded shapes (the artifact's max_verify_tokens rows, a fixed KV extent), so
    plain and speculative decoding compute every row alike on kernels whose numerics depend on shapes; an int: that many rows; None = on for the GPU backends, off on ort-cpu.
    shared_cores (no CLI flag; the serving engine sets it): other threads or sessions of the process run between
    the target's passes, so ONNX Runtime's threads busy-wait within a run only (backends/ort.py SPINNING).
    """

    backend: str = "ort-cpu"
    threads: int | None = None
    drafter: str = "auto"
    num_draft_tokens: int | None = None
    tree: str | None = None
    adaptive: bool = True
    lookup_branch: bool = True
    ngram_corpus: str | Path | None = None
    suffix_cache_requests: int = 10000
    suffix_max_depth: int = 24
    suffix_min_prob: float = 0.1
    suffix_spec_factor: float = 1.0
    suffix_tree: bool = True
    suffix_share_tenants: bool = False
    contract_graph: bool = False
    shape_invariant: bool | int | None = None
    # other sessions or threads run between the target's passes (a server): ORT threads spin only within a run; no CLI flag
    shared_cores: bool = field(default=False, metadata={"cli": False})

    def validate(self) -> "RunOptions":
        if self.backend not in BACKENDS:
            raise InputError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend}", "backend")
        if self.drafter not in DRAFTER_CHOICES:
            raise InputError(f"drafter must be one of {', '.join(DRAFTER_CHOICES)}, got {self.drafter}", "drafter")
        if self.threads is not None and self.threads < 1:
            raise InputError(f"threads must be >= 1, got {self.threads}", "threads")
        if self.num_draft_tokens is not None and self.num_draft_tokens < 1:
            raise InputError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens} (drafter none decodes without "
                             "drafting)", ("num_draft_tokens", "drafter"))
        return self


@dataclass(frozen=True)
class DraftTuning:
    """One generation's own drafting settings in place of the runner's (a server request's `speculative_config`,
    vLLM's keys in brackets); None keeps the runner's. n-gram: `min_match` / `max_match`, the shortest and longest
    history suffix looked up (prompt_lookup_min / _max). Suffix: `max_depth`, the history tokens matched, at most
    the store's depth (suffix_decoding_max_tree_depth); `min_prob`, the least estimated token probability drafted
    (suffix_decoding_min_token_prob); `spec_factor`, draft tokens per matched token (suffix_decoding_max_spec_factor).
    Only proposals change: verification keeps every output exact whatever they are."""

    min_match: int | None = None
    max_match: int | None = None
    max_depth: int | None = None
    min_prob: float | None = None
    spec_factor: float | None = None

    NGRAM = ("min_match", "max_match")
    SUFFIX = ("max_depth", "min_prob", "spec_factor")

    def set_fields(self) -> tuple[str, ...]:
        """The settings this tuning gives (not None)."""
        return tuple(name for name in (*self.NGRAM, *self.SUFFIX) if getattr(self, name) is not None)

    def validate(self, drafter: str, store_depth: int | None = None) -> "DraftTuning":
        """InputError (naming the setting) for settings of another drafter than `drafter` or out of range
        (`store_depth`: the suffix store's, the deepest match a generation may ask for)."""
        own = {"ngram": self.NGRAM, "suffix": self.SUFFIX}.get(drafter, ())
        for name in self.set_fields():
            if name not in own:
                raise InputError(f"{name}: a setting of the {'n-gram' if name in self.NGRAM else 'suffix'} drafter, "
                                 f"not of drafter {drafter}", name)
        for name in ("min_match", "max_match", "max_depth"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InputError(f"{name} must be >= 1, got {value}", name)
        if self.min_match is not None and self.max_match is not None and self.min_match > self.max_match:
            raise InputError(f"min_match {self.min_match} exceeds max_match {self.max_match}", "min_match")
        if self.min_prob is not None and not 0.0 <= self.min_prob <= 1.0:
            raise InputError(f"min_prob must be in [0, 1], got {self.min_prob}", "min_prob")
        if self.spec_factor is not None and not self.spec_factor > 0:
            raise InputError(f"spec_factor must be > 0, got {self.spec_factor}", "spec_factor")
        if self.max_depth is not None and store_depth is not None and self.max_depth > store_depth:
            raise InputError(f"max_depth {self.max_depth}: the suffix store here matches at most {store_depth} tokens "
                             "(suffix_max_depth)", ("max_depth", "suffix_max_depth"))
        return self


@dataclass
class GenerationConfig:
    """What one generation produces: length, sampling, stops, and the num_draft_tokens the runner sets."""

    max_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    num_draft_tokens: int = 8
    adaptive: bool = True
    prefill_chunk: int = 256
    ignore_eos: bool = False
    trace_logits: bool = False  # keep the logits that chose each token (GenerationResult.logits; `verify`)
    constraint: CompiledConstraint | None = None  # the output must match this grammar (runtime/constrained.py)
    logprobs: LogprobRecorder | None = None  # record each emitted token's log-probability here (runtime/logprobs.py)
    penalties: LogitPenalties | None = None  # logit bias, repetition / frequency / presence penalties (runtime/penalties.py)
    user: str | None = None  # who asked (a server request's `user`): the suffix drafter drafts from that tenant's earlier text
    draft_tuning: DraftTuning = field(default_factory=DraftTuning)  # this generation's own drafter settings (Drafter.start)

    def validate(self) -> "GenerationConfig":
        if self.max_tokens is None or self.max_tokens < 1:
            raise InputError(f"max_tokens must be >= 1, got {self.max_tokens}", "max_tokens")
        if self.num_draft_tokens < 0:
            raise InputError(f"num_draft_tokens must be >= 0, got {self.num_draft_tokens}", "num_draft_tokens")
        if self.prefill_chunk < 1:
            raise InputError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}", "prefill_chunk")
        if any(not s for s in self.stop):
            raise InputError("stop: an empty stop string would end every output before its first token", "stop")
        self.sampling.validate()
        if self.penalties is not None:
            self.penalties.validate()
        return self

    @property
    def adjusts_logits(self) -> bool:
        """Whether the target's logits are adjusted (runtime/penalties.py) before sampling processes them."""
        return self.penalties is not None and self.penalties.active
