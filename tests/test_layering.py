"""The import graph of speccompile/ keeps the layering one-way (docs/DESIGN.md, "Layering").

    the contract (errors, manifest, draft_config, atomic_dir, weights_file, tokenizer, onnx_versions, accel/):
        importable from anywhere, imports only itself
    models  <-  export  <-  engines        training -> models        runtime -> the contract only
    inspect_artifact -> the contract       serve -> runtime          evaluation -> runtime, engines
    commands/ -> any library part;  cli -> commands, console;  console -> the contract

Every part of the package (its first name component) has a rule naming the parts it may import: an import of
any other part fails, so an upward import anywhere is caught, and a new part fails until it is given a rule.
Every `import` / `from ... import` counts, including the ones inside functions and under TYPE_CHECKING (lazy
imports are still dependencies), and so does `importlib.import_module(NAME)` (a NAME the checker cannot
resolve fails too). Terminal output (print, rich, click, sys.stdout/stderr) belongs to the front ends only:
library functions return data.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "speccompile"
FRONT_ENDS = {"commands", "cli", "console"}
CONTRACT = {"__init__", "errors", "manifest", "draft_config", "atomic_dir", "weights_file", "tokenizer",
            "onnx_versions", "accel"}
LIBRARIES = {"models", "training", "export", "engines", "runtime", "inspect_artifact", "serve", "evaluation"}

# part -> the parts it may import (itself always)
ALLOWED: dict[str, set[str]] = {
    **{part: CONTRACT for part in CONTRACT},
    "models": CONTRACT,
    "training": CONTRACT | {"models"},
    "export": CONTRACT | {"models"},
    "engines": CONTRACT | {"models", "export"},
    "runtime": CONTRACT,
    "inspect_artifact": CONTRACT,
    "serve": CONTRACT | {"runtime"},
    "evaluation": CONTRACT | {"runtime", "engines"},
    "console": CONTRACT,
    "commands": CONTRACT | LIBRARIES | {"console"},
    "cli": CONTRACT | {"commands", "console"},
}

# Module cycles that still exist, each with the change that removes it. An entry that is no longer a cycle fails
# the test, so the list only shrinks.
KNOWN_CYCLES: list[list[str]] = []

OUTPUT_MODULES = {"rich", "click"}  # importing them is terminal output (click: its echo and prompts)
OUTPUT_CALLS = {"print", "sys.stdout.write", "sys.stderr.write", "sys.stdout.flush", "sys.stderr.flush",
                "click.echo", "click.secho"}


def module_names(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under package directory `root`."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _import_module_target(node: ast.Call, package: str) -> str | None:
    """The module an `importlib.import_module(...)` / `import_module(...)` call imports ("?" when it cannot be
    resolved statically); None for any other call. `package` is the calling module's package (__package__)."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name != "import_module" or not node.args:
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        target = arg.value
    elif isinstance(arg, ast.JoinedStr):
        parts = []
        for value in arg.values:
            if isinstance(value, ast.Constant):
                parts.append(str(value.value))
            elif isinstance(value, ast.FormattedValue) and isinstance(value.value, ast.Name) and value.value.id == "__package__":
                parts.append(package)
            else:
                return "?"
        target = "".join(parts)
    else:
        return "?"
    if target.startswith(".") and len(node.args) > 1:
        return "?"  # relative to an explicit package argument: not followed
    return target


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package-internal modules it imports (anywhere in the file, relative imports resolved,
    `importlib.import_module` followed; "?" for a dynamic import the checker cannot resolve)."""
    modules = module_names(root)
    return {name: module_imports(name, path.read_text(), path.name == "__init__.py", modules)
            for name, path in modules.items()}


def module_imports(name: str, source: str, is_package: bool, modules: dict[str, Path]) -> set[str]:
    """The package-internal modules that module `name` (its text: `source`) imports."""
    package = name.split(".")[0]
    here = name.split(".") if is_package else name.split(".")[:-1]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(source, name)):
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
        elif isinstance(node, ast.Call):
            dynamic = _import_module_target(node, ".".join(here))
            if dynamic is None:
                continue
            found = [dynamic]
        else:
            continue
        for target in found:
            if target == "?":
                targets.add(target)
                continue
            while target and target not in modules:  # `import a.b.c` where c is a name: its module
                target = target.rpartition(".")[0]
            if target.split(".")[0] == package and target != name:
                targets.add(target)
    return targets


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def violations(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """(importer, imported) edges that break ALLOWED; (module, "?") for a dynamic import it cannot follow and
    (module, "no rule") for a part of the package without a rule."""
    bad = set()
    for source, targets in graph.items():
        src = layer(source)
        if src not in ALLOWED:
            bad.add((source, "no rule"))
            continue
        for target in targets:
            if target == "?" or (layer(target) != src and layer(target) not in ALLOWED[src]):
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
            if target != "?" and layer(source) != layer(target):
                edges.setdefault(layer(source), set()).add(layer(target))
    return cycles(edges)


def terminal_output(root: Path) -> list[str]:
    """`module: what` for every print / rich / click / sys.stdout|stderr use outside the front ends."""
    found = []
    for name, path in module_names(root).items():
        if layer(name) in FRONT_ENDS:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                used = [a.name for a in node.names if a.name.split(".")[0] in OUTPUT_MODULES]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                used = [node.module] if (node.module or "").split(".")[0] in OUTPUT_MODULES else []
            elif isinstance(node, ast.Call):
                called = ast.unparse(node.func)
                used = [called] if called in OUTPUT_CALLS else []
            else:
                continue
            found += [f"{name}:{node.lineno}: {u}" for u in used]
    return found


# ---------------------------------------------------------------- the real tree

def test_every_part_has_a_rule_and_keeps_it():
    graph = import_graph(PACKAGE_ROOT)
    bad = sorted(violations(graph))
    assert not bad, "imports against the layering: " + "; ".join(f"{s} -> {t}" for s, t in bad)


def test_no_import_cycles():
    """Neither between layers nor between modules (e.g. a backend module and the protocol module it implements)."""
    graph = import_graph(PACKAGE_ROOT)
    assert layer_cycles(graph) == []
    found = cycles(graph)
    assert [c for c in found if c not in KNOWN_CYCLES] == []
    stale = [c for c in KNOWN_CYCLES if c not in found]
    assert not stale, f"fixed: remove {stale} from KNOWN_CYCLES"


def test_export_imports_nothing_from_the_runtime():
    graph = import_graph(PACKAGE_ROOT)
    assert not {(s, t) for s, ts in graph.items() if layer(s) == "export" for t in ts if layer(t) == "runtime"}


def test_library_code_prints_nothing():
    """Terminal output is the front ends' (commands/, cli.py, console.py): library functions return data."""
    assert terminal_output(PACKAGE_ROOT) == []


