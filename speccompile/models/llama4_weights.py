"""Llama 4's checkpoint under the names every consumer reads (models/llama4.py): the fused experts per expert, the rope
layers' gainless q / k norms as gains of ones."""

from __future__ import annotations

import re

from .config import ModelConfig
from .hf_layouts import _Ones
from .moe_weights import ChunkedExpertSource
from .weights import WeightSource

_FUSED = re.compile(r"^(model\.layers\.\d+\.feed_forward\.experts\.)(gate_up_proj|down_proj)()$")


def llama4_weights(source: WeightSource, config: ModelConfig) -> WeightSource:
    """`source` with the fused experts per expert and the rope layers' q / k norm gains of ones."""
    if config.moe is not None and any(_FUSED.match(n) for n in source.names()):  # [experts, hidden, 2 * inter], [experts, inter, hidden]
        source = ChunkedExpertSource(source, config.hidden_size, config.moe.expert_size, fused=_FUSED, transposed=True)
    if not config.qk_norm:
        return source
    ones = {f"model.layers.{i}.self_attn.{t}_norm.weight": (config.head_dim,) for i in range(config.num_hidden_layers)
            if i not in config.nope_layers for t in "qk"}
    return _Ones(source, ones, source.info("model.embed_tokens.weight").dtype)
