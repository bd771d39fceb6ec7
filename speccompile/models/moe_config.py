"""Mixture-of-experts layers: how a family routes and where its expert weights are (read from config.json).

A MoE layer replaces the dense MLP: a router (`gate` / `router`, [experts, hidden], maybe with a bias) scores
every expert per token; the token goes through its `top_k` experts (SwiGLU MLPs of `expert_size`) and their
outputs are summed, each weighted by its routing weight; Qwen2-MoE adds a shared expert weighted by
sigmoid(shared_expert_gate(x)). Routing weights, by family:

* `softmax_topk` (Qwen2/3-MoE, Mixtral, Hunyuan, Jamba): softmax over all experts, the top k, renormalised to sum 1
  when `norm_topk_prob` (Mixtral always, Jamba never);
* `topk_softmax` (gpt-oss, Granite-MoE, Cohere 2 MoE's "softmax"): the top k router logits, softmax over those k;
* `topk_sigmoid` (Cohere 2 MoE's "sigmoid"): the top k router logits, their sigmoids, renormalised to sum 1 when
  `norm_topk_prob`;
* `sigmoid_group` (DeepSeek-V3, Kimi K2, Moonlight): sigmoid scores; the choice reads them plus
  `e_score_correction_bias` (`score_bias`): the `n_group` groups of experts are scored by the sum of their top 2,
  only the experts of the best `topk_group` groups compete for the top k; the weights are the unbiased scores of
  the chosen experts, renormalised (sum + `renorm_eps`, 1e-20; LFM2-MoE 1e-6) when `norm_topk_prob`, times `routed_scale`. Its shared experts
  (`shared_experts`, moe_intermediate_size x n_shared_experts wide) are added ungated;
* `softmax_group` (DeepSeek-V2): softmax scores; `group_limited_greedy` scores a group by its largest score and
  zeroes the experts outside the best topk_group groups (`greedy`: one group); the top k scores times
  `routed_scale`, not renormalised. Shared experts and dense first layers as V3;
* `sparsemixer` (Phi-3.5-MoE, at inference; top 2): the best logit m wins; its weight is its softmax among the logits
  s with (m - s) / max(|s|, m) <= 2 `jitter_eps` (the others masked out); the same again over the rest for the second;
* `normed_softmax_topk` (Gemma 4's 26B-A4B): the router reads the residual stream's scale-free RMS norm times its
  learned `router.scale` and 1 / sqrt(hidden); softmax top k renormalised, each weight times its expert's learned
  `router.per_expert_scale`. Gemma 4's MoE layers keep their dense MLP beside the experts (`beside_dense`: the
  experts on their own norm of the residual, each output through its own norm, summed; models/moe.py), its experts
  GELU-gated (`act`) and stored fused ([experts, 2 * inter, hidden], gate rows then up rows: models/moe_weights.py).

Llama 4: `topk_sigmoid` whose weights scale each chosen expert's input (`scale_input`: expert(w x), not w expert(x)),
plus an ungated shared expert; MoE layers every `interleave_moe_layer_step`-th (or `moe_layers`), the rest dense.

Nemotron-H (Nemotron 3 Nano): `sigmoid_group` with the score bias, its experts and shared expert ungated
(`expert_gated` False: down(act(up x)), `act` relu2, no gate projection).

Cohere 2 MoE adds its ungated shared experts (intermediate_size x num_shared_experts wide) to the routed output, or
averages the two (`shared_average`: (routed + shared) / 2, its "average" combination strategy).

gpt-oss also clamps its SwiGLU (`swiglu_limit`, `swiglu_alpha`: gate * sigmoid(alpha * gate) * (up + 1), gate
clamped above and up on both sides at limit) and gives the router and experts biases. Its checkpoints store the
experts fused ([experts, hidden, 2 * inter], gate/up interleaved); `models.moe.split_fused_experts` shows them
per expert under the names below, so every consumer reads per-expert [out, in] matrices. Bailing hybrid (as
transformers' Step3p7) clamps after the activation instead, per layer (`clip_limits`, `shared_clip_limits`: 0 none):
min(SiLU(gate), limit) * clip(up, -limit, limit); `at_layer` gives a layer's block its limits as `clip` / `shared_clip`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..errors import UnsupportedError
from .architectures import HF_ACTS

ROUTINGS = ("softmax_topk", "topk_softmax", "topk_sigmoid", "sigmoid_group", "softmax_group", "sparsemixer", "normed_softmax_topk")


@dataclass(frozen=True)
class MoeConfig:
    """The MoE layers of a decoder (names follow Hugging Face's per-expert checkpoints)."""

    num_experts: int
    top_k: int
    expert_size: int  # intermediate size of one expert
    routing: str = "softmax_topk"
    norm_topk_prob: bool = False
    block: str = "mlp"  # module of the MoE block in a layer: "mlp" or Mixtral's "block_sparse_moe"
    router: str = "gate"  # the router's module: "gate" or gpt-oss' "router"
    projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # Mixtral: w1, w3, w2
    router_bias: bool = False
    expert_bias: bool = False
    shared_expert_size: int = 0  # Qwen2-MoE's shared expert (0: none)
    swiglu_limit: float = 0.0  # gpt-oss' clamped SwiGLU (0: plain SiLU(gate) * up)
    swiglu_alpha: float = 1.0
    dense_layers: tuple[int, ...] = ()  # layers with the dense MLP of config.intermediate_size
    shared_name: str = "shared_expert"  # the shared expert's module (DeepSeek-V3: shared_experts)
    shared_gated: bool = True  # the shared expert's output times sigmoid(shared_expert_gate(x)) (Qwen2-MoE)
    shared_average: bool = False  # (routed + shared) / 2 where the shared output is otherwise added (Cohere 2 MoE)
    n_group: int = 1  # sigmoid_group: expert groups, of which the best topk_group compete
    topk_group: int = 1
    routed_scale: float = 1.0  # the routing weights' multiplier (routed_scaling_factor)
    score_bias: bool = False  # the router's e_score_correction_bias (added for the choice only)
    jitter_eps: float = 0.0  # sparsemixer: the relative distance from the best logit within which logits compete
    act: str = "silu"  # the experts' gate activation (ModelConfig.mlp_act's kinds; Gemma 4: gelu_tanh)
    beside_dense: bool = False  # Gemma 4: the dense MLP and the experts side by side, each with its norms
    router_eps: float = 0.0  # normed_softmax_topk: the router input norm's epsilon (rms_norm_eps)
    scale_input: bool = False  # the routing weight multiplies the expert's input, not its output (Llama 4)
    renorm_eps: float = 1e-20  # sigmoid_group's renormalisation: weights / (their sum + renorm_eps) (LFM2-MoE: 1e-6)
    expert_gated: bool = True  # False: every expert and the shared expert down(act(up x)), no gate projection (Nemotron-H)
    clip_limits: tuple[float, ...] = ()  # per layer: the experts' SwiGLU clamped after SiLU at this limit (Bailing; 0: none)
    shared_clip_limits: tuple[float, ...] = ()  # per layer: the shared experts' (Bailing)
    clip: float = 0.0  # this block's experts' limit (`at_layer`)
    shared_clip: float = 0.0  # this block's shared experts' limit (`at_layer`)

    def __post_init__(self) -> None:
        object.__setattr__(self, "projections", tuple(self.projections))
        object.__setattr__(self, "dense_layers", tuple(self.dense_layers))
        object.__setattr__(self, "clip_limits", tuple(self.clip_limits))
        object.__setattr__(self, "shared_clip_limits", tuple(self.shared_clip_limits))
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {self.routing}")

    def at_layer(self, layer: int) -> "MoeConfig":
        """Layer `layer`'s block: its SwiGLU limits (`clip_limits`, `shared_clip_limits`) as `clip` / `shared_clip`."""
        if not (self.clip_limits or self.shared_clip_limits):
            return self
        pick = [float(limits[layer]) if layer < len(limits) else 0.0 for limits in (self.clip_limits, self.shared_clip_limits)]
        return replace(self, clip=pick[0], shared_clip=pick[1])

    def is_moe(self, layer: int) -> bool:
        return layer not in self.dense_layers

    def prefix(self, layer: int) -> str:
        return f"model.layers.{layer}.{self.block}."

    def expert_sources(self, layer: int, expert: int) -> dict[str, str]:
        """Checkpoint names of one expert's tensors, by role (gate, up, down; and their biases)."""
        p = f"{self.prefix(layer)}experts.{expert}."
        names = dict(zip(("gate", "up", "down"), (p + f"{x}.weight" for x in self.projections)))
        if self.expert_bias:
            names.update(zip(("gate_bias", "up_bias", "down_bias"), (p + f"{x}.bias" for x in self.projections)))
        return names if self.expert_gated else {role: name for role, name in names.items() if not role.startswith("gate")}

    def shared_projections(self) -> tuple[str, ...]:
        """The shared expert's projections (gate_proj, up_proj, down_proj; ungated: up_proj, down_proj)."""
        return ("gate_proj", "up_proj", "down_proj") if self.expert_gated else ("up_proj", "down_proj")

    def gguf_names(self) -> dict[str, str]:
        """llama.cpp's MoE block tensors -> their names relative to a layer (`Family.gguf`'s vocabulary): the
        experts as one 3-D tensor each (`*`: the expert index, its leading axis), the router, the shared expert."""
        b, (gate, up, down) = self.block, self.projections
        names = {"ffn_gate_inp": f"{b}.{self.router}", "ffn_gate_exps": f"{b}.experts.*.{gate}",
                 "ffn_up_exps": f"{b}.experts.*.{up}", "ffn_down_exps": f"{b}.experts.*.{down}"}
        if not self.expert_gated:
            del names["ffn_gate_exps"]
        if self.shared_expert_size:
            names.update({f"ffn_{x[:-5]}_shexp": f"{b}.{self.shared_name}.{x}" for x in self.shared_projections()})
        if self.shared_expert_size and self.shared_gated:
            names["ffn_gate_inp_shexp"] = f"{b}.shared_expert_gate"
        if self.score_bias:  # DeepSeek-V3's `exp_probs_b.bias` (a name without `.weight`: models/load.py)
            names["exp_probs_b"] = f"{b}.{self.router}.e_score_correction_bias"
        return names

    def shapes(self, layer: int, hidden: int) -> dict[str, tuple[int, ...]]:
        """Every checkpoint tensor of layer `layer`'s MoE block, with its shape."""
        p, inter = self.prefix(layer), self.expert_size
        shapes: dict[str, tuple[int, ...]] = {f"{p}{self.router}.weight": (self.num_experts, hidden)}
        if self.router_bias:
            shapes[f"{p}{self.router}.bias"] = (self.num_experts,)
        if self.score_bias:
            shapes[f"{p}{self.router}.e_score_correction_bias"] = (self.num_experts,)
        if self.routing == "normed_softmax_topk":
            shapes.update({f"{p}{self.router}.scale": (hidden,), f"{p}{self.router}.per_expert_scale": (self.num_experts,)})
        by_role = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter),
                   "gate_bias": (inter,), "up_bias": (inter,), "down_bias": (hidden,)}
        for e in range(self.num_experts):
            shapes.update({name: by_role[role] for role, name in self.expert_sources(layer, e).items()})
        if self.shared_expert_size:
            s, x = self.shared_expert_size, f"{p}{self.shared_name}."
            shapes.update({f"{x}{proj}.weight": (hidden, s) if proj == "down_proj" else (s, hidden) for proj in self.shared_projections()})
            if self.shared_gated:
                shapes[f"{p}shared_expert_gate.weight"] = (1, hidden)
        return shapes


