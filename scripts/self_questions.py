"""Write training samples with a question a model wrote about each chunk (cagkv.translate.selfqa).

The chunks and their built-in continuations are drawn as `cagkv train` draws them (same
corpora, count, seed, sizes and kinds), so with the same settings the chunks are those of
the corpus pairs; each sample gains a "selfq" continuation where the model's reply parses.
One JSON line per sample, appended as it is written: a run cut short resumes where it stopped.
Train on the file with `{"samples_file": OUT}` in `cagkv train --config`.

Example:
    python scripts/self_questions.py --model gemma3-270m --corpus wiki --samples 700 \
        --out ~/.cache/cagkv/corpora/wiki_selfq_gemma3.jsonl
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from cagkv.models import load
from cagkv.translate.corpus import load_documents, make_samples
from cagkv.translate.selfqa import add_self_questions, sample_to_json


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="the model that writes the questions (usually the target)")
    p.add_argument("--corpus", default="wiki", help="comma-separated corpora, as `cagkv train --corpus`")
    p.add_argument("--samples", type=int, default=700)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunk-chars", default="300,520")
    p.add_argument("--kinds", default="follows,blank", help="built-in continuations kept beside the question")
    p.add_argument("--only-questions", action="store_true", help="keep only the written question per chunk")
    p.add_argument("--max-new-tokens", type=int, default=32, help="for the question (half for the answer)")
    p.add_argument("--batch", type=int, default=8, help="chunks per generation pass")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    lo, hi = (int(x) for x in args.chunk_chars.split(","))
    samples = make_samples(load_documents(args.corpus.split(",")), args.samples, seed=args.seed, chars=(lo, hi),
                           kinds=tuple(k for k in args.kinds.split(",") if k))
    out = args.out.expanduser()
    done = [json.loads(line)["text"] for line in out.read_text().splitlines() if line.strip()] if out.is_file() else []
    if done != [s.text for s in samples[: len(done)]]:
        raise SystemExit(f"{out} holds other chunks than these settings draw; give another --out")
    loaded = load(args.model)
    out.parent.mkdir(parents=True, exist_ok=True)
    t0, asked, parsed = time.time(), 0, 0
    with out.open("a") as f:

        def write(i: int, s) -> None:  # noqa: ANN001
            nonlocal asked, parsed
            asked += 1
            parsed += any(c.kind == "selfq" for c in s.conts)
            f.write(sample_to_json(s) + "\n")
            f.flush()
            if asked % 10 == 0 or len(done) + asked == len(samples):
                print(f"{len(done) + asked}/{len(samples)} chunks, {parsed}/{asked} questions parsed, "
                      f"{time.time() - t0:.0f}s", flush=True)

        add_self_questions(loaded, samples[len(done):], args.max_new_tokens, progress=write,
                           only_questions=args.only_questions, batch=args.batch)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
