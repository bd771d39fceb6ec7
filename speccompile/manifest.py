"""The artifact contract: `manifest.json` <-> dataclasses, with schema version and file checksums.

An artifact directory (written by `speccompile export` or `build`) holds ONNX graphs or engines, the
tokenizer files and `manifest.json`. The runtime trusts nothing else: it checks the schema version and
the sha256 of every file listed before it loads anything.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ArtifactError

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
FUSED_VARIANT = "-ort"  # graph NAME's fused ONNX Runtime CPU variant is listed as NAME-ort
GPU_VARIANT = "-ort-cuda"  # ... and its ONNX Runtime CUDA variant (GroupQueryAttention, device KV buffer) as NAME-ort-cuda
SLOTS_VARIANT = "-ort-slots"  # ... and its slotted CPU variant (one GroupQueryAttention per batch slot) as NAME-ort-slots
GPU_SLOTS_VARIANT = "-ort-cuda-slots"  # ... and its slotted GPU variant (S slots of R rows a pass) as NAME-ort-cuda-slots
GPU_TREE_SLOTS_VARIANT = "-ort-cuda-tree-slots"  # ... and that variant with a per-slot attention_bias (tree drafts)


def variant_name(graph: str, target: str = "cpu") -> str:
    """Manifest name of graph `graph`'s fused ONNX Runtime variant for `target` ('cpu', 'cuda', 'slots' or
    'cuda-slots', 'cuda-tree-slots')."""
    return graph + {"cuda": GPU_VARIANT, "slots": SLOTS_VARIANT, "cuda-slots": GPU_SLOTS_VARIANT,
                    "cuda-tree-slots": GPU_TREE_SLOTS_VARIANT}.get(target, FUSED_VARIANT)


@dataclass
class TensorSpec:
    """One graph input or output: name, ONNX element type name and shape (ints or axis names)."""

    name: str
    dtype: str
    shape: list[Any]


@dataclass
class GraphSpec:
    """One ONNX graph (or engine) of the artifact and its interface."""

    role: str  # "target", "draft-model", "eagle", "eagle3", "medusa", "mtp"
    file: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    dtype: str = "fp32"
    num_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    hidden_states: str = "none"
    extra: dict[str, Any] = field(default_factory=dict)

    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs]


@dataclass
class Manifest:
    """Everything the runtime and the engine builder need to know about an artifact."""

    model: dict[str, Any]
    graphs: dict[str, GraphSpec]
    limits: dict[str, int]
    tokenizer: dict[str, Any] = field(default_factory=dict)
    drafter: dict[str, Any] | None = None
    files: dict[str, str] = field(default_factory=dict)
    precision: dict[str, Any] = field(default_factory=dict)
    engine: dict[str, Any] | None = None
    schema_version: int = SCHEMA_VERSION
    created_by: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = MANIFEST_NAME) -> "Manifest":
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ArtifactError(
                f"{source}: schema_version {version} is not supported by this speccompile "
                f"(expects {SCHEMA_VERSION}); re-export the model"
            )
        try:
            graphs = {
                name: GraphSpec(
                    **{
                        **g,
                        "inputs": [TensorSpec(**t) for t in g["inputs"]],
                        "outputs": [TensorSpec(**t) for t in g["outputs"]],
                    }
                )
                for name, g in data["graphs"].items()
            }
            fields = {f.name for f in dataclasses.fields(cls)}
            rest = {k: v for k, v in data.items() if k in fields and k != "graphs"}
            return cls(graphs=graphs, **rest)
        except (KeyError, TypeError) as exc:
            raise ArtifactError(f"{source}: malformed manifest ({exc})") from None

    def write(self, directory: Path) -> Path:
        """Write manifest.json (atomically) into `directory`."""
        path = Path(directory) / MANIFEST_NAME
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n")
        tmp.replace(path)
        return path

    def record_files(self, directory: Path, names: list[str], known: dict[str, str] | None = None) -> None:
        """Store the sha256 of each named file (relative to `directory`); `known`: digests computed while the
        files were written (name -> hex), used instead of reading those files again."""
        known = known or {}
        for name in names:
            self.files[name] = known[name] if name in known else sha256_of(Path(directory) / name)

    def graph(self, name: str) -> GraphSpec:
        if name not in self.graphs:
            raise ArtifactError(f"artifact has no '{name}' graph (has: {', '.join(self.graphs) or 'none'})")
        return self.graphs[name]


def sha256_of(path: Path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _manifest_data(directory: str | Path) -> dict[str, Any] | None:
    """The parsed manifest.json of `directory` when it is a speccompile one (any schema version), else None."""
    try:
        data = json.loads((Path(directory) / MANIFEST_NAME).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) and "schema_version" in data and isinstance(data.get("graphs"), dict) else None


def is_manifest_dir(directory: str | Path) -> bool:
    """True when `directory` holds a speccompile manifest.json (any schema version): an artifact directory."""
    return _manifest_data(directory) is not None


def written_files(directory: str | Path) -> set[str]:
    """What speccompile wrote in an artifact directory: manifest.json and the files it lists (relative paths)."""
    data = _manifest_data(directory) or {}
    listed = data.get("files")
    return {MANIFEST_NAME, *(str(name) for name in listed)} if isinstance(listed, dict) else {MANIFEST_NAME}


def read_manifest(directory: str | Path, verify_files: bool = True) -> Manifest:
    """Load and validate an artifact's manifest (every graph's file and every listed file present); with
    `verify_files` every listed file's sha256 is checked."""
    directory = Path(directory)
    path = directory / MANIFEST_NAME
    if not directory.is_dir():
        raise ArtifactError(f"{directory}: not an artifact directory (expected the output of `speccompile export`)")
    if not path.is_file():
        raise ArtifactError(f"{directory}: no {MANIFEST_NAME} (expected the output of `speccompile export`)")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path}: not valid JSON ({exc})") from None
    manifest = Manifest.from_dict(data, str(path))
    check_present(manifest, directory)
    if verify_files:
        verify_checksums(manifest, directory)
    return manifest


