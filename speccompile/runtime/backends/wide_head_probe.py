"""Where ONNX Runtime's CPU GroupQueryAttention makes a query row's bits depend on where its pass ends, measured on
this machine at one head_dim (backends/wide_head.py applies what it finds; docs/DESIGN.md, "The fused CPU graph").

At head_dim > 128, MLAS's SGEMM sums a score's head_dim products in an order chosen per panel of key slots, and
the panel layout follows the pass's last slot. The layout differs between machines (the kernel MLAS picks for
the CPU): on an AMD EPYC host a row at slot p is "short" when its pass ends at a slot E with E mod 128 <= 63 in
p's 128-slot block (head_dim 512: 64-slot blocks, E mod 64 <= 31); on an Intel Xeon host with AMX, 256-slot
blocks at head_dim 256, and at 512 three classes in 128-slot blocks (E mod 128 below 32, below 64, the rest).
So the rule is measured, not assumed: within a block of B slots, thresholds t_1 < ... < t_m split the pass ends
into classes (E mod B below t_1, below t_2, ..., the rest, and any later block), and a row's bits are its plain
decoding's (a one-row pass with attention's padding row, E = p + 1) exactly when its pass ends in the same class.

`measured_cuts` finds t_1.. by bisection from a row in each class and B as the first slot after them where a row
is in the first class again (at head_dim 192 on the Xeon: B = 341, t = 64), then checks that every pass the rule
keeps in a row's plain class gives the row its plain bits (random passes with padding rows, and the rows around
four block starts). It returns the cuts `(B, t)` (none: no dependence), or None when the operator follows no such
rule (the caller then runs one row a pass). A few hundred runs of a one-node graph (0.6 s at 256, about 1 s at 512
on the Xeon), once per head_dim and thread count.
"""

from __future__ import annotations

import functools

import numpy as np

HEADS = 4  # query heads over one KV head
CAPACITY = 2048  # KV slots of the probe (two blocks of the largest candidate and room to pad)
BLOCKS = (64, 128, 256, 512)  # block sizes seen (the bisection reaches two of the largest)
MAX_CLASSES = 8
CHECKS = 60  # random passes the fitted rule must predict


