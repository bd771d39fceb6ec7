"""Chained MTP modules (DeepSeek-V3's sequential MTP): with N modules, depth d of a chain is drafted by module d mod N
over its own cache of committed rows. The drafter's proposals equal a full recompute of the chain in torch, round
after round; exported artifacts with 2-3 modules in every naming draft with every module and keep greedy ==
plain; sampled output is distributed as the target (chi-square)."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np

from speccompile.runtime.drafters.base import GenerationStart, Observation
import pytest
import torch

from test_heads_helpers import H, VOCAB
from test_mtp_layouts import make_target_with_mtp, mtp_tensors


class _TorchSession:
    """A Session over a torch MTP module (the runtime's Session protocol), to check the drafter's bookkeeping."""

    def __init__(self, head):
        from speccompile.manifest import TensorSpec

        self.head = head
        self.spec = type("Spec", (), {"inputs": [TensorSpec("hidden_states", "float32", ["batch", "q_len", H])]})()
        self.calls = 0

    def new_cache(self):
        from speccompile.runtime.kvcache import KVCache

        return KVCache([t.numpy() for t in self.head.empty_past()])

    def run(self, ids, positions, mask, cache, hidden_states):
        from speccompile.runtime.backends.base import StepOutput

        self.calls += 1
        with torch.no_grad():
            logits, k, v, hidden = self.head(torch.as_tensor(ids)[None], torch.as_tensor(positions)[None],
                                             torch.as_tensor(mask), torch.as_tensor(hidden_states)[None],
                                             *map(torch.as_tensor, cache.tensors))
        return StepOutput(logits=logits[0].numpy(), presents=[k.numpy(), v.numpy()], hidden=hidden[0].numpy())


def _reference_chain(modules, tokens: list[int], features: np.ndarray, k: int) -> list[int]:
    """The chain recomputed from scratch: depth d runs module d mod N causally over rows 0..n-1, row s pairing
    depth d-1's output at s (depth 0: the target's feature) with token s+d+1 (drafts past the pending token)."""
    n = len(tokens) - 1
    ext, hidden = list(tokens), torch.as_tensor(features[:n])[None]
    mask = torch.ones(n, n, dtype=torch.bool).tril()[None]
    for d in range(k):
        head = modules[d % len(modules)]
        with torch.no_grad():
            logits, _, _, hidden = head(torch.tensor(ext[d + 1: d + 1 + n])[None], torch.arange(n)[None], mask, hidden,
                                        *head.empty_past())
        ext.append(int(torch.argmax(logits[0, -1])))
    return ext[n + 1:]


@pytest.mark.parametrize("ks,keep", [((2,), 256), ((5,), 256), ((1, 4, 2, 1, 1, 5), 256), ((1, 4, 2, 1, 1, 5), 1)])
def test_chain_drafts_equal_the_sequential_mtp_recomputed(tmp_path, monkeypatch, ks, keep):
    """Rounds with random verdicts: every proposal equals the chain recomputed in torch (k = 5 > 3 modules reuses
    modules 0 and 1 at depths 3 and 4), with one module call per depth; a k that changes from round to round
    leaves deeper depths behind, which catch up when drafted again (or, kept outputs capped at one row, skip the
    rows no longer held: drafts then differ from the full recompute, memory stays bounded)."""
    from speccompile.runtime.drafters import mtp_chain

    monkeypatch.setattr(mtp_chain, "KEEP_UNREAD", keep)
    from speccompile.draft_config import DraftConfig
    from speccompile.models.head_loaders import load_head
    from speccompile.models.load import load_model
    from speccompile.runtime.adaptive import Sizing
    from speccompile.runtime.drafters.mtp_chain import MTPChainDrafter

    torch.set_num_threads(1)
    folder = make_target_with_mtp(tmp_path / "target", "llama", "deepseek", modules=3)
    model = load_model(str(folder))
    head = load_head("mtp", None, model.config, model.weights, folder)
    modules = [head, *head.chain]
    assert len(modules) == 3 and head.head_config.mtp_modules == 3
    sessions = [_TorchSession(m) for m in modules]
    drafter = MTPChainDrafter(sessions[0], sessions[1:], DraftConfig.parse("mtp", "chain", max(ks)), 16)
    rng = np.random.default_rng(len(ks) + ks[0])
    for prompt_len in (1, 6):
        drafter.start(GenerationStart())
        tokens = [int(t) for t in rng.integers(0, VOCAB, prompt_len + 1)]
        features = rng.normal(size=(prompt_len, H)).astype(np.float32)
        drafter.observe(Observation(tokens[:-1], features, tokens[-1]))
        for r in range(6):
            k = ks[r % len(ks)]
            calls = [s.calls for s in sessions]
            draft = drafter.propose(tokens, Sizing(room=k))
            assert len(draft.tokens) == k
            assert draft.tokens == _reference_chain(modules, tokens, features, k) or keep == 1
            assert all(len(d.outs) <= max(keep, 1) + 6 for d in [drafter.outs0, *drafter.depths])
            assert sum(s.calls for s in sessions) - sum(calls) == k  # one call per depth
            assert [s.calls - c > 0 for s, c in zip(sessions, calls)] == [True, k >= 2, k >= 3]
            accepted = draft.tokens[: int(rng.integers(0, k + 1))]
            new = accepted + [int(rng.integers(0, VOCAB))]
            rows = rng.normal(size=(len(new), H)).astype(np.float32)  # the committed rows' target features
            drafter.observe(Observation([tokens[-1], *accepted], rows, new[-1]))
            features = np.concatenate([features, rows])
            tokens += new


def _speculators_checkpoint(folder, modules: int):
    """Speculators' MTP naming (`mtp_layers.{i}.*`, `speculators_model_type: mtp`) with several modules."""
    from safetensors.torch import save_file

    from test_heads_helpers import layer_config

    folder.mkdir(parents=True)
    tensors = {k.removeprefix("model."): v.contiguous() for k, v in mtp_tensors("mimo", 4, True, modules, seed=9).items()}
    save_file(tensors, str(folder / "model.safetensors"))
    config = {"speculators_model_type": "mtp", "transformer_layer_config": {**layer_config(), "model_type": "qwen3"}}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _prompt(seed: int) -> list[int]:
    """A prompt of random ids with a repeat (so that drafts get accepted now and then)."""
    ids = [int(t) for t in np.random.default_rng(seed).integers(3, VOCAB, 5)]
    return [1, *ids, *ids]


