"""Streaming build: segments compute what the whole graph computes, the streaming pass stores what the whole-model
pass stores (bit for bit), eval in chunks is eval in one piece, the in-place GPTQ factor is the inverse's, and a model
past 2 GiB builds in memory bounded by a layer, not the model."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from speccompile.engines import gptq
from speccompile.engines.build import BuildOptions, build_artifact
from speccompile.engines.calibrate import ActivationRecorder, load_calibration_texts, prefill_feeds, tokenize_calibration
from speccompile.engines.methods import MethodOptions, apply_methods, calibrated_tensors
from speccompile.engines.qdq_targets import QuantOptions, activation_tensors
from speccompile.engines.quantize import quantize_model
from speccompile.engines.segments import SegmentRunner, cpu_session, plan_segments, weight_inputs
from speccompile.manifest import read_manifest
from speccompile.tokenizer import TextTokenizer
from speccompile.weights_file import load_graph, read_tensor

from conftest import load_benchmark, run_cli, write_char_tokenizer


def _samples(artifact: Path, count: int = 3, tokens: int = 64) -> list[list[int]]:
    tokenizer = TextTokenizer(artifact, read_manifest(artifact).tokenizer.get("eos_token_ids"))
    return tokenize_calibration(load_calibration_texts(None), tokenizer, count, tokens)


def test_segments_compute_the_whole_graph_bit_for_bit(tiny_artifact, tmp_path):
    """Cut at every weight MatMul (one per segment), every activation and the logits equal an ONNX Runtime run of
    the whole graph, bitwise."""
    spec = read_manifest(tiny_artifact).graph("target")
    model = load_graph(tiny_artifact / spec.file)
    wanted = sorted(weight_inputs(model)) + ["logits"]
    assert len(plan_segments(model, wanted, parameters=0)) >= 8  # 2 layers x 4 weight MatMuls, lm_head
    whole = onnx.load(str(tiny_artifact / spec.file), load_external_data=True)
    del whole.graph.output[1:]
    whole.graph.output.extend(helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in wanted[:-1])
    session = cpu_session(whole.SerializeToString())
    feeds = [prefill_feeds(spec, ids) for ids in _samples(tiny_artifact)]
    expected = [dict(zip(wanted[:-1], session.run(wanted[:-1], f))) | {"logits": session.run(["logits"], f)[0]} for f in feeds]
    got: list[dict] = [{} for _ in feeds]
    SegmentRunner(tiny_artifact, model).run(feeds, wanted, lambda i, name, value: got[i].__setitem__(name, value), parameters=0)
    for want, have in zip(expected, got):
        assert set(have) == set(wanted)
        for name in wanted:
            np.testing.assert_array_equal(have[name], want[name], err_msg=name)


def _whole_model_build(artifact: Path, options: BuildOptions) -> onnx.ModelProto:
    """The Q/DQ graph as the pass computed it before it streamed: the model loaded, calibrated in one session per
    sample, the methods on every activation at once, then quantize_model."""
    spec = read_manifest(artifact).graph("target")
    model = onnx.load(str(artifact / spec.file), load_external_data=True)
    qopts = QuantOptions(options.precision, options.exclude, options.int4_block, tables=options.quantize_tables,
                         table_format=options.table_format, weight_only=options.weight_only)
    tensors = activation_tensors(model, qopts) or calibrated_tensors(model, qopts)
    samples = _samples(artifact, options.calib_samples, options.calib_max_tokens)
    whole = onnx.load(str(artifact / spec.file), load_external_data=True)
    whole.graph.output.extend(helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in tensors)
    session = cpu_session(whole.SerializeToString())
    recorder = ActivationRecorder(tensors, sum(map(len, samples)), options.methods.calibration_rows(qopts.defaults_key))
    for ids in samples:
        for name, value in zip(tensors, session.run(tensors, prefill_feeds(spec, ids))):
            recorder.add(name, value)
    applied = apply_methods(model, qopts, {n: recorder.pop(n) for n in tensors}, options.methods)
    quantize_model(model, qopts, applied.act_amax if qopts.quantizes_activations else None, applied.weight_clip, applied.weight_grid)
    return model


@pytest.mark.parametrize("options", [
    BuildOptions(precision="int4", int4_block=32),
    BuildOptions(precision="nvfp4"),
    BuildOptions(precision="fp8", methods=MethodOptions(low_rank=4)),
    BuildOptions(precision="nvfp4", weight_only=True, quantize_tables=True, table_format="scheme", exclude=("lm_head*",)),
], ids=["int4", "nvfp4", "fp8-low-rank", "nvfp4-weight-only-table"])
def test_streaming_build_stores_what_the_whole_model_pass_stores(tiny_artifact, tmp_path, options):
    """One weight MatMul per calibration segment, units quantized as their activations complete, weights written as
    they come: the graph (nodes in order) and every initializer's bytes are those of the whole-model pass."""
    options = dataclasses.replace(options, onnx_only=True, calib_samples=3, calib_max_tokens=64, segment_parameters=0)
    build_artifact(tiny_artifact, tmp_path / "built", options)
    built = load_graph(tmp_path / "built" / "target.onnx")
    expected = _whole_model_build(tiny_artifact, options)
    key = lambda n: (n.op_type, n.name, tuple(n.input), tuple(n.output))  # noqa: E731
    assert [key(n) for n in built.graph.node] == [key(n) for n in expected.graph.node]
    values = {i.name: _stored_bytes(i, tmp_path / "built") for i in built.graph.initializer}
    assert values == {i.name: _stored_bytes(i, tmp_path) for i in expected.graph.initializer}


