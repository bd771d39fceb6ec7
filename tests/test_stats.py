"""A generation's statistics add up: every token the target passes produced is one pass or one accepted draft."""

from __future__ import annotations

import pytest

from speccompile.runtime.drafters.base import Draft, Drafter
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


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_seeded_ngram_statistics_add_up(tiny_artifact, seed):
    runner = Runner(tiny_artifact, drafter="ngram", threads=1)
    result = runner.generate(PROMPT, chat=False, max_tokens=24, sampling=SamplingParams(temperature=0.8, seed=seed))
    assert_adds_up(result.stats)
