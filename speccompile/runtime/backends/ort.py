"""ONNX Runtime backend: CPU (the embedded default), CUDA EP and TensorRT EP, with I/O binding.

The KV cache stays in OrtValues between steps (bound as inputs, outputs bound to the device), so
decoding copies no cache data on the Python side; only logits (and hidden states) come back as numpy.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ...errors import InputError, UnsupportedError
from ...manifest import GraphSpec, Manifest
from ..kvcache import BufferKVCache, KVCache
from ..state_cache import BufferStateCache, StateCache, state_inputs, with_zero_states
from .base import StepOutput, feature_inputs, hidden_output
from .ort_quantized import quantized_session_config
from .tree_layout import MainPathLayout
from .wide_head import UNBOUNDED_ROWS, WideHeadRule, lift_rows, recorded_lift  # noqa: F401 - re-exported

_NP_DTYPES = {"float": np.float32, "float16": np.float16, "bfloat16": np.float32, "double": np.float64}
_PROVIDERS = {
    "ort-cpu": ["CPUExecutionProvider"],
    "ort-cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"],
    "ort-trt": ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"],
}


def default_threads() -> int:
    """Physical-ish core count: what ONNX Runtime would pick, bounded to what this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return os.cpu_count() or 1


def execution_providers(backend: str, dtype: str) -> list:
    """The providers for `backend`; fp32 graphs run the CUDA EP without TF32 (exact fp32, not 10-bit mantissas)."""
    providers: list = list(_PROVIDERS[backend])
    if dtype == "fp32" and "CUDAExecutionProvider" in providers:
        providers[providers.index("CUDAExecutionProvider")] = ("CUDAExecutionProvider", {"use_tf32": "0"})
    return providers


SPINNING = ("off", "in-run", "always")


def session_options(threads: int | None, spinning: str = "off"):
    """The ONNX Runtime options every speccompile graph runs with (sequential, fully optimised).

    `spinning` (SPINNING): whether the intra-op threads busy-wait for work instead of sleeping. "always":
    between operators and between runs, ~15% faster per decode step when the target is the only graph
    running back to back (plain, n-gram); when another graph alternates with it such pools steal the cores
    from each other (2-3x slower steps with a drafter graph). "in-run": between operators only, the pool stops
    spinning when a run returns (`session.force_spinning_stop`): for sessions that take turns with other
    sessions or threads (a server's batched and slotted graphs and its event loop: +10 % tokens/s with
    `--slot-passes drafts`, docs/serving.md). "off": never.
    """
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads or default_threads()
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3
    if spinning not in SPINNING:
        raise ValueError(f"spinning must be one of {SPINNING}, got {spinning!r}")
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0" if spinning == "off" else "1")
    opts.add_session_config_entry("session.force_spinning_stop", "1" if spinning == "in-run" else "0")
    return opts


def inference_session(directory: str | Path, manifest: Manifest, spec: GraphSpec, backend: str = "ort-cpu",
                      threads: int | None = None, spinning: str = "off"):
    """An onnxruntime.InferenceSession for graph `spec` on `backend` (ort-cpu, ort-cuda or ort-trt)."""
    import onnxruntime as ort

    providers = _PROVIDERS[backend]
    available = ort.get_available_providers()
    if providers[0] not in available:
        raise InputError(
            f"backend {backend}: ONNX Runtime here has no {providers[0]} "
            f"(available: {', '.join(available)}); install onnxruntime-gpu for CUDA/TensorRT", "backend"
        )
    if threads is not None and threads < 1:
        raise InputError(f"threads must be >= 1, got {threads}", "threads")
    opts = session_options(threads, spinning)
    for key, value in quantized_session_config(spec, backend).items():  # exact verify passes on Q/DQ graphs
        opts.add_session_config_entry(key, value)
    if spec.extra.get("quantization") == "nvfp4" and backend != "ort-trt":
        raise UnsupportedError(
            f"{spec.file} is NVFP4-quantized: ONNX Runtime {backend} cannot run FP4 "
            "(use the tensorrt or ort-trt backend on a Blackwell GPU)"
        )
    provider_list = execution_providers(backend, spec.dtype)
    if backend == "ort-trt":
        from ...accel.ort_trt import tensorrt_ep_options

        provider_list[0] = ("TensorrtExecutionProvider", tensorrt_ep_options(manifest, spec))
    return ort.InferenceSession(str(Path(directory) / spec.file), opts, providers=provider_list)


