"""Prefix caching (runtime/prefix_cache.py): reused rows are bitwise what a fresh prefill computes; LRU bound.

The tiny artifact's fused graph is row-invariant, so the cache works in blocks of PREFIX_BLOCK (16) tokens;
tests that set `row_invariant` False check the prefill-chunk granularity of other graphs."""

from __future__ import annotations

import dataclasses

import httpx
import numpy as np
import openai
import pytest

from conftest import load_benchmark
from speccompile.runtime import Runner
from speccompile.runtime.prefix_cache import PrefixCache

ServerProcess = load_benchmark("server_process").ServerProcess

CHUNK = 8  # a small prefill chunk: prompts of a few dozen tokens span several chunks
SYSTEM = "You are terse; answer in a word. "


def _config(runner: Runner, max_tokens: int):
    return dataclasses.replace(runner.config(max_tokens), prefill_chunk=CHUNK)


def _ids(runner: Runner, text: str) -> list[int]:
    return runner.artifact.tokenizer.prompt_ids(text, chat=False)


def _fresh(runner: Runner, ids: list[int]):
    """A generation started alone on a cache of its own (what `speccompile run` computes): its rows and logits."""
    generation = runner.generator(plain=True).start(ids, _config(runner, 4))
    return [a[0, :, : len(ids)].copy() for a in generation.cache.arrays], generation.prompt_logits


