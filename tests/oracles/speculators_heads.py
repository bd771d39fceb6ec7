"""Random EAGLE-3 heads built by the `speculators` library's own classes, saved in their published layouts, with
the library's own forward on random target features as the oracle (tests/test_speculators_oracle.py).

Run with the python of a venv holding `speculators` (scripts/setup_oracles.sh), never this project's:
    SPEC_PY tests/oracles/speculators_heads.py TARGET_DIR OUT_DIR
TARGET_DIR: a tiny Llama target (config.json + model.safetensors); OUT_DIR/<name>/ gets each head and
OUT_DIR/<name>/oracle.npz: features, input ids, and per TTT step the library's logits and draft tokens.

Heads (sized for the target): speculators layout with a Llama layer (draft vocabulary, embeddings from the target);
two Qwen3 layers with q/k norms, custom taps and norm_before_residual + fc_norm + norm_output; three Llama
layers over four taps (the embeddings and the final hidden state) with norm_before_fc; the EAGLE authors' layout
(flat `LlamaForCausalLMEagle3` config, `midlayer.*` in pytorch_model.bin); SGLang SpecForge's flat layout with
`eagle_config` taps counted as layer outputs, in two safetensors shards. And one MTP module (the library's
MTPDraftModel, a Qwen3 layer): OUT_DIR/spec_mtp.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from speculators.models.mtp import MTPDraftModel, MTPSpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig

ROWS, STEPS = 10, 3


def layer_config(kind: str, target: dict, layers: int):
    common = dict(vocab_size=target["vocab_size"], hidden_size=target["hidden_size"], num_hidden_layers=layers,
                  max_position_embeddings=512, rms_norm_eps=1e-5)
    if kind == "qwen3":
        cfg = Qwen3Config(intermediate_size=96, num_attention_heads=8, num_key_value_heads=4, head_dim=8, **common)
    else:
        cfg = LlamaConfig(intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16, **common)
    cfg._attn_implementation = "eager"  # the dense-mask path of the library's forward (flex attention wants a GPU)
    return cfg


def randomize(model, seed: int) -> torch.Generator:
    """Weights larger than the library's init, so the distributions are peaked."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or ".norm" in name or "fc_norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 if "lm_head" in name else 0.15))
    return g


def speculators_config() -> SpeculatorsConfig:
    return SpeculatorsConfig(algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=STEPS)],
                             default_proposal_method="greedy",
                             verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"]))


MTP_HEADS = {"spec_mtp": ("qwen3", 6), "spec_mtp_seed7": ("qwen3", 7), "spec_mtp_seed8": ("qwen3", 8)}  # name -> (layer, seed)


def build_mtp(target: dict, weights: dict, out: Path, kind: str = "qwen3", seed: int = 6) -> None:
    """The library's MTP module (a `kind` layer) saved, and its teacher-forced forward as the oracle."""
    torch.manual_seed(seed)
    config = MTPSpeculatorConfig(transformer_layer_config=layer_config(kind, target, 1),
                                 speculators_config=speculators_config())
    model = MTPDraftModel(config).eval()
    randomize(model, seed)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(weights["model.embed_tokens.weight"])
        model.lm_head.weight.copy_(weights["lm_head.weight"])
    model.save_pretrained(str(out))
    g = torch.Generator().manual_seed(100 + seed)
    hidden = torch.randn(1, ROWS, target["hidden_size"], generator=g)
    ids = torch.randint(0, target["vocab_size"], (1, ROWS), generator=g)
    with torch.no_grad():
        logits, _, _ = model(ids, hidden, position_ids=torch.arange(ROWS)[None])
    np.savez(out / "oracle.npz", features=hidden[0].numpy(), input_ids=ids[0].numpy(),
             logits=torch.cat(logits).numpy())


def build(target: dict, embed: torch.Tensor, seed: int, kind: str, layers: int, taps, draft_vocab: int, **flags):
    torch.manual_seed(seed)
    config = Eagle3SpeculatorConfig(transformer_layer_config=layer_config(kind, target, layers), draft_vocab_size=draft_vocab,
                                    eagle_aux_hidden_state_layer_ids=taps, speculators_config=speculators_config(), **flags)
    model = Eagle3DraftModel(config).eval()
    g = randomize(model, seed)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embed)
        if model.d2t is not None:
            chosen = torch.sort(torch.randperm(target["vocab_size"], generator=g)[:draft_vocab]).values
            model.d2t.copy_(chosen - torch.arange(draft_vocab))
            model.t2d.zero_()
            model.t2d[chosen] = True
    return model


