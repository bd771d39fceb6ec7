"""A ready-to-generate runner: artifact + drafter + generator, as used by the CLI and benchmarks."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..errors import InputError
from .adaptive import PassCosts
from .artifact import default_num_draft_tokens, make_drafter, open_artifact, resolve_drafter_name
from .drafters.ngram_corpus import NgramCorpus
from .generate import GenerationConfig, GenerationResult, Generator
from .sampling import SamplingParams


class Runner:
    """Open an artifact once; generate plain or speculative with one drafter."""

    def __init__(
        self,
        artifact: str | Path,
        backend: str = "ort-cpu",
        threads: int | None = None,
        drafter: str = "auto",
        num_draft_tokens: int | None = None,
        adaptive: bool = True,
        sampling: SamplingParams | None = None,
        tree: str | None = None,
        fused: bool = True,
        lookup_branch: bool = True,
        ngram_corpus: str | Path | None = None,
        shape_invariant: bool | int | None = None,
    ):
        if shape_invariant is None:  # on by default where kernels depend on shapes: the GPU backends
            shape_invariant = backend != "ort-cpu"
        self.artifact = open_artifact(artifact, backend, threads, fused, drafter, shape_invariant)
        self.shape_invariant = self.artifact.shape_invariant  # rows of every target pass, 0 = off
        self.drafter_name = resolve_drafter_name(self.artifact, drafter)
        self.ngram_corpus = None  # read once; every n-gram drafter of this runner shares it
        if ngram_corpus is not None:
            if self.drafter_name != "ngram":  # checked before the file is read
                raise InputError(f"--ngram-corpus: only the ngram drafter uses a corpus (drafter: {self.drafter_name})")
            self.ngram_corpus = NgramCorpus.from_file(ngram_corpus, self.artifact.tokenizer)
        self.num_draft_tokens = num_draft_tokens if num_draft_tokens is not None else default_num_draft_tokens(self.artifact, self.drafter_name)
        self.adaptive = adaptive
        self.tree = tree
        self.lookup_branch = lookup_branch
        self._drafters: dict[tuple, object] = {}
        self._sampling = sampling
        self.pass_costs = PassCosts()  # the target's pass times, measured across this runner's generations

    def _generator(self, drafter_name: str, sampling: SamplingParams) -> Generator:
        a = self.artifact
        max_verify = min(a.max_verify_tokens, a.shape_invariant or a.max_verify_tokens)
        generator = Generator(a.target, a.tokenizer, a.max_context, a.eos_token_ids, None, max_verify, self.pass_costs)
        if drafter_name != "none":
            key = (drafter_name, sampling)
            if key not in self._drafters:
                self._drafters[key] = make_drafter(a, drafter_name, sampling, generator.engine_clock, self.tree,
                                                   self.lookup_branch, self.ngram_corpus)
            drafter = self._drafters[key]
            if hasattr(drafter, "session") and hasattr(drafter.session, "_clock"):
                drafter.session._clock = generator.engine_clock
            generator.drafter = drafter
        return generator

    def generate_ids(
        self,
        prompt_ids: list[int],
        max_tokens: int = 128,
        sampling: SamplingParams | None = None,
        stop: list[str] | None = None,
        on_text: Callable[[str], None] | None = None,
        drafter: str | None = None,
    ) -> GenerationResult:
        """Generate after token ids; `drafter="none"` gives plain decoding on the same backend."""
        sampling = sampling or SamplingParams()
        name = self.drafter_name if drafter is None else drafter
        config = GenerationConfig(
            max_tokens=max_tokens,
            sampling=sampling,
            stop=list(stop or []),
            num_draft_tokens=self.num_draft_tokens if name != "none" else 0,
            adaptive=self.adaptive,
        )
        return self._generator(name, sampling).generate(prompt_ids, config, on_text)

    def generate(self, prompt: str, chat: bool = True, max_tokens: int = 128, sampling: SamplingParams | None = None,
                 stop: list[str] | None = None, on_text: Callable[[str], None] | None = None,
                 drafter: str | None = None) -> GenerationResult:
        """Generate from text (through the chat template when `chat`)."""
        ids = self.artifact.tokenizer.prompt_ids(prompt, chat)
        return self.generate_ids(ids, max_tokens, sampling, stop, on_text, drafter)
