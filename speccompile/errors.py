"""One exception family. The CLI turns any `SpecCompileError` into a one-line message and exit code 2."""

from __future__ import annotations


class SpecCompileError(Exception):
    """Base class of every error speccompile reports to a user (bad input, unsupported model, ...)."""

    exit_code = 2


class InputError(SpecCompileError):
    """A file, flag or value given by the user is missing, malformed or out of range."""


class UnsupportedError(SpecCompileError):
    """The model, drafter, precision or hardware is not supported."""


class ArtifactError(SpecCompileError):
    """An artifact directory is inconsistent: schema version, sha256, missing graph or limits."""


class HardwareError(SpecCompileError):
    """The GPU, TensorRT version or engine does not match what the artifact needs."""
