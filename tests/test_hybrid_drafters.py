"""Drafters on hybrid linear-attention targets, which verify chains only (docs/DESIGN.md, "Hybrid linear attention"):
Qwen3-Next / Qwen3.5 (dense and MoE, and Qwen3.5's published multimodal form) with their own MTP module, whose
block is one more of the target's gated full-attention layers (its MoE MLP on a MoE target), read from the
checkpoint's `mtp.*` tensors: the module graph's logits equal the MTP formula recomputed with transformers' own
decoder layer; and every head (EAGLE-3 on the target's taps, EAGLE, Medusa, DFlash) drafting chains. Greedy
speculative decoding equals plain; a tree is refused in one line."""

from __future__ import annotations

import numpy as np
import pytest

from speccompile.export.pipeline import ExportOptions, export_artifact
from speccompile.runtime.session import Runner

from test_families import make_family_model
from test_hybrid import HYBRID
from test_heads_helpers import write_checkpoint
from test_mla_drafters import PROMPTS, mtp_graph_logits


def _with_mtp(folder, name: str, seed: int = 7):
    """A tiny random `name` checkpoint whose `mtp.*` tensors are the published module's: `mtp.layers.0` a copy of
    the target's full-attention layer (so transformers' layer object computes it), `mtp.fc` and the zero-centred
    `pre_fc_norm_embedding`, `pre_fc_norm_hidden` and `norm` gains random. `name` "qwen3_5": the published
    multimodal form (Qwen3_5ForConditionalGeneration, the text decoder under model.language_model). Returns
    (model, full layer, glue)."""
    import torch
    from safetensors.torch import load_file, save_file

    hf = _multimodal_qwen3_5(folder) if name == "qwen3_5" else make_family_model(folder, name, families=HYBRID)
    text = getattr(hf.config, "text_config", hf.config)
    full = text.layer_types.index("full_attention")
    tensors = load_file(str(folder / "model.safetensors"))
    prefix = f"model.language_model.layers.{full}." if name == "qwen3_5" else f"model.layers.{full}."
    tensors.update({"mtp.layers.0." + k[len(prefix):]: v.clone() for k, v in tensors.items() if k.startswith(prefix)})
    g, h = torch.Generator().manual_seed(seed), text.hidden_size
    glue = {"mtp.fc.weight": torch.randn(h, 2 * h, generator=g) * 0.3,
            **{f"mtp.{n}.weight": 0.2 * torch.randn(h, generator=g) for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}}
    tensors.update(glue)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return hf, full, glue


