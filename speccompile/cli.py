"""The `speccompile` command line: thin wrappers that parse, call a stage and print (rich) or --json."""

from __future__ import annotations

import sys

import click

from .errors import SpecCompileError


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="speccompile")
def cli() -> None:
    """Compile an LLM plus a drafter into ONNX / TensorRT artifacts and run exact speculative decoding.

    \b
    Typical flow:
      speccompile export smollm2-135m --out exported/
      speccompile run exported/ --prompt "Write a haiku about the sea" --drafter ngram
      speccompile bench exported/ --workload benchmarks/workloads/copy.jsonl
    """


def _register_commands() -> None:
    """Attach the commands of speccompile/commands/ (each imports its heavy dependencies only when run)."""
    from .commands import artifacts, build, eval, generate, train

    for module in (artifacts, generate, build, train, eval):
        for command in module.COMMANDS:
            cli.add_command(command)


_register_commands()


def main(argv: list[str] | None = None) -> None:
    """Console entry point: SpecCompileError -> one line on stderr, exit code 2."""
    try:
        cli.main(args=argv, standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except SpecCompileError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
