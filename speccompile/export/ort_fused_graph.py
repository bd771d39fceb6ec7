"""The ONNX Runtime CPU fast path: the same decoder as a lean graph of `com.microsoft` fused operators.

The contract graph (`target.onnx`) is plain ONNX so that TensorRT and every ONNX Runtime execution
provider can run it; it pays for that on the CPU with ~2,900 small nodes per step and a KV cache that is
concatenated inside the graph on every call. This module writes a second graph of the same model,
`target.ort.onnx`, made of the operators ONNX Runtime fuses on the CPU:

* `GroupQueryAttention` with rotary embedding inside (positions are an input, so tree nodes at the same
  depth share a position), an additive `attention_bias` for tree masks, and a **preallocated KV buffer
  written in place** (the runtime binds the same buffer as past input and present output: no concat);
* `SkipSimplifiedLayerNormalization` (residual add + RMSNorm in one node), fused q/k/v and gate/up
  matmuls, SiLU as Sigmoid*Mul.

Weights are not written twice: every tensor whose bytes equal a tensor of the contract graph points at
the same bytes of `target.onnx.data`; only what the contract graph lacks (the rotary cos/sin tables)
goes to `target.ort.onnx.data`. The contract graph stays the reference: tests compare the two.

The same builder writes the **GPU variant** (`target="cuda"`, `target.ort-cuda.onnx`) for ONNX Runtime's
CUDA execution provider. What differs follows what the CUDA kernels implement (onnxruntime
contrib_ops/cuda/bert/group_query_attention.cc):

* the model dtype throughout (GroupQueryAttention registers CUDA kernels for fp16 and bf16 only, so the
  export writes the GPU variant for those; the builder also writes an fp32 form, which ORT CPU runs and
  tests compare against the contract graph);
* no `attention_bias` input: the CUDA kernel rejects it, attention is causal from `seqlens_k`. The GPU
  variant therefore verifies chains (n-gram, draft model, plain decoding; padding rows at the tail of a
  padded q are invisible to the real rows); tree drafts run the contract graph;
* logits leave the graph as float32 plus `next_tokens` = ArgMax of every row, so greedy decoding copies
  q integers back instead of q x vocab floats.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..manifest import GraphSpec, variant_name
from ..onnx_versions import installed_onnxruntime, onnxruntime_loads, save_model
from ..models.config import ModelConfig
from .onnx_export import check_graph, graph_interface

TARGETS = ("cpu", "cuda")
SUFFIXES = {"cpu": ".ort.onnx", "cuda": ".ort-cuda.onnx", "slots": ".ort-slots.onnx"}
FUSED_SUFFIX = SUFFIXES["cpu"]
CUDA_DTYPES = ("fp16", "bf16")  # GroupQueryAttention's CUDA kernels (T = MLFloat16, BFloat16)
_BACKENDS = {"cpu": ["ort-cpu"], "cuda": ["ort-cuda"]}
_DESCRIPTIONS = {"cpu": "fused ONNX Runtime CPU graph", "cuda": "ONNX Runtime CUDA graph (GPU variant)"}
FUSED_MIN_ORT = "1.22"  # GroupQueryAttention's position_ids / attention_bias inputs (onnx_versions.ORT_LIMITS)
_MS = "com.microsoft"
PAD_INPUT = "attention_pad"  # CPU graph: 1 appends attention's padding row to a pass (_OneRowPadding)
BATCH = "batch"  # the dynamic batch axis: one row per sequence, each with its own KV rows and seqlens_k
_ELEM = {"fp32": TensorProto.FLOAT, "fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}


def _np_dtype(dtype: str):
    if dtype == "bf16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return {"fp32": np.float32, "fp16": np.float16}[dtype]


def fused_variant_problem(config: ModelConfig, dtype: str, target: str = "cpu") -> str | None:
    """Why this model cannot get the fused `target` graph (None when it can)."""
    if target == "cpu" and dtype != "fp32":
        return f"the fused ONNX Runtime CPU graph is fp32 only (export dtype {dtype})"
    if not onnxruntime_loads(FUSED_MIN_ORT):
        installed = ".".join(map(str, installed_onnxruntime()))
        return f"it needs onnxruntime >= {FUSED_MIN_ORT} (GroupQueryAttention with position_ids/attention_bias; installed {installed})"
    if target == "cuda" and dtype not in CUDA_DTYPES:
        return (f"GroupQueryAttention has CUDA kernels for {'/'.join(CUDA_DTYPES)} only (export dtype {dtype}); "
                "ort-cuda runs the contract graph")
    if config.head_dim % 16:
        return f"GroupQueryAttention's rotary kernel needs head_dim % 16 == 0 (head_dim {config.head_dim})"
    return None


def add_fused_variant(decoder, name: str, graphs: dict[str, GraphSpec], directory: Path, max_context: int,
                      progress=lambda _: None, pass_rows: int = 0, target: str = "cpu", slots: int = 0) -> list[str]:
    """Add graph `name`'s fused `target` variant to `graphs` (as variant_name(name, target)) when the model
    allows; returns the new files. `slots` (cpu): also its slotted form for that many batch slots
    (variant_name(name, "slots"), the same weight files; `_SlotInputs`).

    `pass_rows`: KV slots past the context the graph accepts (GroupQueryAttention needs rotary tables as
    long as its total_sequence_length): a shape-invariant pass near the context end pads up to that many rows."""
    contract = graphs[name]
    problem = fused_variant_problem(decoder.config, contract.dtype, target)
    if problem:
        progress(f"note: no {_DESCRIPTIONS[target]} for {name}: {problem}")
        return []
    progress(f"writing the {_DESCRIPTIONS[target]} for {name}" + (f" (and its {slots}-slot form)" if slots else ""))
    specs, files = export_fused_variant(decoder, contract, directory, max_context + pass_rows, target, slots)
    graphs[variant_name(name, target)] = specs[0]
    if slots:
        graphs[variant_name(name, "slots")] = specs[1]
    return files


def export_fused_variant(decoder, contract: GraphSpec, directory: Path, kv_capacity: int,
                         target: str = "cpu", slots: int = 0) -> tuple[list[GraphSpec], list[str]]:
    """Write `<contract stem><SUFFIXES[target]>` next to the contract graph, in the contract's dtype, with
    rotary tables for `kv_capacity` slots (and, `slots` > 0 on the CPU, `<stem>.ort-slots.onnx` over the same
    weight files); returns their specs and the files written."""
    contract_path = Path(directory) / contract.file
    stem = contract_path.name.removesuffix(".onnx")
    path = contract_path.with_name(stem + SUFFIXES[target])
    weights = SharedWeights(contract_path, path.name + ".data")
    models = [(path, _build_model(decoder, weights, kv_capacity, target, contract.dtype))]
    if slots and target == "cpu":
        models.append((contract_path.with_name(stem + SUFFIXES["slots"]),
                       _build_model(decoder, weights, kv_capacity, target, contract.dtype, slots=slots)))
    files = [p.name for p, _ in models]
    if weights.write_own(directory):
        files.append(weights.own_location)
    specs = []
    for graph_path, model in models:
        save_model(model, graph_path)
        check_graph(graph_path)
        inputs, outputs = graph_interface(graph_path)
        extra = {**contract.extra, "variant_of": contract.file, "kv_layout": "buffer", "backends": _BACKENDS[target],
                 "min_onnxruntime": FUSED_MIN_ORT, "kv_capacity": int(kv_capacity)}
        if target == "cuda":
            extra["masks"] = "causal"  # no attention_bias on CUDA: chains only, tree drafts use the contract graph
        if graph_path != path:
            extra["slots"] = int(slots)
        specs.append(GraphSpec(
            role=contract.role, file=graph_path.name, inputs=inputs, outputs=outputs, dtype=contract.dtype,
            num_layers=contract.num_layers, num_kv_heads=contract.num_kv_heads, head_dim=contract.head_dim,
            hidden_states=contract.hidden_states, extra=extra,
        ))
    return specs, files


class SharedWeights:
    """Initializers that reuse the contract graph's external data where the bytes are identical."""

    def __init__(self, contract_path: Path, own_location: str):
        self.own_location = own_location
        self._own: list[bytes] = []
        self._own_size = 0
        self._index: dict[tuple, list[tuple[str, str]]] = {}
        contract = onnx.load(str(contract_path), load_external_data=False)
        files: dict[str, np.memmap] = {}
        for init in contract.graph.initializer:
            info = {e.key: e.value for e in init.external_data}
            if init.data_location != TensorProto.EXTERNAL or "location" not in info:
                continue
            location = info["location"]
            if location not in files:
                files[location] = np.memmap(contract_path.parent / location, dtype=np.uint8, mode="r")
            data = files[location]
            start = int(info.get("offset", 0))
            raw = data[start : start + int(info["length"])]
            key = (init.data_type, tuple(init.dims), hashlib.blake2b(raw, digest_size=16).digest())
            self._index[key] = [(k, v) for k, v in info.items()]

    def tensor(self, name: str, array: np.ndarray) -> TensorProto:
        """An initializer `name` holding `array`, pointing into the contract's data when possible."""
        array = np.ascontiguousarray(array)
        proto = onnx.numpy_helper.from_array(array, name)
        key = (proto.data_type, tuple(array.shape), hashlib.blake2b(array.tobytes(), digest_size=16).digest())
        external = self._index.get(key)
        if external is None:  # written once to the own file, shared by every graph built with these weights
            raw = array.tobytes()
            external = [("location", self.own_location), ("offset", str(self._own_size)), ("length", str(len(raw)))]
            self._own.append(raw)
            self._own_size += len(raw)
            self._index[key] = external
        proto.ClearField("raw_data")
        proto.data_location = TensorProto.EXTERNAL
        for k, v in external:
            proto.external_data.add(key=k, value=v)
        return proto

    def write_own(self, directory: Path) -> bool:
        """Write the tensors the contract graph did not have; False when there were none."""
        if not self._own:
            return False
        with open(Path(directory) / self.own_location, "wb") as fh:
            for raw in self._own:
                fh.write(raw)
        return True


