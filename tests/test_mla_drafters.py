"""Drafters on a multi-head latent attention target (tiny DeepSeek-V3 of tests/test_families.py, 8 layers so the
EAGLE-3 taps (2, 4, 5) are distinct): EAGLE-3 / EAGLE / Medusa heads (Llama layers reading the target's hidden
states) and DeepSeek-V3's own MTP module (the target's decoder layer: latent attention + MoE) keep greedy
speculative == plain; the MTP graph's logits equal DeepSeek's MTP formula recomputed with transformers' layer."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from speccompile.export.pipeline import ExportOptions, export_artifact
from speccompile.runtime.artifact import open_artifact
from speccompile.runtime.kvcache import causal_mask
from speccompile.runtime.session import Runner

from test_families import make_family_model
from test_heads_helpers import write_checkpoint

LAYERS = 8
PROMPTS = [[1, 40, 41, 42, 43, 10, 11, 12, 13, 40, 41, 42], [1, 7, 30, 52, 7, 30, 61, 9, 7, 30]]


def _add_mtp_module(folder, seed: int = 5):
    """A DeepSeek-V3 checkpoint of LAYERS + 1 layers saved by transformers, relabelled as LAYERS layers + one MTP
    module (`num_nextn_predict_layers: 1`): layer LAYERS keeps its decoder block (MLA + MoE) and gains enorm, hnorm,
    eh_proj, shared_head.norm and copies of the embeddings / lm_head (as DeepSeek-V3 ships them). Returns the
    transformers model (its layer LAYERS: the MTP block) and the MTP-only tensors."""
    import torch
    from safetensors.torch import load_file, save_file

    hf = make_family_model(folder, "deepseek_v3", seed=seed, num_hidden_layers=LAYERS + 1)
    g = torch.Generator().manual_seed(seed)
    h, p = hf.config.hidden_size, f"model.layers.{LAYERS}."
    extra = {p + "enorm.weight": 1 + 0.2 * torch.randn(h, generator=g), p + "hnorm.weight": 1 + 0.2 * torch.randn(h, generator=g),
             p + "eh_proj.weight": torch.randn(h, 2 * h, generator=g) * 0.3,
             p + "shared_head.norm.weight": 1 + 0.2 * torch.randn(h, generator=g)}
    tensors = load_file(str(folder / "model.safetensors"))
    tensors.update(extra)
    tensors[p + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[p + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": LAYERS, "num_nextn_predict_layers": 1}))
    return hf, extra


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    import torch

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("mla_drafters")
    hf, extra = _add_mtp_module(root / "ds")
    yield root, hf, extra
    shutil.rmtree(root, ignore_errors=True)


def _greedy_equals_plain(art, kind: str) -> int:
    runner = Runner(art, drafter=kind, num_draft_tokens=4, adaptive=False, threads=1, lookup_branch=False)
    steps = 0
    for prompt in PROMPTS:
        spec = runner.generate_ids(prompt, 24)
        assert spec.tokens == runner.generate_ids(prompt, 24, drafter="none").tokens, (kind, prompt)
        steps += spec.stats.draft_steps
    return steps


@pytest.mark.parametrize("kind", ["eagle3", "eagle", "medusa"])
def test_heads_on_a_latent_attention_target_greedy_equal_plain(target, kind):
    """The head's layer is a Llama layer (not the target's latent attention, partial interleaved rope or MoE);
    EAGLE-3 reads the target's taps (2, 4, 5), the others its final hidden state."""
    root = target[0]
    ckpt = write_checkpoint(root / f"{kind}_ckpt", kind)
    manifest = export_artifact(str(root / "ds"), root / kind, ExportOptions(drafter=f"{kind}:{ckpt}", max_context=256))
    layer = manifest.drafter["head"]["layer"]  # (medusa has none: its ResBlocks read the final hidden state)
    assert kind == "medusa" or (layer["kv_lora_rank"], layer["moe"], layer["num_key_value_heads"], layer["head_dim"],
                                layer["rope_interleaved"]) == (0, None, 2, 16, False)
    assert manifest.graphs["target"].hidden_states == ("eagle3" if kind == "eagle3" else "final")
    if kind == "eagle3":
        assert manifest.drafter["target_taps"] == [2, 4, 5]
    assert _greedy_equals_plain(root / kind, kind) > 0


