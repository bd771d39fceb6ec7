"""Drafter exporters, selected by `--drafter KIND:PATH`.

Each exporter writes its graph(s) into the artifact's temporary directory and returns a
`DrafterExport`: the graphs, the files written and the drafter's manifest section. The registry below also
says which hidden-state taps the target graph must expose for each kind.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..errors import InputError, UnsupportedError
from ..models.config import ModelConfig, eagle3_tap_layers
from ..models.load import LoadedModel
from ..draft_config import DraftConfig
from .drafter_types import DrafterExport, DrafterRequest

__all__ = ["DrafterExport", "DrafterRequest", "export_drafter", "parse_drafter", "target_hidden_states_for",
           "target_taps_for"]


# kind -> (needs a path, hidden states the target must expose, exporter: "draft-model" | "head" | "dflash" | None). An exporter
# (request, target, out_dir, dtype, digests) -> DrafterExport records the sha256 of the files it writes in
# `digests` (file name -> hex) when it computes them on the way. The exporters import nothing from this module.
Exporter = Callable[[DrafterRequest, LoadedModel, Path, str, dict[str, str]], DrafterExport]
_REGISTRY: dict[str, tuple[bool, str, str | None]] = {
    "ngram": (False, "none", None),
    "suffix": (False, "none", None),
    "draft-model": (True, "none", "draft-model"),
    "eagle": (True, "final", "head"),
    "eagle3": (True, "eagle3", "head"),
    "medusa": (True, "final", "head"),
    "mtp": (False, "final", "head"),  # no path: the MTP modules inside the target's own checkpoint
    "dflash": (True, "eagle3", "dflash"),  # its own taps: `target_taps_for`
}


def _exporter(kind: str) -> Exporter | None:
    which = _REGISTRY[kind][2]
    if which == "head":
        from .heads import export_head  # torch-heavy: imported when a head is exported

        return export_head
    if which == "dflash":
        from .dflash import export_dflash

        return export_dflash
    return export_draft_model if which == "draft-model" else None


def parse_drafter(value: str | None, tree: str | None = None, num_draft_tokens: int | None = None) -> DrafterRequest | None:
    """Parse `KIND[:PATH]`; raise InputError about `drafter` on a bad value."""
    if not value or value == "none":
        return None
    kind, _, path = value.partition(":")
    if kind not in _REGISTRY:
        raise InputError(f"drafter: unknown kind '{kind}' (expected one of: {', '.join(sorted(_REGISTRY))}, as KIND:PATH)",
                         "drafter")
    needs_path = _REGISTRY[kind][0]
    if needs_path and not path:
        raise InputError(f"drafter {kind} needs a path: {kind}:PATH", "drafter")
    return DrafterRequest(kind, path or None, tree, num_draft_tokens)


def target_hidden_states_for(request: DrafterRequest | None) -> str:
    if request is None:
        return "none"
    return _REGISTRY[request.kind][1]


def target_taps_for(request: DrafterRequest | None, target: ModelConfig) -> tuple[int, ...]:
    """The target layers whose inputs the target graph returns as `aux_hidden_states`: an EAGLE-3 head's or a
    DFlash drafter's own (its config's tap ids; L = the final hidden state), else the default (2, L//2, L-3)."""
    if request is not None and request.kind == "dflash":
        from .dflash import dflash_taps

        return dflash_taps(request.path, target.num_hidden_layers) or eagle3_tap_layers(target.num_hidden_layers)
    if request is None or request.kind != "eagle3" or request.path is None:
        return eagle3_tap_layers(target.num_hidden_layers)
    import json

    from ..models.eagle3_layouts import check_eagle3_config, eagle3_taps

    folder = Path(request.path) if Path(request.path).is_dir() else Path(request.path).parent
    config = folder / "config.json"
    try:
        raw = json.loads(config.read_text()) if config.is_file() else {}
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"{config}: not valid JSON ({exc})") from None
    check_eagle3_config(raw, folder)  # a config not understood fails before the target is exported
    return tuple(eagle3_taps(raw, target.num_hidden_layers, folder))


def export_drafter(request: DrafterRequest, target: LoadedModel, out_dir: Path, dtype: str,
                   digests: dict[str, str] | None = None) -> DrafterExport:
    exporter = _exporter(request.kind)
    if exporter is None:  # n-gram lookup: nothing to export but its k
        config = DraftConfig.parse(request.kind, request.tree, request.num_draft_tokens)
        return DrafterExport(graphs={}, files=[], manifest={"kind": request.kind, **config.to_manifest()})
    return exporter(request, target, out_dir, dtype, {} if digests is None else digests)


# ----------------------------------------------------------------------------------------------
# Built-in: a separate, smaller draft model sharing the target's tokenizer.


def export_draft_model(request: DrafterRequest, target: LoadedModel, out_dir: Path, dtype: str,
                       digests: dict[str, str]) -> DrafterExport:
    """Export a separate draft LM as `draft.onnx` (the target's builder) after checking it shares the target's
    tokenizer."""
    from ..models.load import load_model
    from .decoder_graph import DecoderWeights, export_decoder

    draft = load_model(request.path)
    if draft.config.hybrid is not None:  # a draft model's cache rolls back the drafts the target rejects: states cannot
        raise UnsupportedError(f"drafter draft-model:{request.path}: a hybrid linear-attention model "
                               f"({draft.config.architecture}) as a draft model is not supported (its recurrent states "
                               "cannot roll back rejected drafts)", "drafter")
    _check_same_tokenizer(draft, out_dir, request.path)
    max_context = request.max_context or draft.config.max_position_embeddings
    weights = DecoderWeights(draft.config, draft.weights, "none", max_context=max_context)
    graphs = {"draft": export_decoder(weights, out_dir / "draft.onnx", "draft-model", dtype, digests)}
    files = ["draft.onnx", "draft.onnx.data"]
    if request.fused_cpu_graph:
        from .ort_fused_graph import add_fused_variant

        from .cpu_draft_weights import pack_fused_variant

        fused = add_fused_variant(weights, "draft", graphs, out_dir, max_context, digests=digests)
        packed = pack_fused_variant("draft", graphs, out_dir, request.draft_cpu_weights, digests=digests)  # int8 by default
        files += fused if packed is None else packed  # (the variant's files: slots=0, nothing else)
    return DrafterExport(
        graphs=graphs,
        files=files,
        manifest={
            "kind": "draft-model",
            "graph": "draft",
            "source": str(draft.source),
            "source_sha256": draft.source_sha256,
            "config": draft.config.to_dict(),
            **DraftConfig.parse("draft-model", request.tree, request.num_draft_tokens).to_manifest(),
        },
    )


def _check_same_tokenizer(draft: LoadedModel, out_dir: Path, draft_path: str) -> None:
    """The artifact's tokenizer (already written to out_dir) must equal the draft model's."""
    import tempfile

    from tokenizers import Tokenizer

    target_vocab = Tokenizer.from_file(str(out_dir / "tokenizer.json")).get_vocab()
    with tempfile.TemporaryDirectory() as tmp:
        draft.write_tokenizer(Path(tmp))
        draft_vocab = Tokenizer.from_file(str(Path(tmp) / "tokenizer.json")).get_vocab()
    if draft_vocab != target_vocab:
        differing = len(set(draft_vocab.items()) ^ set(target_vocab.items()))
        raise InputError(
            f"drafter draft-model:{draft_path}: its tokenizer differs from the target's "
            f"({len(draft_vocab)} vs {len(target_vocab)} tokens, {differing} entries differ); "
            "a draft model must share the target's vocabulary", "drafter"
        )
