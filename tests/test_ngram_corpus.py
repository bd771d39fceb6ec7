"""The n-gram corpus fallback of prompt lookup (`--ngram-corpus`): proposals, exactness, bad input."""

from __future__ import annotations

import json

import pytest

from speccompile.errors import InputError
from speccompile.runtime.drafters.ngram import NgramDrafter
from speccompile.runtime.drafters.ngram_corpus import NgramCorpus
from speccompile.runtime.generate import GenerationConfig
from speccompile.runtime.session import Runner

from conftest import run_cli
from test_runtime import PROMPTS, _clean_error


def test_corpus_walks_the_most_frequent_continuation_longest_context_first():
    corpus = NgramCorpus([[1, 2, 3, 4, 5, 9], [7, 2, 3, 4, 5], [8, 2, 3, 4, 6], [1, 2, 3, 9, 9]])
    assert corpus.tokens == 21
    # (2, 3) -> 4 three times of four; (3, 4) -> 5 twice of three; (4, 5) -> 9; (5, 9) unknown: stop
    assert corpus.continue_from([0, 2, 3], 10) == ([4, 5, 9], 2)
    assert corpus.continue_from([1, 2, 3], 10) == ([4, 5, 9], 3)  # (1, 2, 3) -> 4 once, 9 once: first seen wins
    assert corpus.continue_from([0, 2, 3], 2) == ([4, 5], 2)
    assert corpus.continue_from([5, 5], 4) == ([], 0)


def test_drafter_uses_the_corpus_only_without_a_match_in_the_history():
    corpus = NgramCorpus([[10, 11, 12, 13, 14]])
    drafter = NgramDrafter(min_match=2, corpus=corpus)
    draft = drafter.lookup([1, 2, 3, 10, 11], 3)
    assert draft.tokens == [12, 13, 14] and draft.key == -2
    draft = drafter.lookup([10, 11, 5, 6, 10, 11], 3)
    assert draft.tokens == [5, 6, 10] and draft.key == 2
    assert NgramDrafter(min_match=2).lookup([1, 2, 3, 10, 11], 3).tokens == []


def test_greedy_output_is_unchanged_with_corpus_drafts(tiny_artifact, tmp_path):
    runner = Runner(tiny_artifact, drafter="ngram", threads=1)
    # the corpus: the model's own greedy continuations of other texts
    answers = [runner.generate(text, chat=False, max_tokens=48, drafter="none").text for text in ("zebra", "quiet", "mm")]
    path = tmp_path / "answers.jsonl"
    path.write_text("".join(json.dumps({"text": a}) + "\n" for a in answers))
    runner = Runner(tiny_artifact, drafter="ngram", threads=1, ngram_corpus=path)
    corpus_drafts = []
    walk = runner.ngram_corpus.continue_from
    runner.ngram_corpus.continue_from = lambda history, k: corpus_drafts.append(walk(history, k)) or corpus_drafts[-1]
    generator = runner.generator(plain=True)
    generator.drafter = NgramDrafter(min_match=3, corpus=runner.ngram_corpus)  # history matches are rarer: the corpus speaks
    for prompt in PROMPTS:
        ids = runner.artifact.tokenizer.prompt_ids(prompt, chat=False)
        plain = runner.generate_ids(ids, 40, drafter="none")
        spec = generator.generate(ids, GenerationConfig(max_tokens=40, num_draft_tokens=6, adaptive=False))
        assert spec.tokens == plain.tokens, prompt
    assert any(tokens for tokens, _ in corpus_drafts)  # corpus proposals were really verified


def test_corpus_bad_input(tiny_artifact, tiny_artifact_with_draft, tmp_path):
    missing = tmp_path / "nope.jsonl"
    _clean_error(run_cli("run", str(tiny_artifact), "--prompt", "abc", "--drafter", "ngram", "--ngram-corpus", str(missing)), "nope.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"prompt": "no text"}\n')
    with pytest.raises(InputError, match="line 2"):
        Runner(tiny_artifact, drafter="ngram", threads=1, ngram_corpus=bad)
    empty = tmp_path / "empty.txt"
    empty.write_text("a")
    with pytest.raises(InputError, match="no text to learn from"):
        Runner(tiny_artifact, drafter="ngram", threads=1, ngram_corpus=empty)
    text = tmp_path / "corpus.txt"
    text.write_text("the cat sat on the mat " * 5)
    _clean_error(run_cli("run", str(tiny_artifact_with_draft), "--prompt", "abc", "--drafter", "draft-model", "--ngram-corpus", str(text)),
                 "--ngram-corpus")
    assert Runner(tiny_artifact, drafter="ngram", threads=1, ngram_corpus=text).ngram_corpus.tokens > 0
