"""Quantization methods (engines/methods.py): exact input-scale folding, AWQ / clipping / SmoothQuant / FP8 ranges."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from speccompile.engines import numerics as nx
from speccompile.engines.calibrate import ActivationStats
from speccompile.accel.compat import check_tensorrt_compat
from speccompile.engines.method_search import (
    awq_search,
    clip_search,
    fp8_range,
    nvfp4_fake_quantizer,
    product_error,
    smoothquant_scale,
    weight_fake_quant,
)
from speccompile.engines.methods import MethodOptions, apply_methods
from speccompile.engines.qdq_targets import QuantOptions
from speccompile.engines.quantize import quantize_model

K, I, T = 64, 96, 48


def _outlier_rows(rng, t: int = T, k: int = K) -> np.ndarray:
    x = rng.standard_normal((t, k)).astype(np.float32)
    x[:, [3, 17, 40]] *= 40.0  # a few outlier channels, as in LLM activations
    return x


def _block_model(rng) -> onnx.ModelProto:
    """RMSNorm-style Mul(x, gamma) -> gated MLP (MatMul, Split, SiLU * up, down) -> Relu -> MatMul."""
    w = {
        "gamma": (1.0 + rng.random(K)).astype(np.float32),
        "mlp.weight_t": rng.standard_normal((K, 2 * I)).astype(np.float32) * 0.2,
        "mlp.down_proj.weight_t": rng.standard_normal((I, K)).astype(np.float32) * 0.2,
        "out.weight_t": rng.standard_normal((K, K)).astype(np.float32) * 0.2,
        "sizes": np.array([I, I], np.int64),
    }
    n = helper.make_node
    nodes = [
        n("Mul", ["x", "gamma"], ["a"], name="norm"),
        n("MatMul", ["a", "mlp.weight_t"], ["gu"], name="gate_up"),
        n("Split", ["gu", "sizes"], ["g", "u"], name="split", axis=-1),
        n("Sigmoid", ["g"], ["sg"], name="sigmoid"),
        n("Mul", ["g", "sg"], ["silu"], name="silu"),
        n("Mul", ["silu", "u"], ["d"], name="gated"),
        n("MatMul", ["d", "mlp.down_proj.weight_t"], ["o"], name="down"),
        n("Relu", ["o"], ["r"], name="relu"),
        n("MatMul", ["r", "out.weight_t"], ["y"], name="out"),
    ]
    graph = helper.make_graph(nodes, "block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [T, K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [T, K])],
                              [numpy_helper.from_array(v, k) for k, v in w.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return model


def _run(model: onnx.ModelProto, x: np.ndarray, names=("y",)) -> list[np.ndarray]:
    import onnxruntime as ort

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    for name in names:
        if name not in [o.name for o in probe.graph.output]:
            probe.graph.output.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, None))
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(probe.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(list(names), {"x": x})


def _stats(model, x) -> dict[str, ActivationStats]:
    names = ("a", "d", "r")
    values = _run(model, x, names)
    return {n: ActivationStats(np.abs(v).max(axis=0), v) for n, v in zip(names, values)}


@pytest.mark.parametrize("scheme,methods", [
    ("int4", MethodOptions(awq=True, clip=False)),
    ("nvfp4", MethodOptions(awq=True, clip=False)),
    ("fp8", MethodOptions(smoothquant=0.5, awq=False, clip=False)),
])
def test_input_scales_leave_the_fp32_block_unchanged(scheme, methods):
    rng = np.random.default_rng(0)
    model = _block_model(rng)
    x = _outlier_rows(rng)
    before = _run(model, x)[0]
    report = apply_methods(model, QuantOptions(scheme, exclude=(), int4_block=32), _stats(model, x), methods)
    onnx.checker.check_model(model, full_check=True)
    folds = {info["folded"] for info in report.input_scales.values()}
    if scheme == "fp8":  # SmoothQuant scales every activation: all three ways of placing 1/s are used
        assert folds == {"norm weight", "previous matmul", "mul"}
    assert report.input_scales, "the search chose no scale on outlier-heavy activations"
    after = _run(model, x)[0]
    np.testing.assert_allclose(after, before, rtol=1e-4, atol=1e-4 * np.abs(before).max())
    # and the quantized graph built from it is TensorRT-compatible (the inserted Mul included)
    quantize_model(model, QuantOptions(scheme, exclude=(), int4_block=32), report.act_amax or None, report.weight_clip)
    assert check_tensorrt_compat(model).ok


@pytest.mark.parametrize("scheme", ["int4", "nvfp4"])
def test_awq_and_clipping_beat_round_to_nearest_on_outlier_activations(scheme):
    rng = np.random.default_rng(1)
    x = _outlier_rows(rng, t=128)
    w = rng.standard_normal((K, 80)).astype(np.float32)
    options = QuantOptions(scheme, exclude=(), int4_block=32)
    stats = ActivationStats(np.abs(x).max(axis=0), x)
    amax = stats.amax
    rtn = product_error(x, [w], np.ones(K, np.float32), options, amax)
    scale, alpha, ratio = awq_search(stats, [w], options, rows=128)
    awq = product_error(x, [w], scale, options, float((stats.channel_amax / scale).max()))
    assert alpha > 0 and awq < 0.8 * rtn and ratio == pytest.approx(awq / rtn, rel=1e-6)
    # clipping: smaller second-moment-weighted weight error than the full range
    h = np.square(x).mean(axis=0)
    clip = clip_search(w, h, options)
    assert clip.min() < 1.0
    full = (np.square(w - weight_fake_quant(w, options)) * h[:, None]).sum()
    clipped = (np.square(w - weight_fake_quant(w, options, clip)) * h[:, None]).sum()
    assert clipped < full


def test_nvfp4_range_search_also_widens_blocks(monkeypatch):
    """NVFP4's block-range search takes ratios above 1 too (a block's largest value on a lower E2M1 level): on
    weights that sit on an evenly spaced 4-bit grid (what a GGUF Q4 source holds) some blocks pick one, and the
    weighted error is below that of the search limited to clipping."""
    import speccompile.engines.method_search as methods

    rng = np.random.default_rng(3)
    w = (rng.integers(0, 16, (K, 80)) - 7.5).astype(np.float32) * rng.uniform(0.01, 0.03, (1, 80)).astype(np.float32)
    h = rng.uniform(0.5, 2.0, K).astype(np.float32)
    options = QuantOptions("nvfp4", exclude=())

    def error(clip):
        return float((np.square(w - weight_fake_quant(w, options, clip)) * h[:, None]).sum())

    widened = clip_search(w, h, options)
    monkeypatch.setattr(methods, "NVFP4_RANGE_RATIOS", methods.CLIP_RATIOS)
    clipped = clip_search(w, h, options)
    assert widened.max() > 1.0 and clipped.max() <= 1.0
    assert error(widened) < 0.95 * error(clipped)


def test_smoothquant_reduces_fp8_error_on_extreme_outliers():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((128, K)).astype(np.float32) * 0.01
    x[:, 5] *= 1e5  # one channel five orders of magnitude above the rest: the others fall to fp8 subnormals
    w = rng.standard_normal((K, 48)).astype(np.float32)
    options = QuantOptions("fp8", exclude=())
    stats = ActivationStats(np.abs(x).max(axis=0), x)
    plain = product_error(x, [w], np.ones(K, np.float32), options, stats.amax)
    s = smoothquant_scale(stats, [w], 0.5)
    smooth = product_error(x, [w], s, options, float((stats.channel_amax / s).max()))
    assert smooth < 0.5 * plain


def test_fp8_range_mse_and_percentile_not_above_max():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((256, K)).astype(np.float32)
    x[0, 0] = 500.0  # one extreme value
    amax = float(np.abs(x).max())
    mse = fp8_range(x, amax, "mse")
    assert fp8_range(x, amax, "max") == amax and mse <= amax and fp8_range(x, amax, "percentile", 99.9) < amax
    err = {r: np.square(nx.fp8_fake_quant(x, nx.fp8_activation_scale(r)) - x).mean() for r in (amax, mse)}
    assert err[mse] <= err[amax]


def test_build_records_methods_on_tiny_model(tiny_artifact, tmp_path):
    from speccompile.engines.build import BuildOptions, build_artifact
    from speccompile.manifest import read_manifest

    out = tmp_path / "int4"
    build_artifact(tiny_artifact, out, BuildOptions(precision="int4", onnx_only=True, int4_block=32, calib_samples=3, calib_max_tokens=64))
    record = read_manifest(out).precision["target"]
    assert record["methods"]["input_scales"]["method"] == "awq"
    assert record["methods"]["clip_search"]["weights"] == record["quantized_matmuls"]
    assert record["methods"]["gptq"]["act_order"] is True and record["methods"]["gptq"]["damping"] == 3.0  # INT4 defaults
    assert read_manifest(out).precision["tensorrt_compat"]["target"]["ok"]


def test_min_top1_keeps_the_worst_weights_until_met(tiny_artifact, tmp_path):
    from speccompile.engines.build import BuildOptions, build_artifact
    from speccompile.manifest import read_manifest

    out = tmp_path / "int4-min"
    build_artifact(tiny_artifact, out, BuildOptions(precision="int4", onnx_only=True, int4_block=32, calib_samples=3,
                                                    calib_max_tokens=64, min_top1=0.9))
    record = read_manifest(out).precision["target"]
    sensitivity = record["methods"]["sensitivity"]
    assert sensitivity["calibration_top1"] >= 0.9
    assert sensitivity["measured"]["0"] < 0.9 or sensitivity["kept"] == []
    kept = set(sensitivity["kept"])
    model = onnx.load(str(out / "target.onnx"), load_external_data=False)
    float_weights = {i.name for i in model.graph.initializer if i.data_type == TensorProto.FLOAT}
    assert kept <= float_weights  # kept weights stay fp32 initializers
    assert record["quantized_matmuls"] + len(kept) == 8  # 2 layers x 4 weight MatMuls (lm_head excluded)
    assert sensitivity["kept_fp32_mb"] > 0 or not kept
    assert sensitivity["check_samples"] == 1 and record["calibration"]["samples"] == 2  # 3 samples: 2 fit, 1 checks


def test_min_top1_checks_on_samples_the_methods_did_not_fit():
    from speccompile.engines.quantize_graph import split_check_samples

    samples = [[i] for i in range(9)]
    fit, check = split_check_samples(samples)
    assert check == [[1], [5]] and fit == [[0], [2], [3], [4], [6], [7], [8]]
    assert split_check_samples([[1, 2]]) == ([[1, 2]], [[1, 2]])  # one sample: both (the manifest says 1 check sample)


def test_min_top1_out_of_range_is_an_input_error(tiny_artifact, tmp_path):
    from conftest import run_cli

    result = run_cli("build", str(tiny_artifact), "--int4", "--onnx-only", "--out", str(tmp_path / "x"), "--min-top1", "1.5")
    assert result.returncode == 2 and "--min-top1" in result.stderr and not (tmp_path / "x").exists()


@pytest.mark.parametrize("scheme", ["int4", "nvfp4", "fp8"])
def test_low_rank_branch_keeps_the_fp32_function_and_is_never_quantized(scheme):
    """`low_rank`: every quantized MatMul becomes x R + (x A) B; before rounding the block computes what it did,
    the float16 factors stay out of the Q/DQ pass, and the quantized graph is TensorRT-compatible."""
    from speccompile.engines.qdq_targets import LOW_RANK_SUFFIXES

    rng = np.random.default_rng(4)
    model = _block_model(rng)
    x = _outlier_rows(rng)
    before = _run(model, x)[0]
    options = QuantOptions(scheme, exclude=(), int4_block=32)
    report = apply_methods(model, options, _stats(model, x), MethodOptions(awq=False, clip=False, gptq=False, low_rank=8))
    onnx.checker.check_model(model, full_check=True)
    assert report.low_rank == {"mlp.weight_t": 8, "mlp.down_proj.weight_t": 8, "out.weight_t": 8}
    assert report.summary()["low_rank"]["mb"] >= 0
    np.testing.assert_allclose(_run(model, x)[0], before, rtol=1e-4, atol=1e-4 * np.abs(before).max())
    quantized = quantize_model(model, options, report.act_amax or None, report.weight_clip)
    assert sorted(quantized.quantized) == sorted(report.low_rank)
    factors = [i for i in model.graph.initializer if i.name.endswith(LOW_RANK_SUFFIXES)]
    assert len(factors) == 6 and all(f.data_type == TensorProto.FLOAT16 for f in factors)
    assert check_tensorrt_compat(model).ok


@pytest.mark.parametrize("scheme", ["int4", "nvfp4"])
def test_low_rank_branch_shrinks_the_error_of_a_weight_with_a_dominant_part(scheme):
    """A weight = a few large directions + small noise (an LLM weight's spread-out spectrum, exaggerated): with
    the large part in the branch, the 4-bit grid only has to cover the noise."""
    rng = np.random.default_rng(5)
    k, n, t = 64, 48, 256
    w = (rng.standard_normal((k, 3)) @ rng.standard_normal((3, n)) + 0.05 * rng.standard_normal((k, n))).astype(np.float32)
    x = rng.standard_normal((t, k)).astype(np.float32)
    n_ = helper.make_node
    graph = helper.make_graph([n_("MatMul", ["x", "w.weight_t"], ["y"], name="mm")], "one",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [t, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [t, n])],
                              [numpy_helper.from_array(w, "w.weight_t")])
    errors = {}
    for rank in (0, 3):
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
        model.ir_version = 10
        options = QuantOptions(scheme, exclude=(), int4_block=32)
        stats = {"x": ActivationStats(np.abs(x).max(axis=0), x)}
        report = apply_methods(model, options, stats, MethodOptions(awq=False, clip=False, gptq=False, low_rank=rank))
        quantize_model(model, options, report.act_amax or None, report.weight_clip)
        if scheme == "nvfp4":  # ONNX Runtime has no FP4 kernels: the exact fp32 emulation `eval` runs
            from speccompile.engines.emulate import emulate_nvfp4
            emulate_nvfp4(model)
        errors[rank] = float(np.square(_run(model, x)[0] - x @ w).mean())
    assert errors[3] < 0.2 * errors[0]


def test_build_low_rank_through_the_cli(tiny_artifact, tmp_path):
    """`build --int4 --low-rank 4`: the manifest records the branches, the graph runs in ONNX Runtime (greedy
    `run` works); a negative rank is refused with exit 2 and nothing written."""
    import json

    from conftest import run_cli

    out = tmp_path / "lr"
    result = run_cli("build", str(tiny_artifact), "--int4", "--onnx-only", "--int4-block", "32", "--low-rank", "4",
                     "--calib-samples", "3", "--out", str(out), "--json")
    assert result.returncode == 0, result.stderr
    record = json.loads((out / "manifest.json").read_text())["precision"]["target"]
    assert record["methods"]["low_rank"]["weights"] == record["quantized_matmuls"] and record["methods"]["low_rank"]["ranks"] == [4]
    ran = run_cli("run", str(out), "--prompt", "hello", "--max-tokens", "4", "--raw", "--threads", "1")
    assert ran.returncode == 0, ran.stderr
    bad = run_cli("build", str(tiny_artifact), "--int4", "--onnx-only", "--out", str(tmp_path / "x"), "--low-rank", "-1")
    assert bad.returncode == 2 and "--low-rank" in bad.stderr and not (tmp_path / "x").exists()


@pytest.mark.parametrize("scheme", ["fp8", "nvfp4"])
def test_weight_only_quantizes_the_weights_and_no_activation(scheme):
    """`weight_only`: every quantized MatMul reads DQ(weight) and its unquantized input, so the graph computes
    x W_q exactly (no activation rounding), passes the TensorRT check, and on outlier activations errs less
    than the same scheme with its activation quantization."""
    rng = np.random.default_rng(5)
    x = _outlier_rows(rng)
    errors = {}
    for weight_only in (False, True):
        model = _block_model(np.random.default_rng(0))
        reference = _run(model, x, ("a", "d", "r", "y"))
        options = QuantOptions(scheme, exclude=(), weight_only=weight_only)
        amax = None if weight_only else {name: float(np.abs(v).max()) for name, v in zip(("a", "d", "r"), reference)}
        inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
        report = quantize_model(model, options, amax)
        assert len(report.quantized) == 3
        assert check_tensorrt_compat(model).ok
        ops = [n.op_type for n in model.graph.node]
        if weight_only:
            assert "QuantizeLinear" not in ops and "TRT_FP4DynamicQuantize" not in ops and not report.activations
            # the last MatMul's input is the fp32 Relu output; its weight the scheme's rounding of W
            out = _run(_emulated(model) if scheme == "nvfp4" else model, x, ("r", "y"))
            expected = out[0] @ weight_fake_quant(inits["out.weight_t"], options)
            np.testing.assert_allclose(out[1], expected, rtol=1e-4, atol=1e-4)
        model = _emulated(model) if scheme == "nvfp4" else model
        errors[weight_only] = float(np.square(_run(model, x)[0] - reference[3]).mean())
    assert errors[True] < errors[False]


def _emulated(model: onnx.ModelProto) -> onnx.ModelProto:
    from speccompile.engines.emulate import emulate_nvfp4

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    emulate_nvfp4(copy)
    return copy


def test_build_weight_only_through_the_cli(tiny_artifact, tmp_path):
    """`build --fp8 --weight-only`: FP8 weights, no activation Q/DQ, recorded in the manifest, runs in ONNX Runtime;
    the flag without --fp8/--fp4, or with SmoothQuant (an activation method), is exit 2 with nothing written."""
    import json

    from conftest import run_cli

    out = tmp_path / "wo"
    result = run_cli("build", str(tiny_artifact), "--fp8", "--weight-only", "--onnx-only", "--calib-samples", "3", "--out", str(out))
    assert result.returncode == 0, result.stderr
    record = json.loads((out / "manifest.json").read_text())["precision"]["target"]
    assert record["weight_only"] is True and record["activation_tensors"] == 0 and record["quantized_matmuls"] == 8
    assert record["methods"]["gptq"]["damping"] == 0.1  # FP8's GPTQ still ran on the calibration rows
    model = onnx.load(str(out / "target.onnx"), load_external_data=False)
    assert not [n for n in model.graph.node if n.op_type == "QuantizeLinear"]
    assert sum(i.data_type == TensorProto.FLOAT8E4M3FN for i in model.graph.initializer) == 8
    ran = run_cli("run", str(out), "--prompt", "hello", "--max-tokens", "4", "--raw", "--threads", "1")
    assert ran.returncode == 0, ran.stderr
    for flags, named in ((["--no-quantize", "--weight-only"], "--weight-only"), (["--fp8", "--weight-only", "--smoothquant", "0.5"], "--smoothquant")):
        bad = run_cli("build", str(tiny_artifact), *flags, "--onnx-only", "--out", str(tmp_path / "x"))
        assert bad.returncode == 2 and named in bad.stderr and "Traceback" not in bad.stderr and not (tmp_path / "x").exists()


def test_weight_only_nvfp4_defaults_to_gptq_in_activation_order(tiny_artifact, tmp_path):
    """A weight-only NVFP4 build has its own method defaults (GPTQ in activation order, as INT4), which the
    manifest records; full NVFP4 keeps GPTQ off, and INT4 (weight-only anyway) keeps its own."""
    from speccompile.engines.build import BuildOptions, build_artifact
    from speccompile.manifest import read_manifest

    methods = MethodOptions()
    full, weight_only = QuantOptions("nvfp4"), QuantOptions("nvfp4", weight_only=True)
    assert not methods.uses_gptq(full.defaults_key)
    assert methods.uses_gptq(weight_only.defaults_key) and methods.act_order(weight_only.defaults_key)
    assert QuantOptions("int4", weight_only=True).defaults_key == "int4"
    out = tmp_path / "fp4wo"
    build_artifact(tiny_artifact, out, BuildOptions(precision="nvfp4", onnx_only=True, calib_samples=3, calib_max_tokens=64, weight_only=True))
    record = read_manifest(out).precision["target"]
    assert record["weight_only"] is True and record["activation_tensors"] == 0
    assert record["methods"]["gptq"]["act_order"] is True and record["methods"]["gptq"]["damping"] == 3.0
    model = onnx.load(str(out / "target.onnx"), load_external_data=False)
    assert not [n for n in model.graph.node if n.op_type == "TRT_FP4DynamicQuantize"]
    assert read_manifest(out).precision["tensorrt_compat"]["target"]["ok"]


def test_min_top1_can_keep_the_worst_weights_in_fp8(tiny_artifact, tmp_path):
    """`--keep-format fp8`: the weights --min-top1 keeps are stored FP8 weight-only (per channel) rather than fp32,
    the search measures them that way, and the manifest records the format and its size; the flag alone is exit 2."""
    from speccompile.engines.build import BuildOptions, build_artifact
    from speccompile.manifest import read_manifest

    from conftest import run_cli

    out = tmp_path / "int4-keep-fp8"
    build_artifact(tiny_artifact, out, BuildOptions(precision="int4", onnx_only=True, int4_block=32, calib_samples=3,
                                                    calib_max_tokens=64, min_top1=0.8, keep_format="fp8"))
    record = read_manifest(out).precision["target"]
    sensitivity = record["methods"]["sensitivity"]
    kept = set(sensitivity["kept"])
    assert kept and sensitivity["keep_format"] == "fp8" and sensitivity["calibration_top1"] >= 0.8
    assert sensitivity["kept_mb"] <= sensitivity["kept_fp32_mb"]  # a quarter, plus scales (tiny here: both round small)
    model = onnx.load(str(out / "target.onnx"), load_external_data=False)
    stored = {i.name: i.data_type for i in model.graph.initializer}
    assert not kept & set(stored)  # no kept weight left as a float initializer
    assert sum(t == TensorProto.FLOAT8E4M3FN for t in stored.values()) == len(kept)
    assert sum(t == TensorProto.INT4 for t in stored.values()) == record["quantized_matmuls"] == 8 - len(kept)
    bad = run_cli("build", str(tiny_artifact), "--int4", "--keep-format", "fp8", "--onnx-only", "--out", str(tmp_path / "x"))
    assert bad.returncode == 2 and "--min-top1" in bad.stderr and not (tmp_path / "x").exists()


def test_nvfp4_clip_search_quantizes_as_the_graph_will():
    """The clipping search's NVFP4 fake quantization (W^T, global scale and block amax computed once for every
    ratio) is `weight_fake_quant`'s, bit for bit, at every ratio."""
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((64, 24)) * rng.uniform(0.1, 3.0, (64, 1))).astype(np.float32)
    options = QuantOptions("nvfp4")
    at_ratios = nvfp4_fake_quantizer(w, options.fp4_block)
    for ratio in (1.0, 0.9, 0.55):
        clip = np.full((24, 64 // options.fp4_block), ratio, np.float32)
        np.testing.assert_array_equal(at_ratios(clip), weight_fake_quant(w, options, clip))
