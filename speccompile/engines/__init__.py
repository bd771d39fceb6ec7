"""Quantization (FP8 / INT4 / NVFP4 Q/DQ on the exported ONNX graphs) and TensorRT engine builds.

Modules (none imports TensorRT at import time; torch is never needed):
  numerics      numpy FP8 / INT4 / NVFP4 quantizers, 4-bit packing, reference dequantization
  quantize      the graph passes: quantize_model(model, QuantOptions, act_amax) -> QuantReport
  calibrate     activation amax from ONNX Runtime CPU runs of the unquantized graph
  config        build configuration as data: make_build_config (TRT 10 vs 11), check_hardware (refusal
                table by compute capability), engine_section, trtexec_command
  build         build_artifact(src, out, BuildOptions): the `speccompile build` pipeline (atomic output)
  trt_build     build_engine with the TensorRT Python API

What the runtime needs as well (optimization profiles, the TensorRT import guard, the CUDA driver, the
engine compatibility check, TensorRT EP options, the ONNX compatibility checker) is in `speccompile.accel`.
The `build` click command is `speccompile/commands/build.py`.
"""
