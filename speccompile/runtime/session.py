"""The runtime's Python API: a Runner opens an artifact once and generates, plain or speculative.

    from speccompile.runtime import Runner, RunOptions, SamplingParams

    runner = Runner("exported/smollm2", RunOptions(drafter="ngram"))
    result = runner.generate("Name three colours.", max_tokens=32)
    for delta in runner.stream("Name three colours.", max_tokens=32):
        print(delta, end="")
"""

from __future__ import annotations

import dataclasses
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Hashable, Iterator, TypeVar

from ..errors import InputError, UnsupportedError
from ..manifest import Manifest, read_manifest, variant_name
from ..onnx_versions import installed_onnxruntime, onnxruntime_loads, version_string
from .acceptance import AcceptanceRates
from .adaptive import AdaptiveController, PassCosts
from .costs import seeded_costs
from .backends.ort import OrtBufferSession
from .artifact import check_backend, open_artifact, resolve_drafter
from ..draft_config import DraftConfig, draft_config_for_run
from .constraints import CompiledConstraint, ConstraintSpec
from .drafters.base import Drafter, DrafterRequest, exported_section
from .drafters.registry import make_drafter
from .drafters.ngram_corpus import NgramCorpus
from .state_cache import check_hybrid_run, is_hybrid
from .suffix_cache import SuffixCache
from .generate import Generator
from .logprobs import LogprobRecorder, TokenLogprob, prompt_logprobs
from .penalties import LogitPenalties
from .stats import GenerationResult
from .options import SLOT_PASSES, DraftTuning, GenerationConfig, RunOptions
from .sampling import SamplingParams
from .timing import EngineClock

if TYPE_CHECKING:
    from .backends.base import Session
    from .batch import BatchDecoder
    from .batch_fused import FusedGraphPasses
    from .grammar import GrammarCompiler
    from .prefix_cache import PrefixCache


MAX_SETTINGS = 8  # acceptance estimates kept per runner (one per sampling setting)

T = TypeVar("T")


def most_recent(kept: dict[Hashable, T], key: Hashable, make: Callable[[], T]) -> T:
    """`kept[key]`, made on first use, in a dict holding the `MAX_SETTINGS` most recently used values (a server
    with per-request sampling settings must not grow without bound)."""
    value = kept.pop(key, None)
    if value is None:
        value = make()
    kept[key] = value  # most recently used last
    while len(kept) > MAX_SETTINGS:
        kept.pop(next(iter(kept)))
    return value


