"""ONNX Runtime CUDA backend for the GPU verify graph (`target.ort-cuda.onnx`): device KV buffers, fixed
I/O bindings and one CUDA graph per q bucket.

What a step does:
  * the q new tokens are padded to the step's **bucket** (the smallest of `buckets` >= q; padding rows sit
    after the real rows, and attention is causal, so they never change a real row), and the bucket's
    host inputs are written into its preallocated buffers with `OrtValue.update_inplace` (no allocation);
  * every input and output is bound once per bucket to a fixed buffer: the per-layer KV buffers (past and
    present are the same device buffer, GroupQueryAttention appends in place), `seqlens_k` (the real
    length - 1 after this step's rows, on the device), `total_sequence_length` (the fixed KV capacity: the
    CUDA kernel reads it on the host, so it must not change between replays of a captured graph);
  * on CUDA the session is created with the CUDA EP option `enable_cuda_graph` and each bucket runs with
    the run option `gpu_graph_id` = its own id: ONNX Runtime captures the bucket's graph once and replays it
    (ids >= 1; -1 runs without capture: prefill chunks larger than the largest bucket);
  * only what the sampler needs comes back: the in-graph ArgMax rows (`next_tokens`, q integers) always, the
    logits rows only when the loop reads them (`DeviceLogitsOutput`: sampling does, greedy decoding does not).

The same class runs on ONNX Runtime CPU (`device="cpu"`, no CUDA graphs) with the fp32 form of the GPU
graph: that is how the CPU tests check the bucketing, padding and binding against the contract graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from ...errors import InputError, UnsupportedError
from ...manifest import GraphSpec
from ..kvcache import BufferKVCache, causal_mask
from .base import StepOutput
from .shared_weights import SharedWeights, device_tensor
from .wide_head import UNBOUNDED_ROWS

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
WARM_UP_RUNS = 3  # runs per bucket at open: ONNX Runtime runs a graph uncaptured first, then captures it
UNCAPTURED = -1  # gpu_graph_id of a run that ONNX Runtime must neither capture nor replay
_ONNX_TYPES = {"float": 1, "float16": 10, "int64": 7, "int32": 6, "bfloat16": 16}  # TensorProto element types
_NP_TYPES = {"float": np.float32, "float16": np.float16, "int64": np.int64, "int32": np.int32}


def q_buckets(max_verify_tokens: int, buckets: Sequence[int] = DEFAULT_BUCKETS) -> tuple[int, ...]:
    """The q sizes that get a captured graph: `buckets` up to the first that holds `max_verify_tokens`."""
    if max_verify_tokens < 1:
        raise InputError(f"max_verify_tokens must be >= 1, got {max_verify_tokens}")
    chosen: list[int] = []
    for size in sorted({int(b) for b in buckets if int(b) >= 1}):
        chosen.append(size)
        if size >= max_verify_tokens:
            break
    if not chosen or chosen[-1] < max_verify_tokens:
        chosen.append(int(max_verify_tokens))
    return tuple(chosen)


def bucket_for(q: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket that holds q rows (None: larger than every bucket, run uncaptured at q)."""
    return next((b for b in buckets if b >= q), None)


@dataclass(frozen=True)
class Buffer:
    """One fixed buffer of the binding plan: where it lives, its shape and ONNX element type name."""

    key: str  # buffers with the same key are the same memory (KV: past and present)
    shape: tuple[int, ...]
    dtype: str
    device: str  # "device" (the session's device) or "cpu" (host-read inputs)


@dataclass(frozen=True)
class BindingPlan:
    """Which buffer each graph input/output is bound to, per bucket (pure: no onnxruntime needed)."""

    inputs: dict[str, Buffer]
    outputs: dict[str, Buffer]

    def buffers(self) -> dict[str, Buffer]:
        return {b.key: b for b in (*self.inputs.values(), *self.outputs.values())}