def _np_dtype(spec: GraphSpec, name: str):
    return _NP_DTYPES.get(next(t.dtype for t in spec.inputs if t.name == name), np.float32)


class OrtSession:
    """One graph with a KV cache in an onnxruntime.InferenceSession (target, draft model, EAGLE/MTP heads).

    Head graphs take the target's features as extra float inputs (`feature_inputs`) and return the
    head's own hidden state; both are bound like the token inputs.
    """

    row_invariant = False  # the contract graph's KV concatenation squeezes rejected rows: not claimed here
    max_caches: int | None = None  # each cache holds arrays of its own

    def __init__(self, directory: str | Path, manifest: Manifest, spec: GraphSpec, backend: str = "ort-cpu",
                 threads: int | None = None, spinning: str = "off"):
        import onnxruntime as ort

        self.spec = spec
        self.session = inference_session(directory, manifest, spec, backend, threads, spinning)
        self.device = "cpu" if backend == "ort-cpu" else "cuda"
        self._ort = ort
        self.past_names = [t.name for t in spec.inputs if t.name.startswith(("past_key_values", "past_state."))]
        self.states = state_inputs(spec)  # hybrid linear attention: which cache inputs are states (runtime/state_cache.py)
        self.output_names = spec.output_names()
        self.present_names = [n for n in self.output_names if n.startswith("present")]
        self.kv_past = [n for n in self.past_names if n.startswith("past_key_values")]  # the KV buffers alone
        self.kv_present = [n for n in self.present_names if n.startswith("present.")]
        self.hidden_name = hidden_output(spec)
        self.feature_dtypes = {name: _np_dtype(spec, name) for name in feature_inputs(spec)}
        pasts = [t for t in spec.inputs if t.name.startswith("past_key_values")]  # none: every layer recurrent (state_cache.py)
        self.kv_dtype = _NP_DTYPES.get(next((t.dtype for t in pasts), "float"), np.float32)
        self.kv_shapes = [(int(t.shape[1]), int(t.shape[3])) for t in pasts]  # per buffer: layers may differ (Gemma 4)

    def _to_ort(self, array: np.ndarray):
        return self._ort.OrtValue.ortvalue_from_numpy(array, self.device, 0)

    def _bind_step_inputs(self, binding, input_ids: np.ndarray, position_ids: np.ndarray, features: dict[str, np.ndarray]) -> None:
        binding.bind_cpu_input("input_ids", np.ascontiguousarray(input_ids, dtype=np.int64).reshape(1, -1))
        binding.bind_cpu_input("position_ids", np.ascontiguousarray(position_ids, dtype=np.int64).reshape(1, -1))
        missing = set(self.feature_dtypes) - set(features)
        if missing:
            raise ValueError(f"{self.spec.file} needs feature inputs {sorted(missing)}")
        for name, dtype in self.feature_dtypes.items():
            binding.bind_cpu_input(name, np.ascontiguousarray(features[name], dtype=dtype)[None])

    def pass_rows(self, start: int) -> int:
        """Any number (Session.pass_rows)."""
        return UNBOUNDED_ROWS

    def new_cache(self, max_dead: int | None = None) -> KVCache:
        """`max_dead`: rejected rows that may stay (masked) before a pass squeezes them out. On the CPU none by
        default: a masked row still shifts how the attention kernels group the key axis in their sums, so the
        next rows' logits would differ from plain decoding's in the last bits (docs/quantization.md)."""
        if max_dead is None:
            max_dead = 0 if self.device == "cpu" else 64
        empty = [self._to_ort(np.zeros((1, heads, 0, dim), dtype=self.kv_dtype)) for heads, dim in self.kv_shapes]
        if self.states:  # hybrid linear attention: zero states among the KV buffers (runtime/state_cache.py)
            return StateCache(with_zero_states(empty, self.spec, self._to_ort), self.states, lambda v: v.numpy(), self._to_ort,
                              max_dead, state_inputs(self.spec, rows=True))
        return KVCache(empty, to_numpy=lambda v: v.numpy(), from_numpy=self._to_ort, max_dead=max_dead)

    def run(self, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray, cache: KVCache,
            last_logits_only: bool = False, **features: np.ndarray) -> StepOutput:
        binding = self.session.io_binding()
        self._bind_step_inputs(binding, input_ids, position_ids, features)
        binding.bind_cpu_input("attention_mask", np.ascontiguousarray(attention_mask, dtype=bool))
        for name, value in zip(self.past_names, cache.tensors):
            binding.bind_ortvalue_input(name, value)
        binding.bind_output("logits", "cpu")
        for name in self.present_names:
            binding.bind_output(name, self.device)
        if self.hidden_name:
            binding.bind_output(self.hidden_name, "cpu")
        self.session.run_with_iobinding(binding)
        outputs = dict(zip(self.output_names, binding.get_outputs()))
        logits = outputs["logits"].numpy()[0]
        hidden = outputs[self.hidden_name].numpy()[0] if self.hidden_name else None
        return StepOutput(logits=logits, presents=[outputs[n] for n in self.present_names], hidden=hidden)


