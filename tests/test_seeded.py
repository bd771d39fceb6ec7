"""Seeded sampling is reproducible with every drafter: a seeded request gives the same tokens first, after other
requests, alone and batched, in a Runner and in the server; and one draft model serves every seed.
A new drafter kind joins these tests through `KINDS`, `artifacts` and `_prompts`."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest

from conftest import load_benchmark
from speccompile.runtime import Runner
from speccompile.runtime.sampling import SamplingParams

ServerProcess = load_benchmark("server_process").ServerProcess

KINDS = ["ngram", "suffix", "draft-model", "eagle3", "medusa"]
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=5)
OTHERS = [SamplingParams(temperature=0.9, seed=8), SamplingParams(temperature=0.8), SamplingParams()]  # seeded, unseeded, greedy
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def artifacts(tiny_artifact, tiny_artifact_with_draft, head_artifacts) -> dict:
    return {"ngram": tiny_artifact, "suffix": tiny_artifact, "draft-model": tiny_artifact_with_draft, **head_artifacts}


def _prompts(kind: str, runner: Runner) -> list[list[int]]:
    """The seeded request's prompt first, then the other requests' (repetitive: every drafter drafts)."""
    if kind in ("eagle3", "medusa"):
        from test_heads_helpers import word_prompt_ids

        return [[1, 40, 41, 42, 43, 10, 11, 12, 13, 40, 41, 42], word_prompt_ids(1), word_prompt_ids(2)]
    texts = ["abc abc abc abc", "the cat sat on the mat. the cat sat", "0123 0123 0123 0123 01"]
    return [runner.artifact.tokenizer.prompt_ids(t, chat=False) for t in texts]


def _others(runner: Runner, prompts: list[list[int]]) -> None:
    """Other requests in between: another seed, no seed, greedy."""
    for prompt, sampling in zip(prompts[1:] + prompts[1:2], OTHERS):
        runner.generate_ids(prompt, MAX_TOKENS, sampling)


def test_drafter_rng_is_seeded_and_apart_from_the_verifier():
    seeded = SamplingParams(0.9, seed=3)
    draws = seeded.drafter_rng().random(4)
    assert np.array_equal(draws, seeded.drafter_rng().random(4))  # the same seed, the same draws
    assert not np.array_equal(draws, seeded.rng().random(4))  # a stream of its own
    assert not np.array_equal(draws, SamplingParams(0.9, seed=4).drafter_rng().random(4))


@pytest.mark.parametrize("kind", KINDS)
def test_seeded_request_repeats_in_one_runner(kind, artifacts):
    runner = Runner(artifacts[kind], drafter=kind, threads=1)
    prompts = _prompts(kind, runner)
    first = runner.generate_ids(prompts[0], MAX_TOKENS, SEEDED)
    assert first.stats.draft_steps > 0
    assert runner.generate_ids(prompts[0], MAX_TOKENS, SEEDED).tokens == first.tokens  # at once
    _others(runner, prompts)
    assert runner.generate_ids(prompts[0], MAX_TOKENS, SEEDED).tokens == first.tokens  # after other requests
    fresh = Runner(artifacts[kind], drafter=kind, threads=1)
    assert fresh.generate_ids(prompts[0], MAX_TOKENS, SEEDED).tokens == first.tokens


@pytest.mark.parametrize("kind", ["draft-model", "eagle3"])
def test_interleaved_streams_draft_apart(kind, artifacts):
    """Two streams of one Runner read in turns (and a generation between their steps): each seeded one gives its
    tokens alone (a generation started while a stream decodes gets a drafter of its own)."""
    runner = Runner(artifacts[kind], drafter=kind, threads=1)
    prompts = _prompts(kind, runner)
    other = SamplingParams(temperature=0.9, seed=8)
    alone = [runner.generate_ids(prompts[0], MAX_TOKENS, SEEDED).tokens, runner.generate_ids(prompts[1], MAX_TOKENS, other).tokens]
    streams = [runner.stream_ids(prompts[0], MAX_TOKENS, SEEDED), runner.stream_ids(prompts[1], MAX_TOKENS, other)]
    pending = [iter(stream) for stream in streams]
    while pending:
        for delta in list(pending):
            if next(delta, None) is None:
                pending.remove(delta)
        runner.generate_ids(prompts[2], 2, SamplingParams(0.8))
    assert [stream.result.tokens for stream in streams] == alone
    assert all(stream.result.stats.draft_steps > 0 for stream in streams)


@pytest.mark.parametrize("kind", KINDS)
def test_seeded_request_batched_equals_alone(kind, artifacts):
    """Batched with other requests (seeded, unseeded, greedy; two different sets of batch-mates), a seeded
    request's tokens are its tokens alone."""
    runner = Runner(artifacts[kind], drafter=kind, threads=1)
    prompts = _prompts(kind, runner)
    alone = runner.generate_ids(prompts[0], MAX_TOKENS, SEEDED).tokens
    decoder = runner.batch_decoder(3)
    for mates in (OTHERS[:2], OTHERS[1:]):
        requests = [(prompts[0], SEEDED), *zip(prompts[1:], mates)]
        generations = decoder.join_many([(ids, runner.config(MAX_TOKENS, s), None) for ids, s in requests])
        while decoder.active:
            decoder.step()
        assert generations[0].result().tokens == alone
        assert generations[0].result().stats.draft_steps > 0  # (a head drafts after a batched prefill too)
    assert decoder.batched_passes > 0


