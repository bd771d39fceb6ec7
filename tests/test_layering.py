"""The import graph of speccompile/ keeps the layering one-way (docs/DESIGN.md, "Layering").

    models  <-  export  <-  engines          commands/ + cli.py + console.py: the click front ends
       ^          ^                           runtime/: torch-free, imports none of export, engines,
       |          |                                     training, commands, cli, console
    training   (neutral: errors, manifest, atomic_dir, tokenizer, accel/ -- importable from anywhere)
               (the runtime's draft contract, runtime/draft_config.py + runtime/tree.py, is what export writes
                into the manifest: export may import those two)

Every `import` / `from ... import` counts, including the ones inside functions (lazy imports are still
dependencies: they run as soon as the function does).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "speccompile"
FRONT_ENDS = {"commands", "cli", "console"}

# layer -> layers it must not import (a layer is speccompile.<first component>)
FORBIDDEN = {
    "runtime": {"export", "engines", "training"} | FRONT_ENDS,
    "models": {"export", "engines", "runtime", "training"} | FRONT_ENDS,
    "export": {"engines", "runtime", "training"} | FRONT_ENDS,
    "engines": {"runtime", "training"} | FRONT_ENDS,
    "training": {"export", "engines", "runtime"} | FRONT_ENDS,
}
NEUTRAL = {"__init__", "errors", "manifest", "atomic_dir", "tokenizer", "accel"}  # import only each other

# The runtime owns the draft contract (the --tree grammar, presets and k); export writes it into the manifest
# with the same code. These runtime modules are the only ones another layer may import.
SHARED_CONTRACT = {"speccompile.runtime.draft_config", "speccompile.runtime.tree"}

# Edges that still break a rule, each with the change that removes it. An entry that no longer matches an
# import fails the test, so the list only shrinks.
KNOWN_VIOLATIONS: set[tuple[str, str]] = set()


def module_names(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under package directory `root`."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package-internal modules it imports (anywhere in the file, relative imports resolved)."""
    modules = module_names(root)
    package = root.name
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        here = name.split(".") if is_package else name.split(".")[:-1]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[: len(here) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                # `from pkg import mod` imports module pkg.mod; `from mod import name` imports mod
                found = [f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names]
            else:
                continue
            for target in found:
                while target and target not in modules:  # `import a.b.c` where c is a name: its module
                    target = target.rpartition(".")[0]
                if target.split(".")[0] == package and target != name:
                    targets.add(target)
        graph[name] = targets
    return graph


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def violations(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """(importer, imported) edges that break FORBIDDEN or NEUTRAL."""
    bad = set()
    for source, targets in graph.items():
        for target in targets:
            src, dst = layer(source), layer(target)
            if target in SHARED_CONTRACT and src not in NEUTRAL:
                continue
            if dst in FORBIDDEN.get(src, ()) or (src in NEUTRAL and dst not in NEUTRAL):
                bad.add((source, target))
    return bad


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of a graph: its strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def layer_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Cycles between layers (speccompile.runtime <-> speccompile.export, ...)."""
    edges: dict[str, set[str]] = {}
    for source, targets in graph.items():
        for target in targets:
            if layer(source) != layer(target):
                edges.setdefault(layer(source), set()).add(layer(target))
    return cycles(edges)


def without_known(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    return {s: {t for t in ts if (s, t) not in KNOWN_VIOLATIONS} for s, ts in graph.items()}


# ---------------------------------------------------------------- the real tree

def test_layering_rules_hold():
    graph = import_graph(PACKAGE_ROOT)
    bad = sorted(violations(graph) - KNOWN_VIOLATIONS)
    assert not bad, "imports against the layering: " + "; ".join(f"{s} -> {t}" for s, t in bad)


def test_known_violations_are_still_real():
    graph = import_graph(PACKAGE_ROOT)
    stale = sorted((s, t) for s, t in KNOWN_VIOLATIONS if t not in graph.get(s, ()))
    assert not stale, f"fixed: remove {stale} from KNOWN_VIOLATIONS"


def test_no_import_cycles():
    """Neither between layers nor between modules (e.g. a backend module and the protocol module it implements)."""
    graph = without_known(import_graph(PACKAGE_ROOT))
    assert layer_cycles(graph) == []
    assert cycles(graph) == []


def test_runtime_is_torch_free():
    """No runtime module imports torch or transformers (the runtime installs without them)."""
    for name, path in module_names(PACKAGE_ROOT).items():
        if layer(name) not in ("runtime", *NEUTRAL):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            assert not [n for n in names if n.split(".")[0] in ("torch", "transformers")], f"{name} imports {names}"


# ---------------------------------------------------------------- the checker itself

def _tree(root: Path, files: dict[str, str]) -> Path:
    package = root / "speccompile"
    for rel, text in files.items():
        path = package / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return package


BASE = {
    "__init__.py": "",
    "errors.py": "",
    "runtime/__init__.py": "",
    "runtime/backends/__init__.py": "",
    "engines/__init__.py": "",
    "engines/config.py": "X = 1\n",
    "export/__init__.py": "",
    "export/heads.py": "",
}


def test_checker_finds_a_function_level_relative_import(tmp_path):
    package = _tree(tmp_path, {**BASE, "runtime/backends/trt.py": "def f():\n    from ...engines.config import X\n    return X\n"})
    graph = import_graph(package)
    assert graph["speccompile.runtime.backends.trt"] == {"speccompile.engines.config"}
    assert violations(graph) == {("speccompile.runtime.backends.trt", "speccompile.engines.config")}


@pytest.mark.parametrize("statement", [
    "import speccompile.engines.config",
    "from speccompile.engines import config",
    "from speccompile import engines",
    "from ..engines.config import X as Y",
])
def test_checker_resolves_every_import_form(tmp_path, statement):
    package = _tree(tmp_path, {**BASE, "runtime/run.py": statement + "\n"})
    assert {t for s, t in violations(import_graph(package))} & {"speccompile.engines.config", "speccompile.engines"}


def test_checker_allows_the_layering_direction(tmp_path):
    package = _tree(tmp_path, {**BASE, "engines/build.py": "from ..export import heads\nfrom ..errors import E\n"})
    assert violations(import_graph(package)) == set()


def test_checker_finds_neutral_modules_importing_layers_and_cycles(tmp_path):
    package = _tree(tmp_path, {
        **BASE,
        "manifest.py": "from .runtime import backends\n",
        "export/heads.py": "from ..runtime import backends\n",
        "runtime/backends/__init__.py": "from ...export.heads import x\n",
    })
    graph = import_graph(package)
    assert ("speccompile.manifest", "speccompile.runtime.backends") in violations(graph)
    assert ["export", "runtime"] in layer_cycles(graph)
    assert ["speccompile.export.heads", "speccompile.runtime.backends"] in cycles(graph)


def test_checker_finds_a_module_cycle_inside_a_layer(tmp_path):
    package = _tree(tmp_path, {
        **BASE,
        "runtime/backends/base.py": "def open_session():\n    from .ort import OrtSession\n",
        "runtime/backends/ort.py": "from .base import StepOutput\n",
    })
    graph = import_graph(package)
    assert violations(graph) == set() and layer_cycles(graph) == []
    assert cycles(graph) == [["speccompile.runtime.backends.base", "speccompile.runtime.backends.ort"]]