class _AttentionProbe:
    """One GroupQueryAttention node (HEADS query heads, one KV head) over random keys, values and queries."""

    def __init__(self, head_dim: int, threads: int | None):
        import onnxruntime as ort
        from onnx import TensorProto, helper

        f, dim = TensorProto.FLOAT, head_dim
        node = helper.make_node("GroupQueryAttention", ["q", "k", "v", "pk", "pv", "seqlens_k", "total", "", "", "", "bias"],
                                ["out", "present_k", "present_v"], domain="com.microsoft", num_heads=HEADS, kv_num_heads=1,
                                scale=dim ** -0.5)
        kv = [1, 1, CAPACITY, dim]
        inputs = [helper.make_tensor_value_info("q", f, [1, "S", HEADS * dim]), helper.make_tensor_value_info("k", f, [1, "S", dim]),
                  helper.make_tensor_value_info("v", f, [1, "S", dim]), helper.make_tensor_value_info("pk", f, kv),
                  helper.make_tensor_value_info("pv", f, kv), helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
                  helper.make_tensor_value_info("total", TensorProto.INT32, []),
                  helper.make_tensor_value_info("bias", f, [1, 1, "S", "T"])]
        outputs = [helper.make_tensor_value_info("out", f, [1, "S", HEADS * dim]),
                   helper.make_tensor_value_info("present_k", f, kv), helper.make_tensor_value_info("present_v", f, kv)]
        model = helper.make_model(helper.make_graph([node], "gqa", inputs, outputs),
                                  opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        self.session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        rng = np.random.default_rng(0)
        self.keys, self.values = (rng.standard_normal((CAPACITY, dim), np.float32) for _ in range(2))
        self.queries = rng.standard_normal((CAPACITY, HEADS * dim), np.float32)
        self._alone: dict[int, np.ndarray] = {}

    def row(self, p: int, first: int, pad: int) -> np.ndarray:
        """Row p's output in a pass of rows first..p (slots before `first` cached) plus `pad` copies of row p."""
        past_k, past_v = np.zeros((2, 1, 1, CAPACITY, self.keys.shape[1]), np.float32)
        past_k[0, 0, :first], past_v[0, 0, :first] = self.keys[:first], self.values[:first]
        rows = [*range(first, p + 1), *[p] * pad]
        total = first + len(rows)
        bias = np.full((1, 1, len(rows), total), -np.inf, np.float32)
        for i in range(len(rows)):
            bias[0, 0, i, : first + min(i, p - first) + 1] = 0
        out = self.session.run(["out"], {"q": self.queries[rows][None], "k": self.keys[rows][None], "v": self.values[rows][None],
                                         "pk": past_k, "pv": past_v, "seqlens_k": np.array([total - 1], np.int32),
                                         "total": np.array(total, np.int32), "bias": bias})[0]
        return out[0, p - first]

    def alone(self, p: int) -> np.ndarray:
        """Row p as plain decoding computes it: a one-row pass and its padding row."""
        if p not in self._alone:
            self._alone[p] = self.row(p, p, 1)
        return self._alone[p]

    def same(self, p: int, last: int, first: int | None = None) -> bool:
        """Whether row p's bits in a pass from `first` (default p) whose last slot is `last` are its plain ones."""
        first = p if first is None else first
        return bool(np.array_equal(self.row(p, first, last - p), self.alone(p)))

    def first_change(self, p: int) -> int | None:
        """The first pass end after p + 1 at which row p's bits change (bisection), None if none within reach."""
        low, high = p + 1, min(p + 2 * max(BLOCKS), CAPACITY - 1)
        if self.same(p, high):
            return None
        while high - low > 1:  # same(p, low), not same(p, high)
            middle = (low + high) // 2
            low, high = (middle, high) if self.same(p, middle) else (low, middle)
        return high


def end_class(p: int, last: int, cuts: tuple[tuple[int, int], ...]) -> tuple[bool, ...]:
    """Which side of each cut `(block, threshold)` a pass ending at `last` lies for row p: (p's block, below t)."""
    return tuple(last // block == p // block and last % block < threshold for block, threshold in cuts)


def _predicts(probe: _AttentionProbe, cuts: tuple[tuple[int, int], ...]) -> bool:
    """Whether a pass that `cuts` put in the class of a row's plain pass gives the row its plain bits: for CHECKS
    random passes (rows before p in the pass, padding rows) and for rows at and around four blocks' starts and
    class edges, passes ending on either side of each threshold. (A row whose bits do not depend on the pass end
    where the rule says they may costs only a cut.)"""
    rng = np.random.default_rng(1)
    cases = []
    for _ in range(CHECKS):
        p = int(rng.integers(1, CAPACITY - 200))
        q, pad = int(rng.integers(1, min(p, 24) + 1)), int(rng.choice([0, 1, 3, 20, 66, 130]))
        cases.append((p, p - q + 1, p + max(pad, int(q == 1))))
    for block, threshold in cuts:
        for start in range(block, min(CAPACITY - block, 5 * block), block):  # four block starts: the layout repeats
            for p in (start - 2, start - 1, start, start + 1, start + threshold - 2, start + threshold - 1):
                cases += [(p, p, last) for last in (start + threshold - 1, start + threshold) if last > p]
    return all(probe.same(p, last, first) for p, first, last in cases
               if end_class(p, last, cuts) == end_class(p, p + 1, cuts))


@functools.lru_cache(maxsize=None)
def measured_cuts(head_dim: int, threads: int | None) -> tuple[tuple[int, int], ...] | None:
    """The cuts `(block, threshold)` of this machine's GroupQueryAttention at `head_dim` with `threads` threads
    (module docstring; () when a row's bits never depend on its pass's end), None when it follows no such rule."""
    probe = _AttentionProbe(head_dim, threads)
    thresholds: list[int] = []
    p = 1
    while len(thresholds) <= MAX_CLASSES:
        change = probe.first_change(p)
        if change is None:
            break
        thresholds.append(change)
        p = change  # a row whose plain pass ends in the next class
    else:
        return None
    if not thresholds:
        return () if _predicts(probe, ()) else None
    block = _block(probe, thresholds)
    if block is None:
        return None
    cuts = tuple((block, t) for t in thresholds)
    return cuts if _predicts(probe, cuts) else None


def _block(probe: _AttentionProbe, thresholds: list[int]) -> int | None:
    """The block size B: rows B .. B + t_1 - 2 are in the first class again (their plain pass ends below B + t_1),
    so stepping by a quarter of t_1 from block 0's last class lands in that window, and the first pass end that
    changes such a row's bits is B + t_1. (A row or two at a block's start may not depend on the pass end at all,
    as at head_dim 160 on the Xeon: stepping finely passes them.)"""
    first = thresholds[0]
    p, step = thresholds[-1], max(1, (first - 1) // 4)
    while p + first < CAPACITY:
        p += step
        if not probe.same(p, p + first):  # a pass ending t_1 later is in another class: p is a first-class row
            change = probe.first_change(p)
            return None if change is None else change - first
    return None
