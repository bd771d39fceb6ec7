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