def _multimodal_qwen3_5(folder):
    """Qwen3.5's published form with a tiny vision tower (as tests/test_hybrid.py's multimodal test writes it)."""
    import torch
    import transformers

    from conftest import TINY_VOCAB, write_char_tokenizer

    text = dict(HYBRID["qwen3_5_text"], vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    text["rope_parameters"] = dict(text["rope_parameters"], mrope_section=[3, 3, 2], mrope_interleaved=True)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    config = transformers.AutoConfig.for_model("qwen3_5", text_config=text, vision_config=vision)
    torch.manual_seed(0)
    hf = transformers.AutoModelForImageTextToText.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(4.0) if p.dim() == 2 else p.add_(0.2 * torch.randn_like(p))
    hf.save_pretrained(folder, safe_serialization=True)
    write_char_tokenizer(folder)
    return hf


def qwen3_next_mtp_formula(hf, full: int, glue: dict, ids: np.ndarray, features: np.ndarray) -> np.ndarray:
    """Qwen3-Next's MTP module (as vLLM's qwen3_next_mtp runs it) in transformers' modules: row s = lm_head(norm(
    layer(fc(cat(pre_fc_norm_embedding(embed(ids[s])), pre_fc_norm_hidden(features[s])))))) at position s, causal
    over the rows, every norm zero-centred (1 + w); `hf` a causal LM or Qwen3.5's multimodal wrapper."""
    import torch

    decoder = getattr(hf.model, "language_model", hf.model)
    eps = getattr(hf.config, "text_config", hf.config).rms_norm_eps

    def rms(x, weight):
        return (1 + weight) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    with torch.no_grad():
        emb = decoder.embed_tokens.weight[torch.as_tensor(ids)][None]
        x = torch.cat((rms(emb, glue["mtp.pre_fc_norm_embedding.weight"]),
                       rms(torch.as_tensor(features)[None], glue["mtp.pre_fc_norm_hidden.weight"])), -1)
        x = x @ glue["mtp.fc.weight"].T
        pos = torch.arange(len(ids))[None]
        mask = torch.full((len(ids), len(ids)), float("-inf")).triu(1)[None, None]
        x = decoder.layers[full](x, attention_mask=mask, position_ids=pos, position_embeddings=decoder.rotary_emb(x, pos))
        x = x[0] if isinstance(x, tuple) else x
        return (rms(x, glue["mtp.norm.weight"]) @ hf.lm_head.weight.T)[0].numpy()


@pytest.mark.parametrize("name", ["qwen3_5_text", "qwen3_next", "qwen3_5_moe_text", "qwen3_5"])
def test_a_hybrid_target_s_own_mtp_module_drafts_exact_chains(tmp_path, name):
    import torch

    torch.set_num_threads(1)
    hf, full, glue = _with_mtp(tmp_path / "hf", name)
    manifest = export_artifact(str(tmp_path / "hf"), tmp_path / "art", ExportOptions(drafter="mtp", max_context=256))
    layer = manifest.drafter["head"]["layer"]
    assert layer["hybrid"] is None and layer["attn_output_gate"] and (layer["moe"] is None) == ("moe" not in name and name != "qwen3_next")
    assert manifest.graphs["target"].hidden_states == "final" and manifest.drafter["tree_name"] == "chain-4"
    rng = np.random.default_rng(2)
    ids, features = rng.integers(3, 90, 12), rng.normal(size=(12, layer["hidden_size"])).astype(np.float32)
    expected = qwen3_next_mtp_formula(hf, full, glue, ids, features)
    error = np.abs(mtp_graph_logits(tmp_path / "art", ids, features) - expected).max(-1) / np.abs(expected).max(-1)
    assert error.max() < 1e-4, float(error.max())
    assert len(set(expected.argmax(-1))) > 3
    assert _greedy_equals_plain(tmp_path / "art", "mtp") > 0


def test_a_hybrid_target_drafts_no_tree(tmp_path):
    """A tree asked of a head on a hybrid target is one line, at export and at run time."""
    from speccompile.errors import InputError, UnsupportedError

    _with_mtp(tmp_path / "hf", "qwen3_5_text")
    with pytest.raises(InputError, match="tree eagle-default: a hybrid linear-attention target .* verifies chains only"):
        export_artifact(str(tmp_path / "hf"), tmp_path / "tree", ExportOptions(drafter="mtp", tree="eagle-default"))
    assert not (tmp_path / "tree").exists()
    export_artifact(str(tmp_path / "hf"), tmp_path / "art", ExportOptions(drafter="mtp", max_context=96))
    with pytest.raises(UnsupportedError, match="tree: drafter mtp: a hybrid linear-attention target verifies chains only"):
        Runner(tmp_path / "art", drafter="mtp", tree="eagle-default", threads=1)
    assert Runner(tmp_path / "art", drafter="mtp", tree="chain-8", threads=1).num_draft_tokens == 8


def _greedy_equals_plain(art, kind: str) -> int:
    """Draft tokens verified while greedy speculative output equals plain on PROMPTS."""
    runner = Runner(art, drafter=kind, num_draft_tokens=3, adaptive=False, threads=1)
    assert not runner.options.lookup_branch  # (a head's n-gram branch would make a tree)
    drafted = 0
    for prompt in PROMPTS:
        spec = runner.generate_ids(prompt, 20)
        assert spec.tokens == runner.generate_ids(prompt, 20, drafter="none").tokens, (kind, prompt)
        drafted += sum(spec.stats.drafted)
    return drafted


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny Qwen3.5 of 8 layers (full attention at 3 and 7): EAGLE-3's default taps 2, 4 and 5 are distinct."""
    import torch

    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp("hybrid_heads") / "hf"
    make_family_model(folder, "qwen3_5_text", families=HYBRID, num_hidden_layers=8)
    return folder


@pytest.mark.parametrize("kind", ["eagle3", "eagle", "medusa", "dflash"])
def test_every_head_drafts_exact_chains_on_a_hybrid_target(target, tmp_path, kind):
    """A head on a hybrid target drafts `--tree chain` unless told otherwise (a tree is refused)."""
    if kind == "dflash":
        from speccompile.models.dflash_io import new_dflash, save_dflash
        from speccompile.models.load import load_model

        model = load_model(str(target))
        drafter = new_dflash(model.config, model.weights, seed=0, block_size=5, tap_layers=[1, 4, 6], num_layers=2)
        checkpoint = save_dflash(drafter, tmp_path / "ckpt", model.config.num_hidden_layers)
    else:
        checkpoint = write_checkpoint(tmp_path / "ckpt", kind)
    manifest = export_artifact(str(target), tmp_path / "art", ExportOptions(drafter=f"{kind}:{checkpoint}", max_context=256))
    assert manifest.drafter.get("tree_name") in ("chain-4", None)  # (DFlash: its block, a chain)
    assert manifest.graphs["target"].hidden_states == ("final" if kind in ("eagle", "medusa") else "eagle3")
    assert _greedy_equals_plain(tmp_path / "art", kind) > 0
