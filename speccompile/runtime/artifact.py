"""Open an artifact directory for generation: manifest checks, tokenizer, backend sessions."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import InputError, UnsupportedError, with_article
from ..manifest import GraphSpec, Manifest, read_manifest, variant_name
from ..onnx_versions import installed_onnxruntime, onnxruntime_loads, version_string
from ..tokenizer import TextTokenizer
from .backends.base import Session
from .backends.factory import open_session
from .backends.ort_cuda_slots import OneSlotSession, OrtCudaSlotSession
from .backends.shared_weights import SharedWeights, gpu_form_weights
from .options import DRAFTER_CHOICES
from .state_cache import is_hybrid

CHAIN_DRAFTERS = ("ngram", "none", "draft-model")  # drafters that never draft trees (the GPU graph's causal passes)


@dataclass
class Artifact:
    directory: Path
    manifest: Manifest
    tokenizer: TextTokenizer
    target: Session
    backend: str
    threads: int | None
    fused: bool = True
    shape_invariant: int = 0  # rows of every target pass in shape-invariant mode (0 = off)
    weights: SharedWeights | None = None  # tensors the target's GPU graph shares with its slotted form (resident once)
    _shared_sessions: dict[str, Session] = field(default_factory=dict, repr=False)

    @property
    def max_context(self) -> int:
        return int(self.manifest.limits.get("max_context", 2048))

    @property
    def max_verify_tokens(self) -> int:
        return int(self.manifest.limits.get("max_verify_tokens", 64))

    @property
    def verify_rows(self) -> int:
        """The most rows one verify pass holds (a tree's nodes included): max_verify_tokens, or in shape-invariant
        mode its rows when fewer (every pass, a slotted GPU graph's included, has that many)."""
        return min(self.max_verify_tokens, self.shape_invariant or self.max_verify_tokens)

    @property
    def eos_token_ids(self) -> list[int]:
        ids = list(self.manifest.tokenizer.get("eos_token_ids") or [])
        return sorted(set(ids) | set(self.tokenizer.eos_token_ids))

    def session(self, graph: str, shared: bool = False) -> Session:
        """Open another graph of the artifact (a drafter) on the same backend. `shared`: the one session of that
        graph opened for drafters that decode side by side (the batch decoder's requests): each keeps its state
        in its own KV cache, and a session whose caches are its callers' (`max_caches` None: ONNX Runtime's
        sessions, TensorRT's per-call engine) keeps none between runs; one that owns its KV buffer (the GPU
        graphs) is opened for each drafter instead."""
        if not shared:
            return _open_graph(self.directory, self.manifest, graph, self.backend, self.threads, self.fused)
        if graph not in self._shared_sessions:
            session = self.session(graph)
            if session.max_caches is not None:
                return session
            self._shared_sessions[graph] = session
        return self._shared_sessions[graph]


def open_artifact(directory: str | Path, backend: str = "ort-cpu", threads: int | None = None, fused: bool = True,
                  drafter: str = "auto", shape_invariant: bool | int = False, shared_cores: bool = False) -> Artifact:
    """Verify the manifest (schema, sha256 of every file) and load the target graph + tokenizer.

    On `ort-cpu` the fused variant of a graph (`target.ort.onnx`, see export/ort_fused_graph.py) is used
    when the artifact has one and `fused` is set; otherwise the contract graph. `drafter` is the one
    that will run: when it has no graph of its own (n-gram, none) the target's threads may spin between runs,
    unless `shared_cores` (other sessions or threads of the process run between its passes: a server), where
    they spin only within a run (backends/ort.py `session_options`).
    `shape_invariant`: run every target pass with the same shapes (True: `max_verify_tokens` rows; an int:
    that many rows; runtime/backends/shape_invariant.py). With `shared_cores` on ort-cuda, the target's GPU graph
    takes its weights from a pool its slotted form shares (`Artifact.weights`). Without `shared_cores` (a single
    stream), a drafter that drafts trees runs on ort-cuda in slot 0 of the slotted GPU graph's tree form where the
    artifact has it (`OneSlotSession`), plain and drafted passes alike; else the contract graph (`tree_form_note`).
    """
    directory = Path(directory)
    manifest = read_manifest(directory, verify_files=True)
    tokenizer = TextTokenizer(directory, manifest.tokenizer.get("eos_token_ids"))
    check_backend(directory, manifest, backend)
    resolved = resolve_drafter(manifest, drafter)
    alone = resolved in ("ngram", "suffix", "none")
    spinning = "in-run" if shared_cores else ("always" if alone else "off")
    chains = resolved in CHAIN_DRAFTERS  # the GPU graph verifies chains only (causal attention)
    single = not shared_cores  # a server's batch decoder runs the tree form itself (session.py, `_gpu_slot_decoder`)
    rows = int(manifest.limits.get("max_verify_tokens", 64)) if shape_invariant is True else int(shape_invariant or 0)
    # a server (`shared_cores`: the serving engine's runner) opens the slotted form beside the GPU graph: their
    # weights resident once (backends/shared_weights.py); a single stream opens one graph with its own copy
    spec = runnable_spec(manifest, "target", backend, fused, chains, single)
    weights = gpu_form_weights(directory, manifest, backend, spec) if shared_cores else None
    target = _open_graph(directory, manifest, "target", backend, threads, fused, spinning=spinning, shape_invariant=rows,
                         chains=chains, weights=weights, single=single)
    return Artifact(directory, manifest, tokenizer, target, backend, threads, fused, rows, weights)


def _open_graph(directory: Path, manifest: Manifest, graph: str, backend: str, threads: int | None, fused: bool,
                spinning: str = "off", shape_invariant: int = 0, chains: bool = False,
                weights: SharedWeights | None = None, single: bool = False) -> Session:
    max_context = int(manifest.limits.get("max_context", 0)) or None
    spec = runnable_spec(manifest, graph, backend, fused, chains, single)
    return single_stream(open_session(directory, spec, backend, threads, manifest=manifest, max_context=max_context,
                                      spinning=spinning, shape_invariant=shape_invariant or None, weights=weights))


def single_stream(session: Session | OrtCudaSlotSession) -> Session:
    """The Session a single stream runs on an opened graph: slot 0 of a slotted GPU graph (`OneSlotSession`), else
    the session itself."""
    return OneSlotSession(session) if isinstance(session, OrtCudaSlotSession) else session


def runnable_spec(manifest: Manifest, graph: str, backend: str, fused: bool, chains: bool = False,
                  single: bool = False) -> GraphSpec:
    """The graph `open_artifact` runs for `graph` on `backend`: its fused variant where there is one (and `fused`),
    else the contract graph. On ort-cuda: the GPU graph for chains; for trees, in a `single` stream, the slotted GPU
    graph's tree form where the artifact has it and ONNX Runtime's CUDA EP takes its attention bias."""
    variant = variant_name(graph)
    if fused and backend == "ort-cpu" and variant in manifest.graphs:
        spec = manifest.graph(variant)
        if onnxruntime_loads(spec.extra.get("min_onnxruntime")):  # else the contract graph (older onnxruntime)
            return spec
    if fused and chains and backend == "ort-cuda" and variant_name(graph, "cuda") in manifest.graphs:
        return manifest.graph(variant_name(graph, "cuda"))
    tree = manifest.graphs.get(variant_name(graph, "cuda-tree-slots"))
    if fused and not chains and single and backend == "ort-cuda" and tree is not None \
            and onnxruntime_loads(tree.extra.get("min_onnxruntime_cuda")):
        return tree
    return manifest.graph(graph)


def tree_form_note(manifest: Manifest, backend: str, drafter: str, fused: bool = True) -> str | None:
    """Why a single stream drafting trees on ort-cuda runs the contract graph (the slow generic path), None where
    it does not: the artifact has no tree form of its slotted GPU graph, or ONNX Runtime here is too old for it."""
    resolved = resolve_drafter(manifest, drafter)
    drafts_trees = resolved not in CHAIN_DRAFTERS and resolved in ("suffix", (manifest.drafter or {}).get("kind"))
    if backend != "ort-cuda" or not fused or not drafts_trees or is_hybrid(manifest):  # (the runner refuses those)
        return None
    if runnable_spec(manifest, "target", backend, fused, False, True).file != manifest.graph("target").file:
        return None
    tree = manifest.graphs.get(variant_name("target", "cuda-tree-slots"))
    why = ("it has no target.ort-cuda-tree-slots.onnx (re-export with --dtype fp16|bf16 --batch-slots N)" if tree is None
           else f"target.ort-cuda-tree-slots.onnx needs onnxruntime-gpu {tree.extra.get('min_onnxruntime_cuda')} "
                f"(installed {version_string(installed_onnxruntime())})")
    return f"tree drafts on ort-cuda run the contract graph {manifest.graph('target').file}: {why}"


def check_backend(directory: Path, manifest: Manifest, backend: str) -> None:
    """Refuse, before anything loads, a target this backend cannot run: one built for other backends (its
    precision record's `runs_on`), a bf16 graph on ort-cpu (ONNX Runtime's CPU provider has no bf16 kernels)."""
    if "target" not in manifest.graphs:
        return
    record = manifest.precision.get("target", {})
    scheme, runs_on = record.get("scheme"), record.get("runs_on")
    quantized = manifest.graphs["target"].extra.get("quantization")
    if quantized is not None and quantized != scheme:
        runs_on = None  # the record is not this graph's (an exact fp32 emulation of it, engines/emulate.py, runs anywhere)
    if runs_on and backend not in runs_on:
        raise UnsupportedError(f"{directory}: {with_article(scheme)} target does not run on backend {backend} (it runs on "
                               f"{', '.join(runs_on)})", "backend")
    if backend == "ort-cpu" and manifest.graphs["target"].dtype.split("+")[0] == "bf16":
        raise UnsupportedError(f"{directory}: a bf16 artifact does not run on ort-cpu (ONNX Runtime's CPU provider has no "
                               "bf16 kernels); run it on a GPU (backend ort-cuda | ort-trt | tensorrt) or export it with "
                               "--dtype fp32", "backend")
    if backend == "ort-cpu" and manifest.graphs["target"].dtype.split("+")[0] == "fp16" and variant_name("target") not in manifest.graphs:
        _check_fp16_fits_cpu(directory, manifest, scheme)


def _available_memory() -> int | None:
    """Bytes of memory the host can give a new process without swapping (MemAvailable; None where unknown)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _check_fp16_fits_cpu(artifact: Path, manifest: Manifest, scheme: str | None) -> None:
    """ONNX Runtime's CPU provider runs an fp16 graph as fp32 (it converts every fp16 weight when the session
    opens; a quantized build's Q/DQ graph has every weight dequantized there too): refuse when that needs more
    memory than the host has available. Needed: 4 bytes per weight element of the graph."""
    from ..weights_file import load_graph

    graph = load_graph(artifact / manifest.graphs["target"].file)
    need = 4 * sum(int(np.prod(init.dims, dtype=np.int64)) for init in graph.graph.initializer)
    available = _available_memory()
    if available is not None and need > available:
        what = f"this {scheme} build of an fp16 export" if scheme else "an fp16 artifact"
        raise UnsupportedError(
            f"{artifact}: {what} runs on ort-cpu as fp32 (ONNX Runtime's CPU provider converts every fp16 "
            f"weight{', dequantized' if scheme else ''}): about {need / 1e9:.1f} GB, {available / 1e9:.1f} GB available here; "
            "on this CPU run an fp32 export (export --dtype fp32) or an INT4 / INT8 build of one (build --int4 | --int8: "
            "packed CPU kernels), or this one on a GPU (backend ort-cuda | ort-trt | tensorrt)", "backend")


def resolve_drafter(manifest: Manifest, name: str) -> str:
    """`auto` -> the drafter exported with the artifact, else n-gram lookup."""
    if name not in DRAFTER_CHOICES:
        raise InputError(f"drafter must be one of {', '.join(DRAFTER_CHOICES)}, got {name}", "drafter")
    if name == "auto":
        return (manifest.drafter or {}).get("kind") or "ngram"
    return name