@pytest.mark.parametrize("row_invariant", [True, False], ids=["blocks-of-16", "chunks-of-8"])
def test_reused_rows_and_first_logits_equal_a_fresh_prefill_bitwise(tiny_artifact, row_invariant, monkeypatch):
    """Blocks of 16 down to the token (the row-invariant graph) and whole prefill chunks of 8 (a graph that is
    not): whatever either reuses, the rows and first logits are a fresh prefill's, bit for bit."""
    runner = Runner(tiny_artifact, drafter="none", threads=1)
    monkeypatch.setattr(runner.artifact.target, "row_invariant", row_invariant)
    decoder = runner.batch_decoder(2, prefix_cache=PrefixCache(64 << 20))
    base = _ids(runner, "the cat sat on the mat and looked.")  # 34 ids: 4 whole chunks + 2
    assert len(base) == 34
    other = base[:20] + _ids(runner, "a dog ran fast")  # shares 20+ tokens (a chunk boundary at 16, a block at 16)
    shared = next(i for i, (a, b) in enumerate(zip(base, other)) if a != b)
    assert 20 <= shared < 32
    cases = [  # (prompt, rows the cache gives: row-invariant, chunks)
        (base, 0, 0),  # a miss: prefilled and stored
        (base, 34, 34),  # the whole prompt: rows and logits, no pass
        (other, shared, 16),  # a whole block / two chunks, then (row-invariant) the shared rows of the next block
        (base[:24], 23, 16),  # no logits cached for 24 tokens: all but the last / the whole chunks
        (base[:5], 4, 0),  # a prefix shorter than a block: leading rows of one (its chunk's rows came from a pass of 8)
        (_ids(runner, "zzz"), 0, 0),  # shorter than a chunk and different
        (base[:5], 5, 5),  # now cached as a whole prompt
    ]
    for ids, cached_rows, cached_chunks in cases:
        cached = cached_rows if row_invariant else cached_chunks
        generation = decoder.join(ids, _config(runner, 4))
        passes = -(-(len(ids) - cached) // CHUNK)  # prefill in chunks from the first uncached token
        assert (generation.stats.cached_tokens, generation.stats.prefill_passes) == (cached, passes), (len(ids), cached)
        rows, logits = _fresh(runner, ids)
        for buffer, expected in zip(decoder.passes.buffers, rows):
            assert np.array_equal(buffer[0, :, : len(ids)], expected), (len(ids), cached)
        assert np.array_equal(generation.prompt_logits, logits), (len(ids), cached)
        if not generation.done:
            decoder.leave(generation)
    assert decoder.prefix_cache.hits == (5 if row_invariant else 4)


@pytest.mark.parametrize("row_invariant", [True, False])
def test_start_refuses_cached_rows_a_fresh_prefill_would_not_reproduce(tiny_artifact, row_invariant, monkeypatch):
    """Cached rows not ending on a prefill chunk are refused unless the graph is row-invariant (then any prefix
    is what a fresh prefill computes); all rows come with the last logits, and only all rows."""
    runner = Runner(tiny_artifact, drafter="none", threads=1)
    monkeypatch.setattr(runner.artifact.target, "row_invariant", row_invariant)
    ids = _ids(runner, "the cat sat on the mat")
    config = _config(runner, 4)
    fresh = runner.generator(plain=True).start(ids, config)
    refused = [(len(ids), None), (CHUNK, fresh.prompt_logits)] + ([] if row_invariant else [(12, None)])
    for rows, logits in refused:
        cache = runner.artifact.target.new_cache()
        cache.append([], range(rows), rows)
        with pytest.raises(ValueError):
            runner.generator(plain=True).start(ids, config, cache=cache, prefilled=logits, cached_rows=rows)
    if row_invariant:  # 12 rows of a fresh prefill, then the rest prefilled: the fresh prefill's logits
        cache = runner.artifact.target.new_cache()
        for array, rows in zip(cache.arrays, fresh.cache.arrays):
            array[:, :, :12] = rows[:, :, :12]
        cache.append([], range(12), 12)
        resumed = runner.generator(plain=True).start(ids, config, cache=cache, cached_rows=12)
        assert np.array_equal(resumed.prompt_logits, fresh.prompt_logits)


@pytest.mark.parametrize("row_invariant", [True, False])
def test_a_shared_system_prompt_is_reused_to_the_token(tiny_artifact, row_invariant, monkeypatch):
    """With the default prefill chunk (256 tokens, longer than these prompts): on the row-invariant graph a
    prompt reuses every token it shares with an earlier one (whole 16-token blocks, then the leading rows of
    the next), and its rows and first logits are bitwise a fresh prefill's; on a graph that is not
    row-invariant nothing short of a chunk is reused."""
    from speccompile.runtime.prefix_cache import PREFIX_BLOCK

    runner = Runner(tiny_artifact, drafter="none", threads=1)
    monkeypatch.setattr(runner.artifact.target, "row_invariant", row_invariant)
    first, second = (_ids(runner, SYSTEM + "and " + q) for q in ("what is a cat?", "where is the dog going now?"))
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert shared >= PREFIX_BLOCK
    decoder = runner.batch_decoder(2, prefix_cache=PrefixCache(64 << 20))
    decoder.leave(decoder.join(first, runner.config(4)))
    generation = decoder.join(second, runner.config(4))
    assert shared % PREFIX_BLOCK  # the shared part ends inside a block
    assert generation.stats.cached_tokens == (shared if row_invariant else 0)
    fresh = runner.generator(plain=True).start(second, runner.config(4))
    for buffer, rows in zip(decoder.passes.buffers, fresh.cache.arrays):
        assert np.array_equal(buffer[0, :, : len(second)], rows[0, :, : len(second)])
    assert np.array_equal(generation.prompt_logits, fresh.prompt_logits)


def _decode(runner: Runner, decoder, prompts: list[list[int]], max_tokens: int) -> list:
    """Continuous batching: requests join (alone, through the prefix cache) as slots free up."""
    waiting, running, results = list(enumerate(prompts)), {}, {}
    while waiting or running:
        batch = waiting[: decoder.free]
        del waiting[: len(batch)]
        for (i, _), generation in zip(batch, decoder.join_many([(ids, _config(runner, max_tokens), None) for _, ids in batch])):
            if generation.done:
                results[i] = generation.result()
            else:
                running[id(generation)] = (i, generation)
        for generation in decoder.step():
            results[running.pop(id(generation))[0]] = generation.result()
    return [results[i] for i in range(len(prompts))]


def test_batched_greedy_with_prefix_cache_equals_alone(tiny_artifact):
    """Requests sharing a system prompt, then the same requests again (whole-prompt hits): every answer
    equals the generation alone with the same prefill chunk."""
    runner = Runner(tiny_artifact, drafter="ngram", threads=1)
    prompts = [_ids(runner, SYSTEM + q) for q in ("abc abc abc", "hello there, hello", "x", "the cat sat on the mat. the cat")]
    decoder = runner.batch_decoder(3, prefix_cache=PrefixCache(64 << 20))
    first = _decode(runner, decoder, prompts, 20)
    again = _decode(runner, decoder, prompts, 20)
    for ids, a, b in zip(prompts, first, again):
        alone = runner.generator().generate(ids, _config(runner, 20))
        assert a.tokens == alone.tokens and b.tokens == alone.tokens
        assert b.stats.cached_tokens == len(ids)
    assert sum(r.stats.cached_tokens for r in first[1:]) >= 3 * (len(_ids(runner, SYSTEM)) // CHUNK) * CHUNK


def _arrays(rng, rows: int = 64) -> list[np.ndarray]:
    return [rng.standard_normal((1, 2, rows, 4)).astype(np.float32) for _ in range(2)]


def test_lru_keeps_the_byte_bound_and_evicts_least_recent_first():
    rng = np.random.default_rng(0)
    logits = np.zeros(10, np.float32)
    chunk_bytes = 2 * 2 * 4 * 4 * 4  # two buffers of [2, 4 rows, 4] float32
    whole = 3 * chunk_bytes + logits.nbytes  # 12 tokens: three chunks + a tail of no rows with the logits
    cache = PrefixCache(2 * whole)
    prompts = [list(range(10 * i, 10 * i + 12)) for i in range(3)]
    stored = {}
    for i, prompt in enumerate(prompts[:2]):
        stored[i] = _arrays(rng)
        cache.store("g", 4, prompt, stored[i], logits)
        assert cache.bytes <= cache.max_bytes
    assert cache.bytes == 2 * whole
    assert cache.lookup("g", 4, prompts[0]).full  # prompt 0 is now the most recent
    cache.store("g", 4, prompts[2], _arrays(rng), logits)
    assert cache.bytes <= cache.max_bytes
    assert cache.lookup("g", 4, prompts[1]) is None  # the least recently used went
    hit = cache.lookup("g", 4, prompts[0])
    assert hit.rows == 12 and hit.full
    target = [np.zeros_like(a) for a in stored[0]]
    hit.copy_into(target)
    assert all(np.array_equal(t[0, :, :12], s[0, :, :12]) for t, s in zip(target, stored[0]))
    assert cache.lookup("g", 8, prompts[0]) is None and cache.lookup("other graph", 4, prompts[0]) is None
    partial = cache.lookup("g", 4, prompts[0][:8] + [999, 998, 997])  # two whole chunks shared
    assert partial.rows == 8 and not partial.full
    tiny = PrefixCache(chunk_bytes - 1)  # no entry fits: nothing is kept
    tiny.store("g", 4, prompts[0], stored[0], logits)
    assert tiny.bytes == 0 and len(tiny) == 0 and tiny.lookup("g", 4, prompts[0]) is None


def test_eviction_drops_tails_before_the_chunks_they_hang_on():
    rng = np.random.default_rng(1)
    logits = np.zeros(10, np.float32)
    chunk_bytes = 2 * 2 * 4 * 4 * 4
    cache = PrefixCache(2 * chunk_bytes + 2 * logits.nbytes + 1)
    cache.store("g", 4, list(range(8)), _arrays(rng), logits)  # two chunks + tail
    cache.store("g", 4, list(range(8)) + [50], _arrays(rng), logits)  # its tail: one row + logits -> over budget
    assert cache.bytes <= cache.max_bytes
    assert cache.lookup("g", 4, list(range(8)) + [51]).rows == 8  # the shared chunks stayed


def test_server_reports_cached_tokens(tiny_artifact):
    """The real server and the openai client: a repeated prompt's usage counts its cached tokens, in the
    response and in a stream's usage chunk; the answers are the Runner's alone; --no-prefix-caching reuses none."""
    runner = Runner(tiny_artifact, threads=1)
    prompt = "the quick brown fox jumps"
    expected = runner.generate(prompt, chat=False, max_tokens=12).text
    with ServerProcess(tiny_artifact, "--served-model-name", "tiny", "--threads", "1") as server:
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
        ask = dict(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
        first = client.completions.create(**ask)
        second = client.completions.create(**ask)
        chunks = list(client.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
        metrics = httpx.get(server.base + "/metrics").text
    assert first.choices[0].text == second.choices[0].text == "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens
    assert f"speccompile_cached_prompt_tokens_total {2.0 * second.usage.prompt_tokens}" in metrics
    assert 'speccompile_prefix_cache_hits_total{kind="full"} 2.0' in metrics
    with ServerProcess(tiny_artifact, "--served-model-name", "tiny", "--threads", "1", "--no-prefix-caching") as server:
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
        answers = [client.completions.create(**ask) for _ in range(2)]
    assert [a.choices[0].text for a in answers] == [expected] * 2
    assert answers[1].usage.prompt_tokens_details.cached_tokens == 0


def test_partial_lookup_reuses_the_leading_rows_of_the_closest_entry():
    """`partial`: after the whole blocks, the leading rows of the block or prompt tail sharing the most next
    tokens (never the prompt's last token: its pass gives the logits); off, whole blocks only."""
    rng = np.random.default_rng(2)
    logits = np.zeros(10, np.float32)
    cache = PrefixCache(1 << 20)
    stored = _arrays(rng)
    cache.store("g", 4, list(range(10)), stored, logits)  # blocks [0:4], [4:8], tail [8:10]
    for prompt, whole, partial in [
        (list(range(6)) + [99], 4, 6),  # one block, then 2 rows of the second
        (list(range(9)) + [99], 8, 9),  # two blocks, then 1 row of the tail
        (list(range(9)), 8, 8),  # the tail's first row would leave no token to prefill
        ([0, 1, 99], None, 2),  # shorter than a block: 2 rows of the first
        ([99, 0, 1], None, None),  # nothing shares its first token
    ]:
        off, on = cache.lookup("g", 4, prompt), cache.lookup("g", 4, prompt, partial=True)
        assert (off.rows if off else None, on.rows if on else None) == (whole, partial), prompt
        if on is not None:
            target = [np.zeros_like(a) for a in stored]
            on.copy_into(target)
            assert all(np.array_equal(t[0, :, : on.rows], s[0, :, : on.rows]) for t, s in zip(target, stored))
            assert not on.full


def test_whole_prompt_logits_peeks_only_whole_prompts():
    """`whole_prompt_logits`: a stored prompt's logits (any length, a multiple of the block or not), nothing for
    its prefixes, extensions or another graph/block, and the LRU order and counters stay as they were."""
    rng = np.random.default_rng(3)
    cache = PrefixCache(1 << 20)
    stored = {}
    for prompt in (list(range(10)), list(range(8)), [7, 7, 7]):
        stored[tuple(prompt)] = rng.standard_normal(10).astype(np.float32)
        cache.store("g", 4, prompt, _arrays(rng), stored[tuple(prompt)])
    for prompt, logits in stored.items():
        assert np.array_equal(cache.whole_prompt_logits("g", 4, list(prompt)), logits)
    order, counts = list(cache._lru), (cache.lookups, cache.hits)
    for prompt in (list(range(9)), list(range(11)), list(range(4)), [7, 7], [], [5]):
        assert cache.whole_prompt_logits("g", 4, prompt) is None, prompt
    assert cache.whole_prompt_logits("g", 8, list(range(8))) is None
    assert cache.whole_prompt_logits("other", 4, list(range(8))) is None
    assert list(cache._lru) == order and (cache.lookups, cache.hits) == counts
