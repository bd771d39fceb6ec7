"""gpt-oss with MXFP4 experts, as the published checkpoints store them (models/mxfp4.py, models/moe_weights.py): a
tiny random gpt-oss written by transformers, its expert weights quantized here to MXFP4 blocks / scales and saved
with `quantization_config: {"quant_method": "mxfp4"}`. The loader's dequantized experts are transformers' own,
bit for bit; the exported graphs match transformers' forward of the dequantized model; greedy n-gram == plain."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from speccompile.export.pipeline import ExportOptions, export_artifact
from speccompile.models import mxfp4
from speccompile.runtime.artifact import open_artifact
from speccompile.runtime.session import Runner

from conftest import TINY_VOCAB, run_cli_here
from test_families import _check_graph, _check_torch_reference, make_family_model
from test_quantized_exact import PROMPTS, assert_greedy_speculative_equals_plain

_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)  # the positive codes 0..7; +8 sets the sign
MXFP4_CONFIG = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                           "lm_head"], "quant_method": "mxfp4"}  # gpt-oss-20b's config.json


def quantize_mxfp4(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float [..., rows, cols] -> (blocks uint8 [..., rows, cols / 32, 16], scales uint8 [..., rows, cols / 32]):
    per group of 32 values a power of two 2^e with the group's largest |value| / 2^e in [4, 8), each value / 2^e
    rounded to the nearest e2m1 code (clamped to 6), two codes a byte (the even value in the low nibble)."""
    groups = weight.reshape(*weight.shape[:-1], weight.shape[-1] // 32, 32).astype(np.float64)
    amax = np.abs(groups).max(axis=-1)
    exponent = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - 2, -127).astype(np.int64)
    scaled = np.abs(groups) / np.exp2(exponent)[..., None]
    magnitude = np.abs(scaled[..., None] - _E2M1).argmin(axis=-1)  # ties go to the smaller code
    codes = (magnitude + 8 * (groups < 0)).astype(np.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.astype(np.uint8), (exponent + mxfp4.SCALE_BIAS).astype(np.uint8)


def write_mxfp4_gpt_oss(folder) -> None:
    """A tiny random gpt-oss (tests/test_families.py) with its experts rewritten as MXFP4, config.json declaring it."""
    from safetensors.numpy import load_file, save_file

    make_family_model(folder, "gpt_oss")
    (path,) = folder.glob("*.safetensors")
    tensors = load_file(str(path))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        # transformers' [experts, in, out] is stored [experts, out, in]: groups of 32 along the input axis
        blocks, scales = quantize_mxfp4(np.swapaxes(tensors.pop(name).astype(np.float32), 1, 2))
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    save_file(tensors, str(path), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": MXFP4_CONFIG}, indent=2))


def _dequantized_by_transformers(folder):
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32,
        attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def mxfp4_model(tmp_path_factory):
    """The MXFP4 checkpoint, transformers' dequantized model of it, and its fp32 export."""
    root = tmp_path_factory.mktemp("mxfp4")
    write_mxfp4_gpt_oss(root / "hf")
    export_artifact(str(root / "hf"), root / "art", ExportOptions(max_context=256))
    yield root / "hf", _dequantized_by_transformers(root / "hf"), root / "art"
    shutil.rmtree(root, ignore_errors=True)


def test_dequantize_is_transformers_bit_for_bit():
    """Every code in every nibble under every scale byte (255: +-inf, as transformers gives), fp32 and bf16."""
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks = np.random.default_rng(0).integers(0, 256, (3, 256, 4, 16), dtype=np.uint8)
    scales = (np.arange(3 * 256 * 4) % 256).astype(np.uint8).reshape(3, 256, 4)
    got = mxfp4.dequantize(blocks, scales)
    want = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32).numpy()
    assert got.dtype == np.float32 and got.shape == want.shape == (3, 128, 256)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.isinf(got).any() and not np.isnan(got).any()
    bf16 = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.bfloat16)
    np.testing.assert_array_equal(bf16.float().numpy(), got)  # every value is a bf16 value: the bf16 model's weights too


