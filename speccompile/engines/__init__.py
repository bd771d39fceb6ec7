"""Quantization (FP8 / INT4 / NVFP4 Q/DQ on the exported ONNX graphs) and TensorRT engine builds.

Modules (none imports TensorRT at import time; torch is never needed):
  numerics      numpy FP8 / INT4 / NVFP4 quantizers, 4-bit packing, reference dequantization
  quantize      the graph passes: quantize_model(model, QuantOptions, act_amax) -> QuantReport
  calibrate     activation amax from ONNX Runtime CPU runs of the unquantized graph
  compat        check_tensorrt_compat(model_or_path) -> CompatReport (operators / dtypes the TRT parser takes)
  config        build configuration as data: profiles_for, make_build_config (TRT 10 vs 11),
                check_hardware (refusal table by compute capability), engine_section / check_engine_compat,
                trtexec_command
  build         build_artifact(src, out, BuildOptions): the `speccompile build` pipeline (atomic output)
  trt_build     guarded TensorRT / CUDA-driver code: require_tensorrt, gpu_info, build_engine
  ort_trt       tensorrt_ep_options: ONNX Runtime TensorRT EP provider options for an artifact
  cli_commands  the `build` click command
"""
