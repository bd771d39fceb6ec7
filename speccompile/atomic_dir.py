"""Safe output directories: what `force` may replace, atomic writes, cleanup on SIGTERM, file modes.

Export and build write into a temporary sibling `.NAME.tmp-PID` and rename it into place at the end;
any error, Ctrl-C or SIGTERM removes it, and temporary siblings left by processes that no longer exist
(killed with SIGKILL, power loss) are removed by the next write to the same place. `force` replaces
only a folder the command itself would have written (an artifact directory, a train-draft head folder)
or an empty one, and there only the files it wrote (those its manifest lists): never a user's own files.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from .errors import InputError

TEMP_TAG = ".tmp-"  # .NAME.tmp-PID: the directory being written
OLD_TAG = ".old-"  # .NAME.old-PID: the directory being replaced, for the moment of the swap


class Terminated(SystemExit):
    """Raised in the main thread on SIGTERM so cleanup runs as on Ctrl-C; exits with 128 + SIGTERM."""

    def __init__(self) -> None:
        super().__init__(128 + signal.SIGTERM)


_sigterm_received = threading.Event()


def sigterm_received() -> bool:
    """True once SIGTERM arrived under `terminate_as_interrupt`: a library that caught the `Terminated` raised
    inside it (a native loader wrapping it in its own error) still ends the command as terminated."""
    return _sigterm_received.is_set()


@contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """While active, SIGTERM raises `Terminated` (so `finally`/`except` blocks clean up) instead of killing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_sigterm(signum, frame) -> None:
        _sigterm_received.set()
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


def check_replaceable(out: Path, force: bool, is_ours: Callable[[Path], bool], what: str) -> None:
    """Refuse (InputError about `out` and `force`, nothing touched) unless `out` is new, or `force` is given and
    `out` is `what` or an empty folder."""
    if not out.exists() and not out.is_symlink():
        return
    if not out.is_dir():
        raise InputError(f"out {out}: exists and is not a directory (force replaces only {what} or an empty folder)",
                         ("out", "force"))
    if not is_empty_dir(out) and not is_ours(out):
        raise InputError(f"out {out}: is neither {what} nor empty, and force replaces only those "
                         "(choose another folder, or remove it yourself)", ("out", "force"))
    if not force:
        raise InputError(f"out {out}: already exists (pass force to replace it)", ("out", "force"))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def remove_stale_temps(out: Path) -> list[Path]:
    """Remove `.NAME.tmp-PID` siblings of `out` whose process is gone (and `.NAME.old-PID` once `out` exists)."""
    removed = []
    if not out.parent.is_dir():
        return removed
    for entry in out.parent.iterdir():
        for tag in (TEMP_TAG, OLD_TAG):
            prefix = f".{out.name}{tag}"
            if not entry.name.startswith(prefix):
                continue
            pid = entry.name[len(prefix):]
            if not pid.isdigit() or int(pid) == os.getpid() or _pid_alive(int(pid)):
                continue
            if tag == OLD_TAG and not out.exists():
                continue  # the swap was cut short: this is the only copy of the old output, keep it
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed


def current_umask() -> int:
    """The process umask (read without changing it where /proc allows)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def honour_umask(root: Path) -> None:
    """Give every file and folder under `root` the mode a plain `open`/`mkdir` would (some writers use 0600)."""
    mask = current_umask()
    for folder, _dirs, files in os.walk(root):
        os.chmod(folder, 0o777 & ~mask)
        for name in files:
            path = os.path.join(folder, name)
            if os.path.islink(path):
                continue
            executable = os.stat(path).st_mode & 0o111
            os.chmod(path, (0o777 if executable else 0o666) & ~mask)


def _make_parent(out: Path) -> list[Path]:
    """`mkdir -p` the parent of `out`; returns the folders it created (to remove on failure)."""
    missing = []
    parent = out.parent
    while not parent.exists():
        missing.append(parent)
        parent = parent.parent
    for folder in reversed(missing):
        try:
            folder.mkdir()
        except OSError as exc:
            raise InputError(f"out {out}: cannot create {folder} ({exc.strerror})", "out") from None
    return missing


def _remove_if_empty(folders: list[Path]) -> None:
    for folder in folders:  # deepest first
        try:
            folder.rmdir()
        except OSError:
            return


def carry_user_files(out: Path, tmp: Path, ours: set[str]) -> None:
    """Link every file in `out` that speccompile did not write (not in `ours`, relative paths) into `tmp` at the
    same place, so replacing `out` by `tmp` keeps it; refuse (InputError, nothing moved) where `tmp` writes a
    file of that name. Hard links: the user's file is never copied, moved or left with one name only in `tmp`."""
    for folder, dirs, files in os.walk(out):
        here = Path(folder).relative_to(out)
        for name in files + [d for d in dirs if (Path(folder) / d).is_symlink()]:
            relative = here / name
            if str(relative) in ours:
                continue
            target = tmp / relative
            if target.exists() or target.is_symlink():
                raise InputError(f"out {out}: {relative} is not one of the files speccompile wrote there, and the new "
                                 "output writes one of that name (move yours away)", ("out", "force"))
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(out / relative, target, follow_symlinks=False)
            except OSError:  # a filesystem without hard links
                shutil.copy2(out / relative, target, follow_symlinks=False)


