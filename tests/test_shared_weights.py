"""The GPU verify graph and its slotted form share their weights (runtime/backends/shared_weights.py): every external
tensor both graphs name with the same bytes is allocated once and handed to both ONNX Runtime sessions. Checked here
with the fp32 forms on the CPU EP: which tensors are shared (the same name, type, shape, file and offset only), that
shared sessions compute bitwise what separately loaded ones do, that both sessions read the one buffer, and that a
server's Runner opens the slotted form over the target's pool."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from speccompile.manifest import read_manifest, variant_name
from speccompile.runtime.backends.ort_cuda import OrtCudaSession
from speccompile.runtime.backends.ort_cuda_slots import OrtCudaSlotSession
from speccompile.runtime.backends.shared_weights import SharedWeights, external_initializers, gpu_form_weights
from speccompile.runtime.batch_gpu import SlotGraphPasses
from speccompile.runtime.kvcache import causal_mask
from conftest import load_benchmark, make_tiny_hf_model
from test_batch_passes import _decode
from test_gpu_graph import _has_cuda_ep
from test_gpu_slots import CONTEXT, PROMPTS, SLOTS, _ids, gpu_runner, slot_artifact  # noqa: F401 (a fixture)

SINGLE, SLOTTED = variant_name("target", "cuda"), variant_name("target", "cuda-slots")


def _pool(artifact: Path) -> SharedWeights:
    manifest = read_manifest(artifact)
    return SharedWeights(artifact, [manifest.graph(SINGLE).file, manifest.graph(SLOTTED).file], "cpu")


def _sessions(artifact: Path, weights: SharedWeights | None) -> tuple[OrtCudaSession, OrtCudaSlotSession]:
    manifest = read_manifest(artifact)
    return (OrtCudaSession(artifact, manifest.graph(SINGLE), device="cpu", max_context=CONTEXT, threads=1, weights=weights),
            OrtCudaSlotSession(artifact, manifest.graph(SLOTTED), device="cpu", max_context=CONTEXT, threads=1,
                               weights=weights))


def _steps(single: OrtCudaSession, slotted: OrtCudaSlotSession, prompt: list[int], steps: int = 4) -> list[np.ndarray]:
    """Logits of a prompt and `steps` greedy tokens after it, on the single-sequence graph and in slot 2 of the
    slotted one (each row's logits, both graphs in turn)."""
    rows, cache = [], single.new_cache()
    slot = slotted.slot_cache(2)
    ids = np.asarray(prompt, np.int64)
    for _ in range(steps + 1):
        positions = np.arange(cache.length, cache.length + len(ids))
        alone = single.run(ids, positions, cache.attention_mask(causal_mask(len(ids))), cache)
        rows += [alone.logits.copy(), alone.greedy_tokens.copy()]
        batched = slotted.run_slots({2: (ids, positions)})[2]
        rows += [batched.logits.copy(), batched.greedy_tokens.copy()]
        cache.length += len(ids)
        slot.length += len(ids)
        ids = alone.greedy_tokens[-1:]
    return rows


def test_the_gpu_forms_share_every_weight_they_both_name(slot_artifact):
    manifest = read_manifest(slot_artifact)
    pool = _pool(slot_artifact)
    single, slotted = (external_initializers(slot_artifact / manifest.graph(name).file) for name in (SINGLE, SLOTTED))
    assert set(single) == set(slotted) == pool.names and len(pool.keys) == len(single)  # the weights, rotary tables
    assert all(single[name] == slotted[name] for name in single)  # the same file, offset and length
    assert "model.embed_tokens.weight" in pool.names and "layers.0.mlp_split" not in pool.names  # inline: not shared
    assert pool.nbytes == sum(key.length for key in single.values()) > 0
    target = manifest.graph(SINGLE)
    assert gpu_form_weights(slot_artifact, manifest, "ort-cuda", target).device == "cuda"
    assert gpu_form_weights(slot_artifact, manifest, "ort-cpu", target) is None  # the CPU EP: see gpu_form_weights
    assert gpu_form_weights(slot_artifact, manifest, "ort-cuda", manifest.graph("target")) is None  # trees: one graph


def test_a_tensor_is_shared_only_with_the_same_bytes(slot_artifact, tmp_path):
    """A graph that names a tensor at another file (or offset) than the other graph does gets its own copy."""
    manifest = read_manifest(slot_artifact)
    for name in ("target.onnx.data", "target.ort-cuda.onnx.data", manifest.graph(SINGLE).file):
        shutil.copy(slot_artifact / name, tmp_path / name)
    shutil.copy(slot_artifact / "target.onnx.data", tmp_path / "elsewhere.data")
    graph = onnx.load(str(slot_artifact / manifest.graph(SLOTTED).file), load_external_data=False)
    moved = next(t for t in graph.graph.initializer if t.name == "model.embed_tokens.weight")
    next(entry for entry in moved.external_data if entry.key == "location").value = "elsewhere.data"
    onnx.save(graph, str(tmp_path / manifest.graph(SLOTTED).file))
    pool = SharedWeights(tmp_path, [manifest.graph(SINGLE).file, manifest.graph(SLOTTED).file], "cpu")
    assert "model.embed_tokens.weight" not in pool.names and len(pool.names) == len(_pool(slot_artifact).names) - 1


def test_shared_sessions_compute_bitwise_what_separate_sessions_compute(slot_artifact):
    pool = _pool(slot_artifact)
    shared = _sessions(slot_artifact, pool)
    assert shared[0].shared_tensors == shared[1].shared_tensors == len(pool.keys) and pool.sessions == 2
    separate = _sessions(slot_artifact, None)
    assert separate[0].shared_tensors == separate[1].shared_tensors == 0
    for prompt in ([5, 6, 7, 8, 9, 10, 11], [3]):
        for mine, theirs in zip(_steps(*shared, prompt), _steps(*separate, prompt)):
            assert np.array_equal(mine, theirs)


def test_both_sessions_read_the_one_buffer(slot_artifact):
    """Writing a shared tensor after the sessions opened changes what both compute (alike), not what a separately
    loaded session computes: ONNX Runtime runs the pool's buffer in place (the embedding: a Gather, never prepacked)."""
    pool = _pool(slot_artifact)
    shared, separate = _sessions(slot_artifact, pool), _sessions(slot_artifact, None)
    prompt = [5, 6, 7, 8]
    before = _steps(*shared, prompt, steps=0)
    embedding = pool.value("model.embed_tokens.weight")
    embedding.update_inplace(embedding.numpy() * np.float32(2))
    after = _steps(*shared, prompt, steps=0)
    assert not np.array_equal(before[0], after[0]) and not np.array_equal(before[2], after[2])  # both graphs
    np.testing.assert_allclose(after[0], after[2], atol=1e-4, rtol=1e-4)  # alike: the same embedding
    assert all(np.array_equal(a, b) for a, b in zip(before, _steps(*separate, prompt, steps=0)))


def test_a_server_runner_opens_the_slot_form_over_the_targets_weights(slot_artifact):
    """What `serve --backend ort-cuda` opens: the target's GPU graph and, for the batch decoder, its slotted form, both
    over the artifact's pool (`Artifact.weights`); batched greedy output is each request's alone."""
    runner = gpu_runner(slot_artifact, drafter="ngram")
    pool = _pool(slot_artifact)
    runner.artifact.weights = pool
    runner.artifact.target = _sessions(slot_artifact, pool)[0]
    decoder = runner.batch_decoder(SLOTS)
    assert isinstance(decoder.passes, SlotGraphPasses)
    assert decoder.passes.session.shared_tensors == runner.artifact.target.shared_tensors == len(pool.keys)
    prompts = [_ids(runner, p) for p in PROMPTS[:4]]
    for ids, result in zip(prompts, _decode(decoder, runner, prompts, 16)):
        assert result.tokens == runner.generate_ids(ids, 16).tokens


def test_the_memory_script_opens_the_sessions_a_server_opens(slot_artifact, capsys):
    """benchmarks/gpu_weights_memory.py (the device check's record of memory in use; here on the CPU EP): the
    slotted session it opens over the pool gets every shared tensor."""
    assert load_benchmark("gpu_weights_memory").main([str(slot_artifact), "--device", "cpu", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["shared_tensors"] == len(_pool(slot_artifact).keys) and report["weights_shared_mib"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not _has_cuda_ep(), reason="onnxruntime here has no CUDAExecutionProvider (needs onnxruntime-gpu and a GPU)")
def test_cuda_sessions_share_the_weights_in_place(tmp_path):
    """On the GPU (fp16, CUDA graphs): the pool an ort-cuda artifact opens with is taken in place by both sessions
    (writing a shared tensor changes what both compute, not what a separately loaded session computes: if ONNX
    Runtime refused the views it would load copies of its own and this fails), and their logits are bitwise the
    separately loaded sessions'."""
    from speccompile.export.pipeline import ExportOptions, export_artifact

    out = tmp_path / "fp16"
    export_artifact(str(make_tiny_hf_model(tmp_path / "llama")), out, ExportOptions(max_context=CONTEXT, dtype="fp16"))
    manifest = read_manifest(out)
    specs = [manifest.graph(SINGLE), manifest.graph(SLOTTED)]
    pool = gpu_form_weights(out, manifest, "ort-cuda", specs[0])
    assert pool is not None, "this onnxruntime makes no DLPack views (OrtValue.from_dlpack): nothing is shared"

    def opened(weights):
        return (OrtCudaSession(out, specs[0], device="cuda", max_context=CONTEXT, weights=weights),
                OrtCudaSlotSession(out, specs[1], device="cuda", max_context=CONTEXT, weights=weights))

    shared, separate = opened(pool), opened(None)
    prompt = [5, 6, 7, 8, 9, 10]
    before = _steps(*shared, prompt)
    assert all(np.array_equal(a, b) for a, b in zip(before, _steps(*separate, prompt)))
    embedding = pool.value("model.embed_tokens.weight")
    embedding.update_inplace(embedding.numpy() * np.float16(2))
    after = _steps(*shared, prompt, steps=0)
    assert not np.array_equal(before[0], after[0]) and not np.array_equal(before[2], after[2])
    assert all(np.array_equal(a, b) for a, b in zip(before[:4], _steps(*separate, prompt, steps=0)))
