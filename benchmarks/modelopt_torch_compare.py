"""Ours vs NVIDIA ModelOpt's PyTorch post-training quantization on the same model, calibration prompts and
held-out text, in one table.

    python benchmarks/modelopt_torch_compare.py EXPORTED --modelopt-python /tmp/mo/bin/python \
        --config INT4_AWQ_CFG --config INT4_BLOCKWISE_WEIGHT_ONLY_CFG:gptq --work /tmp/mo-torch \
        --ours int4-requantized=BUILT_INT4 [--device cuda] [--json]

`modelopt.torch.quantization` is the path of ModelOpt's `hf_ptq.py`, which makes the INT4 AWQ / NVFP4
checkpoints TensorRT-LLM and vLLM load; `benchmarks/modelopt_compare.py` covers its ONNX quantizer. ModelOpt
runs in its own interpreter (`--modelopt-python`: a venv with `pip install --no-deps nvidia-modelopt` and its
small dependencies, the project's site-packages on its path, as modelopt_compare.py describes), in this same
script with `--worker`:

1. the export's source model is built as the torch module the export traced (`models/decoder.py`), its fused
   q/k/v and gate/up matmuls computed by their Linear layers one by one so ModelOpt's quantizers see them;
2. `mtq.quantize` with each `--config` (a constant of `modelopt.torch.quantization`, `:METHOD` replacing its
   calibration algorithm, e.g. `INT4_BLOCKWISE_WEIGHT_ONLY_CFG:gptq`, `+weight-only` turning its activation
   quantizers off, e.g. `NVFP4_FOUR_OVER_SIX_CFG+weight-only`) calibrates it on the built-in calibration
   prompts, as `speccompile build` does;
3. each quantized Linear's effective weight is read by passing the identity through it, which is exact for
   weight-only configs: the worker checks on calibration rows that the layer computes x @ that weight and
   refuses a config that quantizes activations;
4. those weights replace the export's in a copy of its contract graph (the same fp32 function ModelOpt's fake
   quantization computes), which `speccompile eval`'s library then scores like ours.

Size: what ModelOpt's checkpoint stores: per quantized weight 4 bits + its block scales (INT4: one float16 per
block; NVFP4: one FP8 per 16 + a float32 global scale), FP8 8 bits + its scales, AWQ's input scales in float16,
and every other tensor (the tied embedding table / lm_head, the norms) in float16.

ModelOpt 0.47's NVFP4 fake quantization runs only on CUDA (its dynamic block quantizer asserts a CUDA tensor, the
static one is a triton kernel): NVFP4 configs need `--device cuda`; INT4 and FP8 ones run on the CPU. With
`--cpu-nvfp4`, configs whose NVFP4 quantizers are dynamic (`W4A16_NVFP4_CFG` and its `:METHOD` variants) run on
the CPU with that one kernel replaced by the project's NVFP4 arithmetic (`engines/numerics.py`: FP8 E4M3 block
scales of amax / 6 under a float32 global scale of amax / (6 x 448), E2M1 rounding; the arithmetic our NVFP4 graphs
are checked against `onnx.reference` with); ModelOpt's calibration algorithms run as they are. Rows made so say it.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

PROJECTIONS = {  # contract-graph weight (layer i) -> the Linear layers whose weights it holds, side by side
    "layers.{i}.self_attn.weight_t": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "layers.{i}.self_attn.o_proj.weight_t": ("self_attn.o_proj",),
    "layers.{i}.mlp.weight_t": ("mlp.gate_proj", "mlp.up_proj"),
    "layers.{i}.mlp.down_proj.weight_t": ("mlp.down_proj",),
}


def stored_bytes(quantizer, numel: int, rows: int) -> tuple[float, str]:
    """Bytes ModelOpt's checkpoint stores for a [rows, numel / rows] weight behind `quantizer`, and the format."""
    bits, blocks = quantizer.num_bits, quantizer.block_sizes or {}
    block = blocks.get(-1) or blocks.get(1)
    if bits == (2, 1):
        return numel / 2 + numel / 16 + 4, "NVFP4"
    if bits == (4, 3):  # one float32 scale per block (2-D blocks: rows x columns), else per output channel
        per_scale = block * (blocks.get(-2) or 1) if block else numel // rows
        return numel + 4 * numel / per_scale, "FP8" + (f" blocks {blocks.get(-2)}x{block}" if blocks.get(-2) else "")
    if bits == 4:
        return numel / 2 + 2 * numel / (block or numel // rows), f"INT4 block {block}" if block else "INT4 per channel"
    raise SystemExit(f"weight quantizer with num_bits {bits}: no size rule")


def nvfp4_fake_quant_cpu(inputs, block_size: int, amax):
    """NVFP4 fake quantization of `inputs` in blocks of `block_size` along its last axis under the global `amax`,
    by numerics.nvfp4_quantize / nvfp4_dequantize (the stand-in for ModelOpt's CUDA kernel under --cpu-nvfp4)."""
    import torch

    from speccompile.engines import numerics as nx

    x = inputs.detach().float().cpu().numpy()
    flat = x.reshape(-1, x.shape[-1])
    codes, scale_fp8, global_scale = nx.nvfp4_quantize(flat, nx.nvfp4_global_scale(float(amax.detach().float().max())), block_size)
    out = nx.nvfp4_dequantize(codes, scale_fp8, global_scale, block_size).reshape(x.shape)
    return torch.from_numpy(out).to(inputs.dtype)


def emulate_nvfp4_on_cpu(tensor_quant) -> None:
    """Route ModelOpt's dynamic block quantization of NVFP4 (E2M1 values, E4M3 scales) on CPU tensors to
    nvfp4_fake_quant_cpu; every other format and CUDA tensors keep ModelOpt's own kernels."""
    original = tensor_quant.dynamic_block_quantize_op

    def dispatch(inputs, block_size, amax, num_bits, exponent_bits, scale_num_bits, scale_exponent_bits):
        if not inputs.is_cuda and (num_bits, exponent_bits, scale_num_bits, scale_exponent_bits) == (4, 2, 8, 4):
            return nvfp4_fake_quant_cpu(inputs, block_size, amax)
        return original(inputs, block_size, amax, num_bits, exponent_bits, scale_num_bits, scale_exponent_bits)

    tensor_quant.dynamic_block_quantize_op = dispatch


@contextlib.contextmanager
def linear_by_linear():
    """models/decoder.py's fused q/k/v and gate/up matmuls computed by each Linear layer in turn (the same function),
    so that forward hooks and ModelOpt's quantizers see every layer."""
    import speccompile.models.decoder as decoder_module
    import speccompile.models.feed_forward as feed_forward_module  # the MLP's gate/up

    modules = (decoder_module, feed_forward_module)
    fused = [module.fused_linear for module in modules]
    for module in modules:
        module.fused_linear = lambda x, layers: tuple(layer(x) for layer in layers)
    try:
        yield
    finally:
        for module, original in zip(modules, fused):
            module.fused_linear = original


def effective_weight_t(linear, rows, device: str) -> np.ndarray:
    """The [K, N] weight `linear` applies, read by passing the identity through it; checked on `rows` [n, K] of its
    real inputs to be what the layer computes (a layer that quantizes its input is refused)."""
    import torch

    with torch.no_grad():
        weight_t = linear(torch.eye(linear.in_features, device=device)).float()
        want = linear(rows)
        gap = (want - rows @ weight_t).abs().max().item()
    if gap > 1e-4 * max(1.0, want.abs().max().item()):
        raise SystemExit(f"a Linear layer is not linear in its input (gap {gap:.2e}): the config quantizes activations; "
                         "only weight-only configs compare here")
    return weight_t.cpu().numpy()


def replace_projections(graph, model, original: dict, rows: dict, device: str) -> list:
    """Each projection weight of the contract graph `graph` replaced, in place, by the effective weights of its
    Linear layers in `model` side by side, after checking that the export's weight is their `original` ones
    (HF names -> tensors) side by side. `rows`: module path -> a few of its inputs. Returns the Linear layers."""
    from onnx import numpy_helper

    inits = {i.name: i for i in graph.graph.initializer}
    layers = dict(model.named_modules())
    done = []
    for i in range(len(model.model.layers)):
        for pattern, group in PROJECTIONS.items():
            paths = [f"model.layers.{i}.{p}" for p in group]
            target = pattern.format(i=i)
            before = numpy_helper.to_array(inits[target])
            if not np.array_equal(before, np.concatenate([original[f"{p}.weight"].float().numpy().T for p in paths], axis=1)):
                raise SystemExit(f"{target}: the export's weight is not {' + '.join(group)} side by side")
            after = np.concatenate([effective_weight_t(layers[p], rows[p], device) for p in paths], axis=1)
            inits[target].CopyFrom(numpy_helper.from_array(after.astype(before.dtype), target))
            done += [layers[p] for p in paths]
    return done


def projection_inputs(model, feed_args) -> dict:
    """module path -> the first 64 input rows each projection Linear of `model` gets on one forward pass."""
    import torch

    rows = {}
    layers = dict(model.named_modules())

    def keep(path):
        def hook(_module, args, _out):
            rows[path] = args[0].detach().reshape(-1, args[0].shape[-1])[:64].clone()
        return hook

    paths = [f"model.layers.{i}.{p}" for i in range(len(model.model.layers)) for group in PROJECTIONS.values() for p in group]
    handles = [layers[p].register_forward_hook(keep(p)) for p in paths]
    with torch.no_grad(), linear_by_linear():
        model(*feed_args)
    for h in handles:
        h.remove()
    return rows


WEIGHT_ONLY = "+weight-only"


def modelopt_config(mtq, spec: str) -> dict:
    """The ModelOpt config `spec` names: CONFIG[:METHOD][+weight-only] (see the module docstring)."""
    weight_only = spec.endswith(WEIGHT_ONLY)
    name, _, method = spec.removesuffix(WEIGHT_ONLY).partition(":")
    if not hasattr(mtq, name):
        raise SystemExit(f"--config {spec}: modelopt.torch.quantization has no {name}")
    cfg = copy.deepcopy(getattr(mtq, name))
    if method:
        cfg["algorithm"] = {"method": method}
    if weight_only:  # a later entry overrides the earlier ones for the quantizers it names
        cfg["quant_cfg"] = [*cfg["quant_cfg"], {"quantizer_name": "*input_quantizer", "enable": False}]
    return cfg


def worker(exported: Path, config: str, device: str, out: Path, calib_tokens: int, cpu_nvfp4: bool = False) -> None:
    """In ModelOpt's interpreter: quantize the export's source model with `config`, write the artifact + meta.json."""
    import onnx
    import torch

    import modelopt.torch.quantization as mtq
    from modelopt_compare import wrap_as_artifact
    from speccompile.engines.calibrate import load_calibration_texts, prefill_feeds, tokenize_calibration
    from speccompile.manifest import read_manifest
    from speccompile.models.decoder import build_decoder
    from speccompile.models.load import load_model
    from speccompile.tokenizer import TextTokenizer

    cfg = modelopt_config(mtq, config)
    emulated = not device.startswith("cuda") and "'num_bits': (2, 1)" in str(cfg["quant_cfg"])
    if emulated and not cpu_nvfp4:
        raise SystemExit(f"{config}: ModelOpt's NVFP4 fake quantization runs only on CUDA (--device cuda, or --cpu-nvfp4)")
    if emulated:
        import modelopt.torch.quantization.tensor_quant as tensor_quant

        emulate_nvfp4_on_cpu(tensor_quant)
    manifest = read_manifest(exported, verify_files=False)
    spec = manifest.graph("target")
    loaded = load_model(manifest.model["source"])
    model = build_decoder(loaded.config, loaded.weights).float().eval().to(device)
    tokenizer = TextTokenizer(exported, manifest.tokenizer.get("eos_token_ids"))
    samples = tokenize_calibration(load_calibration_texts(None), tokenizer, 16, calib_tokens)
    feeds = [[torch.from_numpy(np.asarray(feed[n])).to(device) for n in model.input_names]
             for feed in (prefill_feeds(spec, ids) for ids in samples)]

    def forward_loop(m):
        with torch.no_grad(), linear_by_linear():
            for args in feeds:
                m(*args)

    mtq.quantize(model, cfg, forward_loop)
    graph = onnx.load(str(exported / spec.file), load_external_data=True)
    linears = replace_projections(graph, model, loaded.torch_weights(), projection_inputs(model, feeds[0]), device)
    stored, formats = 0.0, set()
    for linear in linears:
        size, fmt = stored_bytes(linear.weight_quantizer, linear.weight.numel(), linear.out_features)
        awq_scale = getattr(linear.input_quantizer, "pre_quant_scale", None) is not None
        stored += size + (2 * linear.in_features if awq_scale else 0)
        formats.add(fmt)
    projections = {pattern.format(i=i) for i in range(len(model.model.layers)) for pattern in PROJECTIONS}
    stored += sum(2 * int(np.prod(init.dims)) for init in graph.graph.initializer if init.name not in projections
                  and init.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16))
    out.mkdir(parents=True, exist_ok=True)
    onnx.save_model(graph, str(out / "graph.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="graph.onnx.data", size_threshold=1024)
    wrap_as_artifact(exported, out / "graph.onnx", out / "artifact", "modelopt-torch")
    (out / "graph.onnx").unlink()
    (out / "graph.onnx.data").unlink()
    meta = {"config": config, "algorithm": str(cfg.get("algorithm")), "formats": sorted(formats), "weights": len(linears),
            "stored_mb": stored / 1e6, "device": device, "nvfp4_kernel": "emulated on the CPU" if emulated else "ModelOpt's"}
    (out / "meta.json").write_text(json.dumps(meta))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("exported", type=Path)
    parser.add_argument("--modelopt-python", help="interpreter with nvidia-modelopt (required unless --worker)")
    parser.add_argument("--config", action="append", default=[], help="CONFIG[:METHOD] of modelopt.torch.quantization (repeatable)")
    parser.add_argument("--ours", action="append", default=[], help="LABEL=BUILT_ARTIFACT of ours to put in the table")
    parser.add_argument("--device", default="cpu", help="torch device for ModelOpt (NVFP4: cuda)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/speccompile-modelopt-torch"))
    parser.add_argument("--calib-tokens", type=int, default=256, help="longest calibration prompt (speccompile build's default)")
    parser.add_argument("--cpu-nvfp4", action="store_true", help="NVFP4 configs on the CPU with the project's NVFP4 arithmetic in place of ModelOpt's CUDA kernel")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reuse", action="store_true", help="take ModelOpt outputs already in --work")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", metavar="CONFIG", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.exported, args.worker, args.device, args.work, args.calib_tokens, args.cpu_nvfp4)
        return
    if args.config and not args.modelopt_python:
        parser.error("--config needs --modelopt-python")

    from speccompile.evaluation import EvalOptions, evaluate

    candidates: dict[str, tuple[Path, float | None]] = {}
    failures: dict[str, str] = {}
    for config in args.config:
        work = args.work / config.replace(":", "-").replace("+", "-")
        label = f"ModelOpt torch {config}"
        if not ((work / "meta.json").is_file() and args.reuse):
            command = [args.modelopt_python, __file__, str(args.exported), "--worker", config, "--device", args.device,
                       "--work", str(work), "--calib-tokens", str(args.calib_tokens), *(["--cpu-nvfp4"] if args.cpu_nvfp4 else [])]
            print(" ".join(command), file=sys.stderr)
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                failures[label] = (done.stderr.strip().splitlines() or ["no output"])[-1]
                continue
        meta = json.loads((work / "meta.json").read_text())
        kernel = ", NVFP4 kernel emulated on the CPU" if meta.get("nvfp4_kernel", "").startswith("emulated") else ""
        candidates[f"{label} ({', '.join(meta['formats'])}; {meta['algorithm']}{kernel})"] = (work / "artifact", meta["stored_mb"])
    for item in args.ours:
        label, _, path = item.partition("=")
        candidates[f"ours {label}"] = (Path(path), None)
    rows = {}
    for name, (path, stored_mb) in candidates.items():
        try:
            report = evaluate(path, args.exported, EvalOptions(threads=args.threads))
        except Exception as exc:  # noqa: BLE001 - one failing candidate must not hide the others
            failures[name] = f"eval: {str(exc).splitlines()[0]}"
            continue
        rows[name] = {"top1_agreement": report["top1_agreement"], "top1_interval": report["top1_interval_95"],
                      "kl_divergence": report["kl_divergence"], "perplexity": report["perplexity"]["artifact"],
                      "reference_perplexity": report["perplexity"]["reference"],
                      "size_mb": stored_mb if stored_mb is not None else report["size_mb"]["artifact"]}
    if args.json:
        print(json.dumps({"rows": rows, "failures": failures}, indent=2))
        return
    reference = next(iter(rows.values()), {}).get("reference_perplexity", "-")
    print(f"| candidate | top-1 [95 %] | KL | perplexity (fp32 {reference}) | MB |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        interval = r["top1_interval"]
        top1 = f"{r['top1_agreement']:.4f}" + (f" [{interval[0]:.3f}, {interval[1]:.3f}]" if interval else "")
        print(f"| {name} | {top1} | {r['kl_divergence']:.4f} | {r['perplexity']:.2f} | {r['size_mb']:.1f} |")
    for name, why in failures.items():
        print(f"| {name} | failed: {why} | | | |")


if __name__ == "__main__":
    main()