def mtp_formula(hf, extra: dict, ids: np.ndarray, features: np.ndarray, layer: int = LAYERS) -> np.ndarray:
    """DeepSeek's (and GLM-4.5's) MTP module in transformers' modules: row s = head(shared_head.norm(layer_L(eh_proj(
    cat(enorm(embed(ids[s])), hnorm(features[s])))))) at position s, causal over the rows; embed / head: the module's
    own `embed_tokens` / `shared_head.head` in `extra` when it has them, else the target's."""
    import torch

    p = f"model.layers.{layer}."

    def rms(x, weight):
        var = x.pow(2).mean(-1, keepdim=True)
        return weight * (x * torch.rsqrt(var + hf.config.rms_norm_eps))

    with torch.no_grad():
        table = extra.get(p + "embed_tokens.weight", hf.model.embed_tokens.weight)
        emb = table[torch.as_tensor(ids)][None]
        x = torch.cat((rms(emb, extra[p + "enorm.weight"]), rms(torch.as_tensor(features)[None], extra[p + "hnorm.weight"])), -1)
        x = x @ extra[p + "eh_proj.weight"].T
        pos = torch.arange(len(ids))[None]
        mask = torch.full((len(ids), len(ids)), float("-inf")).triu(1)[None, None]
        x = hf.model.layers[layer](x, attention_mask=mask, position_ids=pos, position_embeddings=hf.model.rotary_emb(x, pos))
        x = x[0] if isinstance(x, tuple) else x
        return (rms(x, extra[p + "shared_head.norm.weight"]) @ extra.get(p + "shared_head.head.weight", hf.lm_head.weight).T)[0].numpy()


def mtp_graph_logits(art, ids: np.ndarray, features: np.ndarray) -> np.ndarray:
    """The artifact's MTP graph on (ids, features) teacher-forced, in passes of 5 then 1-3 rows over its own cache."""
    session = open_artifact(art, threads=1, fused=False).session("mtp")
    cache, got, start = session.new_cache(), [], 0
    for q in (5, 1, 3, 1, 2):
        rows = slice(start, start + q)
        out = session.run(ids[rows], np.arange(start, start + q), cache.attention_mask(causal_mask(q)), cache,
                          hidden_states=features[rows])
        cache.append(out.presents, range(q), q)
        got.append(out.logits)
        start += q
    return np.concatenate(got)


def test_deepseek_mtp_module_on_its_target(target):
    """`--drafter mtp` on a DeepSeek-V3 checkpoint with its MTP module: the module graph's cache is the target's
    (one latent head of kv_lora_rank + rope values); its logits, in passes of 5 then 1-3 rows over its own cache,
    equal DeepSeek's MTP formula with transformers' decoder layer (within 1e-4 of a row's largest logit); greedy
    MTP == plain."""
    root, hf, extra = target
    manifest = export_artifact(str(root / "ds"), root / "mtp", ExportOptions(drafter="mtp", max_context=256))
    spec = manifest.graphs["mtp"]
    assert (spec.num_kv_heads, spec.head_dim) == (1, 48) and manifest.drafter["head"]["layer"]["kv_lora_rank"] == 32
    rng = np.random.default_rng(2)
    ids, features = rng.integers(3, 90, 12), rng.normal(size=(12, hf.config.hidden_size)).astype(np.float32)
    expected = mtp_formula(hf, extra, ids, features)
    error = np.abs(mtp_graph_logits(root / "mtp", ids, features) - expected).max(-1) / np.abs(expected).max(-1)
    assert error.max() < 1e-4, float(error.max())
    assert len(set(expected.argmax(-1))) > 3
    assert _greedy_equals_plain(root / "mtp", "mtp") > 0