def _stored_bytes(tensor: onnx.TensorProto, base: Path) -> bytes:
    """A tensor's bytes as stored (packed 4-bit codes as they are), wherever they are."""
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        return np.asarray(read_tensor(tensor, base)).tobytes()
    return tensor.raw_data if tensor.HasField("raw_data") else onnx.numpy_helper.to_array(tensor).tobytes()


def test_eval_in_chunks_is_eval_in_one_piece(tiny_artifact, tmp_path, monkeypatch):
    from speccompile import evaluation

    build_artifact(tiny_artifact, tmp_path / "int4", BuildOptions(precision="int4", onnx_only=True, calib_samples=2))
    text = tmp_path / "text.txt"
    text.write_text("the cat sat on the mat.\n\nabc abc abc abc\n\nhello world, hello again.")
    whole = evaluation.evaluate(tmp_path / "int4", tiny_artifact, evaluation.EvalOptions(text=text))
    monkeypatch.setattr(evaluation, "LOGITS_BYTES", 1)  # one paragraph per chunk
    assert len(evaluation.chunks([[1, 2]] * 3, 96, 1)) == 3
    chunked = evaluation.evaluate(tmp_path / "int4", tiny_artifact, evaluation.EvalOptions(text=text, segment_parameters=0))
    assert chunked == whole and whole["top1_agreement"] < 1.0


@pytest.mark.parametrize("k,block", [(300, 64), (700, 128)])
def test_in_place_gptq_factor_is_the_inverse_factor(k, block):
    """The in-place factor (used above K=4096) gives the float32 factor of the inverse-based one, bit for bit on these
    matrices; the in-place symmetric permutation is fancy indexing."""
    rng = np.random.default_rng(k)
    x = rng.standard_normal((2 * k, k)) * rng.uniform(0.1, 3.0, k)
    h = gptq.hessian(x)
    expected = gptq.inverse_hessian_factor(h, 0.1)
    damped = h.copy()
    damped[np.diag_indices_from(damped)] += 0.1 * np.mean(np.diag(damped))
    got = gptq.factor_in_place(damped, block)
    np.testing.assert_array_equal(got, expected)
    order = rng.permutation(k)
    permuted = h.copy()
    gptq.permute_symmetric(permuted, order)
    np.testing.assert_array_equal(permuted, h[np.ix_(order, order)])


# ---------------------------------------------------------------- past 2 GiB, memory bounded by a layer

