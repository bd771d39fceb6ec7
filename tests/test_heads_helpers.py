"""Helpers for the drafter-head tests: tiny random targets and checkpoints in the published layouts."""

from __future__ import annotations

import json
from pathlib import Path

VOCAB = 96
H, HEADS, KV, HD, INTER = 64, 4, 2, 16, 128


def write_tokenizer(folder: Path) -> None:
    """The shared character-level tokenizer of the test suite."""
    from conftest import write_char_tokenizer

    write_char_tokenizer(folder, VOCAB)


def make_target(folder: Path, layers: int = 8, seed: int = 0, scale: float = 4.0) -> Path:
    """A tiny random Llama (8 layers so the EAGLE-3 taps (2, 4, 5) are distinct)."""
    import torch
    import transformers

    if (folder / "config.json").exists():
        return folder
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=H, intermediate_size=INTER, num_hidden_layers=layers,
                                   num_attention_heads=HEADS, num_key_value_heads=KV, max_position_embeddings=512,
                                   bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(scale)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    write_tokenizer(folder)
    return folder


_CACHE: dict = {}


def shared_target(tmp_path_factory) -> Path:
    """One tiny target per test session (shared by the head test modules)."""
    if "target" not in _CACHE:
        _CACHE["target"] = make_target(tmp_path_factory.mktemp("heads_target") / "llama")
    return _CACHE["target"]


WORDS = "the cat sat on a mat and then it ran to the red house where many dogs were playing with a ball".split()


def word_prompt_ids(seed: int, words: int = 6) -> list[int]:
    import random

    from tokenizers import Tokenizer

    rng = random.Random(seed)
    tok = Tokenizer.from_file(str(_CACHE["target"] / "tokenizer.json"))
    return [1] + tok.encode(" ".join(rng.choice(WORDS) for _ in range(words)), add_special_tokens=False).ids


def training_text(folder: Path, target: Path, docs: int = 32, new_tokens: int = 32) -> Path:
    """Self-distillation data: word prompts + the tiny target's own greedy continuations (JSONL)."""
    import torch
    from tokenizers import Tokenizer

    from speccompile.models.decoder import build_decoder, causal_mask
    from speccompile.models.load import load_model

    model = load_model(str(target))
    dec = build_decoder(model.config, model.weights, "none")
    tok = Tokenizer.from_file(str(target / "tokenizer.json"))
    lines = []
    with torch.no_grad():
        for d in range(docs):
            ids = word_prompt_ids(1000 + d)
            past = dec.empty_past()
            x, start = ids, 0
            for _ in range(new_tokens):
                out = dec(torch.tensor([x]), torch.arange(start, start + len(x))[None], causal_mask(len(x), start), *past)
                past, start = list(out[1:]), start + len(x)
                x = [int(out[0][0, -1].argmax())]
                ids.append(x[0])
            lines.append(json.dumps({"text": tok.decode(ids[1:], skip_special_tokens=False)}))
    path = folder / "train.jsonl"
    path.write_text("\n".join(lines))
    return path


def trained_head(tmp_path_factory, method: str, steps: int = 30) -> Path:
    """A head trained for a few steps on the shared tiny target (cached per session)."""
    key = ("head", method)
    if key not in _CACHE:
        from speccompile.training.trainer import TrainOptions, train_draft

        folder = tmp_path_factory.mktemp(f"trained_{method}")
        target = shared_target(tmp_path_factory)
        if "data" not in _CACHE:
            _CACHE["data"] = training_text(tmp_path_factory.mktemp("train_data"), target)
        train_draft(str(target), [_CACHE["data"]], folder / "head",
                    TrainOptions(method=method, steps=steps, seq_len=64, batch=8, lr=3e-3, save_every=steps, threads=1))
        _CACHE[key] = folder / "head"
    return _CACHE[key]


