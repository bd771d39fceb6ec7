"""Native TensorRT backend: a serialized engine per graph, KV cache kept in device memory between steps.

Needs the `tensorrt` package and an NVIDIA GPU (device memory and streams through the CUDA driver API via
ctypes, so no torch / cuda-python). The engine must have been built by `speccompile build` with the same
TensorRT version for the same GPU: both are recorded in the manifest and checked before deserializing.

Per step: input ids / positions / mask are copied to the device, past KV tensors are bound by address
(the previous step's present buffers, adopted by the KVCache), present buffers are allocated for the new
length, the profile covering the shapes is selected, `execute_async_v3` runs, logits come back to the host.

Engines built with `--profiles buckets` (static shapes per q bucket, see engines/config.bucket_profiles)
run in `TensorRTGraphSession` instead: the GPU design of the ONNX Runtime CUDA backend (ort_cuda.py) on
TensorRT. One execution context per bucket, its profile, shapes and tensor addresses set once; the KV
lives in fixed per-layer buffers of max_context rows (unused and rejected rows masked out); each bucket's
`execute_async_v3` is captured once into a CUDA graph (driver API stream capture) and replayed per step;
after a step only the accepted rows move, device to device, from the bucket's present scratch buffer
into the KV buffer (one 2D copy per layer tensor for a chain, one per row run for a tree path); only
the q real logits rows come back to the host.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from dataclasses import dataclass

from ...errors import ArtifactError, InputError, UnsupportedError
from ...manifest import GraphSpec, read_manifest
from ..kvcache import KVCache
from .base import StepOutput
from .ort_cuda import FixedKVCache, bucket_for, pad_step

BUCKET_PREFIX = "q"  # engines.config.BUCKET_PREFIX: the profiles of a `--profiles buckets` engine


class DeviceArray:
    """A device buffer with a shape and dtype; freed when garbage-collected."""

    __slots__ = ("driver", "ptr", "shape", "dtype", "nbytes", "__weakref__")

    def __init__(self, driver, shape: tuple[int, ...], dtype):
        self.driver = driver
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        self.ptr = driver.malloc(self.nbytes)

    @classmethod
    def from_numpy(cls, driver, array: np.ndarray, stream: int = 0) -> "DeviceArray":
        array = np.ascontiguousarray(array)
        out = cls(driver, array.shape, array.dtype)
        driver.htod(out.ptr, array.ctypes.data, out.nbytes, stream)
        driver.sync(stream)
        return out

    def numpy(self, stream: int = 0) -> np.ndarray:
        host = np.empty(self.shape, dtype=self.dtype)
        self.driver.dtoh(host.ctypes.data, self.ptr, self.nbytes, stream)
        self.driver.sync(stream)
        return host

    def __del__(self):
        try:
            if self.ptr:
                self.driver.free(self.ptr)
                self.ptr = 0
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class TensorRTSession:
    """One graph's TensorRT engine, implementing the runtime Session protocol."""

    def __init__(self, directory: str | Path, spec: GraphSpec, **options: Any):
        from ...engines.config import Profile, check_engine_compat, select_profile  # noqa: F401
        from ...engines.trt_build import CudaDriver, require_tensorrt

        directory = Path(directory)
        self.spec = spec
        manifest = read_manifest(directory, verify_files=False)
        plan_file = spec.extra.get("engine")
        if not manifest.engine or not plan_file:
            raise ArtifactError(
                f"{directory}: no TensorRT engine for {spec.file} (build one with `speccompile build {directory} --out DIR`, "
                f"or use --backend ort-cpu / ort-trt)"
            )
        trt = require_tensorrt()
        self.trt = trt
        self.driver = CudaDriver(int(options.get("device", 0)))
        check_engine_compat(manifest.engine, trt.__version__, self.driver.compute_capability(), self.driver.name())
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.runtime = trt.Runtime(self.logger)
        self.engine = self.runtime.deserialize_cuda_engine((directory / plan_file).read_bytes())
        if self.engine is None:
            raise ArtifactError(f"{directory / plan_file}: TensorRT could not deserialize the engine")
        self.context = self.engine.create_execution_context()
        self.stream = self.driver.stream()
        graph_name = next((n for n, g in manifest.graphs.items() if g.file == spec.file), "target")
        self.profiles = [
            Profile(p["name"], {k: tuple(v) for k, v in p["shapes"].items()})
            for p in manifest.engine.get("profiles", {}).get(graph_name, [])
        ]
        self._select_profile = select_profile
        self._profile = 0
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.input_names = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.output_names = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        missing = set(spec.input_names()) - set(self.input_names)
        if missing:
            raise ArtifactError(f"{plan_file}: engine lacks inputs {sorted(missing)} of {spec.file}")
        self.dtypes = {n: np.dtype(trt.nptype(self.engine.get_tensor_dtype(n))) for n in names}
        self.past_names = [n for n in spec.input_names() if n.startswith("past_key_values")]
        self.present_names = [n for n in spec.output_names() if n.startswith("present")]
        self.hidden_name = next((n for n in ("hidden_states", "aux_hidden_states") if n in self.output_names), None)
        past = next(t for t in spec.inputs if t.name.startswith("past_key_values"))
        self.kv_heads, self.head_dim = int(past.shape[1]), int(past.shape[3])
        self._dummy = DeviceArray(self.driver, (1,), np.uint8)  # address for empty tensors

    # -- KV cache ----------------------------------------------------------------------------------
    def _from_numpy(self, array: np.ndarray) -> DeviceArray:
        return DeviceArray.from_numpy(self.driver, array, self.stream)

    def new_cache(self, max_dead: int = 64) -> KVCache:
        empty = [DeviceArray(self.driver, (1, self.kv_heads, 0, self.head_dim), self.dtypes[n]) for n in self.past_names]
        return KVCache(empty, to_numpy=lambda a: a.numpy(self.stream), from_numpy=self._from_numpy, max_dead=max_dead)

    # -- one step ----------------------------------------------------------------------------------
    def run(self, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray, cache: KVCache) -> StepOutput:
        trt_ctx, driver, stream = self.context, self.driver, self.stream
        q = int(np.asarray(input_ids).size)
        host = {
            "input_ids": np.ascontiguousarray(input_ids, dtype=self.dtypes["input_ids"]).reshape(1, q),
            "position_ids": np.ascontiguousarray(position_ids, dtype=self.dtypes["position_ids"]).reshape(1, q),
            "attention_mask": np.ascontiguousarray(attention_mask, dtype=self.dtypes["attention_mask"]),
        }
        shapes = {name: a.shape for name, a in host.items()}
        for name, tensor in zip(self.past_names, cache.tensors):
            shapes[name] = tensor.shape
        if self.profiles:
            index = self._select_profile(self.profiles, shapes)
            if index != self._profile:
                trt_ctx.set_optimization_profile_async(index, stream)
                self._profile = index
        keep_alive = []
        for name, array in host.items():
            dev = DeviceArray(driver, array.shape, array.dtype)
            driver.htod(dev.ptr, array.ctypes.data, dev.nbytes, stream)
            keep_alive.append(dev)
            if not trt_ctx.set_input_shape(name, array.shape):
                raise InputError(f"TensorRT rejected shape {array.shape} for {name} (outside the engine's profiles?)")
            trt_ctx.set_tensor_address(name, dev.ptr)
        for name, tensor in zip(self.past_names, cache.tensors):
            if not trt_ctx.set_input_shape(name, tensor.shape):
                raise InputError(f"TensorRT rejected shape {tensor.shape} for {name}: context longer than the engine's max_context?")
            trt_ctx.set_tensor_address(name, tensor.ptr if tensor.nbytes else self._dummy.ptr)
        outputs: dict[str, DeviceArray] = {}
        for name in self.output_names:
            shape = tuple(trt_ctx.get_tensor_shape(name))
            if any(d < 0 for d in shape):
                raise InputError(f"TensorRT could not infer the shape of {name} ({shape})")
            outputs[name] = DeviceArray(driver, shape, self.dtypes[name])
            trt_ctx.set_tensor_address(name, outputs[name].ptr if outputs[name].nbytes else self._dummy.ptr)
        if not trt_ctx.execute_async_v3(stream):
            raise InputError("TensorRT execute_async_v3 failed")
        logits = outputs["logits"].numpy(stream)[0].astype(np.float32, copy=False)
        hidden = outputs[self.hidden_name].numpy(stream)[0] if self.hidden_name else None
        driver.sync(stream)
        return StepOutput(logits=logits, presents=[outputs[n] for n in self.present_names], hidden=hidden)


