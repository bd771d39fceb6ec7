"""BitNet b1.58's released layout (models/bitnet.py): a tiny checkpoint packed as transformers packs it (ternary weights
four per uint8, a weight_scale per projection, quantization_config "bitnet") and read back by transformers itself.

The per-token int8 round trip of every projection input is a rounding: where two implementations differ by an ulp
before it (any other summation order), a value on a rounding edge moves by a whole step, so no graph can agree with
transformers to 1e-4 at *every* position. What is checked: the weights unpack to transformers' own values bit for bit,
the torch reference and both graphs agree with transformers' fp32 forward to 1e-4 on most positions (the others
where a rounding edge was crossed, still close), a position's logits are the same bits in a one-row and a verify pass
(row-local: speculation stays exact), greedy n-gram decoding equals plain decoding; other BitNet modes are refused."""

from __future__ import annotations

import json

import numpy as np
import pytest

from speccompile.export.pipeline import ExportOptions, export_artifact
from speccompile.runtime.artifact import open_artifact
from speccompile.runtime.session import Runner

from conftest import TINY_VOCAB
from test_families import _decoded, _hf_logits, make_family_model

QUANT = {"quant_method": "bitnet", "linear_class": "bitlinear", "quantization_mode": "offline"}


def write_packed_bitnet(folder, seed: int = 0):
    """A tiny BitNet saved by transformers, its projections replaced by random ternary weights packed as the release
    stores them, with random weight scales; returns transformers' fp32 model loaded from it (BitLinear layers)."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file
    from transformers.integrations.bitnet import pack_weights

    make_family_model(folder, "bitnet", seed=seed)
    tensors, generator = load_file(str(folder / "model.safetensors")), torch.Generator().manual_seed(seed)
    for name in [n for n, t in tensors.items() if n.startswith("model.layers.") and t.dim() == 2]:
        ternary = torch.randint(-1, 2, tensors[name].shape, generator=generator).to(torch.float32)
        tensors[name] = pack_weights(ternary)
        tensors[name + "_scale"] = 0.05 + 0.1 * torch.rand(1, generator=generator)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": QUANT}))
    torch._dynamo.config.disable = True  # transformers' BitLinear helpers are torch.compile'd: eager is the same math
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    finally:
        torch._dynamo.config.disable = False


def _mostly_close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Within 1e-4 (of the row's largest |logit|) on at least 3/4 of the rows, within 0.1 on every row."""
    err = np.abs(got - want).max(axis=-1) / np.abs(want).max(axis=-1)
    assert np.mean(err <= 1e-4) >= 0.75 and err.max() <= 0.1, f"{what}: relative errors {np.array2string(err, precision=1)}"


def _graph_logits(session, seq: list[int]) -> np.ndarray:
    """Prefill seq[:20], then the rest as a chain pass: every position's logits."""
    cache = session.new_cache()
    out = session.run(np.array(seq[:20]), np.arange(20), cache.attention_mask(np.tril(np.ones((20, 20), bool))), cache)
    cache.append(out.presents, range(20), 20)
    rest = len(seq) - 20
    tail = session.run(np.array(seq[20:]), np.arange(20, len(seq)), cache.attention_mask(np.tril(np.ones((rest, rest), bool))), cache)
    return np.concatenate([out.logits, tail.logits])


def test_packed_bitnet_matches_transformers(tmp_path):
    import torch
    from transformers.integrations.bitnet import unpack_weights

    from speccompile.models.decoder import build_decoder, causal_mask
    from speccompile.models.load import load_model

    hf = write_packed_bitnet(tmp_path / "hf")
    loaded = load_model(str(tmp_path / "hf"))
    assert (loaded.config.sub_norms, loaded.config.act_quant) == (True, True)
    assert not [n for n in loaded.weights.names() if n.endswith("weight_scale")]
    for name in ("self_attn.k_proj", "mlp.down_proj"):  # transformers' unpacking, divided by the scale
        module = hf.get_submodule(f"model.layers.1.{name}")
        want = (unpack_weights.__wrapped__(module.weight, torch.float32) / module.weight_scale).numpy()
        np.testing.assert_array_equal(loaded.weights.read(f"model.layers.1.{name}.weight"), want)
    seq = [int(t) for t in np.random.default_rng(1).integers(3, TINY_VOCAB, 26)]
    full = _hf_logits(hf, seq)
    decoder = build_decoder(loaded.config, loaded.weights)
    with torch.no_grad():
        logits = decoder(torch.tensor([seq]), torch.arange(26)[None], causal_mask(26, 0), *decoder.empty_past())[0][0].numpy()
    _mostly_close(logits, full, "torch reference")
    export_artifact(str(tmp_path / "hf"), tmp_path / "art", ExportOptions(max_context=96))
    for fused in (True, False):
        session = open_artifact(tmp_path / "art", threads=1, fused=fused).target
        _mostly_close(_graph_logits(session, seq), full, "fused" if fused else "contract")
    fused = open_artifact(tmp_path / "art", threads=1).target  # row-local: the same bits in one-row and verify passes
    np.testing.assert_array_equal(_decoded(fused, seq, 1), _decoded(fused, seq, 3))
    _check_gpu_form(tmp_path / "art", loaded, seq, full)
    _check_speculation(tmp_path / "art")


