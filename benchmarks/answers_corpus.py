#!/usr/bin/env python
"""An n-gram corpus (`--ngram-corpus`) from the model's own answers written by train_smollm2_head.py.

Those files hold one ChatML conversation per line ({"text": "<|im_start|>system ... <|im_start|>assistant\\n..."});
the corpus keeps the assistant part of each, one {"text"} line per answer. Their prompts are disjoint from
benchmarks/workloads/chat.jsonl, so a benchmark with this corpus measures answers the corpus has not seen.

  python benchmarks/answers_corpus.py SCRATCH/smollm2_answers_b505_160.jsonl SCRATCH/smollm2_answers_m540_160.jsonl \\
      SCRATCH/smollm2_answers_t435_160.jsonl --out answers_corpus.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

MARKER = "<|im_start|>assistant\n"


def assistant_texts(path: Path) -> list[str]:
    """The assistant turn of every conversation line in `path` (lines without one are skipped)."""
    texts = []
    for line in path.read_text().splitlines():
        if line.strip():
            text = json.loads(line)["text"]
            if MARKER in text:
                texts.append(text.split(MARKER, 1)[1])
    return texts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("answers", type=Path, nargs="+", help="answer files of train_smollm2_head.py")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    texts = [t for path in args.answers for t in assistant_texts(path)]
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    os.replace(tmp, args.out)
    print(f"{len(texts)} answers -> {args.out}")


if __name__ == "__main__":
    main()
