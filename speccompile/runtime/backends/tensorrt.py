"""Native TensorRT backend: a serialized engine per graph, KV cache kept in device memory between steps.

Needs the `tensorrt` package and an NVIDIA GPU (device memory and streams through the CUDA driver API via
ctypes, so no torch / cuda-python). The engine must have been built by `speccompile build` with the same
TensorRT version for the same GPU: both are recorded in the manifest and checked before deserializing.

Per step: input ids / positions / mask are copied to the device, past KV tensors are bound by address
(the previous step's present buffers, adopted by the KVCache), present buffers are allocated for the new
length, the profile covering the shapes is selected, `execute_async_v3` runs, logits come back to the host.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ...accel.cuda import CudaDriver
from ...accel.profiles import engine_profiles, select_profile
from ...accel.trt import check_engine_compat, require_tensorrt
from ...errors import ArtifactError, InputError
from ...manifest import GraphSpec, Manifest
from ..kvcache import KVCache
from .base import StepOutput, feature_inputs, hidden_output
from .wide_head import UNBOUNDED_ROWS


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


class TensorRTEngine:
    """One graph's serialized TensorRT engine: deserialized after the version/GPU check, run on its own stream."""

    def __init__(self, directory: str | Path, manifest: Manifest, spec: GraphSpec, device: int = 0):
        directory = Path(directory)
        self.spec = spec
        plan_file = spec.extra.get("engine")
        if not manifest.engine or not plan_file:
            raise ArtifactError(
                f"{directory}: no TensorRT engine for {spec.file} (build one with `speccompile build {directory} --out DIR`, "
                f"or use the ort-cpu / ort-trt backend)"
            )
        trt = require_tensorrt()
        self.trt = trt
        self.driver = CudaDriver(device)
        check_engine_compat(manifest.engine, trt.__version__, self.driver.compute_capability(), self.driver.name())
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.runtime = trt.Runtime(self.logger)
        self.engine = self.runtime.deserialize_cuda_engine((directory / plan_file).read_bytes())
        if self.engine is None:
            raise ArtifactError(f"{directory / plan_file}: TensorRT could not deserialize the engine")
        self.context = self.engine.create_execution_context()
        self.stream = self.driver.stream()
        graph_name = next((n for n, g in manifest.graphs.items() if g.file == spec.file), "target")
        self.profiles = engine_profiles(manifest, graph_name)
        self._profile = 0
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.input_names = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.output_names = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        missing = set(spec.input_names()) - set(self.input_names)
        if missing:
            raise ArtifactError(f"{plan_file}: engine lacks inputs {sorted(missing)} of {spec.file}")
        self.dtypes = {n: np.dtype(trt.nptype(self.engine.get_tensor_dtype(n))) for n in names}
        self._dummy = DeviceArray(self.driver, (1,), np.uint8)  # address for empty tensors

    def _host(self, name: str, array: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        return np.ascontiguousarray(array, dtype=self.dtypes[name]).reshape(shape)

    def execute(self, host: dict[str, np.ndarray], on_device: dict[str, DeviceArray]) -> dict[str, DeviceArray]:
        """One engine call: `host` inputs are copied to the device, `on_device` inputs bound by address; the
        profile covering the shapes is selected; returns every output in a fresh device buffer (synchronized)."""
        trt_ctx, driver, stream = self.context, self.driver, self.stream
        shapes = {name: a.shape for name, a in host.items()}
        shapes.update({name: tensor.shape for name, tensor in on_device.items()})
        if self.profiles:
            index = select_profile(self.profiles, shapes)
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
        for name, tensor in on_device.items():
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
        driver.sync(stream)  # the host inputs' device copies (keep_alive) may be freed after this
        return outputs


class TensorRTSession(TensorRTEngine):
    """A graph with a KV cache (target, draft model, EAGLE/MTP heads), implementing the runtime Session protocol."""

    row_invariant = False  # GPU kernels choose their reductions by shape
    max_caches = None  # each cache holds tensors of its own

    def __init__(self, directory: str | Path, manifest: Manifest, spec: GraphSpec, device: int = 0):
        super().__init__(directory, manifest, spec, device)
        self.past_names = [n for n in spec.input_names() if n.startswith("past_key_values")]
        self.present_names = [n for n in spec.output_names() if n.startswith("present")]
        self.hidden_name = hidden_output(spec)
        self.feature_names = feature_inputs(spec)
        past = next(t for t in spec.inputs if t.name.startswith("past_key_values"))
        self.kv_heads, self.head_dim = int(past.shape[1]), int(past.shape[3])

    # -- KV cache ----------------------------------------------------------------------------------
    def _from_numpy(self, array: np.ndarray) -> DeviceArray:
        return DeviceArray.from_numpy(self.driver, array, self.stream)

    def pass_rows(self, start: int) -> int:
        """Any number (Session.pass_rows)."""
        return UNBOUNDED_ROWS

    def new_cache(self, max_dead: int = 64) -> KVCache:
        empty = [DeviceArray(self.driver, (1, self.kv_heads, 0, self.head_dim), self.dtypes[n]) for n in self.past_names]
        return KVCache(empty, to_numpy=lambda a: a.numpy(self.stream), from_numpy=self._from_numpy, max_dead=max_dead)

    # -- one step ----------------------------------------------------------------------------------
    def run(self, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray, cache: KVCache,
            last_logits_only: bool = False, **features: np.ndarray) -> StepOutput:
        q = int(np.asarray(input_ids).size)
        host = {
            "input_ids": self._host("input_ids", input_ids, (1, q)),
            "position_ids": self._host("position_ids", position_ids, (1, q)),
            "attention_mask": self._host("attention_mask", attention_mask, np.shape(attention_mask)),
        }
        for name in self.feature_names:
            host[name] = self._host(name, features[name], (1, *np.shape(features[name])))
        outputs = self.execute(host, dict(zip(self.past_names, cache.tensors)))
        logits = outputs["logits"].numpy(self.stream)[0].astype(np.float32, copy=False)
        hidden = outputs[self.hidden_name].numpy(self.stream)[0] if self.hidden_name else None
        return StepOutput(logits=logits, presents=[outputs[n] for n in self.present_names], hidden=hidden)


class TensorRTFeatureSession(TensorRTEngine):
    """A graph without KV cache (the Medusa heads), implementing the runtime FeatureSession protocol."""

    max_caches = None  # no state between runs

    def run(self, hidden_states: np.ndarray) -> np.ndarray:
        host = {"hidden_states": self._host("hidden_states", hidden_states, (1, *np.shape(hidden_states)))}
        return self.execute(host, {})["logits"].numpy(self.stream)[0].astype(np.float32, copy=False)