def test_quantizer_round_trips_its_grid():
    """The test's own quantizer: values already on a group's grid come back unchanged through `mxfp4.dequantize_rows`."""
    rng = np.random.default_rng(3)
    codes, power = rng.integers(0, 16, (5, 64)), np.exp2(rng.integers(-6, 3, (5, 2))).repeat(32, 1)
    codes[:, [0, 32]] = 7  # each group's largest: 6 * its power of two
    grid = (np.concatenate([_E2M1, -_E2M1])[codes] * power).astype(np.float32)
    blocks, scales = quantize_mxfp4(grid)
    assert blocks.shape == (5, 2, 16) and scales.shape == (5, 2)
    np.testing.assert_array_equal(mxfp4.dequantize_rows(blocks, scales), grid)


def test_loader_experts_equal_transformers_dequantized_bitwise(mxfp4_model):
    """Each expert's gate / up / down weight read by the loader (lazily, one expert's rows at a time) = transformers'
    dequantized `gate_up_proj[e][:, 0::2]` / `[:, 1::2]` / `down_proj[e]`, transposed to [out, in], bit for bit."""
    from speccompile.models.load import load_model

    folder, hf, _ = mxfp4_model
    weights = load_model(str(folder)).weights
    assert not [n for n in weights.names() if n.endswith(("_blocks", "_scales"))]
    for layer in range(2):
        experts = hf.model.layers[layer].mlp.experts
        gate_up, down = experts.gate_up_proj.detach().numpy(), experts.down_proj.detach().numpy()
        for e in range(4):
            prefix = f"model.layers.{layer}.mlp.experts.{e}."
            for proj, want in (("gate_proj", gate_up[e][:, 0::2]), ("up_proj", gate_up[e][:, 1::2]), ("down_proj", down[e])):
                got = weights.read(prefix + proj + ".weight")
                info = weights.info(prefix + proj + ".weight")
                assert info.shape == got.shape and info.dtype == got.dtype == np.float32
                np.testing.assert_array_equal(got.view(np.uint32), np.ascontiguousarray(want.T).view(np.uint32))
    groups = weights.read("model.layers.0.mlp.experts.0.up_proj.weight").reshape(-1, 32)
    assert max(len(np.unique(np.abs(g))) for g in groups) <= 8  # MXFP4 values: 8 magnitudes under a group's scale


def test_an_expert_is_dequantized_alone(tmp_path):
    """Streaming: reading one expert's weight from the memory-mapped file allocates about that weight (here 0.5 MB of
    a 32 MB dequantized gate_up_proj), and it is transformers' layout's slice of the whole tensor."""
    import tracemalloc

    from safetensors.numpy import save_file

    from speccompile.models.moe_weights import per_expert
    from speccompile.models.weights import SafetensorsSource

    rng = np.random.default_rng(5)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    blocks = rng.integers(0, 256, (32, 512, 16, 16), dtype=np.uint8)
    scales = rng.integers(110, 130, (32, 512, 16), dtype=np.uint8)
    save_file({f"{name}_blocks": blocks, f"{name}_scales": scales}, str(tmp_path / "model.safetensors"))
    weights = per_expert(SafetensorsSource([tmp_path / "model.safetensors"]), str(tmp_path))
    assert len(weights.names()) == 32 * 2
    tracemalloc.start()
    got = weights.read("model.layers.0.mlp.experts.7.up_proj.weight")
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert got.shape == (256, 512) and peak < 4 * got.nbytes, peak
    np.testing.assert_array_equal(got, np.ascontiguousarray(mxfp4.dequantize(blocks, scales)[7][:, 1::2].T))


