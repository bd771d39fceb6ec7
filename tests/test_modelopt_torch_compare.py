"""benchmarks/modelopt_torch_compare.py without ModelOpt: the effective weights of a torch model's Linear layers
go into the export's contract graph at the right places (the graph then computes what the torch model computes),
a layer that is not linear in its input is refused, and the checkpoint size rules."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from speccompile.engines.calibrate import prefill_feeds
from speccompile.manifest import read_manifest

from conftest import load_benchmark


def _source_model(artifact):
    from speccompile.models.decoder import build_decoder
    from speccompile.models.load import load_model

    manifest = read_manifest(artifact, verify_files=False)
    loaded = load_model(manifest.model["source"])
    return manifest.graph("target"), loaded, build_decoder(loaded.config, loaded.weights).float().eval()


def _logits(graph: onnx.ModelProto, feeds: dict) -> np.ndarray:
    return ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"]).run(["logits"], feeds)[0]


def test_effective_weights_go_into_the_contract_graph(tiny_artifact):
    """Linear weights moved to a coarse grid in torch, read back through the identity and written into the graph:
    ONNX Runtime on that graph gives the torch model's logits, which differ from the export's."""
    bench = load_benchmark("modelopt_torch_compare")
    spec, loaded, model = _source_model(tiny_artifact)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}":
                module.weight.copy_(torch.round(module.weight * 8) / 8)
    feeds = prefill_feeds(spec, np.random.default_rng(0).integers(3, 60, 12))
    args = [torch.from_numpy(np.asarray(feeds[n])) for n in model.input_names]
    graph = onnx.load(str(tiny_artifact / spec.file))
    before = _logits(graph, feeds)
    linears = bench.replace_projections(graph, model, loaded.torch_weights(), bench.projection_inputs(model, args), "cpu")
    assert len(linears) == 7 * loaded.config.num_hidden_layers
    with torch.no_grad():
        want = model(*args)[0].numpy()
    got = _logits(graph, feeds)
    assert np.abs(got - want).max() <= 1e-4 * max(1.0, np.abs(want).max())
    assert np.abs(before - want).max() > 1e-2


def test_the_export_weights_must_be_the_layers_side_by_side(tiny_artifact):
    """A source weight that is not the one the export holds (layer 0's q_proj doubled) stops the replacement."""
    bench = load_benchmark("modelopt_torch_compare")
    spec, loaded, model = _source_model(tiny_artifact)
    altered = loaded.torch_weights()
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    altered[q_proj] = altered[q_proj] * 2
    graph = onnx.load(str(tiny_artifact / spec.file))
    feeds = prefill_feeds(spec, [5, 6, 7])
    rows = bench.projection_inputs(model, [torch.from_numpy(np.asarray(feeds[n])) for n in model.input_names])
    with pytest.raises(SystemExit, match="layers.0.self_attn.weight_t"):
        bench.replace_projections(graph, model, altered, rows, "cpu")


def test_a_layer_that_quantizes_its_input_is_refused():
    bench = load_benchmark("modelopt_torch_compare")
    linear = torch.nn.Linear(8, 4, bias=False)

    class InputRounding(torch.nn.Module):
        in_features = 8

        def forward(self, x):
            return linear(torch.round(x * 2) / 2)

    rows = torch.randn(16, 8)
    assert np.allclose(bench.effective_weight_t(linear, rows, "cpu"), linear.weight.detach().numpy().T, atol=1e-6)
    with pytest.raises(SystemExit, match="not linear in its input"):
        bench.effective_weight_t(InputRounding(), rows, "cpu")


@pytest.mark.parametrize("bits, blocks, expected", [
    ((2, 1), {-1: 16}, 4096 / 2 + 4096 / 16 + 4),  # NVFP4: E2M1 codes, an FP8 scale per 16, a float32 global scale
    (4, {-1: 128}, 4096 / 2 + 2 * 4096 / 128),  # INT4 blocks of 128, float16 scales
    (4, None, 4096 / 2 + 2 * 64),  # INT4 per output channel
    ((4, 3), None, 4096 + 4 * 64),  # FP8 per output channel
    ((4, 3), {-1: 32, -2: 32}, 4096 + 4 * 4),  # FP8 in 32 x 32 blocks
])
def test_checkpoint_sizes(bits, blocks, expected):
    bench = load_benchmark("modelopt_torch_compare")
    size, _fmt = bench.stored_bytes(SimpleNamespace(num_bits=bits, block_sizes=blocks), 4096, 64)
    assert size == pytest.approx(expected)


def test_cpu_nvfp4_stands_in_for_the_cuda_kernel_only():
    """--cpu-nvfp4: NVFP4 dynamic block quantization of a CPU tensor goes to the project's NVFP4 arithmetic (blocks
    of 16 along the last axis, the global scale from ModelOpt's amax); any other format still reaches ModelOpt's
    own kernel."""
    from speccompile.engines import numerics as nx

    bench = load_benchmark("modelopt_torch_compare")
    calls = []
    tensor_quant = SimpleNamespace(dynamic_block_quantize_op=lambda *args: calls.append(args) or args[0])
    bench.emulate_nvfp4_on_cpu(tensor_quant)
    x = torch.randn(4, 64) * torch.linspace(0.1, 3.0, 64)
    amax = x.abs().max()
    got = tensor_quant.dynamic_block_quantize_op(x, 16, amax, 4, 2, 8, 4)
    assert not calls and got.shape == x.shape and got.dtype == x.dtype
    codes, scales, global_scale = nx.nvfp4_quantize(x.numpy(), nx.nvfp4_global_scale(float(amax)), 16)
    assert np.array_equal(got.numpy(), nx.nvfp4_dequantize(codes, scales, global_scale, 16))
    assert 0 < (got - x).abs().max() <= x.abs().max() / 6  # rounded, within one E2M1 step of the top level
    tensor_quant.dynamic_block_quantize_op(x, 32, amax, 8, 4, 8, 8)  # MXFP8: not NVFP4
    assert len(calls) == 1
