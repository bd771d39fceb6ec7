"""The slotted fused CPU graph (`export --batch-slots N`: target.ort-slots.onnx, export/ort_fused_graph.py
`_SlotInputs`; backends/ort_slots.py): every slot's rows, plain or a draft, compute the same bits as that
sequence's pass alone."""

from __future__ import annotations

import numpy as np
import pytest

from speccompile.export.pipeline import ExportOptions, export_artifact
from speccompile.manifest import read_manifest, variant_name
from speccompile.runtime.artifact import open_artifact
from speccompile.runtime.backends.ort_slots import OrtSlotSession, SlotRows

from conftest import make_tiny_hf_model
from test_families import make_family_model


def _tril(n: int) -> np.ndarray:
    return np.tril(np.ones((n, n), bool))


def alone_rows_in_slots(alone, pool: list[np.ndarray], prompts: list, tokens: list) -> tuple[list, list, list]:
    """Each prompt prefilled alone and copied into slot b of `pool`, then its new `tokens` run alone: (their logits
    alone, the slots' caches, the SlotRows that run the same tokens in a slot pass)."""
    expected, caches = [], []
    for b, (prompt, new) in enumerate(zip(prompts, tokens)):
        cache = alone.new_cache()
        out = alone.run(prompt, np.arange(len(prompt)), cache.attention_mask(_tril(len(prompt))), cache)
        cache.append(out.presents, range(len(prompt)), len(prompt))
        for buffer, own in zip(pool, cache.arrays):
            buffer[b, :, : len(prompt)] = own[0, :, : len(prompt)]
        positions = np.arange(len(prompt), len(prompt) + len(new))
        expected.append(alone.run(new, positions, cache.attention_mask(_tril(len(new))), cache).logits)
        slot_cache = alone.slot_cache(pool, b)
        slot_cache.append([], range(len(prompt)), len(prompt))
        caches.append(slot_cache)
    rows = [SlotRows(new, np.arange(len(p), len(p) + len(new)), _tril(len(new))) for p, new in zip(prompts, tokens)]
    return expected, caches, rows


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2", "cohere2", "phi", "qwen2_moe", "gpt_oss", "hunyuan_v1_dense",
                                  "ministral3", "gemma3n_text"])  # + windows, softcaps, LayerNorm (Phi-2: with biases, a plain MLP), mixtures of
# experts (a shared expert; biases, clamped SwiGLU, attention sinks), q/k norms after rope (Hunyuan: RotaryEmbedding before
# GroupQueryAttention), queries scaled by position (Ministral 3: each slot's rows by their own positions),
# Gemma 3n's AltUp streams, Gaussian top-k, KV sharing and per-layer embeddings
def test_slot_rows_equal_each_sequence_alone_bitwise(tmp_path, arch):
    art = tmp_path / "art"
    if arch in ("llama", "qwen3"):
        make_tiny_hf_model(tmp_path / "m", arch=arch)
    else:  # window 8: the prompts run past it
        make_family_model(tmp_path / "m", arch)
    export_artifact(str(tmp_path / "m"), art, ExportOptions(max_context=96, batch_slots=4))
    manifest = read_manifest(art)
    spec = manifest.graphs[variant_name("target", "slots")]
    assert spec.extra["slots"] == 4 and (art / spec.file).exists()
    alone = open_artifact(art, threads=1).target
    slotted = OrtSlotSession(art, manifest, spec, threads=1)
    slots, rows = 3, 128  # one graph slot more than the decoder has: it gets a dummy row in a spare buffer
    pool = alone.new_batch_buffers(slots, rows)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 60, n) for n in (5, 17, 30)]
    qs = [1, 3, 5]  # a plain step and drafts in one pass
    tokens = [rng.integers(3, 60, q) for q in qs]
    expected, caches, requests = alone_rows_in_slots(alone, pool, prompts, tokens)
    outs = slotted.run(pool, alone.past_names, requests, caches)
    for b, out in enumerate(outs):
        np.testing.assert_array_equal(out.logits, expected[b], err_msg=f"slot {b}")
    # the same rows with slot 0 idle (a dummy row): the other slots' bits do not change
    outs = slotted.run(pool, alone.past_names, [None, *requests[1:]], caches)
    assert outs[0] is None
    for b in (1, 2):
        np.testing.assert_array_equal(outs[b].logits, expected[b], err_msg=f"slot {b} next to a dummy")


def test_one_row_slots_without_padding_equal_the_batched_pass_bitwise(tmp_path):
    """`pad_one_row=False` (the batch decoder's slot passes unless batch-invariant): a plain row skips attention's
    padding row and computes what the batched pass computes for it, bit for bit."""
    art = tmp_path / "art"
    export_artifact(str(make_tiny_hf_model(tmp_path / "m")), art, ExportOptions(max_context=96, batch_slots=4))
    manifest = read_manifest(art)
    alone = open_artifact(art, threads=1).target
    slotted = OrtSlotSession(art, manifest, manifest.graphs[variant_name("target", "slots")], threads=1)
    pool = alone.new_batch_buffers(3, 128)
    rng = np.random.default_rng(1)
    caches = []
    for b, n in enumerate((6, 19, 33)):
        prompt = rng.integers(3, 60, n)
        cache = alone.new_cache()
        out = alone.run(prompt, np.arange(n), cache.attention_mask(_tril(n)), cache)
        cache.append(out.presents, range(n), n)
        for buffer, own in zip(pool, cache.arrays):
            buffer[b, :, :n] = own[0, :, :n]
        caches.append(alone.slot_cache(pool, b))
        caches[-1].append([], range(n), n)
    new = [rng.integers(3, 60, 1) for _ in caches]
    batched = alone.run_batch(pool, [(t, np.array([c.length]), _tril(1)) for t, c in zip(new, caches)], caches)
    rows = [SlotRows(t, np.array([c.length]), _tril(1)) for t, c in zip(new, caches)]
    outs = slotted.run(pool, alone.past_names, rows, caches, pad_one_row=False)
    for b, (out, expected) in enumerate(zip(outs, batched)):
        np.testing.assert_array_equal(out.logits, expected.logits, err_msg=f"slot {b}")
    padded = slotted.run(pool, alone.past_names, rows, caches)  # negative control: the padding row's kernel differs
    assert any(not np.array_equal(p.logits, e.logits) for p, e in zip(padded, batched))


def test_export_without_slots_writes_no_slotted_graph(tmp_path):
    art = tmp_path / "art"
    export_artifact(str(make_tiny_hf_model(tmp_path / "m")), art, ExportOptions(max_context=64, batch_slots=0))
    assert variant_name("target", "slots") not in read_manifest(art).graphs
    assert not (art / "target.ort-slots.onnx").exists()
