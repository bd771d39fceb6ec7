"""What a drafter drafts each step: its tree shape and num_draft_tokens. One grammar for export and runtime (a
part of the artifact contract, like manifest.py: export writes it into the manifest, the runtime reads it back).

`num_draft_tokens` (k below; the CLI's `--num-draft-tokens`/`-k`) is the most draft *positions* per step: the
number of tokens of a chain, the depth of a tree (a tree of depth k verifies more than k tokens). Shapes:

* chain drafters (n-gram lookup, a draft model): no tree; k defaults to 12 (n-gram) or 4 (draft model);
* block drafters (DFlash) draft a chain of k tokens, or with `--tree` a static tree (each depth's children the
  top-ranked tokens of that position; k defaults to the drafts per block);
* head drafters (EAGLE, EAGLE-3, MTP, Medusa) draft a tree, given by `--tree`:
  - a preset (``eagle-default``, ``chain-K``, ``tree-WxD``) or a JSON file of choice
    paths: a static tree, k defaults to its depth and cuts it to depth k;
  - ``chain``: a chain of k tokens (k defaults to 4);
  - ``dynamic`` / ``dynamic-D-K-N`` / ``dynamic-D-K-N-pP``: an EAGLE-2 tree grown each step (depth D, top-K
    children per expanded node, the N best nodes kept, none whose cumulative draft probability is below P);
    k defaults to D and caps the depth.

The manifest's drafter section stores a config as ``{"tree": choices | "dynamic", "tree_name", "dynamic":
{...}, "num_draft_tokens": k}`` (`to_manifest` / `from_manifest`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from .errors import ArtifactError, InputError, SpecCompileError, check_at_least

CHAIN_KINDS = ("ngram", "suffix", "draft-model")
HEAD_KINDS = ("eagle", "eagle3", "medusa", "mtp")
BLOCK_KINDS = ("dflash",)  # one pass drafts every position: a chain, or a static tree of each position's top-k
TREE_KINDS = HEAD_KINDS + BLOCK_KINDS
DEFAULT_NUM_DRAFT_TOKENS = {"ngram": 12, "suffix": 24, "draft-model": 4}  # suffix: tree nodes, SuffixDecoding's depth
DEFAULT_CHAIN_LENGTH = 4
DEFAULT_TREES = {"eagle": "eagle-default", "eagle3": "eagle-default", "medusa": "eagle-default", "mtp": "chain"}
_DYNAMIC = re.compile(r"dynamic(?:-(\d+)-(\d+)-(\d+)(?:-p(\d*\.?\d+))?)?")
MAX_PRESET_NODES = 1024

# --------------------------------------------------------------------------------------------
# Static trees: choice paths, presets and files
# --------------------------------------------------------------------------------------------


# ~25 nodes, depth 5, widest near the root: most acceptance mass sits on the drafter's top-1
# continuation, so the tree spends its width early and keeps a top-1 spine to depth 5.
EAGLE_DEFAULT: list[list[int]] = [
    [0], [1], [2], [3],
    [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [3, 0],
    [0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0],
    [0, 0, 0, 0], [0, 0, 0, 1], [0, 1, 0, 0], [1, 0, 0, 0],
    [0, 0, 0, 0, 0], [0, 0, 0, 1, 0], [0, 1, 0, 0, 0],
]  # fmt: skip


def wide_chains(width: int, depth: int) -> list[list[int]]:
    """``tree-WxD``: the top-W first tokens, each extended by a top-1 chain to depth D."""
    return [[w] + [0] * d for w in range(width) for d in range(depth)]


def chain_choices(length: int) -> list[list[int]]:
    """``chain-K``: K tokens, each the top-1 continuation of the previous."""
    return [[0] * d for d in range(1, length + 1)]


PRESETS: dict[str, list[list[int]]] = {
    "chain-4": chain_choices(4),
    "chain-8": chain_choices(8),
    "tree-2x4": wide_chains(2, 4),
    "tree-3x3": wide_chains(3, 3),
    "tree-4x2": wide_chains(4, 2),
    "eagle-default": EAGLE_DEFAULT,
}


def preset_names() -> list[str]:
    """Named presets (``chain-K`` and ``tree-WxD`` also work for other sizes)."""
    return list(PRESETS)


def load_choices(spec: str | Path) -> list[tuple[int, ...]]:
    """The choice paths of a preset name (``eagle-default``, ``chain-K``, ``tree-WxD``) or of a JSON file, in the
    tree's node order (by depth, then path).

    The JSON file holds a list of paths (``[[0], [0, 0], [1]]``) or an object with a
    ``"choices"`` list. Raises :class:`InputError` with a one-line reason otherwise.
    """
    return sorted(_choices_of(spec), key=lambda path: (len(path), path))


def _choices_of(spec: str | Path) -> list[tuple[int, ...]]:
    name = str(spec)
    if name in PRESETS:
        return normalise_choices(PRESETS[name])
    pattern = _pattern_preset(name)
    if pattern is not None:
        return normalise_choices(pattern)
    path = Path(name)
    if path.is_file():
        return normalise_choices(_read_choices_json(path))
    if path.suffix.lower() == ".json" or "/" in name or path.exists():
        raise InputError(f"tree file {name} not found")
    known = ", ".join(preset_names() + ["chain-K", "tree-WxD"])
    raise InputError(f"unknown tree preset {name!r} (known: {known}; or a JSON file of choice paths)")


def _pattern_preset(name: str) -> list[list[int]] | None:
    m = re.fullmatch(r"chain-(\d+)", name)
    if m:
        choices = chain_choices(int(m.group(1)))
    else:
        m = re.fullmatch(r"tree-(\d+)x(\d+)", name)
        if not m:
            return None
        choices = wide_chains(int(m.group(1)), int(m.group(2)))
    if not choices or len(choices) + 1 > MAX_PRESET_NODES:
        raise InputError(f"tree preset {name!r} must have between 1 and {MAX_PRESET_NODES - 1} draft nodes")
    return choices


def _read_choices_json(path: Path) -> list:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read tree file {path}: {e}") from None
    except json.JSONDecodeError as e:
        raise InputError(f"tree file {path} is not valid JSON: {e.msg} at line {e.lineno}") from None
    if isinstance(data, dict):
        data = data.get("choices")
    if not isinstance(data, list):
        raise InputError(f"tree file {path} must hold a list of choice paths (or {{\"choices\": [...]}})")
    return data


def normalise_choices(choices: Iterable[Sequence[int]]) -> list[tuple[int, ...]]:
    """Validate choice paths (InputError: malformed, duplicate or not prefix-closed); return them as tuples with
    the (optional) root [] dropped."""
    if isinstance(choices, (str, bytes)) or not isinstance(choices, Iterable):
        raise InputError(f"tree choices must be a list of paths like [[0], [0, 0], [1]], got {choices!r}")
    seen: set[tuple[int, ...]] = set()
    out: list[tuple[int, ...]] = []
    for raw in choices:
        path = _as_path(raw)
        if not path:
            continue
        if path in seen:
            raise InputError(f"tree path {list(path)} appears twice")
        seen.add(path)
        out.append(path)
    for path in out:
        if len(path) > 1 and path[:-1] not in seen:
            raise InputError(f"tree path {list(path)} has no parent path {list(path[:-1])} (paths must be prefix-closed)")
    return out


def _as_path(raw: object) -> tuple[int, ...]:
    if isinstance(raw, (str, bytes)) or not isinstance(raw, (list, tuple, np.ndarray)):
        raise InputError(f"tree path must be a list of non-negative integers, got {raw!r}")
    path = []
    for v in raw:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise InputError(f"tree path must be a list of non-negative integers, got {list(raw)!r}")
        path.append(int(v))
    return tuple(path)



# --------------------------------------------------------------------------------------------
# What a drafter drafts
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2 tree parameters: grown `depth` levels deep from the `top_k` children of the best nodes,
    `total_tokens` nodes kept, none below `min_prob` cumulative draft probability."""

    depth: int = 5
    top_k: int = 8
    total_tokens: int = 48
    min_prob: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"depth": self.depth, "top_k": self.top_k, "total_tokens": self.total_tokens}
        if self.min_prob:
            out["min_prob"] = self.min_prob
        return out


