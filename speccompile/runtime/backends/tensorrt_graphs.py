"""Native TensorRT with static shapes and CUDA graphs: engines built with `speccompile build --profiles buckets`.

The GPU design of the ONNX Runtime CUDA backend (ort_cuda.py) on TensorRT. The engine's profiles
(accel/profiles.bucket_profiles) fix every shape per q bucket: `q_len = Q`, the KV at `max_context` rows
(unused and rejected rows masked, so the KV length never changes), plus a `prefill` profile for longer
prompt chunks. `TensorRTGraphSession`:

* one `IExecutionContext` per bucket: `set_optimization_profile_async`, `set_input_shape` and
  `set_tensor_address` once, against fixed device buffers;
* the bucket's `execute_async_v3` runs once (TensorRT finishes its lazy setup outside a capture), then is
  captured into a CUDA graph through the driver API (`cuStreamBeginCapture` / `cuStreamEndCapture` /
  `cuGraphInstantiateWithFlags`) and replayed with `cuGraphLaunch` on every later step;
* host inputs (ids, positions, the padded mask) are copied into the bucket's buffers before the launch;
* the KV lives in fixed per-layer buffers: after a step only the accepted rows move, device to device,
  from the bucket's present scratch buffer (the contract graph's concat output) into the KV buffer, one
  `cuMemcpy2DAsync` per layer tensor for a chain (one per run of rows for a tree path);
* only the q real logits (and hidden) rows come back to the host.

TensorRT cannot be installed in the workplace this was written in: the pure parts (layout, masks, row
copies, the CUDA_MEMCPY2D layout) are unit-tested; the engine path is tested where TensorRT exists.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...errors import HardwareError, InputError, UnsupportedError
from ...accel.profiles import BUCKET_PREFIX
from ...manifest import GraphSpec, Manifest
from .base import StepOutput
from .ort_cuda import FixedKVCache, bucket_for, pad_step
from .tensorrt import DeviceArray, TensorRTSession
from .wide_head import UNBOUNDED_ROWS



class GraphCalls:
    """The CUDA driver calls CUDA-graph replay needs, over an opened CudaDriver's libcuda (ctypes)."""

    def __init__(self, driver):
        self.lib = driver.lib

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise HardwareError(f"CUDA driver call {what} failed with error {status}")

    def memset(self, ptr: int, nbytes: int, stream: int = 0) -> None:
        if nbytes:
            self._check(self.lib.cuMemsetD8Async(ctypes.c_uint64(ptr), ctypes.c_ubyte(0), ctypes.c_size_t(nbytes), ctypes.c_void_p(stream)), "cuMemsetD8Async")

    def copy_2d(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int, stream: int = 0) -> None:
        """Device-to-device copy of `height` rows of `width` bytes (rows `src_pitch` / `dst_pitch` bytes apart)."""
        params = CudaMemcpy2D(srcMemoryType=_CU_MEMORYTYPE_DEVICE, srcDevice=src, srcPitch=src_pitch,
                              dstMemoryType=_CU_MEMORYTYPE_DEVICE, dstDevice=dst, dstPitch=dst_pitch,
                              WidthInBytes=width, Height=height)
        self._check(self.lib.cuMemcpy2DAsync_v2(ctypes.byref(params), ctypes.c_void_p(stream)), "cuMemcpy2DAsync")

    # CUDA graphs: capture the work a stream is given, instantiate it once, launch it per step
    def begin_capture(self, stream: int) -> None:
        self._check(self.lib.cuStreamBeginCapture_v2(ctypes.c_void_p(stream), _CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), "cuStreamBeginCapture")

    def end_capture(self, stream: int) -> int:
        graph = ctypes.c_void_p()
        self._check(self.lib.cuStreamEndCapture(ctypes.c_void_p(stream), ctypes.byref(graph)), "cuStreamEndCapture")
        return graph.value or 0

    def instantiate(self, graph: int) -> int:
        executable = ctypes.c_void_p()
        self._check(self.lib.cuGraphInstantiateWithFlags(ctypes.byref(executable), ctypes.c_void_p(graph), ctypes.c_ulonglong(0)), "cuGraphInstantiate")
        return executable.value or 0

    def launch(self, executable: int, stream: int) -> None:
        self._check(self.lib.cuGraphLaunch(ctypes.c_void_p(executable), ctypes.c_void_p(stream)), "cuGraphLaunch")

    def destroy_graph(self, graph: int, executable: int) -> None:
        if executable:
            self.lib.cuGraphExecDestroy(ctypes.c_void_p(executable))
        if graph:
            self.lib.cuGraphDestroy(ctypes.c_void_p(graph))


