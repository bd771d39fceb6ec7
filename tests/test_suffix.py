"""Suffix decoding: the suffix tree's counts, its speculation rules, the global store (FIFO, tenants) and the
drafter's exactness (greedy identical to plain alone and batched, sampled distribution-exact, seeded reproducible)."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from speccompile.runtime import Runner
from speccompile.runtime.adaptive import GUESS, Sizing
from speccompile.runtime.drafters.base import GenerationStart, Observation
from speccompile.runtime.drafters.suffix import SuffixCache, SuffixDrafter
from speccompile.runtime.sampling import SamplingParams, sample
from speccompile.runtime.suffix_tree import SuffixTree
from speccompile.runtime.tree import TreeSpec
from speccompile.runtime.verification import verify_tree
from test_sampling import MIN_P_VALUE, ROOT, T, V, chi_square_p_value, encode, exact_joint, tables


def _substring_counts(seqs: dict, depth: int) -> Counter:
    """Brute force: occurrences of every substring of length <= depth."""
    counts = Counter()
    for seq in seqs.values():
        for i in range(len(seq)):
            for j in range(i + 1, min(len(seq), i + depth) + 1):
                counts[tuple(seq[i:j])] += 1
    return counts


def _tree_counts(tree: SuffixTree) -> Counter:
    """Every path of the tree with its count (a position inside an edge has its node's count)."""
    counts = Counter()

    def walk(node, path):
        if node is not tree.root:
            label = list(node.ref[node.start: node.start + node.length])
            for k in range(1, len(label) + 1):
                counts[tuple(path + label[:k])] = node.count
            path = path + label
        for child in (node.children or {}).values():
            assert child.parent is node and 0 < child.count <= node.count
            walk(child, path)

    walk(tree.root, [])
    return counts


def test_tree_counts_every_substring_through_appends_and_removals():
    rng = random.Random(0)
    for _ in range(150):
        depth, vocab = rng.randint(1, 6), rng.randint(1, 4)
        tree, seqs = SuffixTree(depth), {}
        for _ in range(rng.randint(1, 25)):
            if seqs and rng.random() < 0.2:
                key = rng.choice(list(seqs))
                tree.remove(key)
                del seqs[key]
            else:
                key = rng.randint(0, 4)
                tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 5))]
                seqs.setdefault(key, []).extend(tokens)
                tree.extend(key, tokens)
            assert _tree_counts(tree) == _substring_counts(seqs, depth)
            assert tree.tokens == sum(map(len, seqs.values()))


def test_speculation_scores_by_frequency_and_caps_by_match_length():
    tree = SuffixTree(8)
    tree.extend("a", [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 4])
    # after [1, 2, 3]: 4 twice, 5 once -> a tree of both, probabilities 2/3 and 1/3
    draft = tree.speculate([9, 1, 2, 3], max_tokens=8, min_token_prob=0.1)
    assert draft.match_len == 3 and draft.tokens[:2] in ([4, 5], [4, 1])
    assert draft.probs[0] == pytest.approx(2 / 3) and draft.score == pytest.approx(sum(draft.probs))
    assert all(draft.probs[i] >= draft.probs[i + 1] for i in range(len(draft.probs) - 1))  # best first
    assert all(parent < i for i, parent in enumerate(draft.parents))
    # at most max_spec_factor x match length tokens
    assert len(tree.speculate([9, 1, 2, 3], max_tokens=8, max_spec_factor=0.5).tokens) <= 1
    # a chain takes the most frequent branch; min_token_prob cuts improbable nodes
    chain = tree.speculate([9, 1, 2, 3], max_tokens=8, tree=False)
    assert chain.tokens[0] == 4 and chain.parents == list(range(-1, len(chain.tokens) - 1))
    assert 5 not in tree.speculate([9, 1, 2, 3], max_tokens=8, min_token_prob=0.5).tokens
    assert not tree.speculate([7, 7, 7], max_tokens=8).tokens  # nothing matches


