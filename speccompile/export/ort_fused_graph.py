"""The ONNX Runtime CPU fast path: the same decoder as a lean graph of `com.microsoft` fused operators.

The contract graph (`target.onnx`) is plain ONNX so that TensorRT and every ONNX Runtime execution
provider can run it; it pays for that on the CPU with ~2,900 small nodes per step and a KV cache that is
concatenated inside the graph on every call. This module writes a second graph of the same model,
`target.ort.onnx`, made of the operators ONNX Runtime fuses on the CPU:

* `GroupQueryAttention` with rotary embedding inside (positions are an input, so tree nodes at the same
  depth share a position; q/k norms after rope, Hunyuan's: a `RotaryEmbedding` before it), an additive `attention_bias` for tree masks, and a **preallocated KV buffer
  written in place** (the runtime binds the same buffer as past input and present output: no concat);
* `SkipSimplifiedLayerNormalization` (residual add + RMSNorm in one node), fused q/k/v and gate/up
  matmuls, SiLU as Sigmoid*Mul.

Weights are not written twice: the graph asks for each weight by recipe (export/recipes.py), and every recipe
the contract graph stored points at the same bytes of `target.onnx.data` (found by name in the contract graph,
never by comparing bytes); only what the contract graph lacks (the rotary cos/sin tables) goes to
`target.ort.onnx.data`. The contract graph stays the reference: tests compare the two.

The same builder writes the **GPU variant** (`target="cuda"`, `target.ort-cuda.onnx`) for ONNX Runtime's
CUDA execution provider. What differs follows what the CUDA kernels implement (onnxruntime
contrib_ops/cuda/bert/group_query_attention.cc):

* the model dtype throughout (GroupQueryAttention registers CUDA kernels for fp16 and bf16 only, so the
  export writes the GPU variant for those; the builder also writes an fp32 form, which ORT CPU runs and
  tests compare against the contract graph);
* no `attention_bias` input: attention is causal from `seqlens_k` (ONNX Runtime's flash kernel on CUDA). The GPU
  variant therefore verifies chains (n-gram, draft model, plain decoding; padding rows at the tail of a
  padded q are invisible to the real rows); a single request's tree drafts run the contract graph. The slotted
  form's **tree form** (`target.ort-cuda-tree-slots.onnx`, fused_ops.GpuSlotInputs `tree`) takes a per-slot
  `attention_bias` in every pass, which ONNX Runtime >= 1.28 runs on its unfused CUDA kernel: the batch
  decoder verifies trees there, every pass on the same attention path;
* logits leave the graph as float32 plus `next_tokens` = ArgMax of every row, so greedy decoding copies
  q integers back instead of q x vocab floats.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..errors import UnsupportedError
from ..manifest import GraphSpec, variant_name
from ..models.config import ModelConfig
from ..models.rope import long_rope_start, rope_attention_factor, rounded_inv_freq
from ..onnx_versions import installed_onnxruntime, onnxruntime_loads
from ..weights_file import WeightsWriter
from .contract_graph import contract_names
from .fused_ops import BATCH, MS_DOMAIN, PAD_INPUT, WIDE_HEAD_DIM, attention_lift, GpuSlotInputs, OneRowPadding, SlotInputs, rotary_names
from .fused_layers import _Fused, decoder_layers
from .graph_builder import value
from .linear_ops import state_values
from .onnx_export import check_graph_bounded, graph_interface, save_graph
from .recipes import EMBED, LM_HEAD, POSITIONS, DecoderWeights, Recipe, np_dtype, position_recipes, top_bias_recipes
from .weight_store import WeightStore, stored_by_recipe

TARGETS = ("cpu", "cuda")
SUFFIXES = {"cpu": ".ort.onnx", "cuda": ".ort-cuda.onnx", "slots": ".ort-slots.onnx", "cuda-slots": ".ort-cuda-slots.onnx",
            "cuda-tree-slots": ".ort-cuda-tree-slots.onnx"}
FUSED_SUFFIX = SUFFIXES["cpu"]
CUDA_DTYPES = ("fp16", "bf16")  # GroupQueryAttention's CUDA kernels (T = MLFloat16, BFloat16)
_BACKENDS = {"cpu": ["ort-cpu"], "cuda": ["ort-cuda"]}
_DESCRIPTIONS = {"cpu": "fused ONNX Runtime CPU graph", "cuda": "ONNX Runtime CUDA graph (GPU variant)"}
FUSED_MIN_ORT = "1.22"  # GroupQueryAttention's position_ids / attention_bias inputs (onnx_versions.ORT_LIMITS)
# GroupQueryAttention's attention_bias on the CUDA EP (onnxruntime PR #29525, merged 2026-07-03: the unfused kernel);
# 1.27.0 (2026-06-19) predates it, 1.28.0 is the first release after it
CUDA_BIAS_MIN_ORT = "1.28"
__all__ = ["PAD_INPUT", "BATCH", "add_fused_variant", "export_fused_variant", "fused_variant_problem", "build_fused_graph"]


def fused_variant_problem(config: ModelConfig, dtype: str, target: str = "cpu", kv_capacity: int | None = None) -> str | None:
    """Why this model cannot get the fused `target` graph with `kv_capacity` KV slots (None when it can)."""
    if target == "cpu" and dtype != "fp32":
        return f"the fused ONNX Runtime CPU graph is fp32 only (export dtype {dtype})"
    if not onnxruntime_loads(FUSED_MIN_ORT):
        installed = ".".join(map(str, installed_onnxruntime()))
        return f"it needs onnxruntime >= {FUSED_MIN_ORT} (GroupQueryAttention with position_ids/attention_bias; installed {installed})"
    if target == "cuda" and dtype not in CUDA_DTYPES:
        return (f"GroupQueryAttention has CUDA kernels for {'/'.join(CUDA_DTYPES)} only (export dtype {dtype}); "
                "ort-cuda runs the contract graph")
    if target == "cuda" and config.window_chunks and (kv_capacity is None or kv_capacity > config.sliding_window):
        return _CHUNKS.format(kv_capacity, config.sliding_window)
    if config.mla and config.head_dim > (WIDE_HEAD_DIM if target == "cpu" else 256):
        return (f"multi-head latent attention's {config.head_dim}-wide cache head: ONNX Runtime's CPU GroupQueryAttention "
                "rounds a row by the pass's rows and total at this width and no attention_lift keeps it exact"
                if target == "cpu" else f"GroupQueryAttention's CUDA flash kernels take head_size <= 256 "
                f"(multi-head latent attention's cache head: {config.head_dim}); ort-cuda runs the contract graph")
    for layer in sorted({config.layer(i).head_dim: config.layer(i) for i in range(config.num_hidden_layers)}.values(),
                        key=lambda c: c.head_dim):  # each head width of the layers (Gemma 4: two)
        if layer.head_dim % 16:
            return f"GroupQueryAttention's rotary kernel needs head_dim % 16 == 0 (head_dim {layer.head_dim})"
        if layer.rope_dim % 16:
            return f"GroupQueryAttention's rotary kernel needs rotated dims % 16 == 0 (partial rotary: {layer.rope_dim})"
    return None


def add_fused_variant(model: DecoderWeights, name: str, graphs: dict[str, GraphSpec], directory: Path, max_context: int,
                      progress=lambda _: None, pass_rows: int = 0, target: str = "cpu", slots: int = 0,
                      digests: dict[str, str] | None = None) -> list[str]:
    """Add graph `name`'s fused `target` variant to `graphs` (as variant_name(name, target)) when the model
    allows; returns the new files. `slots`: also its slotted form for that many batch slots (the same weight
    files; cpu: variant_name(name, "slots"), `SlotInputs`; cuda: variant_name(name, "cuda-slots"), `GpuSlotInputs`). The sha256 of the files written go to
    `digests`.

    `pass_rows`: KV slots past the context the graph accepts (GroupQueryAttention needs rotary tables as
    long as its total_sequence_length): a shape-invariant pass near the context end pads up to that many rows.
    cuda with `slots`: also the slotted graph's tree form (variant_name(name, "cuda-tree-slots"), per-slot
    attention_bias: tree drafts batched), over the same weight files."""
    contract = graphs[name]
    problem = fused_variant_problem(model.config, contract.dtype, target, max_context + pass_rows)
    if problem:
        progress(f"note: no {_DESCRIPTIONS[target]} for {name}: {problem}")
        return []
    progress(f"writing the {_DESCRIPTIONS[target]} for {name}" + (f" (and its {slots}-slot form)" if slots else ""))
    specs, files = export_fused_variant(model, contract, directory, max_context + pass_rows, target, slots, digests)
    graphs[variant_name(name, target)] = specs[0]
    if slots:
        graphs[variant_name(name, "slots" if target == "cpu" else "cuda-slots")] = specs[1]
    if slots and target == "cuda":
        graphs[variant_name(name, "cuda-tree-slots")] = specs[2]
    return files


def export_fused_variant(model: DecoderWeights, contract: GraphSpec, directory: Path, kv_capacity: int,
                         target: str = "cpu", slots: int = 0,
                         digests: dict[str, str] | None = None) -> tuple[list[GraphSpec], list[str]]:
    """Write `<contract stem><SUFFIXES[target]>` next to the contract graph, in the contract's dtype, with
    rotary tables for `kv_capacity` slots (and, `slots` > 0, its slotted form `<stem>.ort-slots.onnx` or
    `<stem>.ort-cuda-slots.onnx`, cuda also the tree form `<stem>.ort-cuda-tree-slots.onnx`, over the same weight
    files); returns their specs and the files written."""
    contract_path = Path(directory) / contract.file
    stem = contract_path.name.removesuffix(".onnx")
    forms = [(target, 0, False)]  # (suffix key, slots, tree)
    if slots:
        forms += [("slots", slots, False)] if target == "cpu" else [("cuda-slots", slots, False), ("cuda-tree-slots", slots, True)]
    paths = [contract_path.with_name(stem + SUFFIXES[key]) for key, _, _ in forms]
    shared = stored_by_recipe(contract_path, contract_names(model, contract.dtype))
    own = paths[0].with_name(paths[0].name + ".data")
    digests = {} if digests is None else digests
    with WeightsWriter(own) as writer:
        store = WeightStore(model.source, writer, shared)
        graphs = [build_fused_graph(model, store, kv_capacity, target, contract.dtype, slots=n, tree=tree) for _, n, tree in forms]
    files = [p.name for p in paths]
    if writer.size:
        digests[own.name] = writer.sha256
        files.append(own.name)
    else:
        own.unlink()
    probe = WeightStore(model.source, None, shared={**shared, **store.written})
    specs = []
    for graph_path, graph, (_, n, tree) in zip(paths, graphs, forms):
        digests[graph_path.name] = save_graph(graph, graph_path)
        check_graph_bounded(graph_path, graph, lambda n=n, tree=tree: build_fused_graph(
            model.first_layer(), probe, kv_capacity, target, contract.dtype, slots=n, layers=1, tree=tree))
        specs.append(_spec(contract, graph_path, target, kv_capacity, n, tree))
    return specs, files


def _spec(contract: GraphSpec, graph_path: Path, target: str, kv_capacity: int, slots: int, tree: bool = False) -> GraphSpec:
    inputs, outputs = graph_interface(graph_path)
    extra = {**contract.extra, "variant_of": contract.file, "kv_layout": "buffer", "backends": _BACKENDS[target],
             "min_onnxruntime": FUSED_MIN_ORT, "kv_capacity": int(kv_capacity)}
    if target == "cuda" and tree:  # per-slot attention_bias: the CUDA EP runs it on its unfused kernel from 1.28
        extra["masks"], extra["min_onnxruntime_cuda"] = "tree", CUDA_BIAS_MIN_ORT
    elif target == "cuda":
        extra["masks"] = "causal"  # no attention_bias: chains only (the flash kernel on CUDA)
    if slots:
        extra["slots"] = int(slots)
    if target == "cpu" and contract.head_dim > WIDE_HEAD_DIM:  # attention_pad a count (OneRowPadding, `many`);
        extra["attention_lift"] = attention_lift(contract.head_dim)  # slots: padding rows in `padded_index`
    return GraphSpec(role=contract.role, file=graph_path.name, inputs=inputs, outputs=outputs, dtype=contract.dtype,
                     num_layers=contract.num_layers, num_kv_heads=contract.num_kv_heads, head_dim=contract.head_dim,
                     hidden_states=contract.hidden_states, extra=extra)


_CHUNKS = ("Llama 4's chunked attention on {} KV slots, past its chunk of {}: GroupQueryAttention's local_window_size keeps "
           "a window, not a chunk; ort-cuda runs the contract graph")


def _unchunked(model: DecoderWeights, kv_capacity: int, target: str) -> DecoderWeights:
    """Llama 4's chunked layers in a GPU graph: positions below the chunk size all lie in chunk 0, whose mask is the
    causal one, so they are built as full-attention layers; a longer KV capacity is refused (`_CHUNKS`)."""
    cfg = model.config
    if target != "cuda" or not cfg.window_chunks:
        return model
    if kv_capacity > cfg.sliding_window:
        raise UnsupportedError(_CHUNKS.format(kv_capacity, cfg.sliding_window))
    return dataclasses.replace(model, config=dataclasses.replace(cfg, layer_types=[], sliding_window=0, window_chunks=False))


def build_fused_graph(model: DecoderWeights, store: WeightStore, max_context: int, target: str = "cpu",
                      dtype: str = "fp32", slots: int = 0, layers: int | None = None, tree: bool = False) -> onnx.ModelProto:
    """The fused graph for `target` ('cpu': attention_bias input, fp32; 'cuda': causal, model dtype, ArgMax).
    `slots`: the slotted form, one GroupQueryAttention per slot (cpu: `SlotInputs`, packed rows of any count per
    slot; cuda: `GpuSlotInputs`, the same rows per slot, causal; with `tree` a per-slot attention_bias). `layers`:
    only the first that many decoder layers (the probe of the ONNX Runtime load check)."""
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target}")
    model = _unchunked(model, max_context, target)
    f = _Fused(model, store, dtype, target)
    _rotary_tables(f, max_context + (1 if target == "cpu" else 0))  # CPU: a spare slot for OneRowPadding's row
    embed = f.weight("model.embed_tokens.weight", Recipe(EMBED, False, dtype))
    x = f.n("Gather", [embed, "input_ids"])[0]
    if model.config.embed_scale != 1.0:
        x = f.n("Mul", [x, f.const("embed_scale", model.config.embed_scale, np_dtype(dtype))])[0]
    if model.config.position_embeddings:  # learned absolute positions: every form's position_ids line up with input_ids
        x = f.n("Add", [x, _position_rows(f)])[0]
    slot_inputs = (SlotInputs(f.n, f.const, slots) if target == "cpu" else GpuSlotInputs(f.n, f.const, slots, tree)) if slots else None
    wide = model.config.max_head_dim > WIDE_HEAD_DIM
    attends = model.config.hybrid is None or not model.config.hybrid.attention_free  # (else no padding row: state_cache.py)
    padding = OneRowPadding(f.n, f.const, many=wide) if target == "cpu" and not slots and attends else None
    count = model.config.num_hidden_layers if layers is None else layers
    final, taps, presents = decoder_layers(f, x, count, padding, slot_inputs)
    outputs = _head(f, final, embed) + _kv_and_hidden_outputs(f, presents, final, taps, slots)
    inputs = slot_inputs.values() if slot_inputs is not None else _pass_inputs(target)
    for i in range(count):
        if model.config.linear(i):  # a gated delta net's committed states (export/linear_ops.py; no slotted form)
            inputs += state_values(model.config, i, f.elem, past=True)
            continue
        cache_shape = _cache_shape(model.config.layer(i), slots)
        for b in range(slots or 1):
            past = f"past_key_values.{i}.{b}" if slots else f"past_key_values.{i}"
            inputs += [value(f"{past}.{kind}", f.elem, cache_shape) for kind in ("key", "value")]
        inputs += state_values(model.config, i, f.elem, past=True) if model.config.parallel_mixer(i) else []  # Falcon-H1's mixer
    graph = helper.make_graph(f.n.nodes, "speccompile_ort_fused", inputs, outputs, f.inits)
    model_proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS_DOMAIN, 1)])
    model_proto.producer_name = "speccompile"
    return model_proto


def _position_rows(f: _Fused) -> str:
    """The learned position table's rows of `position_ids` (+ the family's offset), the index clipped to the table: a
    padding row past the context reads the last row (its output is dropped)."""
    cfg = f.model.config
    table = f.weight(POSITIONS[0], position_recipes(cfg, f.dtype)[POSITIONS[0]])
    rows = f.n("Add", ["position_ids", f.const("positions.offset", [cfg.position_offset])])[0] if cfg.position_offset else "position_ids"
    rows = f.n("Min", [rows, f.const("positions.last", [cfg.position_embeddings - 1])])[0]
    return f.n("Gather", [table, rows])[0]


def _rotary_tables(f: _Fused, rows: int) -> None:
    """cos/sin caches [rows, rope_dim / 2] per rotary kind in the graph dtype (computed in float32 from the
    rounded frequencies, times the rope's attention factor; longrope: rows at and past its boundary from the long
    set, when the model's positions reach it)."""
    for kind in f.model.config.rope_kinds():
        inv_freq = rounded_inv_freq(f.model.config, np_dtype(f.dtype), kind)
        factor = np.float32(rope_attention_factor(f.model.config, kind))
        freqs = np.arange(rows, dtype=np.float32)[:, None] * inv_freq[None, :]
        key_freq = inv_freq.tobytes()
        start = long_rope_start(f.model.config, kind, f.model.max_context or rows)
        if start is not None and start < rows:
            long = rounded_inv_freq(f.model.config, np_dtype(f.dtype), kind, long=True)
            freqs[start:] = np.arange(start, rows, dtype=np.float32)[:, None] * long[None, :]
            key_freq += long.tobytes() + str(start).encode()
        sin = (lambda t: -np.sin(t)) if f.model.config.rope_reversed else np.sin  # nanochat: the rotation by -angle
        for name, fn in zip(rotary_names(kind), (np.cos, sin)):
            key = (name, rows, f.dtype, key_freq, float(factor), f.model.config.rope_reversed)
            table = (lambda fn=fn: fn(freqs).astype(np.float32).astype(np_dtype(f.dtype))) if factor == 1 else \
                (lambda fn=fn: (fn(freqs).astype(np.float32) * factor).astype(np_dtype(f.dtype)))
            f.inits.append(f.store.computed(name, key, table))


def _head(f: _Fused, final: str, embed: str) -> list[onnx.ValueInfoProto]:
    """lm_head to float32 logits (CPU: only the rows in `logits_rows`; CUDA: plus ArgMax `next_tokens`)."""
    n, cfg, target = f.n, f.model.config, f.target
    post = cfg.logit_scale != 1.0 or bool(cfg.final_softcap)  # the family's logit multiplier / soft-capping
    raw_logits = "logits" if f.elem == TensorProto.FLOAT and not post else "logits_model_dtype"
    # CPU: only the rows in `logits_rows` go through lm_head (a prefill chunk needs its last row's logits; on
    # SmolLM2 the vocabulary projection is a fifth of a token's work). Each row's logits are those of the
    # whole pass: the Gather copies rows, and the projection computes every row alike.
    head_input = n("Gather", [final, "logits_rows"], axis=1)[0] if target == "cpu" else final
    projected = "logits_unbiased" if cfg.lm_head_bias else raw_logits
    if f.model.tied:
        flat = n("Reshape", [head_input, f.const("lm_head.flat_shape", [-1, cfg.hidden_size])])[0]
        logits2d = n("Gemm", [flat, _tied_head_table(f, embed)], transB=1)[0]
        # [batch * rows, V] -> [batch, rows, V]: the same bytes as batch 1's Unsqueeze, any batch
        rows_shape = n("Shape", [head_input], end=2)[0]
        logits_shape = n("Concat", [rows_shape, f.const("lm_head.vocab", [cfg.vocab_size])], axis=0)[0]
        n("Reshape", [logits2d, logits_shape], [projected])
    else:
        n("MatMul", [head_input, f.weight("lm_head.weight_t", Recipe(LM_HEAD, True, f.dtype))], [projected])
    if cfg.lm_head_bias:  # Phi-2
        n("Add", [projected, f.weight("lm_head.bias", top_bias_recipes(cfg, f.dtype)["lm_head.bias"])], [raw_logits])
    if raw_logits != "logits":  # the contract graph's logits are float32 too
        _logit_post(f, n("Cast", [raw_logits], to=TensorProto.FLOAT)[0] if post else raw_logits, post)
    outputs = [value("logits", TensorProto.FLOAT, [BATCH, "logits_len" if target == "cpu" else "q_len", cfg.vocab_size])]
    if target == "cuda":  # greedy decoding reads q integers back instead of q x vocab floats
        n("ArgMax", ["logits"], ["next_tokens"], axis=-1, keepdims=0, select_last_index=0)
        outputs.append(value("next_tokens", TensorProto.INT64, [BATCH, "q_len"]))
    return outputs


def _logit_post(f: _Fused, logits: str, post: bool) -> None:
    """`logits` (float32 when `post`) times the logit multiplier, soft-capped, as the output `logits`."""
    n, cfg = f.n, f.model.config
    if not post:
        n("Cast", [logits], ["logits"], to=TensorProto.FLOAT)
        return
    if cfg.logit_scale != 1.0:
        logits = n("Mul", [logits, f.const("logit_scale", cfg.logit_scale, np.float32)])[0]
    if cfg.final_softcap:
        cap = f.const("final_softcap", cfg.final_softcap, np.float32)
        logits = n("Mul", [n("Tanh", [n("Div", [logits, cap])[0]])[0], cap])[0]
    n("Identity", [logits], ["logits"])


def _tied_head_table(f: _Fused, embed: str) -> str:
    """The tied lm_head's own initializer entry over the embedding table's bytes (nothing is written twice).

    ONNX Runtime's CPU Gemm prepacks its constant B into an anonymous copy and releases the initializer when no
    other node reads it. Read through one entry, the table would stay mapped and wholly resident for the Gather
    (the prepacking touched every page) beside that copy: 2x the table. With an entry of its own, the Gemm's
    mapping is released after prepacking and the Gather's keeps only the rows it looked up (docs/cpu.md,
    Memory). CUDA keeps the one entry: there each entry would be its own device copy."""
    if f.target != "cpu":
        return embed
    return f.weight(f"{embed}.lm_head", Recipe(EMBED, False, f.dtype))


def _kv_and_hidden_outputs(f: _Fused, presents: list[str], final: str, taps: list[str], slots: int) -> list[onnx.ValueInfoProto]:
    cfg = f.model.config
    outputs = [value(name, f.elem, _cache_shape(cfg.layer(int(name.split(".")[1])), slots)) if name.startswith("present.") else
               next(v for v in state_values(cfg, int(name.split(".")[1]), f.elem, past=False) if v.name == name) for name in presents]
    if f.model.hidden_states == "final":
        f.n("Identity", [final], ["hidden_states"])
        outputs.append(value("hidden_states", f.elem, [BATCH, "q_len", cfg.hidden_size]))
    elif f.model.hidden_states == "eagle3":
        f.n("Concat", taps, ["aux_hidden_states"], axis=-1)
        outputs.append(value("aux_hidden_states", f.elem, [BATCH, "q_len", cfg.hidden_size * len(taps)]))
    return outputs


def _cache_shape(layer: ModelConfig, slots: int) -> list:
    """A layer's KV buffer shape (its own kv heads and head_dim)."""
    return [1 if slots else BATCH, layer.num_key_value_heads, "kv_capacity", layer.head_dim]


def _pass_inputs(target: str) -> list[onnx.ValueInfoProto]:
    """The inputs of the (unslotted) fused graph before its KV buffers."""
    return [
        value("input_ids", TensorProto.INT64, [BATCH, "q_len"]),
        value("position_ids", TensorProto.INT64, [BATCH, "q_len"]),
        *([value("attention_bias", TensorProto.FLOAT, [BATCH, 1, "q_len", "total_len"])] if target == "cpu" else []),
        value("seqlens_k", TensorProto.INT32, [BATCH]),
        value("total_sequence_length", TensorProto.INT32, []),
        *([value("logits_rows", TensorProto.INT64, ["logits_len"])] if target == "cpu" else []),
        *([value(PAD_INPUT, TensorProto.INT64, [1])] if target == "cpu" else []),
    ]
