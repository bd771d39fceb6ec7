"""Quantization-aware distillation (`build --qad-steps`): the torch twin of a graph, grid rounding, the build."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from speccompile.engines import numerics as nx
from speccompile.engines.calibrate import prefill_feeds
from speccompile.engines.qad import grid_steps, pack_rows, round_to_grid, weight_grid_for
from speccompile.engines.qdq_targets import QuantOptions
from speccompile.engines.torch_graph import TorchGraph
from speccompile.errors import SpecCompileError
from speccompile.manifest import read_manifest

from conftest import run_cli

CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA GPU"))


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_torch_graph_computes_what_onnxruntime_computes(tiny_artifact, device):
    """The exported contract graph run node by node in torch gives ONNX Runtime's logits (batch of two rows), on
    the CPU and on a CUDA GPU."""
    spec = read_manifest(tiny_artifact).graph("target")
    path = tiny_artifact / spec.file
    feeds = prefill_feeds(spec, np.random.default_rng(0).integers(3, 60, (2, 24)))
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(["logits"], feeds)[0]
    with torch.no_grad():
        got = TorchGraph(onnx.load(str(path)), device).run(feeds, ["logits"])["logits"].cpu().numpy()
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-4 * max(1.0, np.abs(want).max())


def test_torch_graph_refuses_an_operator_it_does_not_know():
    node = helper.make_node("Einsum", ["x", "x"], ["y"], equation="ij,ij->ij")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])])
    with pytest.raises(SpecCompileError, match="Einsum"):
        TorchGraph(helper.make_model(graph))


def _numpy_dequantized(w: np.ndarray, scheme: str, grid) -> np.ndarray:
    """What the Q/DQ pass stores for `w` on `grid`, dequantized by the numpy reference."""
    if scheme == "int4":
        block = w.shape[0] // grid.scale.shape[0]
        q, scale = nx.quantize_int4_blockwise(w, block, scale=grid.scale)
        return nx.dequantize_int4_blockwise(q, scale, block)
    if scheme == "fp8":
        q, scale = nx.quantize_fp8_per_channel(w, axis=1, scale=grid.scale)
        return q.astype(np.float32) * scale[None, :]
    codes, s_fp8, s2 = nx.nvfp4_quantize(w.T, grid.global_scale, block_scale=grid.scale)
    return nx.nvfp4_dequantize(codes, s_fp8, s2).T


@pytest.mark.parametrize("scheme", ["int4", "fp8", "nvfp4"])
def test_grid_rounding_in_torch_is_the_qdq_pass_rounding(scheme):
    """Training rounds `w / step` in torch; the build stores `code x step`, which the numpy Q/DQ pass must map back
    to the same code: both for the untrained weight (plain rounding) and for moved ones (anywhere on the grid)."""
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((128, 48)) * np.exp(rng.standard_normal((1, 48)))).astype(np.float32)
    qopts = QuantOptions(scheme, weight_only=True)
    grid = weight_grid_for(w, qopts, None)
    step = grid_steps(grid, w.shape, scheme)
    for moved in (w, w + (rng.standard_normal(w.shape) * step * 1.5).astype(np.float32)):
        stored = (round_to_grid(torch.from_numpy(moved / step), scheme) * torch.from_numpy(step)).numpy()
        assert np.array_equal(stored, _numpy_dequantized(moved, scheme, grid))
        assert np.array_equal(_numpy_dequantized(stored, scheme, grid), stored)  # on the grid: stored as it is


def test_pack_rows_cuts_the_samples_into_equal_rows():
    rows = pack_rows([[1, 2, 3], [4, 5], [6, 7, 8, 9]], 4)
    assert rows.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert pack_rows([[1, 2, 3]], 8).tolist() == [[1, 2, 3]]


def _kl_on_rows(artifact, reference, rows: np.ndarray) -> float:
    spec = read_manifest(reference).graph("target")
    opts = ort.SessionOptions()
    opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
    logits = [ort.InferenceSession(str(a / spec.file), opts, providers=["CPUExecutionProvider"]).run(["logits"], prefill_feeds(spec, rows))[0]
              for a in (reference, artifact)]
    logp = [torch.log_softmax(torch.from_numpy(x).double(), -1) for x in logits]
    return float((logp[0].exp() * (logp[0] - logp[1])).sum(-1).mean())


def test_qad_build_fits_the_quantized_graph_to_the_unquantized_one(tiny_artifact, tmp_path):
    """`build --int4 --qad-steps N`: the manifest records the training; the stored graph (ONNX Runtime) is closer
    to the unquantized one on the text it was trained on than the same build without QAD; the build runs."""
    from speccompile.engines.calibrate import BUILTIN_CALIBRATION, tokenize_calibration
    from speccompile.tokenizer import TextTokenizer

    common = ["--int4", "--int4-block", "32", "--onnx-only", "--calib-samples", "8", "--calib-max-tokens", "64", "--threads", "1",
              "--no-gptq", "--no-awq", "--no-clip-search"]
    plain, tuned = tmp_path / "plain", tmp_path / "qad"
    assert run_cli("build", str(tiny_artifact), *common, "--out", str(plain)).returncode == 0
    result = run_cli("build", str(tiny_artifact), *common, "--qad-steps", "40", "--qad-lr", "0.02", "--qad-data", "calib", "--out", str(tuned))
    assert result.returncode == 0, result.stderr
    record = json.loads((tuned / "manifest.json").read_text())["precision"]["target"]
    qad = record["methods"]["qad"]
    assert qad["steps"] == 40 and qad["data"] == "calib" and qad["weights"] == 8 and qad["float_parameters"] >= 1 and qad["codes_changed"] > 0
    assert qad["kl_last_10"] < qad["kl_first_10"]
    manifest = read_manifest(tiny_artifact)
    tokenizer = TextTokenizer(tiny_artifact, manifest.tokenizer.get("eos_token_ids"))
    rows = pack_rows(tokenize_calibration(list(BUILTIN_CALIBRATION), tokenizer, 8, 64), 64)
    before, after = _kl_on_rows(plain, tiny_artifact, rows), _kl_on_rows(tuned, tiny_artifact, rows)
    assert after < 0.5 * before, (before, after)
    ran = run_cli("run", str(tuned), "--prompt", "hello", "--max-tokens", "4", "--raw", "--threads", "1")
    assert ran.returncode == 0, ran.stderr


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_the_stored_graph_is_the_trained_student(tiny_artifact, device):
    """After `distill` (on the CPU or a CUDA GPU), the Q/DQ pass on the returned grids (+ the trained norm weight)
    gives a graph whose ONNX Runtime logits are the torch student's: training and storage agree on every code."""
    import copy

    from speccompile.engines.qad import QadOptions, batches, distill, free_parameters, store_free
    from speccompile.engines.qdq_targets import is_excluded, weight_matmuls
    from speccompile.engines.quantize import quantize_model

    spec = read_manifest(tiny_artifact).graph("target")
    model = onnx.load(str(tiny_artifact / spec.file))
    qopts = QuantOptions("int4", int4_block=32)
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    weights = {w: weight_grid_for(inits[w].astype(np.float32), qopts, None) for _, _, w in weight_matmuls(model) if not is_excluded(w, qopts.exclude)}
    rows = np.random.default_rng(2).integers(3, 90, (4, 32))
    feeds = [prefill_feeds(spec, b) for b in batches(rows, 2)]
    result = distill(model, "int4", weights, free_parameters(model, set(weights)), feeds, QadOptions(steps=12, lr=0.05, lr_free=0.01, device=device), 1, lambda _: None)
    assert result.summary["codes_changed"] > 0 and result.free
    assert (result.summary["device"] == "cpu") == (device == "cpu")
    replace = {w: torch.from_numpy(g.weight) for w, g in result.grids.items()} | {n: torch.from_numpy(v) for n, v in result.free.items()}
    with torch.no_grad():
        student = TorchGraph(model).run(feeds[0], ["logits"], replace)["logits"].numpy()
    stored = copy.deepcopy(model)
    store_free(stored, result.free)
    quantize_model(stored, qopts, None, None, result.grids)
    opts = ort.SessionOptions()
    opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
    got = ort.InferenceSession(stored.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(["logits"], feeds[0])[0]
    assert np.abs(got - student).max() <= 1e-4 * max(1.0, np.abs(student).max())


def test_generated_text_is_what_the_model_would_write(tiny_artifact):
    """`--qad-data generated` trains on continuations sampled from the unquantized graph: each row starts with its
    prompt, has the asked length, never an avoided id; with top-k 1 every token is the graph's argmax after the
    ones before it (checked in one prefill pass over the whole row)."""
    from speccompile.engines.calibrate import sample_continuations

    spec = read_manifest(tiny_artifact).graph("target")
    prompts = [[1, 10, 11, 12], [1, 20, 21]]
    rows = sample_continuations(tiny_artifact, spec, prompts, 3, 12, seed=0, avoid=[2, 5])
    assert len(rows) == 6 and all(r[:len(prompts[i // 3])] == prompts[i // 3] for i, r in enumerate(rows))
    assert all(len(r) == len(prompts[i // 3]) + 12 and not {2, 5} & set(r) for i, r in enumerate(rows))
    session = ort.InferenceSession(str(tiny_artifact / spec.file), providers=["CPUExecutionProvider"])
    for prompt in prompts:
        (row,) = sample_continuations(tiny_artifact, spec, [prompt], 1, 10, top_k=1)
        logits = session.run(["logits"], prefill_feeds(spec, row))[0][0]
        assert row[len(prompt):] == logits[len(prompt) - 1:-1].argmax(-1).tolist()


def test_qad_lr_zero_trains_only_the_float_parameters(tiny_artifact, tmp_path):
    """`--qad-lr 0`: the codes of every quantized weight stay those of the same build without QAD; the norm
    weight trains (on generated text, the default data)."""
    common = ["--int4", "--int4-block", "32", "--onnx-only", "--calib-samples", "4", "--calib-max-tokens", "32", "--threads", "1"]
    plain, tuned = tmp_path / "plain", tmp_path / "qad"
    assert run_cli("build", str(tiny_artifact), *common, "--out", str(plain)).returncode == 0
    result = run_cli("build", str(tiny_artifact), *common, "--qad-steps", "5", "--qad-lr", "0", "--qad-samples", "4",
                     "--qad-float-lr", "0.05", "--out", str(tuned))
    assert result.returncode == 0, result.stderr
    qad = json.loads((tuned / "manifest.json").read_text())["precision"]["target"]["methods"]["qad"]
    assert qad["data"] == "generated" and qad["codes_changed"] == 0
    graphs = [{i.name: onnx.numpy_helper.to_array(i) for i in onnx.load(str(d / "target.onnx")).graph.initializer} for d in (plain, tuned)]
    codes = [name for name, value in graphs[0].items() if value.dtype.name == "int4" or str(value.dtype) == "int4"]
    assert codes and all(np.array_equal(graphs[0][n], graphs[1][n]) for n in codes)
    norms = [name for name in graphs[0] if name.endswith("norm.weight")]
    assert norms and any(not np.array_equal(graphs[0][n], graphs[1][n]) for n in norms)


@pytest.mark.parametrize("flags, named", [
    (["--fp8", "--qad-steps", "5"], "--qad-steps"),  # FP8 with activations: not emulated
    (["--int4", "--qad-steps", "5", "--qad-lr", "2"], "--qad-lr"),
    (["--int4", "--qad-steps", "5", "--qad-lr", "0", "--qad-float-lr", "0"], "--qad-float-lr 0"),
    (["--fp4", "--qad-steps", "5", "--qad-data", "web"], "--qad-data"),
    (["--int4", "--qad-steps", "5", "--qad-device", "gpu"], "--qad-device"),
    (["--int4", "--qad-steps", "5", "--qad-device", "cpu:1"], "--qad-device"),
    pytest.param(["--int4", "--qad-steps", "5", "--qad-device", "cuda"], "sees no CUDA device",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="torch sees a CUDA GPU")),
])
def test_qad_flags_are_checked_before_any_work(tiny_artifact, tmp_path, flags, named):
    bad = run_cli("build", str(tiny_artifact), *flags, "--onnx-only", "--out", str(tmp_path / "x"))
    assert bad.returncode == 2 and named in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "x").exists()
