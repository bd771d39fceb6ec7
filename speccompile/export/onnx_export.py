"""ONNX graph files: tracing torch modules (drafter heads), saving, checking and reading interfaces.

Any module whose forward takes `(tensor inputs..., *flat_past_kv)` and returns a flat tuple can be
traced here (drafter heads with their own KV cache); decoders are built without tracing
(export/contract_graph.py). Every graph is checked by path, its weights staying on disk.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import onnx
from onnx import numpy_helper

from ..errors import SpecCompileError
from ..manifest import TensorSpec
from ..onnx_versions import pin_versions

OPSET = 21
_ELEM_NAMES = {v: k for k, v in onnx.TensorProto.DataType.items()}


def _dynamic_axes(input_names, input_axes, output_names, output_axes) -> dict[str, dict[int, str]]:
    axes: dict[str, dict[int, str]] = {}
    for name, spec in zip(input_names, input_axes):
        if spec:
            axes[name] = dict(spec)
    for name in input_names:
        if name.startswith("past_key_values"):
            axes[name] = {0: "batch", 2: "past_len"}
    for name in output_names:
        if name in output_axes:
            axes[name] = dict(output_axes[name])
        elif name.startswith("present"):
            axes[name] = {0: "batch", 2: "total_len"}
    return axes


def torch_dtype(name: str):
    """The torch dtype of an export dtype name (fp32 | fp16 | bf16)."""
    import torch

    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]


def export_module(
    module,
    example_inputs: Sequence[Any],
    example_past: Sequence[Any],
    input_axes: Sequence[dict[int, str] | None],
    input_names: list[str],
    output_names: list[str],
    output_axes: dict[str, dict[int, str]],
    path: Path,
) -> dict[str, str]:
    """Export `module(*example_inputs, *example_past)` to `path` (+ `path.data` external weights) by tracing;
    returns the sha256 of the files written (name -> hex).

    Uses torch's TorchScript-based ONNX exporter (on a 30-layer model it traces about 4x faster than the
    torch.export-based one, and its graph runs equally fast in ONNX Runtime). Drafter heads (one layer) are
    exported this way; decoders are built directly (contract_graph.py). The trace goes to a file in a
    temporary folder, so the exporter writes external data when the weights pass protobuf's 2 GiB; the graph is
    then re-saved with its weights streamed through `WeightsWriter` one at a time."""
    import tempfile

    import torch

    names = list(input_names[: len(example_inputs)]) + list(input_names[len(example_inputs):])
    axes = _dynamic_axes(names, input_axes, output_names, output_axes)
    logging.getLogger("torch").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory(dir=Path(path).parent, prefix=".trace-") as tmp:
        traced = Path(tmp) / "traced.onnx"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                with torch.no_grad():
                    torch.onnx.export(module, (*example_inputs, *example_past), str(traced), dynamo=False,
                                      input_names=names, output_names=output_names, dynamic_axes=axes,
                                      opset_version=OPSET, do_constant_folding=True)
            except Exception as exc:  # noqa: BLE001 - the exporter raises many kinds
                raise SpecCompileError(f"ONNX export failed: {str(exc).splitlines()[0]}") from exc
        model = onnx.load(str(traced), load_external_data=False)
        with torch.no_grad():
            example_outputs = module(*example_inputs, *example_past)
        if isinstance(example_outputs, torch.Tensor):
            example_outputs = (example_outputs,)
        _pin_static_output_dims(model, [tuple(t.shape) for t in example_outputs], axes)
        _name_weights(model)
        return _resave(model, Path(tmp), Path(path))


def _resave(model: onnx.ModelProto, traced_dir: Path, path: Path) -> dict[str, str]:
    """Save `model` (weights in `traced_dir` or inline) at `path`, every initializer of >= 1 KiB streamed to
    `path`.data one at a time; returns the files' sha256."""
    from ..weights_file import WeightsWriter, read_tensor

    data = path.with_name(path.name + ".data")
    kept = []
    with WeightsWriter(data) as writer:
        for init in model.graph.initializer:
            array = read_tensor(init, traced_dir)
            kept.append(writer.add(init.name, array) if array.nbytes >= 1024 else numpy_helper.from_array(np.array(array), init.name))
            del array
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    return {data.name: writer.sha256, path.name: save_graph(model, path)}


def save_graph(model: onnx.ModelProto, path: Path) -> str:
    """Write a graph whose weights are external (or small) with its versions pinned; returns its sha256."""
    import hashlib

    raw = pin_versions(model).SerializeToString()
    Path(path).write_bytes(raw)
    return hashlib.sha256(raw).hexdigest()


