"""Model types the architecture table does not build, each refused in one line with its reason (docs/DESIGN.md,
"Families not built"): layers that change the cache contract (hybrid recurrent layers, sparse attention whose key
choice depends on the whole cache) and layers that need a feature no builder has yet."""

from __future__ import annotations

_HYBRID = "hybrid linear attention (a recurrent state that must roll back on rejected drafts) is not supported"
_DSA = "sparse attention (an indexer picks each query's top-k keys of the whole cache) is not supported"

REFUSED = {
    # the cache contract: recurrent or convolution states, sparse attention
    "lara_mini": _HYBRID,
    "qwen4_exp_text": _HYBRID.replace(" is", ", a sparse-attention indexer and n-gram embeddings are"),
    "inkling_text": "short causal convolutions (a conv state that must roll back on rejected drafts) are not supported",
    "deepseek_v32": _DSA, "glm_moe_dsa": _DSA, "axk2": _DSA, "minimax_m3_vl_text": _DSA,
    "deepseek_v4": "compressed sparse attention and hyper-connections are not supported",
    "hy_v4": "sparse attention (DSA indexer) and hyper-connections are not supported",
    "doge": "dynamic mask attention (top-k keys of the whole cache past keep_window_size) is not supported",
    # features no builder has yet
    "gemma3n": "Gemma 3n is read from its Hugging Face checkpoint (the gemma3n wrapper's text_config); llama.cpp's layout is not read",
    "xglm": "sinusoidal absolute position embeddings are not built",
    "mpt": "ALiBi position biases are not built",
    "codegen": "CodeGen's fused qkv (four model-parallel blocks of q | v | k) is not built",
    "diffllama": "differential attention (two softmax maps subtracted) is not built",
    "axk1": "a norm of the MoE block's output on MoE layers only (post_mlp_layernorm) is not built",
    "kolibri1": "routing on logits + score bias with sigmoid weights is not built",
    "laguna": "a softplus gate on the attention output, per-layer head counts and per-layer-type partial rotary are not built",
    "mimo_v2_flash": "values narrower than keys (v_head_dim), sinks on sliding layers only and the value scale are not built",
    "ergo": "per-expert output norms, ungated ReLU-squared experts and the global-attention scale are not built",
    "longcat_flash": "zero-computation experts and two attention / MLP blocks per layer are not built",
    "dory": "nGPT layers (unit-norm hidden states, interpolated residuals, looped layers) are not built",
    # GGUF files
    "hunyuan-moe": "llama.cpp's Hunyuan MoE GGUF is not read (no oracle: its converter needs Hunyuan's tiktoken tokenizer); "
                   "export the safetensors checkpoint",
}
