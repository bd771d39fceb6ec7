"""Constrained speculative decoding is exact: greedy == plain constrained greedy on every drafter (n-gram, draft
model, a head with trees), alone and batched; sampled first tokens follow the masked target (chi-square),
through the real OutputRules (runtime/constrained.py), xgrammar and the real verifiers."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from speccompile.runtime.backends.base import StepOutput
from speccompile.runtime.constrained import OutputRules
from speccompile.runtime.constraints import ConstraintSpec
from speccompile.runtime.drafters.base import Draft
from speccompile.runtime.grammar import GrammarCompiler
from speccompile.runtime.sampling import SamplingParams, process_logits, sample
from speccompile.runtime.verification import verify_chain, verify_tree
from speccompile.runtime.session import Runner
from speccompile.runtime.tree import TreeSpec
from test_sampling import chi_square_p_value

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "c": {"enum": ["red", "green", "blue"]}}, "required": ["name", "n", "c"], "additionalProperties": False}
PROMPTS = ["hello world", '{"name": "ab", "n": 7, "c": "red"} {"name": "ab", "n": 7, "c": "red"} {"name": "ab"']


def _check(result) -> None:
    value = json.loads(result.text)
    assert set(value) == {"name", "n", "c"} and value["c"] in ("red", "green", "blue") and 0 <= value["n"] <= 99


@pytest.mark.parametrize("drafter", ["ngram", "draft-model"])
def test_greedy_constrained_speculative_equals_plain(tiny_artifact, tiny_artifact_with_draft, drafter):
    artifact = tiny_artifact if drafter == "ngram" else tiny_artifact_with_draft
    runner = Runner(artifact, drafter=drafter, threads=1, adaptive=False)
    spec = runner.compile_constraint(ConstraintSpec.json_schema(SCHEMA))
    drafted = 0
    for prompt in PROMPTS:
        plain = runner.generate(prompt, chat=False, max_tokens=60, drafter="none", constraint=spec, logprobs=0)
        fast = runner.generate(prompt, chat=False, max_tokens=60, constraint=spec, logprobs=0)
        assert fast.tokens == plain.tokens and fast.finish_reason == "stop"
        assert [e.logprob for e in fast.logprobs] == [e.logprob for e in plain.logprobs]  # the same rows' bits
        _check(fast)
        drafted += sum(fast.stats.drafted)
        assert "".join(runner.stream(prompt, chat=False, max_tokens=60, constraint=spec)) == fast.text
    assert drafted > 0


def test_greedy_constrained_with_a_head_and_trees(tmp_path_factory):
    from test_heads_helpers import shared_target, word_prompt_ids
    from test_heads_runtime import export_with

    target = shared_target(tmp_path_factory)
    artifact = tmp_path_factory.mktemp("constrained_head") / "eagle"
    export_with("eagle", target, artifact)
    runner = Runner(artifact, drafter="eagle", threads=1, adaptive=False)
    spec = runner.compile_constraint(ConstraintSpec("regex", "( ?[a-z]{1,5}){3,8}"))
    for tree in ("chain-4", "tree-2x3", "dynamic-4-3-12"):
        runner = Runner(artifact, drafter="eagle", tree=tree, threads=1, adaptive=False)
        for prompt in ([1, 40, 41, 42, 43, 40, 41, 42], word_prompt_ids(1)):
            plain = runner.generate_ids(prompt, 40, drafter="none", constraint=spec)
            fast = runner.generate_ids(prompt, 40, constraint=spec)
            assert fast.tokens == plain.tokens, tree
            assert fast.stats.draft_steps > 0


def test_batched_greedy_constrained_equals_alone(tiny_artifact):
    runner = Runner(tiny_artifact, threads=1)
    spec = runner.compile_constraint(ConstraintSpec.json_schema(SCHEMA))
    ids = [runner.artifact.tokenizer.prompt_ids(p + " " * i, chat=False) for i, p in enumerate(PROMPTS * 3)]
    decoder = runner.batch_decoder(4)
    pending = [(prompt, runner.config(60, constraint=spec)) for prompt in ids]
    results = {}
    while pending or decoder.active:
        while pending and decoder.free:
            prompt, config = pending.pop()
            results[tuple(prompt)] = decoder.join(prompt, config)
        decoder.step()
    for prompt, generation in results.items():
        alone = runner.generate_ids(list(prompt), 60, drafter="none", constraint=spec)
        assert generation.result().tokens == alone.tokens
    assert decoder.batched_passes > 0


# ----------------------------------------------------------------------------------------------
# Trees: each node in its own path's state
# ----------------------------------------------------------------------------------------------

LETTERS = "abcdefgh"


@pytest.fixture(scope="module")
def letters(tmp_path_factory) -> GrammarCompiler:
    """A tokenizer of 8 letters + an end token: token i is LETTERS[i], 8 is </s>."""
    folder = tmp_path_factory.mktemp("letters")
    tok = Tokenizer(models.WordLevel({**{c: i for i, c in enumerate(LETTERS)}, "</s>": 8}, unk_token="</s>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.add_special_tokens(["</s>"])
    tok.save(str(folder / "tokenizer.json"))
    return GrammarCompiler(folder, 9, [8])


def test_tree_nodes_are_cut_in_their_own_path_state(letters):
    rules = OutputRules(SamplingParams(), letters.compile(ConstraintSpec("regex", "(ab|ba)c")), None)
    # root; children a (ok), c (refused: its subtree goes); a's children b (ok), a (refused); c's child b
    tree = TreeSpec([-1, 0, 0, 1, 1, 2], [0, 0, 1, 0, 1, 0])
    draft = Draft([0, 2, 1, 0, 1], tree=tree)
    cut, plan = rules.plan(draft)
    assert cut.tokens == [0, 1] and cut.tree.parents.tolist() == [-1, 0, 1]
    assert plan.proposed is draft and plan.proposed_rows([1, 2]) == [1, 3]
    logits = np.zeros((3, 9), dtype=np.float32)
    masks = np.isfinite(rules.masked(plan, StepOutput(logits, [])).logits)
    assert [np.flatnonzero(m).tolist() for m in masks] == [[0, 1], [1], [2]]  # root: a|b; after a: b; after ab: c


# ----------------------------------------------------------------------------------------------
# Sampling: chi-square of the first tokens against the exact masked target
# ----------------------------------------------------------------------------------------------

V, T, ROOT, N = 9, 3, 3, 4000
GRAMMAR = "[abcd][b-h][aceg]"  # a different allowed set at each position


def _tables(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    target = rng.normal(size=(V, V)) * 1.5
    return target, 0.7 * target + 0.3 * rng.normal(size=(V, V)) * 1.5


def _exact_masked_joint(target: np.ndarray, params: SamplingParams, letters: GrammarCompiler) -> np.ndarray:
    """P(first T tokens) of plain constrained sampling, by enumeration: each step's row masked in its state."""
    joint = np.zeros([V] * T)
    compiled = letters.compile(ConstraintSpec("regex", GRAMMAR))

    def walk(prefix: list[int], prob: float) -> None:
        if len(prefix) == T:
            joint[tuple(prefix)] += prob
            return
        state = compiled.new_state()
        state.advance(prefix)
        row = np.where(state.allowed_tokens(), target[prefix[-1] if prefix else ROOT], -np.inf)
        for token, p in enumerate(process_logits(row, params)):
            if p > 0:
                walk(prefix + [token], prob * p)

    walk([], 1.0)
    return joint


