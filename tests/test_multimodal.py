"""Multimodal checkpoints read as their text decoder (models/multimodal.py): a tiny random checkpoint of each wrapper
written by transformers (ForConditionalGeneration, tiny vision tower), exported; the contract and fused CPU graphs'
logits within 1e-4 of transformers' fp32 forward on text-only input at every position of a prefill, a tree verify and
a chain pass; greedy n-gram == plain; the towers left out and said so. Wrappers not read are refused in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from speccompile.export.pipeline import ExportOptions, export_artifact
from speccompile.runtime.artifact import open_artifact
from speccompile.runtime.session import Runner

from conftest import TINY_VOCAB, run_cli_here, write_char_tokenizer
from test_families import FAMILIES, MINISTRAL3_ROPE, WINDOW, _check_graph

_TEXT = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
_SIGLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14)
_QWEN_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
_TWO = ["sliding_attention", "full_attention"]
_MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}  # sections of a 16-wide head's 8 frequencies
WRAPPERS = {  # name -> (model_type, config kwargs); text decoders as tests/test_families.py's families
    # Gemma 3 (saved as language_model.model.*, tied): sliding + full layers, each rope base its own, linear scaling
    "gemma3": ("gemma3", dict(text_config=dict(_TEXT, sliding_window=WINDOW, layer_types=_TWO, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}), vision_config=_SIGLIP, mm_tokens_per_image=4)),
    # Gemma 4 (model.language_model.*): a full layer of its own head_dim whose values are its keys
    "gemma4": ("gemma4", dict(text_config=dict(_TEXT, sliding_window=WINDOW, layer_types=_TWO, global_head_dim=32,
                                               num_global_key_value_heads=1, attention_k_eq_v=True, hidden_size_per_layer_input=0),
                              vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2))),
    # Gemma 4 26B-A4B's layers (model.language_model.*): the MoE block beside the dense MLP, fused experts
    "gemma4-moe": ("gemma4", dict(text_config=dict(_TEXT, sliding_window=WINDOW, layer_types=_TWO, global_head_dim=32,
                                                   num_global_key_value_heads=1, attention_k_eq_v=True, hidden_size_per_layer_input=0,
                                                   enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32),
                                  vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2))),
    # Mistral Small 3.x (mistral3): an untied lm_head (language_model.lm_head), every layer sliding
    "mistral3": ("mistral3", dict(text_config=dict(_TEXT, model_type="mistral", sliding_window=WINDOW), tie_word_embeddings=False,
                                  vision_config=dict(_SIGLIP, head_dim=16))),
    # Ministral 3 (mistral3, text_config ministral3; a tied head as the 3B's): yarn rope, queries scaled by position
    "ministral3": ("mistral3", dict(text_config=dict(_TEXT, model_type="ministral3", rope_parameters=dict(MINISTRAL3_ROPE),
                                                     tie_word_embeddings=True), vision_config=dict(_SIGLIP, head_dim=16))),
    "llava": ("llava", dict(text_config=dict(_TEXT, model_type="llama"), vision_config=dict(
        _SIGLIP, model_type="clip_vision_model", projection_dim=32))),
    # Qwen2.5-VL (model.layers.*, visual.*: the text names already) and Qwen3-VL (model.language_model.*): mrope
    "qwen2_5_vl": ("qwen2_5_vl", dict(text_config=dict(_TEXT, rope_parameters=_MROPE), vision_config=_QWEN_VISION)),
    "qwen2_vl": ("qwen2_vl", dict(text_config=dict(_TEXT, rope_parameters=_MROPE), vision_config=dict(
        depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2))),
    "qwen3_vl": ("qwen3_vl", dict(text_config=dict(_TEXT, rope_parameters=dict(_MROPE, mrope_interleaved=True)),
                                  vision_config=dict(_QWEN_VISION, deepstack_visual_indexes=[0]))),
    # Qwen3-VL-MoE (model.language_model.*): Qwen3-MoE's layers, fused experts; hidden 64 != inter 24 and != 2 * inter
    "qwen3_vl_moe": ("qwen3_vl_moe", dict(text_config=dict(_TEXT, rope_parameters=dict(_MROPE, mrope_interleaved=True),
                                                          num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24),
                                          vision_config=dict(_QWEN_VISION, deepstack_visual_indexes=[0]))),
    # Llama 4 (Scout / Maverick: language_model.model.*, vision_model.*): tests/test_families.py's llama4_text layers
    "llama4": ("llama4", dict(text_config=dict(_TEXT, **FAMILIES["llama4_text"]), vision_config=dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14,
        vision_output_dim=32, projector_input_dim=32, projector_output_dim=64))),
    # Phi-4-multimodal (model.*, the towers in model.embed_tokens_extend; text keys at the top level): Phi-4-mini's
    # fused qkv / gate_up, longrope on half of each head, an untied lm_head
    "phi4_multimodal": ("phi4_multimodal", dict(_TEXT, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                                original_max_position_embeddings=256, rope_parameters=FAMILIES["phi3"]["rope_parameters"],
                                                vision_config=dict(_SIGLIP, crop_size=28), audio_config=dict(
        hidden_size=32, intermediate_size=64, num_blocks=1, num_attention_heads=2, nemo_conv_channels=32,
        depthwise_seperable_out_channel=32, ext_pw_out_channel=32, depthwise_multiplier=1, kernel_size=3))),
}
_CAUSAL_LM = ("phi4_multimodal",)  # wrappers transformers builds as a causal LM (not AutoModelForImageTextToText)
# text_config keys whose values are transformers' defaults, left out as older saves leave them (Gemma 3's published configs)
_GEMMA3_DEFAULTS = ("query_pre_attn_scalar", "rms_norm_eps", "hidden_activation", "attn_logit_softcapping",
                    "final_logit_softcapping", "attention_bias")


def make_wrapper_model(folder, name: str, seed: int = 0):
    """A tiny random multimodal checkpoint saved by transformers (2-D weights scaled: logits not near-ties)."""
    import torch
    import transformers

    model_type, kwargs = WRAPPERS[name]
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    auto = transformers.AutoModelForCausalLM if model_type in _CAUSAL_LM else transformers.AutoModelForImageTextToText
    model = auto.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(4.0)
            else:
                p.add_(0.2 * torch.randn_like(p))
        for bname, b in model.named_buffers():
            if bname.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand_like(b))
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    write_char_tokenizer(folder)
    return model


def _rewrite(folder, names: dict[str, str] | None = None, drop_text_keys: tuple[str, ...] = (), transpose: str = "") -> None:
    """The checkpoint with its tensors renamed (`names`: old prefix -> new), those ending in `transpose` stored with their
    last two axes swapped, and text_config keys left out."""
    from safetensors.torch import load_file, save_file

    if names or transpose:
        tensors = load_file(folder / "model.safetensors")
        tensors = {k: v.transpose(1, 2).contiguous() if transpose and k.endswith(transpose) else v for k, v in tensors.items()}
        renamed = {next((new + k[len(old):] for old, new in (names or {}).items() if k.startswith(old)), k): v
                   for k, v in tensors.items()}
        save_file(renamed, folder / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((folder / "config.json").read_text())
    raw["text_config"] = {k: v for k, v in raw["text_config"].items() if k not in drop_text_keys}
    (folder / "config.json").write_text(json.dumps(raw))


@pytest.mark.parametrize("name", [*WRAPPERS, "gemma3-v5", "qwen3_vl_moe-published"])
def test_wrapper_text_decoder_matches_transformers(tmp_path, name):
    hf = make_wrapper_model(tmp_path / "hf", name.removesuffix("-v5").removesuffix("-published"))
    if name == "qwen3_vl_moe-published":  # the published checkpoints' experts: [experts, hidden, 2 * inter], [experts, inter, hidden]
        _rewrite(tmp_path / "hf", transpose="_proj")
    if name == "gemma3-v5":  # transformers 5's names, a config of an older save (defaults left out)
        _rewrite(tmp_path / "hf", {"language_model.model.": "model.language_model.", "vision_tower.": "model.vision_tower.",
                                   "multi_modal_projector.": "model.multi_modal_projector."}, _GEMMA3_DEFAULTS)
    (tmp_path / "hf" / "chat_template.json").write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}"}))
    said: list[str] = []
    out = tmp_path / "art"
    export_artifact(str(tmp_path / "hf"), out, ExportOptions(max_context=96), said.append)
    left_out = [m for m in said if m.startswith("text decoder only: ")]
    assert len(left_out) == 1 and any(part in left_out[0] for part in ("vision_tower", "visual", "vision_model", "embed_tokens_extend")), said
    manifest = json.loads((out / "manifest.json").read_text())
    assert not any("vision" in f or "visual" in f for f in manifest["files"])
    assert (out / "tokenizer_config.json").is_file()  # the tokenizer's template wins over the processor's
    seq = [int(t) for t in np.random.default_rng(1).integers(3, TINY_VOCAB, 26)]
    for fused in (True, False):
        session = open_artifact(out, threads=1, fused=fused).target
        _check_graph(session, hf, seq, 5, f"{name} {'fused' if fused else 'contract'}")
    runner = Runner(out, drafter="ngram", num_draft_tokens=4, adaptive=False, threads=1)
    prompt = "abc abd abc abd abc abd abc"
    plain = runner.generate(prompt, chat=False, max_tokens=40, drafter="none")
    assert runner.generate(prompt, chat=False, max_tokens=40).tokens == plain.tokens


def test_processor_chat_template_comes_through(tmp_path):
    """A folder whose only chat template is the processor's chat_template.json: exported as chat_template.jinja."""
    from speccompile.models.load import load_model

    make_wrapper_model(tmp_path / "hf", "qwen3_vl")
    config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "chat_template"}))
    (tmp_path / "hf" / "chat_template.json").write_text(json.dumps({"chat_template": "<{{ messages[0]['content'] }}>"}))
    written = load_model(str(tmp_path / "hf")).write_tokenizer(tmp_path / "tok")
    assert "chat_template.jinja" in written
    assert (tmp_path / "tok" / "chat_template.jinja").read_text() == "<{{ messages[0]['content'] }}>"


