"""Building blocks of the fused ONNX Runtime graphs (export/ort_fused_graph.py): the node writer, the
`com.microsoft` norms, the one-row attention padding of the CPU graph and the slotted graph's inputs."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from .graph_builder import value

MS_DOMAIN = "com.microsoft"
PAD_INPUT = "attention_pad"  # CPU graph: 1 appends attention's padding row to a pass (OneRowPadding)
WIDE_HEAD_DIM = 128  # above it, OneRowPadding takes a count of rows (`many`) and the manifest `attention_lift`


def attention_lift(head_dim: int) -> list[int]:
    """[block, short] for head_dim > 128: ONNX Runtime CPU rounds a row of GroupQueryAttention differently depending on
    where its pass ends. The runtime reads it as a rule (runtime/backends/wide_head.py): at head_dim 256 passes cut
    at slots 63 mod 128 (measured mechanism: MLAS's last column panel of <= 64 keys takes K in one stride), at 512
    at 31 mod 64, other
    widths padding rows that leave no remainder of 1..short modulo block (benchmarks/wide_head_gaps.py)."""
    return [128, 64]
TREE_BIAS = "attention_bias"  # the GPU slot graph's tree form: every slot's additive mask (GpuSlotInputs)
BATCH = "batch"  # the dynamic batch axis: one row per sequence, each with its own KV rows and seqlens_k


class Nodes:
    """A tiny node writer: unique output names, optional outputs as ''."""

    def __init__(self):
        self.nodes: list[onnx.NodeProto] = []
        self._count = 0

    def __call__(self, op: str, inputs: list[str], outputs: int | list[str] = 1, domain: str = "", **attrs) -> list[str]:
        self._count += 1
        if isinstance(outputs, int):
            outputs = [f"{op.lower()}_{self._count}_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op, inputs, outputs, name=f"{op}_{self._count}", domain=domain, **attrs))
        return outputs


class OneRowPadding:
    """The CPU graph's `attention_pad` input (int64 [1], 0 or 1): with 1, every GroupQueryAttention gets a copy
    of the pass's last row appended (same position; its KV lands one slot past the pass's rows; its output is
    dropped), so a one-row pass runs the same kernels as a multi-row one.

    Why: ONNX Runtime CPU's attention multiplies probabilities by values with MLAS's dedicated one-row SGEMM
    kernel when a pass has one row, and with the general kernel otherwise; the two sum in different orders, so
    a position's logits differed by up to ~4e-5 between plain decoding (q = 1) and a verify pass (q > 1).
    With the padding row every pass has >= 2 rows, and MLAS computes each row of the general kernel alike
    whatever the number of rows: a position's logits are the same bits in any pass (tests/test_ort_fused.py).
    Everything outside the attention (the weight matmuls, norms, lm_head) already is row-independent.
    ONNX Runtime refuses more than one row per sequence at batch > 1 with a past, so batched one-row
    passes run with 0 (runtime/batch.py); the slotted graph gets the same padding row per slot from the
    caller's row layout (`SlotInputs`).

    `many` (head_dim > 128): `attention_pad` is a count of padding rows (copies of the last row), so that the
    runtime can also move a pass's total length off the lengths where ONNX Runtime rounds differently
    (`attention_lift`)."""

    def __init__(self, n: Nodes, const, many: bool = False):
        self._n = n
        self._many = many
        pad = PAD_INPUT
        const("pad.axis", [1])
        const("pad.zero", [0])
        q_len = n("Shape", ["input_ids"], start=1, end=2)[0]
        self.q_len = q_len
        self._last = n("Sub", [q_len, const("pad.one", [1])])[0]
        self._end = n("Add", [self._last, pad])[0]  # [last, last + pad): the last row, or no row
        self.position_ids = self.rows("position_ids")
        pad32 = n("Cast", [pad], to=TensorProto.INT32)[0]
        self.seqlens_k = n("Add", ["seqlens_k", pad32])[0]
        self.total_sequence_length = n("Add", ["total_sequence_length", n("Squeeze", [pad32])[0]])[0]
        # the padding row sees every slot up to its own (bias 0; causal inside); no real row reaches its slot
        pads = n("Concat", [const("pad.bias_begin", [0, 0, 0, 0, 0, 0]), pad, pad], axis=0)[0]
        self.attention_bias = n("Pad", ["attention_bias", pads])[0]

    def rows(self, x: str) -> str:
        """`x` [batch, q, ...] with the padding row (if any) appended."""
        if self._many:
            extra = self._n("Gather", [x, self._n("Expand", [self._last, PAD_INPUT])[0]], axis=1)[0]
        else:
            extra = self._n("Slice", [x, self._last, self._end, "pad.axis"])[0]
        return self._n("Concat", [x, extra], axis=1)[0]

    def drop(self, x: str, name: str) -> str:
        """`x` without the padding row, as `name`."""
        return self._n("Slice", [x, "pad.zero", self.q_len, "pad.axis"], [name])[0]


class SlotInputs:
    """The slotted CPU graph's inputs: the rows of up to `slots` sequences packed along one pass (`input_ids`,
    `position_ids` [1, rows], slot b's rows after slot b - 1's; at least one each), and how each slot's
    GroupQueryAttention sees them, laid out by the caller (backends/ort_slots.py): `padded_index` [padded]
    gathers every slot's rows plus, for a one-row slot, its row again as the attention padding row
    (`OneRowPadding`); `padded_rows` [slots] splits them per slot; `unpadded_index` [rows] gathers the real rows
    back; per slot `seqlens_k`, `total_sequence_length` (int32 [slots], padding counted) and
    `attention_bias.{b}` [1, 1, q_b + pad_b, total_b] (padding row and column 0), and its KV buffers
    `past_key_values.{layer}.{b}.*`. The weight matmuls run over every slot's rows at once; each slot's
    attention is a batch of one, which ONNX Runtime takes with several rows and the padding row, so a slot's
    rows compute the same bits as the same rows of that sequence alone. One Gather, Split and Concat per
    layer and tensor lay the rows out (per-slot Slice/Concat nodes cost ~5 ms a pass on SmolLM2)."""

    def __init__(self, n: Nodes, const, slots: int):
        self._n = n
        self.slots = slots
        self.positions = self.split("position_ids")
        self.lengths = []
        for b in range(slots):
            at, to = const(f"slot.{b}.start", [b]), const(f"slot.{b}.end", [b + 1])
            seqlens = n("Slice", ["seqlens_k", at, to])[0]
            total = n("Squeeze", [n("Slice", ["total_sequence_length", at, to])[0]])[0]
            self.lengths.append((seqlens, total))

    def split(self, x: str) -> list[str]:
        """`x` [1, rows, ...] as each slot's padded rows."""
        padded = self._n("Gather", [x, "padded_index"], axis=1)[0]
        return self._n("Split", [padded, "padded_rows"], self.slots, axis=1)

    def join(self, outs: list[str], name: str) -> str:
        """Every slot's attention output back as the pass's real rows."""
        padded = self._n("Concat", outs, axis=1)[0]
        return self._n("Gather", [padded, "unpadded_index"], [name], axis=1)[0]

    def values(self) -> list[onnx.ValueInfoProto]:
        return [
            value("input_ids", TensorProto.INT64, [1, "rows"]),
            value("position_ids", TensorProto.INT64, [1, "rows"]),
            value("padded_index", TensorProto.INT64, ["padded"]),
            value("padded_rows", TensorProto.INT64, [self.slots]),
            value("unpadded_index", TensorProto.INT64, ["rows"]),
            value("seqlens_k", TensorProto.INT32, [self.slots]),
            value("total_sequence_length", TensorProto.INT32, [self.slots]),
            *[value(f"attention_bias.{b}", TensorProto.FLOAT, [1, 1, f"q_{b}", f"total_{b}"]) for b in range(self.slots)],
            value("logits_rows", TensorProto.INT64, ["logits_len"]),
        ]


