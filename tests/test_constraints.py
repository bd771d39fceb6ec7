"""The constraint interface and its xgrammar implementation on a character-level tokenizer (one token per char)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import CHARS, SPECIAL, TINY_VOCAB, write_char_tokenizer
from speccompile.errors import InputError
from speccompile.runtime.constraints import ConstraintSpec, mask_logits
from speccompile.runtime.grammar import GrammarCompiler
from speccompile.tokenizer import vocabulary_kind

MODEL_VOCAB = TINY_VOCAB + 8  # logits wider than the tokenizer, as padded lm_heads are
EOS = SPECIAL.index("</s>")


@pytest.fixture(scope="module")
def compiler(tmp_path_factory) -> GrammarCompiler:
    folder = tmp_path_factory.mktemp("chartok")
    write_char_tokenizer(folder)
    return GrammarCompiler(folder, MODEL_VOCAB, [EOS])


def ids(text: str) -> list[int]:
    return [len(SPECIAL) + CHARS.index(c) for c in text]


def walk(compiler: GrammarCompiler, spec: ConstraintSpec, text: str):
    """Feed `text` char by char, checking each is in the mask before it; returns the state after it."""
    state = compiler.compile(spec).new_state()
    for token in ids(text):
        allowed = state.allowed_tokens()
        assert allowed.shape == (MODEL_VOCAB,) and allowed.dtype == bool
        assert allowed[token], f"{CHARS[token - len(SPECIAL)]!r} refused after a prefix of {text!r}"
        assert not allowed[TINY_VOCAB:].any()  # ids past the tokenizer are never allowed
        assert state.advance([token]) == 1
    return state


SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["name", "n"], "additionalProperties": False}


@pytest.mark.parametrize("spec, text", [
    (ConstraintSpec.json_schema(SCHEMA), '{"name": "ab", "n": 12}'),
    (ConstraintSpec("json_object"), '{"x": [1, 2]}'),
    (ConstraintSpec("regex", r"[a-c]{2}\d"), "bc7"),
    (ConstraintSpec("grammar", 'root ::= "x" item+\nitem ::= "a" | "b"'), "xaba"),
    (ConstraintSpec.choice(["yes", "no"]), "no"),
])
def test_each_kind_accepts_its_text_and_then_only_the_stop_token(compiler, spec, text):
    state = walk(compiler, spec, text)
    if spec.kind != "grammar":  # item+ may go on
        assert np.flatnonzero(state.allowed_tokens()).tolist() == [EOS]
    assert not state.terminated
    assert state.advance([EOS]) == 1 and state.terminated


def test_schema_refuses_what_it_does_not_allow(compiler):
    state = walk(compiler, ConstraintSpec.json_schema(SCHEMA), '{"name": "ab", "n": ')
    assert not state.allowed_tokens()[ids('"')[0]]  # n is an integer
    strict = walk(compiler, ConstraintSpec.json_schema({**SCHEMA, "additionalProperties": True}, strict=False), "{")
    assert strict.allowed_tokens()[ids('"')[0]]


def test_advance_stops_at_the_first_refused_token_and_rollback_restores(compiler):
    state = compiler.compile(ConstraintSpec("regex", "abc")).new_state()
    before = state.allowed_tokens().copy()
    assert state.advance(ids("abx")) == 2  # x refused: the state is after "ab"
    assert np.flatnonzero(state.allowed_tokens()).tolist() == ids("c")
    state.rollback(2)
    assert np.array_equal(state.allowed_tokens(), before)
    assert state.advance(ids("abc")) == 3


@pytest.mark.parametrize("spec, message", [
    (ConstraintSpec("regex", "(ab"), "regex: "),
    (ConstraintSpec("grammar", "root ::= undefined_rule"), "grammar: "),
    (ConstraintSpec("json_schema", '{"type": "nonsense"}'), "json_schema: "),
    (ConstraintSpec("json_schema", '{"type": '), "json_schema: not valid JSON"),
    (ConstraintSpec("choice", ()), "choice: expected one or more"),
])
def test_bad_specs_are_one_line_input_errors(compiler, spec, message):
    with pytest.raises(InputError) as error:
        compiler.compile(spec)
    text = str(error.value)
    assert text.startswith(message) and "\n" not in text and ".cc:" not in text


def test_mask_logits_refuses_everything_outside_the_mask():
    logits = np.arange(6, dtype=np.float32)[None].repeat(2, 0)
    allowed = np.array([[True, False, True, False], [False, False, False, True]])  # narrower: ids 4, 5 refused
    masked = mask_logits(logits, allowed)
    assert masked.dtype == np.float32
    assert np.array_equal(np.isfinite(masked), [[1, 0, 1, 0, 0, 0], [0, 0, 0, 1, 0, 0]])
    assert masked[0, 2] == 2 and masked[1, 3] == 3


def test_vocabulary_kinds():
    assert vocabulary_kind({"decoder": {"type": "ByteLevel"}}) == ("BYTE_LEVEL", False)
    llama2 = {"normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"}]},
              "decoder": {"type": "Sequence", "decoders": [{"type": "Replace"}, {"type": "ByteFallback"}]}}
    assert vocabulary_kind(llama2) == ("BYTE_FALLBACK", True)
    assert vocabulary_kind({"decoder": {"type": "Fuse"}}) == ("RAW", False)
    assert json.loads(ConstraintSpec.json_schema(SCHEMA).value) == SCHEMA


def test_run_flags_constrain_the_output_and_refuse_bad_ones_in_one_line(tiny_artifact, tmp_path, capsys):
    from conftest import run_cli_here

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"c": {"enum": ["red", "blue"]}}, "required": ["c"]}))
    code, out, _ = run_cli_here(capsys, "run", str(tiny_artifact), "-p", "hi", "--raw", "--threads", "1", "--json-schema", str(schema), "--json")
    assert code == 0 and json.loads(json.loads(out)["text"])["c"] in ("red", "blue")
    code, out, _ = run_cli_here(capsys, "run", str(tiny_artifact), "-p", "hi", "--threads", "1", "--choice", "yes", "--choice", "no")
    assert code == 0 and out.strip() in ("yes", "no")
    (tmp_path / "bad.json").write_text('{"type": "nonsense"}')
    for args, message in [(["--json-schema", str(tmp_path / "bad.json")], f"--json-schema {tmp_path / 'bad.json'}: Unsupported type"),
                          (["--json-schema", str(tmp_path / "none.json")], "no such file"),
                          (["--regex", "(ab"], "--regex: Regex parsing error"),
                          (["--grammar", str(schema)], f"--grammar {schema}: "),
                          (["--regex", "a", "--choice", "b"], "give at most one of")]:
        code, _, err = run_cli_here(capsys, "run", str(tiny_artifact), "-p", "hi", *args)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
