"""Time to first token on one device (a GPU): translate (r = 0) against native prefill, side by side.

What a GPU changes is the model work; the store and retrieval stay on the CPU. For each
context length, real text of that many canonical tokens is cut into the engine's chunks and
prefilled by the canonical model into position-free blocks, which are then put in host
memory as the store would return them. Timed, alternating, after warm-ups:

    r0          the translator turns the blocks into the target's (`Translator.translate_many`:
                the copy to the device, alignment, the folded network), the engine assembles
                them after the target's prefix (`CAG.assemble`), and the question's forward
                computes the separators and the first token (`cagkv.refresh.feed`)
    refreshF    (`--refresh F`) the same, plus contrast scoring of the chunk tokens and the
                share F of them recomputed in the question's forward (`CAG.refresh`)
    native      the target prefills the chunks itself after its prefix (`CAG.prefill_native`)
                and the question's forward gives the first token

Each region ends with a device synchronisation. Reported: the median of each split, and
native / translate.

`--random-weights`: the lent GPU machines hold no model files and take at most 64 MiB of
baggage, so each model can be built from its folder's config and tokenizer alone, with
random weights (the translator's weights are the shipped ones). Times depend on the shapes,
not the values, for these dense models; the tokens chosen mean nothing and are not reported.
The translator's card names the models it accepts: the random models take the card's
fingerprints for that reason only.

Example (on the GPU machine):
    python benchmarks/ttft_device.py --canonical DIR --target DIR \
        --translator cagkv/translators/smollm2-135m__qwen2.5-0.5b --random-weights \
        --lengths 512,2048,8192,32768 --repeats 10 --out ttft_device.json --markdown ttft_device.md
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ttft import DEFAULT_TEXT, QUESTION, context_of, read_text  # noqa: E402

from cagkv.chunking import chunk_text  # noqa: E402
from cagkv.models import LoadedModel, load  # noqa: E402
from cagkv.models.spec import ModelSpec  # noqa: E402
from cagkv.pipeline import CAG, NEUTRAL_QUESTIONS  # noqa: E402
from cagkv.prefill import prefill_chunks  # noqa: E402
from cagkv.prompt import PromptFormat  # noqa: E402
from cagkv.refresh import feed  # noqa: E402
from cagkv.translate.artifact import load_translator  # noqa: E402


def random_model(folder: str, fingerprint: str, dtype: torch.dtype, device: str) -> LoadedModel:
    """The model of `folder`'s config and tokenizer, with random weights (see module doc)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval().requires_grad_(False)
    return LoadedModel(model=model, tokenizer=tokenizer, spec=ModelSpec.from_config(config, tokenizer),
                       fingerprint=fingerprint, name=Path(folder).name, config=config, path=folder, dtype=dtype)


def real_model(name: str, dtype: torch.dtype, device: str) -> LoadedModel:
    loaded = load(name, dtype=dtype)
    loaded.model.to(device)
    return loaded


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def first_token_translated(engine: CAG, tr, target: LoadedModel, fmt: PromptFormat, blocks, question: list[int],
                           device: str, refresh: float = 0.0) -> dict[str, float]:
    """As the engine's `prepare` + first token (pipeline.py), with `refresh` the share of the
    chunk tokens the target recomputes, chosen by contrast scoring."""
    split = {}
    t0 = time.perf_counter()
    translated = tr.translate_many(blocks, target)
    sync(device)
    t1 = time.perf_counter()
    cache, n, pending, starts, stale = engine.assemble(target, fmt, translated, keep_all=refresh > 0)
    sync(device)
    t2 = time.perf_counter()
    if refresh:
        neutral = [pending + fmt.question_suffix_ids(q) for q in NEUTRAL_QUESTIONS]
        stale.update(engine.refresh(target, cache, n, pending + question, zip(starts, translated), refresh, neutral,
                                    "contrast", stop_ids=fmt.stop_ids, defer=engine.fuse_feed))
        sync(device)
    t3 = time.perf_counter()
    _, logits = feed(target.model, cache, n, pending + question, stale=stale)
    int(logits[-1].argmax())  # the first token, on the host
    t4 = time.perf_counter()
    split["translate"], split["assemble"], split["scoring"], split["first_token"] = t1 - t0, t2 - t1, t3 - t2, t4 - t3
    split["total"] = t4 - t0
    return split


def first_token_native(engine: CAG, target: LoadedModel, fmt: PromptFormat, chunks: list[str], question: list[int],
                       device: str) -> dict[str, float]:
    t0 = time.perf_counter()
    cache, n, pending = engine.prefill_native(target, fmt, chunks)
    sync(device)
    t1 = time.perf_counter()
    _, logits = feed(target.model, cache, n, pending + question)
    int(logits[-1].argmax())
    t2 = time.perf_counter()
    return {"prefill": t1 - t0, "first_token": t2 - t1, "total": t2 - t0}


