"""What a new user gets wrong, answered in one line with exit code 2 (and before the model loads where the mistake
is in the command line): issue 33's list, one test each."""

from __future__ import annotations

import errno
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import copy_artifact, run_cli_here
from speccompile.errors import InputError, UnsupportedError

REPO = Path(__file__).resolve().parents[1]


def one_error_line(code: int, err: str, *needles: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, err)
    for needle in needles:
        assert needle in lines[0], err
    return lines[0]


@pytest.fixture
def nothing_loads(monkeypatch):
    """Opening an artifact's graphs fails the test: a mistake in the command line is reported before that."""
    import speccompile.runtime.session

    def load(*args, **kwargs):
        raise AssertionError("the artifact was opened before the mistake was reported")

    monkeypatch.setattr(speccompile.runtime.session, "open_artifact", load)


def _edited(src: Path, dst: Path, edit) -> Path:
    art = copy_artifact(src, dst)
    manifest = json.loads((art / "manifest.json").read_text())
    edit(art, manifest)
    (art / "manifest.json").write_text(json.dumps(manifest))
    return art


# ---------------------------------------------------------------- the artifact


def test_a_graph_entry_naming_a_missing_file_is_one_line_in_every_command(capsys, tmp_path, tiny_artifact):
    def rename(art, manifest):
        manifest["graphs"]["target-ort"]["file"] = "moved.onnx"

    art = _edited(tiny_artifact, tmp_path / "art", rename)
    for command in (["run", str(art), "--prompt", "hi"], ["verify", str(art)], ["inspect", str(art)]):
        one_error_line(*run_cli_here(capsys, *command)[::2], "moved.onnx", "target-ort", "missing")
    served = subprocess.run([sys.executable, "-m", "speccompile.cli", "serve", str(art), "--port", "0", "--threads", "1"],
                            capture_output=True, text=True, timeout=120)
    one_error_line(served.returncode, served.stderr, "moved.onnx", "missing")


def test_a_missing_contract_graph_is_noticed_without_contract_graph(capsys, tmp_path, tiny_artifact):
    """The fused CPU graph runs by default, but the contract graph (target.onnx) is part of the artifact."""
    def drop(art, manifest):
        (art / "target.onnx").unlink()
        manifest["files"].pop("target.onnx")

    art = _edited(tiny_artifact, tmp_path / "art", drop)
    one_error_line(*run_cli_here(capsys, "run", str(art), "--prompt", "hi")[::2], "target.onnx", "missing")


def test_a_bf16_artifact_is_refused_by_the_runner_and_the_server_in_one_line(capsys, tmp_path, tiny_artifact):
    from speccompile.runtime import Runner

    def bf16(art, manifest):
        manifest["graphs"]["target"]["dtype"] = "bf16"

    art = _edited(tiny_artifact, tmp_path / "art", bf16)
    with pytest.raises(UnsupportedError, match="bf16 artifact does not run on ort-cpu") as caught:
        Runner(art, threads=1)
    assert caught.value.field == "backend"  # the API names its argument; the CLI names --backend
    served = subprocess.run([sys.executable, "-m", "speccompile.cli", "serve", str(art), "--port", "0", "--threads", "1"],
                            capture_output=True, text=True, timeout=120)
    one_error_line(served.returncode, served.stderr, "bf16", "--backend ort-cuda")


# ---------------------------------------------------------------- run's options, before anything loads


@pytest.mark.parametrize("args,needles", [
    (["--max-tokens", "0"], ["--max-tokens must be >= 1, got 0"]),
    (["--num-draft-tokens", "0"], ["--num-draft-tokens must be >= 1", "--drafter none"]),
    (["--num-draft-tokens", "100"], ["--num-draft-tokens 100", "at most 63"]),
    (["--ngram-corpus", "missing.jsonl"], ["--ngram-corpus missing.jsonl: no such file"]),
    (["--drafter", "eagle3"], ["--drafter eagle3", "exported without it"]),
])
def test_run_option_mistakes_are_one_line_before_the_model_loads(capsys, tiny_artifact, nothing_loads, args, needles):
    one_error_line(*run_cli_here(capsys, "run", str(tiny_artifact), "--prompt", "hi", *args)[::2], *needles)