def test_cache_evicts_oldest_first_and_keeps_tenants_apart():
    cache = SuffixCache(max_requests=2, max_depth=4)
    first, second = cache.open("alice"), cache.open("bob")
    cache.append(first, [1, 2, 3])
    cache.append(second, [4, 5, 6])
    assert cache.tree_of("alice").speculate([1, 1, 2], 4).tokens == [3]
    assert not cache.tree_of("bob").speculate([1, 1, 2], 4).tokens  # alice's text never drafts for bob
    assert cache.tree_of("carol") is None
    third = cache.open("bob")  # evicts alice's response
    cache.append(third, [7, 8])
    cache.append(first, [9])  # an evicted response is not stored again
    assert cache.tree_of("alice") is None and cache.requests == 2 and cache.tokens == 5
    shared = SuffixCache(max_requests=2, max_depth=4, share_tenants=True)
    shared.append(shared.open("alice"), [1, 2, 3])
    assert shared.tree_of("bob").speculate([1, 1, 2], 4).tokens == [3]


def test_drafter_learns_from_earlier_responses_and_sizes_by_cost():
    cache = SuffixCache(max_requests=10, max_depth=8)
    earlier = SuffixDrafter(cache)
    earlier.start(GenerationStart([50, 51]))
    earlier.observe(Observation(finished=[50, 51, 1, 2, 3, 4, 5, 6, 7, 8]))
    drafter = SuffixDrafter(cache)
    drafter.start(GenerationStart([60, 61, 1, 2, 3]))
    draft = drafter.propose([60, 61, 1, 2, 3], Sizing(8))  # not adaptive: the whole candidate
    assert draft.tokens == [4, 5, 6] and cache.proposals["global"] == 1  # 3 matched tokens: at most 3 drafted
    drafter.observe(Observation([4], draft=draft, accepted_rows=[1, 2, 3]))
    assert cache.accepted["global"] == 3
    guess = drafter.propose([60, 61, 1, 2, 3], GUESS)  # a plain step's guess: one token, not counted as a proposal
    assert guess.tokens == [4] and cache.proposals["global"] == 1
    seeded = SuffixDrafter(cache)
    seeded.start(GenerationStart([60, 61, 1, 2, 3], fresh=True))  # seeded sampling: its own text only
    assert not seeded.propose([60, 61, 1, 2, 3], Sizing(8)).tokens


def test_a_generation_s_own_settings_apply_to_it_alone():
    """DraftTuning (a server request's speculative_config): the suffix drafter's depth, least probability and
    spec factor for one generation, the runner's again for the next."""
    from speccompile.runtime.options import DraftTuning

    cache = SuffixCache(max_requests=10, max_depth=8)
    earlier = SuffixDrafter(cache)
    earlier.start(GenerationStart([50, 51]))
    earlier.observe(Observation(finished=[50, 51, 1, 2, 3, 4, 5, 6, 7, 8]))
    drafter = SuffixDrafter(cache)
    history = [60, 61, 1, 2, 3]
    drafter.start(GenerationStart(history, tuning=DraftTuning(spec_factor=2.0)))
    assert drafter.propose(history, Sizing(8)).tokens == [4, 5, 6, 7, 8]  # 2 per matched token: all 5 known
    drafter.start(GenerationStart(history, tuning=DraftTuning(max_depth=3)))
    assert drafter.propose(history, Sizing(8)).tokens == [4, 5]  # matches shorter than the depth: [2, 3], 2 drafted
    drafter.start(GenerationStart(history))
    assert drafter.propose(history, Sizing(8)).tokens == [4, 5, 6]  # the runner's settings again
    assert (drafter.max_depth, drafter.min_prob, drafter.spec_factor) == (8, 0.1, 1.0)


@pytest.mark.parametrize("tuning, drafter, field", [
    ({"max_match": 3}, "suffix", "max_match"), ({"min_prob": 0.5}, "ngram", "min_prob"),
    ({"min_match": 4, "max_match": 2}, "ngram", "min_match"), ({"min_prob": 1.5}, "suffix", "min_prob"),
    ({"spec_factor": 0.0}, "suffix", "spec_factor"), ({"max_depth": 0}, "suffix", "max_depth")])
def test_draft_tuning_refuses_another_drafter_s_settings_and_bad_values(tuning, drafter, field):
    from speccompile.errors import InputError
    from speccompile.runtime.options import DraftTuning

    with pytest.raises(InputError, match=field) as caught:
        DraftTuning(**tuning).validate(drafter)
    assert caught.value.field == field


