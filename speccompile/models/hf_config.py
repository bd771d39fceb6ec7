"""A Hugging Face config.json as transformers itself reads it.

Checkpoints on the Hub keep keys of older transformers releases that transformers still converts on load:
Gemma 3's `sliding_window_pattern` and `rope_local_base_freq` (no `layer_types`, no per-type rope table), `rope_scaling`
with a top-level `rope_theta`, and defaults a save left out. Reading the stored dict as it is would build another
model than the one transformers runs (every Gemma 3 layer sliding, the local layers at the global base), so the
folder's config goes through transformers' own config class first (`AutoConfig.for_model`: its conversions and
defaults), the oracle the families are checked against. Where this transformers does not know the model type or
cannot build it, the stored dict is read as before.
"""

from __future__ import annotations

from typing import Any


def transformers_config(raw: dict[str, Any]) -> Any | None:
    """transformers' config object for a config.json dict, or None where transformers cannot build one."""
    try:
        import transformers

        return transformers.AutoConfig.for_model(str(raw.get("model_type", "")), **{k: v for k, v in raw.items() if k != "model_type"})
    except Exception:  # noqa: BLE001 - no transformers, a model type it lacks (ValueError), or a config it refuses
        return None


def as_transformers_reads(raw: dict[str, Any]) -> dict[str, Any]:
    """config.json `raw` with transformers' conversions and defaults applied (the stored dict where it cannot)."""
    config = transformers_config(raw)
    return dict(config.to_dict()) if config is not None else raw