class _Nodes:
    """A tiny node writer: unique output names, optional outputs as ''."""

    def __init__(self):
        self.nodes: list[onnx.NodeProto] = []
        self._count = 0

    def __call__(self, op: str, inputs: list[str], outputs: int | list[str] = 1, domain: str = "", **attrs) -> list[str]:
        self._count += 1
        if isinstance(outputs, int):
            outputs = [f"{op.lower()}_{self._count}_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op, inputs, outputs, name=f"{op}_{self._count}", domain=domain, **attrs))
        return outputs


def _numpy(param) -> np.ndarray:
    return param.detach().to("cpu").float().numpy()


def _rotary_tables(decoder, max_context: int) -> tuple[np.ndarray, np.ndarray]:
    inv_freq = decoder.model.rotary_emb.inv_freq.detach().float().numpy()
    freqs = np.arange(max_context, dtype=np.float32)[:, None] * inv_freq[None, :]
    return np.cos(freqs).astype(np.float32), np.sin(freqs).astype(np.float32)


def _build_model(decoder, weights: SharedWeights, max_context: int, target: str = "cpu", dtype: str = "fp32",
                 slots: int = 0) -> onnx.ModelProto:
    """The fused graph for `target` ('cpu': attention_bias input, fp32; 'cuda': causal, model dtype, ArgMax).
    `slots` (cpu): the slotted form, one GroupQueryAttention per slot (`_SlotInputs`)."""
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target}")
    cfg = decoder.config
    heads, kv_heads, dim, hidden = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
    eps = float(cfg.rms_norm_eps)
    elem, np_dtype = _ELEM[dtype], _np_dtype(dtype)
    n = _Nodes()
    inits: list[TensorProto] = []

    def init(name: str, array: np.ndarray) -> str:
        """A float weight in the graph's dtype (fp32 master copies are rounded the way torch rounds them)."""
        inits.append(weights.tensor(name, np.asarray(array, dtype=np.float32).astype(np_dtype)))
        return name

    consts: dict[str, np.ndarray] = {}

    def const(name: str, values, dtype=np.int64) -> str:
        """An integer constant initializer; asking again for `name` (with the same values) reuses it."""
        values = np.asarray(values, dtype=dtype)
        if name in consts:
            assert np.array_equal(consts[name], values), name
            return name
        consts[name] = values
        inits.append(onnx.numpy_helper.from_array(values, name))
        return name

    # CPU: one spare rotary slot past kv_capacity, for the padding row of a one-row pass (_OneRowPadding)
    cos, sin = _rotary_tables(decoder, max_context + (1 if target == "cpu" else 0))
    init("rotary.cos_cache", cos)
    init("rotary.sin_cache", sin)
    embed = init("model.embed_tokens.weight", _numpy(decoder.model.embed_tokens.weight))
    x = n("Gather", [embed, "input_ids"])[0]
    residual = x
    taps: list[str] = []
    presents: list[str] = []
    mlp_out = None
    slot_inputs = _SlotInputs(n, const, slots) if slots else None
    padding = _OneRowPadding(n, const) if target == "cpu" and not slots else None
    for i, layer in enumerate(decoder.model.layers):
        pre = f"layers.{i}"
        gamma = init(f"{pre}.input_layernorm.weight", _numpy(layer.input_layernorm.weight))
        if mlp_out is None:
            h = _rms_norm(n, x, gamma, eps, const, pre, elem)
        else:
            h, residual = _skip_norm(n, mlp_out, residual, gamma, eps)
        if i in decoder.aux_layers:
            taps.append(residual)
        attn = layer.self_attn
        qkv_weight = np.concatenate([_numpy(p.weight) for p in (attn.q_proj, attn.k_proj, attn.v_proj)], axis=0)
        qkv = n("MatMul", [h, init(f"{pre}.self_attn.qkv.weight_t", qkv_weight.T)])[0]
        if attn.q_proj.bias is not None:
            bias = np.concatenate([_numpy(p.bias) for p in (attn.q_proj, attn.k_proj, attn.v_proj)])
            qkv = n("Add", [qkv, init(f"{pre}.self_attn.qkv.bias", bias)])[0]
        if attn.q_norm is not None:
            split = const(f"{pre}.qkv_split", [heads * dim, kv_heads * dim, kv_heads * dim])
            q, k, v = n("Split", [qkv, split], 3, axis=-1)
            q = _head_norm(n, q, heads, dim, init(f"{pre}.self_attn.q_norm.weight", _numpy(attn.q_norm.weight)), eps, const, f"{pre}.q", elem)
            k = _head_norm(n, k, kv_heads, dim, init(f"{pre}.self_attn.k_norm.weight", _numpy(attn.k_norm.weight)), eps, const, f"{pre}.k", elem)
            query = [q, k, v]
        else:
            query = [qkv, "", ""]
        gqa = dict(domain=_MS, num_heads=heads, kv_num_heads=kv_heads, scale=float(1.0 / np.sqrt(dim)),
                   do_rotary=1, rotary_interleaved=0, local_window_size=-1)
        rotary = ["rotary.cos_cache", "rotary.sin_cache"]
        if slot_inputs is not None:  # each slot's rows through a GroupQueryAttention of their own, over that slot's KV
            parts = [slot_inputs.split(x) if x else [""] * slots for x in query]
            outs = []
            for b in range(slots):
                past, present = f"past_key_values.{i}.{b}", f"present.{i}.{b}"
                out = n("GroupQueryAttention", [*(part[b] for part in parts), f"{past}.key", f"{past}.value",
                                                *slot_inputs.lengths[b], *rotary, slot_inputs.positions[b], f"attention_bias.{b}"],
                        [f"attn_{i}_{b}_padded", f"{present}.key", f"{present}.value"], **gqa)[0]
                outs.append(out)
                presents += [f"{present}.key", f"{present}.value"]
            out = slot_inputs.join(outs, f"attn_{i}")
        else:
            present_k, present_v = f"present.{i}.key", f"present.{i}.value"
            if padding is None:  # the CUDA kernel rejects attention_bias
                lengths = ["seqlens_k", "total_sequence_length"]
                extra = ["position_ids"]
            else:
                query = [padding.rows(x) if x else "" for x in query]
                lengths = [padding.seqlens_k, padding.total_sequence_length]
                extra = [padding.position_ids, padding.attention_bias]
            out = n("GroupQueryAttention", [*query, f"past_key_values.{i}.key", f"past_key_values.{i}.value", *lengths,
                                            *rotary, *extra],
                    [f"attn_{i}" if padding is None else f"attn_{i}_padded", present_k, present_v], **gqa)[0]
            if padding is not None:
                out = padding.drop(out, f"attn_{i}")
            presents += [present_k, present_v]
        o = n("MatMul", [out, init(f"{pre}.self_attn.o_proj.weight_t", _numpy(attn.o_proj.weight).T)])[0]
        gamma = init(f"{pre}.post_attention_layernorm.weight", _numpy(layer.post_attention_layernorm.weight))
        h, residual = _skip_norm(n, o, residual, gamma, eps)
        mlp = layer.mlp
        gate_up = np.concatenate([_numpy(mlp.gate_proj.weight), _numpy(mlp.up_proj.weight)], axis=0)
        gu = n("MatMul", [h, init(f"{pre}.mlp.gate_up.weight_t", gate_up.T)])[0]
        inter = mlp.gate_proj.out_features
        gate, up = n("Split", [gu, const(f"{pre}.mlp_split", [inter, inter])], 2, axis=-1)
        act = n("Mul", [n("Mul", [gate, n("Sigmoid", [gate])[0]])[0], up])[0]
        mlp_out = n("MatMul", [act, init(f"{pre}.mlp.down_proj.weight_t", _numpy(mlp.down_proj.weight).T)])[0]
    final, _ = _skip_norm(n, mlp_out, residual, init("model.norm.weight", _numpy(decoder.model.norm.weight)), eps)
    raw_logits = "logits" if elem == TensorProto.FLOAT else "logits_model_dtype"
    # CPU: only the rows in `logits_rows` go through lm_head (a prefill chunk needs its last row's logits; on
    # SmolLM2 the vocabulary projection is a fifth of a token's work). Each row's logits are those of the
    # whole pass: the Gather copies rows, and the projection computes every row alike.
    head_input = n("Gather", [final, "logits_rows"], axis=1)[0] if target == "cpu" else final
    if cfg.tie_word_embeddings:
        flat = n("Reshape", [head_input, const("lm_head.flat_shape", [-1, hidden])])[0]
        logits2d = n("Gemm", [flat, embed], transB=1)[0]
        # [batch * rows, V] -> [batch, rows, V]: the same bytes as batch 1's Unsqueeze, any batch
        rows_shape = n("Shape", [head_input], end=2)[0]
        logits_shape = n("Concat", [rows_shape, const("lm_head.vocab", [cfg.vocab_size])], axis=0)[0]
        n("Reshape", [logits2d, logits_shape], [raw_logits])
    else:
        n("MatMul", [head_input, init("lm_head.weight_t", _numpy(decoder.lm_head.weight).T)], [raw_logits])
    if raw_logits != "logits":
        n("Cast", [raw_logits], ["logits"], to=TensorProto.FLOAT)  # the contract graph's logits are float32 too
    outputs = [_value("logits", TensorProto.FLOAT, [BATCH, "logits_len" if target == "cpu" else "q_len", cfg.vocab_size])]
    if target == "cuda":  # greedy decoding reads q integers back instead of q x vocab floats
        n("ArgMax", ["logits"], ["next_tokens"], axis=-1, keepdims=0, select_last_index=0)
        outputs.append(_value("next_tokens", TensorProto.INT64, [BATCH, "q_len"]))
    cache_shape = [1 if slots else BATCH, kv_heads, "kv_capacity", dim]
    outputs += [_value(name, elem, cache_shape) for name in presents]
    if decoder.hidden_mode == "final":
        n("Identity", [final], ["hidden_states"])
        outputs.append(_value("hidden_states", elem, [BATCH, "q_len", hidden]))
    elif decoder.hidden_mode == "eagle3":
        n("Concat", taps, ["aux_hidden_states"], axis=-1)
        outputs.append(_value("aux_hidden_states", elem, [BATCH, "q_len", hidden * len(taps)]))
    if slot_inputs is not None:
        inputs = slot_inputs.values()
    else:
        inputs = _pass_inputs(target)
    for i in range(cfg.num_hidden_layers):
        for b in range(slots or 1):
            past = f"past_key_values.{i}.{b}" if slots else f"past_key_values.{i}"
            inputs += [_value(f"{past}.{kind}", elem, cache_shape) for kind in ("key", "value")]
    graph = helper.make_graph(n.nodes, "speccompile_ort_fused", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(_MS, 1)])
    model.producer_name = "speccompile"
    return model


