"""Head loaders read the published layouts; torch and ONNX Runtime agree; wrong taps / keys fail."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from speccompile.errors import InputError
from test_heads_helpers import H, VOCAB, published_tensors, shared_target, write_checkpoint

KINDS = ["eagle", "eagle3", "medusa", "mtp"]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from speccompile.models.load import load_model

    torch.set_num_threads(1)  # the CPUs are shared: oversubscribed torch threads are 100x slower
    folder = shared_target(tmp_path_factory)
    return folder, load_model(str(folder))


def _inputs(head, q=4, past=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    cfg = head.head_config
    ids = torch.randint(0, VOCAB, (1, q), generator=g)
    pos = torch.tensor([[past, past + 1, past + 1, past + 2]])
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    mask = torch.cat([torch.ones(q, past, dtype=torch.bool), tree], dim=1)[None]
    hidden = torch.randn(1, q, H, generator=g)
    extra = [torch.randn(1, q, 3 * H, generator=g)] if cfg.kind == "eagle3" else []
    past_kv = [torch.randn(1, cfg.layer.num_key_value_heads, past, cfg.layer.head_dim, generator=g) for _ in range(2)]
    return ids, pos, mask, extra, hidden, past_kv


@pytest.mark.parametrize("kind", KINDS)
def test_loader_reads_published_layout_and_onnx_matches(kind, target, tmp_path):
    import onnxruntime as ort

    from speccompile.export.heads import export_head_graph
    from speccompile.models.head_loaders import load_head

    _, model = target
    ckpt = write_checkpoint(tmp_path / kind, kind)
    head = load_head(kind, ckpt, model.config, model.weights)
    _, tensors = published_tensors(kind)
    state = head.state_dict()
    # every published tensor landed in the module (names mapped, values unchanged)
    if kind == "eagle":
        assert torch.equal(state["fc.weight"], tensors["fc.weight"])
        assert torch.equal(state["lm_head.weight"], model.weights.torch_tensor("lm_head.weight"))
    elif kind == "eagle3":
        assert torch.equal(state["midlayer.self_attn.q_proj.weight"], tensors["midlayer.self_attn.q_proj.weight"])
        assert torch.equal(head.draft_to_target()[head.t2d[head.draft_to_target()]], head.draft_to_target())
    elif kind == "mtp":
        assert torch.equal(state["block.self_attn.q_proj.weight"], tensors["model.layers.8.self_attn.q_proj.weight"])
    else:
        assert torch.equal(state["medusa_head.2.1.weight"], tensors["medusa_head.2.1.weight"])
    path = tmp_path / f"{kind}.onnx"
    spec = export_head_graph(head, path)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ids, pos, mask, extra, hidden, past = _inputs(head)
    with torch.no_grad():
        if kind == "medusa":
            ref = head(hidden)
            got = sess.run(None, {"hidden_states": hidden.numpy()})
            assert got[0].shape == (1, 4, 3, VOCAB)
        else:
            ref = head(ids, pos, mask, *extra, hidden, *past)
            feed = dict(zip(head.input_names, [t.numpy() for t in (ids, pos, mask, *extra, hidden, *past)]))
            got = sess.run(head.output_names, feed)
    ref = ref if isinstance(ref, tuple) else (ref,)
    for r, o in zip(ref, got):
        np.testing.assert_allclose(o, r.numpy(), atol=1e-4, rtol=1e-4)
    assert spec.role == kind


def test_legacy_medusa_pt_weights_only(target, tmp_path):
    from speccompile.models.head_loaders import load_head

    _, model = target
    config, tensors = published_tensors("medusa")
    folder = tmp_path / "legacy"
    folder.mkdir()
    torch.save({k[len("medusa_head."):]: v for k, v in tensors.items()}, folder / "medusa_lm_head.pt")
    (folder / "config.json").write_text(json.dumps(config))
    head = load_head("medusa", folder, model.config, model.weights)
    assert torch.equal(head.state_dict()["medusa_head.1.0.linear.bias"], tensors["medusa_head.1.0.linear.bias"])
    # a pickle that is not plain tensors (here: a reference to a builtin) is refused by weights_only
    import pickle

    (folder / "medusa_lm_head.pt").write_bytes(pickle.dumps({"x": print}))
    with pytest.raises(InputError, match="weights-only"):
        load_head("medusa", folder, model.config, model.weights)


@pytest.mark.parametrize("kind", KINDS)
def test_missing_and_unexpected_keys_are_named(kind, target, tmp_path):
    from safetensors.torch import save_file

    from speccompile.models.head_loaders import load_head

    _, model = target
    config, tensors = published_tensors(kind)
    victim = sorted(k for k in tensors if "post_attention_layernorm" in k or k.endswith(".1.weight"))[0]
    del tensors[victim]
    tensors["extra_thing.weight"] = torch.zeros(3)
    folder = tmp_path / kind
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError) as err:
        load_head(kind, folder, model.config, model.weights)
    msg = str(err.value)
    assert "extra_thing.weight" in msg
    assert victim.split(".")[-2] in msg and "missing keys" in msg


def test_eagle_vs_eagle3_and_shape_errors(target, tmp_path):
    from speccompile.models.head_loaders import load_head

    _, model = target
    e3 = write_checkpoint(tmp_path / "e3", "eagle3")
    with pytest.raises(InputError, match="eagle3:PATH"):
        load_head("eagle", e3, model.config, model.weights)
    config, tensors = published_tensors("eagle")
    assert config["bias"] is True
    with pytest.raises(InputError, match="no such file"):
        load_head("eagle", tmp_path / "nope", model.config, model.weights)


def _hf_hidden_states(folder, ids):
    import transformers

    hf = transformers.LlamaForCausalLM.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        return hf(ids, output_hidden_states=True).hidden_states  # [0] = embeddings, [j] = input of layer j


def test_eagle3_taps_match_hf_and_off_by_one_is_caught(target, tmp_path):
    """Our target's aux output = HF hidden_states[j] for j in the EAGLE-3 ids; the off-by-one wiring differs."""
    from speccompile.models.decoder import build_decoder, causal_mask
    from speccompile.models.head_loaders import load_head

    folder, model = target
    dec = build_decoder(model.config, model.weights, "eagle3")
    ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        aux = dec(ids, torch.arange(12)[None], causal_mask(12, 0), *dec.empty_past())[-1]
    hs = _hf_hidden_states(folder, ids)
    head = load_head("eagle3", write_checkpoint(tmp_path / "e3", "eagle3"), model.config, model.weights)
    taps = head.head_config.aux_layer_ids
    assert taps == [2, 4, 5]

    def head_logits(features):
        h0 = torch.zeros(1, 11, H)
        with torch.no_grad():
            return head(ids[:, 1:], torch.arange(11)[None], causal_mask(11, 0), features[:, :-1], h0, *head.empty_past())[0]

    right = torch.cat([hs[j] for j in taps], dim=-1)
    wrong = torch.cat([hs[j + 1] for j in taps], dim=-1)  # "output of layer j" convention
    torch.testing.assert_close(aux, right, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(head_logits(aux), head_logits(right), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(head_logits(aux), head_logits(wrong), atol=1e-2)

    # custom taps, in either numbering, are the head's own: the target graph exports exactly those (id L: the
    # final hidden state before the norm)
    L = model.config.num_hidden_layers
    for key, written, inputs in (("eagle_aux_hidden_state_layer_ids", [1, 3, L], [1, 3, L]),
                                 ("eagle_config", {"eagle_aux_hidden_state_layer_ids": [0, 2, 6]}, [1, 3, 7])):
        config, tensors = published_tensors("eagle3")
        config[key] = written
        custom = tmp_path / f"custom_{key}"
        write_checkpoint(custom, "eagle3")
        (custom / "config.json").write_text(json.dumps(config))
        assert load_head("eagle3", custom, model.config, model.weights).head_config.aux_layer_ids == inputs
        dec = build_decoder(model.config, model.weights, "eagle3", tuple(inputs))
        with torch.no_grad():
            out = dec(ids, torch.arange(12)[None], causal_mask(12, 0), *dec.empty_past())
        hf = [hs[j] for j in inputs if j < L] + ([_pre_norm_final(dec, ids)] if L in inputs else [])
        torch.testing.assert_close(out[-1], torch.cat(hf, dim=-1), atol=1e-4, rtol=1e-4)
    config["eagle_aux_hidden_state_layer_ids"] = [2, 4, 6]  # disagrees with eagle_config's outputs [0, 2, 6]
    (custom / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match="disagree"):
        load_head("eagle3", custom, model.config, model.weights)


def _pre_norm_final(dec, ids):
    """The last layer's output before the final norm (HF's hidden_states[L] is after it)."""
    from speccompile.models.decoder import causal_mask

    seen = {}
    hook = dec.model.norm.register_forward_pre_hook(lambda _m, args: seen.setdefault("x", args[0]))
    with torch.no_grad():
        dec(ids, torch.arange(ids.shape[1])[None], causal_mask(ids.shape[1], 0), *dec.empty_past())
    hook.remove()
    return seen["x"]


def test_save_head_roundtrip(target, tmp_path):
    from speccompile.models.head_loaders import load_head
    from speccompile.models.head_writers import new_head, save_head

    _, model = target
    for kind in KINDS:
        head = new_head(kind, model.config, model.weights, medusa_num_heads=2)
        with torch.no_grad():
            for p in head.parameters():
                p.add_(0.01 * torch.randn_like(p))
        save_head(head, tmp_path / kind)
        again = load_head(kind, tmp_path / kind, model.config, model.weights)
        for k, v in head.state_dict().items():
            if kind in ("eagle", "mtp") and k in ("lm_head.weight", "embed_tokens.weight", "shared_head.head.weight"):
                continue  # shared with the target, not written
            if kind == "eagle3" and k == "embed_tokens.weight":
                continue
            assert torch.equal(again.state_dict()[k], v), (kind, k)


def test_eagle3_heads_are_written_flat_and_the_speculators_layout_still_reads(target, tmp_path):
    """`save_head` writes the flat Hugging Face EAGLE-3 config (`LlamaForCausalLMEagle3`: the sizes at the top
    level, `draft_vocab_size`, the taps under `eagle_config` and as `target_layer_ids`) that vLLM, SGLang,
    TensorRT-LLM and TensorRT Edge-LLM read; the older speculators layout (sizes nested under
    `transformer_layer_config`) loads to the same head."""
    from speccompile.models.decoder import eagle3_tap_layers
    from speccompile.models.head_loaders import load_head
    from speccompile.models.head_writers import new_head, save_head

    _, model = target
    head = new_head("eagle3", model.config, model.weights, draft_vocab_size=32)
    folder = save_head(head, tmp_path / "flat")
    config = json.loads((folder / "config.json").read_text())
    taps = list(eagle3_tap_layers(model.config.num_hidden_layers))
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["hidden_size"] == H and config["num_hidden_layers"] == 1 and config["draft_vocab_size"] == 32
    assert config["eagle_aux_hidden_state_layer_ids"] == taps == config["target_layer_ids"]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [t - 1 for t in taps]  # SGLang: outputs
    flat = load_head("eagle3", folder, model.config, model.weights)
    layer = {k: config.pop(k) for k in list(config) if k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                              "num_key_value_heads", "head_dim", "rms_norm_eps")}
    old = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"], "transformer_layer_config": layer,
           "draft_vocab_size": 32, "eagle_aux_hidden_state_layer_ids": taps}
    (folder / "config.json").write_text(json.dumps(old))
    nested = load_head("eagle3", folder, model.config, model.weights)
    for key, value in flat.state_dict().items():
        assert torch.equal(nested.state_dict()[key], value), key
    assert nested.head_config.layout == "eagle3/speculators"
    assert replace(nested.head_config, layout="") == replace(flat.head_config, layout="")