def _config_folder(tmp_path, raw: dict):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


@pytest.mark.parametrize("raw, says", [
    (dict(model_type="mllama", text_config=dict(_TEXT, model_type="mllama_text_model")), "model_type 'mllama': Llama 3.2 Vision"),
    (dict(model_type="idefics3", text_config=dict(_TEXT, model_type="llama")), "model_type 'idefics3' (a multimodal wrapper"),
    (dict(model_type="llava", text_config=dict(_TEXT, model_type="rwkv")), "llava with text_config model_type 'rwkv' is not supported"),
    (dict(model_type="gemma3", text_config=dict(_TEXT, model_type="gemma3_text", use_bidirectional_attention=True)),
     "gemma3 with use_bidirectional_attention is not supported"),
])
def test_unsupported_wrappers_are_refused(tmp_path, capsys, raw, says):
    folder = _config_folder(tmp_path, raw)
    (folder / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")  # an empty checkpoint
    code, _, err = run_cli_here(capsys, "export", str(folder), "--out", str(tmp_path / "art"))
    lines = [line for line in err.strip().splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1 and says in lines[0] and "Traceback" not in err, err
    assert not (tmp_path / "art").exists()


def test_phi4_multimodal_remote_code_save_reads_its_base_layers(tmp_path):
    """Phi-4-multimodal as Microsoft published it (model_type phi4mm, remote code): the text keys beside embd_layer /
    vision_lora / speech_lora, each adapted layer's weight under `base_layer.` beside its vision / speech LoRA
    tensors. The text decoder is the base layers (the adapters are off on text, as transformers' conversion drops
    them): logits as transformers' phi4_multimodal forward of the converted checkpoint, the adapters said."""
    import torch
    from safetensors.torch import load_file, save_file

    hf = make_wrapper_model(tmp_path / "hf", "phi4_multimodal")
    folder = tmp_path / "hf"
    tensors, adapted = load_file(folder / "model.safetensors"), ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    stored = {}
    for name, tensor in tensors.items():
        if name.startswith("model.layers.") and name.rsplit(".", 2)[-2] in adapted:
            stem = name.removesuffix(".weight")
            stored[f"{stem}.base_layer.weight"] = tensor
            for mode in ("vision", "speech"):  # rank 4; B nonzero: applied, they would change the logits
                stored[f"{stem}.lora_A.{mode}.weight"] = torch.randn(4, tensor.shape[1])
                stored[f"{stem}.lora_B.{mode}.weight"] = torch.randn(tensor.shape[0], 4)
        else:
            stored[name] = tensor
    save_file(stored, folder / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((folder / "config.json").read_text())
    raw = {k: v for k, v in raw.items() if k not in ("vision_config", "audio_config")}
    raw.update(model_type="phi4mm", auto_map={"AutoConfig": "configuration_phi4mm.Phi4MMConfig"},
               embd_layer={"image_embd_layer": {"crop_size": 28}, "audio_embd_layer": {"downsample_rate": 8}},
               vision_lora={"r": 4, "lora_alpha": 8}, speech_lora={"r": 4, "lora_alpha": 8})
    (folder / "config.json").write_text(json.dumps(raw))
    said: list[str] = []
    export_artifact(str(folder), tmp_path / "art", ExportOptions(max_context=96), said.append)
    note = [m for m in said if m.startswith("text decoder only: ")]
    assert len(note) == 1 and "embed_tokens_extend" in note[0] and "32 LoRA adapter tensors" in note[0], said
    seq = [int(t) for t in np.random.default_rng(1).integers(3, TINY_VOCAB, 26)]
    _check_graph(open_artifact(tmp_path / "art", threads=1).target, hf, seq, 5, "phi4mm fused")


def test_stray_tensor_is_refused(tmp_path, capsys):
    """A tensor that is neither the language model's nor a vision / audio part is refused by name, never dropped."""
    make_wrapper_model(tmp_path / "hf", "llava")
    _rewrite(tmp_path / "hf", {"multi_modal_projector.linear_1.": "image_newline."})
    code, _, err = run_cli_here(capsys, "export", str(tmp_path / "hf"), "--out", str(tmp_path / "art"))
    lines = [line for line in err.strip().splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1 and "llava tensor image_newline.bias is neither" in lines[0], err


class _Gemma3nText:
    """transformers' Gemma3nModel forward on token ids (its text path: a token at or past embed_vision's offset embedded
    by its embedder, per-layer inputs of the ids) over the text model `hf` and the embedders; Gemma3nForConditionalGeneration
    itself needs timm for its MobileNet tower, which the tests do not install."""

    def __init__(self, hf, embedders):
        self.hf, self.embedders = hf, embedders

    def __call__(self, input_ids):
        import torch

        model = self.hf.model
        embeds = model.embed_tokens(input_ids)
        for embedder in self.embedders:
            mine = (input_ids >= embedder.vocab_offset) & (input_ids < embedder.vocab_offset + embedder.vocab_size)
            ids = torch.where(mine, input_ids, embedder.vocab_offset)
            embeds = torch.where(mine.unsqueeze(-1), embedder(input_ids=ids), embeds)
        hidden = model(inputs_embeds=embeds, per_layer_inputs=model.get_per_layer_inputs(input_ids)).last_hidden_state
        cap = self.hf.config.final_logit_softcapping
        logits = torch.tanh(self.hf.lm_head(hidden) / cap) * cap
        return type("Out", (), {"logits": logits})


def test_gemma3n_wrapper_reads_its_language_model(tmp_path):
    """Gemma 3n (model.language_model.*, tied; the vision / audio towers left out): the text decoder's contract and fused
    graphs match transformers' forward on token ids at every position of a prefill, a tree verify and a chain pass,
    its image / audio tokens (ids 80-95 here) embedded by their embedders (models/soft_tokens.py); greedy n-gram == plain."""
    import torch
    import transformers
    from safetensors.torch import save_file
    from transformers.models.gemma3n.modeling_gemma3n import Gemma3nMultimodalEmbedder

    from test_families import make_family_model

    hf = make_family_model(tmp_path / "text", "gemma3n_text")
    config = transformers.AutoConfig.for_model("gemma3n", text_config=hf.config.to_dict(),
                                               vision_config=dict(vocab_offset=80, vocab_size=8, hidden_size=16),
                                               audio_config=dict(vocab_offset=88, vocab_size=8, hidden_size=16))
    torch.manual_seed(1)
    embedders = {name: Gemma3nMultimodalEmbedder(part, config.text_config).eval()
                 for name, part in (("embed_vision", config.vision_config), ("embed_audio", config.audio_config))}
    tensors = {"model.language_model." + k.removeprefix("model."): v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    with torch.no_grad():
        for name, embedder in embedders.items():
            for key, p in embedder.named_parameters():
                p.add_(0.2 * torch.randn_like(p))
                tensors[f"model.{name}.{key}"] = p.detach().clone()
    tensors.update({"model.vision_tower.timm_model.conv_stem.conv.weight": torch.zeros(4, 3, 3, 3),
                    "model.audio_tower.subsample_conv_projection.input_proj_linear.weight": torch.zeros(8, 8)})
    folder = tmp_path / "hf"
    folder.mkdir()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(config.to_json_string())
    write_char_tokenizer(folder)
    said: list[str] = []
    export_artifact(str(folder), tmp_path / "art", ExportOptions(max_context=96), said.append)
    left_out = [m for m in said if m.startswith("text decoder only: ")]
    assert left_out == ["text decoder only: audio_tower, embed_audio, embed_vision, vision_tower not exported (10 tensors); "
                        "embed_vision/embed_audio token rows read as model.soft_token_embeds.weight"], said
    reference = _Gemma3nText(hf, list(embedders.values()))
    seq = [int(t) for t in np.random.default_rng(1).integers(3, TINY_VOCAB, 26)]
    assert max(seq) >= 88 and any(80 <= t < 88 for t in seq)  # image and audio tokens among them
    for fused in (True, False):
        _check_graph(open_artifact(tmp_path / "art", threads=1, fused=fused).target, reference, seq, 84, f"gemma3n {'fused' if fused else 'contract'}")
    runner = Runner(tmp_path / "art", drafter="ngram", num_draft_tokens=4, adaptive=False, threads=1)
    prompt = "abc abd abc abd abc abd abc"
    assert runner.generate(prompt, chat=False, max_tokens=40).tokens == runner.generate(prompt, chat=False, max_tokens=40, drafter="none").tokens