PEAK_RSS = """
import resource, sys
from pathlib import Path
from speccompile.engines.build import BuildOptions, build_artifact
build_artifact(sys.argv[1], Path(sys.argv[2]), BuildOptions(precision="int4", onnx_only=True, calib_samples=2, calib_max_tokens=32,
                                                           segment_parameters=0))
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def _peak_build_rss(artifact: Path, out: Path) -> int:
    result = subprocess.run([sys.executable, "-c", PEAK_RSS, str(artifact), str(out)], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-2000:]
    return int(result.stdout.split()[-1])


def _random_export(folder: Path, out: Path, max_context: int = 64, fused: bool = False, **config) -> Path:
    import transformers

    from speccompile.export.pipeline import ExportOptions, export_artifact

    scale = load_benchmark("scale")
    defaults = dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                    torch_dtype="bfloat16")
    scale.write_random_checkpoint(transformers.LlamaConfig(**{**defaults, **config}), folder, shard_bytes=256 << 20)
    write_char_tokenizer(folder)
    export_artifact(str(folder), out, ExportOptions(max_context=max_context, batch_slots=0, fused_cpu_graph=fused))
    return out


def test_build_memory_is_bounded_by_a_layer_not_the_model(tmp_path):
    """Peak RSS of an INT4 build (AWQ, clipping, GPTQ; measured in a subprocess) of an 8-layer model exceeds that of
    the one-layer model of the same shapes by less than a few copies of its largest weight, though the model is 8x
    (calibration segments of one weight MatMul: the default's are larger, SEGMENT_PARAMETERS, not the model). The
    same process writes the packed fused CPU graph (engines/cpu_graph.py)."""
    shapes = dict(vocab_size=96, hidden_size=512, intermediate_size=2048)
    peaks, sizes = {}, {}
    for layers in (1, 8):
        art = _random_export(tmp_path / f"m{layers}", tmp_path / f"a{layers}", fused=True, num_hidden_layers=layers, **shapes)
        peaks[layers] = _peak_build_rss(art, tmp_path / f"b{layers}")
        assert (tmp_path / f"b{layers}" / "target.ort.onnx").is_file()  # the packed CPU graph is inside the bound
        sizes[layers] = (art / "target.onnx.data").stat().st_size
    largest = 2 * 2048 * 512 * 4  # the gate/up MatMul weight in float32
    assert sizes[8] - sizes[1] > 10 * largest  # a model held in memory would not fit under the bound
    assert peaks[8] - peaks[1] < 4 * largest, (peaks, sizes)


@pytest.fixture(scope="module")
def past_2gib(tmp_path_factory):
    """Two layers, hidden 64, a tied table of 8.45M rows: over 2 GiB in float32 (its INT4 build copies the table); a
    context for `verify`'s built-in prompts (up to 107 tokens of this tokenizer, plus the generated ones)."""
    root = tmp_path_factory.mktemp("past2gib")
    vocab = (1 << 23) + (1 << 16)
    art = _random_export(root / "ckpt", root / "fp32", max_context=160, fused=True, vocab_size=vocab, hidden_size=64,
                         intermediate_size=128, num_hidden_layers=2, tie_word_embeddings=True)
    assert (art / "target.onnx.data").stat().st_size > 2**31
    yield root
    import shutil

    shutil.rmtree(root, ignore_errors=True)


def test_int4_build_past_2gib_runs_and_tracks_its_reference(past_2gib):
    """The INT4 build of a model past protobuf's 2 GiB: complete artifact, its logits close to the fp32 export's (eval,
    both run a segment at a time), and speculative greedy decoding identical to plain greedy on it (`verify`)."""
    from speccompile.evaluation import EvalOptions, evaluate

    art, built = past_2gib / "fp32", past_2gib / "int4"
    result = run_cli("build", str(art), "--out", str(built), "--int4", "--onnx-only", "--calib-samples", "2",
                     "--calib-max-tokens", "32")
    assert result.returncode == 0, result.stderr[-2000:]
    manifest = read_manifest(built, verify_files=True)
    # every weight MatMul of the 2 layers (q/k/v, o, gate/up, down), the tied table kept apart by the default excludes
    assert manifest.precision["target"]["quantized_matmuls"] == 8 and (built / "target.onnx.data").stat().st_size > 2**31
    packed = [g for g in manifest.graphs.values()
              if g.extra.get("variant_of") == "target.onnx" and "ort-cpu" in g.extra.get("backends", ())]
    assert [g.extra["quantization"] for g in packed] == ["int4"]  # the fused CPU graph, weights packed (MatMulNBits)
    assert packed[0].extra["cpu_kernels"], packed[0].extra
    text = past_2gib / "text.txt"
    text.write_text("the cat sat on the mat")  # every position's logits span 8.45M tokens: a short text
    report = evaluate(built, art, EvalOptions(text=text))
    # a random model's logits over 8.45M tokens are nearly tied: KL is the measure, top-1 a loose sanity bound
    assert report["kl_divergence"] < 0.01 and report["top1_agreement"] >= 0.75, report
    result = run_cli("verify", str(built), "--max-tokens", "8", "--limit", "1", "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout)["identical"] is True


@pytest.mark.parametrize("flags,options", [
    (["--int4", "--no-awq", "--no-clip-search", "--no-gptq"], dict(precision="int4")),
    (["--int8", "--quantize-lm-head"], dict(precision="int8", quantize_tables=True, exclude=())),
    (["--fp8", "--weight-only", "--no-gptq"], dict(precision="fp8", weight_only=True)),
    (["--fp4", "--weight-only", "--no-awq", "--no-clip-search", "--no-gptq"], dict(precision="nvfp4", weight_only=True)),
])
def test_build_output_estimate_bounds_what_is_written(tmp_path, flags, options):
    """The disk estimate `build` checks before any work (engines/output_size.py) is at least what the build writes
    and not far above it, per scheme (its margin for graphs and small files aside)."""
    from speccompile.engines.output_size import MARGIN, estimate_build_bytes

    art = _random_export(tmp_path / "m", tmp_path / "a", fused=True, num_hidden_layers=2, vocab_size=2048, hidden_size=256,
                         intermediate_size=1024)
    out = tmp_path / "b"
    result = run_cli("build", str(art), "--out", str(out), "--onnx-only", *flags)
    assert result.returncode == 0, result.stderr[-2000:]
    written = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    estimate = estimate_build_bytes(art, read_manifest(art), BuildOptions(onnx_only=True, **options), packs_cpu_graph=True)
    assert written <= estimate and estimate - MARGIN <= 1.3 * written, (flags, written, estimate - MARGIN)


def test_build_without_room_for_its_output_is_refused_before_any_work(tmp_path, capsys, monkeypatch, tiny_artifact):
    from conftest import assert_refused_for_disk_space

    assert_refused_for_disk_space(capsys, monkeypatch, tmp_path / "built", "build", str(tiny_artifact), "--int4", "--onnx-only")
