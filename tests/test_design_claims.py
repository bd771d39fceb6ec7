"""docs/DESIGN.md states what the code does: the constants it quotes have the values it quotes, and the modules,
classes and functions it names exist.

Each entry of CLAIMS is a phrase of DESIGN.md that quotes a value and where the code keeps that value. Changing
the constant fails the test until the phrase (and the entry) are updated with it; rewording the phrase fails it
until the entry is updated, so a claim cannot silently drop out of the check.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
from pathlib import Path
from typing import Any, Callable

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "speccompile"
DESIGN = REPO / "docs" / "DESIGN.md"


def design_text() -> str:
    """DESIGN.md with every run of whitespace (line breaks included) read as one space."""
    return re.sub(r"\s+", " ", DESIGN.read_text())


def attr(module: str, path: str) -> Callable[[], Any]:
    """A getter of `module`'s attribute `path` (dotted: a class attribute)."""
    def get():
        value: Any = importlib.import_module(module)
        for name in path.split("."):
            value = getattr(value, name)
        return value
    return get


def default(module: str, path: str, parameter: str) -> Callable[[], Any]:
    """A getter of the default of `parameter` of the callable at `module`.`path`."""
    return lambda: inspect.signature(attr(module, path)()).parameters[parameter].default


def option_default(module: str, command: str, option: str) -> Callable[[], Any]:
    """A getter of the default of a click command's option."""
    return lambda: next(p.default for p in attr(module, command)().params if p.name == option)