def binding_plan(spec: GraphSpec, q: int, capacity: int, batch: int = 1) -> BindingPlan:
    """The fixed buffers of a q-row pass of the GPU graph over a `capacity`-row KV buffer (`batch`: the slotted
    GPU graph's slots, q rows each, every slot's KV buffers inputs of their own).

    Per-bucket buffers are keyed by q; the KV buffers, `seqlens_k` and `total_sequence_length` are shared by
    all buckets (KV past and present share one key: the graph writes the new rows in place).
    """
    kv_dtype = next(t.dtype for t in spec.inputs if t.name.startswith("past_key_values"))
    inputs: dict[str, Buffer] = {}
    for tensor in spec.inputs:
        name = tensor.name
        if name.startswith("past_key_values"):  # each buffer its layer's kv heads / head_dim
            kv_shape = (1, int(tensor.shape[1]), int(capacity), int(tensor.shape[3]))
            inputs[name] = Buffer("kv." + name.removeprefix("past_key_values."), kv_shape, kv_dtype, "device")
        elif name == "seqlens_k":
            inputs[name] = Buffer(name, (batch,), "int32", "device")
        elif name == "total_sequence_length":
            inputs[name] = Buffer(name, (), "int32", "cpu")
        elif name in ("input_ids", "position_ids"):
            inputs[name] = Buffer(f"{name}.q{q}", (batch, q), "int64", "device")
        elif name == "attention_bias":  # the slotted graph's tree form: each slot's additive mask
            inputs[name] = Buffer(f"{name}.q{q}", (batch, 1, q, int(capacity)), "float", "device")
        else:
            raise UnsupportedError(f"{spec.file}: input {name} is not one the GPU session binds")
    outputs: dict[str, Buffer] = {}
    for tensor in spec.outputs:
        name = tensor.name
        if name.startswith("present."):
            outputs[name] = inputs["past_key_values." + name.removeprefix("present.")]
        elif name == "next_tokens":
            outputs[name] = Buffer(f"{name}.q{q}", (batch, q), "int64", "device")
        else:  # logits, hidden_states, aux_hidden_states: [batch, q, width]
            outputs[name] = Buffer(f"{name}.q{q}", (batch, q, int(tensor.shape[-1])), tensor.dtype, "device")
    return BindingPlan(inputs, outputs)


def pad_step(input_ids: np.ndarray, position_ids: np.ndarray, bucket: int, max_position: int) -> tuple[np.ndarray, np.ndarray]:
    """Ids and positions of a q-row step padded to `bucket` rows ([1, bucket] int64 each).

    Padding rows repeat the last token at the following positions (clamped to the rotary table); attention
    is causal, so no real row sees them, and the next step overwrites the KV rows they wrote.
    """
    q = int(input_ids.size)
    ids = np.empty((1, bucket), dtype=np.int64)
    pos = np.empty((1, bucket), dtype=np.int64)
    ids[0, :q] = input_ids.reshape(-1)
    pos[0, :q] = position_ids.reshape(-1)
    if bucket > q:
        ids[0, q:] = ids[0, q - 1]
        pos[0, q:] = np.minimum(pos[0, q - 1] + np.arange(1, bucket - q + 1), max_position - 1)
    return ids, pos


def is_causal_step(attention_mask: np.ndarray, past: int) -> bool:
    """True when causal attention over the KV buffer computes what the mask asks for every row whose output
    is used: each real row sees every committed row and the new rows up to itself (a chain), and any rows
    after the real ones are padding that sees only its own slot (the shape-invariant wrapper's padding),
    whose outputs are discarded. The mask may be wider than past + rows (a fixed KV extent)."""
    mask = attention_mask[0]
    rows, width = mask.shape
    if width < past + rows:
        return False
    own = past + np.arange(rows)
    visible = np.count_nonzero(mask, axis=1)
    # a causal row sees all `past` slots, the new rows up to itself (the causal block), and nothing else (its count)
    sees_past = mask[:, :past].all(axis=1) if past else np.ones(rows, dtype=bool)
    causal = sees_past & (visible == own + 1) & (mask[:, past: past + rows] == causal_mask(rows)).all(axis=1)
    padding = (visible == 1) & mask[np.arange(rows), own]  # a padding row sees its own slot only
    real = rows if causal.all() else int(np.argmin(causal))  # the leading causal rows
    return bool(padding[real:].all())


