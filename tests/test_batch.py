"""Batched decoding (runtime/batch.py): rows as alone (bitwise where the kernels allow), outputs equal to each request alone."""

from __future__ import annotations

import numpy as np
import pytest

from speccompile.runtime import Runner
from speccompile.runtime.adaptive import AdaptiveController
from speccompile.runtime.batch_fused import FusedGraphPasses
from speccompile.runtime.costs import LoadPricedCosts, PassCosts
from speccompile.runtime.sampling import SamplingParams

PROMPTS = ["abc abc abc abc", "hello there, hello there", "x", "the cat sat on the mat. the cat sat", "0123 0123 0123 0123 01"]


def _ids(runner: Runner, text: str) -> list[int]:
    return runner.artifact.tokenizer.prompt_ids(text, chat=False)


def test_batched_rows_equal_batch_one_bitwise(tiny_artifact):
    """What batching rests on: a prompt prefilled in a batch gives the same bits as alone (the KV the batched
    prefill wrote then serves the batched steps), and so does a q = 1 row of a batch of one. At batch > 1 a q = 1
    row cannot get attention's padding row (ONNX Runtime refuses two rows per sequence there), so it runs the
    one-row attention kernel: the same bits at every batch size > 1, and the same function as alone."""
    session = Runner(tiny_artifact, drafter="none", threads=1).artifact.target
    assert session.batches
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 60, n) for n in (5, 17, 1, 40)]
    tokens = rng.integers(3, 60, len(prompts))
    tril = lambda n: np.tril(np.ones((n, n), bool))

    def prefill(cache, prompt):
        out = session.run(prompt, np.arange(len(prompt)), cache.attention_mask(tril(len(prompt))), cache)
        cache.append(out.presents, range(len(prompt)), len(prompt))
        return out.logits

    alone, alone_prefill = [], []
    for prompt, token in zip(prompts, tokens):
        cache = session.new_cache()
        alone_prefill.append(prefill(cache, prompt)[-1].copy())
        alone.append(session.run(np.asarray([token]), np.asarray([len(prompt)]), cache.attention_mask(tril(1)), cache).logits)
    buffers = session.new_batch_buffers(len(prompts), session.kv_rows)
    caches = [session.slot_cache(buffers, b) for b in range(len(prompts))]
    together = session.prefill_batch(buffers, 0, prompts)  # right-padded prompts in one pass
    for b, (cache, prompt) in enumerate(zip(caches, prompts)):
        assert np.array_equal(together[b], alone_prefill[b]), b
        cache.append([], range(len(prompt)), len(prompt))
    batched = {}
    for batch in (1, 2, len(prompts)):
        rows = [(np.asarray([t]), np.asarray([c.length]), tril(1)) for t, c in zip(tokens[:batch], caches[:batch])]
        batched[batch] = [out.logits for out in session.run_batch(buffers, rows, caches[:batch])]
    assert np.array_equal(batched[1][0], alone[0])
    for b in range(2):
        assert np.array_equal(batched[2][b], batched[len(prompts)][b]), b
    for b, logits in enumerate(batched[len(prompts)]):
        np.testing.assert_allclose(logits, alone[b], atol=1e-4, rtol=1e-4)


def _decode_together(runner: Runner, prompts: list[list[int]], max_tokens: int, sampling=None, slots: int = 3) -> list:
    """Requests join as slots free up (continuous batching); results in prompt order."""
    decoder = runner.batch_decoder(slots)
    waiting = list(enumerate(prompts))
    running, results = {}, {}
    while waiting or running:
        batch = waiting[: decoder.free]
        del waiting[: len(batch)]
        joined = decoder.join_many([(ids, runner.config(max_tokens, sampling), None) for _, ids in batch])
        for (i, _), generation in zip(batch, joined):
            if generation.done:
                results[i] = generation.result()
            else:
                running[id(generation)] = (i, generation)
        for generation in decoder.step():
            i, _ = running.pop(id(generation))
            results[i] = generation.result()
    assert not decoder.active
    return [results[i] for i in range(len(prompts))], decoder


@pytest.mark.parametrize("adaptive", [True, False])
def test_batched_greedy_equals_alone(tiny_artifact, adaptive, monkeypatch):
    monkeypatch.setattr(FusedGraphPasses, "initial_rows", 8)  # the slot buffers grow (and move) while decoding
    runner = Runner(tiny_artifact, drafter="ngram", threads=1, adaptive=adaptive)
    prompts = [_ids(runner, p) for p in PROMPTS]
    together, decoder = _decode_together(runner, prompts, 24)
    assert decoder.batched_passes > 0 and decoder.rows > 8
    drafted = 0
    for ids, result in zip(prompts, together):
        alone = runner.generate_ids(ids, 24)
        assert result.tokens == alone.tokens and result.finish_reason == alone.finish_reason
        drafted += result.stats.draft_steps
    if not adaptive:
        assert drafted > 0  # speculative passes of their own ran next to the batched ones


