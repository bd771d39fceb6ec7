"""MTP modules shipped inside a target checkpoint, in each published naming (DeepSeek-V3 / GLM-4.5 with several
modules, Qwen3-Next / Qwen3.5 `mtp.*` with zero-centred norms, MiMo `model.mtp_layers.*`), on Llama and Qwen3
targets: `--drafter mtp` with no path reads them from the target folder, the target graph leaves them out, the
head graph equals the torch module, and greedy speculative output equals plain."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from test_heads_helpers import H, HD, HEADS, INTER, KV, VOCAB, _llama_layer, write_tokenizer


def _block(prefix: str, g: torch.Generator, qk_norm: bool, norm_offset: float = 1.0) -> dict[str, torch.Tensor]:
    t = _llama_layer(prefix, g)
    if qk_norm:
        t[f"{prefix}self_attn.q_norm.weight"] = 1 + 0.1 * torch.randn(HD, generator=g)
        t[f"{prefix}self_attn.k_norm.weight"] = 1 + 0.1 * torch.randn(HD, generator=g)
    return {k: (v - 1 + norm_offset if k.endswith("norm.weight") else v) for k, v in t.items()}


def mtp_tensors(style: str, layers: int, qk_norm: bool, modules: int = 1, seed: int = 5) -> dict[str, torch.Tensor]:
    """Random MTP modules in a published naming (norm gains around 1; Qwen3-Next's stored around 0)."""
    g = torch.Generator().manual_seed(seed)
    norm = lambda offset=1.0: offset + 0.1 * torch.randn(H, generator=g)  # noqa: E731
    proj = lambda: torch.randn(H, 2 * H, generator=g) * 0.1  # noqa: E731
    t: dict[str, torch.Tensor] = {}
    for i in range(modules):
        if style == "deepseek":
            p = f"model.layers.{layers + i}."
            t.update({p + "enorm.weight": norm(), p + "hnorm.weight": norm(), p + "eh_proj.weight": proj(),
                      p + "shared_head.norm.weight": norm()})
            t.update(_block(p, g, qk_norm))
        elif style == "qwen3_next":
            t.update(_block(f"mtp.layers.{i}.", g, qk_norm, norm_offset=0.0))
        else:
            p = f"model.mtp_layers.{i}."
            t.update({p + "token_layernorm.weight": norm(), p + "hidden_layernorm.weight": norm(),
                      p + "input_proj.weight": proj(), p + "final_layernorm.weight": norm()})
            t.update(_block(p, g, qk_norm))
    if style == "qwen3_next":
        t.update({"mtp.fc.weight": proj(), "mtp.pre_fc_norm_embedding.weight": norm(0.0),
                  "mtp.pre_fc_norm_hidden.weight": norm(0.0), "mtp.norm.weight": norm(0.0)})
    return t


def make_target_with_mtp(folder: Path, arch: str, style: str, modules: int = 1, layers: int = 4) -> Path:
    """A tiny random Llama / Qwen3 target whose checkpoint also carries MTP modules in `style`'s naming."""
    import transformers
    from safetensors.torch import load_file, save_file

    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[arch]
    cfg = cls[0](vocab_size=VOCAB, hidden_size=H, intermediate_size=INTER, num_hidden_layers=layers, num_attention_heads=HEADS,
                 num_key_value_heads=KV, head_dim=HD, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                 tie_word_embeddings=False)
    torch.manual_seed(0)
    model = cls[1](cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    model.save_pretrained(folder, safe_serialization=True)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors.update(mtp_tensors(style, layers, arch == "qwen3", modules))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config["num_nextn_predict_layers"] = modules
    (folder / "config.json").write_text(json.dumps(config))
    write_tokenizer(folder)
    return folder


CASES = [("llama", "deepseek", 2), ("qwen3", "qwen3_next", 1), ("qwen3", "mimo", 1), ("llama", "qwen3_next", 1)]


@pytest.mark.parametrize("arch,style,modules", CASES)
def test_mtp_inside_the_target_loads_exports_and_verifies(arch, style, modules, tmp_path):
    import onnxruntime as ort

    from speccompile.export.heads import export_head_graph
    from speccompile.models.head_loaders import load_head
    from speccompile.models.load import load_model
    from speccompile.export.pipeline import ExportOptions, export_artifact
    from test_heads_runtime import spec_vs_plain

    torch.set_num_threads(1)
    folder = make_target_with_mtp(tmp_path / "target", arch, style, modules)
    model = load_model(str(folder))
    assert not any("mtp" in n or n.startswith("model.layers.4.") for n in model.weights.names())  # the target's only
    head = load_head("mtp", None, model.config, model.weights, folder)
    cfg = head.head_config
    assert (cfg.mtp_style, cfg.mtp_modules, cfg.layout, cfg.layer.qk_norm) == (style, modules, f"mtp/{style}", arch == "qwen3")
    written = mtp_tensors(style, 4, arch == "qwen3", modules)
    state = head.state_dict()
    if style == "deepseek":  # module 0's values, names mapped
        assert torch.equal(state["block.self_attn.q_proj.weight"], written["model.layers.4.self_attn.q_proj.weight"])
        assert torch.equal(state["eh_proj.weight"], written["model.layers.4.eh_proj.weight"])
    elif style == "qwen3_next":  # zero-centred gains: stored weight + 1
        assert torch.equal(state["enorm.weight"], written["mtp.pre_fc_norm_embedding.weight"] + 1)
        assert torch.equal(state["block.input_layernorm.weight"], written["mtp.layers.0.input_layernorm.weight"] + 1)
        assert torch.equal(state["eh_proj.weight"], written["mtp.fc.weight"])
    else:
        assert torch.equal(state["hnorm.weight"], written["model.mtp_layers.0.hidden_layernorm.weight"])
        assert torch.equal(state["shared_head.norm.weight"], written["model.mtp_layers.0.final_layernorm.weight"])
    # the graph equals the torch module, rows at position 0 included (MiMo zeroes that row's embedding)
    export_head_graph(head, tmp_path / "mtp.onnx")
    sess = ort.InferenceSession(str(tmp_path / "mtp.onnx"), providers=["CPUExecutionProvider"])
    g = torch.Generator().manual_seed(1)
    ids, pos = torch.randint(0, VOCAB, (1, 5), generator=g), torch.arange(5)[None]
    hidden = torch.randn(1, 5, H, generator=g)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()[None]
    with torch.no_grad():
        ref = head(ids, pos, mask, hidden, *head.empty_past())
        other = head(ids.roll(1, dims=1), pos, mask, hidden, *head.empty_past())
    got = sess.run(None, dict(zip(head.input_names, [t.numpy() for t in (ids, pos, mask, hidden, *head.empty_past())])))
    for r, o in zip(ref, got):
        np.testing.assert_allclose(o, r.numpy(), atol=1e-4, rtol=1e-4)
    assert torch.equal(ref[0][0, 0], other[0][0, 0]) == (style == "mimo")  # position 0's token counts unless MiMo
    m = export_artifact(str(folder), tmp_path / "art", ExportOptions(drafter="mtp", max_context=256))
    assert m.drafter["head"]["mtp_style"] == style and m.graphs["target"].num_layers == 4
    stats = spec_vs_plain(tmp_path / "art", "mtp", {"chain": None, "dynamic": "dynamic-3-2-6"})
    assert all(s[0] > 0 for s in stats.values()), stats


def test_mtp_without_a_path_on_a_target_without_mtp_is_one_line(tmp_path, tmp_path_factory):
    from speccompile.errors import InputError
    from speccompile.export.pipeline import ExportOptions, export_artifact
    from test_heads_helpers import shared_target

    with pytest.raises(InputError, match="carries no MTP weights"):
        export_artifact(str(shared_target(tmp_path_factory)), tmp_path / "art", ExportOptions(drafter="mtp", max_context=64))
