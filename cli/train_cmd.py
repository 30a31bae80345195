"""`cagkv train` and `cagkv translators list`: thin shells over `cagkv.translate`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import typer

translators_app = typer.Typer(help="Trained KV translators: list what is installed.", no_args_is_help=True)


def train_cmd(
    canonical: str = typer.Option(..., "--canonical", help="Source (canonical) model: zoo name or folder."),
    target: str = typer.Option(..., "--target", help="Target model: zoo name or folder."),
    out: str = typer.Option(None, "--out", help="Artifact folder. Default: $CAGKV_HOME/translators/SRC__TGT."),
    corpus: list[str] = typer.Option(None, "--corpus", help="Corpus name (pydoc, lee, shakespeare, wiki) or .txt path; repeatable (default lee + pydoc)."),
    samples: int = typer.Option(72, "--samples", help="Training chunks to draw (10% of documents held out)."),
    experts: int = typer.Option(4, "--experts", help="Experts per layer group (1 = single-translator ablation; with --init from a one-expert "
                                     "translator, each expert starts as its copy: upcycled)."),
    top_k: int = typer.Option(2, "--top-k", help="Experts per token."),
    steps: str = typer.Option("0,0,400", "--steps", help="Steps of regression,attention,e2e (0 skips a stage)."),
    minutes: str = typer.Option("0,0,24", "--minutes", help="Wall budget per stage in minutes (0 = none)."),
    init: str = typer.Option("ridge", "--init", help="random; ridge: start from the closed-form ridge map; "
                             "or a translator folder: start from its linear path and replay heads."),
    train_only: str = typer.Option("", "--train-only",
                                   help="mixture: train only the mixture (linear path and replay heads frozen); "
                                   "streams: only the layer streams (config layer_streams); "
                                   "key_scale: only the keys' per-layer scales (config key_scale)."),
    skip_rank: int = typer.Option(128, "--skip-rank", help="Rank of the per-layer linear path (0: none)."),
    method: str = typer.Option("staged", "--method",
                               help="staged: pairs + regression/attention/e2e stages; ridge: streaming closed-form fit."),
    ridge_texts: int = typer.Option(0, "--ridge-texts", help="ridge: corpus chunks streamed (0: all)."),
    ridge_minutes: float = typer.Option(0.0, "--ridge-minutes", help="ridge: stop streaming after N minutes (0: none)."),
    replay: str = typer.Option("", "--replay", help="Replay heads to fit, as replay counts r (comma-separated, e.g. 2,4,6)."),
    int8_linear: bool = typer.Option(False, "--int8-linear", help="Store the linear paths as int8 (half of float16)."),
    threads: int = typer.Option(1, "--threads", help="torch CPU threads."),
    seed: int = typer.Option(0, "--seed"),
    config: str = typer.Option(None, "--config", help="JSON file of further TrainConfig fields."),
) -> None:
    """Train a Mixture-of-Translators from CANONICAL's KV to TARGET's (resumable).

    Example: cagkv train --canonical smollm2-135m --target gemma3-270m --experts 4 --top-k 2
    """
    from cagkv.errors import UsageError
    from cagkv.translate.runner import run_training
    from cagkv.translate.train import TRAIN_ONLY, TrainConfig

    try:
        s_reg, s_att, s_e2e = (int(x) for x in steps.split(","))
        m_reg, m_att, m_e2e = (float(x) for x in minutes.split(","))
    except ValueError:
        raise UsageError(f"--steps and --minutes take three comma-separated numbers, got {steps!r} / {minutes!r}") from None
    try:
        replays = [int(x) for x in replay.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--replay takes comma-separated integers, got {replay!r}") from None
    extra = json.loads(Path(config).read_text()) if config else {}
    home = Path(os.environ.get("CAGKV_HOME", Path.home() / ".cache" / "cagkv"))
    default_out = home / "translators" / f"{Path(canonical).name}__{Path(target).name}"
    fields = dict(
        out=str(out or default_out), samples=samples, experts=experts, top_k=top_k, seed=seed, threads=threads,
        steps_regression=s_reg, steps_attention=s_att, steps_e2e=s_e2e,
        stage_minutes={"regression": m_reg, "attention": m_att, "e2e": m_e2e},
        init=init, train_only=train_only, skip_rank=skip_rank, method=method, ridge_texts=ridge_texts,
        ridge_minutes=ridge_minutes,
        replay=replays, int8_linear=int8_linear,
    )
    if corpus:
        fields["corpora"] = list(corpus)
    fields.update(extra)
    try:
        cfg = TrainConfig.from_dict(fields)
        if not 1 <= top_k <= experts:
            raise ValueError(f"--top-k must be between 1 and --experts={experts}, got {top_k}")
        if method not in ("staged", "ridge"):
            raise ValueError(f"--method must be staged or ridge, got {method!r}")
        if init == "ridge" and skip_rank < 1:
            raise ValueError("--init ridge needs --skip-rank >= 1")
        if init not in ("random", "ridge"):
            if not (Path(init) / "card.json").is_file():
                raise ValueError(f"--init must be random, ridge or a translator folder (with card.json), got {init!r}")
            if method != "staged":
                raise ValueError("--init FOLDER starts the staged method's gradient stages; use --method staged")
        if train_only not in TRAIN_ONLY:
            raise ValueError(f"--train-only must be one of {', '.join(repr(t) for t in TRAIN_ONLY)}, got {train_only!r}")
    except (TypeError, ValueError) as e:
        raise UsageError(str(e)) from None
    path = run_training(canonical, target, cfg)
    typer.echo(str(path))


@translators_app.command("list")
def list_cmd(as_json: bool = typer.Option(False, "--json", help="One JSON object per translator.")) -> None:
    """List installed translators ($CAGKV_HOME/translators and shipped ones), with what `ask`
    does by default with each: REFRESH, the share of chunk tokens the target recomputes and how
    they are ranked; TABLE, whether a difficulty table ships (needed by the difficulty, contrast_difficulty,
    union and adaptive scorings) and the peakedness at which adaptive switches to contrast;
    BIAS, the attention bias on the tokens left translated where a refresh runs / at r = 0,
    with its scope after a colon where it is not every token in every layer (as in
    ":answer4,rest:full": docs/EXPERIMENTS.md E88e, E93).

    Example: cagkv translators list
    """
    from cagkv.translate import list_translators

    rows = list_translators()
    if as_json:
        for r in rows:
            typer.echo(json.dumps(r))
        return
    if not rows:
        typer.echo("no translators installed (train one: cagkv train --canonical A --target B)")
        return
    biases = [
        "/".join(f"{r[k]:g}" + ("" if r[f"{k}_scope"] == "all" else f":{r[k + '_scope']}")
                 for k in ("attention_bias", "attention_bias_r0"))
        for r in rows
    ]
    width = max(11, *(len(b) for b in biases))  # a scope such as answer4,rest:full is wider than the rest
    typer.echo(f"{'SOURCE':14} {'TARGET':14} {'E/k':5} {'QUALITY':>8} {'AUTO>=':>6} {'MB':>5}  "
               f"{'REFRESH':20} {'TABLE':14} {'BIAS':{width}} PATH")
    for r, bias in zip(rows, biases):
        q = "-" if r["quality"] is None else f"{r['quality']:.3f}"
        mb = "-" if not r["size_bytes"] else f"{r['size_bytes'] / 1e6:.1f}"
        ek = f"{r['experts']}/{r['top_k']}"
        refresh = f"{r['default_refresh']:g} {r['default_refresh_scoring']}" if r["default_refresh"] else "0"
        table = f"yes (z {r['peak_z']:g})" if r["difficulty_table"] else "-"
        typer.echo(f"{str(r['source']):14} {str(r['target']):14} {ek:5} {q:>8} {str(r['auto_threshold']):>6} {mb:>5}  "
                   f"{refresh:20} {table:14} {bias:{width}} {r['path']}")


def register(app: typer.Typer) -> None:
    """Add `cagkv train` and `cagkv translators ...` to the app."""
    app.command("train")(train_cmd)
    app.add_typer(translators_app, name="translators")