def test_fixed_kv_pool_is_allocated_once_and_decodes_as_alone(tiny_artifact):
    """With a token bound the slots are allocated (and written) at start and never reallocated while serving;
    the warm-up leaves nothing that changes what the requests decode."""
    runner = Runner(tiny_artifact, drafter="ngram", threads=1)
    prompts = [_ids(runner, p) for p in PROMPTS]
    bound = max(len(ids) for ids in prompts) + 24
    decoder = runner.batch_decoder(3, bound)
    assert decoder.rows == bound + runner.artifact.max_verify_tokens
    pool = [id(buffer) for buffer in decoder.passes.buffers]
    assert decoder.kv_bytes == sum(b.nbytes for b in decoder.passes.buffers) > 0
    passes = decoder.batched_passes
    decoder.warm_up(runner.config(2))  # the server's start: the largest passes once, then an empty decoder
    assert not decoder.active and decoder.free == 3 and decoder.batched_passes > passes
    waiting, results = list(enumerate(prompts)), {}
    running = {}
    while waiting or running:
        batch = waiting[: decoder.free]
        del waiting[: len(batch)]
        for (i, _), generation in zip(batch, decoder.join_many([(ids, runner.config(24), None) for _, ids in batch])):
            running[id(generation)] = i
        for generation in decoder.step():
            results[running.pop(id(generation))] = generation.result().tokens
        assert [id(buffer) for buffer in decoder.passes.buffers] == pool
    for i, ids in enumerate(prompts):
        assert results[i] == runner.generate_ids(ids, 24).tokens


def test_batched_seeded_sampling_equals_alone(tiny_artifact):
    """Per-request RNG and acceptance: a seeded request gives the same tokens batched or alone."""
    runner = Runner(tiny_artifact, drafter="ngram", threads=1)
    prompts = [_ids(runner, p) for p in PROMPTS[:4]]
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=s) for s in range(len(prompts))]
    decoder = runner.batch_decoder(4)
    generations = decoder.join_many([(ids, runner.config(20, p), None) for ids, p in zip(prompts, params)])
    while decoder.active:
        decoder.step()
    for ids, p, generation in zip(prompts, params, generations):
        assert generation.result().tokens == runner.generate_ids(ids, 20, p).tokens


def test_load_priced_costs_turn_drafting_off_under_load():
    """A plain step costs a share of the batched pass: drafting pays alone, not in a large batch."""
    alone = PassCosts(by_q={1: 0.020, 2: 0.022, 3: 0.023, 4: 0.024, 5: 0.025}, slope=0.001)

    def k_for(shared_row: float) -> int:
        controller = AdaptiveController(num_draft_tokens=4, probe_every=10**6, costs=LoadPricedCosts(alone, shared_row))
        for _ in range(30):
            controller.record_draft(4, 3, 0.0)  # 75% of drafted tokens accepted
        return controller.choose_k()

    assert k_for(0.020) > 0  # one request: its plain pass is a whole pass
    assert k_for(0.030 / 8) == 0  # eight requests share a 30 ms pass: a row costs 3.75 ms


def test_costs_before_measurements_do_not_freeze_drafting():
    """A batched request's costs before anything was measured: no plain-pass time yet (t1 None: the controller
    takes a plain step first), and a q-token pass is priced like the batched pass over q rows until one of its
    own ran, not by the 1 s default that made deep drafts look hopeless (a single batched request drafted at
    most 3 tokens where the same request alone drafted 12)."""
    batched = PassCosts(by_q={4: 0.024})
    cold = LoadPricedCosts(PassCosts(), None, batched)
    assert cold.t1 is None and AdaptiveController(num_draft_tokens=12, costs=cold).choose_k(available=12) == 0
    assert cold.seconds(13) == batched.seconds(13) < 0.1
    assert PassCosts(by_q={2: 0.03}).line()[0] == 0.03  # t1 is at most the cheapest pass measured
    warm = LoadPricedCosts(PassCosts(by_q={2: 0.03, 13: 0.04}), 0.02, batched)
    assert warm.seconds(1) == 0.02 and warm.seconds(13) == 0.04


def test_drafting_stops_when_not_even_full_acceptance_pays(tiny_artifact):
    runner = Runner(tiny_artifact, drafter="ngram", threads=1)
    decoder = runner.batch_decoder(8)
    decoder.passes.pricing.alone.by_q.clear()
    decoder.passes.pricing.alone.by_q.update({1: 0.020})
    decoder.passes.pricing.alone.slope = 0.004  # a draft of k costs 20 + 4k ms alone
    decoder.active = [decoder.join(runner.artifact.tokenizer.prompt_ids("abc abc", chat=False), runner.config(50))]
    decoder.passes.pricing.batched.by_q.clear()
    decoder.passes.pricing.batched.by_q.update({1: 0.020, 8: 0.030})
    assert decoder.passes.drafting_pays(decoder.passes.shared_row_seconds(1, decoder.active), decoder.active)  # alone: 9 tokens in 52 ms beat 1 in 20 ms
    assert not decoder.passes.drafting_pays(decoder.passes.shared_row_seconds(8, decoder.active), decoder.active)  # 1 token per 3.75 ms row beats any draft