def _pin_static_output_dims(model: onnx.ModelProto, shapes: list[tuple[int, ...]], axes: dict[str, dict[int, str]]) -> None:
    """Give output axes that are not declared dynamic their size: the exporter sometimes names them
    (`Castlogits_dim_2` for the vocabulary of a tied lm_head) although they never change."""
    for output, shape in zip(model.graph.output, shapes):
        dynamic = axes.get(output.name, {})
        for i, dim in enumerate(output.type.tensor_type.shape.dim):
            if i not in dynamic and i < len(shape) and dim.dim_param:
                dim.dim_value = int(shape[i])


def _module_path(node: onnx.NodeProto) -> str | None:
    """'/model/layers.0/self_attn/q_proj/MatMul' -> 'model.layers.0.self_attn.q_proj'."""
    parts = [p for p in node.name.split("/") if p]
    if len(parts) < 2:
        return None
    return ".".join(parts[:-1])


def _name_weights(model: onnx.ModelProto) -> None:
    """Name weight initializers of MatMuls after their torch module (`model.layers.0.mlp.up_proj.weight_t`)."""
    inits = {i.name: i for i in model.graph.initializer}
    renames: dict[str, str] = {}
    for node in model.graph.node:
        module = _module_path(node)
        if node.op_type in ("MatMul", "Gemm") and module and len(node.input) > 1 and node.input[1] in inits:
            old = node.input[1]
            if old not in renames and old.startswith("onnx::"):
                renames[old] = f"{module}.weight_t"
    for init in model.graph.initializer:
        if init.name in renames:
            init.name = renames[init.name]
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            if name in renames:
                node.input[i] = renames[name]


ORT_CHECK_BYTES = 1 << 30  # weights up to this size: ONNX Runtime loads the graph itself; above: a probe


def check_graph_bounded(path: Path, model: onnx.ModelProto, probe: Callable[[], onnx.ModelProto]) -> None:
    """`check_graph` whose memory does not grow with the model: when the weights `model` (the graph saved at
    `path`) refers to pass ORT_CHECK_BYTES, ONNX Runtime loads `probe()` instead, a graph of the same builder
    with one layer over the same weight bytes (saved beside `path` for the check, then deleted)."""
    import tempfile

    if external_bytes(model) <= ORT_CHECK_BYTES:
        check_graph(path)
        return
    check_graph(path, load=False)
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".probe-{path.stem}-", suffix=".onnx") as fh:
        save_graph(probe(), Path(fh.name))
        check_graph(Path(fh.name))


def external_bytes(model: onnx.ModelProto) -> int:
    """Bytes of the external weights a graph refers to."""
    from ..weights_file import external_location

    return sum(where.length for t in model.graph.initializer if (where := external_location(t)) is not None)


def check_graph(path: Path, load: bool = True) -> None:
    """The full onnx checker (with shape inference), run by path: the weights stay on disk; with `load`, an
    ONNX Runtime load too (weights mapped, nothing prepacked: the check costs little memory). Raises on failure."""
    import onnxruntime as ort

    try:
        onnx.checker.check_model(str(path), full_check=True)
    except Exception as exc:  # noqa: BLE001
        raise SpecCompileError(f"{path.name}: onnx checker failed: {str(exc).splitlines()[0]}") from exc
    if not load or _uses_bfloat16(path):
        return  # ONNX Runtime's CPU provider has no bf16 kernels for most operators: bf16 graphs are for GPUs
    try:
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        opts.add_session_config_entry("session.disable_prepacking", "1")
        ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001
        raise SpecCompileError(f"{path.name}: ONNX Runtime cannot load the graph: {str(exc).splitlines()[0]}") from exc


def _uses_bfloat16(path: Path) -> bool:
    model = onnx.load(str(path), load_external_data=False)
    bf16 = onnx.TensorProto.BFLOAT16
    values = [*model.graph.input, *model.graph.output]
    return any(v.type.tensor_type.elem_type == bf16 for v in values) or any(t.data_type == bf16 for t in model.graph.initializer)


def graph_interface(path: Path) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Inputs and outputs of an ONNX file as TensorSpecs (names, dtype names, shapes with axis names)."""
    model = onnx.load(str(path), load_external_data=False)

    def specs(values) -> list[TensorSpec]:
        out = []
        for v in values:
            t = v.type.tensor_type
            shape = [d.dim_param if d.dim_param else int(d.dim_value) for d in t.shape.dim]
            out.append(TensorSpec(v.name, _ELEM_NAMES.get(t.elem_type, str(t.elem_type)).lower(), shape))
        return out

    return specs(model.graph.input), specs(model.graph.output)