def test_runtime_is_torch_free():
    """No runtime module imports torch or transformers (the runtime installs without them)."""
    for name, path in module_names(PACKAGE_ROOT).items():
        if layer(name) not in ("runtime", *CONTRACT):
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
    "import importlib\nimportlib.import_module('speccompile.engines.config')",
    "from importlib import import_module\nimport_module(NAME)",  # not resolvable: refused

])
def test_checker_resolves_every_import_form(tmp_path, statement):
    package = _tree(tmp_path, {**BASE, "runtime/run.py": statement + "\n"})
    assert {t for s, t in violations(import_graph(package))} & {"speccompile.engines.config", "speccompile.engines", "?"}


def test_checker_follows_import_module_with_the_package_name(tmp_path):
    package = _tree(tmp_path, {**BASE, "export/heads.py": "import importlib\nimportlib.import_module(f'{__package__}.pick')\n",
                               "export/pick.py": "from ..engines import config\n"})
    graph = import_graph(package)
    assert graph["speccompile.export.heads"] == {"speccompile.export.pick"}
    assert violations(graph) == {("speccompile.export.pick", "speccompile.engines.config")}


def test_checker_allows_the_layering_direction(tmp_path):
    package = _tree(tmp_path, {**BASE, "engines/build.py": "from ..export import heads\nfrom ..errors import E\n"})
    assert violations(import_graph(package)) == set()


def test_checker_finds_contract_modules_importing_layers_and_cycles(tmp_path):
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


def test_checker_refuses_a_part_without_a_rule(tmp_path):
    package = _tree(tmp_path, {**BASE, "plugins.py": "from .errors import E\n"})
    assert violations(import_graph(package)) == {("speccompile.plugins", "no rule")}


UPWARD = [(part, above) for part in sorted(ALLOWED) for above in sorted(set(ALLOWED) - ALLOWED[part] - {part})]


@pytest.fixture(scope="module")
def real_tree():
    modules = module_names(PACKAGE_ROOT)
    return modules, import_graph(PACKAGE_ROOT)


@pytest.mark.parametrize("part,above", UPWARD, ids=[f"{p}->{a}" for p, a in UPWARD])
def test_an_upward_import_injected_into_the_real_tree_fails(real_tree, part, above):
    """For every part and every part it must not import: the real package with that import added to the part's
    first module (lazily, inside a function) fails the check."""
    modules, graph = real_tree
    source = next(m for m in sorted(modules) if layer(m) == part)
    target = next(m for m in sorted(modules) if layer(m) == above)
    path = modules[source]
    injected = path.read_text() + f"\n\ndef _injected():\n    import {target}\n"
    assert (source, target) not in violations(graph)
    changed = {**graph, source: module_imports(source, injected, path.name == "__init__.py", modules)}
    assert (source, target) in violations(changed)


def test_injected_terminal_output_fails(tmp_path):
    package = _tree(tmp_path, {**BASE, "runtime/report.py": "def show(x):\n    print(x)\n",
                               "export/bar.py": "from rich.progress import Progress\n",
                               "commands/run.py": "import click\nclick.echo('ok')\n"})
    found = terminal_output(package)
    assert len(found) == 2 and any("print" in f for f in found) and any("rich" in f for f in found)
