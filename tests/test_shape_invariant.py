"""Shape-invariant verification (runtime/backends/shape_invariant.py), proved on ONNX Runtime CPU.

Every decode pass runs with the same number of rows and the same KV extent, so a position's logits are
bitwise the same whether it was computed by plain decoding, inside a chain verify pass or inside a tree
pass. Checked on the fused fp32 graph (buffer KV) and the contract graph at fp32 and fp16.
"""

from __future__ import annotations

import numpy as np
import pytest

from speccompile.export.pipeline import ExportOptions, export_artifact
from speccompile.runtime.artifact import open_artifact
from speccompile.runtime.backends.ort import OrtBufferSession
from speccompile.runtime.backends.shape_invariant import ShapeInvariantSession

from conftest import make_tiny_hf_model

MAX_CONTEXT = 96
PROMPT = 21


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> dict[str, tuple]:
    """name -> (directory, fused): fused fp32 (buffer KV), contract fp32, contract fp16."""
    root = tmp_path_factory.mktemp("shape_invariant")
    model = make_tiny_hf_model(root / "model", hidden_size=128, intermediate_size=256, num_attention_heads=4,
                               num_key_value_heads=2)
    fp32, fp16 = root / "fp32", root / "fp16"
    export_artifact(str(model), fp32, ExportOptions(max_context=MAX_CONTEXT))
    export_artifact(str(model), fp16, ExportOptions(max_context=MAX_CONTEXT, dtype="fp16"))
    return {"fused-fp32": (fp32, True), "contract-fp32": (fp32, False), "contract-fp16": (fp16, False)}


def _session(artifacts, name: str, rows: int | None):
    directory, fused = artifacts[name]
    target = open_artifact(directory, threads=1, fused=fused).target
    return ShapeInvariantSession(target, rows, MAX_CONTEXT) if rows else target


def _tokens(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, 90, n)


def _prefill(session, prompt: np.ndarray):
    cache = session.new_cache()
    q = len(prompt)
    out = session.run(prompt, np.arange(q), cache.attention_mask(np.tril(np.ones((q, q), bool))), cache)
    cache.append(out.presents, range(q), q)
    return cache


def _pass(session, cache, ids, depths, ancestry, keep) -> np.ndarray:
    """One decode pass (chain or tree rows) committing the rows in `keep`; returns the logits of all rows."""
    past = cache.length
    cache.maybe_compact(len(ids), MAX_CONTEXT)
    out = session.run(np.asarray(ids), past + np.asarray(depths), cache.attention_mask(ancestry), cache)
    cache.append(out.presents, keep, len(ids))
    return out.logits.copy()


def _chain(n: int) -> tuple[np.ndarray, np.ndarray]:
    return np.arange(n), np.tril(np.ones((n, n), bool))


def plain_logits(session, prompt, text) -> list[np.ndarray]:
    """Plain decoding of the fixed tokens `text`: one pass per token; logits at each of its positions."""
    cache = _prefill(session, prompt)
    depths, ancestry = _chain(1)
    return [_pass(session, cache, [token], depths, ancestry, [0])[0] for token in text]


def _ancestry(parents: list[int]) -> np.ndarray:
    ancestry = np.eye(len(parents), dtype=bool)
    for node, parent in enumerate(parents):
        while parent >= 0:
            ancestry[node, parent] = True
            parent = parents[parent]
    return ancestry


# tree layouts of the pass that verifies text[3..5]: (token slots, parents, rows of the accepted path)
MAIN_PATH_FIRST = (["t3", "t4", "t5", "d2", "d3"], [-1, 0, 1, 0, 1], [0, 1, 2])  # accepted path = chain prefix
BREADTH_FIRST = (["t3", "t4", "d2", "t5", "d3"], [-1, 0, 0, 1, 2], [0, 1, 3])  # the same tree as drafters order it
SIDE_BRANCH = (["t3", "d2", "t4", "d3", "t5"], [-1, 0, 0, 2, 2], [0, 2, 4])  # accepted path is not the first children


def speculative_logits(session, prompt, text, decoys, tree=MAIN_PATH_FIRST) -> list[np.ndarray]:
    """The same positions verified by speculative passes: a chain with two rejected rows, a tree with
    rejected siblings, and a last single-row pass."""
    cache = _prefill(session, prompt)
    got: list[np.ndarray] = []
    depths, ancestry = _chain(5)
    logits = _pass(session, cache, [*text[:3], *decoys[:2]], depths, ancestry, [0, 1, 2])
    got += list(logits[:3])
    names, parents, path = tree
    tokens = {"t3": text[3], "t4": text[4], "t5": text[5], "d2": decoys[2], "d3": decoys[3]}
    ancestry = _ancestry(parents)
    logits = _pass(session, cache, [tokens[n] for n in names], ancestry.sum(1) - 1, ancestry, path)
    got += [logits[row] for row in path]
    depths, ancestry = _chain(1)
    got.append(_pass(session, cache, [text[6]], depths, ancestry, [0])[0])
    return got