def _check_gpu_form(out, loaded, seq: list[int], full: np.ndarray) -> None:
    """The GPU graph's fp32 form on ONNX Runtime CPU: a prefill and chain passes of 4 and 2 rows."""
    from speccompile.export.ort_fused_graph import export_fused_variant
    from speccompile.export.recipes import DecoderWeights
    from speccompile.manifest import read_manifest
    from speccompile.runtime.backends.ort_cuda import OrtCudaSession

    (spec,), _ = export_fused_variant(DecoderWeights(loaded.config, loaded.weights), read_manifest(out).graph("target"), out, 96,
                                      target="cuda")
    gpu = OrtCudaSession(out, spec, device="cpu", max_context=96, threads=1)
    cache, past, rows = gpu.new_cache(), 0, []
    for q in (20, 4, 2):
        step = gpu.run(np.array(seq[past:past + q]), np.arange(past, past + q), cache.attention_mask(np.tril(np.ones((q, q), bool))), cache)
        cache.append(step.presents, range(q), q)
        rows.append(step.logits)
        past += q
    _mostly_close(np.concatenate(rows), full[:past], "GPU form")


def _check_speculation(artifact) -> None:
    """Greedy n-gram speculative decoding equals plain decoding."""
    runner = Runner(artifact, drafter="ngram", num_draft_tokens=4, adaptive=False, threads=1)
    prompt = "abc abd abc abd abc abd abc"
    assert runner.generate(prompt, chat=False, max_tokens=40).tokens == \
        runner.generate(prompt, chat=False, max_tokens=40, drafter="none").tokens


def test_packed_bitnet_int4_build(tmp_path):
    """`build --int4` of the packed checkpoint's export: ternary weights of one scale fit 4-bit blocks exactly (layer
    0's q/k/v MatMulNBits weight dequantizes to the fp32 graph's, bit for bit); speculation identical to plain
    decoding on the packed graph."""
    import onnx
    from onnx import numpy_helper

    from speccompile.engines.build import BuildOptions, build_artifact
    from speccompile.engines.nbits import NBitsWeight
    from speccompile.models.load import load_model

    write_packed_bitnet(tmp_path / "hf")
    export_artifact(str(tmp_path / "hf"), tmp_path / "art", ExportOptions(max_context=96))
    build_artifact(tmp_path / "art", tmp_path / "int4", BuildOptions(precision="int4", onnx_only=True, calib_samples=2, calib_max_tokens=32))
    graph = onnx.load(str(tmp_path / "int4" / open_artifact(tmp_path / "int4").target.spec.file)).graph
    inits = {i.name: i for i in graph.initializer}
    node = next(n for n in graph.node if n.op_type == "MatMulNBits" and "layers.0.self_attn" in n.input[1])
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    packed, scales, *zeros = (numpy_helper.to_array(inits[name], base_dir=str(tmp_path / "int4")) for name in node.input[1:4] if name)
    got = NBitsWeight(packed, scales.astype(np.float32), zeros[0] if zeros else None, attrs["bits"], attrs["block_size"], attrs["K"],
                      attrs["N"]).dequantize()
    weights = load_model(str(tmp_path / "hf")).weights
    np.testing.assert_array_equal(got, np.concatenate([weights.read(f"model.layers.0.self_attn.{x}_proj.weight") for x in "qkv"]).T)
    _check_speculation(tmp_path / "int4")


@pytest.mark.parametrize("key,value", [("linear_class", "autobitlinear"), ("quantization_mode", "online"), ("use_rms_norm", True)])
def test_other_bitnet_modes_are_refused(key, value):
    from speccompile.errors import UnsupportedError
    from speccompile.models.config import config_from_hf

    data = dict(model_type="bitnet", vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, quantization_config={**QUANT, key: value})
    with pytest.raises(UnsupportedError, match=f"quantization_config.{key} .* is not supported") as info:
        config_from_hf(data, "config.json")
    assert "\n" not in str(info.value)
    assert not config_from_hf({**data, "quantization_config": None}, "config.json").act_quant  # saved unquantized: plain