@dataclass(frozen=True)
class DraftConfig:
    """A drafter kind, its tree (static choice paths, a dynamic tree, or none for a chain drafter) and
    `num_draft_tokens` (the most draft positions a round: chain tokens, tree depth)."""

    kind: str
    num_draft_tokens: int
    choices: tuple[tuple[int, ...], ...] | None = None  # static tree (a head's chain is a one-path tree)
    dynamic: DynamicTree | None = None
    tree_name: str | None = None

    @property
    def shape(self) -> str:
        """"chain" (a chain drafter), "static" or "dynamic" (head drafters)."""
        if self.dynamic is not None:
            return "dynamic"
        return "static" if self.choices is not None else "chain"

    @property
    def is_chain(self) -> bool:
        """Whether every draft is one path: a chain drafter's, or a head's static tree of one path (`--tree chain`)."""
        return self.dynamic is None and all(not any(path) for path in self.choices or ())

    def with_num_draft_tokens(self, num_draft_tokens: int | None) -> "DraftConfig":
        """The same tree with another `num_draft_tokens` (None: unchanged)."""
        if num_draft_tokens is None:
            return self
        return replace(self, num_draft_tokens=_check_num_draft_tokens(num_draft_tokens))

    # -- the grammar ---------------------------------------------------------------------------------

    @classmethod
    def parse(cls, kind: str, tree: str | None = None, num_draft_tokens: int | None = None) -> "DraftConfig":
        """The config drafter KIND with `tree` and `num_draft_tokens` asks for (defaults filled in); errors about
        them name `tree` / `num_draft_tokens`."""
        if num_draft_tokens is not None:
            _check_num_draft_tokens(num_draft_tokens)
        given = num_draft_tokens  # (None: the default of the kind or tree)
        if kind in BLOCK_KINDS and tree is not None:
            if tree == "chain" or _DYNAMIC.fullmatch(tree):
                raise InputError(f"tree {tree}: the {kind} drafter drafts a chain by default, or a static tree", "tree")
            choices = load_choices(tree)
            return cls(kind, _given_or(given, max(map(len, choices))), _paths(choices), tree_name=str(tree))
        if kind in CHAIN_KINDS or kind not in HEAD_KINDS:
            if tree is not None:
                raise InputError(f"tree: the {kind} drafter drafts chains; trees need a head drafter ({', '.join(HEAD_KINDS)})", "tree")
            return cls(kind, _given_or(given, DEFAULT_NUM_DRAFT_TOKENS.get(kind, DEFAULT_CHAIN_LENGTH)))
        name = tree or DEFAULT_TREES[kind]
        if name == "chain":
            length = _given_or(given, DEFAULT_CHAIN_LENGTH)
            return cls(kind, length, _paths(chain_choices(max(length, 1))), tree_name=f"chain-{length}")
        match = _DYNAMIC.fullmatch(name)
        if match:
            if kind == "medusa":
                raise InputError("tree dynamic: Medusa heads do not draft autoregressively; use a static tree", "tree")
            dynamic = DynamicTree()
            if match.group(1):
                dynamic = DynamicTree(int(match.group(1)), int(match.group(2)), int(match.group(3)))
            if match.group(4):
                dynamic = replace(dynamic, min_prob=float(match.group(4)))
            _check_dynamic(dynamic, f"tree {name}", field="tree")
            return cls(kind, _given_or(given, dynamic.depth), dynamic=dynamic, tree_name=name)
        choices = load_choices(name)
        return cls(kind, _given_or(given, max(map(len, choices))), _paths(choices), tree_name=str(name))

    # -- the manifest ---------------------------------------------------------------------------------

    def to_manifest(self) -> dict[str, Any]:
        """The keys this config adds to the manifest's drafter section."""
        out: dict[str, Any] = {"num_draft_tokens": self.num_draft_tokens}
        if self.dynamic is not None:
            out.update(tree="dynamic", tree_name=self.tree_name, dynamic=self.dynamic.to_dict())
        elif self.choices is not None:
            out.update(tree=[list(c) for c in self.choices], tree_name=self.tree_name)
        return out

    @classmethod
    def from_manifest(cls, section: dict[str, Any]) -> "DraftConfig":
        """The config an artifact was exported with (its manifest's drafter section)."""
        kind = section.get("kind")
        if not kind:
            raise ArtifactError("manifest drafter section has no kind")
        recorded = section.get("num_draft_tokens")
        tree = section.get("tree")
        if kind not in HEAD_KINDS and not (kind in BLOCK_KINDS and isinstance(tree, list) and tree):
            return cls(kind, int(recorded) if recorded else DEFAULT_NUM_DRAFT_TOKENS.get(kind, DEFAULT_CHAIN_LENGTH))
        if tree == "dynamic":
            raw = dict(section.get("dynamic") or {})
            try:
                dynamic = DynamicTree(**raw)
            except TypeError as exc:
                raise ArtifactError(f"manifest drafter section of {kind}: bad dynamic tree {raw!r} ({exc})") from None
            _check_dynamic(dynamic, f"manifest drafter section of {kind}", ArtifactError)
            return cls(kind, int(recorded or dynamic.depth), dynamic=dynamic, tree_name=section.get("tree_name") or "dynamic")
        if not isinstance(tree, list) or not tree:
            raise ArtifactError(f"manifest drafter section of {kind} has no tree (got {tree!r})")
        choices = _paths(tree)
        return cls(kind, int(recorded or max(len(c) for c in choices)), choices, tree_name=section.get("tree_name"))