CASES = ["fused-fp32", "contract-fp32", "contract-fp16"]


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("rows", [5, 8, 16])
def test_padding_rows_never_change_a_real_row(artifacts, name, rows, monkeypatch):
    """Whatever the padding rows hold, the real rows' logits are bitwise the same (and match the unpadded pass)."""
    prompt, text = _tokens(0, PROMPT), _tokens(1, 7)
    session = _session(artifacts, name, rows)
    reference = speculative_logits(session, prompt, text, _tokens(2, 4))
    rng = np.random.default_rng(3)

    def noisy_pad(ids, count):  # padding rows with random tokens instead of the last real one
        return np.concatenate([ids.reshape(-1), rng.integers(3, 90, max(0, count - ids.size))])

    monkeypatch.setattr(session, "pad_tokens", noisy_pad)
    noisy = speculative_logits(session, prompt, text, _tokens(2, 4))
    for a, b in zip(reference, noisy):
        assert np.array_equal(a, b)
    unpadded = speculative_logits(_session(artifacts, name, None), prompt, text, _tokens(2, 4))
    tolerance = 2e-2 if name.endswith("fp16") else 1e-4
    for a, b in zip(reference, unpadded):
        np.testing.assert_allclose(a, b, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("tree", [MAIN_PATH_FIRST, BREADTH_FIRST], ids=["main-path-first", "breadth-first"])
def test_plain_chain_and_tree_logits_are_bitwise_equal(artifacts, name, tree):
    """Breadth-first trees too: the session runs the main path first and tells the cache where rows went."""
    session = _session(artifacts, name, 8)
    prompt, text = _tokens(0, PROMPT), _tokens(1, 7)
    plain = plain_logits(session, prompt, text)
    speculative = speculative_logits(session, prompt, text, _tokens(2, 4), tree)
    for position, (a, b) in enumerate(zip(plain, speculative)):
        assert np.array_equal(a, b), f"position {PROMPT + position}: max |diff| {np.abs(a - b).max()}"


def _differs(plain, speculative) -> bool:
    return any(not np.array_equal(a, b) for a, b in zip(plain, speculative))


def _without_attention_padding(monkeypatch) -> None:
    """The fused graph as exported before its one-row attention padding (export/ort_fused_graph.py): a pass
    of one row runs ONNX Runtime's one-row attention kernel."""
    monkeypatch.setattr(OrtBufferSession, "_padding_rows", lambda self, q, batch=1: 0)


def _without_tree_layout(monkeypatch) -> None:
    """Trees run in the drafter's row order (breadth first), as before the fused session laid them out."""
    from speccompile.runtime.backends import tree_layout

    monkeypatch.setattr(tree_layout, "main_path_first", lambda ancestry: (np.arange(len(ancestry)), np.ones(len(ancestry), bool)))


def test_the_fused_graph_is_exact_without_the_mode(artifacts, monkeypatch):
    """On the CPU the fused fp32 graph needs no mode: its one-row passes get attention's padding row, ONNX
    Runtime CPU computes each row alike in any pass of >= 2 rows, and the session lays a tree out main path
    first (tree_layout.py), so a breadth-first tree's accepted main path is bitwise plain decoding too. The
    checks have teeth: in the drafter's order a breadth-first tree (keys after a masked sibling) differs, and
    without the padding row a row differs between a 1-row and a 5-row pass (the one-row attention kernel)."""
    session = _session(artifacts, "fused-fp32", None)
    prompt, text = _tokens(0, PROMPT), _tokens(1, 7)
    plain = plain_logits(session, prompt, text)
    assert not _differs(plain, speculative_logits(session, prompt, text, _tokens(2, 4)))
    assert not _differs(plain, speculative_logits(session, prompt, text, _tokens(2, 4), BREADTH_FIRST))
    with monkeypatch.context() as patch:
        _without_tree_layout(patch)
        assert _differs(plain, speculative_logits(session, prompt, text, _tokens(2, 4), BREADTH_FIRST))
    _without_attention_padding(monkeypatch)
    assert _differs(plain_logits(session, prompt, text), speculative_logits(session, prompt, text, _tokens(2, 4)))


def test_varying_the_rows_breaks_it(artifacts, monkeypatch):
    """Same as the mode, except that each pass is padded only to its own q, on a graph whose one-row passes
    run the one-row attention kernel (as a GPU kernel picks its tiles by q): the logits differ again."""
    _without_attention_padding(monkeypatch)
    session = _session(artifacts, "fused-fp32", 8)
    run = ShapeInvariantSession.run

    def unpadded(self, input_ids, position_ids, attention_mask, cache):
        self.rows = int(np.asarray(input_ids).size)
        try:
            return run(self, input_ids, position_ids, attention_mask, cache)
        finally:
            self.rows = 8

    monkeypatch.setattr(ShapeInvariantSession, "run", unpadded)
    prompt, text = _tokens(0, PROMPT), _tokens(1, 7)
    assert _differs(plain_logits(session, prompt, text), speculative_logits(session, prompt, text, _tokens(2, 4)))


class _DeadSlots:
    """The contract-graph target with a cache that keeps rejected rows as dead slots (up to 64, as GPU
    backends do without the mode; on the CPU the cache squeezes them out before every pass)."""

    def __init__(self, inner):
        self.inner = inner

    def new_cache(self):
        return self.inner.new_cache(max_dead=64)

    def run(self, input_ids, position_ids, attention_mask, cache, last_logits_only=False):
        return self.inner.run(input_ids, position_ids, attention_mask, cache, last_logits_only)


def test_contract_graph_without_compaction_differs(artifacts):
    """The contract graph without the mode: a tree's rejected rows stay as dead slots between live ones, so
    later keys are not at slot == position and the logits after the tree differ."""
    session = _DeadSlots(_session(artifacts, "contract-fp32", None))
    prompt, text = _tokens(0, PROMPT), _tokens(1, 7)
    assert _differs(plain_logits(session, prompt, text), speculative_logits(session, prompt, text, _tokens(2, 4)))


@pytest.mark.parametrize("name", ["fused-fp32", "contract-fp32"])
def test_tree_nodes_after_siblings_are_not_guaranteed(artifacts, name):
    """The documented limit: a tree node laid out after a sibling sees its ancestors with a masked hole
    between them, and its logits (and those of every position after it) differ in the last bits."""
    session = _session(artifacts, name, 8)
    prompt, text = _tokens(0, PROMPT), _tokens(1, 7)
    plain = plain_logits(session, prompt, text)
    side = speculative_logits(session, prompt, text, _tokens(2, 4), SIDE_BRANCH)
    assert all(np.array_equal(a, b) for a, b in zip(plain[:4], side[:4]))  # chain and the tree's root
    assert _differs(plain[4:], side[4:])


def test_fused_graph_sees_the_same_kv_extent_every_pass(artifacts):
    """Every pass (prefill chunk, plain step, chain, tree) reaches GroupQueryAttention with the same
    rows and total_sequence_length; on the CPU the kernel reads only the live window, so varying the
    capacity changes no bit there: this checks the shapes the GPU kernels would see."""
    session = _session(artifacts, "fused-fp32", 8)
    seen: list[tuple[int, int]] = []
    inner_run = session.inner.run

    def spy(input_ids, position_ids, attention_mask, cache):
        seen.append((int(np.asarray(input_ids).size), int(attention_mask.shape[-1])))
        return inner_run(input_ids, position_ids, attention_mask, cache)

    session.inner.run = spy
    prompt, text = _tokens(0, 6), _tokens(1, 7)
    plain_logits(session, prompt, text)
    speculative_logits(session, prompt, text, _tokens(2, 4))
    assert set(seen) == {(8, MAX_CONTEXT + 8)}


def test_fp32_on_cuda_never_uses_tf32():
    from speccompile.runtime.backends.ort import execution_providers

    assert execution_providers("ort-cuda", "fp32")[0] == ("CUDAExecutionProvider", {"use_tf32": "0"})
    assert ("CUDAExecutionProvider", {"use_tf32": "0"}) in execution_providers("ort-trt", "fp32")
    assert execution_providers("ort-cuda", "fp16")[0] == "CUDAExecutionProvider"
    assert execution_providers("ort-cpu", "fp32") == ["CPUExecutionProvider"]


def test_exact_acceptance_keeps_the_plain_exact_rows_and_the_next_token():
    from speccompile.runtime.backends.tree_layout import main_path_first
    from speccompile.runtime.verification import exact_acceptance

    order, exact = main_path_first(_ancestry(BREADTH_FIRST[1]))
    assert order.tolist() == [0, 1, 3, 2, 4] and exact.tolist() == [True, True, False, True, False]
    deeper_order, deeper_exact = main_path_first(_ancestry([-1, 0, 0, 2, 3]))  # the deepest branch is the main path
    assert deeper_order.tolist() == [0, 2, 3, 4, 1] and deeper_exact.tolist() == [True, False, True, True, True]
    assert exact_acceptance([1, 3], [10, 11, 12], exact) == ([1, 3], [10, 11, 12])
    assert exact_acceptance([2, 4], [10, 11, 12], exact) == ([], [10])  # row 2 is not the first child
    order, exact = main_path_first(np.tril(np.ones((4, 4), bool)))
    assert order.tolist() == [0, 1, 2, 3] and exact.all()
    assert exact_acceptance([], [10], exact) == ([], [10])


@pytest.mark.parametrize("rows", [8, None], ids=["mode", "fused-default"])
def test_side_branch_rows_are_marked_not_exact(artifacts, rows):
    """The pass reports which rows are plain-exact; the side branch's are not (and do differ). The fused
    session does so without the mode too; a chain needs no marks there (every row is plain decoding's)."""
    session = _session(artifacts, "fused-fp32", rows)
    cache = _prefill(session, _tokens(0, PROMPT))
    ancestry = _ancestry(SIDE_BRANCH[1])
    out = session.run(_tokens(1, 5), cache.length + ancestry.sum(1) - 1, cache.attention_mask(ancestry), cache)
    assert out.plain_exact.tolist() == [True, False, True, True, False]  # main path: root, t4, d3 (the deepest)
    if rows is None:
        chain = session.run(_tokens(1, 3), cache.length + np.arange(3), cache.attention_mask(np.tril(np.ones((3, 3), bool))), cache)
        assert chain.plain_exact is None


def test_verify_and_bench_say_which_mode_ran(tiny_artifact):
    import json

    from conftest import run_cli

    done = run_cli("verify", str(tiny_artifact), "--drafter", "ngram", "--max-tokens", "24", "--limit", "2",
                   "--shape-invariant", "--threads", "1", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["identical"] and report["shape_invariant"] == 64 and report["row_invariant"] is False  # the wrapper claims none
    done = run_cli("verify", str(tiny_artifact), "--drafter", "ngram", "--max-tokens", "8", "--limit", "1", "--threads", "1")
    assert done.returncode == 0 and "shape-invariant off, row-invariant graph" in done.stdout  # ort-cpu default


@pytest.mark.parametrize("shape_invariant", [16, False], ids=["mode", "fused-default"])
def test_tree_drafter_greedy_equals_plain(tmp_path, tmp_path_factory, shape_invariant):
    """End to end through the generation loop: a head drafter's trees (with the n-gram lookup branch,
    which is often not the main path) give plain decoding's tokens, chosen from bitwise the same logits, in
    shape-invariant mode and on the CPU's default fused session (trees laid out main path first)."""
    from speccompile.draft_config import DraftConfig
    from speccompile.runtime.session import Runner

    from test_heads_helpers import shared_target, word_prompt_ids
    from test_heads_runtime import PROMPTS, export_with

    export_with("mtp", shared_target(tmp_path_factory), tmp_path / "art")
    runner = Runner(tmp_path / "art", drafter="mtp", num_draft_tokens=4, adaptive=False, threads=1, shape_invariant=shape_invariant)
    assert runner.artifact.target.row_invariant == (not shape_invariant)
    drafter = runner.drafter()
    drafter.inner.set_tree(DraftConfig("mtp", 4, ((0,), (1,), (0, 0), (1, 0), (0, 0, 0))))
    accepted = cuts = 0
    for prompt in [PROMPTS[0], word_prompt_ids(1)]:
        plain, spec = (_traced(runner, prompt, 32, drafter) for drafter in ("none", None))
        assert spec.tokens == plain.tokens
        assert np.array_equal(spec.logits, plain.logits)
        accepted += sum(spec.stats.accepted)
        cuts += spec.stats.exact_cuts
    assert accepted > 0 and cuts > 0  # the lookup branch is accepted off the main path: cut, then carried


def _traced(runner, ids, max_tokens: int, drafter: str | None):
    """A greedy generation that keeps the logits each token was chosen from."""
    from speccompile.runtime.sampling import SamplingParams

    config = runner.config(max_tokens, SamplingParams(), drafter=drafter)
    config.trace_logits = True
    return runner.generator(SamplingParams(), plain=drafter == "none").generate(ids, config)