def test_the_api_names_its_arguments_the_cli_its_flags(tiny_artifact):
    from speccompile.runtime import Runner

    with pytest.raises(InputError) as caught:
        Runner(tiny_artifact, num_draft_tokens=100)
    assert str(caught.value).startswith("num_draft_tokens 100:") and caught.value.field == "num_draft_tokens"
    runner = Runner(tiny_artifact, threads=1)
    with pytest.raises(InputError, match=r"^max_tokens must be >= 1, got 0$"):
        runner.generate("hi", max_tokens=0)


@pytest.mark.parametrize("command", [["bench", "--workload", "missing.jsonl"], ["verify", "--max-tokens", "0"],
                                     ["verify", "--limit", "0"]])
def test_bench_and_verify_mistakes_before_the_model_loads(capsys, tiny_artifact, nothing_loads, command):
    one_error_line(*run_cli_here(capsys, command[0], str(tiny_artifact), *command[1:])[::2])


# ---------------------------------------------------------------- the command line itself


@pytest.mark.parametrize("args,needles", [
    (["run", "ART", "--max-tokens", "x"], ["speccompile run:", "--max-tokens", "speccompile run --help"]),
    (["run", "ART", "--no-such-flag"], ["No such option", "--no-such-flag"]),
    (["runn", "ART"], ["No such command 'runn'", "speccompile --help"]),
    (["run"], ["Missing argument"]),
])
def test_usage_errors_are_one_error_line(capsys, args, needles):
    one_error_line(*run_cli_here(capsys, *args)[::2], *needles)


def test_the_help_flow_exports_where_it_runs_and_replaces_an_earlier_export(capsys, tmp_path, tiny_model_dir, tiny_artifact):
    """`speccompile --help`'s typical flow runs after the README's first command filled the same folder: its export
    replaces an artifact there (--force), and run and bench use the folder it exported to."""
    from speccompile.cli import cli

    flow = [shlex.split(line.strip()) for line in cli.help.splitlines() if line.strip().startswith("speccompile ")]
    export, run, bench = flow[0], flow[1], flow[2]
    out = export[export.index("--out") + 1]
    assert export[1] == "export" and "--force" in export and run[2] == out and bench[2] == out
    existing = copy_artifact(tiny_artifact, tmp_path / out)  # what an earlier export left there
    args = [str(tiny_model_dir) if a == export[2] else str(existing) if a == out else a for a in export[1:]]
    code, _, err = run_cli_here(capsys, *args, "--max-context", "64")
    assert code == 0, err
    assert (existing / "manifest.json").is_file()


def test_train_draft_on_a_device_says_what_it_is(capsys, tmp_path, tiny_model_dir):
    line = one_error_line(*run_cli_here(capsys, "train-draft", str(tiny_model_dir), "--data", "/dev/null",
                                        "--out", str(tmp_path / "head"))[::2], "--data /dev/null")
    assert "no such file" not in line and "not a text file" in line
    assert not (tmp_path / "head").exists()


# ---------------------------------------------------------------- round 4 (issue 47): nothing lost


def _files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("command", ["export", "build"])
def test_force_keeps_the_users_files_inside_an_artifact_folder(capsys, tmp_path, tiny_model_dir, tiny_artifact, command):
    """--force replaces what speccompile wrote (the files the old manifest lists) and keeps the user's own."""
    from speccompile.manifest import written_files

    out = copy_artifact(tiny_artifact, tmp_path / "art")
    (out / "NOTES.md").write_text("my notes")
    (out / "mine").mkdir()
    (out / "mine" / "data.csv").write_text("1,2,3")
    args = ["export", str(tiny_model_dir), "--max-context", "64"] if command == "export" else \
        ["build", str(tiny_artifact), "--int4", "--onnx-only"]
    code, _, err = run_cli_here(capsys, *args, "--out", str(out), "--force")
    assert code == 0, err
    assert (out / "NOTES.md").read_text() == "my notes" and (out / "mine" / "data.csv").read_text() == "1,2,3"
    assert _files(out) == written_files(out) | {"NOTES.md", "mine/data.csv"}  # nothing of the old output is left
    assert [p.name for p in tmp_path.iterdir()] == ["art"]