def _sample_constrained(target, draft_table, params, letters, mode: str, seed: int) -> np.ndarray:
    """Counts of the first T tokens of N constrained speculative generations through OutputRules: chains drafted
    from the (unconstrained) draft table, one-hot or soft, or a deterministic tree of its top-2 / top-1 picks."""
    rng = np.random.default_rng(seed)
    compiled = letters.compile(ConstraintSpec("regex", GRAMMAR))
    q_table = process_logits(draft_table, SamplingParams(1.0))
    counts = np.zeros(V ** T, dtype=np.int64)
    for _ in range(N):
        rules = OutputRules(params, compiled, None)
        first = sample(process_logits(rules.first_logits(target[ROOT]), params), rng)
        rules.emit(target[ROOT][None], [first], 0)
        out = [first]
        while len(out) < T:
            draft = _draft(q_table, out[-1], mode, rng)
            draft, plan = rules.plan(draft, 4 if mode != "tree" else 0)  # chains: the grammar's forced tokens too
            nodes = [out[-1], *draft.tokens]
            rows = rules.masked(plan, StepOutput(target[nodes].astype(np.float32), [])).logits
            probs = process_logits(rows, params)
            if draft.tree is not None:
                tokens = verify_tree(draft.tree, nodes, probs, rng).tokens
            else:
                tokens = verify_chain(draft.tokens, probs, rng, draft.probs).tokens
            if 8 in tokens:  # the loop stops at the end token (the grammar allows it only after T tokens)
                tokens = tokens[: tokens.index(8) + 1]
            rules.emit(rows, tokens, 0)
            out += tokens
        counts[np.ravel_multi_index(out[:T], [V] * T)] += 1
    return counts