class GpuSlotInputs(SlotInputs):
    """The slotted GPU graph's inputs: `slots` sequences with the same number of rows R each (`input_ids`,
    `position_ids` [slots, R]: a slot's real rows first, then padding rows, which causal attention hides from
    them), each slot's `seqlens_k` (int32 [slots]: its KV length after the pass, minus one), one
    `total_sequence_length` (the KV buffers' capacity, which the CUDA kernel reads on the host) and each slot's KV
    buffers `past_key_values.{layer}.{b}.*`. The weight matmuls run over all slots x R rows at once; each slot's
    GroupQueryAttention is a batch of one over its own buffer (ONNX Runtime's CPU kernel refuses a batch above one
    with several rows and a past). With R fixed (one bucket), a slot's rows are computed with the same shapes
    whatever the other slots hold.

    `tree` (the tree form, `target.ort-cuda-tree-slots.onnx`): one more input, `attention_bias` (float32 [slots, 1,
    R, kv_capacity], 0 or FLOAT_MIN), every slot's GroupQueryAttention takes its slice (`biases`), every pass,
    trees or not: ONNX Runtime's CUDA EP runs a node with a bias on its unfused kernel (onnxruntime >= 1.28),
    so all passes of this graph take the same attention path. Without `tree` no bias: causal, flash on CUDA."""

    def __init__(self, n: Nodes, const, slots: int, tree: bool = False):
        self._n = n
        self.slots = slots
        self.tree = tree
        self.positions = self.split("position_ids")
        self.lengths = [(n("Slice", ["seqlens_k", const(f"slot.{b}.start", [b]), const(f"slot.{b}.end", [b + 1])])[0],
                         "total_sequence_length") for b in range(slots)]
        self.biases = self.split(TREE_BIAS) if tree else []  # each slot's float32 [1, 1, R, kv_capacity]

    def split(self, x: str) -> list[str]:
        """`x` [slots, R, ...] as each slot's [1, R, ...]."""
        return self._n("Split", [x], self.slots, axis=0, num_outputs=self.slots)

    def join(self, outs: list[str], name: str) -> str:
        """Every slot's attention output back as [slots, R, ...]."""
        return self._n("Concat", outs, [name], axis=0)[0]

    def values(self) -> list[onnx.ValueInfoProto]:
        return [
            value("input_ids", TensorProto.INT64, [self.slots, "q_len"]),
            value("position_ids", TensorProto.INT64, [self.slots, "q_len"]),
            value("seqlens_k", TensorProto.INT32, [self.slots]),
            value("total_sequence_length", TensorProto.INT32, []),
            *([value(TREE_BIAS, TensorProto.FLOAT, [self.slots, 1, "q_len", "kv_capacity"])] if self.tree else []),
        ]