class OrtBufferSession(OrtSession):
    """The fused CPU graph (`*.ort.onnx`): KV in preallocated buffers that GroupQueryAttention fills in place.

    Each layer's buffer is bound as both the past input and the present output, so a step copies no cache
    data at all; the mask becomes GroupQueryAttention's additive `attention_bias` (0 or -inf).
    """

    initial_capacity = 256  # KV rows allocated up front; the buffers double when a step needs more

    def __init__(self, directory: str | Path, manifest: Manifest, spec: GraphSpec, backend: str = "ort-cpu",
                 threads: int | None = None, max_context: int | None = None, spinning: str = "off"):
        if backend != "ort-cpu":
            raise UnsupportedError(f"{spec.file} is the fused ONNX Runtime CPU graph; backend {backend} needs {spec.extra.get('variant_of')}")
        super().__init__(directory, manifest, spec, backend, threads, spinning)
        self.max_context = max_context
        # logits (+ hidden) are written into numpy arrays bound as outputs: reading them back wraps no
        # OrtValue per output (get_outputs() wraps all of them, the 2 x layers KV buffers included)
        self._step_outputs = ["logits", *([self.hidden_name] if self.hidden_name else [])]
        widths = {t.name: t.shape[-1] for t in spec.outputs if t.name in self._step_outputs}
        self._widths = [int(widths[name]) for name in self._step_outputs]
        # graphs exported since the input exists project only the rows in `logits_rows` to the vocabulary
        self.selects_logits = any(t.name == "logits_rows" for t in spec.inputs)
        # graphs exported since the input exists run a one-row pass with a padding row in attention, so that
        # a position's logits are the same bits in a one-row pass as in a verify pass (export/ort_fused_graph.py)
        self.takes_attention_pad = any(t.name == "attention_pad" for t in spec.inputs)
        self.row_invariant = self.takes_attention_pad
        # head_dim > 128: passes cut at the slots measured on this machine (backends/wide_head.py)
        self.wide = WideHeadRule.of(recorded_lift(spec.extra.get("attention_lift")), [d for _, d in self.kv_shapes],
                                    threads or default_threads())

    def new_cache(self, max_dead: int = 64, capacity: int | None = None) -> BufferKVCache:
        """`capacity`: a fixed number of KV rows allocated up front (the buffers never grow)."""
        return BufferKVCache(self.kv_shapes, self.kv_dtype, self._to_ort, capacity=capacity or self.initial_capacity,
                             max_capacity=capacity or self.max_context) if not self.states else BufferStateCache(
            self.spec, self.kv_shapes, self.kv_dtype, self._to_ort, capacity or self.initial_capacity, capacity or self.max_context)

    def run(self, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray, cache: BufferKVCache,
            last_logits_only: bool = False, **features: np.ndarray) -> StepOutput:
        """`attention_mask` [1, q, T] with T >= cache.length + q: GroupQueryAttention writes the q rows at
        [length, length + q) and sees T as total_sequence_length (T > length + q: slots past the new rows,
        masked; the shape-invariant mode passes the full capacity). `last_logits_only`: logits of the last
        row only (a prefill chunk), where the graph can skip the others. On a row-invariant graph a tree (a mask
        over the committed rows and the new ones, as `cache.attention_mask` makes it) runs main path first, its
        rows marked `plain_exact` (tree_layout.py); the shape-invariant wrapper lays out its own passes."""
        q = int(input_ids.size)
        if self.states:  # hybrid linear attention: the pass's states start from the committed ones
            cache.start_pass()
        if self.row_invariant and not features and attention_mask.shape[-1] == cache.length + q:
            layout = MainPathLayout.of_tree(attention_mask, q)
            if layout is not None:  # a tree: its main path's rows are plain decoding's (tree_layout.py)
                out = self._run_rows(layout.rows(input_ids), layout.rows(position_ids), layout.mask(attention_mask), cache)
                return layout.restore(out, cache)
        return self._run_rows(input_ids, position_ids, attention_mask, cache, last_logits_only, features)

    def pass_rows(self, start: int) -> int:
        """The most rows a pass from KV slot `start` holds without being split (`WideHeadRule.rows_from`)."""
        return self.wide.rows_from(start)

    def _run_rows(self, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray, cache: BufferKVCache,
                  last_logits_only: bool = False, features: dict[str, np.ndarray] | None = None) -> StepOutput:
        """The rows as given, in one pass, or one pass per segment where they straddle a cut (`WideHeadRule`):
        each chunk's rows land at their slots, the later chunks see the earlier ones' as committed rows."""
        q, length = int(input_ids.size), cache.length
        pieces = self.wide.segments(length, q)
        if len(pieces) == 1:
            return self._one_pass(input_ids, position_ids, attention_mask, cache, 1 if last_logits_only else q, features)
        outs = []
        try:
            for a, b in pieces:
                cache.length = length + a
                wanted = 1 if last_logits_only else b - a  # (zero rows: a tied head's Reshape reads a 0 as "keep")
                outs.append(self._one_pass(input_ids.reshape(-1)[a:b], position_ids.reshape(-1)[a:b],
                                           attention_mask[:, a:b, : length + b], cache, wanted,
                                           {k: v[..., a:b, :] for k, v in (features or {}).items()}))
        finally:
            cache.length = length
        logits = outs[-1].logits if last_logits_only else np.concatenate([o.logits for o in outs])
        hidden = None if outs[0].hidden is None else np.concatenate([o.hidden for o in outs])
        return StepOutput(logits=logits, presents=cache.tensors, hidden=hidden)

    def _one_pass(self, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray, cache: BufferKVCache,
                  logit_rows: int, features: dict[str, np.ndarray] | None = None) -> StepOutput:
        """One pass over the rows as given; the logits of its last `logit_rows` rows (all, on graphs that cannot
        select them)."""
        q = int(input_ids.size)
        total = int(attention_mask.shape[-1])
        pad = max(self._padding_rows(q), self._lift_rows(total, cache))
        cache.reserve(total + pad)
        binding = self._binding_for(cache)
        bias = np.where(attention_mask[0], np.float32(0), np.float32(-np.inf))[None, None]
        self._bind_step_inputs(binding, input_ids, position_ids, features or {})
        binding.bind_cpu_input("attention_bias", np.ascontiguousarray(bias))
        binding.bind_cpu_input("seqlens_k", np.array([cache.length + q - 1], dtype=np.int32))
        binding.bind_cpu_input("total_sequence_length", np.array(total, dtype=np.int32))
        if self.takes_attention_pad:
            binding.bind_cpu_input("attention_pad", np.array([pad], dtype=np.int64))
        rows = q
        if self.selects_logits:
            rows = logit_rows
            binding.bind_cpu_input("logits_rows", np.arange(q - rows, q, dtype=np.int64))
        shapes = [(1, rows, self._widths[0])] + [(1, q, width) for width in self._widths[1:]]
        arrays = [np.empty(shape, dtype=np.float32) for shape in shapes]  # fresh each step: callers may keep them
        for name, array in zip(self._step_outputs, arrays):
            binding.bind_ortvalue_output(name, self._to_ort(array))  # rebound each step: q (the output shape) changes
        states = cache.bind_states(binding, q) if self.states else None  # (runtime/state_cache.py)
        self.session.run_with_iobinding(binding)
        if states is not None:
            cache.record(states)
        return StepOutput(logits=arrays[0][0], presents=cache.tensors, hidden=arrays[1][0] if self.hidden_name else None)

    def _padding_rows(self, q: int, batch: int = 1) -> int:
        """1 when a pass of one row per sequence gets attention's padding row: where the graph has it and
        ONNX Runtime allows it (a batch of one, or sequences without a past); the caller's buffers need one
        slot past the pass's rows for it."""
        return int(self.row_invariant and q == 1 and batch == 1)

    def _lift_rows(self, total: int, cache: BufferKVCache) -> int:
        """Padding rows that move a single sequence's pass of `total` slots past a remainder of 1..short modulo
        block (a rule's `lift`, set by hand only since every width is measured; 0 otherwise), where the cache can hold
        them."""
        return lift_rows(self.wide.lift, total, cache.capacity if cache.fixed else None)

    @property
    def wide_head_passes(self) -> bool:
        """Whether the graph lays out its passes for head_dim > 128 (cuts or lifts, backends/wide_head.py): a
        batched pass of several sequences cannot (one row each, no padding row), so only batch-1 and slot passes
        compute a row's bits alone."""
        return self.wide.active

    @property
    def pad_rows(self) -> int:
        """KV rows past a pass's own that attention's padding may write: the one-row padding row, or up to
        `short` rows lifting a pass (a rule's `lift`, set by hand only)."""
        return max(1, self.wide.lift[1])

    @property
    def batches(self) -> bool:
        """Whether the graph has a dynamic batch axis (`run_batch`); graphs exported before it have batch 1."""
        return not str(next(t for t in self.spec.inputs if t.name == "input_ids").shape[0]).isdigit()

    @property
    def kv_rows(self) -> int:
        """KV rows the graph accepts per sequence: max_context + max_verify_tokens (its rotary positions), plus
        room for the padding rows a lifted pass writes past them (`pad_rows`, head_dim > 128)."""
        return int(self.spec.extra.get("kv_capacity") or self.max_context or self.initial_capacity) + self.pad_rows - 1

    def new_batch_buffers(self, slots: int, rows: int) -> list[np.ndarray]:
        """Per-layer KV buffers [slots, kv_heads, rows, head_dim] for `run_batch` (one slot per sequence)."""
        return [np.zeros((slots, heads, rows, dim), dtype=self.kv_dtype) for heads, dim in self.kv_shapes]

    def slot_cache(self, buffers: list[np.ndarray], slot: int) -> BufferKVCache:
        """The cache of one slot of `buffers`: `run` (a prefill, batch 1) and `run_batch` both write into it."""
        return BufferKVCache.over([b[slot: slot + 1] for b in buffers], self._to_ort)

    def run_batch(self, buffers: list[np.ndarray], rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
                  caches: list[BufferKVCache]) -> list[StepOutput]:
        """One pass over sequences 0..B-1 of `buffers`: `rows[b]` = (input_ids [q_b], position_ids [q_b],
        mask [q_b, q_b] over its own new tokens), `caches[b]` its slot cache (slot b, rows committed by the caller).

        q is padded to the batch's max: sequence b's q rows land at [length_b, length_b + q) (seqlens_k =
        length_b + q - 1); a padding row sees only its own slot, and its KV lands past what the caller commits."""
        batch, q = len(rows), max(len(r[0]) for r in rows)
        lengths = [c.length for c in caches]
        total = max(lengths) + q
        ids = np.zeros((batch, q), dtype=np.int64)
        positions = np.zeros((batch, q), dtype=np.int64)
        bias = np.full((batch, 1, q, total), -np.inf, dtype=np.float32)
        for b, ((row_ids, row_positions, mask), length) in enumerate(zip(rows, lengths)):
            n = len(row_ids)
            ids[b, :n], positions[b, :n] = row_ids, row_positions
            positions[b, n:] = row_positions[-1]  # padding rows: any valid rotary position
            bias[b, 0, :n, :length] = 0
            bias[b, 0, :n, length: length + n] = np.where(mask, np.float32(0), np.float32(-np.inf))
            pad = np.arange(n, q)
            bias[b, 0, pad, length + pad] = 0
        pad = self._padding_rows(q, batch)
        if batch == 1:  # a lone sequence: lifted as when alone (a batch > 1 cannot take the rows: `wide_head_passes`)
            pad = max(pad, self._lift_rows(total, caches[0]))
        arrays = self._run_slots([b[:batch] for b in buffers], ids, positions, bias, [length + q - 1 for length in lengths], pad)
        return [StepOutput(logits=arrays[0][b, :len(r[0])], presents=c.tensors,
                           hidden=arrays[1][b, :len(r[0])] if self.hidden_name else None)
                for b, (r, c) in enumerate(zip(rows, caches))]

    def prefill_batch(self, buffers: list[np.ndarray], first_slot: int, prompts: list[np.ndarray]) -> list[np.ndarray]:
        """Prompts without past into slots first_slot.. of `buffers` in one pass (right-padded to the longest;
        GroupQueryAttention takes a batch when no sequence has a past); each prompt's last logits.
        The callers then commit len(prompt) rows of each slot cache."""
        batch, q = len(prompts), max(len(p) for p in prompts)
        ids = np.zeros((batch, q), dtype=np.int64)
        positions = np.tile(np.arange(q, dtype=np.int64), (batch, 1))
        causal = np.where(np.tril(np.ones((q, q), dtype=bool)), np.float32(0), np.float32(-np.inf))
        bias = np.repeat(causal[None, None], batch, axis=0)
        for b, prompt in enumerate(prompts):
            n = len(prompt)
            ids[b, :n] = prompt
            bias[b, 0, :, n:] = -np.inf
            pad = np.arange(n, q)
            bias[b, 0, pad, pad] = 0  # a padding row sees only its own slot
        arrays = self._run_slots([b[first_slot: first_slot + batch] for b in buffers], ids, positions, bias,
                                 [len(p) - 1 for p in prompts], self._padding_rows(q))  # no past: any batch
        return [arrays[0][b, len(p) - 1] for b, p in enumerate(prompts)]

    def _run_slots(self, buffers: list[np.ndarray], ids: np.ndarray, positions: np.ndarray, bias: np.ndarray,
                   seqlens_k: list[int], pad: int) -> list[np.ndarray]:
        """One pass over the sequences of `buffers` (views [B, ...], written in place); the step outputs [B, q, width].
        `pad`: attention's padding row (`_padding_rows`)."""
        batch, q = ids.shape
        binding = self.session.io_binding()
        for past, present, buffer in zip(self.past_names, self.present_names, buffers):
            value = self._to_ort(buffer)
            binding.bind_ortvalue_input(past, value)
            binding.bind_ortvalue_output(present, value)
        binding.bind_cpu_input("input_ids", ids)
        binding.bind_cpu_input("position_ids", positions)
        binding.bind_cpu_input("attention_bias", bias)
        binding.bind_cpu_input("seqlens_k", np.asarray(seqlens_k, dtype=np.int32))
        binding.bind_cpu_input("total_sequence_length", np.array(bias.shape[-1], dtype=np.int32))
        if self.takes_attention_pad:
            binding.bind_cpu_input("attention_pad", np.array([pad], dtype=np.int64))
        if self.selects_logits:
            binding.bind_cpu_input("logits_rows", np.arange(q, dtype=np.int64))
        arrays = [np.empty((batch, q, width), dtype=np.float32) for width in self._widths]
        for name, array in zip(self._step_outputs, arrays):
            binding.bind_ortvalue_output(name, self._to_ort(array))
        self.session.run_with_iobinding(binding)
        return arrays

    def _binding_for(self, cache: BufferKVCache):
        """One I/O binding per cache, reused across steps; the KV buffers are rebound only when they grow
        (logits and hidden are bound by each step, their shape follows q)."""
        if cache.binding is not None and cache.binding[0] is self and cache.binding[1] == cache.capacity:
            return cache.binding[2]
        binding = self.session.io_binding()
        for past, value in zip(self.kv_past, cache.tensors):
            binding.bind_ortvalue_input(past, value)
        for present, value in zip(self.kv_present, cache.tensors):
            binding.bind_ortvalue_output(present, value)
        cache.binding = (self, cache.capacity, binding)
        return binding


class OrtFeatureSession:
    """A graph without KV cache in ONNX Runtime (the Medusa heads): hidden_states [1, q, H] -> logits [1, q, heads, V]."""

    max_caches = None  # no state between runs

    def __init__(self, directory: str | Path, manifest: Manifest, spec: GraphSpec, backend: str = "ort-cpu",
                 threads: int | None = None):
        self.spec = spec
        self.session = inference_session(directory, manifest, spec, backend, threads)
        self.float_dtype = _np_dtype(spec, "hidden_states")

    def run(self, hidden_states: np.ndarray) -> np.ndarray:
        feed = {"hidden_states": np.ascontiguousarray(hidden_states, dtype=self.float_dtype)[None]}
        return self.session.run(["logits"], feed)[0][0]