def test_force_refuses_to_overwrite_a_users_file_of_a_name_it_writes(capsys, tmp_path, tiny_model_dir, tiny_artifact):
    def unlist(art, manifest):  # tokenizer.json is then the user's: the new export would write over it
        manifest["files"].pop("tokenizer.json")

    out = _edited(tiny_artifact, tmp_path / "art", unlist)
    before = {name: (out / name).read_bytes() for name in _files(out)}
    code, _, err = run_cli_here(capsys, "export", str(tiny_model_dir), "--max-context", "64", "--out", str(out), "--force")
    last = err.strip().splitlines()[-1]  # found at the end, after the progress lines
    assert code == 2 and "Traceback" not in err and [line for line in err.splitlines() if "error" in line] == [last], err
    assert last.startswith(f"error: --out {out}: tokenizer.json") and "move yours away" in last, err
    assert {name: (out / name).read_bytes() for name in _files(out)} == before
    assert [p.name for p in tmp_path.iterdir()] == ["art"]


class _FullDisk:
    """A file whose disk fills after `room` bytes: write raises OSError(ENOSPC) as the kernel's does."""

    def __init__(self, file, room: int):
        self.file, self.room = file, room

    def write(self, data) -> int:
        size = memoryview(data).nbytes
        if size > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= size
        return self.file.write(data)

    def __getattr__(self, name):
        return getattr(self.file, name)


@pytest.mark.parametrize("command", ["export", "build"])
def test_a_disk_that_fills_while_writing_is_one_line_and_leaves_nothing(capsys, monkeypatch, tmp_path, tiny_model_dir,
                                                                        tiny_artifact, command):
    """ENOSPC in the middle of the weights (export and build write them through WeightsWriter): one line naming
    --out and the file, exit 2, no output and no temporary folder; an existing artifact there stays as it was."""
    import builtins

    import speccompile.weights_file

    def filling(path, mode="r", *args, **kwargs):
        file = builtins.open(path, mode, *args, **kwargs)
        return _FullDisk(file, 4096) if "w" in mode else file

    monkeypatch.setattr(speccompile.weights_file, "open", filling, raising=False)
    args = ["export", str(tiny_model_dir), "--max-context", "64"] if command == "export" else \
        ["build", str(tiny_artifact), "--int4", "--onnx-only"]
    for out in (tmp_path / "new" / "art", copy_artifact(tiny_artifact, tmp_path / "old")):
        before = {name: (out / name).read_bytes() for name in _files(out)} if out.exists() else None
        code, _, err = run_cli_here(capsys, *args, "--out", str(out), "--force")
        last = err.strip().splitlines()[-1]
        assert code == 2 and "Traceback" not in err and [line for line in err.splitlines() if "error" in line] == [last], err
        assert last.startswith(f"error: --out {out}: the disk is full (No space left on device) while writing "), err
        assert ".onnx.data; nothing was written" in last, err
        assert ({name: (out / name).read_bytes() for name in _files(out)} if out.exists() else None) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"]  # no temporary folder, no parent created for it


# ---------------------------------------------------------------- round 4 (issue 47): what is printed where


def test_piped_reports_are_not_wrapped(tmp_path, tiny_artifact):
    """Piped (not a terminal), `inspect` prints each fact on one line, however long: rich would wrap at 80 columns."""
    from conftest import run_cli

    art = copy_artifact(tiny_artifact, tmp_path / ("a-folder-name-long-enough-to-pass-eighty-columns-" * 2))
    result = run_cli("inspect", str(art))
    assert result.returncode == 0, result.stderr
    (model,) = [line for line in result.stdout.splitlines() if line.startswith("model")]
    assert "vocab " in model and model.rstrip()[-1].isdigit() and len(model) > 80, result.stdout
    (title,) = [line for line in result.stdout.splitlines() if line.startswith(str(art))]
    assert "(schema" in title


# ---------------------------------------------------------------- round 4 (issue 47): logprob bytes


def _byte_fallback_tokenizer(folder: Path) -> Path:
    """Llama 2's kind: '▁' for spaces, <0xNN> tokens for bytes the vocabulary lacks (an emoji: four of them)."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    pieces = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], "▁", "h", "i", "▁h", "▁hi"]
    tok = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, [("▁", "h"), ("▁h", "i")], unk_token="<unk>",
                               byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    return folder


def _byte_level_tokenizer(folder: Path) -> Path:
    """GPT-2's kind (SmolLM2's): every byte a character of its alphabet; one merge joins an emoji's first two bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from speccompile.tokenizer import _BYTE_OF_CHAR

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    char = {b: c for c, b in _BYTE_OF_CHAR.items()}
    first_two = char[0xF0] + char[0x9F]
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    vocab[first_two] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, [(char[0xF0], char[0x9F])]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    return folder


