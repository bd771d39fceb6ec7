"""An n-gram corpus for prompt lookup: what usually follows the last 3 (or 2) tokens in a body of text.

Prompt lookup finds nothing to copy in open chat. A corpus of the model's own earlier answers (logs of a
deployment, or answers to other prompts) does: chat models repeat their phrasing ("Here are some tips
to ...", list markup, closing lines). For every 3- and 2-token context the corpus keeps its most frequent
next token; a proposal walks that table greedily from the end of the history, preferring the longer
context, until no context is known. Proposals are deterministic (one-hot q), so verification stays exact.

Corpus files: JSONL with a "text" string per line, or any other file read as one text. Texts are
tokenized with the artifact's tokenizer, without special tokens.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Iterable, Sequence

from ...errors import InputError

CONTEXT_LENGTHS = (3, 2)  # longest first


class NgramCorpus:
    """Most frequent continuation of each 3- and 2-token context of a corpus of token sequences."""

    def __init__(self, sequences: Iterable[Sequence[int]]):
        counts: dict[int, defaultdict] = {n: defaultdict(Counter) for n in CONTEXT_LENGTHS}
        self.tokens = 0
        for seq in sequences:
            seq = list(seq)
            self.tokens += len(seq)
            for n in CONTEXT_LENGTHS:
                for i in range(n, len(seq)):
                    counts[n][tuple(seq[i - n: i])][seq[i]] += 1
        self.next_token = {n: {ctx: c.most_common(1)[0][0] for ctx, c in counts[n].items()} for n in CONTEXT_LENGTHS}

    @staticmethod
    def check_file(path: str | Path) -> Path:
        """The corpus file's path; InputError when it is not a readable file (checked before anything loads)."""
        path = Path(path)
        if not path.is_file():
            raise InputError(f"ngram_corpus {path}: no such file", "ngram_corpus")
        return path

    @classmethod
    def from_file(cls, path: str | Path, tokenizer) -> "NgramCorpus":
        """Read and tokenize a corpus file (JSONL of {"text": ...}, or plain text)."""
        path = cls.check_file(path)
        raw = path.read_text(encoding="utf-8", errors="replace")
        if path.suffix == ".jsonl":
            texts = []
            for number, line in enumerate(raw.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)["text"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise InputError(f"ngram_corpus {path}: line {number} is not a JSON object with a 'text'", "ngram_corpus") from None
                if not isinstance(text, str):
                    raise InputError(f"ngram_corpus {path}: line {number}: 'text' is not a string", "ngram_corpus")
                texts.append(text)
        else:
            texts = [raw]
        corpus = cls(tokenizer.encode(text) for text in texts if text.strip())
        if not corpus.next_token[CONTEXT_LENGTHS[-1]]:
            raise InputError(f"ngram_corpus {path}: no text to learn from (needs at least {CONTEXT_LENGTHS[-1] + 1} tokens)",
                             "ngram_corpus")
        return corpus

    def continue_from(self, history: Sequence[int], k: int) -> tuple[list[int], int]:
        """Up to k tokens that usually follow `history`, and the context length of the first one (0: none)."""
        walk = list(history[-max(CONTEXT_LENGTHS):])
        proposal: list[int] = []
        first_context = 0
        while len(proposal) < k:
            for n in CONTEXT_LENGTHS:
                token = self.next_token[n].get(tuple(walk[-n:])) if len(walk) >= n else None
                if token is not None:
                    break
            else:
                break
            first_context = first_context or n
            proposal.append(token)
            walk.append(token)
        return proposal, first_context
