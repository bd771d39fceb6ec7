"""Quantized ONNX Runtime CPU variant of a drafter head graph (`<kind>.ort.onnx`).

A drafter only proposes tokens; the target verifies every one of them, so the drafter's weights may
be rounded without changing a single output token (only how many drafts are accepted). On the CPU a
head step is memory-bound: int8 weights make it ~3x faster, int4 ~5x (EAGLE-3 head for SmolLM2:
3.6 ms -> 1.1 ms / 0.7 ms per step), which is most of what drafting costs per target pass.

The variant keeps the contract graph's inputs and outputs (the runtime drives it the same way); its
MatMul weights become ONNX Runtime `MatMulNBits` (block-wise, symmetric, int8 activations inside the
kernel). Weights it leaves alone (the token embedding) point into the contract graph's data file.
Listed in the manifest as `<kind>-ort` with `extra.weights`; `build` drops it like the fused target.
"""

from __future__ import annotations

from pathlib import Path


from ..manifest import GraphSpec, variant_name

DRAFT_WEIGHTS = ("int8", "int4", "fp32")
BLOCK_SIZE = 32
ACCURACY_LEVEL = 4  # MatMulNBits computes with int8-quantized activations (the fast CPU kernels)


def add_quantized_head_variant(name: str, graphs: dict[str, GraphSpec], directory: Path, weights: str,
                               progress=lambda _: None, digests: dict[str, str] | None = None) -> list[str]:
    """Add head graph `name`'s CPU variant with `weights` (int8|int4) to `graphs`; returns the files written
    (their sha256 into `digests`)."""
    if weights == "fp32":
        return []
    contract = graphs[name]
    if contract.dtype != "fp32":
        progress(f"note: no {weights} CPU variant of {name}: quantizing starts from fp32 (export dtype {contract.dtype})")
        return []
    progress(f"writing the {weights} ONNX Runtime CPU variant of {name}")
    from ..onnx_versions import installed_onnxruntime, onnxruntime_loads, pin_versions, required_onnxruntime, version_string
    from .onnx_export import check_graph, graph_interface
    from .ort_fused_graph import FUSED_SUFFIX

    contract_path = Path(directory) / contract.file
    path = contract_path.with_name(contract_path.name.removesuffix(".onnx") + FUSED_SUFFIX)
    model = quantize_matmul_weights(contract_path, int(weights.removeprefix("int")))
    required = version_string(required_onnxruntime(pin_versions(model)) or installed_onnxruntime())
    if not onnxruntime_loads(required):
        progress(f"note: no {weights} CPU variant of {name}: it needs onnxruntime >= {required} "
                 f"(installed {version_string(installed_onnxruntime())})")
        return []
    files = _save_sharing_weights(model, contract_path, path, {} if digests is None else digests)
    check_graph(path)
    inputs, outputs = graph_interface(path)
    extra = {**contract.extra, "variant_of": contract.file, "weights": weights, "backends": ["ort-cpu"],
             "min_onnxruntime": required}
    graphs[variant_name(name)] = GraphSpec(
        role=contract.role, file=path.name, inputs=inputs, outputs=outputs, dtype=contract.dtype,
        num_layers=contract.num_layers, num_kv_heads=contract.num_kv_heads, head_dim=contract.head_dim,
        hidden_states=contract.hidden_states, extra=extra,
    )
    return files


def quantize_matmul_weights(path: Path, bits: int):
    """The graph at `path` with every MatMul by a constant weight turned into MatMulNBits (`bits` = 4 or 8)."""
    import logging

    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quiet = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    level = quiet.level
    quiet.setLevel(logging.WARNING)  # it logs every node it visits at INFO
    try:
        quantizer = MatMulNBitsQuantizer(onnx.load(str(path)), bits=bits, block_size=BLOCK_SIZE, is_symmetric=True,
                                         accuracy_level=ACCURACY_LEVEL)
        quantizer.process()
    finally:
        quiet.setLevel(level)
    return quantizer.model.model


def _save_sharing_weights(model, contract_path: Path, path: Path, digests: dict[str, str]) -> list[str]:
    """Save `model` at `path`: an initializer the quantizer left alone (its name, type and shape are the contract
    graph's) points at the contract's bytes; the others of >= 1 KiB go to `path`.data, streamed."""
    from onnx import numpy_helper

    from ..weights_file import WeightsWriter, external_location, load_graph
    from .onnx_export import save_graph
    from .weight_store import StoredTensor

    contract = {}
    for init in load_graph(contract_path).graph.initializer:
        where = external_location(init)
        if where is not None:
            contract[init.name] = StoredTensor(where, init.data_type, tuple(init.dims))
    own = path.with_name(path.name + ".data")
    kept = []
    with WeightsWriter(own) as writer:
        for init in model.graph.initializer:
            shared = contract.get(init.name)
            if shared is not None and (shared.data_type, shared.dims) == (init.data_type, tuple(init.dims)):
                kept.append(shared.proto(init.name))
                continue
            array = numpy_helper.to_array(init)
            kept.append(writer.add(init.name, array) if array.nbytes >= 1024 else init)
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    files = [path.name]
    if writer.size:
        digests[own.name] = writer.sha256
        files.append(own.name)
    else:
        own.unlink()
    digests[path.name] = save_graph(model, path)
    return files
