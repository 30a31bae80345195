"""The `cagkv` command line: one Typer app; each command module registers its commands.

Errors: a `CagkvError` becomes one line on stderr and exit code 1 (traceback only with
`--debug`); usage errors exit with 2.
"""

from __future__ import annotations

import os
import sys

import typer

from cagkv.errors import CagkvError, UsageError

app = typer.Typer(
    name="cagkv",
    help="Cache-augmented generation across heterogeneous LLMs: prefill documents once, "
    "answer with any model from translated KV caches.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

_DEBUG = {"on": False}


@app.callback()
def _global(
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks on errors."),
) -> None:
    _DEBUG["on"] = debug or bool(os.environ.get("CAGKV_DEBUG"))


def _register_commands() -> None:
    # Each module adds its commands to `app`; imported lazily-heavy code stays inside commands.
    from cagkv.cli import models_cmd, store_cmd, train_cmd, eval_cmd

    for module in (models_cmd, store_cmd, train_cmd, eval_cmd):
        module.register(app)


_register_commands()


def main() -> None:
    """Console-script entry point."""
    try:
        code = app(standalone_mode=False)  # a typer.Exit(n) comes back as n here, not raised
        if isinstance(code, int) and code:
            sys.exit(code)
    except SystemExit:
        raise
    except UsageError as err:
        _report(err)
        sys.exit(2)
    except CagkvError as err:
        _report(err)
        sys.exit(1)
    except KeyboardInterrupt:
        print("cagkv: interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as err:  # noqa: BLE001 - the CLI boundary turns every error into one line
        # Typer ships its own click: its exceptions carry `exit_code` (2 for usage errors)
        # and `show()`; an Abort (Ctrl-C at a prompt) has neither.
        if hasattr(err, "exit_code") and hasattr(err, "show"):
            err.show()
            sys.exit(int(err.exit_code))
        if type(err).__name__ == "Abort":
            sys.exit(1)
        _report(err)
        sys.exit(1)


def _report(err: BaseException) -> None:
    if _DEBUG["on"]:
        import traceback

        traceback.print_exception(err)
    message = str(err) or type(err).__name__
    print(f"cagkv: error: {message.splitlines()[0]}", file=sys.stderr)


if __name__ == "__main__":
    main()