def _pass_inputs(target: str) -> list[onnx.ValueInfoProto]:
    """The inputs of the (unslotted) fused graph before its KV buffers."""
    return [
        _value("input_ids", TensorProto.INT64, [BATCH, "q_len"]),
        _value("position_ids", TensorProto.INT64, [BATCH, "q_len"]),
        *([_value("attention_bias", TensorProto.FLOAT, [BATCH, 1, "q_len", "total_len"])] if target == "cpu" else []),
        _value("seqlens_k", TensorProto.INT32, [BATCH]),
        _value("total_sequence_length", TensorProto.INT32, []),
        *([_value("logits_rows", TensorProto.INT64, ["logits_len"])] if target == "cpu" else []),
        *([_value(PAD_INPUT, TensorProto.INT64, [1])] if target == "cpu" else []),
    ]


class _OneRowPadding:
    """The CPU graph's `attention_pad` input (int64 [1], 0 or 1): with 1, every GroupQueryAttention gets a copy
    of the pass's last row appended (same position; its KV lands one slot past the pass's rows; its output is
    dropped), so a one-row pass runs the same kernels as a multi-row one.

    Why: ONNX Runtime CPU's attention multiplies probabilities by values with MLAS's dedicated one-row SGEMM
    kernel when a pass has one row, and with the general kernel otherwise; the two sum in different orders, so
    a position's logits differed by up to ~4e-5 between plain decoding (q = 1) and a verify pass (q > 1).
    With the padding row every pass has >= 2 rows, and MLAS computes each row of the general kernel alike
    whatever the number of rows: a position's logits are the same bits in any pass (tests/test_ort_fused.py).
    Everything outside the attention (the weight matmuls, norms, lm_head) already is row-independent.
    ONNX Runtime refuses more than one row per sequence at batch > 1 with a past, so batched one-row
    passes run with 0 (runtime/batch.py); the slotted graph gets the same padding row per slot from the
    caller's row layout (`_SlotInputs`)."""

    def __init__(self, n: _Nodes, const):
        self._n = n
        pad = PAD_INPUT
        const("pad.axis", [1])
        const("pad.zero", [0])
        q_len = n("Shape", ["input_ids"], start=1, end=2)[0]
        self.q_len = q_len
        self._last = n("Sub", [q_len, const("pad.one", [1])])[0]
        self._end = n("Add", [self._last, pad])[0]  # [last, last + pad): the last row, or no row
        self.position_ids = self.rows("position_ids")
        pad32 = n("Cast", [pad], to=TensorProto.INT32)[0]
        self.seqlens_k = n("Add", ["seqlens_k", pad32])[0]
        self.total_sequence_length = n("Add", ["total_sequence_length", n("Squeeze", [pad32])[0]])[0]
        # the padding row sees every slot up to its own (bias 0; causal inside); no real row reaches its slot
        pads = n("Concat", [const("pad.bias_begin", [0, 0, 0, 0, 0, 0]), pad, pad], axis=0)[0]
        self.attention_bias = n("Pad", ["attention_bias", pads])[0]

    def rows(self, x: str) -> str:
        """`x` [batch, q, ...] with the padding row (if any) appended."""
        extra = self._n("Slice", [x, self._last, self._end, "pad.axis"])[0]
        return self._n("Concat", [x, extra], axis=1)[0]

    def drop(self, x: str, name: str) -> str:
        """`x` without the padding row, as `name`."""
        return self._n("Slice", [x, "pad.zero", self.q_len, "pad.axis"], [name])[0]