def _speculative_counts(p: np.ndarray, prompt: list[int], n: int, seed: int) -> tuple[np.ndarray, int]:
    """Counts of the first T tokens of n sampled generations verified against suffix drafts (trees and chains
    from the prompt's suffix tree: deterministic in the history, so memoized), and how many drafts were trees."""
    rng = np.random.default_rng(seed)
    drafter = SuffixDrafter(SuffixCache(max_requests=0, max_depth=6, min_prob=0.05, spec_factor=2.0))
    drafts: dict[tuple, tuple[TreeSpec | None, list[int]]] = {}
    codes = np.empty(n, dtype=np.int64)
    for s in range(n):
        out: list[int] = []
        while len(out) < T:
            history = tuple(prompt + out)
            if history not in drafts:
                drafter.start(GenerationStart(prompt[:-1]))
                draft = drafter.propose(list(history), Sizing(4))
                tree = draft.tree if draft.tree is not None else (TreeSpec.chain(len(draft.tokens)) if draft.tokens else None)
                drafts[history] = (tree, [history[-1], *draft.tokens])
            tree, nodes = drafts[history]
            out += verify_tree(tree, nodes, p[nodes], rng).tokens if tree is not None else [sample(p[history[-1]], rng)]
        codes[s] = encode(out)
    return np.bincount(codes, minlength=V ** T), sum(1 for tree, _ in drafts.values() if tree is not None and not tree.is_chain)


def test_sampled_output_with_suffix_trees_is_exact():
    p, _ = tables(SamplingParams(0.9), SamplingParams(1.0))
    text = random.Random(3)
    prompt = [text.choice([0, 1, 2, 3, 4, 5, 6, 7, 1, 1, 2]) for _ in range(60)] + [ROOT]
    counts, trees = _speculative_counts(p, prompt, 60_000, seed=11)
    assert trees > 0  # branching drafts were verified
    assert chi_square_p_value(counts, exact_joint(p)) > MIN_P_VALUE


# -- the runtime: greedy identical to plain, alone and batched; seeded sampling reproducible ------------------------

PROMPTS = ["abc abc abc abc", "the cat sat on the mat. the cat", "x = 1; y = 2; x = 1; y =", "abc abc abc abc"]


@pytest.mark.parametrize("adaptive", [True, False])
def test_greedy_output_is_plain_decodings_and_later_requests_draft_from_earlier(tiny_artifact, adaptive):
    runner = Runner(tiny_artifact, drafter="suffix", threads=1, adaptive=adaptive)
    for prompt in PROMPTS:
        ids = runner.artifact.tokenizer.prompt_ids(prompt, False)
        result = runner.generate_ids(ids, 24)
        assert result.tokens == runner.generate_ids(ids, 24, drafter="none").tokens
    cache = runner.suffix_cache
    assert cache.requests == len(PROMPTS)
    if not adaptive:  # (adaptive: whether drafting pays depends on the measured pass times)
        assert cache.proposals["global"] > 0 and cache.accepted["global"] > 0  # the repeated prompt drafted from history


@pytest.mark.parametrize("drafter, tuning", [("suffix", {"max_depth": 3, "spec_factor": 4.0}),
                                             ("ngram", {"min_match": 2, "max_match": 2})])
def test_a_request_s_draft_settings_keep_greedy_output_and_cap_its_drafts(tiny_artifact, drafter, tuning):
    """Runner.config's num_draft_tokens and draft_tuning (a server request's speculative_config), batched."""
    from speccompile.errors import InputError
    from speccompile.runtime.options import DraftTuning

    runner = Runner(tiny_artifact, drafter=drafter, threads=1, adaptive=False)
    ids = runner.artifact.tokenizer.prompt_ids(PROMPTS[0], False)
    plain = runner.generate_ids(ids, 24, drafter="none").tokens
    assert runner.generate_ids(ids, 24).tokens == plain  # (suffix: the store now holds the answer, so long drafts)
    decoder = runner.batch_decoder(3)
    configs = [runner.config(24, num_draft_tokens=2), runner.config(24, draft_tuning=DraftTuning(**tuning)),
               runner.config(24)]
    assert [c.num_draft_tokens for c in configs] == [2, runner.num_draft_tokens, runner.num_draft_tokens]
    generations = decoder.join_many([(ids, config, None) for config in configs])
    while decoder.active:
        decoder.step()
    results = [g.result() for g in generations]
    assert [r.tokens for r in results] == [plain] * 3
    assert len(results[0].stats.drafted) <= 2  # draft positions used
    if drafter == "suffix":
        assert len(results[2].stats.drafted) > 2
    with pytest.raises(InputError, match="num_draft_tokens"):
        runner.config(24, num_draft_tokens=runner.num_draft_tokens + 1)
    other = {"suffix": {"max_match": 2}, "ngram": {"max_depth": 2}}[drafter]
    with pytest.raises(InputError, match=next(iter(other))):
        runner.config(24, draft_tuning=DraftTuning(**other))
    if drafter == "suffix":
        with pytest.raises(InputError, match="max_depth"):
            runner.config(24, draft_tuning=DraftTuning(max_depth=runner.suffix_cache.max_depth + 1))