def draft_config_for_run(kind: str, exported: dict[str, Any] | None, tree: str | None = None,
                         num_draft_tokens: int | None = None) -> DraftConfig:
    """What drafter KIND with `tree` and `num_draft_tokens` drafts on an artifact whose manifest drafter section is
    `exported`: the exported config when it is this kind's and no tree is given (`num_draft_tokens` overridable),
    else the parsed one."""
    if tree is None and exported and exported.get("kind") == kind:
        return DraftConfig.from_manifest(exported).with_num_draft_tokens(num_draft_tokens)
    return DraftConfig.parse(kind, tree, num_draft_tokens)


def _paths(choices) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(x) for x in c) for c in choices)


def _check_num_draft_tokens(num_draft_tokens: int) -> int:
    check_at_least("num_draft_tokens", int(num_draft_tokens), 0)
    return int(num_draft_tokens)


def _given_or(given: int | None, default: int) -> int:
    """`num_draft_tokens` as given, else the default of the kind or tree."""
    return default if given is None else given


def _check_dynamic(dynamic: DynamicTree, where: str, error: type[SpecCompileError] = InputError,
                   field: str | None = None) -> None:
    if dynamic.depth < 1 or dynamic.top_k < 1 or dynamic.total_tokens < 1:
        raise error(f"{where}: depth, top-k and total tokens must be >= 1", field)
    if not 0.0 <= dynamic.min_prob < 1.0:
        raise error(f"{where}: the minimum draft probability (-pP) must be in [0, 1)", field)
