"""Runs in the speculators library's own environment (tests/test_dflash.py starts it with $SPECCOMPILE_SPECULATORS_PYTHON):
builds a DFlash drafter with random weights from the library's classes, `save_pretrained`s it, and writes the
logits the library's own modules give for a block over given target features (the inference pass vLLM and z-lab
run: non-causal attention of the block over the fused context and itself).

    python speculators_dflash_oracle.py OUT SEED DRAFT_VOCAB   (reads OUT/inputs.npz, writes OUT/head, OUT/oracle.npy)

The checkpoint leaves out what the target holds (the embeddings; the lm_head unless over a draft vocabulary), so
the oracle uses the target's, given in inputs.npz.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig

TARGET = {"hidden_size": 64, "vocab_size": 96, "num_layers": 8}  # the tiny target of tests/test_heads_helpers.py
TAPS, BLOCK, MASK = [1, 4, 6], 5, 95


def build(seed: int, draft_vocab: int) -> DFlashDraftModel:
    torch.manual_seed(seed)
    layer = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, vocab_size=TARGET["vocab_size"], rms_norm_eps=1e-6, rope_theta=10000.0,
                        max_position_embeddings=512)
    layer._attn_implementation = "eager"
    config = DFlashSpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=draft_vocab, block_size=BLOCK, aux_hidden_state_layer_ids=TAPS,
        mask_token_id=MASK, target_hidden_size=64,
        speculators_config=SpeculatorsConfig(algorithm="dflash", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=BLOCK - 1)],
                                             default_proposal_method="greedy", verifier=VerifierConfig(name_or_path=None, architectures=[])))
    model = DFlashDraftModel(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.rand_like(p) + 0.5 if name.endswith("norm.weight") else torch.randn_like(p) * 0.2)
        if draft_vocab != TARGET["vocab_size"]:  # a draft vocabulary: every other target token
            keep = torch.arange(0, TARGET["vocab_size"], TARGET["vocab_size"] // draft_vocab)[:draft_vocab]
            t2d = torch.zeros(TARGET["vocab_size"], dtype=torch.bool)
            t2d[keep] = True
            model.load_vocab_mappings(t2d, keep - torch.arange(draft_vocab))
    return model.eval()


def block_logits(model: DFlashDraftModel, ids: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """The library's modules over [context | block]: fc + hidden_norm, each layer, norm, lm_head (slots 1..B-1)."""
    ctx = model.hidden_norm(model.fc(aux))
    x = model.embed_tokens(ids)
    positions = torch.arange(aux.shape[1] + ids.shape[1])[None]
    cos, sin = model.rotary_emb(x, positions)
    for layer in model.layers:
        x = layer(hidden_states=x, target_hidden=ctx, attention_mask=None, position_embeddings=(cos, sin))
    return model.lm_head(model.norm(x))[:, 1:].float()


def main() -> None:
    out, seed, draft_vocab = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    model = build(seed, draft_vocab)
    model.save_pretrained(out / "head")
    inputs = np.load(out / "inputs.npz")
    with torch.no_grad():
        model.embed_tokens.weight.copy_(torch.from_numpy(inputs["embed"]))
        if draft_vocab == TARGET["vocab_size"]:
            model.lm_head.weight.copy_(torch.from_numpy(inputs["lm_head"]))
        logits = block_logits(model, torch.from_numpy(inputs["ids"]), torch.from_numpy(inputs["aux"]))
    np.save(out / "oracle.npy", logits.numpy())


if __name__ == "__main__":
    main()