# -- static shapes and CUDA graphs (engines built with --profiles buckets) --------------------------------
@dataclass(frozen=True)
class BucketLayout:
    """What a bucket engine's profiles fix: q bucket -> profile index, the KV rows, the prefill profile."""

    buckets: dict[int, int]
    capacity: int
    prefill: int | None


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

    def __init__(self, base: TensorRTSession, layout: BucketLayout, cuda_graphs: bool = True):
        self.base, self.layout, self.spec = base, layout, base.spec
        base.context = None  # its profile 0 belongs to the q1 bucket's context (one context per profile)
        self.cuda_graphs = cuda_graphs
        self.driver, self.stream, self.trt = base.driver, base.stream, base.trt
        self.capacity = layout.capacity
        self.buckets = tuple(layout.buckets)
        names = base.past_names
        self.kv = [DeviceArray(self.driver, (1, base.kv_heads, self.capacity, base.head_dim), base.dtypes[n]) for n in names]
        for array in self.kv:
            self.driver.memset(array.ptr, array.nbytes, self.stream)  # unused rows are masked, but never NaN
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
            self.driver.launch(entry["exec"], self.stream)
            return
        if not entry["context"].execute_async_v3(self.stream):
            raise InputError("TensorRT execute_async_v3 failed")
        if self.cuda_graphs:
            self.driver.sync(self.stream)
            self.driver.begin_capture(self.stream)
            ok = entry["context"].execute_async_v3(self.stream)
            entry["graph"] = self.driver.end_capture(self.stream)
            if not ok:
                raise InputError("TensorRT execute_async_v3 failed during CUDA graph capture")
            entry["exec"] = self.driver.instantiate(entry["graph"])

    def new_cache(self, max_dead: int = 64) -> DeviceKVCache:
        self._cache.length = 0
        return self._cache

    def run(self, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray, cache: DeviceKVCache) -> StepOutput:
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
            raise InputError(f"{int(np.asarray(input_ids).size)} tokens in one pass: the engine's largest bucket is {self.buckets[-1]} (lower --prefill-chunk)")
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
                self.driver.copy_2d(kv.ptr + c.dst_offset, c.dst_pitch, present.ptr + c.src_offset, c.src_pitch, c.width, c.height, self.stream)


def _rows(driver, array: DeviceArray, q: int, stream: int) -> np.ndarray:
    """The first q rows of a [1, Q, W] device tensor (contiguous: one copy of q * W elements)."""
    width = array.shape[-1]
    host = np.empty((q, width), dtype=array.dtype)
    driver.dtoh(host.ctypes.data, array.ptr, host.nbytes, stream)
    driver.sync(stream)
    return host


def open_tensorrt_session(directory: str | Path, spec: GraphSpec, **options: Any):
    """The engine's session: TensorRTGraphSession for `--profiles buckets` engines, else TensorRTSession."""
    base = TensorRTSession(directory, spec, **options)
    manifest = read_manifest(directory, verify_files=False)
    graph_name = next((n for n, g in manifest.graphs.items() if g.file == spec.file), "target")
    layout = bucket_layout(manifest.engine.get("profiles", {}).get(graph_name, []))
    return TensorRTGraphSession(base, layout, bool(options.get("cuda_graphs", True))) if layout else base