def _dense_layers(data: dict[str, Any], layers: int) -> tuple[int, ...]:
    """Qwen-MoE: `mlp_only_layers` and the layers `decoder_sparse_step` skips keep a dense MLP (Mellum: `mlp_layer_types`)."""
    if data.get("mlp_layer_types"):
        return _mlp_dense_layers(data, layers)
    step = int(data.get("decoder_sparse_step") or 1)
    only = {int(i) for i in data.get("mlp_only_layers") or []}
    return tuple(i for i in range(layers) if i in only or (i + 1) % step)


def moe_keys_from_gguf(meta: dict[str, Any], prefix: str, kind: str, tensors: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The config.json keys of a MoE family (`kind`) that llama.cpp's metadata (`<arch>.expert_count`, ...) gives.
    Renormalised top k: llama.cpp's `expert_weights_norm`, else what it hard-codes (Qwen3-MoE, Qwen3.5-MoE, Qwen3-Next and
    Mixtral yes, Qwen2-MoE and OLMoE no). Every layer is a MoE layer (llama.cpp has no dense ones for these families) except DeepSeek's
    `leading_dense_block_count` first ones (and LFM2-MoE's; its score bias where the file has `exp_probs_b`: `tensors`)."""
    if kind in ("deepseek_v3", "deepseek_v2", "kimi_linear"):  # llama.cpp's kimi-linear renormalises whatever the file says
        return {**_deepseek_keys_from_gguf(meta, prefix), **({"norm_topk_prob": True} if kind == "kimi_linear" else {})}
    if kind == "ernie4_5_moe":  # llama.cpp: MoE layers every `interleave_moe_layer_step`-th from the leading dense ones
        return {"moe_num_experts": int(meta[prefix + "expert_count"]), "moe_k": int(meta[prefix + "expert_used_count"]),
                "moe_intermediate_size": int(meta[prefix + "expert_feed_forward_length"]),
                "moe_num_shared_experts": int(meta.get(prefix + "expert_shared_count") or 0),
                "moe_layer_start_index": int(meta.get(prefix + "leading_dense_block_count") or 0),
                "moe_layer_interval": int(meta.get(prefix + "interleave_moe_layer_step") or 1)}
    if kind == "granitemoe" and not meta.get(prefix + "expert_count"):  # Granite 4.0-H dense: the shared MLP alone
        return {"num_local_experts": 0, "shared_intermediate_size": int(meta.get(prefix + "expert_shared_feed_forward_length")
                                                                        or meta[prefix + "feed_forward_length"])}
    data = {"num_experts": int(meta[prefix + "expert_count"]), "num_experts_per_tok": int(meta[prefix + "expert_used_count"]),
            "norm_topk_prob": bool(meta.get(prefix + "expert_weights_norm",
                                            kind not in ("qwen2_moe", "olmoe") or prefix in ("qwen35moe.", "qwen3next.")))}
    if kind == "gpt_oss":  # llama.cpp stores no SwiGLU clamp for gpt-oss: moe_from_hf's defaults are its hard-coded 7 / 1.702
        data["intermediate_size"] = int(meta[prefix + "expert_feed_forward_length"])
    if kind == "granitemoe":
        data["shared_intermediate_size"] = int(meta.get(prefix + "expert_shared_feed_forward_length") or 0)
    if kind == "lfm2_moe":
        data.update(moe_intermediate_size=int(meta[prefix + "expert_feed_forward_length"]),
                    num_dense_layers=int(meta.get(prefix + "leading_dense_block_count") or 0),
                    use_expert_bias=any(name.endswith("exp_probs_b.bias") for name in tensors),
                    routed_scaling_factor=float(meta.get(prefix + "expert_weights_scale") or 1.0))
    if kind in ("qwen2_moe", "qwen3_moe"):
        data["moe_intermediate_size"] = int(meta[prefix + "expert_feed_forward_length"])
        data["shared_expert_intermediate_size"] = int(meta.get(prefix + "expert_shared_feed_forward_length") or 0)
    return data


def _deepseek_keys_from_gguf(meta: dict[str, Any], p: str) -> dict[str, Any]:
    """DeepSeek-V2/V3's MoE keys from llama.cpp's `deepseek2` metadata: renormalised and scaled as llama.cpp does
    (`expert_weights_norm` absent: no, `expert_weights_scale` absent: 1); V2's softmax with fewer groups used than there
    are is refused before (models/mla_gguf.py: llama.cpp scores a group by its two best experts, V2 by its best)."""
    groups, used = int(meta.get(p + "expert_group_count") or 1), int(meta.get(p + "expert_group_used_count") or 1)
    return {"n_routed_experts": int(meta[p + "expert_count"]), "num_experts_per_tok": int(meta[p + "expert_used_count"]),
            "moe_intermediate_size": int(meta[p + "expert_feed_forward_length"]),
            "n_shared_experts": int(meta.get(p + "expert_shared_count") or 0),
            "first_k_dense_replace": int(meta.get(p + "leading_dense_block_count") or 0),
            "norm_topk_prob": bool(meta.get(p + "expert_weights_norm", False)),
            "routed_scaling_factor": float(meta.get(p + "expert_weights_scale") or 1.0),
            "n_group": groups, "topk_group": min(used, groups)}


def _deepseek_moe(kind: str, data: dict[str, Any], top_k: int, layers: int) -> MoeConfig:
    """DeepSeek-V3's sigmoid or V2's softmax group routing (V2's `greedy`: one group), shared experts, dense first layers
    (Kimi Linear: V3's routing, Mixtral's block and expert names)."""
    inter, v3 = int(data["moe_intermediate_size"]), kind != "deepseek_v2"
    grouped = v3 or data.get("topk_method", "greedy") == "group_limited_greedy"
    if not v3 and data.get("topk_method", "greedy") not in ("greedy", "group_limited_greedy"):
        raise UnsupportedError(f"config.json: DeepSeek-V2 topk_method {data['topk_method']!r} is not supported "
                               "(greedy, group_limited_greedy)")
    return MoeConfig(int(data["n_routed_experts"]), top_k, inter, "sigmoid_group" if v3 else "softmax_group",
                     bool(data.get("norm_topk_prob", True)) if v3 else False,
                     shared_expert_size=inter * int(data.get("n_shared_experts") or 0), shared_name="shared_experts",
                     shared_gated=False, n_group=int(data.get("n_group") or 1) if grouped else 1,
                     topk_group=int(data.get("topk_group") or 1) if grouped else 1,
                     routed_scale=float(data.get("routed_scaling_factor", 1.0)), score_bias=v3,
                     dense_layers=_mlp_dense_layers(data, layers), clip_limits=tuple(data.get("expert_swiglu_limit_list") or ()),
                     shared_clip_limits=tuple(data.get("share_expert_swiglu_limit_list") or ()),  # Bailing hybrid
                     **(dict(block="block_sparse_moe", projections=("w1", "w3", "w2")) if kind == "kimi_linear" else {}))


def _mlp_dense_layers(data: dict[str, Any], layers: int) -> tuple[int, ...]:
    """The dense layers of a DeepSeek-style config: `mlp_layer_types` ("dense" / "sparse", GLM-4.7-Flash, K-EXAONE)
    where given, else the first `first_k_dense_replace`."""
    if data.get("mlp_layer_types"):
        return tuple(i for i, kind in enumerate(data["mlp_layer_types"][:layers]) if kind == "dense")
    return tuple(range(min(int(data.get("first_k_dense_replace") or 0), layers)))


def _ernie_moe(data: dict[str, Any], layers: int) -> MoeConfig:
    """ERNIE 4.5 MoE: softmax scores, the top k of scores + e_score_correction_bias, the chosen (unbiased) scores
    renormalised (its clamp at moe_norm_min never binds) -- softmax_group in one group; shared experts; MoE layers
    every moe_layer_interval-th from moe_layer_start_index to moe_layer_end_index (-1: the last)."""
    inter, start = int(data["moe_intermediate_size"]), int(data.get("moe_layer_start_index") or 0)
    end, every = int(data.get("moe_layer_end_index", -1)), int(data.get("moe_layer_interval") or 1)
    end = layers - 1 if end == -1 else end
    return MoeConfig(int(data["moe_num_experts"]), int(data["moe_k"]), inter, "softmax_group", True,
                     shared_expert_size=inter * int(data.get("moe_num_shared_experts") or 0), shared_name="shared_experts",
                     shared_gated=False, score_bias=True,
                     dense_layers=tuple(i for i in range(layers) if (i + 1) % every or not start <= i <= end))


def _cohere2_moe(data: dict[str, Any], experts: int, top_k: int) -> MoeConfig:
    """Cohere 2 MoE: top k logits then softmax, or sigmoid (renormalised when norm_topk_prob); experts of
    intermediate_size; ungated shared experts summed or averaged with the routed output. Dense layers refused."""
    select, combine = data.get("expert_selection_fn", "softmax"), data.get("shared_expert_combination_strategy", "average")
    if select not in ("softmax", "sigmoid") or combine not in ("sum", "average"):
        bad = f"expert_selection_fn {select!r}" if select not in ("softmax", "sigmoid") else f"shared_expert_combination_strategy {combine!r}"
        raise UnsupportedError(f"config.json: Cohere 2 MoE with {bad} is not supported")
    if "dense" in (data.get("mlp_layer_types") or []):
        raise UnsupportedError("config.json: Cohere 2 MoE with dense layers (mlp_layer_types) is not supported")
    inter = int(data["intermediate_size"])
    return MoeConfig(experts, top_k, inter, "topk_softmax" if select == "softmax" else "topk_sigmoid",
                     bool(data.get("norm_topk_prob", True)), shared_expert_size=inter * int(data.get("num_shared_experts") or 0),
                     shared_name="shared_experts", shared_gated=False, shared_average=combine == "average")


def _llama4_moe(data: dict[str, Any], experts: int, top_k: int, layers: int) -> MoeConfig:
    """Llama 4: sigmoids of the top k logits on the experts' input, an ungated shared expert; MoE layers `moe_layers`,
    else every `interleave_moe_layer_step`-th (moe_intermediate_size: models/llama4.py's name of its intermediate_size)."""
    inter, step = int(data["moe_intermediate_size"]), int(data.get("interleave_moe_layer_step") or 1)
    sparse = set(data["moe_layers"] if data.get("moe_layers") is not None else range(step - 1, layers, step))
    return MoeConfig(experts, top_k, inter, "topk_sigmoid", block="feed_forward", router="router", shared_expert_size=inter,
                     shared_gated=False, scale_input=True, dense_layers=tuple(i for i in range(layers) if i not in sparse))


def _lfm2_moe(data: dict[str, Any], experts: int, top_k: int, layers: int) -> MoeConfig:
    """LFM2-MoE: sigmoid top k of scores + expert_bias (one group), renormalised (sum + 1e-6), scaled; its experts
    `feed_forward.experts.N.w1 / w3 / w2`; the first num_dense_layers dense."""
    return MoeConfig(experts, top_k, int(data["moe_intermediate_size"]), "sigmoid_group", bool(data.get("norm_topk_prob", True)),
                     block="feed_forward", projections=("w1", "w3", "w2"), score_bias=bool(data.get("use_expert_bias", True)),
                     routed_scale=float(data.get("routed_scaling_factor", 1.0)), renorm_eps=1e-6,
                     dense_layers=tuple(range(min(int(data.get("num_dense_layers") or 0), layers))))


def _afmoe_moe(data: dict[str, Any], experts: int, top_k: int, layers: int) -> MoeConfig:
    """AFMoE: sigmoid top k of scores + expert_bias (one group), renormalised, times route_scale; ungated shared
    experts (moe_intermediate_size x num_shared_experts wide); the first num_dense_layers dense."""
    inter = int(data["moe_intermediate_size"])
    return MoeConfig(experts, top_k, inter, "sigmoid_group", True, score_bias=True, routed_scale=float(data.get("route_scale", 1.0)),
                     shared_expert_size=inter * int(data.get("num_shared_experts") or 0), shared_name="shared_experts", shared_gated=False,
                     dense_layers=tuple(range(min(int(data.get("num_dense_layers") or 0), layers))))


def _nemotron_h_moe(data: dict[str, Any], layers: int) -> MoeConfig | None:
    """Nemotron-H's MoE blocks (the table layers `nemotron_h_moe_layers`, models/nemotron_h.py; none: None): DeepSeek-V3's
    sigmoid group routing with the score bias, ungated experts (`mlp_hidden_act`, relu2) and one ungated shared expert
    of moe_shared_expert_intermediate_size (transformers ignores n_shared_experts); the other layers dense or MLP-less."""
    moe = set(data.get("nemotron_h_moe_layers") or [])
    if not moe:
        return None
    return MoeConfig(int(data["n_routed_experts"]), int(data["num_experts_per_tok"]), int(data["moe_intermediate_size"]), "sigmoid_group",
                     bool(data.get("norm_topk_prob", True)), shared_expert_size=int(data["moe_shared_expert_intermediate_size"]),
                     shared_name="shared_experts", shared_gated=False, n_group=int(data.get("n_group") or 1),
                     topk_group=int(data.get("topk_group") or 1), routed_scale=float(data.get("routed_scaling_factor", 1.0)),
                     score_bias=True, act=HF_ACTS[str(data.get("mlp_hidden_act", "relu2"))], expert_gated=False,
                     dense_layers=tuple(i for i in range(layers) if i not in moe))


_LAYERED = {"llama4": _llama4_moe, "lfm2_moe": _lfm2_moe, "afmoe": _afmoe_moe}  # MoE kinds read by a function of (data, experts, top_k, layers)


def _jamba_moe(data: dict[str, Any], layers: int) -> MoeConfig | None:
    """Jamba: softmax top k, not renormalised, every expert_layer_period-th layer from expert_layer_offset (the router
    `feed_forward.router`; transformers' defaults where absent); one expert: every layer a dense SwiGLU (None)."""
    experts, period, offset = (int(data.get(k, d)) for k, d in (("num_experts", 16), ("expert_layer_period", 2), ("expert_layer_offset", 1)))
    return MoeConfig(experts, int(data.get("num_experts_per_tok", 2)), int(data["intermediate_size"]), "softmax_topk", block="feed_forward",
                     router="router", dense_layers=tuple(i for i in range(layers) if i % period != offset)) if experts > 1 else None


def _uniform(data: dict[str, Any], key: str) -> int:
    """An int config key that may be a per-layer list (Hunyuan's moe_topk); a list of different values is refused."""
    value = data[key]
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise UnsupportedError(f"config.json: {key} {value} differs between layers (not supported)")
        value = value[0]
    return int(value)


def _top_k(kind: str, data: dict[str, Any]) -> int:
    """num_experts_per_tok (0 where absent); a null one in a MoE family's config is a missing key (DeepSeek-V2's default)."""
    if kind and "num_experts_per_tok" in data and data["num_experts_per_tok"] is None:
        raise KeyError("num_experts_per_tok")
    return int(data.get("num_experts_per_tok") or 0)


def moe_from_hf(kind: str, data: dict[str, Any]) -> MoeConfig | None:
    """The MoE layer of a config.json whose family's MLP kind is `kind` (models/architectures.py; "" dense: None);
    KeyError when a key is missing."""
    if kind in ("nemotron_h", "jamba"):  # experts by the block pattern (models/nemotron_h.py) or Jamba's layer period; none: dense
        return (_nemotron_h_moe if kind == "nemotron_h" else _jamba_moe)(data, int(data["num_hidden_layers"]))
    experts = data.get("num_experts", data.get("num_local_experts"))
    top_k = _top_k(kind, data)
    layers = int(data["num_hidden_layers"])
    if kind in ("qwen2_moe", "qwen3_moe"):
        return MoeConfig(int(experts), top_k, int(data["moe_intermediate_size"]), "softmax_topk", bool(data.get("norm_topk_prob", False)),
                         shared_expert_size=int(data.get("shared_expert_intermediate_size") or 0) if kind == "qwen2_moe" else 0,
                         dense_layers=_dense_layers(data, layers))
    if kind == "flint":  # sigmoid top k renormalised without a score bias (one group), an ungated shared expert
        return MoeConfig(int(experts), top_k, int(data["moe_intermediate_size"]), "sigmoid_group", bool(data.get("norm_topk_prob", True)),
                         shared_expert_size=int(data.get("shared_expert_intermediate_size") or 0), shared_gated=False,
                         dense_layers=_dense_layers(data, layers))
    if kind == "hy_v3":  # sigmoid top k of scores + score bias (one group), renormalised, scaled; ungated shared experts
        inter = int(data["moe_intermediate_size"])
        return MoeConfig(int(experts), top_k, inter, "sigmoid_group", True, shared_name="shared_mlp", shared_gated=False,
                         shared_expert_size=inter * int(data.get("num_shared_experts") or 0), score_bias=True,
                         routed_scale=float(data.get("router_scaling_factor", 1.0)), dense_layers=_mlp_dense_layers(data, layers))
    if kind == "olmoe":  # experts of intermediate_size, every layer
        return MoeConfig(int(experts), top_k, int(data["intermediate_size"]), "softmax_topk", bool(data.get("norm_topk_prob", False)))
    if kind == "granitemoe":  # the fused experts and shared MLP shown per expert by models/moe_weights.py; none: dense (Granite 4.0-H)
        return MoeConfig(int(experts), top_k, int(data["intermediate_size"]), "topk_softmax", block="block_sparse_moe",
                         router="router", shared_expert_size=int(data.get("shared_intermediate_size") or 0), shared_gated=False) if experts else None
    if kind == "ernie4_5_moe":
        return _ernie_moe(data, layers)
    if kind == "hunyuan_v1_moe":  # softmax top k renormalised; experts and the ungated shared MLP of intermediate_size
        inter = int(data["intermediate_size"])
        return MoeConfig(_uniform(data, "num_experts"), _uniform(data, "moe_topk"), inter, "softmax_topk", True,
                         shared_expert_size=inter, shared_name="shared_mlp", shared_gated=False)
    if kind == "cohere2_moe" or kind in _LAYERED:
        return _cohere2_moe(data, int(experts), top_k) if kind == "cohere2_moe" else _LAYERED[kind](data, int(experts), top_k, layers)
    if kind == "minimax_m2":  # sigmoid scores, top k of scores + e_score_correction_bias, renormalised: one group
        return MoeConfig(int(experts), top_k, int(data["intermediate_size"]), "sigmoid_group", True, block="block_sparse_moe",
                         projections=("w1", "w3", "w2"), score_bias=True)
    if kind == "phimoe":
        if top_k != 2:
            raise UnsupportedError(f"config.json: Phi-MoE's sparsemixer with num_experts_per_tok {top_k} is not supported (2)")
        return MoeConfig(int(experts), top_k, int(data["intermediate_size"]), "sparsemixer", block="block_sparse_moe",
                         projections=("w1", "w3", "w2"), jitter_eps=float(data.get("router_jitter_noise", 0.01)))
    if kind == "mixtral":
        return MoeConfig(int(experts), top_k, int(data["intermediate_size"]), "softmax_topk", True, block="block_sparse_moe",
                         projections=("w1", "w3", "w2"))
    if kind in ("deepseek_v3", "deepseek_v2", "kimi_linear"):
        return _deepseek_moe(kind, data, top_k, layers)
    if kind == "gemma4":  # the MoE block beside the dense MLP (enable_moe_block); its experts' activation the MLP's
        if not data.get("enable_moe_block"):
            return None
        act = HF_ACTS.get(str(data.get("hidden_activation", "gelu_pytorch_tanh")), "")
        if act not in ("gelu_tanh", "gelu", "silu"):
            raise UnsupportedError(f"config.json: Gemma 4's experts with hidden_activation {data['hidden_activation']!r} are not supported")
        return MoeConfig(int(experts), int(data["top_k_experts"]), int(data["moe_intermediate_size"]), "normed_softmax_topk", True,
                         block="moe", router="router", act=act, beside_dense=True, router_eps=float(data.get("rms_norm_eps", 1e-6)))
    if kind == "gpt_oss":
        return MoeConfig(int(experts), top_k, int(data["intermediate_size"]), "topk_softmax", router="router",
                         router_bias=True, expert_bias=True, swiglu_limit=float(data.get("swiglu_limit", 7.0)),
                         swiglu_alpha=float(data.get("swiglu_alpha", 1.702)))
    return None