class FixedKVCache(BufferKVCache):
    """KV rows in per-layer buffers of a fixed capacity that the graph writes in place.

    The addresses never change (a captured CUDA graph replays against them), so the cache never grows: a
    generation that would pass `capacity` rows ends at the context limit. The GPU graphs verify chains, and the
    slotted graph's tree form trees laid out main path first with verdicts cut off it, so accepted rows are always
    the first ones of a pass and committing them moves nothing.
    """

    def __init__(self, tensors: list[Any], capacity: int):
        self.row_slots: np.ndarray | None = None  # a tree pass laid out main path first (runtime/batch_gpu.py)
        self.tensors = list(tensors)
        self._capacity = int(capacity)
        self.max_capacity = self._capacity
        self.length = 0
        self.compactions = 0
        self.binding = None
        self.arrays = []

    @property
    def capacity(self) -> int:
        return self._capacity

    def reserve(self, total: int) -> None:
        if total > self._capacity:
            raise InputError(f"context of {total} tokens exceeds the KV buffer of {self._capacity} rows (the artifact's max_context)")

    def append(self, presents: Sequence[Any], keep: Sequence[int], num_new: int) -> None:
        """Commit the kept rows, which must be the pass's first rows (a chain's, or a tree's main path laid out
        first: `row_slots` maps them to the pass rows that computed them)."""
        slots, self.row_slots = self.row_slots, None
        keep = [int(k if slots is None else slots[k]) for k in keep]
        if keep != list(range(len(keep))):
            raise UnsupportedError("the GPU verify graph keeps a prefix of each step's rows (chains); tree drafts need the contract graph")
        self.length += len(keep)


class DeviceLogitsOutput(StepOutput):
    """A step whose logits rows stay on the device until read: greedy verification uses `greedy_tokens` (the
    graph's ArgMax) and never copies the [q, vocab] logits back. Valid until the session's next `run`."""

    def __init__(self, fetch_logits: Callable[[], np.ndarray], presents: list[Any], hidden: np.ndarray | None,
                 greedy_tokens: np.ndarray):
        super().__init__(logits=None, presents=presents, hidden=hidden, greedy_tokens=greedy_tokens)
        self._fetch_logits = fetch_logits
        self._host_logits: np.ndarray | None = None

    @property
    def logits(self) -> np.ndarray:
        """[q, vocab] float32, copied from the device on first use."""
        if self._host_logits is None:
            self._host_logits = self._fetch_logits()
        return self._host_logits

    @logits.setter
    def logits(self, value: np.ndarray | None) -> None:  # the dataclass __init__ assigns it
        self._host_logits = value


