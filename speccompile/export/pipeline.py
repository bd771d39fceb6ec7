"""`speccompile export`: model (+ drafter) -> artifact directory, written atomically."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .. import __version__
from ..atomic_dir import atomic_output, check_artifact_output
from ..errors import InputError, check_at_least, check_one_of
from ..manifest import Manifest, remember_verified
from ..models.gguf_types import stored_weight_types
from .cpu_draft_weights import DRAFT_WEIGHTS
from .linear_ops import hybrid_drafter
from .drafters import DrafterRequest, export_drafter, parse_drafter, target_hidden_states_for, target_taps_for
from .ort_fused_graph import add_fused_variant
from .output_size import check_disk_space, drafter_estimate, estimate_export_bytes

Progress = Callable[[str], None]


@dataclass
class ExportOptions:
    dtype: str = "fp32"
    hidden_states: str | None = None  # None = whatever the drafter needs
    max_context: int | None = None
    max_verify_tokens: int = 64
    max_batch: int = 1
    drafter: str | None = None
    tree: str | None = None
    num_draft_tokens: int | None = None
    fused_cpu_graph: bool = True  # also write *.ort.onnx (GroupQueryAttention, in-place KV) for ORT CPU
    batch_slots: int = 8  # and *.ort-slots.onnx (GPU dtype: *.ort-cuda-slots.onnx): one GroupQueryAttention per slot (0: none)
    gpu_graph: bool = True  # fp16/bf16: also write *.ort-cuda.onnx (GroupQueryAttention on CUDA, device KV) for ort-cuda
    draft_cpu_weights: str = "int8"  # weights of a drafter head's ORT CPU variant: int8 | int4 | fp32 (none)
    force: bool = False


def export_artifact(model_name: str, out: Path, options: ExportOptions, progress: Progress = lambda _: None) -> Manifest:
    """Export target (+ drafter) to `out`. Nothing is left at `out` unless everything succeeded.
    Every option and path is checked first, before torch is even imported (a bad one fails in about a second);
    the disk space the output needs is checked before any weight is written."""
    from ..models.load import load_model

    request, hidden = _checked_options(model_name, out, options)
    from .decoder_graph import DecoderWeights, export_decoder

    out = Path(out)
    started = time.time()
    progress(f"loading {model_name}")
    model = load_model(model_name)  # the file headers: the weights are read while the graphs are written
    if model.left_out:  # a multimodal checkpoint's towers: "text decoder only: vision_tower, ... not exported"
        progress(model.left_out)
    cfg = model.config
    if cfg.hybrid is not None:  # docs/DESIGN.md "Hybrid linear attention": the contract graph alone, fp32, chains
        request = hybrid_drafter(cfg, options.dtype, request)
        options = dataclasses.replace(options, gpu_graph=False, batch_slots=0)
        progress(f"{cfg.architecture}: hybrid linear attention: no GPU or slotted graph (chains on ort-cpu)")
    max_context = options.max_context or cfg.max_position_embeddings
    if cfg.position_embeddings and max_context > cfg.max_position_embeddings:  # no row of the learned table past it
        raise InputError(f"max_context {max_context}: {cfg.architecture} has learned positions for "
                         f"{cfg.max_position_embeddings} tokens (n_positions)", "max_context")
    drafter = drafter_estimate(model, options.dtype, request.kind if request else None, request.path if request else None)
    needed = estimate_export_bytes(model, options.dtype, max_context + options.max_verify_tokens, options.fused_cpu_graph,
                                   options.gpu_graph, drafter)
    with atomic_output(out, options.force) as tmp:
        check_disk_space(tmp, needed, out)  # where the files will be, before any is written
        model.hash_in_background()
        progress("writing tokenizer")
        tokenizer_files = model.write_tokenizer(tmp)
        progress(f"exporting target ({cfg.architecture}, {cfg.num_hidden_layers} layers, {options.dtype})")
        digests: dict[str, str] = {}
        target = DecoderWeights(cfg, model.weights, hidden, target_taps_for(request, cfg), max_context)
        graphs = {"target": export_decoder(target, tmp / "target.onnx", "target", options.dtype, digests)}
        files = ["target.onnx", "target.onnx.data", *tokenizer_files]
        _warn_tensorrt_incompatible(tmp / "target.onnx", progress)
        if options.fused_cpu_graph:
            files += add_fused_variant(target, "target", graphs, tmp, max_context, progress, options.max_verify_tokens,
                                       slots=options.batch_slots, digests=digests)
        if options.gpu_graph and options.dtype != "fp32":  # fp32: no CUDA GroupQueryAttention kernel
            files += add_fused_variant(target, "target", graphs, tmp, max_context, progress, options.max_verify_tokens,
                                       target="cuda", slots=options.batch_slots, digests=digests)
        drafter_section = None
        if request is not None:
            request.max_context, request.fused_cpu_graph = max_context, options.fused_cpu_graph
            request.draft_cpu_weights = options.draft_cpu_weights
            progress(f"exporting drafter {request.kind}")
            exported = export_drafter(request, model, tmp, options.dtype, digests)
            graphs.update(exported.graphs)
            files += exported.files
            drafter_section = exported.manifest
        manifest = _manifest(model_name, model, graphs, max_context, options, tokenizer_files, drafter_section)
        progress("checksumming files")
        manifest.record_files(tmp, [f for f in files if (tmp / f).exists()], known=digests)
        manifest.write(tmp)
    remember_verified(out, {name: digests[name] for name in manifest.files if name in digests})  # `run` need not re-read them
    progress(f"done in {time.time() - started:.1f}s")
    return manifest


def _checked_options(model_name: str, out: Path, options: ExportOptions) -> tuple[DrafterRequest | None, str]:
    """Every option and path checked (InputError naming the option, `fields`); returns the drafter request and the target's
    hidden-state outputs. Imports torch last: an install without it fails here too, before any work."""
    from ..models.config import HIDDEN_STATE_MODES
    from ..models.load import resolve_model_path
    from .recipes import DTYPES

    check_one_of("draft_cpu_weights", options.draft_cpu_weights, DRAFT_WEIGHTS)
    request = parse_drafter(options.drafter, options.tree, options.num_draft_tokens)
    resolve_model_path(model_name)  # a missing path fails before anything is written
    check_drafter_request(request, options.tree)
    for name, least in (("max_context", 2), ("max_verify_tokens", 1), ("num_draft_tokens", 1)):
        if getattr(options, name) is not None:
            check_at_least(name, getattr(options, name), least)
    needed = target_hidden_states_for(request)
    hidden = options.hidden_states or needed
    if needed != "none" and hidden != needed:
        raise InputError(f"hidden_states {hidden}: the {request.kind} drafter needs '{needed}'", "hidden_states")
    check_artifact_output(out, options.force)
    check_one_of("dtype", options.dtype, DTYPES)
    check_one_of("hidden_states", hidden, HIDDEN_STATE_MODES)
    import torch  # noqa: F401 - the weight transposes

    return request, hidden


def _manifest(model_name: str, model, graphs: dict, max_context: int, options: ExportOptions, tokenizer_files: list[str],
              drafter_section: dict | None) -> Manifest:
    cfg = model.config
    return Manifest(
        model={
            "name": model_name,
            "source": str(model.source),
            "source_format": model.source_format,
            "source_sha256": model.source_sha256,
            "config": cfg.to_dict(),
            **({"stored_types": stored_weight_types(model.source)} if model.source_format == "gguf" else {}),
        },
        graphs=graphs,
        limits={
            "max_context": int(max_context),
            "max_verify_tokens": int(options.max_verify_tokens),
            "max_batch": int(options.max_batch),
        },
        tokenizer={
            "files": tokenizer_files,
            "chat_template": model.chat_template is not None or "chat_template.jinja" in tokenizer_files,
            "eos_token_ids": cfg.eos_token_ids,
            "bos_token_id": cfg.bos_token_id,
        },
        drafter=drafter_section,
        created_by=f"speccompile {__version__}",
    )


def check_drafter_request(request: DrafterRequest | None, tree: str | None) -> None:
    """The drafter's path and tree, checked before the (slow) export starts."""
    from ..models.load import resolve_model_path
    from ..draft_config import TREE_KINDS, DraftConfig

    if tree is not None and (request is None or request.kind not in TREE_KINDS):
        raise InputError(f"tree: only head drafters (drafter {'|'.join(TREE_KINDS)}:PATH) draft trees"
                         + (f", not {request.kind}" if request else ""), ("tree", "drafter"))
    if request is None or request.path is None:
        return
    label = f"drafter {request.kind}:{request.path}"
    if request.kind == "draft-model":
        try:
            resolve_model_path(request.path)
        except InputError as exc:
            raise InputError(f"{label}: {str(exc).partition(': ')[2] or exc}", "drafter") from None
        return
    if not Path(request.path).exists():
        raise InputError(f"{label}: no such file or directory", "drafter")
    try:
        DraftConfig.parse(request.kind, request.tree, request.num_draft_tokens)
    except InputError as exc:
        if exc.fields:  # already about an option
            raise
        raise InputError(f"tree {request.tree}: {exc}", "tree") from None


def _warn_tensorrt_incompatible(path: Path, progress: Progress) -> None:
    """Report operators/dtypes the TensorRT ONNX parser would reject (the graph still runs in ONNX Runtime)."""
    from ..accel.compat import check_tensorrt_compat

    report = check_tensorrt_compat(path)
    for problem in report.errors:
        progress(f"warning (TensorRT): {problem}")

