"""The `speccompile` command line: thin wrappers that parse, call a stage and print (rich) or --json."""

from __future__ import annotations

import sys

import click

from .errors import SpecCompileError

# Top-level module -> the extra that installs it (pip install 'speccompile[EXTRA]').
EXTRA_OF_MODULE = {
    "torch": "export", "onnxscript": "export", "onnx_ir": "export", "safetensors": "export", "gguf": "export",
    "transformers": "export", "tensorrt": "tensorrt", "polygraphy": "tensorrt", "onnxruntime_genai": "bench",
    "fastapi": "serve", "uvicorn": "serve", "ray": "serve", "prometheus_client": "serve", "openai": "serve",
}


def missing_extra_message(exc: ModuleNotFoundError, command: str | None) -> str | None:
    """'`speccompile CMD` needs X ...: pip install ...' when `exc` is a module an extra provides, else None."""
    module = (exc.name or "").partition(".")[0]
    extra = EXTRA_OF_MODULE.get(module)
    if extra is None:
        return None
    who = f"`speccompile {command}`" if command else "this command"
    return f"{who} needs {module}, which is not installed: pip install 'speccompile[{extra}]'"


class CommandLine(click.Group):
    """The command group: a library error a command raises is worded with that command's flags (`flag_message`)."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except SpecCompileError as exc:
            command = self.commands.get(ctx.invoked_subcommand or "")
            if command is not None:
                exc.args = (flag_message(exc, command), *exc.args[1:])
            raise


def flag_message(exc: SpecCompileError, command: click.Command) -> str:
    """The error's message in the command line's terms: each API field it is about (`exc.fields`) named by the
    command's option for it (max_tokens -> --max-tokens), where it has one."""
    return exc.naming({p.name: max(p.opts, key=len) for p in command.params if isinstance(p, click.Option) and p.name})


@click.group(cls=CommandLine, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="speccompile")
def cli() -> None:
    """Compile an LLM plus a drafter into ONNX / TensorRT artifacts and run exact speculative decoding.

    \b
    Typical flow:
      speccompile export smollm2-135m --out exported/smollm2 --force
      speccompile run exported/smollm2 --prompt "Write a haiku about the sea" --drafter ngram
      speccompile bench exported/smollm2 --workload benchmarks/workloads/copy.jsonl
    """


def _register_commands() -> None:
    """Attach the commands of speccompile/commands/ (each imports its heavy dependencies only when run)."""
    from .commands import artifacts, build, eval, generate, serve, train

    for module in (artifacts, generate, build, train, eval, serve):
        for command in module.COMMANDS:
            cli.add_command(command)


_register_commands()


def main(argv: list[str] | None = None) -> None:
    """Console entry point: SpecCompileError -> one line on stderr, exit code 2."""
    try:
        cli.main(args=argv, prog_name="speccompile", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        click.echo(f"error: {usage_message(exc)}", err=True)
        sys.exit(exc.exit_code)
    except SpecCompileError as exc:
        _end_if_terminated()
        click.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)
    except SystemExit as exc:
        from .atomic_dir import Terminated

        if isinstance(exc, Terminated):
            click.echo("terminated", err=True)
        raise
    except ModuleNotFoundError as exc:
        _end_if_terminated()
        args = sys.argv[1:] if argv is None else argv
        message = missing_extra_message(exc, next((a for a in args if not a.startswith("-")), None))
        if message is None:
            raise
        click.echo(f"error: {message}", err=True)
        sys.exit(2)
    except Exception:
        _end_if_terminated()
        raise


def usage_message(exc: click.ClickException) -> str:
    """Click's error as one line: what is wrong and, for a usage error, where the options are listed."""
    message = exc.format_message().rstrip(".")
    ctx = getattr(exc, "ctx", None)
    if isinstance(exc, click.UsageError) and ctx is not None:
        return f"{ctx.command_path}: {message} (see `{ctx.command_path} --help`)"
    return message


def _end_if_terminated() -> None:
    """SIGTERM arrived inside a library that turned the raised `Terminated` into an error of its own (a native
    loader during export): end as terminated (128 + SIGTERM), not with that error."""
    from .atomic_dir import Terminated, sigterm_received

    if sigterm_received():
        click.echo("terminated", err=True)
        raise Terminated() from None


if __name__ == "__main__":
    main()