_CU_MEMORYTYPE_DEVICE = 2
_CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1


class CudaMemcpy2D(ctypes.Structure):
    """The driver API's CUDA_MEMCPY2D."""

    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t), ("srcMemoryType", ctypes.c_int),
        ("srcHost", ctypes.c_void_p), ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t), ("dstMemoryType", ctypes.c_int),
        ("dstHost", ctypes.c_void_p), ("dstDevice", ctypes.c_uint64), ("dstArray", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t),
    ]


@dataclass(frozen=True)
class BucketLayout:
    """What a bucket engine's profiles fix: q bucket -> profile index, the KV rows, the prefill profile."""

    buckets: dict[int, int]
    capacity: int
    prefill: int | None

    def only(self, rows: int) -> "BucketLayout":
        """The same engine with every pass of up to `rows` tokens in one bucket (the smallest that holds them,
        else the largest): shape-invariant mode, every decode pass with the same shapes."""
        bucket = next((q for q in self.buckets if q >= rows), max(self.buckets))
        return BucketLayout({bucket: self.buckets[bucket]}, self.capacity, self.prefill)


def bucket_layout(profiles: list[dict]) -> BucketLayout | None:
    """The bucket layout of an engine's recorded profiles (manifest engine.profiles[graph]); None when the
    engine was built with dynamic profiles (single/split)."""
    buckets: dict[int, int] = {}
    capacity: set[int] = set()
    prefill = None
    for index, profile in enumerate(profiles):
        name, shapes = profile["name"], profile["shapes"]
        past = [v for k, v in shapes.items() if k.startswith("past_key_values")]
        if name == "prefill":
            prefill = index
        elif name.startswith(BUCKET_PREFIX) and name[len(BUCKET_PREFIX):].isdigit():
            buckets[int(name[len(BUCKET_PREFIX):])] = index
        else:
            return None
        capacity.update(int(p[i][2]) for p in past for i in range(3))
    if not buckets or len(capacity) != 1:
        return None
    return BucketLayout(dict(sorted(buckets.items())), capacity.pop(), prefill)


def bucket_mask(new_mask: np.ndarray, length: int, capacity: int, bucket: int) -> np.ndarray:
    """[1, bucket, capacity + bucket] mask of a padded step over the fixed KV rows.

    Real rows see the `length` committed rows and their own (causal or tree) mask over the new rows;
    padding rows see only themselves (no row of softmax is empty) and no real row sees them.
    """
    q = new_mask.shape[0]
    mask = np.zeros((1, bucket, capacity + bucket), dtype=bool)
    mask[0, :q, :length] = True
    mask[0, :q, capacity: capacity + q] = new_mask
    pad = np.arange(q, bucket)
    mask[0, pad, capacity + pad] = True
    return mask


@dataclass(frozen=True)
class RowCopy:
    """One 2D device copy: `height` (= KV heads) rows of `width` bytes."""

    src_offset: int
    dst_offset: int
    width: int
    src_pitch: int
    dst_pitch: int
    height: int


def accepted_row_copies(keep: list[int], length: int, capacity: int, bucket: int, kv_heads: int, row_bytes: int) -> list[RowCopy]:
    """Copies that move a step's accepted rows from the present scratch [1, H, capacity + bucket, D] (new rows
    at capacity + i) to the KV buffer [1, H, capacity, D] slots length, length + 1, ...; consecutive rows
    move together (a chain is one copy)."""
    copies: list[RowCopy] = []
    runs: list[list[int]] = []
    for slot, source in enumerate(keep):
        if runs and source == runs[-1][0] + runs[-1][2] and slot == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([source, slot, 1])
    for source, slot, count in runs:
        copies.append(RowCopy(
            src_offset=(capacity + source) * row_bytes, dst_offset=(length + slot) * row_bytes, width=count * row_bytes,
            src_pitch=(capacity + bucket) * row_bytes, dst_pitch=capacity * row_bytes, height=kv_heads,
        ))
    return copies


class DeviceKVCache(FixedKVCache):
    """Fixed per-layer KV buffers on the device; committing a step copies its accepted rows into place."""

    def __init__(self, session: "TensorRTGraphSession", tensors: list[DeviceArray], capacity: int):
        super().__init__(tensors, capacity)
        self._session = session

    def append(self, presents, keep, num_new: int) -> None:
        keep = [int(k) for k in keep]
        self._session.commit_rows(presents, keep, self.length)
        self.length += len(keep)


