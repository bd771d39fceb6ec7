"""The DFlash block drafter: both published layouts, the exported block graph against torch, greedy speculative ==
plain with one drafter pass per block, sampled drafts distribution-exact (chi-square, as tests/test_sampling.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from test_heads_helpers import VOCAB, shared_target, training_text, word_prompt_ids
from speccompile.runtime.drafters.base import GenerationStart, Observation

BLOCK = 5
TAPS = [1, 4, 6]  # inputs of these layers of the 8-layer tiny target


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    import torch

    torch.set_num_threads(1)
    from speccompile.models.load import load_model

    folder = shared_target(tmp_path_factory)
    return folder, load_model(str(folder))


def _random_drafter(model, seed=0, **kw):
    from speccompile.models.dflash_io import new_dflash

    kw = {"block_size": BLOCK, "tap_layers": TAPS, "num_layers": 2, **kw}
    drafter = new_dflash(model.config, model.weights, seed=seed, **kw)
    import torch

    with torch.no_grad():  # a random body that is not near-identity: the norms' weights vary too
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight") and not name.startswith("norm"):
                p.uniform_(0.5, 1.5)
    return drafter


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_both_layouts_load_the_same_drafter(target, tmp_path, seed):
    import torch

    from speccompile.models.dflash_io import load_dflash, save_dflash

    folder, model = target
    drafter = _random_drafter(model, seed)
    zlab = save_dflash(drafter, tmp_path / "zlab", model.config.num_hidden_layers)
    spec = save_dflash(drafter, tmp_path / "spec", model.config.num_hidden_layers, layout="speculators")
    raw = json.loads((zlab / "config.json").read_text())
    assert raw["dflash_config"]["target_layer_ids"] == [t - 1 for t in TAPS]  # z-lab counts layer outputs
    assert json.loads((spec / "config.json").read_text())["aux_hidden_state_layer_ids"] == TAPS  # speculators: inputs
    a, b = load_dflash(zlab, model.config, model.weights), load_dflash(spec, model.config, model.weights)
    assert a.head_config.tap_layers == b.head_config.tap_layers == TAPS
    assert (a.head_config.layout, b.head_config.layout) == ("z-lab", "speculators")
    args = _example(drafter, ctx=6, past=0)
    ref = drafter(*args)[0]
    assert torch.equal(a(*args)[0], ref) and torch.equal(b(*args)[0], ref)


def test_a_layout_not_understood_names_the_key(target, tmp_path):
    from speccompile.errors import InputError, UnsupportedError
    from speccompile.models.dflash_io import load_dflash, save_dflash

    folder, model = target
    out = save_dflash(_random_drafter(model), tmp_path / "d", model.config.num_hidden_layers)
    raw = json.loads((out / "config.json").read_text())
    for change, error, words in (({"dflash_config": {"target_layer_ids": [0, 3, 5]}}, InputError, "mask_token_id"),
                                 ({"block_size": None}, InputError, "block_size"),
                                 ({"dflash_config": {**raw["dflash_config"], "target_layer_ids": [0, 3]}}, InputError, "fc.weight"),
                                 ({"layer_types": ["sliding_attention"] * 2}, UnsupportedError, "sliding"),
                                 ({"speculators_model_type": "eagle3"}, InputError, "speculators_model_type")):
        (out / "config.json").write_text(json.dumps({**raw, **change}))
        with pytest.raises(error, match=words):
            load_dflash(out, model.config, model.weights)


def test_dspark_without_a_markov_head_drafts_every_slot(target, tmp_path):
    from speccompile.errors import InputError, UnsupportedError
    from speccompile.models.dflash_io import load_dflash, save_dflash

    _, model = target
    out = save_dflash(_random_drafter(model), tmp_path / "d", model.config.num_hidden_layers, layout="speculators")
    raw = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**raw, "speculators_model_type": "dspark", "markov_rank": 0,
                                                 "sample_from_anchor": True}))
    drafter = load_dflash(out, model.config, model.weights)
    assert drafter.head_config.sample_from_anchor and drafter.head_config.drafts_per_block == BLOCK
    assert drafter(*_example(drafter, ctx=3, past=0))[0].shape[1] == BLOCK
    assert drafter.markov is None
    (out / "config.json").write_text(json.dumps({**raw, "speculators_model_type": "dspark", "markov_rank": 256,
                                                 "markov_head_type": "gated"}))
    with pytest.raises(UnsupportedError, match="markov_head_type gated"):
        load_dflash(out, model.config, model.weights)
    (out / "config.json").write_text(json.dumps({**raw, "speculators_model_type": "dspark", "markov_rank": 256}))
    with pytest.raises(InputError, match="no markov_head.markov_w1.weight"):
        load_dflash(out, model.config, model.weights)


def _dspark_with_markov(model, folder, rank: int = 8, seed: int = 4, block_size: int = BLOCK):
    """A DSpark checkpoint (speculators layout) with a vanilla Markov head of `rank`; (folder, W1, W2)."""
    import torch
    from safetensors.torch import load_file, save_file

    from speccompile.models.dflash_io import save_dflash

    out = save_dflash(_random_drafter(model, seed, block_size=block_size), folder, model.config.num_hidden_layers,
                      layout="speculators")
    g = torch.Generator().manual_seed(seed)
    w1, w2 = torch.randn(VOCAB, rank, generator=g), torch.randn(VOCAB, rank, generator=g)
    tensors = load_file(str(out / "model.safetensors"))
    tensors.update({"markov_head.markov_w1.weight": w1, "markov_head.markov_w2.weight": w2,
                    "confidence_head.proj.weight": torch.randn(1, 64 + rank, generator=g)})
    save_file(tensors, str(out / "model.safetensors"))
    raw = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**raw, "speculators_model_type": "dspark", "markov_rank": rank,
                                                 "markov_head_type": "vanilla", "sample_from_anchor": True}))
    return out, w1.numpy(), w2.numpy()


def test_dspark_markov_head_drafts_token_by_token(target, tmp_path):
    """The vanilla Markov head: each drafted position's logits get W2 W1[previous token]; the exported artifact
    proposes the chain computed by hand from the torch block pass, and greedy speculative == plain."""
    import torch

    from speccompile.export.pipeline import ExportOptions, export_artifact
    from speccompile.models.dflash_io import load_dflash
    from speccompile.runtime.adaptive import Sizing
    from speccompile.runtime.session import Runner

    folder, model = target
    ckpt, w1, w2 = _dspark_with_markov(model, tmp_path / "dspark")
    drafter = load_dflash(ckpt, model.config, model.weights)
    np.testing.assert_array_equal(drafter.markov[0].numpy(), w1)
    manifest = export_artifact(str(folder), tmp_path / "art", ExportOptions(drafter=f"dflash:{ckpt}", max_context=256))
    assert manifest.drafter["markov"] == {"w1": "dflash_markov_w1.npy", "w2": "dflash_markov_w2.npy"}
    runner = Runner(tmp_path / "art", drafter="dflash", adaptive=False, threads=1, contract_graph=True)
    chain = runner.drafter()
    ids, pos, mask, aux = _example(drafter, ctx=6, past=0)
    tokens = [7, 8, 9, 10, 11, 12, 5]  # six context rows, pending token 5 (the example's block starts with it)
    chain.start(GenerationStart())
    chain.observe(Observation(tokens[:-1], aux[0].numpy(), 5))
    got = chain.propose(tokens, Sizing(room=BLOCK))
    with torch.no_grad():
        base = drafter(ids, pos, mask, aux, *drafter.empty_past())[0][0].numpy()
    want, previous = [], 5
    for row in base:
        previous = int(np.argmax(row + w2 @ w1[previous]))
        want.append(previous)
    assert got.tokens == want and want != [int(t) for t in base.argmax(-1)]  # the bias changed the chain
    steps, _ = _greedy_equal_plain(Runner(tmp_path / "art", drafter="dflash", adaptive=False, threads=1), range(3), 24)
    assert steps > 0


def _example(drafter, ctx: int, past: int, batch: int = 1):
    import torch

    cfg = drafter.head_config
    g = torch.Generator().manual_seed(ctx + 7 * past)
    ids = torch.full((batch, cfg.block_size), cfg.mask_token_id)
    ids[:, 0] = 5
    pos = torch.arange(past + ctx, past + ctx + cfg.block_size).expand(batch, -1)
    mask = torch.ones(batch, cfg.block_size, past + ctx + cfg.block_size, dtype=torch.bool)
    aux = torch.randn(batch, ctx, len(cfg.tap_layers) * cfg.target_hidden_size, generator=g)
    return ids, pos, mask, aux


def test_exported_block_graph_matches_torch_with_a_context_cache(target, tmp_path):
    """The ONNX pass equals torch; caching the context in two passes equals one pass over all of it; c = 0 works."""
    import onnxruntime as ort
    import torch

    from speccompile.export.dflash import export_dflash_graph

    _, model = target
    drafter = _random_drafter(model, 3)
    spec = export_dflash_graph(drafter, tmp_path / "dflash.onnx")
    assert [t.name for t in spec.inputs][:4] == ["input_ids", "position_ids", "attention_mask", "aux_hidden_states"]
    session = ort.InferenceSession(str(tmp_path / "dflash.onnx"), providers=["CPUExecutionProvider"])
    ids, pos, mask, aux = _example(drafter, ctx=7, past=0)
    with torch.no_grad():
        whole = drafter(ids, pos, mask, aux, *drafter.empty_past())
        first = drafter(ids, pos - 3, mask[..., 3:], aux[:, :4], *drafter.empty_past())  # 4 rows cached ...
        second = drafter(ids, pos, mask, aux[:, 4:], *first[1:])  # ... then the other 3 with the block
        none_new = drafter(ids, pos, mask, aux[:, :0], *whole[1:])  # no new context row
    torch.testing.assert_close(second[0], whole[0], rtol=0, atol=1e-5)
    for a, b in zip(second[1:], whole[1:]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert whole[0].shape == (1, BLOCK - 1, model.config.vocab_size)
    for (i, p, m, x), past, want in (((ids, pos, mask, aux[:, 4:]), first[1:], second),
                                     ((ids, pos, mask, aux[:, :0]), whole[1:], none_new)):
        feed = {"input_ids": i.numpy(), "position_ids": p.numpy(), "attention_mask": m.numpy(), "aux_hidden_states": x.numpy()}
        feed.update({name: t.numpy() for name, t in zip(drafter.input_names[4:], past)})
        got = session.run(None, feed)
        np.testing.assert_allclose(got[0], want[0].numpy(), rtol=0, atol=1e-4)
        for a, b in zip(got[1:], want[1:]):
            np.testing.assert_allclose(a, b.numpy(), rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def trained_artifact(target, tmp_path_factory):
    from speccompile.export.pipeline import ExportOptions, export_artifact
    from speccompile.training.trainer import TrainOptions, train_draft

    folder, _ = target
    root = tmp_path_factory.mktemp("dflash_trained")
    data = training_text(root, folder)
    train_draft(str(folder), [data], root / "head", TrainOptions(method="dflash", steps=40, seq_len=64, batch=8, lr=3e-3,
                                                                  save_every=40, threads=1, block_size=BLOCK))
    assert json.loads((root / "head" / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    manifest = export_artifact(str(folder), root / "art", ExportOptions(drafter=f"dflash:{root / 'head'}", max_context=256))
    return root / "art", manifest


def _greedy_equal_plain(runner, seeds, max_tokens: int) -> tuple[int, int]:
    """(drafted blocks, accepted tokens) of greedy speculative generations, each checked equal to plain and to
    have run one drafter pass per drafted block."""
    drafter = runner.drafter()
    steps = accepted = 0
    for seed in seeds:
        prompt = word_prompt_ids(seed)
        plain = runner.generate_ids(prompt, max_tokens, drafter="none")
        before = drafter.passes
        spec = runner.generate_ids(prompt, max_tokens)
        assert spec.tokens == plain.tokens, seed
        assert drafter.passes - before == spec.stats.draft_steps  # one drafter pass per drafted block
        steps += spec.stats.draft_steps
        accepted += sum(spec.stats.accepted)
    return steps, accepted


def test_greedy_speculative_equals_plain_one_pass_per_block(trained_artifact):
    from speccompile.runtime.session import Runner

    art, manifest = trained_artifact
    assert manifest.drafter["kind"] == "dflash" and manifest.drafter["num_draft_tokens"] == BLOCK - 1
    assert manifest.graphs["target"].extra["aux_layers"] == [2, 4, 5]  # the trained drafter's taps (2, L//2, L-3)
    assert "dflash.ort.onnx" in manifest.files  # the int8 CPU variant
    steps, accepted = _greedy_equal_plain(Runner(art, drafter="dflash", adaptive=False, threads=1), range(4), 32)
    assert steps > 0 and 2 * accepted > steps  # a trained drafter (a random one has none accepted)


def test_static_tree_of_ranked_positions_greedy_equals_plain(trained_artifact):
    from speccompile.runtime.session import Runner

    runner = Runner(trained_artifact[0], drafter="dflash", adaptive=False, threads=1, tree="tree-2x3")
    assert runner.drafter().static_trees is not None
    steps, _ = _greedy_equal_plain(runner, range(3), 24)
    assert steps > 0


def test_sampled_generation_is_seeded(trained_artifact):
    from speccompile.runtime.sampling import SamplingParams
    from speccompile.runtime.session import Runner

    runner = Runner(trained_artifact[0], drafter="dflash", adaptive=False, threads=1)
    params = SamplingParams(temperature=0.8, seed=11)
    first = runner.generate_ids(word_prompt_ids(1), 24, sampling=params)
    again = runner.generate_ids(word_prompt_ids(1), 24, sampling=params)
    assert first.tokens == again.tokens and first.stats.draft_steps > 0
    runner.generate_ids(word_prompt_ids(2), 24, sampling=SamplingParams(temperature=0.9, seed=3))  # other requests
    runner.generate_ids(word_prompt_ids(2), 24, sampling=SamplingParams(temperature=0.9))
    assert runner.generate_ids(word_prompt_ids(1), 24, sampling=params).tokens == first.tokens
    fresh = Runner(trained_artifact[0], drafter="dflash", adaptive=False, threads=1)
    assert fresh.generate_ids(word_prompt_ids(1), 24, sampling=params).tokens == first.tokens


# ------------------------------------------------------------------------------------------------
# Sampled exactness: the real drafter's proposals (q_j per position, independent of the drafted x_<j)
# verified by the runtime's chain rule give the target's distribution.


class _BlockTables:
    """A fake block graph: position j's logits depend on the pending token only (as a DFlash pass's do)."""

    def __init__(self, logits: np.ndarray, width: int = 3):
        from speccompile.manifest import TensorSpec

        self.logits = logits  # [drafts, V, V]: position j, pending token -> logits
        self.spec = type("Spec", (), {"inputs": [TensorSpec("aux_hidden_states", "float32", ["batch", "context", width])]})()

    def new_cache(self):
        from speccompile.runtime.kvcache import KVCache

        return KVCache([])

    def run(self, ids, positions, mask, cache, **features):
        from speccompile.runtime.backends.base import StepOutput

        assert mask.shape == (1, len(ids), cache.physical_len + len(features["aux_hidden_states"]) + len(ids))
        return StepOutput(logits=self.logits[:, int(ids[0])], presents=[])


@pytest.mark.parametrize("k,markov", [(2, False), (3, False), (3, True)])
def test_block_drafts_sampled_are_exact(k, markov):
    from test_sampling import ROOT, T, V, assert_exact, encode, model_logits

    from speccompile.runtime.adaptive import Sizing
    from speccompile.runtime.drafters.dflash import DFlashBlockDrafter
    from speccompile.runtime.sampling import SamplingParams, process_logits
    from speccompile.runtime.verification import verify_chain

    target, draft = model_logits(seed=5)
    params = SamplingParams(temperature=0.9)
    p = process_logits(target, params)
    rng = np.random.default_rng(2024 + k)
    blocks = np.stack([draft + rng.normal(size=draft.shape) * j for j in range(k)])  # one table per drafted position
    head = {"block_size": k + 1, "mask_token_id": 0, "target_vocab_size": V}
    bias = (rng.normal(size=(V, 2)), rng.normal(size=(V, 2))) if markov else None  # DSpark: q_j depends on x_{j-1}
    drafter = DFlashBlockDrafter(_BlockTables(blocks), head, k, markov=bias)
    start = GenerationStart(sampling=params, rng=np.random.default_rng(7))  # one generator, kept across samples
    n = 40_000
    codes = np.empty(n, dtype=np.int64)
    for s in range(n):
        drafter.start(start)
        tokens = [1, ROOT]
        drafter.observe(Observation(tokens[:1], np.zeros((1, 3), np.float32), ROOT))
        while len(tokens) - 2 < T:
            d = drafter.propose(tokens, Sizing(room=k))
            assert len(d.tokens) == k and d.probs.shape == (k, V)
            rows = p[[tokens[-1], *d.tokens]]
            res = verify_chain(d.tokens, rows, rng, d.probs)
            drafter.observe(Observation(res.tokens, np.zeros((len(res.tokens), 3), np.float32)))
            tokens += res.tokens
        codes[s] = encode(tokens[2:])
    assert_exact(np.bincount(codes, minlength=V ** T), p)


# ------------------------------------------------------------------------------------------------
# The oracle: the speculators library's own DFlash model, in its own environment (SPECCOMPILE_SPECULATORS_PYTHON = its python)

ORACLE = os.environ.get("SPECCOMPILE_SPECULATORS_PYTHON")


@pytest.mark.skipif(not ORACLE, reason="set SPECCOMPILE_SPECULATORS_PYTHON to a python with speculators 0.9.0 installed to compare "
                    "with the library's DFlash model (tests/speculators_dflash_oracle.py)")
@pytest.mark.parametrize("seed,draft_vocab", [(0, 96), (1, 48), (2, 96)])
def test_proposals_match_the_speculators_library(target, tmp_path, seed, draft_vocab):
    import subprocess
    import sys

    import onnxruntime as ort

    from speccompile.export.dflash import export_dflash_graph
    from speccompile.models.dflash_io import load_dflash
    from speccompile.models.heads import target_embed, target_lm_head

    _, model = target
    rng = np.random.default_rng(seed)
    ids = np.full((1, BLOCK), 95, np.int64)
    ids[0, 0] = 7 + seed
    aux = rng.normal(size=(1, 6, 3 * model.config.hidden_size)).astype(np.float32)
    np.savez(tmp_path / "inputs.npz", ids=ids, aux=aux, embed=target_embed(model.weights).numpy(),
             lm_head=target_lm_head(model.config, model.weights).numpy())
    script = Path(__file__).with_name("speculators_dflash_oracle.py")
    done = subprocess.run([ORACLE, str(script), str(tmp_path), str(seed), str(draft_vocab)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    drafter = load_dflash(tmp_path / "head", model.config, model.weights)
    assert drafter.head_config.layout == "speculators" and drafter.head_config.draft_vocab_size == draft_vocab
    export_dflash_graph(drafter, tmp_path / "dflash.onnx")
    session = ort.InferenceSession(str(tmp_path / "dflash.onnx"), providers=["CPUExecutionProvider"])
    feed = {"input_ids": ids, "position_ids": np.arange(6, 6 + BLOCK)[None], "attention_mask": np.ones((1, BLOCK, 6 + BLOCK), bool),
            "aux_hidden_states": aux}
    feed.update({name: np.zeros((1, 2, 0, 16), np.float32) for name in drafter.input_names[4:]})
    ours = session.run(["logits"], feed)[0]
    oracle = np.load(tmp_path / "oracle.npy")

    def probs(x):
        e = np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    assert (ours.argmax(-1) == oracle.argmax(-1)).all()  # the same draft tokens
    np.testing.assert_allclose(probs(ours), probs(oracle), rtol=0, atol=1e-4)
    d2t = drafter.draft_to_target().numpy()
    assert d2t[ours.argmax(-1)].max() < model.config.vocab_size


def test_train_draft_refuses_a_bad_block_size(tmp_path, capsys):
    from conftest import run_cli_here

    data = tmp_path / "data.txt"
    data.write_text("some text to train on " * 20)
    code, out, err = run_cli_here(capsys, "train-draft", "smollm2-135m", "--method", "dflash", "--block-size", "1",
                                  "--data", str(data), "--out", str(tmp_path / "out"))
    assert code == 2 and "--block-size must be between 2 and half the sequence length (128), got 1" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------
# Sampled exactness end to end: an exported random drafter through the real Runner on ort-cpu


@pytest.fixture(scope="module")
def random_artifacts(target, tmp_path_factory):
    """Exported random drafters, blocks of 4: DFlash, and DSpark with a vanilla Markov head (blocks of 3 drafts each)."""
    from speccompile.export.pipeline import ExportOptions, export_artifact
    from speccompile.models.dflash_io import save_dflash

    folder, model = target
    root = tmp_path_factory.mktemp("dflash_random")
    dflash = save_dflash(_random_drafter(model, seed=3, block_size=4), root / "head", model.config.num_hidden_layers)
    dspark, _, _ = _dspark_with_markov(model, root / "dspark", block_size=3)
    return {name: (root / f"{name}_art", export_artifact(str(folder), root / f"{name}_art",
                                                        ExportOptions(drafter=f"dflash:{ckpt}", max_context=256)))
            for name, ckpt in (("dflash", dflash), ("dspark", dspark))}


@pytest.mark.parametrize("kind,wrong_q", [("dflash", False), ("dflash", True), ("dspark", False)])
def test_sampled_output_through_the_runner_is_exact(target, random_artifacts, kind, wrong_q):
    """Sampled drafts (x_j ~ q_j, temperature 1, top-k 8; DSpark's q_j given the drafts before it) verified by the
    runtime give the target's distribution of the first 2 tokens (the second one drafted; a torch forward over
    every prefix), chi-square over 600 seeded generations of blocks of 3 drafts; the control reports a uniform q
    for the same draws, so the verifier accepts nearly every draft (p ~ 1e-17 at this size), and the test must
    fail it."""
    from collections import Counter

    from runner_sampling_helpers import exact_prefix_distribution, p_value, sampled_prefix_counts

    from speccompile.runtime.sampling import SamplingParams
    from speccompile.runtime.session import Runner

    art, manifest = random_artifacts[kind]
    runner = Runner(art, drafter="dflash", adaptive=False, threads=1)
    drafter = runner.drafter()
    assert (drafter.markov is not None) == (kind == "dspark")
    propose, proposed = drafter.propose, Counter()

    def counted(tokens, sizing):
        draft = propose(tokens, sizing)
        proposed.update([len(draft.tokens)])
        assert draft.probs is not None and draft.probs.shape == (len(draft.tokens), VOCAB)  # sampled, with its q
        if wrong_q:
            draft.probs = np.full_like(draft.probs, 1.0 / VOCAB)
        return draft

    drafter.propose = counted
    prompt = word_prompt_ids(5)
    exact = exact_prefix_distribution(target[0], prompt, 2, 1.0, 8, manifest.tokenizer.get("eos_token_ids") or [2])
    counts = sampled_prefix_counts(runner, prompt, 2, SamplingParams(temperature=1.0, top_k=8), 600, max_tokens=5)
    assert proposed[3] > 0, proposed  # blocks of 3 drafts (block size 4)
    assert (p_value(counts, exact) > 1e-3) != wrong_q, (counts.most_common(6), sorted(exact.values())[-6:])
