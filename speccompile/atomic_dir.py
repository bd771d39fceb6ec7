"""Write an output directory atomically: build it in a temporary sibling, rename it into place at the end."""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from .errors import InputError


def prepare_output(out: Path, force: bool) -> Path:
    """Check the output location and return a fresh temporary directory beside it."""
    if out.exists() and not force:
        raise InputError(f"--out {out}: already exists (use --force to replace it)")
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out}: exists and is not a directory")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        try:
            parent.mkdir(parents=True, exist_ok=True)  # like `mkdir -p`: users pass exported/NAME
        except OSError as exc:
            raise InputError(f"--out {out}: cannot create {parent} ({exc.strerror})") from None
    tmp = parent / f".{out.name}.tmp-{os.getpid()}"
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    except OSError as exc:
        raise InputError(f"--out {out}: cannot write there ({exc.strerror})") from None
    return tmp


def commit_output(tmp: Path, out: Path) -> None:
    """Move the finished temporary directory into place, replacing an old one (only with --force)."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def atomic_output(out: Path, force: bool) -> Iterator[Path]:
    """Yield a temporary directory beside `out`; on success it replaces `out`, on any error it is removed."""
    tmp = prepare_output(out, force)
    try:
        yield tmp
        commit_output(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

