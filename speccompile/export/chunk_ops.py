"""Llama 4's chunked attention mask as ONNX nodes, for the contract graph and the fused CPU graphs (plain and slotted):
what models/decoder.py `chunk_mask` computes.

A chunked layer's query at position p sees the keys of positions p - p % C .. p only (C: `sliding_window` with
`window_chunks`). A key's position is its slot for the past keys (the KV contract: slot j holds position j), and for
the pass's own keys, the last rows of the KV (the fused CPU graph's padding row included), the position of its row:
exact for trees too, whose keys sit at or after their positions. The causal CUDA graphs, whose GroupQueryAttention can
only keep a window of the last keys (`local_window_size`), are not written for chunked models (export/ort_fused_graph.py).
"""

from __future__ import annotations

import numpy as np

from ..models.config import ModelConfig
from .fused_ops import FLOAT_MIN, window_bias
from .moe_ops import Emitter


def before_chunk(em: Emitter, keys_of: str, positions: str, chunk: int) -> str:
    """Bool [b, q, T]: the keys before each query's chunk. `keys_of`: a tensor whose last axis is the T keys (the mask
    or bias); `positions`: the pass's rows' int64 positions [b, q] (the KV's last q slots are theirs)."""
    total = em.one("Squeeze", [em.one("Shape", [keys_of], start=-1)])
    past = em.one("Sub", [total, em.one("Squeeze", [em.one("Shape", [positions], start=1, end=2)])])
    slots = em.one("Range", [em.const("chunk.zero", 0), total, em.const("chunk.one", 1)])
    own = em.one("Gather", [positions, em.one("Max", [em.one("Sub", [slots, past]), em.const("chunk.zero", 0)])], axis=1)
    keys = em.one("Where", [em.one("Less", [slots, past]), slots, own])  # [b, T]: each key's position
    start = em.one("Sub", [positions, em.one("Mod", [positions, em.const("chunk.size", chunk)])])
    return em.one("Less", [em.one("Unsqueeze", [keys, em.const("chunk.axis1", [1])]),
                           em.one("Unsqueeze", [start, em.const("chunk.axis2", [2])])])


def chunk_bias(em: Emitter, bias: str, positions: str, chunk: int) -> str:
    """A fused graph's `bias` [b, 1, q, T] with the keys before each query's chunk masked (float32 min)."""
    far = em.one("Unsqueeze", [before_chunk(em, bias, positions, chunk), em.const("chunk.axis1", [1])])
    return em.one("Where", [far, em.const("window.min", FLOAT_MIN, np.float32), bias])


def sliding_bias(em: Emitter, cfg: ModelConfig, bias: str, positions: str) -> str:
    """A fused graph's sliding-layer bias: Llama 4's chunks (`chunk_bias`), else the window (`fused_ops.window_bias`)."""
    if cfg.window_chunks:
        return chunk_bias(em, bias, positions, cfg.sliding_window)
    return window_bias(em.op, em.const, bias, positions, cfg.sliding_window)