def constant_in_tests(file: str, name: str) -> Callable[[], Any]:
    """A getter of a constant of a module under tests/ (not a package: loaded from its path)."""
    def get():
        spec = importlib.util.spec_from_file_location(f"_design_{Path(file).stem}", REPO / "tests" / file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return getattr(module, name)
    return get


def tree_planner_prior(path: tuple[int, ...]) -> Callable[[], float]:
    def get():
        from speccompile.runtime.tree_planner import TreePlanner
        return TreePlanner([[0], [1], [0, 0], [1, 0]], 4).acceptance(path)
    return get


RT = "speccompile.runtime"
# (phrase of DESIGN.md, where the code keeps the value, the value the phrase quotes)
CLAIMS: list[tuple[str, Callable[[], Any], Any]] = [
    ("contract errors, manifest, draft_config, atomic_dir, weights_file, tokenizer, onnx_versions, accel/",
     lambda: constant_in_tests("test_layering.py", "CONTRACT")() - {"__init__"},
     {"errors", "manifest", "draft_config", "atomic_dir", "weights_file", "tokenizer", "onnx_versions", "accel"}),
    ("no module over 450 lines", constant_in_tests("test_code_shape.py", "MAX_MODULE_LINES"), 450),
    ("no function over 60 lines", constant_in_tests("test_code_shape.py", "MAX_FUNCTION_LINES"), 60),
    ("`ALLOWED_WHILE_RESHAPED` set may exempt an engines/ module while a branch restructures it; it is empty",
     constant_in_tests("test_code_shape.py", "ALLOWED_WHILE_RESHAPED"), set()),
    ("on an import cycle (none is left; `KNOWN_CYCLES` may only shrink)",
     constant_in_tests("test_layering.py", "KNOWN_CYCLES"), []),
    ("`schema_version` 1", attr("speccompile.manifest", "SCHEMA_VERSION"), 1),
    ("a file of 64 MB or more whose sha256", attr("speccompile.manifest", "VerifiedFiles.MIN_SIZE"), 64 << 20),
    ("tensors of 64 KiB or more aligned to 64 KiB", attr("speccompile.weights_file", "LARGE_TENSOR"), 1 << 16),
    ("tensors of 64 KiB or more aligned to 64 KiB", attr("speccompile.weights_file", "ALIGN_LARGE"), 1 << 16),
    ("when its weights are at most 1 GiB", attr("speccompile.export.onnx_export", "ORT_CHECK_BYTES"), 1 << 30),
    ("(`prefill_chunk` = 256 tokens a pass by default)", attr(f"{RT}.options", "GenerationConfig.prefill_chunk"), 256),
    ("(int8 by default, block 32; `--draft-cpu-weights int4|fp32`)",
     option_default("speccompile.commands.artifacts", "export", "draft_cpu_weights"), "int8"),
    ("(int8 by default, block 32;", attr("speccompile.export.cpu_draft_weights", "BLOCK_SIZE"), 32),
    ("`export --batch-slots N` (default 8, the server's default `--max-concurrency`)",
     option_default("speccompile.commands.artifacts", "export", "batch_slots"), 8),
    ("(default 8, the server's default `--max-concurrency`)",
     option_default("speccompile.commands.serve", "serve", "max_concurrency"), 8),
    ("`max_dead` (64; 256 for head caches;", default(f"{RT}.kvcache", "KVCache", "max_dead"), 64),
    ("config, else 12 (n-gram), 24 (suffix), 4 (draft model)", attr("speccompile.draft_config", "DEFAULT_NUM_DRAFT_TOKENS"),
     {"ngram": 12, "suffix": 24, "draft-model": 4}),
    ("`chain-K` with K = `--num-draft-tokens` (default 4)", attr("speccompile.draft_config", "DEFAULT_CHAIN_LENGTH"), 4),
    ("the 24-node tree published with EAGLE", lambda: len(attr("speccompile.draft_config", "EAGLE_DEFAULT")()), 24),
    ("default depth 5, top-k 8, 48 nodes",
     lambda: (lambda d: (d.depth, d.top_k, d.total_tokens))(attr("speccompile.draft_config", "DynamicTree")()), (5, 8, 48)),
    ("an EMA (weight `alpha` = 0.1) of how often the node", default(f"{RT}.tree_planner", "TreePlanner", "alpha"), 0.1),
    ("`prior` = 0.5 per level", default(f"{RT}.tree_planner", "TreePlanner", "prior"), 0.5),
    ("`[0]` 0.5,", tree_planner_prior((0,)), 0.5),
    ("`[1]` 0.25,", tree_planner_prior((1,)), 0.25),
    ("`[0, 0]` 0.25,", tree_planner_prior((0, 0)), 0.25),
    ("`[1, 0]` 0.125", tree_planner_prior((1, 0)), 0.125),
    ("every `probe_every` = 8 planned steps the next `probe_extra` = 3",
     lambda: (default(f"{RT}.tree_planner", "TreePlanner", "probe_every")(),
              default(f"{RT}.tree_planner", "TreePlanner", "probe_extra")()), (8, 3)),
    ("by a margin (`MARGIN` = 1e-4)", attr(f"{RT}.costs", "MARGIN"), 1e-4),
    ("a is an EMA (weight `alpha` = 0.08,", attr(f"{RT}.adaptive", "AdaptiveController.alpha"), 0.08),
    ("`prior_acceptance` = 0.5) per proposal class", attr(f"{RT}.adaptive", "AdaptiveController.prior_acceptance"), 0.5),
    ("one step in `probe_every` = 8 drafts anyway", attr(f"{RT}.adaptive", "AdaptiveController.probe_every"), 8),
    ("`SEEDED_SLOPE` = 0.06", attr(f"{RT}.costs", "SEEDED_SLOPE"), 0.06),
    ("`PACKED_CPU_SLOPE` = 0.19", attr(f"{RT}.costs", "PACKED_CPU_SLOPE"), 0.19),
    ("MatMulNBits in blocks of 32 at accuracy level 4",
     lambda: (attr("speccompile.engines.nbits", "KERNEL_BLOCK")(), attr("speccompile.engines.nbits", "ACCURACY_LEVEL")()), (32, 4)),
    ("blocks of 16 packed two per byte", attr("speccompile.engines.numerics", "NVFP4_BLOCK"), 16),
    ("the residual-stream inputs of layers (2, L//2, L-3)",
     lambda: attr("speccompile.models.config", "eagle3_tap_layers")()(30), (2, 15, 27)),
    ("one scale byte s, the group's power of two 2^(s - 127)", attr("speccompile.models.mxfp4", "SCALE_BIAS"), 127),
    ("A group of 32 values along the input axis is 16 bytes", attr("speccompile.models.mxfp4", "GROUP"), 32),
]


@pytest.mark.parametrize("phrase, value, expected", CLAIMS, ids=[c[0][:48] for c in CLAIMS])
def test_design_quotes_the_value_the_code_has(phrase, value, expected):
    assert phrase in design_text(), f"docs/DESIGN.md no longer says {phrase!r}: update the claim and this entry"
    assert value() == expected, f"docs/DESIGN.md says {phrase!r}, the code has {value()!r}"


# ---------------------------------------------------------------- names

NOT_CODE = {"session.force_spinning_stop"}  # an ONNX Runtime session config key, not a module of ours
CODE_FILE_BASES = (REPO, PACKAGE, PACKAGE / "runtime")


def package_files() -> dict[str, Path]:
    return {p.relative_to(PACKAGE).as_posix(): p for p in PACKAGE.rglob("*.py")}


def defines(source: str, name: str) -> bool:
    """Whether `source` defines `name`: a def or class, a module-level or class-level assignment, a self.name."""
    n = re.escape(name)
    return bool(re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{n}\b|^\s*(?:self\.)?{n}\s*(?::|=(?!=))", source, re.M))


def name_problems(text: str, files: dict[str, Path]) -> list[str]:
    """The code names in backticks of `text` that do not resolve: a `path.py` file, `path.py::Name`, a
    `Class.member`, a `module.function`."""
    sources = {key: path.read_text() for key, path in files.items()}
    problems = []
    for name in sorted(set(re.findall(r"`([^`\s]+)`", text)) - NOT_CODE):
        if re.fullmatch(r"[\w/]+\.py(::\w+)?", name):
            file, _, member = name.partition("::")
            found = next((base / file for base in CODE_FILE_BASES if (base / file).exists()), None)
            if found is None and "/" not in file:  # a module named by its file name alone
                found = next((path for key, path in files.items() if key == file or key.endswith(f"/{file}")), None)
            if found is None:
                problems.append(f"{name}: no such file")
            elif member and not defines(found.read_text(), member):
                problems.append(f"{name}: {file} does not define {member}")
        elif re.search(r"\.(json|jinja|onnx|data|npy|pt|sh|plan)$", name):
            continue  # a file of an artifact or checkpoint
        elif m := re.fullmatch(r"([A-Z]\w+)\.(\w+)", name):
            owners = [s for s in sources.values() if re.search(rf"^class {m[1]}\b", s, re.M)]
            if not any(defines(s, m[2]) for s in owners):
                problems.append(f"{name}: no class {m[1]} defining {m[2]}")
        elif m := re.fullmatch(r"([a-z_]+)\.([a-z_]\w*)", name):
            modules = [s for key, s in sources.items() if key == f"{m[1]}.py" or key.endswith(f"/{m[1]}.py")]
            if modules and not any(defines(s, m[2]) for s in modules):
                problems.append(f"{name}: {m[1]}.py does not define {m[2]}")
    return problems


def test_the_code_design_names_exists():
    assert name_problems(DESIGN.read_text(), package_files()) == []


def test_the_name_check_finds_what_is_gone(tmp_path):
    (tmp_path / "mod.py").write_text("class Thing:\n    size: int = 1\n\n    def grow(self):\n        self.more = 2\n\n"
                                     "def helper():\n    pass\n")
    files = {"mod.py": tmp_path / "mod.py"}
    text = ("`Thing.size` `Thing.grow` `Thing.more` `mod.helper` `Thing.shrink` `mod.gone` `Nothing.size` "
            "`runtime/costs.py` `runtime/nowhere.py` `runtime/costs.py::ema` `runtime/costs.py::gone` `mod.py` `gone.py` "
            "`config.json`")
    assert name_problems(text, files) == [
        "Nothing.size: no class Nothing defining size",
        "Thing.shrink: no class Thing defining shrink",
        "gone.py: no such file",
        "mod.gone: mod.py does not define gone",
        "runtime/costs.py::gone: runtime/costs.py does not define gone",
        "runtime/nowhere.py: no such file",
    ]


# ---------------------------------------------------------------- the layering diagram


def diagram_rules(text: str) -> dict[str, set[str]]:
    """The library parts of the "Layering" diagram and the parts each may import besides the contract."""
    diagram = re.search(r"## Layering\s+```\n(.*?)```", text, re.S).group(1)
    rules = {}
    for line in diagram.splitlines():
        m = re.match(r"(?:libraries)?\s+(\w+)(?:/|\.py)?(?:\s+->\s+([\w, ]+?))?(?:\s{2,}|$)", line)
        if m and not line.startswith(("front ends", "contract")):
            rules[m[1]] = set(re.split(r",\s*", m[2])) if m[2] else set()
    return rules


def test_the_layering_diagram_is_what_the_layering_test_enforces():
    layering = constant_in_tests("test_layering.py", "ALLOWED")()
    contract = constant_in_tests("test_layering.py", "CONTRACT")()
    libraries = constant_in_tests("test_layering.py", "LIBRARIES")()
    drawn = diagram_rules(DESIGN.read_text())
    assert set(drawn) == libraries
    assert {part: layering[part] - contract - {part} for part in libraries} == drawn


# ---------------------------------------------------------------- one pricing module

PRICED = re.compile(r"seconds|^t1$|draft_cost|speed|per_second|pass_cost")  # names of a price: times, rates of tokens
PRICING_CALLS = {"expected_speed", "faster"}  # costs.py's comparison of two options


def pricing_outside_costs(text: str) -> list[str]:
    """Pricing arithmetic in one module (not runtime/costs.py): a call of costs.py's own comparison
    (`expected_speed`, `faster`), or a comparison (<, >, ==, ...) of anything named as a price (`*seconds*`, `t1`,
    `draft_cost`, `*speed*`, `*per_second*`, `pass_cost*`); `is None` checks are not pricing."""
    import ast

    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Call):
            name = getattr(node.func, "id", getattr(node.func, "attr", None))
            if name in PRICING_CALLS:
                found.append(f"line {node.lineno}: {name}()")
        elif isinstance(node, ast.Compare) and not all(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
            names = [n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node) if isinstance(n, (ast.Name, ast.Attribute))]
            if any(PRICED.search(name) for name in names):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_every_does_it_pay_decision_is_asked_of_costs_py():
    """The adaptive controller, the tree planner, the drafters and the batch decoder ask runtime/costs.py whether an
    option pays, with the costs passed in: no module of runtime/ compares prices itself."""
    found = {}
    for path in sorted((PACKAGE / "runtime").rglob("*.py")):
        if path.name != "costs.py":
            found.update({f"{path.relative_to(PACKAGE)}: {hit}": 1 for hit in pricing_outside_costs(path.read_text())})
    assert not found, "pricing outside runtime/costs.py:\n" + "\n".join(found)


def test_the_pricing_scan_finds_a_loop_that_compares_speeds():
    loop = ("def paying(costs, rates):\n    best, best_n, gain = expected_speed(1.0, costs.seconds(1)), 0, 1.0\n"
            "    for n, rate in enumerate(rates, 1):\n        gain += rate\n"
            "        if gain / costs.seconds(n + 1) > best * 1.0001:\n            best, best_n = gain, n\n    return best_n\n")
    assert [hit.split(":")[0] for hit in pricing_outside_costs(loop)] == ["line 2", "line 5"]
    assert pricing_outside_costs("def f(costs):\n    return 0 if costs.t1 is None else 1\n") == []
