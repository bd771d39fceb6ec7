"""ONNX Runtime's packed block-quantized weight layouts: `com.microsoft` MatMulNBits and GatherBlockQuantized.

A weight W [K, N] (K the reduction axis) quantized in blocks of B consecutive inputs per output column, with
unsigned codes q in [0, 2^bits), a step `scale` and a zero point z per block, is W[k, n] = (q[k, n] - z) scale.
MatMulNBits stores it transposed and packed:

* B       uint8 [N, K/B, B bits / 8]: each output column's codes along K, low bits first (two 4-bit codes a
          byte: even k in the low nibble);
* scales  [N, K/B] in the activation's float type;
* zero_points (optional; absent means 2^(bits-1)): uint8 [N, ceil(K/B bits / 8)] packed like B, or the
          scales' float type [N, K/B] (a real-valued zero point: Q4_1-style grids w = d q + m have z = -m / d).

GatherBlockQuantized reads a table T [V, H] with blocks along H (quantize_axis 1): data uint8 [V, H bits / 8]
(8 bits: uint8 codes; 4 bits: packed as above), scales [V, H/B], zero_points uint8 packed like the data.
A tied table is the same bytes as the lm_head's MatMulNBits weight (N = V, K = H): one packing serves both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..weights_file import external_location, external_tensor
from .integer_head import constant_tensors, integer_head_nodes, weight_arrays

BITS = (4, 8)


@dataclass
class NBitsWeight:
    """W [K, N] = (codes - zero_point) * scale in blocks of `block` along K; arrays in MatMulNBits' layout."""

    packed: np.ndarray  # uint8 [N, K/B, B bits / 8]
    scales: np.ndarray  # float32 [N, K/B]
    zero_points: np.ndarray | None  # uint8 [N, packed K/B] or float32 [N, K/B]; None: 2^(bits-1)
    bits: int
    block: int
    k: int
    n: int

    def dequantize(self) -> np.ndarray:
        """W [K, N] as float32, the way the kernels read it ((q - z) * s in float32)."""
        codes = unpack_codes(self.packed.reshape(self.n, -1), self.bits, self.k).reshape(self.n, self.k // self.block, self.block)
        if self.zero_points is None:
            zero = np.full(self.scales.shape, 2 ** (self.bits - 1), np.float32)
        elif self.zero_points.dtype == np.uint8:
            zero = unpack_codes(self.zero_points, self.bits, self.k // self.block).astype(np.float32)
        else:
            zero = self.zero_points.astype(np.float32)
        w = (codes.astype(np.float32) - zero[:, :, None]) * self.scales[:, :, None]
        return np.ascontiguousarray(w.reshape(self.n, self.k).T)


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned codes [..., L] (L * bits a multiple of 8) packed along the last axis, low bits first."""
    codes = np.asarray(codes)
    if bits == 8:
        return codes.astype(np.uint8)
    if bits != 4:
        raise ValueError(f"bits must be one of {BITS}, got {bits}")
    if codes.shape[-1] % 2:
        codes = np.concatenate([codes, np.zeros((*codes.shape[:-1], 1), codes.dtype)], axis=-1)
    low, high = codes[..., 0::2].astype(np.uint8), codes[..., 1::2].astype(np.uint8)
    return (low & 0xF) | ((high & 0xF) << 4)


def unpack_codes(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """The first `count` unsigned codes along the last axis of `packed` (inverse of pack_codes)."""
    if bits == 8:
        return packed[..., :count].astype(np.uint8)
    out = np.empty((*packed.shape[:-1], packed.shape[-1] * 2), np.uint8)
    out[..., 0::2] = packed & 0xF
    out[..., 1::2] = packed >> 4
    return out[..., :count]


def nbits_weight(codes: np.ndarray, scale: np.ndarray, bits: int, block: int, zero_point: np.ndarray | None = None) -> NBitsWeight:
    """MatMulNBits arrays for W = (codes - zero_point) * scale, with codes [K, N] unsigned in [0, 2^bits) and
    scale / zero_point [K/B, N] (zero_point: integer-valued -> packed uint8; otherwise float32; None -> 2^(bits-1))."""
    k, n = codes.shape
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits}")
    if k % block:
        raise ValueError(f"K={k} is not a multiple of the block {block}")
    if codes.min() < 0 or codes.max() >= 2 ** bits:
        raise ValueError(f"codes outside [0, {2 ** bits})")
    blob = codes.T.reshape(n, k // block, block)
    packed = pack_codes(blob, bits)
    zeros = None
    if zero_point is not None:
        z = np.asarray(zero_point, np.float32).T
        integral = np.array_equal(z, np.rint(z)) and z.min() >= 0 and z.max() < 2 ** bits
        zeros = pack_codes(z.astype(np.uint8), bits) if integral else np.ascontiguousarray(z)
    return NBitsWeight(np.ascontiguousarray(packed), np.ascontiguousarray(np.asarray(scale, np.float32).T), zeros, bits, block, k, n)


def reblock_rows(scale_rows: np.ndarray, k: int, block: int) -> np.ndarray:
    """Per-row scales [N, G] over G equal blocks of K (G = 1: one per row) as scales [N, K / block]: the same
    values, each repeated over the smaller blocks (a grid of blocks of 128 is a grid of blocks of 32)."""
    n, groups = scale_rows.shape
    if k % groups or (k // groups) % block:
        raise ValueError(f"blocks of {k // groups} over K={k} are not whole blocks of {block}")
    return np.repeat(np.asarray(scale_rows, np.float32), k // groups // block, axis=1)


def symmetric_rows(codes_rows: np.ndarray, scale_rows: np.ndarray, bits: int, block: int) -> NBitsWeight:
    """MatMulNBits arrays for output rows W^T [N, K] = c * s: signed codes c [N, K] in [-2^(bits-1), 2^(bits-1)),
    scales [N, G] over G equal blocks of K (re-blocked to `block`); the default zero point (no zero-point input)."""
    n, k = codes_rows.shape
    if k % block:
        raise ValueError(f"K={k} is not a multiple of the block {block}")
    unsigned = (np.asarray(codes_rows, np.int16) + 2 ** (bits - 1)).astype(np.uint8)
    packed = pack_codes(unsigned.reshape(n, k // block, block), bits)
    return NBitsWeight(np.ascontiguousarray(packed), np.ascontiguousarray(reblock_rows(scale_rows, k, block)), None, bits, block, k, n)


# ------------------------------------------------------------------------------------------ graph rewriting

KERNEL_BLOCK = 32  # MatMulNBits / GatherBlockQuantized block (see engines/cpu_graph.py for why 32)
WIDE_BLOCK = 64  # 8-bit weights on a grid of blocks of 64 run at blocks of 64: row-exact too, and faster (docs/cpu.md)
FINE_BLOCK = 16  # weights on a grid of blocks of 16 (Q6_K's, Q3_K's) run at blocks of 16: row-exact at 4 and 8 bits (docs/cpu.md)
ACCURACY_LEVEL = 4  # MatMulNBits: int8 activations per block, integer dot products (row-exact at blocks of 32)
_MS = "com.microsoft"
_SIGNED = {TensorProto.INT4: 4, TensorProto.INT8: 8}


class QuantizedSource(Protocol):
    """Where the packer reads the quantized contract graph's tensors (engines/cpu_graph.py's _Graph)."""

    inits: dict[str, TensorProto]

    def array(self, name: str) -> np.ndarray: ...


class PackedWeight(NamedTuple):
    """A weight written in MatMulNBits' layout: its packed codes' and scales' tensor names, shape, bits, kernel block."""

    data: str
    scales: str
    k: int
    n: int
    bits: int
    block: int


class NBitsPacker:
    """Turns the quantized contract graph's `reader(DequantizeLinear(codes, scale))` patterns into MatMulNBits and
    GatherBlockQuantized nodes over packed copies of the same codes, written once to `writer`.

    Tensor names in the rewritten graphs: `name_of(t)` for the quantized graph's initializers (reused in place,
    `reuse`) and shared constants; packed tensors under names of their own (`tensor` gives any of them)."""

    def __init__(self, quantized: QuantizedSource, writer, accuracy_level: int = ACCURACY_LEVEL, block: int = KERNEL_BLOCK):
        self.quantized = quantized
        self.writer = writer
        self.accuracy_level = accuracy_level
        self.block = block
        self.new_tensors: dict[str, TensorProto] = {}
        self._packed: dict[tuple[str, str], PackedWeight] = {}
        self._row_scaled_heads: dict[str, onnx.NodeProto] = {}  # packed data name -> its DequantizeLinear (8 bits, a scale per row)
        self.counts = {"MatMulNBits": 0, "GatherBlockQuantized": 0, "DequantizeLinear kept": 0}

    @staticmethod
    def name_of(tensor: str) -> str:
        return f"quantized/{tensor}"

    def reuse(self, source_name: str, name: str) -> TensorProto:
        """The quantized graph's initializer `source_name` as initializer `name` (same bytes, same file)."""
        init = self.quantized.inits[source_name]
        stored = external_location(init)
        if stored is None:
            copy = TensorProto()
            copy.CopyFrom(init)
            copy.name = name
            return copy
        return external_tensor(name, init.data_type, list(init.dims), stored)

    def tensor(self, name: str) -> TensorProto | None:
        """An initializer the rewritten nodes read: packed (new) or one of the quantized graph's."""
        if name in self.new_tensors:
            return self.new_tensors[name]
        prefix = self.name_of("")
        if name.startswith(prefix) and name[len(prefix):] in self.quantized.inits:
            return self.reuse(name[len(prefix):], name)
        return None

    def summary(self) -> dict:
        used = {p.block for p in self._packed.values()}
        other = {key: block for key, block in (("wide_block", WIDE_BLOCK), ("fine_block", FINE_BLOCK)) if block in used}
        return {"accuracy_level": self.accuracy_level, "block": self.block, **other, **{k: v for k, v in self.counts.items() if v}}

    def integer_heads(self, nodes: list) -> list:
        """`nodes` with each MatMulNBits over an 8-bit table scaled per row (a tied lm_head) replaced by the integer
        product of engines/integer_head.py; its int8 [K, N] weight and column scales written once."""
        out = []
        for node in nodes:
            dq = self._row_scaled_heads.get(node.input[1]) if node.op_type == "MatMulNBits" else None
            if dq is None:
                out.append(node)
                continue
            weight, column_scales = self._integer_weight(dq, node.input[1])
            self.counts["MatMulNBits"] -= 1
            self.counts["MatMulInteger"] = self.counts.get("MatMulInteger", 0) + 1
            out += integer_head_nodes(node.input[0], weight, column_scales, node.output[0], node.name or "lm_head")
        return out

    def _integer_weight(self, dq, data: str) -> tuple[str, str]:
        """Names of the int8 [K, N] weight and [N] column scales of the per-row table behind `dq` (written once)."""
        name = data + ".integer"
        if name not in self.new_tensors:
            codes, scale_rows, _bits = self._rows(dq, "rows")
            weight, column_scales = weight_arrays(codes, scale_rows)
            for tensor in (self.writer.add(name, weight), self.writer.add(name + ".scales", column_scales), *constant_tensors()):
                self.new_tensors.setdefault(tensor.name, tensor)
        return name, name + ".scales"

    def convert(self, nodes: list) -> list:
        """Copies of `nodes` (one region of the quantized graph) with every convertible reader of a weight
        DequantizeLinear replaced by its packed kernel; DequantizeLinear nodes nothing reads any more dropped."""
        producers = {o: n for n in nodes for o in n.output}
        out = []
        for node in nodes:
            new = self._packed_reader(node, producers)
            copy = onnx.NodeProto()
            copy.CopyFrom(new or node)
            out.append(copy)
        read = {t for n in out for t in n.input}
        kept = [n for n in out if n.op_type != "DequantizeLinear" or any(o in read for o in n.output)]
        self.counts["DequantizeLinear kept"] += sum(n.op_type == "DequantizeLinear" for n in kept)
        return kept

    def _packed_reader(self, node, producers: dict):
        """The packed-kernel form of `node`, or None when it is not a reader of a convertible weight."""
        if node.op_type == "MatMul" and len(node.input) == 2:
            position, role = 1, "cols"
        elif node.op_type == "Gemm" and len(node.input) == 2 and _attrs(node) == {"transB": 1}:
            position, role = 1, "rows"
        elif node.op_type == "Gather" and _attrs(node).get("axis", 0) == 0:
            position, role = 0, "rows"
        else:
            return None
        dq = producers.get(node.input[position])
        if dq is None or dq.op_type != "DequantizeLinear":
            return None
        packed = self._pack(dq, role)
        if packed is None:
            return None
        data, scales, k, n, bits, block = packed
        if node.op_type == "Gather":
            self.counts["GatherBlockQuantized"] += 1
            return helper.make_node("GatherBlockQuantized", [data + ".rows", node.input[1], scales], list(node.output),
                                    name=node.name, domain=_MS, bits=bits, block_size=block, gather_axis=0, quantize_axis=1)
        self.counts["MatMulNBits"] += 1
        return helper.make_node("MatMulNBits", [node.input[0], data, scales], list(node.output), name=node.name, domain=_MS,
                                K=k, N=n, bits=bits, block_size=block, accuracy_level=self.accuracy_level)

    def _pack(self, dq, role: str) -> PackedWeight | None:
        """DequantizeLinear `dq`'s weight read as `role` ("cols": a MatMul weight [K, N]; "rows": a table [N, K]
        read by Gather or by Gemm with transB), written once; None if not convertible. The kernel block: `_kernel_block`."""
        key = (dq.input[0], role)
        if key not in self._packed:
            grid = self._rows(dq, role)
            if grid is None:
                return None
            codes, scale_rows, bits = grid
            block = _kernel_block(bits, codes.shape[1] // scale_rows.shape[1], self.block)
            try:
                weight = symmetric_rows(codes, scale_rows, bits, block)
            except ValueError:
                return None
            stem = f"{self.name_of(dq.input[0])}.{role}.b{block}"
            data = self.writer.add(stem, weight.packed)
            rows = external_tensor(stem + ".rows", TensorProto.UINT8, [weight.n, weight.packed[0].size], self.writer.stored(stem))
            scales = self.writer.add(stem + ".scales", weight.scales)
            for tensor in (data, rows, scales):
                self.new_tensors[tensor.name] = tensor
            self._packed[key] = PackedWeight(data.name, scales.name, weight.k, weight.n, bits, block)
            if role == "rows" and bits == 8 and scale_rows.shape[1] == 1:
                self._row_scaled_heads[data.name] = dq
        return self._packed[key]

    def _rows(self, dq, role: str) -> tuple[np.ndarray, np.ndarray, int] | None:
        """(signed codes [N, K], scales [N, G], bits) of a weight DequantizeLinear, or None (another type, a
        non-zero zero point, a layout the kernels do not take)."""
        inits = self.quantized.inits
        if not all(t in inits for t in dq.input if t):
            return None
        codes_init = inits[dq.input[0]]
        bits = _SIGNED.get(codes_init.data_type)
        if bits is None or len(codes_init.dims) != 2:
            return None
        if len(dq.input) > 2 and dq.input[2] and np.any(np.asarray(self.quantized.array(dq.input[2]))):
            return None
        codes = _signed_codes(self.quantized.array(dq.input[0]), codes_init)
        scale = np.asarray(self.quantized.array(dq.input[1]), np.float32)
        attrs = _attrs(dq)
        axis, block = attrs.get("axis", 1), attrs.get("block_size", 0)
        axis = axis % 2
        if role == "cols":  # W [K, N]: output rows are its columns
            codes = codes.T
            axis = 1 - axis
            scale = scale.T if scale.ndim == 2 else scale
        n = codes.shape[0]
        if scale.ndim == 0 or scale.size == 1:
            return codes, np.full((n, 1), float(scale.reshape(-1)[0]), np.float32), bits
        if block and axis == 1 and scale.ndim == 2:  # blocks along K
            return codes, scale, bits
        if not block and axis == 0 and scale.ndim == 1:  # one scale per output row
            return codes, scale[:, None], bits
        return None


def _kernel_block(bits: int, grid_block: int, default: int) -> int:
    """The MatMulNBits block a weight on a grid of `grid_block` runs at: its own where that is row-exact (FINE_BLOCK,
    and WIDE_BLOCK at 8 bits), else `default` (coarser grids repeat their scales over it)."""
    return grid_block if grid_block == FINE_BLOCK or (bits == 8 and grid_block == WIDE_BLOCK) else default


def _attrs(node) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _signed_codes(raw: np.ndarray, init: TensorProto) -> np.ndarray:
    """int8 codes of an INT8 initializer, or of an INT4 one stored as raw packed bytes (two's complement nibbles)."""
    shape = tuple(int(d) for d in init.dims)
    if init.data_type == TensorProto.INT8:
        return np.asarray(raw, np.int8).reshape(shape)
    nibbles = unpack_codes(np.asarray(raw, np.uint8).reshape(-1), 4, int(np.prod(shape))).astype(np.int8)
    return ((nibbles ^ 8) - 8).astype(np.int8).reshape(shape)
