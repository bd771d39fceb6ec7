"""Export a decoder (target or separate draft model) as its contract verify graph, streaming its weights.

`export_decoder` builds the graph (export/contract_graph.py) while its weights go from the checkpoint to
`<graph>.data` one at a time, converted on the way and hashed as they are written; then it checks the
graph: the onnx checker by path (the weights are never loaded into a proto) and an ONNX Runtime load, on the
graph itself when its weights are small, else on a probe built by the same builder (the first layer and
the head, pointing at the same weight bytes), so the check's memory does not grow with the model.
"""

from __future__ import annotations

from pathlib import Path

from ..manifest import GraphSpec
from ..weights_file import WeightsWriter
from .contract_graph import build_contract_graph
from .onnx_export import check_graph_bounded, graph_interface, save_graph
from .recipes import DTYPES, DecoderWeights, check_weights
from .weight_store import WeightStore

__all__ = ["DTYPES", "DecoderWeights", "export_decoder"]


def export_decoder(model: DecoderWeights, path: Path, role: str, dtype: str = "fp32",
                   digests: dict[str, str] | None = None) -> GraphSpec:
    """Write `path` (+ `path`.data) for `model` in `dtype`; returns the graph's manifest entry. The sha256 of
    the files written go to `digests` (file name -> hex), computed while writing."""
    check_weights(model.config, model.source)
    path = Path(path)
    data = path.with_name(path.name + ".data")
    with WeightsWriter(data, threaded=True) as writer:
        store = WeightStore(model.source, writer)
        graph = build_contract_graph(model, store, dtype)
    digests = {} if digests is None else digests
    digests[data.name] = writer.sha256
    digests[path.name] = save_graph(graph, path)
    probe = WeightStore(model.source, None, shared=store.written)
    check_graph_bounded(path, graph, lambda: build_contract_graph(model.first_layer(), probe, dtype, layers=1))
    inputs, outputs = graph_interface(path)
    cfg = model.config
    return GraphSpec(
        role=role,
        file=path.name,
        inputs=inputs,
        outputs=outputs,
        dtype=dtype,
        num_layers=cfg.num_hidden_layers,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.max_head_dim,  # the widest layer's (per-layer shapes: each past_key_values input has its own)
        hidden_states=model.hidden_states,
        extra={"aux_layers": list(model.aux_layers)} if model.hidden_states == "eagle3" else {},
    )
