"""Train an EAGLE-3 (or EAGLE / Medusa) head for SmolLM2-135M-Instruct on text available offline.

Data = (1) SmolLM2's own greedy chat answers to a set of training prompts (self-distillation on the
distribution it will be asked to draft; the prompts do not overlap benchmarks/workloads/chat.jsonl),
rendered with its ChatML template, plus (2) documentation and source of installed Python packages.
Weights go to /work/scratch_heads (never committed).

    python benchmarks/train_smollm2_head.py --steps 400 [--method eagle3] [--answers 80]

Needs the fp32 SmolLM2 artifact (`speccompile export smollm2-135m --out /tmp/smol`) for fast answer
generation. Prints the training summary (time, tokens) as JSON at the end.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

TOPICS = [
    "a cat who learns to swim", "a lost key", "the moon and a fisherman", "a city made of glass", "a shy giant",
    "a clockmaker's apprentice", "the last tree on a hill", "a friendly ghost", "a journey across the desert",
    "a girl who talks to birds", "a snowman in summer", "a pirate who hates water", "a library at midnight",
    "an old violin", "two rival chefs", "a kite that flies to space", "a village without music", "a brave mouse",
]
FORMS = ["Write a short story about {}.", "Write a poem about {}.", "Tell a bedtime story about {}.", "Describe {} in a few sentences."]
QUESTIONS = [
    "Explain how a rainbow forms.", "What is photosynthesis?", "How do vaccines work?", "Why is the sky blue?",
    "Explain what a neural network is to a child.", "What are the benefits of regular exercise?",
    "Give me three tips for learning a new language.", "How does a refrigerator keep food cold?",
    "What is the difference between weather and climate?", "Explain the water cycle.",
    "Write a Python function that reverses a string.", "Write a Python function to check if a number is prime.",
    "How do I make a cup of tea?", "What causes earthquakes?", "Summarize the plot of a typical fairy tale.",
    "What is the capital of France and what is it famous for?", "Explain recursion with an example.",
    "Give me a recipe for pancakes.", "What should I pack for a weekend camping trip?", "How do bees make honey?",
    "Write an email asking a colleague for help with a report.", "List five fun facts about octopuses.",
]


def training_prompts(n: int) -> list[str]:
    prompts = [f.format(t) for t in TOPICS for f in FORMS] + QUESTIONS
    prompts = sorted(set(prompts), key=lambda p: (hash(p) % 997, p))
    return prompts[:n]


def generate_answers(artifact: Path, prompts: list[str], out: Path, max_tokens: int, threads: int = 1) -> Path:
    from speccompile.runtime.session import Runner

    runner = Runner(artifact, drafter="none", threads=threads)
    tok = runner.artifact.tokenizer
    lines = []
    started = time.time()
    for i, prompt in enumerate(prompts):
        ids = tok.prompt_ids(prompt, True)
        res = runner.generate_ids(ids, max_tokens, drafter="none")
        text = tok.decode(ids + res.tokens, skip_special_tokens=False)
        lines.append(json.dumps({"text": text}))
        print(f"answers {i + 1}/{len(prompts)} ({time.time() - started:.0f}s)", flush=True)
    out.write_text("\n".join(lines) + "\n")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifact", default="/tmp/smol")
    ap.add_argument("--method", default="eagle3", choices=["eagle3", "eagle", "medusa"])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--answers", type=int, default=80, help="chat prompts answered by the target for self-distillation")
    ap.add_argument("--answer-tokens", type=int, default=160)
    ap.add_argument("--docs-tokens", type=int, default=60_000, help="cap on documentation/source text tokens")
    ap.add_argument("--out", default="/work/scratch_heads/smollm2_{method}")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()

    from speccompile.training.trainer import TrainOptions, train_draft

    scratch = Path("/work/scratch_heads")
    scratch.mkdir(parents=True, exist_ok=True)
    answers = scratch / f"smollm2_answers_{args.answers}.jsonl"
    if not answers.is_file():
        generate_answers(Path(args.artifact), training_prompts(args.answers), answers, args.answer_tokens, args.threads)
    # documentation + source of installed packages (real text on this machine)
    import click
    import jinja2

    docs = scratch / "docs_text.jsonl"
    if not docs.is_file():
        lines = []
        for pkg in (click, jinja2):
            for f in sorted(Path(pkg.__file__).parent.rglob("*.py")):
                lines.append(json.dumps({"text": f.read_text(errors="ignore")}))
        docs.write_text("\n".join(lines) + "\n")
    out = Path(args.out.format(method=args.method))
    # answers first (the workload's distribution), then docs/source up to the token cap
    n_answer_tokens = args.answers * (args.answer_tokens + 40)
    options = TrainOptions(method=args.method, steps=args.steps, batch=args.batch, seq_len=args.seq_len, lr=1e-3,
                           warmup=min(30, args.steps // 10 + 1), max_tokens=n_answer_tokens + args.docs_tokens,
                           save_every=50, resume=args.resume, threads=args.threads)
    summary = train_draft("smollm2-135m", [answers, docs], out, options, progress=lambda m: print(m, flush=True))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