class OrtCudaSession:
    """The GPU verify graph in an ONNX Runtime session with fixed bindings per q bucket (CUDA graphs on CUDA)."""

    row_invariant = False  # GPU kernels choose their reductions by shape
    max_caches = 1  # `new_cache` hands out the one device KV buffer every bucket's binding (and CUDA graph) points at

    def __init__(self, directory: str | Path, spec: GraphSpec, device: str = "cuda", max_context: int | None = None,
                 max_verify_tokens: int = 64, kv_capacity: int | None = None, cuda_graph: bool | None = None,
                 buckets: Sequence[int] = DEFAULT_BUCKETS, device_id: int = 0, threads: int | None = None,
                 weights: SharedWeights | None = None):
        """`weights`: tensors this graph shares with the artifact's other GPU-form graph, resident once (their pool
        must live as long as this session; shared_weights.py)."""
        import onnxruntime as ort

        from .ort import session_options

        if spec.extra.get("kv_layout") != "buffer" or "next_tokens" not in spec.output_names():
            raise UnsupportedError(f"{spec.file} is not the GPU verify graph (expected target.ort-cuda.onnx)")
        self.spec = spec
        self.device = device
        self.device_id = device_id
        self.cuda_graph = (device == "cuda") if cuda_graph is None else bool(cuda_graph)
        if self.cuda_graph and device != "cuda":
            raise InputError("CUDA graphs need device 'cuda'")
        # rows of the graph's rotary tables: the export's kv_capacity when it records one, else max_context
        self.max_position = int(spec.extra.get("kv_capacity") or max_context or 0)
        capacity = int(kv_capacity or self.max_position)
        if capacity < 2:
            raise InputError(f"{spec.file}: the GPU session needs a KV capacity (the artifact's max_context), got {capacity}")
        self.capacity = capacity
        self.buckets = q_buckets(min(max_verify_tokens, capacity), buckets)
        self.graph_ids = {q: i + 1 for i, q in enumerate(self.buckets)}  # gpu_graph_id per bucket (>= 1)
        self._ort = ort
        opts = session_options(threads)
        if device == "cuda":
            available = ort.get_available_providers()
            if "CUDAExecutionProvider" not in available:
                raise InputError(
                    f"backend ort-cuda: ONNX Runtime here has no CUDAExecutionProvider (available: {', '.join(available)}); "
                    "install onnxruntime-gpu", "backend"
                )
            cuda_options = {"device_id": str(device_id), "use_tf32": "0",
                            "enable_cuda_graph": "1" if self.cuda_graph else "0"}
            providers: list = [("CUDAExecutionProvider", cuda_options), "CPUExecutionProvider"]
        else:
            providers = ["CPUExecutionProvider"]
        if weights is not None and (weights.device, weights.device_id) != (device, device_id):
            raise ValueError(f"shared weights on {weights.device}:{weights.device_id} for a session on {device}:{device_id}")
        self.shared_tensors = weights.add_to(opts, spec.file) if weights is not None else 0
        self.weights = weights  # kept alive with the session
        self.session = ort.InferenceSession(str(Path(directory) / spec.file), opts, providers=providers)
        self.past_names = [t.name for t in spec.inputs if t.name.startswith("past_key_values")]
        self.present_names = [n for n in spec.output_names() if n.startswith("present.")]
        self.hidden_name = next((n for n in ("hidden_states", "aux_hidden_states") if n in spec.output_names()), None)
        self._buffers: dict[str, Any] = {}  # key -> OrtValue, shared by every bucket's binding
        self._bindings: dict[int, tuple[Any, BindingPlan]] = {}
        self._run_options: dict[int, Any] = {}
        self._cache: FixedKVCache | None = None
        if self.cuda_graph:
            self.warm_up()

    # -- buffers -----------------------------------------------------------------------------------
    def _allocate(self, buffer: Buffer):
        device = "cpu" if buffer.device == "cpu" else self.device
        # bfloat16 has no numpy type: zeroed from 16-bit host zeros
        host = np.zeros(buffer.shape, dtype=_NP_TYPES.get(buffer.dtype, np.uint16))
        return device_tensor(host, _ONNX_TYPES[buffer.dtype], device, self.device_id)

    def _buffer(self, buffer: Buffer):
        if buffer.key not in self._buffers:
            self._buffers[buffer.key] = self._allocate(buffer)
        return self._buffers[buffer.key]

    def _binding(self, q: int) -> tuple[Any, BindingPlan]:
        """The I/O binding of a q-row pass: built once per bucket, every name bound to its fixed buffer."""
        if q in self._bindings:
            return self._bindings[q]
        plan = self._plan(q)
        binding = self.session.io_binding()
        for name, buffer in plan.inputs.items():
            binding.bind_ortvalue_input(name, self._buffer(buffer))
        for name, buffer in plan.outputs.items():
            binding.bind_ortvalue_output(name, self._buffer(buffer))
        self._buffers["total_sequence_length"].update_inplace(np.array(self.capacity, dtype=np.int32))
        if q in self.graph_ids:  # uncaptured passes (long prefill chunks) are not kept
            self._bindings[q] = (binding, plan)
        return binding, plan

    def _plan(self, q: int) -> BindingPlan:
        """The fixed buffers of a q-row pass (`binding_plan`)."""
        return binding_plan(self.spec, q, self.capacity)

    def _options(self, q: int):
        graph_id = self.graph_ids.get(q, UNCAPTURED) if self.cuda_graph else None
        if graph_id not in self._run_options:
            options = self._ort.RunOptions()
            if graph_id is not None:
                options.add_run_config_entry("gpu_graph_id", str(graph_id))
            self._run_options[graph_id] = options
        return self._run_options[graph_id]

    def warm_up(self, runs: int = WARM_UP_RUNS) -> None:
        """Run every bucket `runs` times at the start of the KV buffers, so its CUDA graph is captured before the
        first generation (done at open when CUDA graphs are on). Without this, a bucket's first passes (allocation,
        capture) land inside a generation and the drafting controller prices that bucket at their cost. The KV
        rows written here are never read: a pass attends to the committed rows and its own, which it writes first."""
        for bucket in self.buckets:
            ids, positions = np.zeros(bucket, dtype=np.int64), np.arange(bucket)
            for _ in range(runs):
                cache = self.new_cache()
                self.run(ids, positions, cache.attention_mask(causal_mask(bucket)), cache)
        self.new_cache()

    # -- Session protocol --------------------------------------------------------------------------
    def pass_rows(self, start: int) -> int:
        """Any number (Session.pass_rows)."""
        return UNBOUNDED_ROWS

    def new_cache(self, max_dead: int = 64, capacity: int | None = None) -> FixedKVCache:
        """The KV buffers, allocated once per session (every bucket's captured graph points at them): a session
        runs one generation at a time, and a new cache starts that generation over the same buffers.
        `capacity` (the shape-invariant wrapper's fixed KV extent) cannot exceed the session's buffer."""
        if capacity is not None and capacity > self.capacity:
            raise InputError(f"a KV extent of {capacity} rows exceeds the GPU session's buffer of {self.capacity} rows")
        if self._cache is None:
            plan = self._plan(self.buckets[0])
            self._cache = FixedKVCache([self._buffer(plan.inputs[n]) for n in self.past_names], self.capacity)
        self._cache.length = 0
        return self._cache

    def run(self, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray, cache: FixedKVCache,
            last_logits_only: bool = False) -> StepOutput:
        q = int(np.asarray(input_ids).size)
        past = cache.length
        if not is_causal_step(attention_mask, past):
            raise UnsupportedError("the GPU verify graph is causal (GroupQueryAttention on CUDA takes no attention bias): "
                                   "tree drafts run the contract graph")
        bucket = bucket_for(q, self.buckets)
        if bucket is None or past + bucket > self.capacity:
            bucket = q  # no bucket holds it (or its padding would pass the buffer): run at q, uncaptured
        cache.reserve(past + bucket)
        binding, plan = self._binding(bucket)
        ids, pos = pad_step(np.asarray(input_ids), np.asarray(position_ids), bucket, self.max_position)
        self._buffers[plan.inputs["input_ids"].key].update_inplace(ids)
        self._buffers[plan.inputs["position_ids"].key].update_inplace(pos)
        self._buffers["seqlens_k"].update_inplace(np.array([past + bucket - 1], dtype=np.int32))
        self.session.run_with_iobinding(binding, self._options(bucket))
        outputs = {name: self._buffers[buffer.key] for name, buffer in plan.outputs.items()}
        tokens = outputs["next_tokens"].numpy()[0, :q]
        device_logits = outputs["logits"]
        hidden = outputs[self.hidden_name].numpy()[0, :q] if self.hidden_name else None
        if bucket not in self.graph_ids:  # a one-off size (a long prefill chunk): free its buffers
            for buffer in plan.buffers().values():
                if buffer.key.endswith(f".q{bucket}"):
                    del self._buffers[buffer.key]
        return DeviceLogitsOutput(lambda: device_logits.numpy()[0, :q], cache.tensors, hidden, tokens)