def test_batched_greedy_and_seeded_equal_alone(tiny_artifact):
    runner = Runner(tiny_artifact, drafter="suffix", threads=1)
    prompts = [runner.artifact.tokenizer.prompt_ids(p, False) for p in PROMPTS]
    seeded = SamplingParams(temperature=0.9, seed=7)
    alone = [runner.generate_ids(ids, 20).tokens for ids in prompts]
    alone_seeded = runner.generate_ids(prompts[1], 20, seeded).tokens
    decoder = runner.batch_decoder(len(prompts) + 1)
    configs = [runner.config(20, user="u") for _ in prompts] + [runner.config(20, seeded)]
    generations = decoder.join_many([(ids, config, None) for ids, config in zip(prompts + [prompts[1]], configs)])
    results = {}
    while decoder.active:
        for generation in decoder.step():
            results[generations.index(generation)] = generation.result().tokens
    assert [results[i] for i in range(len(prompts))] == alone
    assert results[len(prompts)] == alone_seeded  # seeded: the global store (changed since) is not drafted from


# -- the server: one store for every slot, vLLM's speculative_config, tenants, metrics --------------------------------


def test_speculative_config_takes_vllm_s_spellings_and_keys_of_its_method_only():
    from pydantic import ValidationError

    from speccompile.serve.schemas import SpeculativeConfig

    assert [SpeculativeConfig(method=m).method for m in ("qwen3_next_mtp", "deepseek_mtp", "draft_model", "suffix")] == \
        ["mtp", "mtp", "draft-model", "suffix"]
    tuned = SpeculativeConfig(method="ngram", prompt_lookup_min=2, prompt_lookup_max=5).tuning()
    assert (tuned.min_match, tuned.max_match) == (2, 5) and SpeculativeConfig(method="ngram").tuning() is None
    for bad in ({"method": "ngram", "suffix_decoding_min_token_prob": 0.2}, {"method": "suffix", "prompt_lookup_max": 3},
                {"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, {"method": "suffix", "model": "x"}):
        with pytest.raises(ValidationError):
            SpeculativeConfig(**bad)


def test_server_drafts_from_earlier_responses_of_the_same_user(tiny_artifact):
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from conftest import load_benchmark

    server = load_benchmark("server_process").ServerProcess(tiny_artifact, "--drafter", "suffix", "--no-adaptive", "--threads",
                                                            "1", "--max-concurrency", "2", "--served-model-name", "m")
    try:
        def complete(user: str | None, method: str | dict = "suffix") -> httpx.Response:
            config = method if isinstance(method, dict) else {"method": method}
            body = {"model": "m", "prompt": PROMPTS[1], "max_tokens": 16, "temperature": 0,
                    "speculative_config": config, **({"user": user} if user else {})}
            return httpx.post(server.url + "/completions", json=body, timeout=120)

        def text(user: str | None, method: str | dict = "suffix") -> str:
            response = complete(user, method)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["text"]

        texts = [text("alice") for _ in range(2)]
        plain = text("bob", "none")
        assert texts == [plain, plain]  # greedy: the suffix drafter's output is plain decoding's
        refused = complete("alice", "ngram")  # not this server's drafter
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "speculative_config.method"
        assert text("alice", {"method": "suffix", "num_speculative_tokens": 2, "suffix_decoding_max_tree_depth": 4,
                              "suffix_decoding_min_token_prob": 0.3, "suffix_decoding_max_spec_factor": 2.0,
                              "suffix_decoding_max_cached_requests": 10000}) == plain  # vLLM's keys, this request's
        for config, param in [({"num_speculative_tokens": 10_000}, "num_speculative_tokens"),
                              ({"suffix_decoding_max_tree_depth": 10_000}, "suffix_decoding_max_tree_depth"),
                              ({"suffix_decoding_max_cached_requests": 3}, "suffix_decoding_max_cached_requests"),
                              ({"suffix_decoding_min_token_prob": 2}, "suffix_decoding_min_token_prob"),
                              ({"prompt_lookup_max": 3}, "")]:  # (another method's key: the whole config)
            error = complete("alice", {"method": "suffix", **config}).json()["error"]
            assert error["param"] == f"speculative_config.{param}".rstrip("."), error
        assert httpx.post(server.url + "/completions", json={"model": "m", "prompt": "x", "speculative_config":
                                                             {"method": "suffix", "bogus": 1}}).status_code in (400, 422)
        values = {}
        for family in text_string_to_metric_families(httpx.get(server.base + "/metrics").text):
            for sample in family.samples:
                values[(sample.name, tuple(sorted(sample.labels.values())))] = sample.value
        assert values[("speccompile_suffix_cached_requests", ())] == 3  # alice's three responses (bob's was plain)
        assert values[("speccompile_suffix_proposals_total", ("global",))] > 0  # alice's second drafted from her first
    finally:
        assert server.stop() == 0


def test_bench_replay_keeps_the_store_across_prompts(tiny_artifact, tmp_path):
    from speccompile.runtime.bench import run_bench
    from speccompile.runtime.options import RunOptions

    workload = tmp_path / "sessions.jsonl"
    workload.write_text("".join(f'{{"id": "{i}", "prompt": "{p}", "chat": false}}\n' for i, p in enumerate(PROMPTS)))
    hits = {}
    for replay in (False, True):
        options = RunOptions(drafter="suffix", threads=1, adaptive=False)
        report = run_bench(tiny_artifact, options, [workload], 16, None, False, replay=replay)
        assert report["replay"] == replay and report["workloads"]["sessions"]["identical"] == len(PROMPTS)
        hits[replay] = report["workloads"]["sessions"]["mean_accepted_length"]
    assert hits[True] > hits[False]  # the repeated prompt drafts its whole answer from the first one's


@pytest.mark.parametrize("field, value", [("suffix_min_prob", 1.5), ("suffix_spec_factor", 0.0), ("suffix_max_depth", 0),
                                          ("suffix_cache_requests", -1)])
def test_bad_suffix_options_are_refused_before_loading(tiny_artifact, field, value):
    from speccompile.errors import InputError

    with pytest.raises(InputError, match=field):
        Runner(tiny_artifact, drafter="suffix", **{field: value})


def test_suffix_bound_models_the_drafter_below_its_perfect_pruning():
    """benchmarks/suffix_bound.py: on traces whose later answers repeat an earlier one, the drafter's modelled
    speed is above plain decoding and at most the bound's (a drafter that drafts only what will be accepted);
    where a verified row costs as much as a pass, the drafter only probes and the bound gains nothing."""
    import argparse

    from conftest import load_benchmark

    bound = load_benchmark("suffix_bound")
    answer = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20] * 2
    traces = [{"prompt": [1, 2, 3, n], "answer": list(answer)} for n in range(4)]
    args = argparse.Namespace(cache_requests=100, max_depth=24, min_prob=0.1, spec_factor=1.0, max_spec=24, tree=True)
    cheap = {1: 1.0, 2: 1.05, 8: 1.4, 25: 2.2}
    drafted = bound.replay(traces, bound.cost_table(cheap), args, bound=False)
    perfect = bound.replay(traces, bound.cost_table(cheap), args, bound=True)
    assert 1.0 < drafted["speedup"] <= perfect["speedup"] and perfect["acceptance"] == 1.0
    dear = {1: 1.0, 2: 2.0, 25: 25.0}
    assert bound.replay(traces, bound.cost_table(dear), args, bound=False)["drafted_per_pass"] <= 1 / 8 + 0.01  # probes only
    assert bound.replay(traces, bound.cost_table(dear), args, bound=True)["speedup"] <= 1.0
