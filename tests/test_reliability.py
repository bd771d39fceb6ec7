"""Nothing lost, nothing surprising: --force safety, cleanup on SIGTERM, up-front validation, clean errors,
file modes, help text and what a user sees (issue 15)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import run_cli, run_cli_here as _cli

REPO = Path(__file__).resolve().parents[1]


def _one_error_line(err: str, *needles: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for needle in needles:
        assert needle in lines[0], err


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------- --force replaces only our own output


@pytest.mark.parametrize("command", ["export", "build"])
def test_force_never_deletes_a_folder_of_user_files(capsys, tmp_path, tiny_model_dir, tiny_artifact, command):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("my own work")
    (out / "sub").mkdir()
    (out / "sub" / "data.csv").write_text("1,2,3")
    before = _tree(out)
    args = ["export", str(tiny_model_dir)] if command == "export" else ["build", str(tiny_artifact), "--int4", "--onnx-only"]
    code, _, err = _cli(capsys, *args, "--out", str(out), "--force")
    assert code == 2
    _one_error_line(err, "--out", "--force replaces only")
    assert _tree(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["mine"]  # no temporary folder either


def test_force_refuses_a_file(capsys, tmp_path, tiny_model_dir):
    out = tmp_path / "file.txt"
    out.write_text("keep me")
    code, _, err = _cli(capsys, "export", str(tiny_model_dir), "--out", str(out), "--force")
    assert code == 2 and out.read_text() == "keep me"
    _one_error_line(err, "not a directory")


def test_force_replaces_an_artifact_or_an_empty_folder(capsys, tmp_path, tiny_model_dir):
    out = tmp_path / "art"
    out.mkdir()
    code, _, err = _cli(capsys, "export", str(tiny_model_dir), "--out", str(out), "--force", "--no-fused-cpu-graph")
    assert code == 0, err
    assert (out / "manifest.json").is_file() and not (out / "target.ort.onnx").exists()
    code, _, err = _cli(capsys, "export", str(tiny_model_dir), "--out", str(out), "--force")
    assert code == 0, err
    assert (out / "target.ort.onnx").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


def test_train_draft_never_writes_into_a_folder_of_user_files(capsys, tmp_path, tiny_model_dir):
    data = tmp_path / "data.txt"
    data.write_text("some text to train on. " * 50)
    out = tmp_path / "mine"
    out.mkdir()
    (out / "config.json").write_text('{"mine": true}')
    for extra in ([], ["--force"]):
        code, _, err = _cli(capsys, "train-draft", str(tiny_model_dir), "--data", str(data), "--out", str(out), "--steps", "1", *extra)
        assert code == 2
        _one_error_line(err, "--out", "train-draft head folder")
        assert _tree(out) == {"config.json": b'{"mine": true}'}


def test_train_draft_bad_data_fails_fast_and_creates_nothing(capsys, tmp_path, tiny_model_dir):
    out = tmp_path / "heads" / "h"
    started = time.time()
    code, _, err = _cli(capsys, "train-draft", str(tiny_model_dir), "--data", str(tmp_path / "missing"), "--out", str(out))
    assert code == 2
    _one_error_line(err, "--data", "missing")
    assert time.time() - started < 10
    assert not (tmp_path / "heads").exists()


# ---------------------------------------------------------------- SIGTERM and stale temporary folders


def test_sigterm_during_export_removes_the_temporary_folder(tmp_path, tiny_model_dir):
    out = tmp_path / "exported"
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.Popen([sys.executable, "-m", "speccompile.cli", "export", str(tiny_model_dir), "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if any(p.name.startswith(".exported.tmp-") for p in tmp_path.iterdir()):
            break
        time.sleep(0.005)
    assert proc.poll() is None, "export ended before it could be interrupted"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "terminated"
    assert list(tmp_path.iterdir()) == []


def test_sigterm_during_train_draft_keeps_the_last_checkpoint_and_no_partial_file(tmp_path, tiny_model_dir):
    import torch

    data = tmp_path / "data.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    out = tmp_path / "head"
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.Popen([sys.executable, "-m", "speccompile.cli", "train-draft", str(tiny_model_dir), "--method", "medusa",
                             "--data", str(data), "--out", str(out), "--steps", "100000", "--save-every", "1", "--seq-len", "16",
                             "--batch", "1", "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None and not (out / "trainer_state.pt").is_file():
        time.sleep(0.01)
    time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()[1]
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "terminated"
    assert not list(out.rglob("*.tmp"))
    assert torch.load(out / "trainer_state.pt", weights_only=True)["step"] >= 1  # resumable


def test_stale_temporary_folders_of_dead_processes_are_removed(capsys, tmp_path, tiny_model_dir):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".exported.tmp-{dead.pid}"
    stale.mkdir()
    (stale / "target.onnx.data").write_bytes(b"x" * 100)
    alive = tmp_path / f".exported.tmp-{os.getppid()}"  # another export still running: left alone
    alive.mkdir()
    code, _, err = _cli(capsys, "export", str(tiny_model_dir), "--out", str(tmp_path / "exported"), "--no-fused-cpu-graph")
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["exported", alive.name])


def test_failed_export_removes_the_parent_folders_it_created(capsys, tmp_path):
    model = tmp_path / "not_a_model"
    model.mkdir()  # no config.json: fails after the output is prepared
    code, _, err = _cli(capsys, "export", str(model), "--out", str(tmp_path / "a" / "b" / "out"))
    assert code == 2, err
    assert not (tmp_path / "a").exists()


def test_every_written_file_honours_the_umask(capsys, tmp_path, tiny_model_dir):
    previous = os.umask(0o022)
    try:
        code, _, err = _cli(capsys, "export", str(tiny_model_dir), "--out", str(tmp_path / "art"))
    finally:
        os.umask(previous)
    assert code == 0, err
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in (tmp_path / "art").iterdir()}
    assert "target.onnx.data" in modes
    assert set(modes.values()) == {"0o644"}, modes
    assert oct((tmp_path / "art").stat().st_mode & 0o777) == "0o755"


# ---------------------------------------------------------------- every option checked before heavy work


@pytest.mark.parametrize("extra, needles", [
    (["--drafter", "eagle3:{tmp}/missing"], ["--drafter eagle3:", "no such file"]),
    (["--drafter", "draft-model:{tmp}/missing"], ["--drafter draft-model:", "no such file"]),
    (["--drafter", "eagle3:{tmp}", "--tree", "bogus"], ["--tree bogus", "unknown tree preset"]),
    (["--tree", "chain-2"], ["--tree", "only head drafters"]),
    (["--drafter", "ngram", "--tree", "chain-2"], ["--tree", "not ngram"]),
    (["--max-verify-tokens", "0"], ["--max-verify-tokens must be >= 1"]),
])
def test_export_options_fail_fast_and_create_nothing(capsys, tmp_path, tiny_model_dir, extra, needles):
    out = tmp_path / "exported" / "x"
    started = time.time()
    code, _, err = _cli(capsys, "export", str(tiny_model_dir), "--out", str(out), *[a.format(tmp=tmp_path) for a in extra])
    assert code == 2
    _one_error_line(err, *needles)
    assert time.time() - started < 10
    assert not (tmp_path / "exported").exists()


# ---------------------------------------------------------------- runtime-only install

BLOCK_TORCH = '''
import sys

class _NoTorch:
    """Behave as an install without the [export] extra: `import torch` fails."""
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NoTorch())
'''


def _cli_without_torch(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    site = tmp_path / "no_torch"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(BLOCK_TORCH)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(REPO)]), PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "speccompile.cli", *args], capture_output=True, text=True, env=env, timeout=300)


def test_commands_needing_torch_name_the_extra_on_a_runtime_only_install(tmp_path, tiny_model_dir, tiny_artifact):
    for args in (["export", str(tiny_model_dir), "--out", str(tmp_path / "o")],
                 ["train-draft", str(tiny_model_dir), "--data", str(tiny_model_dir / "config.json"), "--out", str(tmp_path / "h")]):
        result = _cli_without_torch(tmp_path, *args)
        assert result.returncode == 2, result.stderr
        _one_error_line(result.stderr, f"`speccompile {args[0]}` needs torch", "pip install 'speccompile[export]'")
    # options are checked before torch is imported: bad ones fail fast, and say what is wrong with them
    for args, needle in ((["export", str(tiny_model_dir), "--drafter", f"eagle3:{tmp_path}/missing", "--out", str(tmp_path / "o")], "--drafter"),
                         (["export", str(tiny_model_dir), "--out", str(tmp_path)], "--out"),
                         (["train-draft", str(tiny_model_dir), "--data", str(tmp_path / "missing"), "--out", str(tmp_path / "h")], "--data")):
        result = _cli_without_torch(tmp_path, *args)
        assert result.returncode == 2
        _one_error_line(result.stderr, needle)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["no_torch"]
    ran = _cli_without_torch(tmp_path, "run", str(tiny_artifact), "--prompt", "hi", "--max-tokens", "3", "--drafter", "ngram")
    assert ran.returncode == 0, ran.stderr  # the runtime itself never needs torch


# ---------------------------------------------------------------- bf16, FP8/INT4 on the CPU


def test_bf16_export_succeeds_on_a_cpu_machine_and_run_refuses_it_on_ort_cpu(capsys, tmp_path, tiny_model_dir):
    import onnx

    out = tmp_path / "bf16"
    code, _, err = _cli(capsys, "export", str(tiny_model_dir), "--out", str(out), "--dtype", "bf16", "--max-context", "64")
    assert code == 0, err
    onnx.checker.check_model(str(out / "target.onnx"), full_check=True)
    from speccompile.manifest import read_manifest

    assert read_manifest(out).graphs["target"].dtype == "bf16"
    for command in (["run", str(out), "--prompt", "hi"], ["verify", str(out)], ["bench", str(out), "--workload", "x.jsonl"]):
        code, _, err = _cli(capsys, *command)
        assert code == 2
        _one_error_line(err, "bf16", "ort-cpu", "--backend ort-cuda")


def test_int4_artifact_on_ort_cpu_warns_once_that_it_is_meant_for_gpus(capsys, tmp_path, tiny_artifact):
    built = tmp_path / "int4"
    code, _, err = _cli(capsys, "build", str(tiny_artifact), "--int4", "--onnx-only", "--out", str(built))
    assert code == 0, err
    code, _, err = _cli(capsys, "run", str(built), "--prompt", "hi", "--max-tokens", "2", "--drafter", "none")
    assert code == 0, err
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "INT4" in warnings[0] and "GPUs" in warnings[0], err
    code, _, err = _cli(capsys, "run", str(tiny_artifact), "--prompt", "hi", "--max-tokens", "2", "--drafter", "none")
    assert code == 0 and "warning:" not in err


# ---------------------------------------------------------------- prompts, --json --stream, build precision


def test_prompt_file_errors_name_prompt_file(capsys, tmp_path, tiny_artifact):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    for path, needle in ((empty, "the prompt is empty"), (tmp_path / "missing.txt", "no such file"), (tmp_path, "is a directory")):
        code, _, err = _cli(capsys, "run", str(tiny_artifact), "--prompt-file", str(path))
        assert code == 2
        _one_error_line(err, f"--prompt-file {path}:", needle)


def test_prompt_file_dash_reads_standard_input(tiny_artifact):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    base = [sys.executable, "-m", "speccompile.cli", "run", str(tiny_artifact), "--max-tokens", "8", "--drafter", "none", "--json"]
    from_stdin = subprocess.run(base + ["--prompt-file", "-"], input="the sea", capture_output=True, text=True, env=env, timeout=300)
    from_flag = subprocess.run(base + ["--prompt", "the sea"], capture_output=True, text=True, env=env, timeout=300)
    assert from_stdin.returncode == 0, from_stdin.stderr
    import json

    assert json.loads(from_stdin.stdout)["tokens"] == json.loads(from_flag.stdout)["tokens"]


def test_json_stream_prints_one_json_line_per_delta_then_the_result(capsys, tiny_artifact):
    import json

    code, out, err = _cli(capsys, "run", str(tiny_artifact), "--prompt", "hello", "--max-tokens", "12", "--raw", "--stream", "--json")
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    deltas, final = lines[:-1], lines[-1]
    assert len(deltas) >= 2 and all(set(d) == {"delta"} for d in deltas)
    assert "".join(d["delta"] for d in deltas) == final["text"] and final["tokens"]


def test_build_without_a_precision_flag_refuses(capsys, tmp_path, tiny_artifact):
    code, _, err = _cli(capsys, "build", str(tiny_artifact), "--onnx-only", "--out", str(tmp_path / "b"))
    assert code == 2
    _one_error_line(err, "--fp8", "--int4", "--no-quantize")
    assert not (tmp_path / "b").exists()
    code, _, err = _cli(capsys, "build", str(tiny_artifact), "--onnx-only", "--no-quantize", "--out", str(tmp_path / "b"))
    assert code == 0, err


# ---------------------------------------------------------------- artifact details


def test_manifest_records_the_vocabulary_size_of_a_tied_lm_head(capsys, tmp_path):
    from conftest import make_tiny_hf_model
    from speccompile.manifest import read_manifest

    model = make_tiny_hf_model(tmp_path / "tied", tie_word_embeddings=True)
    out = tmp_path / "art"
    code, _, err = _cli(capsys, "export", str(model), "--out", str(out), "--max-context", "64", "--no-fused-cpu-graph")
    assert code == 0, err
    logits = next(t for t in read_manifest(out).graphs["target"].outputs if t.name == "logits")
    assert logits.shape == ["batch", "q_len", 96]


def test_inspect_prints_tables_not_python_dicts(tmp_path, tiny_artifact):
    from io import StringIO

    from rich.console import Console

    from speccompile.commands.reports import print_summary
    from speccompile.inspect_artifact import summarize

    built = tmp_path / "int4"
    assert run_cli("build", str(tiny_artifact), "--int4", "--onnx-only", "--out", str(built)).returncode == 0
    for artifact in (tiny_artifact, built):
        buffer = StringIO()
        print_summary(summarize(artifact), Console(file=buffer, width=80))
        text = buffer.getvalue()
        assert "{'" not in text and "':" not in text and "['" not in text, text
        assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80
        assert "[batch, q_len, 96]" in text and "max_context=256" in text
    assert "runs_on=[ort-cpu" in text


# ---------------------------------------------------------------- help


def test_every_option_of_every_command_has_help():
    import click

    from speccompile.cli import cli

    missing = []
    for name, command in cli.commands.items():
        assert command.help, f"{name} has no description"
        for param in command.params:
            if isinstance(param, click.Option) and not (param.help or "").strip():
                missing.append(f"{name} {param.opts[0]}")
    assert not missing, f"options without help: {', '.join(missing)}"


# ---------------------------------------------------------------- tokens per pass


def test_plain_decoding_is_one_token_per_pass_when_it_ends_on_eos(capsys, tmp_path, tiny_artifact):
    import json

    from conftest import copy_artifact

    art = copy_artifact(tiny_artifact, tmp_path / "art")
    args = ["run", str(art), "--prompt", "abc abc abc", "--max-tokens", "40", "--json"]
    code, out, err = _cli(capsys, *args, "--drafter", "none")
    assert code == 0, err
    tokens = json.loads(out)["tokens"]
    cut = next(i for i in range(3, len(tokens)) if tokens[i] not in tokens[:i])  # a token first produced at step i
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["tokenizer"]["eos_token_ids"] = [tokens[cut]]  # this artifact's tokenizer now ends on it
    (art / "manifest.json").write_text(json.dumps(manifest))
    for drafter in ("none", "ngram"):
        code, out, err = _cli(capsys, *args, "--drafter", drafter)
        assert code == 0, err
        result = json.loads(out)
        stats = result["stats"]
        assert result["finish_reason"] == "stop" and result["tokens"] == tokens[:cut]
        assert stats["end_tokens"] == 1
        assert stats["mean_accepted_length"] == round((cut + 1) / stats["target_passes"], 4)
        if drafter == "none":
            assert stats["mean_accepted_length"] == 1.0


# ---------------------------------------------------------------- bench / verify: progress and tables


def test_bench_table_is_readable_at_80_columns(tmp_path, tiny_artifact):
    from io import StringIO

    from rich.console import Console

    from speccompile.commands.reports import print_bench_report
    from speccompile.runtime.bench import run_bench
    from speccompile.runtime.options import RunOptions

    workloads = []
    for name in ("copy", "chat_questions"):
        path = tmp_path / f"{name}.jsonl"
        path.write_text('{"id": "a", "prompt": "abc abc abc abc"}\n{"id": "b", "prompt": "hello there, hello there"}\n')
        workloads.append(path)
    report = run_bench(tiny_artifact, RunOptions(drafter="ngram", threads=1), workloads, 12, None, False)
    buffer = StringIO()
    print_bench_report(report, Console(file=buffer, width=80))
    text = buffer.getvalue()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80, text
    for label in ("plain tok/s", "speculative tok/s", "median speedup", "tokens per pass", "identical to plain", "chat_questions"):
        assert label in text, text


def test_verify_shows_a_progress_bar_only_on_a_terminal(monkeypatch, tiny_artifact):
    from io import StringIO

    from rich.console import Console

    from speccompile.console import progress_bar_console, prompt_progress_bar
    from speccompile.runtime.bench import run_verify
    from speccompile.runtime.options import RunOptions

    buffer = StringIO()
    with prompt_progress_bar(Console(file=buffer, force_terminal=True, width=80)) as progress:
        report = run_verify(tiny_artifact, RunOptions(drafter="ngram", threads=1), [], 8, 2, progress)
    assert report["identical"]
    assert "builtin-copy" in buffer.getvalue() and "2/2" in buffer.getvalue()
    import speccompile.console

    monkeypatch.setattr(speccompile.console, "console", lambda: Console(file=StringIO(), force_terminal=True))
    assert progress_bar_console(quiet=False) is not None and progress_bar_console(quiet=True) is None  # --json: none
    result = run_cli("verify", str(tiny_artifact), "--max-tokens", "8", "--limit", "1")  # stderr is a pipe: no bar
    assert result.returncode == 0 and "━" not in result.stderr and "identical" in result.stdout


# ---------------------------------------------------------------- install: CPU torch, test temp folders


def test_install_torch_takes_the_cpu_build_where_the_index_has_it_and_says_so_when_not(tmp_path):
    log = tmp_path / "pip.log"
    site = tmp_path / "no_torch"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCK_TORCH)  # a Python without torch yet

    def install(has_cpu_build: bool) -> subprocess.CompletedProcess:
        pip = tmp_path / "pip"  # a pip whose index has (or lacks) torch==2.13.0+cpu; logs what it was asked
        refuse = "" if has_cpu_build else 'case "$*" in *+cpu*) exit 1;; esac\n'
        pip.write_text(f'#!/bin/sh\necho "$@" >> "{log}"\n{refuse}exit 0\n')
        pip.chmod(0o755)
        env = dict(os.environ, PYTHON=sys.executable, PIP=str(pip), PYTHONPATH=str(site), TORCH_VERSION="2.13.0")
        return subprocess.run(["bash", str(REPO / "scripts" / "install_torch.sh")], env=env, capture_output=True, text=True, timeout=120)

    result = install(has_cpu_build=True)
    assert result.returncode == 0, result.stderr
    assert log.read_text().splitlines()[-1] == "install -q torch==2.13.0+cpu" and "installed torch" in result.stdout
    result = install(has_cpu_build=False)
    assert result.returncode == 0, result.stderr
    assert log.read_text().splitlines()[-1] == "install -q torch==2.13.0"
    assert "no CPU build" in result.stderr and "CUDA build" in result.stderr
    assert "bash scripts/install_torch.sh" in (REPO / "scripts" / "setup.sh").read_text()


def test_pytest_keeps_temporary_folders_only_of_failed_tests(request):
    assert request.config.getini("tmp_path_retention_policy") == "failed"
    assert int(request.config.getini("tmp_path_retention_count")) == 1


def test_readme_example_inputs_exist_in_a_fresh_clone_and_example_outputs_are_ignored():
    import re

    readme = (REPO / "README.md").read_text()
    def paths(flags: str) -> set[str]:
        return {p.strip("`.,;:()") for p in re.findall(rf"--(?:{flags})\s+(\S+)", readme)} - {""}

    def placeholder(path: str) -> bool:  # DIR, FILE.jsonl, SCRATCH/..., ...
        return "..." in path or any(part.split(".")[0].isupper() for part in path.split("/"))

    produced = paths("out")
    inputs = paths("data|workload|calib|calib-prompts|ngram-corpus")
    assert "README.md" in inputs  # the train-draft example
    missing = [p for p in inputs if p not in produced and not placeholder(p) and not (REPO / p).exists()]
    assert not missing, f"README names inputs a fresh clone does not have: {missing}"
    outputs = {p.split("/")[0] for p in produced if "/" in p and not placeholder(p)}
    tracked = subprocess.run(["git", "check-ignore", *[f"{o}/x" for o in outputs]], cwd=REPO, capture_output=True, text=True)
    assert sorted(set(tracked.stdout.split())) == sorted({f"{o}/x" for o in outputs}), tracked.stdout


def test_a_prompt_too_long_for_the_artifact_names_its_source(capsys, tmp_path, tiny_artifact):
    long = tmp_path / "long.txt"
    long.write_text("abc " * 100)  # 400 characters: more tokens than the tiny artifact's 256 (char tokenizer)
    code, _, err = _cli(capsys, "run", str(tiny_artifact), "--prompt-file", str(long))
    assert code == 2
    _one_error_line(err, f"--prompt-file {long}:", "max_context")
    workload = tmp_path / "w.jsonl"
    workload.write_text('{"id": "short", "prompt": "hi"}\n{"id": "huge", "prompt": "' + "abc " * 100 + '"}\n')
    code, _, err = _cli(capsys, "verify", str(tiny_artifact), "--workload", str(workload), "--max-tokens", "4")
    assert code == 2
    _one_error_line(err, "prompt huge:", "max_context")


def test_sigterm_turned_into_a_library_error_still_ends_as_terminated():
    """SIGTERM can arrive inside a native loader that wraps the raised `Terminated` in an error of its own (seen
    with safetensors during export): the command still ends as terminated (128 + SIGTERM), not as bad input."""
    script = """
import os, signal, time
import speccompile.cli as cli_module
from speccompile.atomic_dir import terminate_as_interrupt
from speccompile.errors import InputError

def command(**kwargs):
    with terminate_as_interrupt():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        except BaseException as exc:  # what a wrapping library does
            raise InputError(f"model.safetensors: not a readable safetensors file ({exc!r})")

cli_module.cli.main = command
cli_module.main([])
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert "terminated" in done.stderr and "not a readable" not in done.stderr