def run_length(engine, tr, source, target, text: str, n_tokens: int, chunk_tokens: int, repeats: int, warmup: int,
               device: str, refresh: list[float], profile: Path | None = None) -> dict:
    context = context_of(text, source.tokenizer, n_tokens)
    chunks = [c.text for c in chunk_text(context, source.tokenizer, chunk_tokens)]
    with torch.inference_mode():
        blocks = prefill_chunks(source, chunks)
    blocks = [dataclasses.replace(b, keys=b.keys.cpu(), values=b.values.cpu()) for b in blocks]  # as the store returns them
    fmt = PromptFormat.for_model(target)
    question = fmt.question_suffix_ids(QUESTION)
    modes = {mode_name(f): f for f in refresh}
    times: dict[str, list[dict[str, float]]] = {m: [] for m in [*modes, "native"]}
    with torch.inference_mode():
        for i in range(warmup + repeats):
            for mode, fraction in modes.items():
                split = first_token_translated(engine, tr, target, fmt, blocks, question, device, fraction)
                if i >= warmup:
                    times[mode].append(split)
            split = first_token_native(engine, target, fmt, chunks, question, device)
            if i >= warmup:
                times["native"].append(split)
        if profile is not None:  # one more translated first token under the profiler: where its time goes
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as profiler

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
            with profiler(activities=acts) as prof:
                first_token_translated(engine, tr, target, fmt, blocks, question, device)
            events = prof.key_averages()
            launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
            with profile.open("a") as f:
                f.write(f"== {n_tokens} tokens, {len(chunks)} chunks: {sum(e.count for e in events if e.key.startswith('aten::'))} "
                        f"aten calls, {launches} kernel launches\n")
                f.write(events.table(sort_by="self_cuda_time_total" if device.startswith("cuda") else "self_cpu_time_total",
                                     row_limit=25) + "\n")
    med = {mode: {k: statistics.median(r[k] for r in rows) * 1e3 for k in rows[0]} for mode, rows in times.items()}
    spread = {mode: [round(min(r["total"] for r in rows) * 1e3, 2), round(max(r["total"] for r in rows) * 1e3, 2)]
              for mode, rows in times.items()}
    target_tokens = len(fmt.prompt_ids(chunks, QUESTION))
    return {"length": n_tokens, "chunks": len(chunks), "canonical_tokens": sum(b.num_tokens for b in blocks),
            "target_prompt_tokens": target_tokens, "ms": {m: {k: round(v, 2) for k, v in d.items()} for m, d in med.items()},
            "total_range_ms": spread,
            "native_over": {m: round(med["native"]["total"] / med[m]["total"], 2) for m in modes}}


def mode_name(fraction: float) -> str:
    return "r0" if fraction == 0 else f"refresh{fraction:g}"


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [f"# Time to first token on {meta['device_name']}: translate (r = 0) vs native prefill", "",
             f"`{meta['command']}`", "",
             f"{meta['device_name']}, {meta['dtype']}, torch {meta['torch']}, transformers {meta['transformers']}; "
             f"{meta['weights']}; translator linear path {meta['linear_dtype']}, folded; chunks of "
             f"{meta['chunk_tokens']} canonical tokens; median of {meta['repeats']} alternating repeats after "
             f"{meta['warmup']} warm-ups; {meta['date']}.", "",
             "| canonical tokens | chunks | mode | translate / assemble / scoring / first token = total ms | "
             "native: prefill / first token = total ms | native / mode |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        n = r["ms"]["native"]
        for mode, ratio in r["native_over"].items():
            t = r["ms"][mode]
            lines.append(f"| {r['length']} | {r['chunks']} | {mode} | {t['translate']:.1f} / {t['assemble']:.1f} / "
                         f"{t['scoring']:.1f} / {t['first_token']:.1f} = **{t['total']:.1f}** | {n['prefill']:.1f} / "
                         f"{n['first_token']:.1f} = **{n['total']:.1f}** | **{ratio}x** |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--canonical", required=True, help="zoo name or model folder (config + tokenizer with --random-weights)")
    ap.add_argument("--target", required=True)
    ap.add_argument("--translator", required=True, help="translator artifact folder")
    ap.add_argument("--random-weights", action="store_true", help="build both models from their configs (see doc)")
    ap.add_argument("--lengths", default="512,2048,8192")
    ap.add_argument("--refresh", default="0", help="translated modes: shares of the chunk tokens refreshed "
                                                    "(0 = r = 0; 0.5 = the Qwen2.5 card's default, contrast scoring)")
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--text", type=Path, nargs="*", default=[DEFAULT_TEXT])
    ap.add_argument("--profile", type=Path, help="append a torch profiler table of one translated first token per length")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--markdown", type=Path)
    a = ap.parse_args()
    import transformers

    dtype = getattr(torch, a.dtype)
    tr = load_translator(a.translator)
    tr.set_linear_path(dtype)
    if a.random_weights:
        source = random_model(a.canonical, tr.source_fingerprint, dtype, a.device)
        target = random_model(a.target, tr.target_fingerprint, dtype, a.device)
    else:
        source, target = real_model(a.canonical, dtype, a.device), real_model(a.target, dtype, a.device)
    engine = CAG(store=None, canonical=source.name, dtype=dtype)
    text = read_text(a.text)
    rows = []
    for n in (int(v) for v in a.lengths.split(",")):
        row = run_length(engine, tr, source, target, text, n, a.chunk_tokens, a.repeats, a.warmup, a.device,
                         [float(f) for f in a.refresh.split(",")], a.profile)
        rows.append(row)
        print(json.dumps(row), flush=True)
    name = torch.cuda.get_device_name(a.device) if a.device.startswith("cuda") else (platform.processor() or "cpu")
    meta = {"device": a.device, "device_name": name, "dtype": a.dtype, "torch": torch.__version__,
            "transformers": transformers.__version__, "linear_dtype": str(tr.linear_dtype).replace("torch.", ""),
            "weights": "random weights from the models' configs (times only)" if a.random_weights else "real weights",
            "chunk_tokens": a.chunk_tokens, "repeats": a.repeats, "warmup": a.warmup,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": "python benchmarks/ttft_device.py " + " ".join(
                f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in vars(a).items()
                if v is not None and v is not False and k not in ("out", "markdown", "text", "profile"))}
    table = markdown(meta, rows)
    print(table)
    if a.out:
        a.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    if a.markdown:
        a.markdown.write_text(table)


if __name__ == "__main__":
    main()