def skip_norm(n: Nodes, x: str, residual: str, gamma: str, eps: float) -> tuple[str, str]:
    """RMSNorm(x + residual) and the new residual stream, as one SkipSimplifiedLayerNormalization."""
    normed, total = f"{x}_normed", f"{x}_plus_residual"
    n("SkipSimplifiedLayerNormalization", [x, residual, gamma], [normed, "", "", total], domain=MS_DOMAIN, epsilon=eps)
    return normed, total


def head_norm(n: Nodes, x: str, num_heads: int, dim: int, norm, const, prefix: str) -> str:
    """A per-head norm of q or k (Qwen3's RMSNorm, Phi-2's LayerNorm: `norm` of the per-head tensor):
    [1, q, heads*dim] -> per head -> back."""
    per_head = n("Reshape", [x, const(f"{prefix}_heads_shape", [0, -1, num_heads, dim])])[0]
    return n("Reshape", [norm(per_head), const(f"{prefix}_flat_shape", [0, -1, num_heads * dim])])[0]


def rms_norm(n: Nodes, x: str, gamma: str, eps: float, const, prefix: str, elem: int = TensorProto.FLOAT) -> str:
    """RMSNorm over the last axis from opset-18 operators (ONNX's RMSNormalization needs opset 23, which
    onnxruntime < 1.23 and onnx < 1.18 do not have); ONNX Runtime fuses the pattern into one kernel.
    A graph in fp16/bf16 (`elem`) normalises in float32 and rounds before the gain, as the torch model does."""
    wide = x if elem == TensorProto.FLOAT else n("Cast", [x], to=TensorProto.FLOAT)[0]
    square = n("Pow", [wide, const(f"{prefix}_norm_two", 2.0, np.float32)])[0]
    mean = n("ReduceMean", [square, const(f"{prefix}_norm_axis", [-1])], keepdims=1)[0]
    root = n("Sqrt", [n("Add", [mean, const(f"{prefix}_norm_eps", eps, np.float32)])[0]])[0]
    normed = n("Div", [wide, root])[0]
    if elem != TensorProto.FLOAT:
        normed = n("Cast", [normed], to=elem)[0]
    return n("Mul", [normed, gamma])[0]


def layer_norm(n: Nodes, x: str, gamma: list[str], eps: float) -> str:
    """LayerNorm over the last axis with a gain (and, `gamma` = [gain, bias], a bias: Phi-2; Cohere has none)."""
    return n("LayerNormalization", [x, *gamma], axis=-1, epsilon=eps)[0]


FLOAT_MIN = float(np.finfo(np.float32).min)
# the most negative finite value of each graph dtype, as float32: a FLOAT_MIN bias clamped to it before the cast
# stays finite (float32's min rounds to -inf in fp16 and in bfloat16)
LOWEST = {TensorProto.FLOAT16: -65504.0, TensorProto.BFLOAT16: float(np.frombuffer(np.uint32(0xFF7F0000).tobytes(), np.float32)[0])}


def window_bias(n: Nodes, const, bias: str, positions: str, window: int) -> str:
    """`bias` [b, 1, q, T] with the key slots j at position - j >= `window` masked (a sliding layer's bias: slot j
    holds position j for every past key, and a pass's own keys sit at or after their positions)."""
    total = n("Squeeze", [n("Shape", [bias], start=3, end=4)[0]])[0]
    slots = n("Range", [const("window.zero", 0), total, const("window.one", 1)])[0]
    query = n("Unsqueeze", [positions, const("window.axes", [1, 3])])[0]
    far = n("GreaterOrEqual", [n("Sub", [query, slots])[0], const("window.size", window)])[0]
    return n("Where", [far, const("window.min", FLOAT_MIN, np.float32), bias])[0]


def rotary_names(kind: str) -> list[str]:
    """The cos / sin cache initializers of rotary table `kind`."""
    prefix = "rotary" if kind == "global" else f"rotary_{kind}"
    return [f"{prefix}.cos_cache", f"{prefix}.sin_cache"]
