"""GPTQ error compensation (engines/gptq.py) on small synthetic layers."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from speccompile.engines.calibrate import ActivationStats
from speccompile.engines.gptq import gptq_rows, gptq_weight, hessian, inverse_hessian_factor
from speccompile.engines.method_search import awq_search, weight_fake_quant
from speccompile.engines.methods import MethodOptions, apply_methods
from speccompile.engines.qdq_targets import QuantOptions
from speccompile.engines.quantize import quantize_model

K, N, T = 128, 48, 384


def _correlated_rows(rng, t: int = T, k: int = K) -> np.ndarray:
    """Activations that live near a 16-dimensional subspace (as LLM hidden states do), a few outlier channels."""
    x = rng.standard_normal((t, 16)) @ rng.standard_normal((16, k)) + 0.05 * rng.standard_normal((t, k))
    x[:, [5, k - 7]] *= 8.0
    return x.astype(np.float32)


class _Identity:
    group = 16

    def start(self, index, rows):
        pass

    def use(self, index):
        pass

    def round(self, row):
        return row.astype(np.float32)

    def grid(self):
        return None


def test_identity_quantizer_leaves_the_layer_unchanged():
    rng = np.random.default_rng(0)
    x, w = _correlated_rows(rng), rng.standard_normal((K, N)).astype(np.float32)
    out = gptq_rows(w, inverse_hessian_factor(hessian(x), 0.01), _Identity())
    np.testing.assert_array_equal(out, w)


def test_inverse_hessian_factor_is_the_upper_cholesky_of_the_damped_inverse():
    rng = np.random.default_rng(1)
    x = _correlated_rows(rng, t=64, k=32)  # fewer rows than a full-rank H needs: damping makes it invertible
    u = inverse_hessian_factor(hessian(x), damp=0.01).astype(np.float64)
    h = x.T.astype(np.float64) @ x / len(x)
    h += 0.01 * np.mean(np.diag(h)) * np.eye(32)
    assert np.allclose(np.tril(u, -1), 0)
    np.testing.assert_allclose(u.T @ u, np.linalg.inv(h), rtol=1e-3, atol=1e-3 * np.abs(np.linalg.inv(h)).max())


@pytest.mark.parametrize("act_order", [False, True], ids=["in-order", "act-order"])
@pytest.mark.parametrize("scheme,block", [("int4", 32), ("nvfp4", 16), ("fp8", 0)])
def test_gptq_output_error_below_rtn_and_awq_on_correlated_inputs(scheme, block, act_order):
    rng = np.random.default_rng(2)
    x, w = _correlated_rows(rng), rng.standard_normal((K, N)).astype(np.float32)
    options = QuantOptions(scheme, exclude=(), int4_block=block)

    def error(quantized: np.ndarray, xs: np.ndarray = x) -> float:
        return float(np.square(xs @ w - xs @ quantized).sum())

    rtn = error(weight_fake_quant(w, options))
    quantized, grid = gptq_weight(w, x, scheme, block, damp=0.01, act_order=act_order)
    assert error(quantized) < 0.5 * rtn
    # AWQ on the same rows (weight-side error, activations unquantized for the comparison)
    stats = ActivationStats(np.abs(x).max(axis=0), x)
    s, _alpha, _ratio = awq_search(stats, [w], options, T)
    awq = error(weight_fake_quant(w * s[:, None], options) / s[:, None])
    assert error(quantized) < awq
    # the grid reproduces GPTQ's weight exactly when the Q/DQ pass re-quantizes it (act order too: its groups
    # are still the contiguous blocks along K, their scales fixed from the original rows)
    np.testing.assert_array_equal(weight_fake_quant(quantized, options, grid=grid), quantized)
    # held-out rows from the same distribution: the compensation generalizes
    held_out = _correlated_rows(np.random.default_rng(2), t=T)  # same subspace (same seed), new noise below
    held_out += 0.05 * np.random.default_rng(3).standard_normal(held_out.shape).astype(np.float32)
    assert error(quantized, held_out) < error(weight_fake_quant(w, options), held_out)


@pytest.mark.parametrize("scheme", ["int4", "nvfp4", "fp8"])
def test_gptq_in_the_pass_stores_its_grid_and_keeps_fp32_weights_for_unquantized_ones(scheme):
    from onnx.reference import ReferenceEvaluator

    from speccompile.engines.quantize import trt_fp4_dynamic_quantize_reference
    from test_quant_methods import _block_model, _stats

    rng = np.random.default_rng(4)
    model = _block_model(rng)
    x = 0.1 * _correlated_rows(rng, t=48, k=64)
    original = {i.name: numpy_helper.to_array(i).copy() for i in model.graph.initializer}
    options = QuantOptions(scheme, exclude=(), int4_block=32)
    report = apply_methods(model, options, _stats(model, x), MethodOptions(awq=False, clip=False, gptq=True))
    assert set(report.weight_grid) == {"mlp.weight_t", "mlp.down_proj.weight_t", "out.weight_t"}
    assert report.summary()["gptq"]["error_vs_without_mean"] < 1.0
    for name, value in original.items():  # the graph's weights are untouched (what stays unquantized stays fp32)
        np.testing.assert_array_equal(numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == name)), value)
    quantize_model(model, options, report.act_amax or None, report.weight_clip, report.weight_grid)
    onnx.checker.check_model(model, full_check=True)
    # the stored weight, dequantized by the graph, is GPTQ's weight exactly
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    weight_read = next(n for n in probe.graph.node if n.name == "out").input[1]  # DequantizeLinear (int4) / Transpose (nvfp4)
    probe.graph.output.append(onnx.helper.make_tensor_value_info(weight_read, onnx.TensorProto.FLOAT, None))
    got = ReferenceEvaluator(probe, new_ops=[trt_fp4_dynamic_quantize_reference()]).run([weight_read], {"x": x})[0]
    np.testing.assert_array_equal(got, report.weight_grid["out.weight_t"].weight)


def test_act_order_quantizes_the_heaviest_channels_first_with_static_groups():
    """Activation order visits the rows by decreasing H diagonal, each rounded on its own group's scale, and
    those scales are the round-to-nearest scales of the original blocks."""
    rng = np.random.default_rng(5)
    x, w = _correlated_rows(rng), rng.standard_normal((K, N)).astype(np.float32)
    seen: list[int] = []

    class Spy:
        group = 32

        def __init__(self):
            self.current = None
            self.started = []

        def start(self, index, rows):
            self.started.append(index)

        def use(self, index):
            self.current = index
            seen.append(index)

        def round(self, row):
            return row.astype(np.float32)

        def grid(self):
            from speccompile.engines.gptq import GridScales

            return GridScales(np.zeros(1))

    import speccompile.engines.gptq as gptq

    spy = Spy()
    original = gptq.Int4Rows
    gptq.Int4Rows = lambda k, n, block, clip: spy  # noqa: E731 - the quantizer the weight would get
    try:
        quantized, _grid = gptq_weight(w, x, "int4", 32, damp=0.01, act_order=True)
    finally:
        gptq.Int4Rows = original
    order = np.argsort(-np.diag(hessian(x)), kind="stable")
    assert spy.started == [0, 1, 2, 3]  # every group's scale first, from the original rows
    assert seen == (order // 32).tolist() and order[0] in (5, K - 7)  # an outlier channel comes first
    np.testing.assert_array_equal(quantized, w)  # an exact quantizer: nothing to compensate, rows back in place
    _q, grid = gptq_weight(w, x, "int4", 32, damp=0.01, act_order=True)
    np.testing.assert_array_equal(grid.scale, np.abs(w).reshape(K // 32, 32, N).max(axis=1) / 7)


def test_gptq_and_headroom_options_are_validated():
    from speccompile.errors import InputError

    for bad in (MethodOptions(gptq_damp=0.0), MethodOptions(gptq_damp=20.0), MethodOptions(act_headroom=0.5)):
        with pytest.raises(InputError):
            bad.validate()
    assert MethodOptions().damp("int4") > MethodOptions().damp("fp8")
    assert MethodOptions(gptq=False).uses_gptq("int4") is False and MethodOptions(gptq=True).uses_gptq("nvfp4") is True