def test_export_matches_transformers_dequantized_and_decodes_exactly(mxfp4_model):
    """Torch reference, contract and fused graphs within 1e-4 (of each row's largest logit) of transformers' forward
    of the dequantized model at every position (prefill, tree verify, chain); greedy n-gram == plain."""
    folder, hf, art = mxfp4_model
    seq = [int(t) for t in np.random.default_rng(1).integers(3, TINY_VOCAB, 26)]
    _check_torch_reference(folder, hf, seq, "gpt_oss mxfp4")
    for fused in (True, False):
        session = open_artifact(art, threads=1, fused=fused).target
        assert session.spec.file == ("target.ort.onnx" if fused else "target.onnx")
        _check_graph(session, hf, seq, 5, f"gpt_oss mxfp4 {'fused' if fused else 'contract'}")
    runner = Runner(art, drafter="ngram", num_draft_tokens=4, adaptive=False, threads=1)
    assert runner.artifact.target.spec.file == "target.ort.onnx"
    assert_greedy_speculative_equals_plain(runner, PROMPTS, 32)


def test_int4_build_repacks_the_dequantized_experts_and_verifies_identical(mxfp4_model, tmp_path):
    """`build --int4` re-quantizes the dequantized experts like any float weight: every expert MatMul packed, rows
    exact in any pass, `verify` identical to plain."""
    import onnx

    from conftest import run_cli
    from test_moe import IDS, _logits_in_passes

    built = tmp_path / "int4"
    result = run_cli("build", str(mxfp4_model[2]), "--int4", "--onnx-only", "--calib-samples", "2", "--out", str(built))
    assert result.returncode == 0, result.stderr
    graph = onnx.load(str(built / "target.ort.onnx"), load_external_data=False).graph
    packed = {n.input[1] for n in graph.node if n.op_type == "MatMulNBits"}
    float_matmuls = {n.input[1] for n in graph.node if n.op_type == "MatMul"} & {i.name for i in graph.initializer}
    assert len(packed) == 2 * (2 + 4 * 2)  # per layer: qkv, o_proj, 4 experts x 2
    assert float_matmuls == {"lm_head.weight_t"} | {f"layers.{i}.mlp.router.weight_t" for i in range(2)}
    session = open_artifact(built, threads=1).target
    assert session.row_invariant
    np.testing.assert_array_equal(_logits_in_passes(session, IDS, 8, 4), _logits_in_passes(session, IDS, 8, 1))
    result = run_cli("verify", str(built), "--max-tokens", "16", "--limit", "2")
    assert result.returncode == 0 and "identical" in result.stdout, result.stdout + result.stderr


def _rewrite(folder, change) -> None:
    from safetensors.numpy import load_file, save_file

    (path,) = folder.glob("*.safetensors")
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize("case", ["method", "no-method", "no-scales", "scales-shape", "blocks-dtype"])
def test_bad_mxfp4_checkpoints_are_refused_in_one_line(mxfp4_model, tmp_path, capsys, case):
    """Another quantization method, a config without its method, a `_blocks` tensor without its `_scales` or not
    MXFP4-shaped: one error line naming the file and the key, exit code 2."""
    folder = tmp_path / "hf"
    shutil.copytree(mxfp4_model[0], folder)
    name = "model.layers.1.mlp.experts.down_proj"
    config = json.loads((folder / "config.json").read_text())
    if case in ("method", "no-method"):
        config["quantization_config"] = {"quant_method": "fp8"} if case == "method" else {"dequantize": False}
        (folder / "config.json").write_text(json.dumps(config))
    elif case == "no-scales":
        _rewrite(folder, lambda t: t.pop(f"{name}_scales"))
    elif case == "scales-shape":
        _rewrite(folder, lambda t: t.update({f"{name}_scales": t[f"{name}_scales"][:, :, :1].copy()}))
    else:
        _rewrite(folder, lambda t: t.update({f"{name}_blocks": t[f"{name}_blocks"].view(np.int8)}))
    code, _, err = run_cli_here(capsys, "export", str(folder), "--out", str(tmp_path / "art"))
    lines = [line for line in err.strip().splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    where, key = ((folder / "config.json", "quantization_config.quant_method") if case in ("method", "no-method")
                  else (folder, f"{name}_{'scales' if case == 'no-scales' else 'blocks'}"))
    assert str(where) in lines[0] and key in lines[0], lines[0]
    assert not (tmp_path / "art").exists()
