"""`speccompile eval` and the NVFP4 emulation it runs on ONNX Runtime CPU."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import run_cli
from speccompile.engines import numerics as nx
from speccompile.engines.emulate import emulate_nvfp4, fake_quant_nvfp4_nodes
from speccompile.engines.quality import LogitComparison
from speccompile.evaluation import teacher_forced_logits
from speccompile.engines.qdq_targets import QuantOptions
from speccompile.engines.quantize import quantize_model, trt_fp4_dynamic_quantize_reference

TEXT = "The cat sat on the mat.\n\nA small boat drifted past the pier at noon.\n\nprint(sum(range(10)))\n"


def _ort(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(None, feeds)


def test_fake_quant_subgraph_bit_exact_with_numpy_nvfp4():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((3, 5, 64)) * 3).astype(np.float32)
    x[0, 0, :16] = 0.0  # an all-zero block
    x[1, 2, 16:32] = np.array([6, 5, 3.5, 2.5, 1.75, 1.25, 0.75, 0.25, -5, -3.5, -2.5, -0.25, 4, 3, 2, 1], np.float32)  # ties
    x[2, 4, 32:48] *= 1e4  # block scale saturating at 448
    gs = nx.nvfp4_global_scale(float(np.abs(x).max()) / 8)
    nodes, inits = fake_quant_nvfp4_nodes("x", "gs", "y", "fq")
    graph = helper.make_graph(nodes, "fq", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 5, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 5, 64])],
                              [*inits, numpy_helper.from_array(np.array(gs, np.float32), "gs")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    onnx.checker.check_model(model, full_check=True)
    codes, s8, s2 = nx.nvfp4_quantize(x, gs)
    expected = nx.nvfp4_dequantize(codes, s8, s2)
    np.testing.assert_array_equal(_ort(model, {"x": x})[0], expected)
    from onnx.reference import ReferenceEvaluator

    np.testing.assert_array_equal(ReferenceEvaluator(model).run(None, {"x": x})[0], expected)


def _two_layer_model(k: int = 64, n: int = 48) -> onnx.ModelProto:
    rng = np.random.default_rng(4)
    w1 = rng.standard_normal((k, n)).astype(np.float32)
    w2 = rng.standard_normal((n, 32)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "a.weight_t"], ["h"], name="a"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "b.weight_t"], ["y"], name="b")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 32])],
                              [numpy_helper.from_array(w1, "a.weight_t"), numpy_helper.from_array(w2, "b.weight_t")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return model


def test_emulated_nvfp4_graph_matches_reference_evaluator_of_the_fp4_graph():
    from onnx.reference import ReferenceEvaluator

    model = _two_layer_model()
    x = (np.random.default_rng(5).standard_normal((4, 64)) * 2).astype(np.float32)
    quantize_model(model, QuantOptions("nvfp4", exclude=()), {"x": float(np.abs(x).max()), "r": 40.0})
    truth = ReferenceEvaluator(model, new_ops=[trt_fp4_dynamic_quantize_reference()]).run(["y"], {"x": x})[0]
    count = emulate_nvfp4(model)
    assert count == 2
    ops = {(n.domain, n.op_type) for n in model.graph.node}
    assert not any(d == "trt" for d, _ in ops)
    assert all(i.data_type == TensorProto.FLOAT for i in model.graph.initializer if i.name.endswith("_dq"))
    got = _ort(model, {"x": x})[0]
    # same numbers; only the float32 summation order of the matrix products differs
    np.testing.assert_allclose(got, truth, rtol=1e-5, atol=1e-5 * np.abs(truth).max())


def test_logit_comparison_identical_and_different():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((10, 7))
    same = LogitComparison()
    same.add(a, a, np.arange(10) % 7)
    assert same.top1_agreement == 1.0 and abs(same.kl_divergence) < 1e-12
    assert same.perplexity("reference") == same.perplexity("quantized")
    other = LogitComparison()
    other.add(a, a[::-1], np.arange(10) % 7)
    assert other.top1_agreement < 1.0 and other.kl_divergence > 0


def test_top1_interval_resamples_whole_sequences():
    """The bootstrap interval contains the pooled agreement, is a point when every sequence agrees alike, widens
    when sequences disagree with each other, and is the same on every call (fixed seed)."""
    def comparison(rates: list[float], positions: int = 40) -> LogitComparison:
        c = LogitComparison()
        eye = np.eye(positions)
        for rate in rates:
            wrong = int(round(positions * (1 - rate)))
            quantized = eye.copy()
            quantized[:wrong] = np.roll(eye[:wrong], 1, axis=1)  # these positions pick another token
            c.add(eye, quantized)
        return c

    even = comparison([0.9] * 6)
    assert even.top1_agreement == 0.9 and even.top1_interval() == (0.9, 0.9)
    mixed = comparison([1.0, 0.6, 1.0, 0.7, 0.95, 0.85])
    low, high = mixed.top1_interval()
    assert low < mixed.top1_agreement < high and high - low > 0.05
    assert mixed.top1_interval() == (low, high)
    single = comparison([0.5])
    assert single.top1_interval() == (0.5, 0.5)


@pytest.fixture(scope="module")
def int4_tiny(tiny_artifact, tmp_path_factory):
    from speccompile.engines.build import BuildOptions, build_artifact

    out = tmp_path_factory.mktemp("evalq") / "int4"
    build_artifact(tiny_artifact, out, BuildOptions(precision="int4", onnx_only=True, int4_block=32))
    return out


@pytest.fixture()
def text_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(TEXT)
    return path


def _workload(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text(json.dumps({"id": "a", "prompt": "abc abc abc abc", "chat": False}) + "\n")
    return path


def test_eval_reference_against_itself(tiny_artifact, text_file, tmp_path):
    from speccompile.evaluation import EvalOptions, evaluate

    report = evaluate(tiny_artifact, tiny_artifact, EvalOptions(text=text_file, workloads=[_workload(tmp_path)], max_tokens=12))
    assert report["top1_agreement"] == 1.0
    assert abs(report["kl_divergence"]) < 1e-6
    assert report["perplexity"]["artifact"] == report["perplexity"]["reference"]
    assert report["text"]["sequences"] == 3
    (row,) = report["ngram"]
    assert row["identical_greedy"] == 1 and row["tokens_per_pass"]["artifact"] == row["tokens_per_pass"]["reference"]


def test_eval_cli_json_on_int4(tiny_artifact, int4_tiny, text_file, tmp_path):
    result = run_cli("eval", str(int4_tiny), "--reference", str(tiny_artifact), "--text", str(text_file),
                     "--workload", str(_workload(tmp_path)), "--max-tokens", "12", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert {"top1_agreement", "kl_divergence", "perplexity", "ngram", "size_mb", "scheme"} <= set(report)
    assert report["scheme"] == "int4"
    assert 0.0 <= report["top1_agreement"] < 1.0
    low, high = report["top1_interval_95"]
    assert low <= report["top1_agreement"] <= high
    assert 0.0 < report["kl_divergence"] < float("inf")
    assert report["size_mb"]["artifact"] < report["size_mb"]["reference"]
    table = run_cli("eval", str(int4_tiny), "--reference", str(tiny_artifact), "--text", str(text_file))
    assert table.returncode == 0 and "top-1 agreement" in table.stdout  # the report on stdout (`> report.txt`)
    assert "scored: target.ort.onnx" in table.stdout and "top-1 agreement" not in table.stderr


def test_eval_scores_the_graph_run_uses(tiny_artifact, int4_tiny, text_file):
    """An INT4 build runs as its packed CPU graph: eval scores that graph (the perplexity of its own logits, as the
    Runner's target session gives them) and says so; --contract-graph scores target.onnx instead."""
    from speccompile.evaluation import EvalOptions, evaluate, load_text_set
    from speccompile.runtime import Runner

    run = evaluate(int4_tiny, tiny_artifact, EvalOptions(text=text_file, threads=1))
    contract = evaluate(int4_tiny, tiny_artifact, EvalOptions(text=text_file, threads=1, contract_graph=True))
    assert run["graphs"]["artifact"] == {"file": "target.ort.onnx", "what": "the CPU graph `run` uses on ort-cpu"}
    assert contract["graphs"]["artifact"] == {"file": "target.onnx", "what": "the contract graph (--contract-graph)"}
    assert run["graphs"]["reference"]["file"] == "target.onnx"
    runner = Runner(int4_tiny, threads=1)
    assert runner.artifact.target.spec.file == "target.ort.onnx"
    comparison = LogitComparison()
    for paragraph in load_text_set(text_file)[1]:
        ids = runner.artifact.tokenizer.encode(paragraph)
        logits = teacher_forced_logits(runner.artifact.target, ids)
        comparison.add(logits, logits, np.asarray(ids))
    assert run["perplexity"]["artifact"] == round(comparison.perplexity("quantized"), 3)
    assert run["kl_divergence"] != contract["kl_divergence"]  # int8 activations in the packed graph: other logits


def test_eval_nvfp4_runs_through_the_emulation(tiny_artifact, text_file, tmp_path):
    from speccompile.engines.build import BuildOptions, build_artifact
    from speccompile.evaluation import EvalOptions, evaluate

    out = tmp_path / "nvfp4"
    build_artifact(tiny_artifact, out, BuildOptions(precision="nvfp4", onnx_only=True, calib_samples=2, calib_max_tokens=32))
    report = evaluate(out, tiny_artifact, EvalOptions(text=text_file))
    assert report["emulated"] and report["scheme"] == "nvfp4"
    assert 0.0 < report["top1_agreement"] <= 1.0 and np.isfinite(report["kl_divergence"])


def test_eval_bad_input_is_one_line_exit_2(tiny_artifact, tmp_path):
    missing = run_cli("eval", str(tiny_artifact), "--reference", str(tiny_artifact), "--text", str(tmp_path / "nope.txt"))
    assert missing.returncode == 2 and "--text" in missing.stderr and "Traceback" not in missing.stderr
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    result = run_cli("eval", str(tiny_artifact), "--reference", str(tiny_artifact), "--text", str(empty))
    assert result.returncode == 2 and "no text" in result.stderr


def test_held_out_text_is_scored_with_the_tokens_the_tokenizer_adds(tmp_path):
    """A tokenizer that adds BOS (Gemma's) has each scored paragraph start with it, as `run --raw` feeds a prompt;
    paragraphs are cut to the longest length and those of fewer than two tokens left out."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    from speccompile.evaluation import scored_sequences
    from speccompile.tokenizer import TextTokenizer

    vocab = {"<bos>": 0, "a": 1, "b": 2, "c": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 0)])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>"}))
    sequences = scored_sequences(TextTokenizer(tmp_path), ["a b c a b", "c", "b c"], 4)
    assert sequences == [[0, 1, 2, 3], [0, 3], [0, 2, 3]]


def test_peer_agreement_scores_the_text_as_eval_does(tmp_path):
    """benchmarks/peer_llamacpp.py --agreement hands every engine the held-out paragraphs as `eval` scores them
    (with the BOS a Gemma tokenizer adds; without it the agreement measured noise) and counts matching argmaxes."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    from conftest import load_benchmark
    from speccompile.tokenizer import TextTokenizer

    tok = Tokenizer(models.WordLevel({"<bos>": 0, "a": 1, "b": 2}, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 0)])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>"}))

    class Recorder:  # what the agreement hands an engine, and an argmax that is off at every 4th position
        def __init__(self, off: bool):
            self.off, self.seen = off, []

        def run(self, ids, max_tokens, mode):
            self.seen.append(list(ids))
            return {"argmax": [(i % 4 == 3 and self.off) + 1 for i in range(len(ids))]}

    workers = {"llama.cpp lookup": Recorder(True), "ours fp32": Recorder(False), "ours int4": Recorder(False)}
    result = load_benchmark("peer_llamacpp").agreement(workers, TextTokenizer(tmp_path))
    seen = workers["ours int4"].seen
    assert seen and all(ids[0] == 0 and len(ids) <= 256 for ids in seen) and seen == workers["llama.cpp lookup"].seen
    assert result["ours int4"] == 1.0 and 0.7 < result["llama.cpp"] < 0.8 and result["positions"] == sum(map(len, seen))
