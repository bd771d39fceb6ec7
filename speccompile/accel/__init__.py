"""TensorRT / CUDA helpers shared by `export`, `engines` (building TensorRT engines) and `runtime` (running them).

Neutral ground between them: these modules import none of them, only the
artifact contract (`manifest`, `errors`). Nothing here imports TensorRT or CUDA at import time.

  cuda      CudaDriver: the CUDA driver API over ctypes (device query, memory, streams), gpu_info
  trt       import_tensorrt / require_tensorrt, TensorRT version parsing, check_engine_compat
  profiles  optimization profiles from the manifest limits: profiles_for, select_profile, Profile
  compat    check_tensorrt_compat: does the TensorRT ONNX parser take a graph (export records it, build refuses)
  ort_trt   tensorrt_ep_options: ONNX Runtime TensorRT execution provider options for an artifact graph
"""
