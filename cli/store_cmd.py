"""`cagkv ingest | ask | ls | rm | stats | doctor`: thin shells over the store and engine.

Each command calls one library function (`cagkv.ingest.ingest`, `CAG.ask` /
`CAG.ask_stream`, `CacheStore.list_documents / remove / stats / doctor`) and prints its
result; `--json` prints one JSON object. Errors become one line on stderr: exit 2 for
usage errors (bad input, unknown model, empty question), 1 for the rest; `--debug`
(before the command) shows the traceback.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from typing import Any

import typer

from cagkv.errors import CagkvError, UsageError

STORE_HELP = "Store folder (default: $CAGKV_HOME/store)."
DB_HELP = "SQLAlchemy URL of the catalog (default: SQLite inside the store)."
MODES = ["auto", "canonical", "native", "translate", "mot-window", "none"]


def _errors(fn: Callable[..., None]) -> Callable[..., None]:
    """Library errors -> one line on stderr and exit code 2 (usage) or 1 (other)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, SystemExit, KeyboardInterrupt):
            raise
        except Exception as err:
            import click

            if isinstance(err, click.ClickException):
                raise
            from cagkv.cli.app import _DEBUG

            if _DEBUG["on"]:
                import traceback

                traceback.print_exception(err)
            message = (str(err) or type(err).__name__).splitlines()[0]
            if not isinstance(err, CagkvError):
                message = f"{type(err).__name__}: {message}"
            typer.echo(f"cagkv: error: {message}", err=True)
            raise typer.Exit(2 if isinstance(err, UsageError) else 1) from None

    return wrapper


def _open_store(store: str | None, db: str | None) -> Any:
    """An existing store (never creates one)."""
    from cagkv.stores import CacheStore

    from cagkv.ingest import default_store_path

    return CacheStore.open(store or default_store_path(), db, create=False)


def _print_json(obj: Any) -> None:
    typer.echo(json.dumps(obj, ensure_ascii=False))