class _SlotInputs:
    """The slotted CPU graph's inputs: the rows of up to `slots` sequences packed along one pass (`input_ids`,
    `position_ids` [1, rows], slot b's rows after slot b - 1's; at least one each), and how each slot's
    GroupQueryAttention sees them, laid out by the caller (backends/ort_slots.py): `padded_index` [padded]
    gathers every slot's rows plus, for a one-row slot, its row again as the attention padding row
    (`_OneRowPadding`); `padded_rows` [slots] splits them per slot; `unpadded_index` [rows] gathers the real rows
    back; per slot `seqlens_k`, `total_sequence_length` (int32 [slots], padding counted) and
    `attention_bias.{b}` [1, 1, q_b + pad_b, total_b] (padding row and column 0), and its KV buffers
    `past_key_values.{layer}.{b}.*`. The weight matmuls run over every slot's rows at once; each slot's
    attention is a batch of one, which ONNX Runtime takes with several rows and the padding row, so a slot's
    rows compute the same bits as the same rows of that sequence alone. One Gather, Split and Concat per
    layer and tensor lay the rows out (per-slot Slice/Concat nodes cost ~5 ms a pass on SmolLM2)."""

    def __init__(self, n: _Nodes, const, slots: int):
        self._n = n
        self.slots = slots
        self.positions = self.split("position_ids")
        self.lengths = []
        for b in range(slots):
            at, to = const(f"slot.{b}.start", [b]), const(f"slot.{b}.end", [b + 1])
            seqlens = n("Slice", ["seqlens_k", at, to])[0]
            total = n("Squeeze", [n("Slice", ["total_sequence_length", at, to])[0]])[0]
            self.lengths.append((seqlens, total))

    def split(self, x: str) -> list[str]:
        """`x` [1, rows, ...] as each slot's padded rows."""
        padded = self._n("Gather", [x, "padded_index"], axis=1)[0]
        return self._n("Split", [padded, "padded_rows"], self.slots, axis=1)

    def join(self, outs: list[str], name: str) -> str:
        """Every slot's attention output back as the pass's real rows."""
        padded = self._n("Concat", outs, axis=1)[0]
        return self._n("Gather", [padded, "unpadded_index"], [name], axis=1)[0]

    def values(self) -> list[onnx.ValueInfoProto]:
        return [
            _value("input_ids", TensorProto.INT64, [1, "rows"]),
            _value("position_ids", TensorProto.INT64, [1, "rows"]),
            _value("padded_index", TensorProto.INT64, ["padded"]),
            _value("padded_rows", TensorProto.INT64, [self.slots]),
            _value("unpadded_index", TensorProto.INT64, ["rows"]),
            _value("seqlens_k", TensorProto.INT32, [self.slots]),
            _value("total_sequence_length", TensorProto.INT32, [self.slots]),
            *[_value(f"attention_bias.{b}", TensorProto.FLOAT, [1, 1, f"q_{b}", f"total_{b}"]) for b in range(self.slots)],
            _value("logits_rows", TensorProto.INT64, ["logits_len"]),
        ]


