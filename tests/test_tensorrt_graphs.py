"""The TensorRT bucket design (--profiles buckets, TensorRTGraphSession): the pure parts here, the engine on
GPU machines with TensorRT only."""

from __future__ import annotations

from dataclasses import asdict

import numpy as np
import pytest

from speccompile.accel import profiles as cfg
from speccompile.accel.trt import import_tensorrt
from speccompile.manifest import GraphSpec, TensorSpec
from speccompile.runtime.backends.tensorrt_graphs import CudaMemcpy2D, accepted_row_copies, bucket_layout, bucket_mask

LIMITS = {"max_context": 2048, "max_verify_tokens": 64, "max_batch": 1}


def _spec() -> GraphSpec:
    kv = [TensorSpec(f"past_key_values.0.{k}", "float16", ["batch", 3, "past_len", 64]) for k in ("key", "value")]
    return GraphSpec(
        role="target", file="target.onnx",
        inputs=[TensorSpec("input_ids", "int64", ["batch", "q_len"]), TensorSpec("position_ids", "int64", ["batch", "q_len"]),
                TensorSpec("attention_mask", "bool", ["batch", "q_len", "total_len"]), *kv],
        outputs=[TensorSpec("logits", "float", ["batch", "q_len", 100])],
    )


def test_bucket_profiles_fix_every_shape():
    profiles = cfg.profiles_for(_spec(), {**LIMITS, "max_verify_tokens": 13}, "buckets", prefill_chunk=256)
    assert [p.name for p in profiles] == ["q1", "q2", "q4", "q8", "q13", "prefill"]
    q8 = profiles[3]
    assert q8.shapes["input_ids"] == ([1, 8], [1, 8], [1, 8])
    assert q8.shapes["past_key_values.0.key"] == ([1, 3, 2048, 64],) * 3
    assert q8.shapes["attention_mask"] == ([1, 8, 2056],) * 3
    prefill = profiles[-1]
    assert prefill.shapes["input_ids"] == ([1, 1], [1, 256], [1, 256])
    assert prefill.shapes["past_key_values.0.value"][0] == [1, 3, 2048, 64]
    with pytest.raises(Exception, match="^profiles must be one of single, split, buckets"):
        cfg.profiles_for(_spec(), LIMITS, "dynamic")


def test_bucket_layout_from_the_manifest_record():
    recorded = [asdict(p) for p in cfg.profiles_for(_spec(), LIMITS, "buckets", prefill_chunk=128)]
    layout = bucket_layout(recorded)
    assert layout.buckets == {1: 0, 2: 1, 4: 2, 8: 3, 16: 4, 32: 5, 64: 6} and layout.capacity == 2048 and layout.prefill == 7
    assert bucket_layout([asdict(p) for p in cfg.profiles_for(_spec(), LIMITS, "single")]) is None  # dynamic engine
    # shape-invariant mode: every pass of up to `rows` tokens in the one bucket that holds them
    assert layout.only(8).buckets == {8: 3} and layout.only(5).buckets == {8: 3} and layout.only(100).buckets == {64: 6}
    assert layout.only(8).capacity == 2048 and layout.only(8).prefill == 7


def test_bucket_mask_pads_and_hides_padding():
    tree = np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=bool)
    mask = bucket_mask(tree, length=2, capacity=5, bucket=4)
    assert mask.shape == (1, 4, 9)
    assert mask[0, :3, :5].tolist() == [[True, True, False, False, False]] * 3  # committed rows only
    assert (mask[0, :3, 5:8] == tree).all() and not mask[0, :3, 8].any()  # no real row sees the padding row
    assert mask[0, 3].tolist() == [False] * 8 + [True]  # the padding row sees itself only


@pytest.mark.parametrize("keep,runs", [([0, 1, 2], 1), ([0, 2, 3], 2), ([0], 1), ([0, 1, 3], 2)])
def test_accepted_row_copies_move_the_right_rows(keep, runs):
    heads, dim, capacity, bucket, length = 3, 4, 10, 4, 5
    rng = np.random.default_rng(0)
    present = rng.standard_normal((1, heads, capacity + bucket, dim)).astype(np.float16)
    kv = rng.standard_normal((1, heads, capacity, dim)).astype(np.float16)
    expected = kv.copy()
    for slot, source in enumerate(keep):
        expected[0, :, length + slot] = present[0, :, capacity + source]
    row_bytes = dim * 2
    copies = accepted_row_copies(keep, length, capacity, bucket, heads, row_bytes)
    assert len(copies) == runs  # consecutive rows move together
    src, dst = present.reshape(-1).view(np.uint8), kv.reshape(-1).view(np.uint8)
    for c in copies:  # what cuMemcpy2DAsync does
        for row in range(c.height):
            s, d = c.src_offset + row * c.src_pitch, c.dst_offset + row * c.dst_pitch
            dst[d: d + c.width] = src[s: s + c.width]
    np.testing.assert_array_equal(kv, expected)


def test_chain_commit_is_one_copy_per_tensor():
    assert len(accepted_row_copies([0, 1, 2, 3], 7, 16, 4, 2, 128)) == 1
    assert len(accepted_row_copies([0, 2, 3], 7, 16, 4, 2, 128)) == 2  # root, then rows 2-3 together


def test_memcpy2d_struct_layout():
    """CUDA_MEMCPY2D on 64-bit Linux: 16 fields, 128 bytes, WidthInBytes at offset 112."""
    import ctypes

    assert ctypes.sizeof(CudaMemcpy2D) == 128 and CudaMemcpy2D.WidthInBytes.offset == 112


@pytest.mark.tensorrt
@pytest.mark.skipif(import_tensorrt() is None, reason="TensorRT is not installed here (no GPU machine)")
def test_bucket_engine_with_cuda_graphs_matches_onnx_runtime(tiny_artifact, tmp_path):
    from speccompile.engines.build import BuildOptions, build_artifact
    from speccompile.runtime.session import Runner

    out = tmp_path / "engines"
    build_artifact(tiny_artifact, out, BuildOptions(precision="none", profiles="buckets", prefill_chunk=64))
    ref = Runner(tiny_artifact, drafter="none").generate_ids([5, 6, 7, 8], max_tokens=16)
    for drafter in ("none", "ngram"):
        got = Runner(out, backend="tensorrt", drafter=drafter).generate_ids([5, 6, 7, 8], max_tokens=16)
        assert got.tokens == ref.tokens
