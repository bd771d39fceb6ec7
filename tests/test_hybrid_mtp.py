"""Qwen3-Next / Qwen3.5 (dense and MoE) with their own MTP module: the module's block is one more of the target's
gated full-attention layers (its MoE MLP on a MoE target), read from the checkpoint's `mtp.*` tensors; the
module graph's logits equal the MTP formula recomputed with transformers' own decoder layer, and greedy MTP
decoding of the hybrid target, which verifies chains only, equals plain (docs/DESIGN.md, "Hybrid linear
attention" and "Drafter checkpoint formats")."""

from __future__ import annotations

import numpy as np
import pytest

from speccompile.export.pipeline import ExportOptions, export_artifact
from speccompile.runtime.session import Runner

from test_families import make_family_model
from test_hybrid import HYBRID
from test_mla_drafters import PROMPTS, mtp_graph_logits


def _with_mtp(folder, name: str, seed: int = 7):
    """A tiny random `name` checkpoint whose `mtp.*` tensors are the published module's: `mtp.layers.0` a copy of
    the target's full-attention layer (so transformers' layer object computes it), `mtp.fc` and the zero-centred
    `pre_fc_norm_embedding`, `pre_fc_norm_hidden` and `norm` gains random. Returns (model, full layer, glue)."""
    import torch
    from safetensors.torch import load_file, save_file

    hf = make_family_model(folder, name, families=HYBRID)
    full = hf.config.layer_types.index("full_attention")
    tensors = load_file(str(folder / "model.safetensors"))
    prefix = f"model.layers.{full}."
    tensors.update({"mtp.layers.0." + k[len(prefix):]: v.clone() for k, v in tensors.items() if k.startswith(prefix)})
    g, h = torch.Generator().manual_seed(seed), hf.config.hidden_size
    glue = {"mtp.fc.weight": torch.randn(h, 2 * h, generator=g) * 0.3,
            **{f"mtp.{n}.weight": 0.2 * torch.randn(h, generator=g) for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}}
    tensors.update(glue)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return hf, full, glue


def qwen3_next_mtp_formula(hf, full: int, glue: dict, ids: np.ndarray, features: np.ndarray) -> np.ndarray:
    """Qwen3-Next's MTP module (as vLLM's qwen3_next_mtp runs it) in transformers' modules: row s = lm_head(norm(
    layer(fc(cat(pre_fc_norm_embedding(embed(ids[s])), pre_fc_norm_hidden(features[s])))))) at position s, causal
    over the rows, every norm zero-centred (1 + w)."""
    import torch

    def rms(x, weight):
        return (1 + weight) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + hf.config.rms_norm_eps))

    with torch.no_grad():
        emb = hf.model.embed_tokens.weight[torch.as_tensor(ids)][None]
        x = torch.cat((rms(emb, glue["mtp.pre_fc_norm_embedding.weight"]),
                       rms(torch.as_tensor(features)[None], glue["mtp.pre_fc_norm_hidden.weight"])), -1)
        x = x @ glue["mtp.fc.weight"].T
        pos = torch.arange(len(ids))[None]
        mask = torch.full((len(ids), len(ids)), float("-inf")).triu(1)[None, None]
        x = hf.model.layers[full](x, attention_mask=mask, position_ids=pos, position_embeddings=hf.model.rotary_emb(x, pos))
        x = x[0] if isinstance(x, tuple) else x
        return (rms(x, glue["mtp.norm.weight"]) @ hf.lm_head.weight.T)[0].numpy()


@pytest.mark.parametrize("name", ["qwen3_5_text", "qwen3_next", "qwen3_5_moe_text"])
def test_a_hybrid_target_s_own_mtp_module_drafts_exact_chains(tmp_path, name):
    import torch

    torch.set_num_threads(1)
    hf, full, glue = _with_mtp(tmp_path / "hf", name)
    manifest = export_artifact(str(tmp_path / "hf"), tmp_path / "art", ExportOptions(drafter="mtp", max_context=256))
    layer = manifest.drafter["head"]["layer"]
    assert layer["hybrid"] is None and layer["attn_output_gate"] and (layer["moe"] is None) == (name == "qwen3_5_text")
    assert manifest.graphs["target"].hidden_states == "final" and manifest.drafter["tree_name"] == "chain-4"
    rng = np.random.default_rng(2)
    ids, features = rng.integers(3, 90, 12), rng.normal(size=(12, hf.config.hidden_size)).astype(np.float32)
    expected = qwen3_next_mtp_formula(hf, full, glue, ids, features)
    error = np.abs(mtp_graph_logits(tmp_path / "art", ids, features) - expected).max(-1) / np.abs(expected).max(-1)
    assert error.max() < 1e-4, float(error.max())
    assert len(set(expected.argmax(-1))) > 3
    runner = Runner(tmp_path / "art", drafter="mtp", num_draft_tokens=3, adaptive=False, threads=1)
    assert not runner.options.lookup_branch  # (its n-gram branch would make a tree)
    drafted = 0
    for prompt in PROMPTS:
        spec = runner.generate_ids(prompt, 20)
        assert spec.tokens == runner.generate_ids(prompt, 20, drafter="none").tokens, prompt
        drafted += sum(spec.stats.drafted)
    assert drafted > 0


def test_a_hybrid_target_s_mtp_module_drafts_no_tree(tmp_path):
    from speccompile.errors import UnsupportedError

    _with_mtp(tmp_path / "hf", "qwen3_5_text")
    export_artifact(str(tmp_path / "hf"), tmp_path / "art", ExportOptions(drafter="mtp", max_context=96))
    with pytest.raises(UnsupportedError, match="tree: a hybrid linear-attention target verifies chains only"):
        Runner(tmp_path / "art", drafter="mtp", tree="eagle-default", threads=1)
    assert Runner(tmp_path / "art", drafter="mtp", tree="chain-8", threads=1).num_draft_tokens == 8
