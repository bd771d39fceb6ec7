"""Terminal output shared by every command: the stderr console, reports and JSON on stdout, progress lines."""

from __future__ import annotations

import json
from contextlib import contextmanager
from typing import Callable, Iterator

import click


UNWRAPPED = 1 << 14  # the width of a console that is not a terminal: lines are never broken


def console(stderr: bool = True):
    """A rich console on stderr (progress, messages) or stdout (reports). On a terminal it wraps at the terminal's
    width; piped or redirected it never wraps (rich's 80 columns would break "vocab 49152" and progress lines
    mid-phrase for whatever reads them)."""
    from rich.console import Console

    out = Console(stderr=stderr, highlight=False)
    return out if out.is_terminal else Console(stderr=stderr, highlight=False, width=UNWRAPPED, soft_wrap=True)


def report_console():
    """The stdout console a command prints its report on (`console(stderr=False)`)."""
    return console(stderr=False)


def progress_bar_console(quiet: bool):
    """The stderr console for a progress bar: None (no bar) when `quiet` (--json) or stderr is not a terminal."""
    out = console()
    return None if quiet or not out.is_terminal else out


@contextmanager
def prompt_progress_bar(out) -> Iterator[Callable[[str, int, int], None] | None]:
    """A progress callback (label, done, total) drawing a bar of prompts on console `out` (removed when finished);
    None without a console (`progress_bar_console`)."""
    if out is None:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=out, transient=True) as bar:
        task = None

        def progress(label: str, done: int, total: int) -> None:
            nonlocal task
            if task is None:
                task = bar.add_task(label, total=total)
            bar.update(task, description=label or "done", completed=done, total=total, refresh=True)

        yield progress


def progress_printer(quiet: bool) -> Callable[[str], None]:
    """A callback printing one dim progress line per message on stderr (silent when `quiet`)."""
    out = console()

    def progress(message: str) -> None:
        if not quiet:
            out.print(f"[dim]·[/dim] {message}")

    return progress


def emit_json(data) -> None:
    """Print one JSON object on stdout."""
    click.echo(json.dumps(data, indent=2, default=str))