def test_distinct_seeds_open_the_draft_model_once(tiny_artifact_with_draft, monkeypatch):
    """A server taking one seed per request: the draft model's graph is opened once (one drafter for the
    generations one after another, every batched request's drafter in the same session)."""
    from speccompile.runtime import artifact as artifact_module

    opened: list[str] = []
    open_graph = artifact_module._open_graph

    def counting(directory, manifest, graph, *args, **kwargs):
        opened.append(graph)
        return open_graph(directory, manifest, graph, *args, **kwargs)

    monkeypatch.setattr(artifact_module, "_open_graph", counting)
    runner = Runner(tiny_artifact_with_draft, drafter="draft-model", threads=1)
    prompt = _prompts("draft-model", runner)[0]
    drafter = None
    for seed in range(12):
        runner.generate_ids(prompt, 4, SamplingParams(0.9, seed=seed))
        drafter = drafter or runner.drafter()
        assert runner.drafter() is drafter
    decoder = runner.batch_decoder(3)
    decoder.join_many([(prompt, runner.config(4, SamplingParams(0.9, seed=100 + s)), None) for s in range(3)])
    while decoder.active:
        decoder.step()
    assert opened == ["target", "draft"]


@pytest.mark.parametrize("kind,batching", [(kind, "--batching") for kind in KINDS] + [("draft-model", "--no-batching")])
def test_seeded_request_repeats_in_the_server(kind, batching, artifacts):
    """In the server: the same text alone, beside other requests (batched when batching), and alone again."""
    runner = Runner(artifacts[kind], drafter=kind, threads=1)
    prompts = _prompts(kind, runner)
    expected = runner.generate_ids(prompts[0], MAX_TOKENS, SEEDED).text
    server = ServerProcess(artifacts[kind], "--served-model-name", "tiny", "--threads", "1", "--drafter", kind,
                           "--max-concurrency", "3", batching)
    try:
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)

        def complete(prompt: list[int], sampling: SamplingParams) -> str:
            extra = {} if sampling.seed is None else {"seed": sampling.seed}
            response = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS,
                                                 temperature=sampling.temperature, top_p=sampling.top_p, **extra)
            return response.choices[0].text

        assert complete(prompts[0], SEEDED) == expected
        with ThreadPoolExecutor(3) as pool:
            together = [pool.submit(complete, p, s) for p, s in [(prompts[0], SEEDED), *zip(prompts[1:], OTHERS)]]
            assert together[0].result() == expected
            for future in together[1:]:
                future.result()
        assert complete(prompts[0], SEEDED) == expected
    finally:
        stopped = server.stop()
    assert stopped == 0