def _llama_layer(prefix: str, g, in_features: int = H, input_norm: bool = True) -> dict:
    import torch

    t = {
        f"{prefix}self_attn.q_proj.weight": torch.randn(HEADS * HD, in_features, generator=g) * 0.1,
        f"{prefix}self_attn.k_proj.weight": torch.randn(KV * HD, in_features, generator=g) * 0.1,
        f"{prefix}self_attn.v_proj.weight": torch.randn(KV * HD, in_features, generator=g) * 0.1,
        f"{prefix}self_attn.o_proj.weight": torch.randn(H, HEADS * HD, generator=g) * 0.1,
        f"{prefix}mlp.gate_proj.weight": torch.randn(INTER, H, generator=g) * 0.1,
        f"{prefix}mlp.up_proj.weight": torch.randn(INTER, H, generator=g) * 0.1,
        f"{prefix}mlp.down_proj.weight": torch.randn(H, INTER, generator=g) * 0.1,
        f"{prefix}post_attention_layernorm.weight": 1 + 0.1 * torch.randn(H, generator=g),
    }
    if input_norm:
        t[f"{prefix}input_layernorm.weight"] = 1 + 0.1 * torch.randn(H, generator=g)
    return t


def layer_config(**extra) -> dict:
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": H, "intermediate_size": INTER,
            "num_hidden_layers": 1, "num_attention_heads": HEADS, "num_key_value_heads": KV, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "vocab_size": VOCAB, "max_position_embeddings": 512, **extra}


def published_tensors(kind: str, seed: int = 0, draft_vocab: int = 48, medusa_heads: int = 3, mtp_layer: int = 8) -> tuple[dict, dict]:
    """(config.json, tensors) of a random checkpoint, keys written out by hand in each published layout."""
    import torch

    g = torch.Generator().manual_seed(seed)
    if kind == "eagle":
        t = {"fc.weight": torch.randn(H, 2 * H, generator=g) * 0.1, "fc.bias": torch.randn(H, generator=g) * 0.1}
        t.update(_llama_layer("layers.0.", g, input_norm=False))
        return layer_config(bias=True), t
    if kind == "eagle3":
        t = {"fc.weight": torch.randn(H, 3 * H, generator=g) * 0.1,
             "midlayer.hidden_norm.weight": 1 + 0.1 * torch.randn(H, generator=g),
             "norm.weight": 1 + 0.1 * torch.randn(H, generator=g),
             "lm_head.weight": torch.randn(draft_vocab, H, generator=g)}
        t.update(_llama_layer("midlayer.", g, in_features=2 * H))
        chosen = torch.sort(torch.randperm(VOCAB, generator=g)[:draft_vocab]).values
        t["d2t"] = (chosen - torch.arange(draft_vocab)).to(torch.int64)
        t2d = torch.zeros(VOCAB, dtype=torch.bool)
        t2d[chosen] = True
        t["t2d"] = t2d
        return layer_config(draft_vocab_size=draft_vocab, architectures=["LlamaForCausalLMEagle3"]), t
    if kind == "medusa":
        t = {}
        for i in range(medusa_heads):
            t[f"medusa_head.{i}.0.linear.weight"] = torch.randn(H, H, generator=g) * 0.1
            t[f"medusa_head.{i}.0.linear.bias"] = torch.randn(H, generator=g) * 0.1
            t[f"medusa_head.{i}.1.weight"] = torch.randn(VOCAB, H, generator=g)
        return {"medusa_num_heads": medusa_heads, "medusa_num_layers": 1}, t
    if kind == "mtp":
        p = f"model.layers.{mtp_layer}."
        t = {p + "enorm.weight": 1 + 0.1 * torch.randn(H, generator=g), p + "hnorm.weight": 1 + 0.1 * torch.randn(H, generator=g),
             p + "eh_proj.weight": torch.randn(H, 2 * H, generator=g) * 0.1,
             p + "embed_tokens.weight": torch.randn(VOCAB, H, generator=g),
             p + "shared_head.norm.weight": 1 + 0.1 * torch.randn(H, generator=g),
             p + "shared_head.head.weight": torch.randn(VOCAB, H, generator=g)}
        t.update(_llama_layer(p, g))
        return layer_config(num_nextn_predict_layers=1), t
    raise ValueError(kind)


def write_checkpoint(folder: Path, kind: str, **kw) -> Path:
    from safetensors.torch import save_file

    config, tensors = published_tensors(kind, **kw)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return folder
