"""A generation's statistics add up: every token the target passes produced is one pass or one accepted draft."""

from __future__ import annotations

import pytest

from speccompile.runtime.drafters.base import Draft, Drafter, GenerationStart, Observation
from speccompile.runtime.generate import GenerationConfig
from speccompile.runtime.sampling import SamplingParams
from speccompile.runtime.session import Runner

PROMPT = "the cat sat on the mat. the cat sat on the"


def assert_adds_up(stats) -> None:
    assert stats.produced_tokens == stats.target_passes + sum(stats.accepted), stats
    assert all(0 <= a <= d for a, d in zip(stats.accepted, stats.drafted)), stats


class Oracle(Drafter):
    """Drafts the known continuation: every draft token is accepted (greedy)."""

    name = "oracle"

    def __init__(self, prompt: list[int], output: list[int]):
        self.sequence = prompt + output

    def propose(self, tokens, sizing):
        return Draft(self.sequence[len(tokens): len(tokens) + sizing.room])


def test_drafts_accepted_past_a_stop_are_not_counted(tiny_artifact):
    """A stop string inside an accepted run ends generation there: the drafts after it were not used, so they
    are not counted as accepted (a run once reported 2 accepted drafts at 1.00 tokens per pass)."""
    runner = Runner(tiny_artifact, drafter="none", threads=1)
    ids = runner.artifact.tokenizer.prompt_ids(PROMPT, chat=False)
    generator = runner.generator(plain=True)
    plain = generator.generate(ids, GenerationConfig(max_tokens=24, num_draft_tokens=0, ignore_eos=True))
    text = runner.artifact.tokenizer.decode(plain.tokens)
    stop = text[3:5]  # two characters early in the output: the stop falls inside the first 8-token draft
    generator.drafter = Oracle(ids, plain.tokens)
    config = GenerationConfig(max_tokens=24, num_draft_tokens=8, adaptive=False, ignore_eos=True, stop=[stop])
    result = generator.generate(ids, config)
    assert result.finish_reason == "stop" and result.text == text[: text.find(stop)]
    assert result.stats.draft_steps >= 1 and sum(result.stats.accepted) < 8
    assert_adds_up(result.stats)


class Listener(Oracle):
    """The oracle, keeping every call the loop makes to it."""

    def __init__(self, prompt: list[int], output: list[int]):
        super().__init__(prompt, output)
        self.calls: list = []

    def start(self, start: GenerationStart) -> None:
        self.calls.append(start)

    def propose(self, tokens, sizing):
        draft = super().propose(tokens, sizing)
        self.calls.append(draft)
        return draft

    def observe(self, observation: Observation) -> None:
        self.calls.append(observation)


def test_the_drafter_hears_the_start_each_pass_its_verdicts_and_the_end(tiny_artifact):
    """The contract's three calls in order: start once, an observation after every target pass (the prompt's, then
    each round's rows with the verdict on the draft that round verified), the finished history last."""
    runner = Runner(tiny_artifact, drafter="none", threads=1)
    ids = runner.artifact.tokenizer.prompt_ids(PROMPT, chat=False)
    generator = runner.generator(plain=True)
    plain = generator.generate(ids, GenerationConfig(max_tokens=20, num_draft_tokens=0, ignore_eos=True))
    generator.drafter = listener = Listener(ids, plain.tokens)
    result = generator.generate(ids, GenerationConfig(max_tokens=20, num_draft_tokens=4, adaptive=False, ignore_eos=True))
    assert result.tokens == plain.tokens
    start, prefill, *rounds, end = listener.calls
    assert start == GenerationStart(ids, None, start.sampling, start.rng, fresh=False) and start.rng is not None
    assert list(prefill.tokens) == ids and prefill.next_token is None and prefill.draft is None
    assert end == Observation(finished=ids + plain.tokens)
    drafts, observed = rounds[0::2], rounds[1::2]
    assert len(observed) == result.stats.target_passes - 1 and all(isinstance(d, Draft) for d in drafts)
    history, at = ids + plain.tokens, len(ids)  # the pending token's position
    for draft, seen in zip(drafts, observed):  # the oracle's drafts are all accepted
        assert seen.draft is draft and list(seen.accepted_rows) == list(range(1, len(draft.tokens) + 1))
        rows = 1 + len(draft.tokens)  # the pending token and the accepted drafts
        assert list(seen.tokens) == history[at: at + rows] and seen.next_token == history[at + rows]
        assert seen.hidden is None or len(seen.hidden) == rows
        at += rows
    assert at == len(history) - 1 and sum(len(d.tokens) > 0 for d in drafts) >= 2


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_seeded_ngram_statistics_add_up(tiny_artifact, seed):
    runner = Runner(tiny_artifact, drafter="ngram", threads=1)
    result = runner.generate(PROMPT, chat=False, max_tokens=24, sampling=SamplingParams(temperature=0.8, seed=seed))
    assert_adds_up(result.stats)