@pytest.mark.parametrize("kind", ["byte-fallback", "byte-level"])
def test_logprob_bytes_are_each_tokens_own_bytes(tmp_path, kind):
    """An emoji split over tokens: each token's `bytes` are its own (a <0xF0> token gives [240], not U+FFFD's
    [239, 191, 189]), so joining them rebuilds the emoji, as OpenAI's do."""
    from speccompile.runtime.logprobs import TokenLogprob
    from speccompile.serve.responses import ResponseShape
    from speccompile.tokenizer import TextTokenizer

    folder = (_byte_fallback_tokenizer if kind == "byte-fallback" else _byte_level_tokenizer)(tmp_path / "tok")
    tokenizer = TextTokenizer(folder)
    ids = tokenizer.encode("hi 🙂")
    assert len(ids) >= 3 and tokenizer.decode(ids) == "hi 🙂"
    shape = ResponseShape(True, "m", lambda t: tokenizer.decode([t], skip_special_tokens=False), token_bytes=tokenizer.token_bytes)
    content = shape.logprobs([TokenLogprob(t, -1.0, ((t, -1.0),)) for t in ids])["content"]
    own = " hi 🙂" if kind == "byte-fallback" else "hi 🙂"  # the first piece is '▁hi': the space the normalizer put
    assert b"".join(bytes(entry["bytes"]) for entry in content) == own.encode()
    assert [239, 191, 189] not in [entry["bytes"] for entry in content]
    assert all(entry["top_logprobs"][0]["bytes"] == entry["bytes"] for entry in content)
    special = tokenizer.encode("<|endoftext|>" if kind == "byte-level" else "</s>", add_special_tokens=False)
    assert tokenizer.token_bytes(special[-1]) == (b"<|endoftext|>" if kind == "byte-level" else b"</s>")


# ---------------------------------------------------------------- round 4 (issue 47): words


def test_messages_say_an_int4(tmp_path, tiny_artifact):
    from speccompile.errors import with_article
    from speccompile.runtime import Runner

    def engines_only(art, manifest):
        manifest["graphs"]["target"]["extra"]["quantization"] = "int4"
        manifest["precision"]["target"] = {"scheme": "int4", "runs_on": ["tensorrt"]}

    art = _edited(tiny_artifact, tmp_path / "art", engines_only)
    with pytest.raises(UnsupportedError, match=r": an int4 target does not run on backend ort-cpu"):
        Runner(art, threads=1)
    assert [with_article(w) for w in ("int8", "fp8", "NVFP4", "mtp", "bf16", "medusa", "eagle3", 8, 18, 5)] == [
        "an int8", "an fp8", "an NVFP4", "an mtp", "a bf16", "a medusa", "an eagle3", "an 8", "an 18", "a 5"]


def test_an_empty_stop_string_is_one_line_before_the_model_loads(capsys, tiny_artifact, nothing_loads):
    one_error_line(*run_cli_here(capsys, "run", str(tiny_artifact), "--prompt", "hi", "--stop", "")[::2],
                   "--stop: an empty stop string")


@pytest.mark.parametrize("body, param, needle", [
    ({"stop": ""}, "stop", "must not be empty"),
    ({"top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
    ({"tool_choice": "required"}, "tool_choice", "'required' needs tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", "needs tools"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "what is it?"},
                                                {"type": "image_url", "image_url": {"url": "data:,"}}]}]},
     "messages.0.content", "images, audio and files are not supported"),
])
def test_request_errors_name_their_param(body, param, needle):
    """The 400's `param` names the field (null before for request-wide checks); an image says images are refused."""
    from pydantic import ValidationError

    from speccompile.serve.api_errors import validation_param
    from speccompile.serve.schemas import ChatCompletionRequest

    with pytest.raises(ValidationError) as caught:
        ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], **body})
    first = caught.value.errors()[0]
    assert validation_param(first) == param and needle in first["msg"], first


def test_piped_progress_lines_are_not_wrapped(capsys):
    """train-draft's (every command's) progress lines on a piped stderr: one line each, however long."""
    from speccompile.console import progress_printer

    message = "step 10/100: loss 2.345, 1234 tokens/s, the features of the target cached in heads/smollm2_eagle3/.cache. " * 2
    progress_printer(False)(message.strip())
    assert capsys.readouterr().err == f"· {message.strip()}\n"
