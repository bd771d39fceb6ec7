"""`speccompile train-draft`: train an EAGLE-3 / EAGLE / Medusa head or a DFlash drafter for a target by self-distillation."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("train-draft")
@click.argument("target")
@click.option("--method", type=click.Choice(["eagle3", "eagle", "medusa", "dflash"]), default="eagle3", show_default=True, help="Head type to train.")
@click.option("--data", "data", type=click.Path(path_type=Path), multiple=True, required=True, help="Text file, JSONL ({\"text\"} or {\"prompt\",\"response\"}) or directory (repeatable).")
@click.option("--out", "out", type=click.Path(path_type=Path), required=True, help="Folder for the head (config.json + model.safetensors).")
@click.option("--steps", type=int, default=200, show_default=True, help="Optimizer steps.")
@click.option("--seq-len", type=int, default=256, show_default=True, help="Tokens per training sequence.")
@click.option("--batch", type=int, default=4, show_default=True, help="Sequences per step.")
@click.option("--lr", type=float, default=1e-3, show_default=True, help="Peak learning rate (warmup, then cosine to 10%).")
@click.option("--unroll", type=int, default=None, help="Draft steps unrolled per position [default: 3 eagle3, 2 eagle, 1 medusa].")
@click.option("--draft-vocab", type=int, default=None, help="EAGLE-3 draft vocabulary size [default: min(vocab, 8192)].")
@click.option("--medusa-heads", type=int, default=3, show_default=True, help="Number of Medusa heads.")
@click.option("--block-size", type=int, default=8, show_default=True, help="DFlash block (block-size - 1 drafts per pass).")
@click.option("--max-tokens", type=int, default=200_000, show_default=True, help="Most training tokens read from --data.")
@click.option("--save-every", type=int, default=50, show_default=True, help="Checkpoint every N steps.")
@click.option("--resume", is_flag=True, help="Continue the run saved in --out.")
@click.option("--force", is_flag=True, help="Start over in an --out folder holding an earlier train-draft run (its checkpoint is replaced; "
              "its cached target features are reused). Folders holding other files are never touched.")
@click.option("--seed", type=int, default=0, show_default=True, help="Random seed for the head's initial weights and the order of training batches.")
@click.option("--threads", type=int, default=None, help="torch intra-op threads.")
@click.option("--json", "as_json", is_flag=True, help="Print the training summary as JSON.")
def train_draft(target, method, data, out, steps, seq_len, batch, lr, unroll, draft_vocab, medusa_heads, block_size, max_tokens, save_every, resume, force, seed, threads, as_json):
    """Self-distil a drafter head for TARGET (HF folder, .gguf or alias): the target's hidden states are the
    inputs and its next-token distributions the labels. Writes the published layout `--drafter KIND:OUT` reads."""
    from ..console import emit_json, progress_printer
    from ..training.options import TrainOptions
    from ..training.trainer import train_draft as run

    options = TrainOptions(method=method, steps=steps, seq_len=seq_len, batch=batch, lr=lr, unroll=unroll,
                           draft_vocab=draft_vocab, medusa_heads=medusa_heads, block_size=block_size, max_tokens=max_tokens,
                           save_every=save_every, resume=resume, force=force, seed=seed, threads=threads)
    printer = progress_printer(as_json)
    last = {"t": 0.0}

    def progress(message: str) -> None:  # throttle per-step lines to ~1/s
        import time

        now = time.time()
        if message.startswith(("step ", "target features")) and now - last["t"] < 1.0 and "/" in message:
            done, _, total = message.split()[1 if message.startswith("step") else 2].partition("/")
            if done != total:
                return
        last["t"] = now
        printer(message)

    summary = run(target, list(data), out, options, progress)
    if as_json:
        emit_json(summary)
    else:
        click.echo(f"trained {method} head: {summary['steps']} steps on {summary['train_tokens']} tokens "
                   f"({summary['train_seconds']:.0f}s training, {summary['feature_seconds']:.0f}s target features) -> {out}")


COMMANDS = [train_draft]
