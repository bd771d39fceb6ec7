"""The slotted fused CPU graph (`target.ort-slots.onnx`; export/ort_fused_graph.py, `_SlotInputs`).

One pass over the new rows of up to `slots` sequences, plain steps and drafts mixed, packed along one axis:
the weight matmuls run over every row at once, and each sequence's attention is a GroupQueryAttention of its
own over its own KV buffer, a batch of one. ONNX Runtime takes several rows and the one-row padding row there,
so every row computes the bits it gets in a pass of that sequence alone (tests/test_ort_slots.py), which the
batched fused graph cannot give (its batched GroupQueryAttention refuses more than one row per sequence with
a past). Every slot of the graph needs at least one row: an idle slot gets a dummy row whose KV lands past
what its sequence commits (or in a spare buffer) and whose outputs are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...manifest import GraphSpec, Manifest
from ..kvcache import BufferKVCache
from .base import StepOutput, hidden_output
from .ort import default_threads, inference_session, lift_rows, recorded_lift
from .tree_layout import MainPathLayout
from .wide_head import WideHeadRule


@dataclass
class SlotRows:
    """One sequence's rows in a slot pass: its new tokens, their positions, their own (causal or tree) mask."""

    input_ids: np.ndarray  # [q] int64
    position_ids: np.ndarray  # [q] int64
    mask: np.ndarray  # [q, q] bool