def _draft(q: np.ndarray, last: int, mode: str, rng) -> Draft:
    if mode == "tree":  # top-2 children of the last token, each extended by its top-1
        first = np.argsort(-q[last], kind="stable")[:2].tolist()
        return Draft([*first, *[int(q[t].argmax()) for t in first]], tree=TreeSpec([-1, 0, 0, 1, 2], [0, 0, 1, 0, 0]))
    tokens, probs, prev = [], [], last
    for _ in range(2):
        row = q[prev]
        prev = sample(row, rng) if mode == "soft" else int(row.argmax())
        tokens.append(prev)
        probs.append(row)
    return Draft(tokens, np.stack(probs) if mode == "soft" else None)


@pytest.mark.parametrize("mode, params", [
    ("one-hot", SamplingParams(0.8, top_k=6)),
    ("soft", SamplingParams(1.0)),  # refused drafts keep their row: the residual needs q
    ("tree", SamplingParams(0.9, top_p=0.95)),
])
def test_constrained_sampling_is_exact(letters, mode, params):
    target, draft = _tables()
    counts = _sample_constrained(target, draft, params, letters, mode, seed=len(mode))
    p = chi_square_p_value(counts, _exact_masked_joint(target, params, letters))
    assert p > 1e-3, f"chi-square p-value {p:.3g}"


def test_chi_square_sees_an_unmasked_target(letters):
    """Negative control: plain sampling without the mask is far from the masked target's distribution."""
    target, _ = _tables()
    params = SamplingParams(1.0)
    exact = _exact_masked_joint(target, params, letters)
    rng = np.random.default_rng(5)
    counts = np.zeros(V ** T, dtype=np.int64)
    p = process_logits(target, params)
    for _ in range(N):
        out = [sample(p[ROOT], rng)]
        while len(out) < T:
            out.append(sample(p[out[-1]], rng))
        counts[np.ravel_multi_index(out, [V] * T)] += 1
    assert chi_square_p_value(counts, exact) < 1e-6


def test_batched_constrained_sampling_is_exact(tiny_artifact):
    """2,000 seeded requests through the batch decoder (n-gram drafts, always on) under a grammar: their first three
    tokens follow the exact masked target, computed from plain passes' logits."""
    import dataclasses
    import re

    from speccompile.runtime.prefix_cache import PrefixCache

    runner = Runner(tiny_artifact, threads=1, adaptive=False)
    prompt = runner.artifact.tokenizer.prompt_ids("abcabcabcabcab", chat=False)
    letters = "abc"
    spec = runner.compile_constraint(ConstraintSpec("regex", f"[{letters}]{{3}}"))
    params = SamplingParams(1.2, top_k=20)
    ids = [runner.artifact.tokenizer.encode(c)[0] for c in letters]
    joint = np.zeros((3, 3, 3))

    def next_probs(prefix: str) -> np.ndarray:  # the plain pass's logits after the prefix, masked as the grammar does
        forced = runner.compile_constraint(ConstraintSpec("regex", re.escape(prefix) + f"[{letters}]"))
        config = dataclasses.replace(runner.config(len(prefix) + 1, constraint=forced, drafter="none"), trace_logits=True)
        row = runner.generator(plain=True).generate(prompt, config).logits[len(prefix)]
        return process_logits(row, params)[ids]

    for i, a in enumerate(letters):
        pa = next_probs("")[i]
        for j, b in enumerate(letters):
            pb = next_probs(a)[j]
            joint[i, j] = pa * pb * next_probs(a + b)
    decoder = runner.batch_decoder(8, prefix_cache=PrefixCache(1 << 24))
    counts, pending, drafted = np.zeros((3, 3, 3), dtype=np.int64), list(range(2000)), 0
    while pending or decoder.active:
        while pending and decoder.free:
            config = runner.config(3, dataclasses.replace(params, seed=pending.pop()), constraint=spec)
            decoder.join(prompt, config)
        for generation in decoder.step():
            tokens = generation.result().tokens
            counts[tuple(ids.index(t) for t in tokens)] += 1
            drafted += generation.stats.draft_steps
    assert drafted > 500 and decoder.batched_passes > 0
    p = chi_square_p_value(counts, joint)
    assert p > 1e-3, f"chi-square p-value {p:.3g}"