def check_present(manifest: Manifest, directory: Path) -> None:
    """Raise ArtifactError naming the first graph file or listed file that is missing (a stat per file)."""
    for name, spec in manifest.graphs.items():
        if not (directory / spec.file).is_file():
            raise ArtifactError(f"{directory / spec.file}: graph '{name}' of {MANIFEST_NAME} is this file, which is missing")
    for name in manifest.files:
        if not (directory / name).is_file():
            raise ArtifactError(f"{directory / name}: listed in {MANIFEST_NAME} but missing")


def verify_checksums(manifest: Manifest, directory: Path) -> None:
    """Raise ArtifactError naming the first file that is missing or whose sha256 differs.

    A large file whose sha256 was checked before (or computed while export wrote it) and whose stat has not
    changed since is not read again (`VerifiedFiles`): hashing a 16 GB weights file costs ~25 s per `run`."""
    verified = VerifiedFiles.load()
    for name, expected in manifest.files.items():
        file = directory / name
        if not file.is_file():
            raise ArtifactError(f"{file}: listed in {MANIFEST_NAME} but missing")
        if verified.known(file, expected):
            continue
        if sha256_of(file) != expected:
            raise ArtifactError(f"{file}: sha256 does not match {MANIFEST_NAME} (file modified or corrupt)")
        verified.remember(file, expected)
    verified.save()


def remember_verified(directory: Path, files: dict[str, str]) -> None:
    """Record `files` (name -> sha256, known to be right: computed while they were written) as verified."""
    verified = VerifiedFiles.load()
    for name, digest in files.items():
        if (Path(directory) / name).is_file():
            verified.remember(Path(directory) / name, digest)
    verified.save()


class VerifiedFiles:
    """sha256 digests of large files checked before, keyed by the file's identity and stat (device, inode, size,
    mtime and ctime in nanoseconds), kept in `$SPECCOMPILE_CACHE_DIR` (default ~/.cache/speccompile).

    Writing a file changes its mtime and ctime (ctime cannot be set back by a user), copying it gives a new
    inode: a file whose stat is the one recorded has the bytes that were hashed, short of a disk corrupting
    data under the filesystem, which the checksum would not catch either once the pages are cached. The
    scheme is git's index; the cache only saves reading, never decides a mismatch."""

    MIN_SIZE = 64 << 20  # smaller files are hashed every time (milliseconds)
    MAX_ENTRIES = 4096

    def __init__(self, path: Path, entries: dict[str, list]):
        self.path = path
        self.entries = entries
        self._changed = False

    @classmethod
    def load(cls) -> "VerifiedFiles":
        import os

        base = os.environ.get("SPECCOMPILE_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "speccompile"
        path = Path(base) / "verified-files.json"
        try:
            entries = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError, UnicodeDecodeError):
            entries = {}
        return cls(path, entries if isinstance(entries, dict) else {})

    @staticmethod
    def _key(file: Path) -> tuple[str, list]:
        st = file.stat()
        return f"{st.st_dev}:{st.st_ino}", [st.st_size, st.st_mtime_ns, st.st_ctime_ns]

    def known(self, file: Path, digest: str) -> bool:
        key, stamp = self._key(file)
        return stamp[0] >= self.MIN_SIZE and self.entries.get(key) == [*stamp, digest]

    def remember(self, file: Path, digest: str) -> None:
        key, stamp = self._key(file)
        if stamp[0] >= self.MIN_SIZE:
            self.entries.pop(key, None)
            self.entries[key] = [*stamp, digest]
            self._changed = True

    def save(self) -> None:
        """Write the cache (atomically; the oldest entries beyond MAX_ENTRIES dropped); an unwritable cache is
        ignored: verification then hashes again next time."""
        if not self._changed:
            return
        entries = dict(list(self.entries.items())[-self.MAX_ENTRIES:])
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{id(self)}.tmp")
            tmp.write_text(json.dumps(entries))
            tmp.replace(self.path)
        except OSError:
            pass
