"""Library errors speak in API terms (the argument's name, recorded in `fields`); the CLI names the running
command's flag for each field instead (errors.py, cli.flag_message). One case per library part that used to word
its errors as CLI flags: export/, atomic_dir, models/, accel/, draft_config, evaluation, serve/, tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import run_cli_here
from speccompile.errors import InputError, SpecCompileError


def _api_error(call) -> SpecCompileError:
    with pytest.raises(SpecCompileError) as caught:
        call()
    return caught.value


def _export_options(**changed):
    from speccompile.export.pipeline import ExportOptions

    return ExportOptions(**changed)


def _cases(tmp_path: Path, tiny_model_dir: Path, tiny_artifact: Path):
    """(command whose flags name the fields, a call that fails, the API message's start, the CLI message's start)."""
    from speccompile.accel.profiles import profiles_for
    from speccompile.atomic_dir import check_artifact_output
    from speccompile.draft_config import DraftConfig
    from speccompile.evaluation import EvalOptions, load_text_set
    from speccompile.export.drafters import parse_drafter
    from speccompile.export.pipeline import export_artifact
    from speccompile.models.head_loaders import load_head
    from speccompile.serve.engine import EngineOptions
    from speccompile.tokenizer import TextTokenizer

    missing = tmp_path / "missing"
    return [
        ("export", lambda: export_artifact(str(tiny_model_dir), tmp_path / "o", _export_options(dtype="fp64")),
         "dtype must be one of", "--dtype must be one of"),
        ("export", lambda: export_artifact(str(tiny_model_dir), tmp_path / "o", _export_options(max_context=1)),
         "max_context must be >= 2, got 1", "--max-context must be >= 2, got 1"),
        ("export", lambda: parse_drafter("eagle"), "drafter eagle needs a path", "--drafter eagle needs a path"),
        ("export", lambda: export_artifact(str(tiny_model_dir), tmp_path / "o", _export_options(drafter="ngram", tree="eagle-default")),
         "tree: only head drafters (drafter ", "--tree: only head drafters (--drafter "),
        ("export", lambda: check_artifact_output(tiny_artifact, force=False),
         f"out {tiny_artifact}: already exists (pass force to replace it)",
         f"--out {tiny_artifact}: already exists (pass --force to replace it)"),
        ("export", lambda: load_head("eagle", missing, None, {}), f"drafter eagle:{missing}: no such file",
         f"--drafter eagle:{missing}: no such file"),
        ("run", lambda: DraftConfig.parse("ngram", "eagle-default"), "tree: the ngram drafter drafts chains",
         "--tree: the ngram drafter drafts chains"),
        ("run", lambda: DraftConfig.parse("eagle", None, -1), "num_draft_tokens must be >= 0, got -1",
         "--num-draft-tokens must be >= 0, got -1"),
        ("run", lambda: TextTokenizer(tiny_artifact).prompt_ids("", chat=False), "prompt: the prompt is empty",
         "--prompt: the prompt is empty"),
        ("build", lambda: profiles_for(None, {}, "dynamic"), "profiles must be one of", "--profiles must be one of"),
        ("eval", lambda: EvalOptions(max_text_tokens=1).validate(), "max_text_tokens must be >= 2, got 1",
         "--max-text-tokens must be >= 2, got 1"),
        ("eval", lambda: load_text_set(missing), f"text {missing}: no such file", f"--text {missing}: no such file"),
        ("serve", lambda: EngineOptions(artifact=tiny_artifact, max_queue=-1).validate(), "max_queue must be >= 0, got -1",
         "--max-queue must be >= 0, got -1"),
        ("serve", lambda: EngineOptions(artifact=tiny_artifact, engine_nice=20).validate(), "engine_nice must be in 0..19",
         "--engine-nice must be in 0..19"),
    ]


def test_library_errors_name_api_fields_and_the_cli_names_its_flags(tmp_path, tiny_model_dir, tiny_artifact):
    from speccompile.cli import cli, flag_message

    for command, call, api, flagged in _cases(tmp_path, tiny_model_dir, tiny_artifact):
        error = _api_error(call)
        message = str(error)
        assert message.startswith(api) and "--" not in message, message
        assert error.fields, message
        assert flag_message(error, cli.commands[command]).startswith(flagged), (command, message)
    assert not (tmp_path / "o").exists()  # every export refused before it wrote anything


def test_the_command_line_prints_the_flag_spelling(capsys, tmp_path, tiny_artifact):
    text = tmp_path / "empty.txt"
    text.write_text("\n\n")
    code, _, err = run_cli_here(capsys, "eval", str(tiny_artifact), "--reference", str(tiny_artifact), "--limit", "0")
    assert code == 2 and err.strip() == "error: --limit must be >= 1, got 0", err
    code, _, err = run_cli_here(capsys, "eval", str(tiny_artifact), "--reference", str(tiny_artifact), "--text", str(text))
    assert code == 2 and err.strip() == f"error: --text {text}: the file has no text", err
    code, _, err = run_cli_here(capsys, "serve", str(tiny_artifact), "--engine-nice", "20")
    assert code == 2 and err.strip() == "error: --engine-nice must be in 0..19, got 20", err


def test_a_field_is_named_once_where_the_message_starts(tmp_path):
    """naming() spells the first occurrence only: a path that contains the field's word is left alone."""
    from speccompile.atomic_dir import check_replaceable

    out = tmp_path / "out"
    (out / "x").mkdir(parents=True)
    error = _api_error(lambda: check_replaceable(out, True, lambda _: False, "a thing"))
    assert isinstance(error, InputError) and error.fields == ("out", "force")
    named = error.naming({"out": "--out", "force": "--force"})
    assert named.startswith(f"--out {out}: is neither a thing nor empty, and --force replaces only those")