CASES = [("llama", "deepseek", 3), ("qwen3", "qwen3_next", 2), ("qwen3", "mimo", 3), ("qwen3", "speculators", 2)]


def _export(tmp_path, arch, style, modules):
    from speccompile.export.pipeline import ExportOptions, export_artifact

    folder = make_target_with_mtp(tmp_path / "target", arch, "mimo" if style == "speculators" else style,
                                  1 if style == "speculators" else modules)
    drafter = f"mtp:{_speculators_checkpoint(tmp_path / 'spec', modules)}" if style == "speculators" else "mtp"
    manifest = export_artifact(str(folder), tmp_path / "art", ExportOptions(drafter=drafter, tree="chain-4", max_context=256))
    return folder, manifest


@pytest.mark.parametrize("arch,style,modules", CASES)
def test_exported_chain_greedy_equals_plain(arch, style, modules, tmp_path):
    from speccompile.runtime.drafters.mtp_chain import MTPChainDrafter
    from speccompile.runtime.session import Runner

    torch.set_num_threads(1)
    folder, manifest = _export(tmp_path, arch, style, modules)
    names = ["mtp"] + [f"mtp{i}" for i in range(1, modules)]
    assert manifest.drafter["module_graphs"] == names and manifest.drafter["head"]["mtp_modules"] == modules
    assert all(n in manifest.graphs and f"{n}-ort" in manifest.graphs for n in names)
    runner = Runner(tmp_path / "art", drafter="mtp", num_draft_tokens=4, adaptive=False, threads=1)
    drafter = runner.drafter().inner  # under the n-gram lookup branch
    assert isinstance(drafter, MTPChainDrafter) and len(drafter.modules) == modules - 1
    adaptive = Runner(tmp_path / "art", drafter="mtp", num_draft_tokens=4, adaptive=True, threads=1, lookup_branch=False)
    steps = 0
    for seed in range(3):
        prompt = _prompt(seed)
        plain = runner.generate_ids(prompt, 24, drafter="none")
        spec = runner.generate_ids(prompt, 24)
        assert spec.tokens == plain.tokens == adaptive.generate_ids(prompt, 24).tokens, seed
        steps += spec.stats.draft_steps
    assert steps > 0 and all(d.cache.physical_len > 0 for d in drafter.depths)  # every depth drafted
    # the fp32 module graphs, each in its place in the chain: proposals equal the torch chain (k = 4: module 0 again)
    from speccompile.draft_config import DraftConfig
    from speccompile.models.head_loaders import load_head
    from speccompile.models.load import load_model
    from speccompile.runtime.adaptive import Sizing

    model = load_model(str(folder))
    head = load_head("mtp", tmp_path / "spec" if style == "speculators" else None, model.config, model.weights, folder)
    graphs = Runner(tmp_path / "art", drafter="mtp", adaptive=False, threads=1, lookup_branch=False, contract_graph=True)
    chain = graphs.drafter()
    chain.set_tree(DraftConfig.parse("mtp", "chain", 4))
    rng = np.random.default_rng(1)
    tokens = _prompt(7)
    features = rng.normal(size=(len(tokens) - 1, H)).astype(np.float32)
    chain.start(GenerationStart())
    chain.observe(Observation(tokens[:-1], features, tokens[-1]))
    assert chain.propose(tokens, Sizing(room=4)).tokens == _reference_chain([head, *head.chain], tokens, features, 4)


def test_sampled_chain_through_the_runner_is_exact(tmp_path, monkeypatch):
    """Sampling (temperature 0.7, top-k 3): the first 3 tokens of 1000 seeded generations drafted by a chain of 3
    modules (deterministic drafts: one-hot q) are distributed as the target's own (its torch forward over every
    prefix)."""
    from runner_sampling_helpers import exact_prefix_distribution, p_value, sampled_prefix_counts

    from speccompile.runtime.drafters.mtp_chain import MTPChainDrafter
    from speccompile.runtime.sampling import SamplingParams
    from speccompile.runtime.session import Runner

    depths: Counter = Counter()
    run_depth = MTPChainDrafter._run_depth
    monkeypatch.setattr(MTPChainDrafter, "_run_depth", lambda self, *a: depths.update([a[-1]]) or run_depth(self, *a))
    torch.set_num_threads(1)
    folder, manifest = _export(tmp_path, "llama", "deepseek", 3)
    runner = Runner(tmp_path / "art", drafter="mtp", num_draft_tokens=3, adaptive=False, threads=1, lookup_branch=False)
    prompt = _prompt(4)
    params = SamplingParams(temperature=0.7, top_k=3)
    exact = exact_prefix_distribution(folder, prompt, 3, 0.7, 3, manifest.tokenizer.get("eos_token_ids") or [2])
    counts = sampled_prefix_counts(runner, prompt, 3, params, 1000, max_tokens=5)
    assert depths[1] > 0 and depths[2] > 0, depths  # modules 1 and 2 drafted
    assert p_value(counts, exact) > 1e-3, (counts.most_common(8), sorted(exact.items(), key=lambda kv: -kv[1])[:8])
