"""What `speccompile build` is asked to do (`BuildOptions`), checked before any work."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..accel.compat import TRT_INT4_BLOCKS
from ..accel.profiles import DEFAULT_PREFILL_CHUNK
from ..errors import InputError
from . import config as cfg
from .int8_weights import INT8_BLOCK, INT8_BLOCKS, check_int8_options
from .methods import MethodOptions
from .qad import QadOptions
from .qdq_targets import DEFAULT_EXCLUDE, TABLE_FORMATS, QuantOptions
from .segments import SEGMENT_PARAMETERS
from .sensitivity import KEEP_FORMATS


@dataclass
class BuildOptions:
    precision: str = "none"  # none | fp8 | int4 | nvfp4 | int8
    onnx_only: bool = False
    calib: Path | None = None
    calib_samples: int = 16
    calib_max_tokens: int = 256
    exclude: tuple[str, ...] = DEFAULT_EXCLUDE
    int4_block: int = 128
    int8_block: int = INT8_BLOCK  # INT8 block along K (32: Q8_0's grid; 64: faster packed CPU passes, docs/cpu.md)
    quantize_tables: bool = False  # embedding tables (and a tied lm_head) stored quantized too
    table_block: int = 64  # INT4 block along H of an embedding table (TensorRT: 64 or 128)
    table_format: str = "int8"  # TABLE_FORMATS: "int8" (per row, or the source's Q8_0 blocks) | "int8-row" | "fp16" | "scheme"
    profiles: str = "single"
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    opt_q: int | None = None
    opt_context: int | None = None
    workspace_mb: int | None = None
    builder_optimization_level: int = 3
    timing_cache: Path | None = None
    weakly_typed: bool = False
    threads: int | None = None
    force: bool = False
    float_dtype: str | None = None  # --fp16 / --bf16: precision of the layers that stay unquantized
    max_context: int | None = None  # limits for the engine's profiles (at most the exported ones)
    max_verify_tokens: int | None = None
    max_batch: int | None = None
    methods: MethodOptions = field(default_factory=MethodOptions)
    min_top1: float | None = None  # keep the most sensitive MatMuls unquantized until calibration top-1 >= this
    keep_format: str = "fp32"  # what --min-top1 keeps them in: fp32, or fp8 (weight-only, per channel)
    weight_only: bool = False  # fp8 / nvfp4: quantize the weights only (activations in the graph's float type)
    qad: QadOptions = field(default_factory=QadOptions)  # quantization-aware distillation (engines/qad.py)
    segment_parameters: int = SEGMENT_PARAMETERS  # weights per calibration / check segment (engines/segments.py)
    extra: dict = field(default_factory=dict)

    def validate(self) -> "BuildOptions":
        if self.precision not in cfg.PRECISIONS:
            raise InputError(f"precision must be one of {', '.join(cfg.PRECISIONS)}, got {self.precision}")
        if self.calib_samples < 1:
            raise InputError(f"--calib-samples must be >= 1, got {self.calib_samples}")
        if self.calib_max_tokens < 2:
            raise InputError(f"--calib-max-tokens must be >= 2, got {self.calib_max_tokens}")
        if self.int4_block not in (16, 32, 64, 128, 256):
            raise InputError(f"--int4-block must be one of 16, 32, 64, 128, 256, got {self.int4_block}")
        if self.int8_block not in INT8_BLOCKS:
            raise InputError(f"--int8-block must be one of {', '.join(map(str, INT8_BLOCKS))}, got {self.int8_block}")
        if self.table_format not in TABLE_FORMATS:
            raise InputError(f"--table-format must be one of {', '.join(TABLE_FORMATS)}, got {self.table_format}")
        if self.table_block not in TRT_INT4_BLOCKS:
            raise InputError(f"--table-block must be one of {', '.join(map(str, TRT_INT4_BLOCKS))}, got {self.table_block}")
        self.methods.validate()
        if self.precision == "int8":
            check_int8_options(self)
        self.qad.validate(QuantOptions(self.precision, weight_only=self.weight_only).defaults_key)
        if self.weight_only:
            if self.precision == "none":
                raise InputError("--weight-only needs a quantized precision: --fp8 or --fp4 (--int4 is weight-only already)")
            if self.methods.smoothquant is not None:
                raise InputError("--smoothquant moves activation outliers into the weights for activation quantization; "
                                 "--weight-only leaves the activations unquantized")
            if self.methods.act_calib != "max":
                raise InputError(f"--act-calib {self.methods.act_calib}: --weight-only quantizes no activation")
        if self.min_top1 is not None and not 0.0 < self.min_top1 <= 1.0:
            raise InputError(f"--min-top1 must be in (0, 1], got {self.min_top1}")
        if self.keep_format not in KEEP_FORMATS:
            raise InputError(f"--keep-format must be one of {', '.join(KEEP_FORMATS)}, got {self.keep_format}")
        if self.keep_format != "fp32" and self.min_top1 is None:
            raise InputError(f"--keep-format {self.keep_format}: it is the format of the weights --min-top1 keeps; pass --min-top1")
        if self.calib is not None:
            path = Path(self.calib)
            if not path.is_file():
                raise InputError(f"--calib {path}: no such file")
            if path.stat().st_size == 0 or not path.read_text(errors="replace").strip():
                raise InputError(f"--calib {path}: the file is empty")
        return self