class TensorRTGraphSession:
    """A `--profiles buckets` engine: per-bucket contexts with fixed addresses, each replayed as a CUDA graph."""

    row_invariant = False  # GPU kernels choose their reductions by shape
    max_caches = 1  # `new_cache` hands out the one set of device KV buffers every bucket's bindings point at

    def __init__(self, base: TensorRTSession, layout: BucketLayout, cuda_graphs: bool = True):
        self.base, self.layout, self.spec = base, layout, base.spec
        base.context = None  # its profile 0 belongs to the q1 bucket's context (one context per profile)
        self.cuda_graphs = cuda_graphs
        self.driver, self.stream, self.trt = base.driver, base.stream, base.trt
        self.calls = GraphCalls(base.driver)
        self.capacity = layout.capacity
        self.buckets = tuple(layout.buckets)
        names = base.past_names
        self.kv = [DeviceArray(self.driver, (1, base.kv_heads, self.capacity, base.head_dim), base.dtypes[n]) for n in names]
        for array in self.kv:
            self.calls.memset(array.ptr, array.nbytes, self.stream)  # unused rows are masked, but never NaN
        self._contexts: dict[int, dict] = {}
        self._cache = DeviceKVCache(self, self.kv, self.capacity)

    def _bucket(self, q: int) -> dict:
        """Context, buffers and (after the first replay) the CUDA graph of bucket q, set up once."""
        if q in self._contexts:
            return self._contexts[q]
        base, trt_ctx = self.base, self.base.engine.create_execution_context()
        trt_ctx.set_optimization_profile_async(self.layout.buckets[q], self.stream)
        shapes = {"input_ids": (1, q), "position_ids": (1, q), "attention_mask": (1, q, self.capacity + q)}
        buffers = {name: DeviceArray(self.driver, shape, base.dtypes[name]) for name, shape in shapes.items()}
        for name, array in [*buffers.items(), *zip(base.past_names, self.kv)]:
            if not trt_ctx.set_input_shape(name, array.shape):
                raise InputError(f"TensorRT rejected shape {array.shape} for {name} in the q{q} profile")
            trt_ctx.set_tensor_address(name, array.ptr)
        outputs = {}
        for name in base.output_names:
            outputs[name] = DeviceArray(self.driver, tuple(trt_ctx.get_tensor_shape(name)), base.dtypes[name])
            trt_ctx.set_tensor_address(name, outputs[name].ptr)
        entry = {"context": trt_ctx, "inputs": buffers, "outputs": outputs, "graph": 0, "exec": 0}
        self._contexts[q] = entry
        return entry

    def _launch(self, entry: dict) -> None:
        """Replay the bucket's CUDA graph; the first call runs once (TensorRT finishes its setup outside a
        capture) and then captures execute_async_v3 into the graph."""
        if entry["exec"]:
            self.calls.launch(entry["exec"], self.stream)
            return
        if not entry["context"].execute_async_v3(self.stream):
            raise InputError("TensorRT execute_async_v3 failed")
        if self.cuda_graphs:
            self.driver.sync(self.stream)
            self.calls.begin_capture(self.stream)
            ok = entry["context"].execute_async_v3(self.stream)
            entry["graph"] = self.calls.end_capture(self.stream)
            if not ok:
                raise InputError("TensorRT execute_async_v3 failed during CUDA graph capture")
            entry["exec"] = self.calls.instantiate(entry["graph"])

    def __del__(self):
        for entry in getattr(self, "_contexts", {}).values():
            try:
                self.calls.destroy_graph(entry.get("graph", 0), entry.get("exec", 0))
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass

    def pass_rows(self, start: int) -> int:
        """Any number (Session.pass_rows)."""
        return UNBOUNDED_ROWS

    def new_cache(self, max_dead: int = 64) -> DeviceKVCache:
        self._cache.length = 0
        return self._cache

    def run(self, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray, cache: DeviceKVCache,
            last_logits_only: bool = False) -> StepOutput:
        q, length = int(np.asarray(input_ids).size), cache.length
        if not attention_mask[0, :, :length].all():
            raise UnsupportedError("the bucket engine's KV rows are always committed rows (no dead slots)")
        bucket = bucket_for(q, self.buckets)
        if bucket is None:
            return self._run_prefill(input_ids, position_ids, attention_mask, cache)
        entry = self._bucket(bucket)
        ids, pos = pad_step(np.asarray(input_ids), np.asarray(position_ids), bucket, 1 << 62)
        mask = bucket_mask(attention_mask[0, :, length:], length, self.capacity, bucket)
        for name, host in (("input_ids", ids), ("position_ids", pos), ("attention_mask", mask)):
            device = entry["inputs"][name]
            host = np.ascontiguousarray(host, dtype=device.dtype)
            self.driver.htod(device.ptr, host.ctypes.data, device.nbytes, self.stream)
        self._launch(entry)
        return self._outputs(entry["outputs"], q)

    def _run_prefill(self, input_ids, position_ids, attention_mask, cache) -> StepOutput:
        """A chunk larger than every bucket: the 'prefill' profile, shapes set per call, not captured."""
        if self.layout.prefill is None:
            raise InputError(f"{int(np.asarray(input_ids).size)} tokens in one pass: the engine's largest bucket is {self.buckets[-1]} (lower prefill_chunk)")
        base, q, length = self.base, int(np.asarray(input_ids).size), cache.length
        trt_ctx = self._contexts.setdefault(-1, {"context": base.engine.create_execution_context()})["context"]
        trt_ctx.set_optimization_profile_async(self.layout.prefill, self.stream)
        host = {"input_ids": np.asarray(input_ids).reshape(1, q), "position_ids": np.asarray(position_ids).reshape(1, q),
                "attention_mask": bucket_mask(attention_mask[0, :, length:], length, self.capacity, q)}
        keep_alive = []
        for name, array in host.items():
            array = np.ascontiguousarray(array, dtype=base.dtypes[name])
            device = DeviceArray.from_numpy(self.driver, array, self.stream)
            keep_alive.append(device)
            trt_ctx.set_input_shape(name, array.shape)
            trt_ctx.set_tensor_address(name, device.ptr)
        for name, array in zip(base.past_names, self.kv):
            trt_ctx.set_input_shape(name, array.shape)
            trt_ctx.set_tensor_address(name, array.ptr)
        outputs = {}
        for name in base.output_names:
            outputs[name] = DeviceArray(self.driver, tuple(trt_ctx.get_tensor_shape(name)), base.dtypes[name])
            trt_ctx.set_tensor_address(name, outputs[name].ptr)
        if not trt_ctx.execute_async_v3(self.stream):
            raise InputError("TensorRT execute_async_v3 failed")
        return self._outputs(outputs, q)

    def _outputs(self, outputs: dict[str, DeviceArray], q: int) -> StepOutput:
        """Only the q real logits (and hidden) rows come back; the presents stay on the device."""
        logits = _rows(self.driver, outputs["logits"], q, self.stream).astype(np.float32, copy=False)
        hidden = _rows(self.driver, outputs[self.base.hidden_name], q, self.stream) if self.base.hidden_name else None
        presents = [outputs[n] for n in self.base.present_names]
        return StepOutput(logits=logits, presents=presents, hidden=hidden)

    def commit_rows(self, presents: list[DeviceArray], keep: list[int], length: int) -> None:
        """Move the accepted rows of a step from its present scratch buffers into the KV buffers."""
        for present, kv in zip(presents, self.kv):
            bucket = present.shape[2] - self.capacity
            row_bytes = kv.shape[3] * kv.dtype.itemsize
            for c in accepted_row_copies(keep, length, self.capacity, bucket, kv.shape[1], row_bytes):
                self.calls.copy_2d(kv.ptr + c.dst_offset, c.dst_pitch, present.ptr + c.src_offset, c.src_pitch, c.width, c.height, self.stream)