# ---------------------------------------------------------------------- ingest
@_errors
def ingest_cmd(
    paths: list[str] = typer.Argument(..., help="Files (.txt, .md, .html), folders (recursive), or - for stdin."),
    store: str | None = typer.Option(None, "--store", help=STORE_HELP),
    canonical: str | None = typer.Option(
        None, "--canonical", help="Canonical model: zoo name or folder (default: the store's, else smollm2-135m)."
    ),
    chunk_tokens: int = typer.Option(256, "--chunk-tokens", min=8, help="Canonical tokens per chunk."),
    batch_size: int = typer.Option(8, "--batch-size", min=1, help="Chunks per prefill forward."),
    dtype: str = typer.Option(
        "auto", "--dtype", help="Prefill dtype: auto (bfloat16 on a GPU or where the CPU has native bf16, else float32), bfloat16, float32."
    ),
    max_bytes: int | None = typer.Option(None, "--max-bytes", min=1, help="Per-file size limit (default 20 MiB)."),
    db: str | None = typer.Option(None, "--db", help=DB_HELP),
    embedder: str | None = typer.Option(
        None, "--embedder", envvar="CAGKV_EMBEDDER", help="Embedder of a new store: minilm-l6 (default) or hash-<dim>."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as one JSON object."),
    device: str = typer.Option("cpu", "--device", help="Where the canonical model prefills: cpu, cuda, cuda:N or auto (a GPU if there is one)."),
) -> None:
    """Prefill documents once with the canonical model and store their KV caches.

    Example: cagkv ingest examples/docs --store /tmp/demo-store
    """
    from cagkv.ingest import ingest

    report = ingest(
        paths, store, canonical=canonical, chunk_tokens=chunk_tokens, batch_size=batch_size,
        dtype=dtype, max_bytes=max_bytes, db_url=db, embedder=embedder,
        progress=not as_json and sys.stderr.isatty(), device=device,
    )  # fmt: skip
    if as_json:
        _print_json(report.to_dict())
    else:
        typer.echo(report.summary())


# ---------------------------------------------------------------------- ask
@_errors
def ask_cmd(
    question: str = typer.Argument(..., help="The question."),
    store: str | None = typer.Option(None, "--store", help=STORE_HELP),
    target: str | None = typer.Option(None, "--target", help="Answering model (default: the canonical model)."),
    mode: str = typer.Option("auto", "--mode", help="auto | canonical | native | translate | mot-window | none."),
    top_k: int = typer.Option(3, "--top-k", min=1, help="Chunks retrieved."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", min=1, help="Answer length limit in tokens."),
    replay: int | None = typer.Option(
        None, "--replay", min=0,
        help="Top target layers recomputed over the chunks (translate mode; default: the translator card's default_replay).",
    ),
    refresh: float | None = typer.Option(
        None, "--refresh", min=0.0, max=1.0,
        help="Share of the chunk tokens the target recomputes through every layer, those the question "
             "attends to most, ranked by --refresh-scoring (translate mode; 0: none; default: the "
             "translator card's default_refresh).",
    ),
    refresh_scoring: str | None = typer.Option(
        None, "--refresh-scoring",
        help="How --refresh ranks the chunk tokens: attention (the question's attention) or contrast "
             "(that attention over a neutral prompt's: skips the tokens every prompt reads) or pooled "
             "(contrast averaged over 5 neighbouring tokens: chooses spans) or averaged (contrast over "
             "the mean of several neutral prompts) or drafted (contrast of the question followed by "
             "8 answer tokens drafted over the translated cache; measured worse on the needles, E61) or "
             "difficulty (the translator's expected error per token, from its difficulty table, shipped with "
             "every bundled translator; no question pass) or contrast_difficulty (contrast times that expected error) or union (the tokens "
             "either contrast or contrast_difficulty ranks high) or adaptive (contrast when the question's "
             "contrast has one token far above the rest, a lookup, by the card's own threshold; "
             "contrast_difficulty otherwise: E72, E77). "
             "Default: the translator card's default_refresh_scoring, else contrast.",
    ),
    attention_bias: float | None = typer.Option(
        None, "--attention-bias",
        help="Added to the attention logits of the chunk tokens left translated, for the question and the "
             "answer (translate mode; < 0: lean on the refreshed tokens, > 0: read more of the translated "
             "ones; default: the translator card's attention_bias where a refresh runs, its attention_bias_r0 "
             "with neither refresh nor replay, else 0; docs/EXPERIMENTS.md E86-E88).",
    ),
    attention_bias_scope: str | None = typer.Option(
        None, "--attention-bias-scope",
        help="Where the attention bias acts: all (every question and answer token), question (the question's "
             "only), answerK (the question's and the first K answer tokens', as in answer4); after a comma, "
             "sliding or full keeps it to the layers of that attention kind, and rest:sliding / rest:full (after "
             "question or answerK) gives the later answer tokens the bias in that kind's layers, as in "
             "question,rest:full; hardF keeps it to the share F of the translated tokens the translator's "
             "difficulty table ranks hardest; fitted scales it in each layer and head by the translator's "
             "fitted attention table (docs/EXPERIMENTS.md E88e, E90, E92, E95). Default: the translator "
             "card's scope for its own bias, else all.",
    ),
    dtype: str = typer.Option("float32", "--dtype", help="Answering dtype: float32 or bfloat16."),
    device: str = typer.Option("cpu", "--device", help="Where the models run: cpu, cuda, cuda:N or auto (a GPU if there is one)."),
    stream: bool = typer.Option(False, "--stream", help="Print the answer as it is generated."),
    db: str | None = typer.Option(None, "--db", help=DB_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (answer, target, mode, sources, timings_ms)."),
) -> None:
    """Answer a question from the stored caches.

    Example: cagkv ask "What does pass do?" --target gemma3-270m --mode auto
    """
    from cagkv.pipeline import CAG

    if mode not in MODES:
        raise UsageError(f"unknown mode {mode!r}: expected one of {', '.join(MODES)}")
    if not question.strip():
        raise UsageError("empty question: ask something")
    cag = CAG.open(store, db, dtype=dtype, device=device)  # the engine checks the canonical tokenizer before using stored blocks
    kwargs = {"target": target, "mode": mode, "top_k": top_k, "max_new_tokens": max_new_tokens, "replay": replay,
              "refresh": refresh, "refresh_scoring": refresh_scoring, "attention_bias": attention_bias,
              "attention_bias_scope": attention_bias_scope}
    if stream and not as_json:
        answer_stream = cag.ask_stream(question, **kwargs)
        for piece in answer_stream:
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        answer = answer_stream.answer
        assert answer is not None
    else:
        answer = cag.ask(question, **kwargs)
        if as_json:
            _print_json(answer.to_dict())
            return
        typer.echo(answer.text)
    typer.echo(format_details(answer), err=False)


def format_details(answer: Any) -> str:
    """Mode, sources and the timing split under a printed answer."""
    from cagkv.pipeline import TIMING_KEYS

    t = answer.timings_ms
    lines = [
        "",
        f"target {answer.target}, mode {answer.mode}" + (f" ({answer.mode_reason})" if answer.mode_reason else ""),
    ]
    for s in answer.sources:
        lines.append(f"  source doc {s.document} chunk {s.chunk} score {s.score:.3f}  {s.source}")
    lines.append("  timings ms: " + ", ".join(f"{k} {t[k]:.0f}" for k in TIMING_KEYS))
    tok = answer.tokens
    lines.append(f"  tokens: context {tok['context']}, prompt {tok['prompt']}, generated {tok['generated']}")
    return "\n".join(lines)


# ---------------------------------------------------------------------- ls / rm / stats / doctor
@_errors
def ls_cmd(
    store: str | None = typer.Option(None, "--store", help=STORE_HELP),
    db: str | None = typer.Option(None, "--db", help=DB_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object {documents: [...]}."),
) -> None:
    """List the stored documents.

    Example: cagkv ls --store /tmp/demo-store
    """
    docs = _open_store(store, db).list_documents()
    if as_json:
        _print_json({"documents": [
            {"id": d.id, "source": d.source, "chunks": d.chunks, "tokens": d.tokens, "bytes": d.nbytes,
             "created": d.created, "metadata": d.metadata, "chunking": d.chunking} for d in docs
        ]})  # fmt: skip
        return
    typer.echo(f"{'ID':>5} {'CHUNKS':>6} {'TOKENS':>8} {'BYTES':>12}  SOURCE")
    for d in docs:
        typer.echo(f"{d.id:>5} {d.chunks:>6} {d.tokens:>8} {d.nbytes:>12}  {d.source}")


@_errors
def rm_cmd(
    document: str = typer.Argument(..., help="Document id (from `cagkv ls`) or its source path."),
    store: str | None = typer.Option(None, "--store", help=STORE_HELP),
    db: str | None = typer.Option(None, "--db", help=DB_HELP),
) -> None:
    """Remove a document: its catalog rows, KV blobs and vectors.

    Example: cagkv rm 3
    """
    from pathlib import Path

    opened = _open_store(store, db)
    key: int | str = int(document) if document.isdigit() else document
    if isinstance(key, str) and Path(key).exists():
        key = str(Path(key).resolve())  # sources are stored as resolved paths
    removed = opened.remove(key)
    typer.echo(f"removed document {document} ({removed} chunks)")


@_errors
def stats_cmd(
    store: str | None = typer.Option(None, "--store", help=STORE_HELP),
    db: str | None = typer.Option(None, "--db", help=DB_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Store statistics: documents, chunks, tokens, bytes, canonical model, embedder.

    Example: cagkv stats --json
    """
    stats = _open_store(store, db).stats()
    if as_json:
        _print_json(stats)
        return
    for k, v in stats.items():
        typer.echo(f"{k:22} {v}")


@_errors
def doctor_cmd(
    repair: bool = typer.Option(False, "--repair", help="Fix what is found (orphans, bad blobs, stale index)."),
    store: str | None = typer.Option(None, "--store", help=STORE_HELP),
    db: str | None = typer.Option(None, "--db", help=DB_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Check that catalog, blobs and index agree; exit 1 when problems remain.

    Example: cagkv doctor --repair
    """
    report = _open_store(store, db).doctor(repair=repair)
    if as_json:
        _print_json(report.to_dict())
    else:
        typer.echo(f"checked {report.checked_chunks} chunks: {'ok' if report.ok else 'problems found'}")
        for p in report.problems:
            typer.echo(f"  {p.kind}: {p.message}")
        for r in report.repaired:
            typer.echo(f"  repaired: {r}")
    if not report.ok and not (repair and report.repaired):
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add this module's commands to the app."""
    app.command("ingest")(ingest_cmd)
    app.command("ask")(ask_cmd)
    app.command("ls")(ls_cmd)
    app.command("rm")(rm_cmd)
    app.command("stats")(stats_cmd)
    app.command("doctor")(doctor_cmd)
