#!/usr/bin/env python
"""(Re)generate the benchmark workloads: benchmarks/workloads/{copy,chat}.jsonl.

copy.jsonl: copy-heavy edit requests. Each prompt is a short instruction plus material taken
verbatim from a file on this machine (CPython 3.11.7 standard library sources, the Python LICENSE,
and README text shipped in the METADATA of packages installed in the project venv). Functions are
cut out by qualified name with `ast` (decorators and docstring included, dedented); text is cut
between two literal markers. For "fix the typos" prompts, a few typos listed below are injected
into the text deterministically (first occurrence of each word). The edits are small on purpose,
so a 135M chat model mostly copies the material back.

chat.jsonl: open chat prompts with nothing to copy (written here by hand).

Deterministic: files, function names, markers and instructions are listed explicitly; the output
only depends on those files. Run from anywhere:

    python benchmarks/make_workloads.py            # writes the two .jsonl files
    python benchmarks/make_workloads.py --check    # also prints material token counts
                                                   # (needs ~/.cache/speccompile/smollm2-135m-hf,
                                                   # made by peer_ortgenai.py)
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import sysconfig
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT_DIR = HERE / "workloads"

# Where the material lives. STDLIB is the interpreter that created the venv (pyenv 3.11.7 here);
# SITE is the venv's site-packages. Both are recorded verbatim in each line's "source".
STDLIB = Path(sysconfig.get_paths()["stdlib"])
SITE = Path(sysconfig.get_paths()["purelib"])

# --- copy workload: code -------------------------------------------------------------------------
# (id, file relative to STDLIB, qualified function name, instruction)
CODE_TASKS = [
    ("textwrap-dedent-rename", "textwrap.py", "dedent",
     "Rename the variable `margin` to `common_indent` in the following function. "
     "Change nothing else and return the complete function."),
    ("heapq-siftup-rename", "heapq.py", "_siftup",
     "Rename the parameter `pos` to `index` everywhere in this function and return the full code."),
    ("statistics-median-error", "statistics.py", "median",
     "Change this function so that it raises ValueError instead of StatisticsError. "
     "Return the whole function, otherwise unchanged."),
    ("colorsys-rgb-to-hls-hints", "colorsys.py", "rgb_to_hls",
     "Add type hints to this function (the arguments and results are floats). "
     "Keep the body exactly as it is."),
    ("calendar-formatmonth-fstring", "calendar.py", "HTMLCalendar.formatmonth",
     "Convert the %-formatting in this method to an f-string. Return the complete method."),
    ("shutil-chown-fstring", "shutil.py", "chown",
     "Convert the .format() calls in this function to f-strings and return the full function."),
    ("functools-cmp-to-key-rename", "functools.py", "cmp_to_key",
     "Rename the inner class `K` to `KeyWrapper` in this code. Return the complete code."),
    ("copy-deepcopy-rename", "copy.py", "deepcopy",
     "Refactor this function: rename the local variable `y` to `result`. "
     "Do not change anything else."),
    ("os-makedirs-rename", "os.py", "makedirs",
     "Rename the parameter `exist_ok` to `allow_existing` in this function, including the "
     "docstring and the recursive call. Return the complete function."),
    ("urllib-urlunsplit-fstring", "urllib/parse.py", "urlunsplit",
     "Rewrite the string concatenations in this function as f-strings. "
     "Return the whole function."),
    ("difflib-ratio-rename", "difflib.py", "SequenceMatcher.ratio",
     "Rename the local variable `matches` to `match_count` in this method and return it."),
    ("fractions-round-rename", "fractions.py", "Fraction.__round__",
     "Rename the parameter `ndigits` to `digits` in this method. Return the full method."),
    ("base64-b64decode-rename", "base64.py", "b64decode",
     "Rename the parameter `validate` to `strict` in this function and its docstring. "
     "Return the complete function."),
    ("posixpath-commonpath-hints", "posixpath.py", "commonpath",
     "Add type hints to this function. Keep the rest of the code unchanged."),
    ("csv-dictreader-next-hints", "csv.py", "DictReader.__next__",
     "Add a return type hint to this method and return the full method unchanged otherwise."),
    ("glob-glob-doc", "glob.py", "glob",
     "Fix the double space in the docstring of this function and return the function."),
    ("inspect-cleandoc-hints", "inspect.py", "cleandoc",
     "Add type hints to this function (it takes a str and returns a str or None). "
     "Return the complete function."),
    ("bisect-bisect-right-hints", "bisect.py", "bisect_right",
     "Add type hints to the parameters of this function. Return the full function."),
    ("statistics-mode-rename", "statistics.py", "mode",
     "Rename the local variable `pairs` to `counts` in this function and return it unchanged "
     "otherwise."),
    ("string-template-substitute-rename", "string.py", "Template.substitute",
     "Rename the inner function `convert` to `replace_match` in this method. "
     "Return the complete method."),
]

# --- copy workload: text -------------------------------------------------------------------------
# (id, file (absolute), start marker (included), end marker (excluded), instruction,
#  typos: list of (word, misspelling) — first occurrence of each word is replaced)
TYPO_INSTRUCTION = ("Fix the spelling mistakes in the following text. Return the corrected text "
                    "and change nothing else.")
TEXT_TASKS = [
    ("heapq-about-typos", STDLIB / "heapq.py",
     "In the tree above, each cell", "A nice feature of this sort",
     TYPO_INSTRUCTION,
     [("tournament", "tournamnet"), ("efficient", "efficeint"), ("algorithmic", "algoritmic"),
      ("logarithmic", "logaritmic")]),
    ("python-license-history-rename", STDLIB / "LICENSE.txt",
     "Python was created in the early 1990s", "    Release         Derived",
     "In the following text, replace every occurrence of \"Guido\" with \"the BDFL\" "
     "(for \"Guido van Rossum\" write \"the BDFL\"). Return the text otherwise unchanged.", []),
    ("requests-readme-typos", SITE / "requests-2.34.2.dist-info" / "METADATA",
     "**Requests** is a simple, yet elegant", "## Installing Requests",
     TYPO_INSTRUCTION,
     [("elegant", "elegent"), ("extremely", "extremly"), ("manually", "manualy"),
      ("repositories", "repositores")]),
    ("click-readme-typos", SITE / "click-8.5.1.dist-info" / "METADATA",
     "Click is a Python package", "```\n$ python hello.py",
     TYPO_INSTRUCTION,
     [("beautiful", "beatiful"), ("necessary", "neccessary"), ("sensible", "sensable"),
      ("frustration", "frustraton")]),
    ("jinja2-readme-typos", SITE / "jinja2-3.1.6.dist-info" / "METADATA",
     "Jinja is a fast, expressive", "## In A Nutshell",
     TYPO_INSTRUCTION,
     [("expressive", "expresive"), ("inheritance", "inheritence"), ("environment", "enviroment"),
      ("philosophy", "philosphy")]),
    ("pydoc-while-rst-to-md", STDLIB / "pydoc_data" / "topics.py",
     "topic:while", None,
     "Convert the following reStructuredText to Markdown: turn the underlined title into a "
     "\"#\" heading and keep every other line exactly as it is.", []),
]

# --- chat workload -------------------------------------------------------------------------------
CHAT_PROMPTS = [
    ("story-lighthouse", "Write a short story about a lighthouse keeper who finds a message in a bottle."),
    ("story-robot-garden", "Tell me a short story about a small robot that learns to grow tomatoes."),
    ("story-dragon-baker", "Write a bedtime story about a dragon who wants to become a baker."),
    ("poem-autumn", "Write a poem about the first cold morning of autumn."),
    ("poem-ocean", "Write a short poem about the ocean at night."),
    ("explain-photosynthesis", "Explain how photosynthesis works to a ten-year-old."),
    ("explain-internet", "How does the internet work? Explain it in simple terms."),
    ("explain-seasons", "Why do we have seasons on Earth?"),
    ("explain-vaccines", "Explain how vaccines help the body fight diseases."),
    ("explain-recursion", "What is recursion in programming? Give a simple explanation."),
    ("advice-sleep", "Give me some advice on how to sleep better."),
    ("advice-interview", "What are some tips for preparing for a job interview?"),
    ("advice-study", "How can I stay focused while studying for exams?"),
    ("advice-running", "I want to start running. How should I begin?"),
    ("list-hobbies", "List ten hobbies that someone could start this weekend and say why each is fun."),
    ("list-healthy-breakfast", "Give me a list of healthy breakfast ideas."),
    ("list-travel", "What are five things to pack for a weekend camping trip?"),
    ("email-thanks", "Write a short email thanking a colleague for helping me with a project."),
    ("compare-cats-dogs", "What are the pros and cons of having a cat versus a dog as a pet?"),
    ("history-pyramids", "Tell me about how the ancient Egyptians built the pyramids."),
    ("describe-city", "Describe a walk through a busy city market in the early morning."),
    ("plan-birthday", "Help me plan a birthday party for my eight-year-old daughter."),
]


# --------------------------------------------------------------------------------------------------


def function_source(path: Path, qualname: str) -> str:
    src = path.read_text()
    node: ast.AST = ast.parse(src)
    for part in qualname.split("."):
        found = [n for n in ast.iter_child_nodes(node)
                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                 and n.name == part]
        if not found:
            raise SystemExit(f"error: {qualname} not found in {path}")
        node = found[0]
    lines = src.splitlines()
    start = min([d.lineno for d in node.decorator_list] + [node.lineno])
    return textwrap.dedent("\n".join(lines[start - 1:node.end_lineno]))


def text_between(path: Path, start: str, end: str | None) -> str:
    if start.startswith("topic:"):  # pydoc_data/topics.py: a dict literal of help topics
        tree = ast.parse(path.read_text())
        assign = next(n for n in tree.body if isinstance(n, ast.Assign))
        topics = ast.literal_eval(assign.value)
        return topics[start.split(":", 1)[1]].strip("\n")
    text = path.read_text()
    i = text.index(start)
    j = text.index(end, i) if end else len(text)
    return text[i:j].strip("\n")


def inject_typos(text: str, typos: list[tuple[str, str]]) -> str:
    for word, typo in typos:
        if word not in text:
            raise SystemExit(f"error: typo target {word!r} not in material")
        text = text.replace(word, typo, 1)
    return text


def build_copy() -> list[dict]:
    rows = []
    for wid, rel, qual, instr in CODE_TASKS:
        path = STDLIB / rel
        code = function_source(path, qual)
        prompt = f"{instr}\n\n```python\n{code}\n```"
        rows.append({"id": wid, "prompt": prompt, "chat": True,
                     "source": f"{path}::{qual}", "kind": "code"})
    for wid, path, start, end, instr, typos in TEXT_TASKS:
        text = inject_typos(text_between(path, start, end), typos)
        prompt = f"{instr}\n\n{text}"
        src = f"{path}::{start}" if start.startswith("topic:") else str(path)
        rows.append({"id": wid, "prompt": prompt, "chat": True, "source": src, "kind": "text"})
    return rows


def build_chat() -> list[dict]:
    return [{"id": wid, "prompt": p, "chat": True} for wid, p in CHAT_PROMPTS]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def check(rows: list[dict]) -> None:
    from tokenizers import Tokenizer

    tj = Path("~/.cache/speccompile/smollm2-135m-hf/tokenizer.json").expanduser()
    if not tj.exists():
        print(f"(no tokenizer at {tj}; run peer_ortgenai.py once)", file=sys.stderr)
        return
    tok = Tokenizer.from_file(str(tj))
    for r in rows:
        n = len(tok.encode(r["prompt"]).ids)
        print(f"{r['id']:40s} {n:5d} prompt tokens (before the chat template)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Regenerate benchmarks/workloads/*.jsonl")
    ap.add_argument("--out-dir", type=Path, default=OUT_DIR)
    ap.add_argument("--check", action="store_true", help="print prompt token counts")
    args = ap.parse_args(argv)
    copy_rows, chat_rows = build_copy(), build_chat()
    write_jsonl(args.out_dir / "copy.jsonl", copy_rows)
    write_jsonl(args.out_dir / "chat.jsonl", chat_rows)
    print(f"wrote {len(copy_rows)} copy prompts and {len(chat_rows)} chat prompts to {args.out_dir}")
    if args.check:
        check(copy_rows + chat_rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