def _rows(driver, array: DeviceArray, q: int, stream: int) -> np.ndarray:
    """The first q rows of a [1, Q, W] device tensor (contiguous: one copy of q * W elements)."""
    width = array.shape[-1]
    host = np.empty((q, width), dtype=array.dtype)
    driver.dtoh(host.ctypes.data, array.ptr, host.nbytes, stream)
    driver.sync(stream)
    return host


def engine_bucket_layout(manifest: Manifest, spec: GraphSpec) -> BucketLayout | None:
    """The bucket layout of graph `spec`'s engine (None: built with dynamic profiles)."""
    graph_name = next((n for n, g in manifest.graphs.items() if g.file == spec.file), "target")
    return bucket_layout((manifest.engine or {}).get("profiles", {}).get(graph_name, []))


def open_tensorrt_session(directory: str | Path, manifest: Manifest, spec: GraphSpec, device: int = 0, cuda_graphs: bool = True,
                          rows: int | None = None):
    """The engine's session: TensorRTGraphSession for `--profiles buckets` engines (with `rows`: every pass in the
    one bucket that holds them), else TensorRTSession."""
    base = TensorRTSession(directory, manifest, spec, device)
    layout = engine_bucket_layout(manifest, spec)
    if layout is None:
        return base
    return TensorRTGraphSession(base, layout.only(rows) if rows else layout, cuda_graphs)
