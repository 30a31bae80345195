"""`cagkv eval`: answer quality and time to first token per mode on a QA set (one library call)."""

from __future__ import annotations

import json

import typer

from cagkv.errors import UsageError

_EXAMPLE = (
    "Example: cagkv eval --dataset ../shared/data/squad_v1.1_dev_even_articles.jsonl --limit 300 "
    "--canonical smollm2-135m --target gemma3-270m --modes none,native,translate "
    "--out docs/results/squad_smollm2_gemma3.json --markdown docs/results/squad_smollm2_gemma3.md"
)


def eval_command(
    dataset: str = typer.Option(..., "--dataset", help="QA file in the shared JSONL schema."),
    limit: int = typer.Option(None, "--limit", help="Evaluate a seeded sample of N questions."),
    seed: int = typer.Option(0, "--seed", help="Seed of the sample (and of the bootstrap)."),
    max_context_chars: int = typer.Option(None, "--max-context-chars",
                                          help="Only examples whose context has at most N characters."),
    canonical: str = typer.Option("smollm2-135m", "--canonical", help="Model that prefills contexts."),
    target: str = typer.Option(None, "--target", help="Model that answers (default: canonical)."),
    modes: str = typer.Option("none,native,canonical", "--modes",
                              help="Comma-separated modes: none, native, canonical, translate, mot-window, auto, or "
                                   "NAME=[DIR][@R|@window|@refreshF[:SCORING]][+biasB...] for a translated variant "
                                   "(the full syntax: cagkv.eval.runner.VARIANT_SYNTAX, docs/ARCHITECTURE.md)."),
    retrieval: str = typer.Option("oracle", "--retrieval",
                                  help="oracle: the example's own context; open: all ingested contexts."),
    top_k: int = typer.Option(3, "--top-k", help="Chunks retrieved per question."),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", help="Answer length limit."),
    replay: int = typer.Option(0, "--replay", help="Top target layers recomputed (translate modes)."),
    chunk_tokens: int = typer.Option(256, "--chunk-tokens", help="Chunk size at ingest."),
    kl_text: str = typer.Option(None, "--kl-text",
                                help="Held-out text: also report next-token KL against native prefill."),
    kl_windows: int = typer.Option(16, "--kl-windows", help="Context/continuation windows from --kl-text."),
    dtype: str = typer.Option("float32", "--dtype", help="dtype the target answers in (float32, bfloat16)."),
    ingest_dtype: str = typer.Option("float32", "--ingest-dtype",
                                     help="dtype of the canonical prefill at ingest."),
    device: str = typer.Option("cpu", "--device",
                               help="Where the models run (ingest and answers): cpu, cuda, cuda:N or auto."),
    embedder: str = typer.Option(None, "--embedder", help="Embedder of the eval store (default minilm-l6)."),
    store: str = typer.Option(None, "--store", help="Keep the evaluation store here (default: temporary)."),
    out: str = typer.Option(None, "--out", help="Results JSON (a rerun resumes from it)."),
    markdown: str = typer.Option(None, "--markdown", help="Also write a markdown table."),
    threads: int = typer.Option(0, "--threads", help="torch CPU threads (0: torch's default)."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show a progress bar."),
    shard: str = typer.Option(None, "--shard",
                              help="K/N: answer only every N-th question from the K-th, into a file "
                                   "beside --out, to split a run over N processes; then run once "
                                   "without --shard to collect the rows and write the report."),
) -> None:
    """Compare modes on a QA set: EM, F1, answer log-prob, recovery, TTFT split."""
    if threads < 0:
        raise UsageError(f"--threads must be >= 0, got {threads}")
    if threads:
        import torch

        torch.set_num_threads(threads)
    from cagkv.eval.report import to_markdown
    from cagkv.eval.runner import EvalConfig, command_line, parse_shard, run_eval

    mode_list = [m.strip() for m in modes.split(",") if m.strip()]
    if limit is not None and limit <= 0:
        raise UsageError(f"--limit must be positive, got {limit}")
    if max_context_chars is not None and max_context_chars <= 0:
        raise UsageError(f"--max-context-chars must be positive, got {max_context_chars}")
    config = EvalConfig(
        dataset=dataset, canonical=canonical, target=target or canonical, modes=mode_list,
        limit=limit, seed=seed, max_context_chars=max_context_chars, retrieval=retrieval, top_k=top_k,
        max_new_tokens=max_new_tokens,
        replay=replay, chunk_tokens=chunk_tokens, kl_text=kl_text, kl_windows=kl_windows,
        dtype=dtype, ingest_dtype=ingest_dtype, device=device, embedder=embedder, out=out, markdown=markdown, store=store,
        command=command_line(), shard=parse_shard(shard) if shard else None,
    )
    report = run_eval(config, progress=progress)
    if shard:
        typer.echo(f"shard {shard}: {report['n']} questions done; run again without --shard to write {out}",
                   err=True)
    typer.echo(to_markdown(report))
    if out is None:
        summary = {k: report[k] for k in ("dataset", "canonical", "target", "n", "modes", "recovery")}
        typer.echo(json.dumps(summary, indent=1))


eval_command.__doc__ = f"{eval_command.__doc__}\n\n{_EXAMPLE}"


def register(app: typer.Typer) -> None:
    """Add `cagkv eval` to the app."""
    app.command("eval")(eval_command)