class OrtSlotSession:
    """The slotted graph in ONNX Runtime, over the KV buffers of a batch decoder ([slots, kv_heads, rows, head_dim]
    per layer and kind, in the order of `past_names`: the fused graph's `past_key_values.{layer}.{kind}`)."""

    def __init__(self, directory: str | Path, manifest: Manifest, spec: GraphSpec, threads: int | None = None,
                 spinning: str = "in-run"):
        import onnxruntime as ort

        self.spec = spec
        self.slots = int(spec.extra["slots"])
        self.session = inference_session(directory, manifest, spec, "ort-cpu", threads, spinning)
        self._ort = ort
        self.hidden_name = hidden_output(spec)
        # head_dim > 128: a slot's rows stay within a segment between the measured cuts, as its pass alone
        # (backends/wide_head.py)
        head_dims = [int(t.shape[3]) for t in spec.inputs if t.name.startswith("past_key_values")]
        self.wide = WideHeadRule.of(recorded_lift(spec.extra.get("attention_lift")), head_dims, threads or default_threads())
        self._outputs = ["logits", *([self.hidden_name] if self.hidden_name else [])]
        widths = {t.name: int(t.shape[-1]) for t in spec.outputs if t.name in self._outputs}
        self._widths = [widths[name] for name in self._outputs]
        self._spare: list[np.ndarray] = []  # 2-row KV buffers for graph slots the decoder does not have
        self._binding = None  # the I/O binding with every slot's KV bound, kept while the buffers stay the same
        self._bound: tuple = ()
        self._values: list = []  # the OrtValues over the buffers (alive as long as the binding)

    def run(self, buffers: list[np.ndarray], past_names: list[str], rows: list[SlotRows | None],
            caches: list[BufferKVCache | None], pad_one_row: bool = True) -> list[StepOutput | None]:
        """One pass; `rows[b]` for slot b of `buffers` (None: a dummy row), `caches[b]` its cache (None: a free slot,
        nothing committed). A tree's rows run main path first (tree_layout.py; its cache is told where rows went).
        Returns slot b's StepOutput (None for a dummy). The buffers need `pad_rows` rows past every pass for the
        padding (with a rule's `lift`, set by hand only: copies of a slot's last row that lift its attention total).
        `pad_one_row`: a one-row slot gets attention's padding row, so it computes the bits of that sequence's
        pass alone; without it, ONNX Runtime's one-row kernel, the bits a batched pass gives that row (and half
        the attention work: what a batch decoder wants when it promises no more than the batched pass)."""
        layouts: list[MainPathLayout | None] = []
        ids, positions, slot_rows, seqlens, totals, biases, real = [], [], [], [], [], [], []
        padded_index, padded_rows, unpadded_index = [], [], []
        start = padded_start = 0
        for b in range(self.slots):
            given = rows[b] if b < len(rows) else None
            length = caches[b].length if b < len(caches) and caches[b] is not None else 0
            layout = None
            if given is None:  # a dummy row at the next free position: its KV lands past what the slot commits
                new_ids, new_positions, mask = np.zeros(1, np.int64), np.array([length], np.int64), np.ones((1, 1), bool)
            else:
                new_ids = np.asarray(given.input_ids, np.int64).reshape(-1)
                new_positions = np.asarray(given.position_ids, np.int64).reshape(-1)
                mask = np.asarray(given.mask, bool)
                q = len(new_ids)
                layout = MainPathLayout.of_tree(mask[None], q)
                if layout is not None:
                    new_ids, new_positions, mask = layout.rows(new_ids), layout.rows(new_positions), layout.mask(mask[None])[0]
                real.extend(range(start, start + q))
            q = len(new_ids)
            pad = int(q == 1 and pad_one_row)  # its row again as attention's padding row (_OneRowPadding)
            if given is not None and (q > 1 or pad_one_row):  # and as many more as lift its total as alone
                pad = max(pad, lift_rows(self.wide.lift, length + q, buffers[0].shape[2]))
            if given is not None and q > self.wide.rows_from(length):
                raise ValueError(f"slot {b}: {q} rows from KV slot {length} cross a cut (WideHeadRule); size drafts by pass_rows")
            layouts.append(layout)
            ids.append(new_ids)
            positions.append(new_positions)
            slot_rows.append(q)
            padded_index.extend([*range(start, start + q), *([start + q - 1] * pad)])
            unpadded_index.extend(range(padded_start, padded_start + q))
            padded_rows.append(q + pad)
            seqlens.append(length + q + pad - 1)
            totals.append(length + q + pad)
            bias = np.zeros((1, 1, q + pad, length + q + pad), np.float32)  # the padding row and column: 0
            bias[0, 0, :q, length: length + q] = np.where(mask, np.float32(0), np.float32(-np.inf))
            biases.append(bias)
            start += q
            padded_start += q + pad
        binding = self._kv_binding(buffers, past_names)
        inputs = {"input_ids": np.concatenate(ids)[None], "position_ids": np.concatenate(positions)[None],
                  "padded_index": np.asarray(padded_index, np.int64), "padded_rows": np.asarray(padded_rows, np.int64),
                  "unpadded_index": np.asarray(unpadded_index, np.int64), "seqlens_k": np.asarray(seqlens, np.int32),
                  "total_sequence_length": np.asarray(totals, np.int32), "logits_rows": np.asarray(real, np.int64),
                  **{f"attention_bias.{b}": bias for b, bias in enumerate(biases)}}
        for name, value in inputs.items():
            binding.bind_cpu_input(name, value)
        arrays = self._bind_outputs(binding, len(real), sum(slot_rows))
        self.session.run_with_iobinding(binding)
        return self._split(arrays, rows, caches, layouts, slot_rows)

    def _bind_outputs(self, binding, logits_rows: int, total_rows: int) -> list[np.ndarray]:
        """Fresh host arrays bound as the pass's outputs: the real rows' logits, every row's hidden states."""
        arrays = [np.empty((1, logits_rows, self._widths[0]), np.float32)]
        arrays += [np.empty((1, total_rows, width), np.float32) for width in self._widths[1:]]
        for name, array in zip(self._outputs, arrays):
            binding.bind_ortvalue_output(name, self._ort.OrtValue.ortvalue_from_numpy(array))
        return arrays

    def _kv_binding(self, buffers: list[np.ndarray], past_names: list[str]):
        """The binding with slot b's KV (buffer row b, or a spare 2-row buffer past the decoder's slots) as both
        the past input and the present output of its GroupQueryAttention; rebuilt when the buffers change."""
        key = tuple((id(buffer), buffer.shape) for buffer in buffers)
        if self._binding is not None and self._bound == key:
            return self._binding
        slots_here = buffers[0].shape[0]
        if self.slots > slots_here and not self._spare:
            self._spare = [np.zeros((1, buffer.shape[1], 2, buffer.shape[3]), buffer.dtype) for buffer in buffers]
        binding, values = self.session.io_binding(), []
        for index, (name, buffer) in enumerate(zip(past_names, buffers)):
            stem, kind = name.rsplit(".", 1)
            present = stem.replace("past_key_values", "present", 1)
            for b in range(self.slots):
                value = self._ort.OrtValue.ortvalue_from_numpy(buffer[b: b + 1] if b < slots_here else self._spare[index])
                binding.bind_ortvalue_input(f"{stem}.{b}.{kind}", value)
                binding.bind_ortvalue_output(f"{present}.{b}.{kind}", value)
                values.append(value)
        self._binding, self._bound, self._values = binding, key, values
        return binding

    def _split(self, arrays, rows, caches, layouts, slot_rows) -> list[StepOutput | None]:
        """Each real slot's logits (and hidden) back in its own row order."""
        outputs: list[StepOutput | None] = []
        start = real_start = 0
        for b in range(self.slots):
            q = slot_rows[b]
            if b < len(rows) and rows[b] is not None:
                hidden = arrays[1][0, start: start + q] if self.hidden_name else None
                out = StepOutput(logits=arrays[0][0, real_start: real_start + q], presents=caches[b].tensors, hidden=hidden)
                outputs.append(layouts[b].restore(out, caches[b]) if layouts[b] is not None else out)
                real_start += q
            else:
                outputs.append(None)
            start += q
        return outputs[: len(rows)]