def _skip_norm(n: _Nodes, x: str, residual: str, gamma: str, eps: float) -> tuple[str, str]:
    """RMSNorm(x + residual) and the new residual stream, as one SkipSimplifiedLayerNormalization."""
    normed, total = f"{x}_normed", f"{x}_plus_residual"
    n("SkipSimplifiedLayerNormalization", [x, residual, gamma], [normed, "", "", total], domain=_MS, epsilon=eps)
    return normed, total


def _head_norm(n: _Nodes, x: str, num_heads: int, dim: int, gamma: str, eps: float, const, prefix: str,
               elem: int = TensorProto.FLOAT) -> str:
    """Qwen3's per-head RMSNorm of q or k: [1, q, heads*dim] -> per head -> back."""
    per_head = n("Reshape", [x, const(f"{prefix}_heads_shape", [0, -1, num_heads, dim])])[0]
    normed = _rms_norm(n, per_head, gamma, eps, const, prefix, elem)
    return n("Reshape", [normed, const(f"{prefix}_flat_shape", [0, -1, num_heads * dim])])[0]


def _rms_norm(n: _Nodes, x: str, gamma: str, eps: float, const, prefix: str, elem: int = TensorProto.FLOAT) -> str:
    """RMSNorm over the last axis from opset-18 operators (ONNX's RMSNormalization needs opset 23, which
    onnxruntime < 1.23 and onnx < 1.18 do not have); ONNX Runtime fuses the pattern into one kernel.
    A graph in fp16/bf16 (`elem`) normalises in float32 and rounds before the gain, as the torch model does."""
    wide = x if elem == TensorProto.FLOAT else n("Cast", [x], to=TensorProto.FLOAT)[0]
    square = n("Pow", [wide, const(f"{prefix}_norm_two", 2.0, np.float32)])[0]
    mean = n("ReduceMean", [square, const(f"{prefix}_norm_axis", [-1])], keepdims=1)[0]
    root = n("Sqrt", [n("Add", [mean, const(f"{prefix}_norm_eps", eps, np.float32)])[0]])[0]
    normed = n("Div", [wide, root])[0]
    if elem != TensorProto.FLOAT:
        normed = n("Cast", [normed], to=elem)[0]
    return n("Mul", [normed, gamma])[0]


def _value(name: str, elem: int, shape: list) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)