def commit_output(tmp: Path, out: Path, ours: Callable[[Path], set[str]] | None = None) -> None:
    """Move the finished temporary directory into place, replacing an old one (checked by check_replaceable);
    `ours`: the files speccompile wrote in the old one, the others are kept (carry_user_files)."""
    old = None
    if ours is not None and out.is_dir() and not out.is_symlink():
        carry_user_files(out, tmp, ours(out))
    if out.exists() or out.is_symlink():
        old = out.parent / f".{out.name}{OLD_TAG}{os.getpid()}"
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        if old.is_symlink():
            old.unlink()
        else:
            shutil.rmtree(old, ignore_errors=True)


FULL = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is used up", errno.EFBIG: "a file grew too large"}


def write_failure(exc: OSError, out: Path, tmp: Path) -> InputError | None:
    """The one-line error for an OSError met while writing `out` (into its temporary folder `tmp`): a full disk
    or quota, or any failure on a file inside `tmp`; None for another file (a source being read)."""
    name = os.path.abspath(os.fsdecode(exc.filename)) if isinstance(exc.filename, (str, bytes, os.PathLike)) else None
    inside = name is not None and Path(name).is_relative_to(tmp)
    if exc.errno not in FULL and not inside:
        return None
    reason = exc.strerror or type(exc).__name__
    reason = f"{FULL[exc.errno]} ({reason})" if exc.errno in FULL else reason
    where = f" while writing {Path(name).relative_to(tmp)}" if inside and name != str(tmp) else ""
    return InputError(f"out {out}: {reason}{where}; nothing was written there (its temporary folder is removed)", "out")


ARTIFACT_DIR = "an artifact directory (one with a speccompile manifest.json)"


def is_artifact_dir(path: Path) -> bool:
    from .manifest import is_manifest_dir

    return is_manifest_dir(path)


def artifact_files(path: Path) -> set[str]:
    from .manifest import written_files

    return written_files(path)


def check_artifact_output(out: Path, force: bool) -> None:
    """check_replaceable for an artifact directory: what export and build check before they start."""
    check_replaceable(Path(os.path.abspath(out)), force, is_artifact_dir, ARTIFACT_DIR)


@contextmanager
def atomic_output(out: Path, force: bool, is_ours: Callable[[Path], bool] = is_artifact_dir,
                  what: str = ARTIFACT_DIR, ours: Callable[[Path], set[str]] = artifact_files) -> Iterator[Path]:
    """Yield a temporary directory beside `out`; on success it replaces what `out` held that speccompile wrote
    (`ours`; other files stay); on any error, Ctrl-C or SIGTERM it is removed (with any parent folders created
    for it) and `out` is left as it was."""
    out = Path(os.path.abspath(out))
    check_replaceable(out, force, is_ours, what)
    created = _make_parent(out)
    remove_stale_temps(out)
    tmp = out.parent / f".{out.name}{TEMP_TAG}{os.getpid()}"
    # The SIGTERM handler is in place before the folder exists: a signal can never leave it behind.
    with terminate_as_interrupt():
        try:
            try:
                if tmp.exists():
                    shutil.rmtree(tmp)
                tmp.mkdir()
            except OSError as exc:
                raise InputError(f"out {out}: cannot write there ({exc.strerror})", "out") from None
            try:
                yield tmp
                honour_umask(tmp)
                commit_output(tmp, out, ours)
            except OSError as exc:
                error = write_failure(exc, out, tmp)
                if error is None:
                    raise
                raise error from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            _remove_if_empty(created)
            raise
