"""Quantization-aware distillation (`build --qad-steps N`): fit the quantized weights to the unquantized model.

Post-training methods (AWQ, clipping, GPTQ) choose each weight's rounding from that weight's own error on the
calibration rows; they cannot see how errors add up over the layers. QAD trains end to end instead:

1. every weight the build quantizes gets a fixed grid (the scales GPTQ or the clipping search chose, else the
   plain ones): INT4 block steps, NVFP4 FP8 block scales times the global scale, FP8 channel scales;
2. the graph runs in torch (engines/torch_graph.py) with each such weight replaced by `round(u) * step`, `u` the
   weight counted in steps of its grid (trainable), the rounding passed straight through in the backward pass;
3. `u` is trained with Adam to match the unquantized graph's next-token distributions (KL over its top-k tokens
   and one bucket for the rest, computed once)
   on text the unquantized model writes itself from the calibration prompts (sampled at temperature 1 from its
   top-64; LLM-QAT's data-free recipe), or on the calibration text (`--qad-data calib`); the float parameters the build does not quantize and that cost
   nothing to change (RMSNorm weights, the float16 low-rank factors of `--low-rank`) are trained with them;
4. the result goes to the Q/DQ pass as a `GridScales` whose weight sits exactly on the grid (code x step), so the
   stored codes are the ones training ended with.

Training runs on the CPU, or on a CUDA GPU torch sees (`--qad-device`; `auto` takes one when there is one), where
the thousands of steps quantization-aware training usually takes are minutes rather than hours.

Weight-only schemes only (INT4, FP8 / NVFP4 `--weight-only`): activation quantization is not emulated here.
Weights on their source grid, weights kept or excluded, and embedding tables are not trained.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..errors import InputError
from . import numerics as nx
from .gptq import GridScales
from .qdq_targets import LOW_RANK_SUFFIXES, QuantOptions

Progress = Callable[[str], None]

QAD_SCHEMES = ("int4", "fp8-weight-only", "nvfp4-weight-only")
QAD_DATA = ("generated", "calib")
FREE_SUFFIXES = ("norm.weight", *LOW_RANK_SUFFIXES)  # float parameters trained along (stored as they are)


@dataclass(frozen=True)
class QadOptions:
    steps: int = 0  # 0: off
    lr: float = 0.002  # Adam's step for the quantized weights, in units of each weight's grid step
    lr_free: float = 0.0001  # Adam's step for the float parameters, relative to each tensor's RMS
    batch: int = 2  # rows of --calib-max-tokens tokens per step
    data: str = "generated"  # "generated": the model's own continuations of the calibration prompts; "calib": the calibration text
    samples: int = 64  # generated continuations (data="generated"), spread over the prompts
    top_k: int = 64  # teacher probabilities kept per position
    seed: int = 0
    device: str = "auto"  # torch device: "auto" (CUDA when torch sees one, else the CPU), "cpu", "cuda", "cuda:N"

    def validate(self, defaults_key: str) -> "QadOptions":
        if self.steps < 0:
            raise InputError(f"--qad-steps must be >= 0, got {self.steps}")
        if not self.steps:
            return self
        if defaults_key not in QAD_SCHEMES:
            raise InputError("--qad-steps: quantization-aware distillation trains weight-only builds "
                             "(--int4, or --fp8 / --fp4 with --weight-only)")
        if self.lr == 0 and self.lr_free == 0:
            raise InputError("--qad-lr 0 and --qad-float-lr 0: QAD would train nothing")
        if importlib.util.find_spec("torch") is None:
            raise InputError("--qad-steps trains in torch, which is not installed: pip install 'speccompile[export]'")
        if not 0 <= self.lr <= 1:
            raise InputError(f"--qad-lr must be in [0, 1] (grid steps per update; 0: codes fixed), got {self.lr}")
        if not 0 <= self.lr_free <= 1:
            raise InputError(f"--qad-float-lr must be in [0, 1] (relative to each tensor's RMS), got {self.lr_free}")
        if self.data not in QAD_DATA:
            raise InputError(f"--qad-data must be one of {', '.join(QAD_DATA)}, got {self.data}")
        if self.samples < 1:
            raise InputError(f"--qad-samples must be >= 1, got {self.samples}")
        if self.batch < 1:
            raise InputError(f"--qad-batch must be >= 1, got {self.batch}")
        resolve_device(self.device)
        return self


def resolve_device(device: str) -> str:
    """The torch device `--qad-device` names ("auto": the first CUDA GPU torch sees, else "cpu"); an unknown name
    or a CUDA device torch cannot see is an InputError."""
    import torch

    kind, _, index = device.partition(":")
    if kind not in ("auto", "cpu", "cuda") or (index and (kind != "cuda" or not index.isdigit())):
        raise InputError(f"--qad-device must be auto, cpu, cuda or cuda:N, got {device!r}")
    if kind == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda" and not torch.cuda.is_available():
        raise InputError(f"--qad-device {device}: torch {torch.__version__} sees no CUDA device (use cpu or auto)")
    if index and int(index) >= torch.cuda.device_count():
        raise InputError(f"--qad-device {device}: torch sees {torch.cuda.device_count()} CUDA device(s)")
    return device


def weight_grid_for(w: np.ndarray, qopts: QuantOptions, clip: np.ndarray | None) -> GridScales:
    """The grid the Q/DQ pass would put `w` [K, N] on (the same functions and clipping), as fixed scales."""
    if qopts.scheme == "fp8":
        return GridScales(nx.quantize_fp8_per_channel(w, axis=1)[1])
    if qopts.scheme == "int4":
        return GridScales(nx.quantize_int4_blockwise(w, nx.pick_block(w.shape[0], qopts.int4_block), clip)[1])
    _, s_fp8, s2 = nx.nvfp4_quantize(w.T, block=qopts.fp4_block, clip=clip)
    return GridScales(s_fp8, s2)


def grid_steps(grid: GridScales, shape: tuple[int, int], scheme: str) -> np.ndarray:
    """Each element's quantization step [K, N] (the dequantization scale that multiplies its code)."""
    k, _ = shape
    if scheme == "fp8":
        return np.broadcast_to(np.asarray(grid.scale, np.float32)[None, :], shape).copy()
    if scheme == "int4":
        return np.repeat(np.asarray(grid.scale, np.float32), k // grid.scale.shape[0], axis=0)
    effective = np.asarray(grid.scale).astype(np.float32) * np.float32(grid.global_scale)  # [N, K/16]
    return np.repeat(effective.T, k // effective.shape[1], axis=0).astype(np.float32)


def round_to_grid(u, scheme: str):
    """`u` (a weight in grid steps, torch) rounded to its code value as the Q/DQ pass rounds it."""
    import torch

    if scheme == "int4":
        return torch.clamp(torch.round(u), -8, 7)
    if scheme == "fp8":
        return torch.clamp(u, -nx.FP8_MAX, nx.FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    levels = torch.from_numpy(nx.E2M1_VALUES).to(u.device)
    return torch.sign(u) * levels[torch.bucketize(u.abs(), (levels[1:] + levels[:-1]) / 2)]


def pack_rows(samples: list[list[int]], length: int) -> np.ndarray:
    """The calibration samples back to back, cut into rows of `length` tokens [R, length] (at least one row)."""
    stream = [t for ids in samples for t in ids]
    length = min(length, len(stream))
    count = len(stream) // length
    return np.asarray(stream[: count * length], dtype=np.int64).reshape(count, length)


def free_parameters(model: onnx.ModelProto, skip: set[str]) -> list[str]:
    """Float initializers trained along: norm weights and low-rank factors (FREE_SUFFIXES), not in `skip`."""
    floats = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
    return [i.name for i in model.graph.initializer
            if i.data_type in floats and i.name.endswith(FREE_SUFFIXES) and i.name not in skip]


def store_free(model: onnx.ModelProto, values: dict[str, np.ndarray]) -> None:
    """Write trained float parameters back into their initializers, each in its own element type."""
    for init in model.graph.initializer:
        if init.name in values:
            dtype = helper.tensor_dtype_to_np_dtype(init.data_type)
            init.CopyFrom(numpy_helper.from_array(values[init.name].astype(dtype), init.name))


@dataclass
class QadResult:
    grids: dict[str, GridScales]  # weight -> its grid with the trained weight (on the grid)
    free: dict[str, np.ndarray]  # float parameter -> trained value (float32)
    summary: dict


def distill(model: onnx.ModelProto, scheme: str, weights: dict[str, GridScales], free: list[str],
            feeds: list[dict[str, np.ndarray]], options: QadOptions, threads: int | None, progress: Progress) -> QadResult:
    """Train the grid positions of `weights` (name -> its grid; `weight` set: start from it) and the float
    parameters `free` so that the graph's logits follow the unquantized graph's on `feeds` (prefill batches)."""
    import torch

    from .torch_graph import TorchGraph

    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(options.seed)
    device = resolve_device(options.device)
    graph = TorchGraph(model, device)
    steps, units = {}, {}
    for name, grid in weights.items():
        w = grid.weight if grid.weight is not None else graph.constants[name].cpu().numpy()
        step = grid_steps(grid, w.shape, scheme)
        steps[name] = torch.from_numpy(step).to(device)
        units[name] = torch.from_numpy(np.where(step > 0, w / np.where(step > 0, step, 1), 0).astype(np.float32)).to(device)
        units[name].requires_grad_(options.lr > 0)  # --qad-lr 0: the codes stay, only the float parameters train
    floats = {name: torch.nn.Parameter(graph.constants[name].clone()) for name in free} if options.lr_free > 0 else {}
    start_codes = {name: round_to_grid(u.detach(), scheme) for name, u in units.items()}

    progress(f"QAD on {device}: the unquantized graph's top-{options.top_k} next tokens on {len(feeds)} batches")
    targets = _teacher_targets(graph, feeds, options.top_k)

    def student_loss(i: int):
        replace = {name: (u + (round_to_grid(u, scheme) - u).detach()) * steps[name] for name, u in units.items()}
        replace.update(floats)
        logits = graph.run(feeds[i], ["logits"], replace)["logits"].float()
        logits = logits.reshape(-1, logits.shape[-1])
        p, idx = targets[i]
        kl = _top_k_kl(p, idx, torch.log_softmax(logits, dim=-1))
        return kl, float((logits.argmax(-1) == idx[:, 0]).float().mean())

    started = time.time()
    history = _train(student_loss, list(units.values()), list(floats.values()), options, len(feeds), progress)

    grids, changed = {}, 0
    with torch.no_grad():
        for name, grid in weights.items():
            codes = round_to_grid(units[name], scheme)
            changed += int((codes != start_codes[name]).sum())
            grids[name] = dataclasses.replace(grid, weight=(codes * steps[name]).cpu().numpy())
    total = sum(int(u.numel()) for u in units.values())
    first, last = np.mean(history[:10], axis=0), np.mean(history[-10:], axis=0)
    summary = {"steps": options.steps, "data": options.data, "lr": options.lr, "lr_free": options.lr_free, "batch_rows": int(feeds[0]["input_ids"].shape[0]),
               "batches": len(feeds), "tokens_per_batch": int(feeds[0]["input_ids"].size), "top_k": options.top_k,
               "weights": len(weights), "float_parameters": len(floats), "codes_changed": changed,
               "codes_changed_fraction": round(changed / max(total, 1), 5),
               "kl_first_10": round(float(first[0]), 5), "kl_last_10": round(float(last[0]), 5),
               "device": torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu",
               "seconds": round(time.time() - started, 1)}
    return QadResult(grids, {n: p.detach().cpu().numpy() for n, p in floats.items()}, summary)


def _teacher_targets(graph, feeds: list[dict[str, np.ndarray]], top_k: int) -> list:
    """Per batch, the unquantized graph's top-k next-token probabilities and their token ids ([R, k] each)."""
    import torch

    targets = []
    with torch.no_grad():
        for feed in feeds:
            logits = graph.run(feed, ["logits"])["logits"].float()
            targets.append(torch.softmax(logits.reshape(-1, logits.shape[-1]), dim=-1).topk(top_k, dim=-1))
    return targets


def _train(student_loss: Callable, units: list, floats: list, options: QadOptions, batches: int,
           progress: Progress) -> list[tuple[float, float]]:
    """Adam with a cosine schedule over the grid positions (`units`, lr) and the float parameters (lr_free scaled by
    each one's RMS), one batch a step in a seeded shuffled order; (KL, top-1) per step."""
    import torch

    groups = [{"params": units, "lr": options.lr}] if options.lr > 0 and units else []
    groups += [{"params": [p], "lr": options.lr_free * max(float(p.detach().pow(2).mean().sqrt()), 1e-6)} for p in floats]
    if not groups:
        raise InputError("--qad-steps: nothing to train (no quantized weight with --qad-lr > 0, no float parameter)")
    optimizer = torch.optim.Adam(groups)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + np.cos(np.pi * s / options.steps)))
    rng = np.random.default_rng(options.seed)
    order: list[int] = []
    history: list[tuple[float, float]] = []
    started = time.time()
    for step in range(options.steps):
        order = order or list(rng.permutation(batches))
        loss, top1 = student_loss(order.pop())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        history.append((loss.item(), top1))
        if step % 10 == 9 or step == options.steps - 1:
            recent = np.mean(history[-10:], axis=0)
            progress(f"QAD step {step + 1}/{options.steps}: KL {recent[0]:.4f}, top-1 {recent[1]:.3f} "
                     f"({time.time() - started:.0f} s)")
    return history


def _top_k_kl(p, idx, log_q):
    """KL(p || q) over the teacher's top-k tokens plus one bucket for all others (a lower bound of the full KL,
    exact when the top-k hold all of p's mass); `p` [R, k] the teacher's probabilities of tokens `idx`."""
    log_q_top = log_q.gather(-1, idx)
    p_rest = (1 - p.sum(-1)).clamp_min(0)
    q_rest = (1 - log_q_top.exp().sum(-1)).clamp_min(1e-12)
    top = (p * (p.clamp_min(1e-12).log() - log_q_top)).sum(-1)
    rest = p_rest * (p_rest.clamp_min(1e-12).log() - q_rest.log())
    return (top + rest).mean()


def batches(rows: np.ndarray, batch: int) -> list[np.ndarray]:
    """`rows` [R, T] grouped `batch` at a time (the last group may be smaller)."""
    return [rows[i: i + batch] for i in range(0, len(rows), batch)]