def oracle(model, taps: int, hidden: int, vocab: int, seed: int) -> dict[str, np.ndarray]:
    """The library's forward over random features: the lm_head output of every TTT step (teacher-forced ids)."""
    g = torch.Generator().manual_seed(seed + 100)
    features = torch.randn(1, ROWS, taps * hidden, generator=g)
    ids = torch.randint(0, vocab, (1, ROWS), generator=g)
    seen = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: seen.append(out.detach().clone()))
    with torch.no_grad():
        tokens = model(features, ids, torch.zeros(1, ROWS, dtype=torch.long), position_ids=torch.arange(ROWS)[None],
                       ttt_steps=STEPS)
    hook.remove()
    return {"features": features[0].numpy(), "input_ids": ids[0].numpy(), "logits": torch.cat(seen).numpy(),
            "draft_tokens": torch.cat(tokens).numpy()}


def save_speculators(model, out: Path, keep_embed: bool) -> None:
    model.save_pretrained(str(out))
    if not keep_embed:  # embeddings from the target (the library ignores them missing on load)
        tensors = load_file(str(out / "model.safetensors"))
        tensors.pop("embed_tokens.weight")
        save_file(tensors, str(out / "model.safetensors"))


def flat_tensors(model) -> dict[str, torch.Tensor]:
    """The library's state in the flat EAGLE-3 names (`midlayer.*`), without the target's tensors."""
    skip = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")
    return {k.replace("layers.0.", "midlayer."): v.contiguous() for k, v in model.state_dict().items() if k not in skip}


def flat_config(model, target: dict, **extra) -> dict:
    c = model.config.transformer_layer_config
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "num_hidden_layers": 1,
            "rms_norm_eps": c.rms_norm_eps,
            "rope_theta": 10000.0, "max_position_embeddings": 2048, "vocab_size": target["vocab_size"],
            "draft_vocab_size": model.config.draft_vocab_size, "hidden_act": "silu", "tie_word_embeddings": False,
            "torch_dtype": "float32", **extra}


def main(target_dir: Path, out: Path) -> None:
    target = json.loads((target_dir / "config.json").read_text())
    weights = load_file(str(target_dir / "model.safetensors"))
    embed = weights["model.embed_tokens.weight"]
    L, H, V = target["num_hidden_layers"], target["hidden_size"], target["vocab_size"]
    heads = {
        "spec_llama": (build(target, embed, 1, "llama", 1, None, 48), False),
        "spec_qwen3_2layers": (build(target, embed, 2, "qwen3", 2, [1, 3, 6], 64, norm_before_residual=True,
                                     fc_norm=True, norm_output=True), True),
        "spec_llama_3layers_4taps": (build(target, embed, 3, "llama", 3, [0, 3, 5, L], V, norm_before_fc=True), True),
    }
    for name, (model, keep_embed) in heads.items():
        save_speculators(model, out / name, keep_embed)
    authors = build(target, embed, 4, "llama", 1, None, 48)
    (out / "eagle_authors").mkdir(parents=True, exist_ok=True)
    torch.save(flat_tensors(authors), out / "eagle_authors" / "pytorch_model.bin")
    (out / "eagle_authors" / "config.json").write_text(json.dumps(flat_config(authors, target)))
    specforge = build(target, embed, 5, "llama", 1, [1, 4, 7], 48)
    folder = out / "specforge_sharded"
    folder.mkdir(parents=True, exist_ok=True)
    tensors = flat_tensors(specforge)
    names = sorted(tensors)
    index = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: tensors[k] for k in part}, str(folder / file))
        index.update({k: file for k in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    (folder / "config.json").write_text(json.dumps(flat_config(
        specforge, target, eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 3, 6], "use_aux_hidden_state": True})))
    models = {**{k: m for k, (m, _) in heads.items()}, "eagle_authors": authors, "specforge_sharded": specforge}
    for seed, (name, model) in enumerate(models.items()):
        taps = len(model.config.eagle_aux_hidden_state_layer_ids or [0, 0, 0])
        np.savez(out / name / "oracle.npz", **oracle(model, taps, H, V, seed))
    for name, (kind, seed) in MTP_HEADS.items():
        build_mtp(target, weights, out / name, kind, seed)
    print(json.dumps(sorted(models)))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