@pytest.mark.parametrize("kind", ["eagle3", "medusa", "draft-model"])
def test_every_drafter_batches_and_equals_alone(kind, head_artifacts, tiny_artifact_with_draft):
    """Head and draft-model drafters decode together too: one drafter (own state) per request over one shared
    session of its graph; every request's greedy tokens equal its tokens alone."""
    artifact = tiny_artifact_with_draft if kind == "draft-model" else head_artifacts[kind]
    runner = Runner(artifact, drafter=kind, threads=1, adaptive=False)
    assert runner.batch_problem() is None
    if kind == "draft-model":
        prompts = [_ids(runner, p) for p in PROMPTS]
    else:
        from test_heads_helpers import word_prompt_ids

        prompts = [[1, 40, 41, 42, 43, 10, 11, 12, 13, 40, 41, 42]] + [word_prompt_ids(s) for s in range(1, 5)]
    together, decoder = _decode_together(runner, prompts, 20)
    assert decoder.batched_passes > 0
    assert sum(r.stats.draft_steps for r in together) > 0
    assert len(runner.artifact._shared_sessions) == 1  # the drafter graph opened once for every request
    for ids, result in zip(prompts, together):
        assert result.tokens == runner.generate_ids(ids, 20).tokens


def test_requests_joining_between_passes_decode_as_alone(tiny_artifact):
    """A fixed pool admits requests between the passes of a round (the server's hook): each joins the rounds
    from the next one and decodes exactly its tokens alone; the round's own requests are undisturbed."""
    runner = Runner(tiny_artifact, drafter="ngram", threads=1, adaptive=False)
    prompts = [_ids(runner, p) for p in PROMPTS]
    decoder = runner.batch_decoder(4, max(len(ids) for ids in prompts) + 24)
    waiting, generations, hooks = list(range(1, len(prompts))), {}, []

    def admit() -> None:
        hooks.append(len(decoder.active))
        if waiting and decoder.free:
            i = waiting.pop(0)
            generations[i] = decoder.join(prompts[i], runner.config(24))

    generations[0] = decoder.join(prompts[0], runner.config(24))
    while decoder.active or waiting:
        if not decoder.active:
            admit()
        decoder.step(admit)
    assert len(hooks) > len(prompts)  # called after every pass, joins while a round was running
    for i, ids in enumerate(prompts):
        assert generations[i].result().tokens == runner.generate_ids(ids, 24).tokens
    grows = runner.batch_decoder(2)  # a growing pool never calls the hook (its slots may move mid-round)
    grows.join(prompts[0], runner.config(4))
    grows.step(lambda: pytest.fail("called on a growing pool"))


def test_deferred_prefill_interleaves_chunks_and_decodes_as_alone(tiny_artifact):
    """join(defer_prefill=True): prompts prefill between passes, shortest first, a long one a chunk at a time;
    a short prompt joining behind a long one gets its first token before the long one's; every request's
    tokens equal its tokens alone with the same prefill chunks."""
    import dataclasses

    runner = Runner(tiny_artifact, drafter="ngram", threads=1)
    chunked = lambda: dataclasses.replace(runner.config(16), prefill_chunk=4)  # noqa: E731
    long_prompt, short_prompts = _ids(runner, "the cat sat on the mat. " * 3), [_ids(runner, p) for p in ("x", "ab")]
    assert len(long_prompt) > 12 and all(len(p) <= 4 for p in short_prompts)
    decoder = runner.batch_decoder(4, len(long_prompt) + 16)
    first_at: dict[str, int] = {}
    clock = iter(range(10**6))
    on_first = lambda name: (lambda _text: first_at.setdefault(name, next(clock)))  # noqa: E731
    generations = {"decoding": decoder.join(short_prompts[1], chunked(), on_first("decoding"))}
    generations["long"] = decoder.join(long_prompt, chunked(), on_first("long"), defer_prefill=True)
    decoder.step()  # one pass of the decoding request, then one chunk of the long prompt
    assert generations["long"].prefilling and "long" not in first_at
    generations["short"] = decoder.join(short_prompts[0], chunked(), on_first("short"), defer_prefill=True)
    while decoder.active:
        decoder.step()
    assert first_at["short"] < first_at["long"]
    for name, ids in (("decoding", short_prompts[1]), ("long", long_prompt), ("short", short_prompts[0])):
        alone = runner.generator().generate(ids, chunked())
        assert generations[name].result().tokens == alone.tokens, name
