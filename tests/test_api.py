"""The README's Python API example runs as written (on a tiny artifact instead of exported/smollm2)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def python_api_example() -> str:
    text = README.read_text()
    section = text[text.index("## Python API"):]
    match = re.search(r"```python\n(.*?)```", section, flags=re.S)
    assert match, "README's Python API section has no python example"
    return match.group(1)


def test_readme_python_example_runs(tiny_artifact, capsys):
    code = python_api_example()
    assert '"exported/smollm2"' in code  # it opens what the README's first command writes
    exec(compile(code.replace('"exported/smollm2"', repr(str(tiny_artifact))), "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert "tokens per target pass" in printed and "tok/s" in printed


def test_stream_yields_what_generate_returns(tiny_artifact):
    from speccompile.runtime import Runner, RunOptions

    runner = Runner(tiny_artifact, RunOptions(drafter="ngram", threads=1))
    prompt = "the cat sat on the mat. the cat sat on the"
    stream = runner.stream(prompt, chat=False, max_tokens=30)
    deltas = list(stream)
    whole = runner.generate(prompt, chat=False, max_tokens=30)
    assert "".join(deltas) == stream.result.text == whole.text and stream.result.tokens == whole.tokens


def test_generation_steps_by_hand_equal_generate(tiny_artifact):
    from speccompile.runtime import GenerationConfig, Runner

    runner = Runner(tiny_artifact, drafter="ngram", threads=1, adaptive=False)
    ids = runner.artifact.tokenizer.prompt_ids("abc abc abc abc abc", chat=False)
    generation = runner.generator().start(ids, GenerationConfig(max_tokens=25, num_draft_tokens=runner.num_draft_tokens, adaptive=False))
    steps = 0
    while not generation.done:
        generation.step()
        steps += 1
    assert generation.result().tokens == runner.generate_ids(ids, 25).tokens and steps < 24  # drafts were accepted


def test_run_options_are_validated():
    from speccompile.errors import InputError
    from speccompile.runtime import RunOptions

    with pytest.raises(InputError, match="backend"):
        RunOptions(backend="gpu").validate()
    with pytest.raises(InputError, match="drafter"):
        RunOptions(drafter="magic").validate()


def test_one_drafter_serves_every_sampling_setting_and_seed(tiny_artifact, tiny_artifact_with_draft):
    from speccompile.runtime import Runner, SamplingParams

    for artifact, kind in ((tiny_artifact, "ngram"), (tiny_artifact_with_draft, "draft-model")):
        runner = Runner(artifact, drafter=kind, threads=1)
        drafter = runner.drafter()
        for seed in range(3):
            runner.generate("abc abc", chat=False, max_tokens=4, sampling=SamplingParams(0.7, seed=seed))
        runner.generate("abc abc", chat=False, max_tokens=4, sampling=SamplingParams(0.9))
        assert runner.drafter() is drafter is runner.generator(SamplingParams(0.9, seed=5)).drafter