class Runner:
    """An opened artifact plus its drafter: `generate`, `generate_ids`, `stream`, `stream_ids`.

    `Runner(path, RunOptions(...))`, or `Runner(path, drafter="ngram", threads=2)` with RunOptions fields as
    keywords. The drafter is built once, for every sampling setting and seed, and keeps what it learns (tree
    planner rates) across generations; the target's measured pass costs are shared by all generations too.
    """

    def __init__(self, artifact: str | Path, options: RunOptions | None = None, **fields):
        options = dataclasses.replace(options or RunOptions(), **fields).validate()
        self.options = options
        manifest = read_manifest(artifact, verify_files=False)  # what the options ask of it is checked before anything loads
        check_backend(Path(artifact), manifest, options.backend)
        self.drafter_name = resolve_drafter(manifest, options.drafter)
        if is_hybrid(manifest):  # a recurrent state verifies chains only: suffix chains, no lookup branch on a head's
            options = self.options = dataclasses.replace(options, suffix_tree=False, lookup_branch=False)
        self.draft_config: DraftConfig | None = self._draft_config(manifest)
        self.suffix_cache = _suffix_cache(options) if self.drafter_name == "suffix" else None  # every slot's drafter shares it
        shape_invariant = options.backend != "ort-cpu" if options.shape_invariant is None else options.shape_invariant
        check_hybrid_run(manifest, options.backend, self.drafter_name, str(artifact), shape_invariant,  # chains on ort-cpu
                         self.draft_config is None or self.draft_config.is_chain)
        self.artifact = open_artifact(artifact, options.backend, options.threads, not options.contract_graph, options.drafter,
                                      shape_invariant, options.shared_cores)
        self.ngram_corpus = None  # read once; every n-gram drafter of this runner shares it
        if options.ngram_corpus is not None:
            self.ngram_corpus = NgramCorpus.from_file(options.ngram_corpus, self.artifact.tokenizer)
        self.clock = EngineClock()  # engine time of the target and every drafter graph
        self.pass_costs = PassCosts()  # the target's pass times, measured across this runner's generations
        self._drafter: Drafter | None = None  # built on first use (`drafter`)
        self._stream: weakref.ref[TextStream] | None = None  # the last stream given that drafter
        self._acceptance: dict[tuple, AcceptanceRates] = {}
        self._grammar: GrammarCompiler | None = None  # built on the first constraint (xgrammar loads then)
        self._gpu_slots = None  # the slotted GPU graph's session, opened by the first batch decoder that runs it

    def compile_constraint(self, constraint: ConstraintSpec | CompiledConstraint | None) -> CompiledConstraint | None:
        """A constraint compiled for this artifact's tokenizer (InputError for a bad schema, regex or grammar);
        a compiled one as it is."""
        if constraint is None or not isinstance(constraint, ConstraintSpec):
            return constraint
        if self._grammar is None:
            from .grammar import compiler_for

            self._grammar = compiler_for(self.artifact.directory)
        return self._grammar.compile(constraint)

    def _draft_config(self, manifest: Manifest) -> DraftConfig | None:
        """What this runner drafts (None: plain decoding), after checking the options against the manifest: a
        drafter the artifact was exported with, a tree for a head drafter only, k within what one verify pass
        holds, a corpus file for the n-gram drafter only."""
        options, name = self.options, self.drafter_name
        if options.ngram_corpus is not None:
            if name != "ngram":
                raise InputError(f"ngram_corpus: only the ngram drafter uses a corpus (drafter: {name})", "ngram_corpus")
            NgramCorpus.check_file(options.ngram_corpus)
        if name == "none":
            if options.tree is not None:
                raise InputError("tree: plain decoding (drafter none) drafts nothing", "tree")
            return None
        if name not in ("ngram", "suffix"):
            exported_section(manifest, name)
        most = int(manifest.limits.get("max_verify_tokens", 64)) - 1
        if options.num_draft_tokens is not None and options.num_draft_tokens > most:
            raise InputError(f"num_draft_tokens {options.num_draft_tokens}: one verify pass of this artifact holds "
                             f"{most + 1} tokens (its max_verify_tokens), so at most {most} draft positions", "num_draft_tokens")
        return draft_config_for_run(name, manifest.drafter, options.tree, options.num_draft_tokens)

    @property
    def num_draft_tokens(self) -> int:
        """The most draft positions per step (chain tokens, tree depth; 0 for plain decoding)."""
        return self.draft_config.num_draft_tokens if self.draft_config is not None else 0

    def drafter(self) -> Drafter | None:
        """The drafter of the generations this runner runs one after another, whatever their sampling settings
        and seeds (built on first use; None for plain decoding). Each generation hands it its settings and a
        generator of its own (`Drafter.start`), so a draft model is loaded once however many seeds it serves."""
        if self.draft_config is None:
            return None
        if self._drafter is None:
            self._drafter = make_drafter(self._drafter_request())
        return self._drafter

    def _drafter_busy(self) -> bool:
        """Whether a stream still decoding holds the runner's drafter: a generation started meanwhile then gets
        a drafter of its own (on ort-cpu in the same session), so neither changes the other's drafts."""
        stream = self._stream() if self._stream is not None else None
        return stream is not None and stream.decoding

    def _drafter_request(self) -> DrafterRequest:
        """Every drafter of this runner (one for generations one after another, one per batched request) runs its
        graph in the artifact's one shared session of it where the session holds no KV of its own
        (`Artifact.session`): a server does not open a drafter graph per request."""
        return DrafterRequest(self.artifact, self.draft_config, self.clock, self.options.lookup_branch,
                              self.ngram_corpus, True, self.suffix_cache)

    def generator(self, sampling: SamplingParams | None = None, plain: bool = False, own_drafter: bool = False,
                  target: "Session | None" = None) -> Generator:
        """The loop over this artifact's target with the runner's drafter (none when `plain`) and the acceptance
        estimates of `sampling`'s setting; `own_drafter`: a new drafter for this generator alone (generations
        decoding at the same time; its graph runs in a session shared by all of them where that session holds no KV), and acceptance
        learned by each generation alone (one after another they carry `learned_acceptance`; pooled across
        concurrent copy and chat requests, estimates drafted worse: docs/benchmarks.md, "Serving and prefill").
        `target`: the session its passes run on instead of the artifact's target (one slot of the slotted GPU graph)."""
        a = self.artifact
        if plain or self.draft_config is None:
            drafter = None
        elif own_drafter:
            drafter = make_drafter(self._drafter_request())
        else:
            drafter = self.drafter()
        max_verify = a.verify_rows  # the padded rows bound q
        return Generator(target or a.target, a.tokenizer, a.max_context, a.eos_token_ids, drafter, max_verify, self.pass_costs, self.clock,
                         seeded_costs(packed_cpu_graph=bool(a.target.spec.extra.get("cpu_kernels"))),
                         None if own_drafter else self.learned_acceptance(sampling), grow_drafts=not own_drafter)

    def learned_acceptance(self, sampling: SamplingParams | None = None) -> AcceptanceRates:
        """The draft acceptance estimates the generations with `sampling`'s temperature, top-k and top-p carry from
        one to the next (the seed aside: it changes no rate). Acceptance depends on them: greedy and sampled drafts
        are accepted at different rates."""
        s = sampling or SamplingParams()
        return most_recent(self._acceptance, (s.temperature, s.top_k, s.top_p), AdaptiveController.learned_rates)

    def batch_problem(self) -> str | None:
        """Why this runner's batch decoder cannot share passes between requests (it then runs one pass per request,
        `batch_decoder`); None when it can (the fused CPU graph with a batch axis, or the GPU graph with its slotted
        form)."""
        target = self.artifact.target
        if is_hybrid(self.artifact.manifest):  # each request's cache holds its own states (runtime/state_cache.py)
            return "a hybrid linear-attention target's recurrent states have no batch slots: one pass per request"
        if self._gpu_slots_spec() is not None:
            return None
        if self._drafts_trees() and self.artifact.backend == "ort-cuda":
            return self._tree_slots_problem()
        if not isinstance(target, OrtBufferSession):
            return f"shared passes need the fused ONNX Runtime CPU graph (target: {target.spec.file} on {self.options.backend})"
        if not target.batches:
            return f"{target.spec.file} was exported with batch 1 (re-export the artifact for a batch axis)"
        if target.wide_head_passes and variant_name("target", "slots") not in self.artifact.manifest.graphs:
            return (f"{target.spec.file} has head_dim {target.spec.head_dim} > 128, where only slot passes compute a "
                    "request's rows as alone (re-export with `speccompile export --batch-slots N`)")
        return None

    def batch_decoder(self, slots: int, max_tokens: int | None = None, prefix_cache: "PrefixCache | None" = None,
                      slot_passes: str = "off", shared_passes: bool = True) -> "BatchDecoder":
        """Decode up to `slots` requests together (runtime/batch.py). On the fused CPU graph with a batch axis (and
        `shared_passes`) their plain rows share passes; otherwise (`batch_problem()`, or not `shared_passes`)
        each request runs its own pass each round, over its own KV cache, with as many slots as the target holds
        caches (`Session.max_caches`: 1 on the GPU graph).
        `max_tokens`: the most tokens (prompt + generated) one request holds; the KV slots are then allocated at
        once for that many tokens plus a verify pass (else they grow with the longest request).
        `prefix_cache`: prompt rows to reuse across requests (runtime/prefix_cache.py; it may outlive the decoder;
        shared passes only).
        `slot_passes` (SLOT_PASSES): which rounds run as one pass of the artifact's slotted graph
        (`target.ort-slots.onnx`, drafts in the shared pass, a draft's rows the bits they get alone): "off" none,
        "drafts" those in which a request drafts (and the drafts pay for it; plain rows compute the batched
        pass's bits), "all" every round of two or more requests (batch invariance: each request's logits bitwise
        its logits alone). Its ONNX Runtime session
        holds a second copy of the weights; UnsupportedError without a slotted graph of `slots` slots.
        head_dim > 128 (`wide_head_passes`): always "all". A batched pass of several sequences takes one row each and no
        padding row, so it cannot lay out a row's attention as the pass alone does (backends/wide_head.py); each slot
        of a slot pass can, so every row is bitwise its row alone by construction."""
        from .batch import BatchDecoder
        from .batch_passes import OnePassPerRequest, slots_for


        if slot_passes not in SLOT_PASSES:
            raise InputError(f"slot_passes must be one of {', '.join(SLOT_PASSES)}, got {slot_passes!r}", "slot_passes")
        if shared_passes and self._gpu_slots_spec() is not None:
            if slot_passes != "off":
                raise UnsupportedError(f"slot_passes {slot_passes}: the GPU graph's slotted form runs every round as one "
                                       "slot pass already", "slot_passes")
            return self._gpu_slot_decoder(slots)
        if self.batch_problem() is not None or not shared_passes:
            if slot_passes != "off":
                raise UnsupportedError(f"slot_passes {slot_passes}: {self.batch_problem() or 'shared passes are off'}", "slot_passes")
            slots = slots_for(self.artifact.target, slots)
            return BatchDecoder(OnePassPerRequest(self.artifact.target, slots, self.artifact.max_context),
                                lambda config: self.generator(config.sampling, config.num_draft_tokens == 0, slots > 1))
        decoder = BatchDecoder(self._fused_passes(slots, max_tokens, slot_passes),
                               lambda config: self.generator(config.sampling, config.num_draft_tokens == 0, True))
        decoder.prefix_cache = prefix_cache
        return decoder

    def _gpu_slots_spec(self):
        """The spec of the slotted GPU graph the batch decoder runs (`export --batch-slots` with a GPU dtype): when the
        drafter drafts trees, its tree form on ort-cuda (or with the GPU verify graph as the target), where ONNX
        Runtime's CUDA EP takes its attention bias; else its causal form when the target is the GPU verify graph;
        None otherwise (one pass per request)."""
        from .backends.factory import is_gpu_graph

        gpu_target, graphs = is_gpu_graph(self.artifact.target.spec), self.artifact.manifest.graphs
        if self._drafts_trees():
            spec = graphs.get(variant_name("target", "cuda-tree-slots"))
            if spec is None or not (gpu_target or self.artifact.backend == "ort-cuda") or self._tree_slots_problem():
                return None
            return spec
        name = variant_name("target", "cuda-slots")
        if not gpu_target or name not in graphs:
            return None
        return self.artifact.manifest.graph(name)

    def _drafts_trees(self) -> bool:
        """Whether this runner's drafter may draft trees (a head's or DFlash's tree, the suffix drafter's)."""
        config = self.draft_config
        return config is not None and (config.shape != "chain" or config.kind == "suffix" and self.options.suffix_tree)

    def _tree_slots_problem(self) -> str | None:
        """Why tree drafts cannot batch in the slotted GPU graph's tree form on ort-cuda (None: they can)."""
        spec = self.artifact.manifest.graphs.get(variant_name("target", "cuda-tree-slots"))
        if spec is None:
            return (f"tree drafts batch on ort-cuda in target.ort-cuda-tree-slots.onnx, which {self.artifact.directory} "
                    "lacks (re-export with a GPU dtype and `--batch-slots N`)")
        needed = spec.extra.get("min_onnxruntime_cuda")
        if self.artifact.backend == "ort-cuda" and not onnxruntime_loads(needed):
            return (f"tree drafts batch on ort-cuda in {spec.file}, whose attention bias ONNX Runtime's CUDA EP takes "
                    f"from onnxruntime-gpu {needed} (installed {version_string(installed_onnxruntime())})")
        return None

    def _gpu_slot_decoder(self, slots: int) -> "BatchDecoder":
        """Every round one pass of the slotted GPU graph (runtime/batch_gpu.py); its session opened once per runner
        (its device KV buffers and captured graphs outlive a decoder), with the weights it shares with the target's
        GPU graph taken from the artifact's pool (`Artifact.weights`: resident once, backends/shared_weights.py)."""
        from .backends.factory import open_session
        from .backends.ort_cuda_slots import SlotSession
        from .batch import BatchDecoder
        from .batch_gpu import SlotGraphPasses

        a = self.artifact
        if self._gpu_slots is None:
            self._gpu_slots = open_session(a.directory, self._gpu_slots_spec(), a.backend, a.threads, manifest=a.manifest,
                                           max_context=a.max_context, shape_invariant=a.shape_invariant or None,
                                           weights=a.weights)
        target = SlotSession(self._gpu_slots)
        return BatchDecoder(SlotGraphPasses(self._gpu_slots, slots, a.max_context),
                            lambda config: self.generator(config.sampling, config.num_draft_tokens == 0, True, target))

    def _fused_passes(self, slots: int, max_tokens: int | None, slot_passes: str) -> "FusedGraphPasses":
        """The batch decoder's shared passes over the fused CPU graph (with its slotted graph unless `slot_passes`
        is "off")."""
        from .batch_fused import FusedGraphPasses

        rows = None if max_tokens is None else max_tokens + self.artifact.max_verify_tokens
        passes = FusedGraphPasses(self.artifact.target, slots, self.pass_costs, rows)
        why = ""
        if self.artifact.target.wide_head_passes and slot_passes != "all":
            slot_passes, why = "all", f" (head_dim {self.artifact.target.spec.head_dim} > 128 batches in slot passes only)"
        if slot_passes != "off":
            spec = self.artifact.manifest.graphs.get(variant_name("target", "slots"))
            if spec is None or int(spec.extra.get("slots", 0)) < slots or not self.artifact.target.row_invariant:
                raise UnsupportedError(f"slot_passes {slot_passes}{why}: {self.artifact.directory} has no slotted graph for {slots} "
                                       f"requests (re-export with `speccompile export --batch-slots {slots}`)", "slot_passes")
            passes.slot_session = self.artifact.session(variant_name("target", "slots"))
            passes.slot_session.wide = self.artifact.target.wide  # (slot specs before it had no attention_lift)
            passes.batch_invariant = slot_passes == "all"
            passes.calibrate_slot_passes(1 + self.num_draft_tokens)
        return passes

    def config(self, max_tokens: int, sampling: SamplingParams | None = None, stop: list[str] | None = None,
               drafter: str | None = None, constraint: ConstraintSpec | CompiledConstraint | None = None,
               logprobs: LogprobRecorder | None = None, penalties: LogitPenalties | None = None,
               user: str | None = None, num_draft_tokens: int | None = None,
               draft_tuning: DraftTuning | None = None) -> GenerationConfig:
        """The GenerationConfig `generate_ids` would use (for `batch_decoder().join`); `user`: the request's tenant;
        `num_draft_tokens`: fewer draft positions a round than the runner's; `draft_tuning`: its drafter's settings."""
        self.check_drafting(drafter, num_draft_tokens, draft_tuning)
        config = self._config(max_tokens, sampling or SamplingParams(), stop, self._plain(drafter), constraint, logprobs,
                              penalties)
        config.user = user
        if num_draft_tokens is not None:
            config.num_draft_tokens = min(config.num_draft_tokens, num_draft_tokens)
        if draft_tuning is not None:
            config.draft_tuning = draft_tuning
        return config

    def check_drafting(self, drafter: str | None = None, num_draft_tokens: int | None = None,
                       draft_tuning: DraftTuning | None = None) -> None:
        """InputError, naming the setting, unless this runner can draft as asked: `drafter` its own or "none",
        at most its num_draft_tokens, `draft_tuning` its drafter's settings within range (a server checks a request
        with it before any work)."""
        if self._plain(drafter):
            return
        if num_draft_tokens is not None and not 1 <= num_draft_tokens <= self.num_draft_tokens:
            raise InputError(f"num_draft_tokens {num_draft_tokens}: drafts here hold 1 to {self.num_draft_tokens} "
                             "tokens a round", "num_draft_tokens")
        if draft_tuning is not None:
            draft_tuning.validate(self.drafter_name, self.suffix_cache.max_depth if self.suffix_cache else None)

    @property
    def shape_invariant(self) -> int:
        """Rows of every target pass in shape-invariant mode (0: off, each pass has its own shape)."""
        return self.artifact.shape_invariant

    def _config(self, max_tokens: int, sampling: SamplingParams, stop: list[str] | None, plain: bool,
                constraint: ConstraintSpec | CompiledConstraint | None = None,
                logprobs: LogprobRecorder | None = None, penalties: LogitPenalties | None = None) -> GenerationConfig:
        if penalties is not None:
            penalties.validate(self.artifact.tokenizer.vocab_size)
        return GenerationConfig(max_tokens=max_tokens, sampling=sampling, stop=list(stop or []),
                                num_draft_tokens=0 if plain else self.num_draft_tokens, adaptive=self.options.adaptive,
                                constraint=self.compile_constraint(constraint), logprobs=logprobs, penalties=penalties)

    def _plain(self, drafter: str | None) -> bool:
        if drafter not in (None, "none", self.drafter_name):
            raise InputError(f"drafter {drafter}: the drafter here is {self.drafter_name} ('none': plain decoding)",
                             "drafter")
        return drafter == "none" or self.draft_config is None

    def prompt_logprobs(self, prompt_ids: list[int], top: int = 0) -> list[TokenLogprob]:
        """Each prompt token's log-probability after the tokens before it (tokens 1..; `top` alternatives), from a
        prefill of its own (runtime/logprobs.py)."""
        return prompt_logprobs(self.artifact.target, prompt_ids, top)

    def generate_ids(self, prompt_ids: list[int], max_tokens: int = 128, sampling: SamplingParams | None = None,
                     stop: list[str] | None = None, on_text: Callable[[str], None] | None = None,
                     drafter: str | None = None, constraint: ConstraintSpec | CompiledConstraint | None = None,
                     logprobs: int | None = None, penalties: LogitPenalties | None = None) -> GenerationResult:
        """Generate after token ids; `drafter="none"` gives plain decoding on the same backend. `constraint`: the
        output must match it (`ConstraintSpec.json_schema(...)`, regex, grammar, choice); `logprobs`: record each
        token's log-probability with that many alternatives (`GenerationResult.logprobs`); `penalties`: logit bias and
        repetition penalties (runtime/penalties.py)."""
        sampling = sampling or SamplingParams()
        plain = self._plain(drafter)
        recorder = None if logprobs is None else LogprobRecorder(logprobs)
        config = self._config(max_tokens, sampling, stop, plain, constraint, recorder, penalties)
        return self.generator(sampling, plain, self._drafter_busy()).generate(prompt_ids, config, on_text)

    def generate(self, prompt: str, chat: bool = True, max_tokens: int = 128, sampling: SamplingParams | None = None,
                 stop: list[str] | None = None, on_text: Callable[[str], None] | None = None,
                 drafter: str | None = None, constraint: ConstraintSpec | CompiledConstraint | None = None,
                 logprobs: int | None = None, penalties: LogitPenalties | None = None) -> GenerationResult:
        """Generate from text (through the chat template when `chat`); `constraint`, `logprobs`, `penalties` as
        `generate_ids`."""
        ids = self.artifact.tokenizer.prompt_ids(prompt, chat)
        return self.generate_ids(ids, max_tokens, sampling, stop, on_text, drafter, constraint, logprobs, penalties)

    def stream_ids(self, prompt_ids: list[int], max_tokens: int = 128, sampling: SamplingParams | None = None,
                   stop: list[str] | None = None, drafter: str | None = None,
                   constraint: ConstraintSpec | CompiledConstraint | None = None) -> "TextStream":
        """Like `generate_ids`, as an iterator of text deltas (its `result` once exhausted)."""
        sampling = sampling or SamplingParams()
        plain = self._plain(drafter)
        config = self._config(max_tokens, sampling, stop, plain, constraint)
        busy = self._drafter_busy()
        stream = TextStream(self.generator(sampling, plain, busy), prompt_ids, config)
        if not busy and not plain:
            self._stream = weakref.ref(stream)
        return stream

    def stream(self, prompt: str, chat: bool = True, max_tokens: int = 128, sampling: SamplingParams | None = None,
               stop: list[str] | None = None, drafter: str | None = None,
               constraint: ConstraintSpec | CompiledConstraint | None = None) -> "TextStream":
        """Like `generate`, as an iterator of text deltas (its `result` once exhausted)."""
        ids = self.artifact.tokenizer.prompt_ids(prompt, chat)
        return self.stream_ids(ids, max_tokens, sampling, stop, drafter, constraint)


def _suffix_cache(options: RunOptions) -> SuffixCache:
    """The runner's store of earlier responses for the suffix drafter, with its RunOptions settings."""
    return SuffixCache(options.suffix_cache_requests, options.suffix_max_depth, options.suffix_share_tenants,
                       options.suffix_min_prob, options.suffix_spec_factor, options.suffix_tree)


class TextStream:
    """Iterates the text deltas of one generation, one decode step at a time; `result` when done."""

    def __init__(self, generator: Generator, prompt_ids: list[int], config: GenerationConfig):
        self._pending: list[str] = []
        self._generation = generator.start(prompt_ids, config, self._pending.append)
        self.result: GenerationResult | None = None

    @property
    def decoding(self) -> bool:
        """Whether its generation has steps to run (its drafter is in use)."""
        return not self._generation.done

    def __iter__(self) -> Iterator[str]:
        while True:
            while self._pending:
                yield self._pending.pop(0)
            if self.result is not None:
                return
            if self._generation.done:
                self.result = self._generation.result()
            else:
                self._generation.step()
