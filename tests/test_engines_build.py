"""`speccompile build`: CLI errors, --onnx-only artifacts, build config as data, compat checker, TensorRT paths."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import run_cli_here as _cli
from speccompile.accel import profiles as prof
from speccompile.accel.trt import check_engine_compat, import_tensorrt
from speccompile.engines import config as cfg
from speccompile.accel.compat import check_tensorrt_compat
from speccompile.errors import ArtifactError, HardwareError, InputError, UnsupportedError
from speccompile.manifest import GraphSpec, Manifest, TensorSpec, read_manifest

HAS_TRT = import_tensorrt() is not None
needs_trt = pytest.mark.skipif(not HAS_TRT, reason="TensorRT is not installed here (no GPU machine)")


# ---------------------------------------------------------------- CLI errors (one line, exit 2)

def test_precision_flags_are_exclusive(capsys, tiny_artifact, tmp_path):
    code, _, err = _cli(capsys, "build", str(tiny_artifact), "--out", str(tmp_path / "o"), "--fp4", "--int4", "--onnx-only")
    assert code == 2 and err.strip() == "error: --fp4 and --int4 are mutually exclusive: pick one precision"
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("content", [None, "", "   \n"])
def test_missing_or_empty_calibration_file(capsys, tiny_artifact, tmp_path, content):
    calib = tmp_path / "calib.txt"
    if content is not None:
        calib.write_text(content)
    code, _, err = _cli(capsys, "build", str(tiny_artifact), "--out", str(tmp_path / "o"), "--fp8", "--onnx-only", "--calib", str(calib))
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--calib" in err and ("no such file" in err if content is None else "empty" in err)


def test_calibration_jsonl_without_prompts(tiny_artifact, tmp_path):
    from speccompile.engines.calibrate import load_calibration_texts

    bad = tmp_path / "c.jsonl"
    bad.write_text('{"foo": 1}\n')
    with pytest.raises(InputError, match="line 1"):
        load_calibration_texts(bad)
    good = tmp_path / "ok.jsonl"
    good.write_text('{"prompt": "hello", "chat": true}\n\n{"text": "more"}\n')
    assert [t["prompt"] for t in load_calibration_texts(good)] == ["hello", "more"]


def test_manifest_without_limits(capsys, tiny_artifact, tmp_path):
    art = tmp_path / "nolimits"
    shutil.copytree(tiny_artifact, art)
    data = json.loads((art / "manifest.json").read_text())
    data["limits"] = {}
    (art / "manifest.json").write_text(json.dumps(data))
    code, _, err = _cli(capsys, "build", str(art), "--out", str(tmp_path / "o"), "--int4", "--onnx-only")
    assert code == 2 and "no usable limits" in err and len(err.strip().splitlines()) == 1


@pytest.mark.skipif(HAS_TRT, reason="TensorRT is installed: the missing-TensorRT message cannot be shown")
def test_no_tensorrt_without_onnx_only(capsys, tiny_artifact, tmp_path):
    code, _, err = _cli(capsys, "build", str(tiny_artifact), "--out", str(tmp_path / "o"), "--fp8")
    assert code == 2 and "TensorRT is not installed" in err and "--onnx-only" in err
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.tmp-*"))


def test_existing_output_needs_force(capsys, tiny_artifact, tmp_path):
    (tmp_path / "o").mkdir()
    code, _, err = _cli(capsys, "build", str(tiny_artifact), "--out", str(tmp_path / "o"), "--int4", "--onnx-only")
    assert code == 2 and "already exists" in err


# ---------------------------------------------------------------- --onnx-only output is a complete artifact

def test_onnx_only_int4_artifact_runs(capsys, tiny_artifact, tmp_path):
    out = tmp_path / "int4"
    code, _, err = _cli(capsys, "build", str(tiny_artifact), "--out", str(out), "--int4", "--int4-block", "64", "--onnx-only", "--json")
    assert code == 0, err
    manifest = read_manifest(out, verify_files=True)  # every file listed, sha256 ok
    assert {"target.onnx", "target.onnx.data", "tokenizer.json", "build_engines.sh"} <= set(manifest.files)
    assert manifest.engine is None and manifest.precision["target"]["scheme"] == "int4"
    assert manifest.graphs["target"].extra["quantization"] == "int4"
    src_size = (tiny_artifact / "target.onnx.data").stat().st_size
    assert (out / "target.onnx.data").stat().st_size < src_size
    script = (out / "build_engines.sh").read_text()
    assert "trtexec --onnx=target.onnx --saveEngine=target.plan" in script and "--maxShapes=" in script
    assert not list(tmp_path.glob(".int4.tmp-*"))
    code, stdout, err = _cli(capsys, "run", str(out), "--prompt", "abc abc abc", "--raw", "--max-tokens", "8", "--json")
    assert code == 0, err
    assert len(json.loads(stdout)["tokens"]) == 8
    # losslessness holds on the quantized target too (same backend: INT4 plain vs INT4 speculative)
    from speccompile.runtime.session import Runner

    runner = Runner(out, drafter="ngram", num_draft_tokens=6, adaptive=False, threads=1)
    for prompt in ("abc abc abc abc", "the cat sat on the mat. the cat sat on the"):
        plain = runner.generate(prompt, chat=False, max_tokens=40, drafter="none")
        assert runner.generate(prompt, chat=False, max_tokens=40).tokens == plain.tokens


# ---------------------------------------------------------------- build config as data

def _spec() -> GraphSpec:
    inputs = [
        TensorSpec("input_ids", "int64", ["batch", "q_len"]),
        TensorSpec("position_ids", "int64", ["batch", "q_len"]),
        TensorSpec("attention_mask", "bool", ["batch", "q_len", "total_len"]),
        TensorSpec("past_key_values.0.key", "float", ["batch", 3, "past_len", 64]),
    ]
    return GraphSpec("target", "target.onnx", inputs, [TensorSpec("logits", "float", ["batch", "q_len", 100])])


LIMITS = {"max_context": 2048, "max_verify_tokens": 64, "max_batch": 1}


def test_required_limits():
    m = Manifest(model={}, graphs={}, limits={"max_context": 100})
    with pytest.raises(ArtifactError, match="max_verify_tokens"):
        prof.required_limits(m)
    m.limits = dict(LIMITS)
    assert prof.required_limits(m) == LIMITS


def test_single_profile_from_limits():
    (p,) = prof.profiles_for(_spec(), LIMITS, "single", prefill_chunk=256)
    lo, opt, hi = p.shapes["input_ids"]
    assert lo == [1, 1] and opt == [1, 8] and hi == [1, 256]
    assert p.shapes["past_key_values.0.key"] == ([1, 3, 0, 64], [1, 3, 512, 64], [1, 3, 2047, 64])
    assert p.shapes["attention_mask"][2] == [1, 256, 2048]
    assert prof.select_profile([p], {"input_ids": (1, 9), "past_key_values.0.key": (1, 3, 100, 64)}) == 0
    with pytest.raises(InputError):
        prof.select_profile([p], {"input_ids": (1, 300)})


def test_split_profiles_verify_and_prefill():
    verify, prefill = prof.profiles_for(_spec(), LIMITS, "split", prefill_chunk=256, opt_q=16, opt_context=1000)
    assert verify.shapes["input_ids"] == ([1, 1], [1, 16], [1, 64])
    assert prefill.shapes["input_ids"] == ([1, 65], [1, 256], [1, 256])
    assert verify.shapes["past_key_values.0.key"][1] == [1, 3, 1000, 64]
    profiles = [verify, prefill]
    assert prof.select_profile(profiles, {"input_ids": (1, 9)}) == 0
    assert prof.select_profile(profiles, {"input_ids": (1, 200)}) == 1


def test_unknown_dynamic_axis_is_refused():
    spec = _spec()
    spec.inputs.append(TensorSpec("tree_mask", "bool", ["nodes", "nodes"]))
    with pytest.raises(UnsupportedError, match="nodes"):
        prof.profiles_for(spec, LIMITS)


def test_trt10_vs_trt11_flags():
    c10 = cfg.make_build_config("10.13.0.35", "fp8")
    assert c10.network_flags == ["STRONGLY_TYPED"] and c10.builder_flags == [] and c10.strongly_typed
    weak = cfg.make_build_config("10.13.0", "fp8", weakly_typed=True)
    assert weak.network_flags == [] and weak.builder_flags == ["FP16", "FP8"] and not weak.strongly_typed
    c11 = cfg.make_build_config("11.0.0", "nvfp4")
    assert c11.network_flags == [] and c11.builder_flags == [] and c11.strongly_typed
    with pytest.raises(UnsupportedError, match="always strongly typed"):
        cfg.make_build_config("11.1", "fp8", weakly_typed=True)
    with pytest.raises(UnsupportedError, match="10.8"):
        cfg.make_build_config("10.7.0", "nvfp4")
    with pytest.raises(UnsupportedError):
        cfg.make_build_config("8.6.1")


@pytest.mark.parametrize(
    "precision,cc,ok",
    [
        ("fp8", (8, 0), False), ("fp8", (8, 6), False), ("fp8", (8, 7), False), ("fp8", (8, 9), True),
        ("fp8", (9, 0), True), ("fp8", (12, 0), True),
        ("nvfp4", (9, 0), False), ("nvfp4", (8, 9), False), ("nvfp4", (10, 0), True), ("nvfp4", (10, 3), True),
        ("nvfp4", (12, 0), True), ("nvfp4", (12, 1), True), ("nvfp4", (11, 0), True),
        ("int4", (7, 5), False), ("int4", (8, 0), True), ("none", (7, 5), True), ("none", (7, 0), False),
    ],
)
def test_hardware_refusal_table(precision, cc, ok):
    if ok:
        cfg.check_hardware(precision, cc, "GPU")
    else:
        with pytest.raises(HardwareError) as info:
            cfg.check_hardware(precision, cc, "GPU")
        assert f"SM {cc[0]}.{cc[1]}" in str(info.value) and "\n" not in str(info.value)


def test_engine_section_and_mismatch_check():
    config = cfg.make_build_config("10.13.0.35", "fp8")
    profiles = {"target": prof.profiles_for(_spec(), LIMITS)}
    engine = cfg.engine_section("10.13.0.35", "NVIDIA H100", (9, 0), {"target": "target.plan"}, config, profiles)
    json.dumps(engine)  # manifest-serialisable
    check_engine_compat(engine, "10.13.0.35", (9, 0), "NVIDIA H100")
    check_engine_compat(engine, "10.13.0", (9, 0))  # build number is not part of compatibility
    with pytest.raises(HardwareError, match="TensorRT 10.13.0.35 but TensorRT 10.14.1"):
        check_engine_compat(engine, "10.14.1", (9, 0))
    with pytest.raises(HardwareError, match="rebuild on this machine"):
        check_engine_compat(engine, "10.13.0.35", (8, 9), "NVIDIA L40S")
    with pytest.raises(ArtifactError):
        check_engine_compat(None, "10.13.0", (9, 0))


def test_trtexec_command_lines():
    profiles = prof.profiles_for(_spec(), LIMITS, "split")
    cmd10 = cfg.trtexec_command("target.onnx", "target.plan", profiles, 10, "fp8", workspace_mb=4096)
    assert "--stronglyTyped" in cmd10 and cmd10.count("--minShapes=") == 2 and "--memPoolSize=workspace:4096M" in cmd10
    assert "past_key_values.0.key:1x3x0x64" in cmd10 and "--fp8" not in cmd10
    cmd11 = cfg.trtexec_command("target.onnx", "target.plan", profiles, 11, "fp8")
    assert "--stronglyTyped" not in cmd11 and "--timingCacheFile=timing.cache" in cmd11
    weak = cfg.trtexec_command("target.onnx", "target.plan", profiles, 10, "int4", weakly_typed=True)
    assert "--fp16" in weak and "--int4" in weak and "--stronglyTyped" not in weak


def test_ort_tensorrt_ep_options(tmp_path, monkeypatch):
    from speccompile.accel.ort_trt import tensorrt_ep_options

    m = Manifest(model={}, graphs={"target": _spec()}, limits=dict(LIMITS), files={"target.onnx": "ab" * 32})
    opts = tensorrt_ep_options(m, _spec(), tmp_path / "cache")
    assert opts["trt_engine_cache_enable"] == "True" and opts["trt_engine_cache_path"] == str(tmp_path / "cache")
    assert "input_ids:1x256" in opts["trt_profile_max_shapes"]
    assert "past_key_values.0.key:1x3x0x64" in opts["trt_profile_min_shapes"]
    monkeypatch.setenv("SPECCOMPILE_CACHE", str(tmp_path / "root"))  # default: keyed by the graph's sha256
    assert tensorrt_ep_options(m, _spec())["trt_engine_cache_path"] == str(tmp_path / "root" / ("ab" * 8))


# ---------------------------------------------------------------- TensorRT compatibility checker

def _model(nodes, inits=(), inputs=None, opsets=(("", 21),)) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "g", inputs or [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], list(inits),
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])


def test_compat_accepts_exported_graph(tiny_artifact):
    report = check_tensorrt_compat(tiny_artifact / "target.onnx")
    assert report.ok, report.errors
    assert report.op_counts["MatMul"] > 0


def test_compat_flags_contrib_ops_and_double():
    w = numpy_helper.from_array(np.zeros((4, 4), np.float64), "w")
    model = _model(
        [
            helper.make_node("MatMulNBits", ["x", "w"], ["t"], domain="com.microsoft"),
            helper.make_node("Cast", ["t"], ["y"], to=TensorProto.DOUBLE),
            helper.make_node("StringNormalizer", ["x"], ["z"]),
        ],
        [w], opsets=(("", 21), ("com.microsoft", 1)),
    )
    report = check_tensorrt_compat(model)
    text = "\n".join(report.errors)
    assert not report.ok
    assert "com.microsoft::MatMulNBits" in text and "StringNormalizer" in text
    assert "Cast" in text and "initializer w: element type double" in text


def test_compat_allows_fp8_only_inside_qdq():
    q = helper.make_tensor("wq", TensorProto.FLOAT8E4M3FN, [4, 4], vals=b"\x00" * 16, raw=True)
    s = numpy_helper.from_array(np.ones(4, np.float32), "s")
    ok = _model([helper.make_node("DequantizeLinear", ["wq", "s"], ["w"], axis=1), helper.make_node("MatMul", ["x", "w"], ["y"])], [q, s])
    assert check_tensorrt_compat(ok).ok
    bad = _model([helper.make_node("Cast", ["wq"], ["w"], to=TensorProto.FLOAT), helper.make_node("MatMul", ["x", "w"], ["y"])], [q])
    assert not check_tensorrt_compat(bad).ok


# ---------------------------------------------------------------- TensorRT (GPU machines only)

@needs_trt
def test_build_engine_and_run_with_tensorrt(tiny_artifact, tmp_path):
    from speccompile.engines.build import BuildOptions, build_artifact
    from speccompile.runtime.session import Runner

    out = tmp_path / "engines"
    build_artifact(tiny_artifact, out, BuildOptions(precision="none", prefill_chunk=64))
    manifest = read_manifest(out)
    assert manifest.engine["plans"]["target"] == "target.plan"
    ref = Runner(tiny_artifact, drafter="none").generate_ids([5, 6, 7, 8], max_tokens=8)
    got = Runner(out, backend="tensorrt", drafter="none").generate_ids([5, 6, 7, 8], max_tokens=8)
    assert got.tokens == ref.tokens


def test_tensorrt_backend_refuses_artifact_without_engine(tiny_artifact):
    from speccompile.runtime.artifact import open_artifact

    with pytest.raises((ArtifactError, UnsupportedError, HardwareError)):
        open_artifact(tiny_artifact, backend="tensorrt")


def test_onnx_only_keeps_drafter_graphs(capsys, tiny_artifact_with_draft, tmp_path):
    out = tmp_path / "fp8"
    code, _, err = _cli(capsys, "build", str(tiny_artifact_with_draft), "--out", str(out), "--fp8", "--onnx-only", "--calib-samples", "2")
    assert code == 0, err
    src = read_manifest(tiny_artifact_with_draft)
    manifest = read_manifest(out, verify_files=True)
    draft = [n for n in manifest.graphs if n != "target"]
    assert draft and all(manifest.graphs[n].file in manifest.files for n in draft)
    for n in draft:  # drafter graphs are copied unchanged
        assert manifest.files[manifest.graphs[n].file] == src.files[src.graphs[n].file]
    script = (out / "build_engines.sh").read_text()  # the ONNX Runtime CPU variants kept (draft model) get no engine
    assert script.count("trtexec --onnx=") == len([g for g in manifest.graphs.values() if not g.extra.get("variant_of")])
    assert any(g.extra.get("variant_of") == manifest.graphs["draft"].file for g in manifest.graphs.values())
    code, stdout, err = _cli(capsys, "run", str(out), "--prompt", "abc abc", "--raw", "--max-tokens", "6", "--drafter", "draft-model", "--json")
    assert code == 0, err
    assert len(json.loads(stdout)["tokens"]) == 6


def test_gptq_act_order_flag_reaches_the_methods(capsys, tiny_artifact, tmp_path):
    """INT4 runs GPTQ in activation order by default; --no-gptq-act-order turns it off (recorded in the manifest)."""
    out = tmp_path / "int4-row-order"
    code, _, err = _cli(capsys, "build", str(tiny_artifact), "--out", str(out), "--int4", "--int4-block", "64",
                        "--no-gptq-act-order", "--onnx-only", "--json")
    assert code == 0, err
    assert read_manifest(out).precision["target"]["methods"]["gptq"]["act_order"] is False
