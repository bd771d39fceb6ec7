"""One exception family. The CLI turns any `SpecCompileError` into a one-line message and exit code 2.

Library messages speak in API terms: an error about one argument names it as the API does
(`RunOptions.num_draft_tokens` -> "num_draft_tokens must be >= 0, got -1") and records it in `field`; a front end
names its own spelling instead (`naming`: the CLI's flag, "--num-draft-tokens must be >= 0, got -1")."""

from __future__ import annotations


class SpecCompileError(Exception):
    """Base class of every error speccompile reports to a user (bad input, unsupported model, ...)."""

    exit_code = 2

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field  # the API name of the argument the message is about; the message then starts with it

    def naming(self, name: str) -> str:
        """The message with its leading field name replaced by `name` (a front end's spelling of it)."""
        message = str(self)
        if self.field and message.startswith(self.field):
            return name + message[len(self.field):]
        return message


class InputError(SpecCompileError):
    """A file, flag or value given by the user is missing, malformed or out of range."""


class UnsupportedError(SpecCompileError):
    """The model, drafter, precision or hardware is not supported."""


class ArtifactError(SpecCompileError):
    """An artifact directory is inconsistent: schema version, sha256, missing graph or limits."""


class HardwareError(SpecCompileError):
    """The GPU, TensorRT version or engine does not match what the artifact needs."""
