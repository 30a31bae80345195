"""The evaluation run: every sampled question answered in every mode from one store.

    run_eval(config)
      load_dataset                      seeded sample of the JSONL file
      ingest_contexts                   real ingest path, each distinct context once
      for example, mode:                (skipping rows a partial results file already has)
        evaluate_example
          CAG.prepare                   retrieve -> load -> translate -> assemble
          answer_logprob                teacher-forced gold answer after the mode's cache
          CAG.generate                  greedy answer, TTFT split
      evaluate_kl_text                  --kl-text: continuation KL against native prefill
      build_report                      means, intervals, recovery

Rows are appended to `<out>.partial.jsonl` as they are produced; a rerun with the same
settings skips them (the sample of N is a prefix of the sample of M > N, so `--limit`
may grow and `--modes` may gain modes between runs).

Shards (`shard=(K, N)`, `--shard K/N`) split one run over processes: shard K answers the
examples at positions K-1, K-1+N, ... of the sample into `<out>.shardKofN.partial.jsonl`
(its own store too), skipping rows any other file already holds, and writes no report; a
run without `--shard` then collects every shard's rows and writes it.
"""

from __future__ import annotations

import copy
import glob
import hashlib
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from cagkv.errors import UsageError
from cagkv.eval.datasets import Example, load_dataset, unique_contexts
from cagkv.eval.metrics import answer_span, exact_match, token_f1
from cagkv.eval.report import TIMING_KEYS, build_report, to_markdown
from cagkv.models.layers import LAYER_WORDS, parse_bias_scope
from cagkv.refresh import SCORINGS

if TYPE_CHECKING:
    import torch

    from cagkv.pipeline import CAG

TTFT_KEYS = TIMING_KEYS[:-1]  # every phase up to the first token
BASELINES = ("none", "native")


# a translated eval mode, "NAME=" + this in --modes (`variant_spec` reads it)
VARIANT_SYNTAX = "[TRANSLATOR_DIR][@REPLAY|@window|@refreshF[:SCORING][+shift]][+biasB[+answerK]|+qbiasB][+sliding|+full][+rest:KIND][+hardF][+fitted]"


@dataclass
class EvalConfig:
    """Everything that decides an evaluation's numbers (and where they go)."""

    dataset: str
    canonical: str
    target: str
    modes: list[str] = field(default_factory=lambda: ["none", "native", "canonical"])
    limit: int | None = None
    seed: int = 0
    max_context_chars: int | None = None  # only examples with contexts this short (None: all)
    retrieval: str = "oracle"
    top_k: int = 3
    max_new_tokens: int = 32
    replay: int = 0
    chunk_tokens: int = 256
    kl_text: str | None = None
    kl_windows: int = 16
    kl_context_tokens: int = 192
    kl_continuation_tokens: int = 48
    dtype: str = "float32"  # the target answers in this dtype (the engine's default)
    device: str = "cpu"  # where the models run: the engine (`CAG(device=)`) and the ingest
    # canonical prefill at ingest: float32 here (exact, and bf16 matmuls are slow on this CPU);
    # `cagkv ingest` defaults to bfloat16
    ingest_dtype: str = "float32"
    embedder: str | None = None  # store embedder (None: the store default, MiniLM)
    out: str | None = None
    markdown: str | None = None
    store: str | None = None  # keep the eval store here (reused by a rerun); temporary if None
    n_boot: int = 2000
    command: str | None = None
    shard: tuple[int, int] | None = None  # (K, N): only every N-th example from the K-th (1-based)

    variants: dict[str, str] = field(default_factory=dict)  # label -> a spec in VARIANT_SYNTAX

    def __post_init__(self) -> None:
        # "NAME=" + VARIANT_SYNTAX in --modes: a translated row labelled NAME, with
        # the artifact at PATH (default: the installed translator), replay R, mot-window, or
        # translate with the question's share F of the chunk tokens recomputed
        labels = []
        for mode in self.modes:
            label, sep, spec = mode.partition("=")
            if sep:
                if not label or not spec:
                    raise UsageError(f"--modes: expected NAME={VARIANT_SYNTAX}, got {mode!r}")
                variant_spec(spec)  # fails early on a bad spec
                self.variants[label] = spec
            labels.append(label)
        self.modes = labels
        if self.retrieval not in ("oracle", "open"):
            raise UsageError(f"--retrieval: expected one of oracle, open, got {self.retrieval!r}")
        if not self.modes:
            raise UsageError("--modes: give at least one mode")
        if len(set(self.modes)) != len(self.modes):
            raise UsageError(f"--modes: duplicate mode in {','.join(self.modes)}")
        if "auto" in self.modes:
            raise UsageError("--modes: 'auto' is not a fixed mode; name the modes to compare")
        if self.shard is not None:
            k, n = self.shard
            if not 1 <= k <= n:
                raise UsageError(f"--shard: expected K/N with 1 <= K <= N, got {k}/{n}")
            if not self.out:
                raise UsageError("--shard needs --out: the shards' rows meet in files next to it")
        from cagkv.models.loading import parse_device

        self.device = str(parse_device(self.device))  # "auto" resolved: the header says where rows ran

    def header(self) -> dict[str, Any]:
        """Settings a resumed run must share with the rows it reuses. Not limit, modes or
        max_context_chars: they choose which rows run, not what a row holds."""
        keys = ("dataset", "canonical", "target", "seed", "retrieval", "top_k", "max_new_tokens",
                "replay", "chunk_tokens", "dtype", "ingest_dtype", "embedder", "kl_text", "kl_windows", "kl_context_tokens",
                "kl_continuation_tokens")
        head = {k: getattr(self, k) for k in keys}
        head["dataset"] = str(Path(self.dataset).name)
        if self.device != "cpu":  # files written before the option (all on the CPU) still resume
            head["device"] = self.device
        return head


# ---------------------------------------------------------------------- partial results


def parse_shard(text: str) -> tuple[int, int]:
    """`"K/N"` -> (K, N), checked by EvalConfig."""
    k, _, n = text.partition("/")
    try:
        return int(k), int(n)
    except ValueError:
        raise UsageError(f"--shard: expected K/N such as 1/2, got {text!r}") from None


def partial_path_for(out: Path, shard: tuple[int, int] | None) -> Path:
    """Where a run (or one shard of it) appends its finished rows."""
    tag = "" if shard is None else f".shard{shard[0]}of{shard[1]}"
    return out.with_name(f"{out.name}{tag}.partial.jsonl")


def _row_settings(header: Any) -> Any:
    """A stored header less the keys that only selected examples (files written before
    max_context_chars left the header still resume)."""
    if not isinstance(header, dict):
        return header
    return {k: v for k, v in header.items() if k != "max_context_chars"}


class PartialResults:
    """Append-only JSONL of finished rows (`kind` qa or kl) under a settings header."""

    def __init__(self, path: Path | None, header: dict[str, Any]) -> None:
        self.path = path
        self.header = header
        self.qa: dict[tuple[str, str], dict[str, Any]] = {}
        self.kl: dict[tuple[str, int], dict[str, Any]] = {}

    @classmethod
    def open(cls, path: Path | None, header: dict[str, Any], final: Path | None = None,
             others: Sequence[Path] = ()) -> PartialResults:
        """Load rows of an earlier run with the same header: from `final` (a finished
        results JSON), from `others` (other shards' files, read only) and from `path`; rows
        made with other settings raise `UsageError`."""
        results = cls(path, header)
        if final is not None:
            results.load_final(final)
        if path is not None and path.is_file():
            results._load_rows(path)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("w", encoding="utf-8") as handle:  # rewrite clean (drops a torn line)
                handle.write(json.dumps({"header": header}) + "\n")
                for row in [*results.qa.values(), *results.kl.values()]:
                    handle.write(json.dumps(row) + "\n")
        for other in others:  # after the rewrite: their rows are skipped here, not copied
            if other != path and other.is_file():
                results._load_rows(other)
        return results

    def load_final(self, final: Path) -> None:
        """Remember the rows of a finished results JSON written with this header (others are ignored)."""
        if not final.is_file():
            return
        try:
            done = json.loads(final.read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            return
        if isinstance(done, dict) and _row_settings(done.get("config", {}).get("header")) == self.header:
            for row in done.get("examples", []):
                self.qa[(row["id"], row["mode"])] = row
            for row in done.get("kl_rows", []):
                self.kl[(row["mode"], int(row["window"]))] = row

    def _load_rows(self, path: Path) -> None:
        """Remember the rows of a partial file written with this header."""
        lines = path.read_text(encoding="utf-8").splitlines()
        if not lines:
            return
        first = json.loads(lines[0])
        if _row_settings(first.get("header")) != self.header:
            raise UsageError(
                f"{path} holds rows made with other settings ({first.get('header')}); "
                "delete it or give another --out"
            )
        for line in lines[1:]:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                break  # a line cut short (an interruption, or a shard writing it now): recompute from here
            self._remember(row)

    def _remember(self, row: dict[str, Any]) -> None:
        if row.get("kind") == "kl":
            self.kl[(row["mode"], int(row["window"]))] = row
        else:
            self.qa[(row["id"], row["mode"])] = row

    def add(self, row: dict[str, Any]) -> None:
        self._remember(row)
        if self.path is not None:
            with self.path.open("a", encoding="utf-8") as handle:
                handle.write(json.dumps(row) + "\n")
                handle.flush()
                os.fsync(handle.fileno())


# ---------------------------------------------------------------------- ingest


def ingest_contexts(store: Any, texts: Sequence[str], config: EvalConfig, prefix: str = "ctx",
                    progress: bool = False) -> list[str]:
    """Ingest each text once through the real ingest path (chunk, canonical prefill, store);
    returns the document id of each text."""
    from cagkv.ingest import ingest_text, parse_dtype
    from cagkv.models import load

    loaded = load(config.canonical, dtype=parse_dtype(config.ingest_dtype), device=config.device)
    ids = []
    for text in _progress_iter(texts, f"ingest {prefix}", progress):
        # the source names the text by its hash, so a kept --store is reused safely
        source = f"cagkv-eval:{prefix}:{hashlib.sha256(text.encode('utf-8')).hexdigest()[:20]}"
        result = ingest_text(store, text, source, loaded=loaded, chunk_tokens=config.chunk_tokens)
        ids.append(str(result.document_id))
    return ids


# ---------------------------------------------------------------------- modes -> engine calls


class Variant(NamedTuple):
    path: str  # artifact folder, "" for the installed translator
    replay: int | None  # None: the translator's default
    window: bool  # mot-window instead of translate
    refresh: float = 0.0  # share of the chunk tokens the target recomputes (cagkv.refresh)
    refresh_scoring: str | None = None  # how they are chosen (cagkv.refresh.SCORINGS); None: the card's
    refresh_shift: bool = False  # the rest of each block moved by its refreshed tokens' mean change
    attention_bias: float | None = None  # added to the translated tokens' attention logits; None: the card's
    bias_scope: str | None = None  # None: all, or the card's scope for its own bias; else parse_bias_scope's words


def _scope_word(flag: str, usage: str) -> str:
    """`flag` where the bias-scope parser takes it as a scope word, else a UsageError saying `usage`."""
    try:
        parse_bias_scope(flag)
    except ValueError:
        raise UsageError(f"--modes: {usage}, got {flag!r}") from None
    return flag


def _flags(text: str) -> tuple[bool, float | None, str | None]:
    """"shift" / "biasB" / "qbiasB" / "answerK" / "sliding" / "full" / "rest:KIND" flags (each
    after a "+") -> (shift, attention bias or None, its scope: None (every token, or the card's
    scope for the card's bias), "question" for qbias, "answerK" for the question's and the first
    K answer tokens', with ",sliding" / ",full" for the layers of that attention kind only and
    ",rest:KIND" for the answer's later tokens in the layers of KIND, ",hardF" for the share F of the
    translated tokens the difficulty table ranks hardest, ",fitted" for the bias scaled per layer and
    head by the translator's fitted table: cagkv.models.layers.parse_bias_scope)."""
    shift, bias, scope, answer, layers, rest, hard, fitted = False, None, None, None, None, None, None, False
    for flag in text.split("+") if text else []:
        if flag == "shift":
            shift = True
        elif flag == "fitted":
            fitted = True
        elif flag in LAYER_WORDS:
            layers = flag
        elif flag.startswith("rest:") and flag[len("rest:"):] in LAYER_WORDS:
            rest = flag
        elif flag.startswith("hard"):
            hard = _scope_word(flag, "+hardF takes a share in (0, 1], as in +hard0.33")
        elif flag.startswith("answer"):
            answer = _scope_word(flag, "+answerK takes a count of answer tokens, as in +answer4")
        elif flag.startswith(("bias", "qbias")):
            name = "qbias" if flag.startswith("qbias") else "bias"
            try:
                bias = float(flag[len(name):])
            except ValueError:
                raise UsageError(f"--modes: +{name}B takes a number, as in +{name}0.5, got {flag!r}") from None
            if not math.isfinite(bias):
                raise UsageError(f"--modes: +{name}B takes a finite number, got {flag!r}")
            scope = "question" if name == "qbias" else None
        else:
            raise UsageError(f"--modes: flags after + are 'shift', 'biasB', 'qbiasB', 'answerK', 'sliding', 'full' and "
                             f"'rest:sliding' / 'rest:full', 'hardF' and 'fitted', got {flag!r}")
    if answer is not None:
        if scope == "question":
            raise UsageError("--modes: +qbiasB is the question only; +answerK goes with +biasB")
        scope = answer
    if layers is not None:
        scope = f"{scope or 'all'},{layers}"
    if rest is not None:
        if scope is None or scope.startswith("all"):
            raise UsageError(f"--modes: +{rest} names the answer's tokens after +qbiasB or +answerK")
        scope = f"{scope},{rest}"
    if hard is not None:
        scope = f"{scope or 'all'},{hard}"
    if fitted:
        scope = f"{scope or 'all'},fitted"
    return shift, bias, scope


def variant_spec(spec: str) -> Variant:
    """A spec in `VARIANT_SYNTAX` -> the Variant it names."""
    path, sep, mod = spec.rpartition("@") if "@" in spec else (spec, "", "")
    if not sep:
        return Variant(path, None, False)
    mod, _, flags = mod.partition("+")
    shift, bias, scope = _flags(flags)
    if shift and not mod.startswith("refresh"):
        raise UsageError(f"--modes: +shift moves what a refresh leaves translated: it needs @refreshF, got {spec!r}")
    if mod == "window":
        if bias is not None:
            raise UsageError(f"--modes: +biasB acts on translated tokens, not on @window, got {spec!r}")
        return Variant(path, None, True)
    if mod.startswith("refresh"):
        fraction, _, scoring = mod[len("refresh"):].partition(":")
        try:
            refresh = float(fraction)
        except ValueError:
            raise UsageError(f"--modes: @refresh takes a fraction, as in @refresh0.33, got {mod!r}") from None
        if not 0 < refresh <= 1:
            raise UsageError(f"--modes: @refresh takes a fraction in (0, 1], got {refresh}")
        if scoring and scoring not in SCORINGS:
            raise UsageError(f"--modes: @refresh{fraction}:SCORING takes one of {', '.join(SCORINGS)}, got {scoring!r}")
        return Variant(path, 0, False, refresh, scoring or None, shift, bias, scope)
    try:
        replay = int(mod)
    except ValueError:
        raise UsageError(f"--modes: after @ expected a replay count, 'window' or 'refreshF', got {mod!r}") from None
    if replay < 0:
        raise UsageError(f"--modes: replay must be >= 0, got {replay}")
    return Variant(path, replay, False, attention_bias=bias, bias_scope=scope)


class ModeRunner:
    """Maps an eval mode to an engine call: engine modes (none, native, canonical,
    translate, mot-window) as they are; a `NAME=` + `VARIANT_SYNTAX` variant runs
    `translate` (replay R, or refresh F) or `mot-window` with the artifact at PATH (default:
    the installed one), e.g. the `linear` baseline, a single-expert ablation or one point of
    the replay curve."""

    def __init__(self, engine: CAG, config: EvalConfig) -> None:
        self.engine = engine
        self.config = config
        self._variants: dict[str, CAG] = {}

    def engine_for(self, mode: str) -> tuple[CAG, str, Variant | None]:
        if mode not in self.config.variants:
            return self.engine, mode, None
        variant = variant_spec(self.config.variants[mode])
        path, engine_mode = variant.path, "mot-window" if variant.window else "translate"
        if not path:
            return self.engine, engine_mode, variant
        if mode not in self._variants:
            from cagkv.pipeline import CAG

            base = self.engine
            self._variants[mode] = CAG(base.store, canonical=base.canonical, dtype=base.dtype,
                                       find_translator=_artifact_loader(path), device=base.device)
        return self._variants[mode], engine_mode, variant

    def prepare(self, mode: str, question: str, document_ids: list[str] | None,
                top_k: int | None = None) -> tuple[CAG, Any]:
        engine, engine_mode, variant = self.engine_for(mode)
        replay = None if variant is None else variant.replay
        if replay is None:
            replay = self.config.replay if engine_mode == "translate" else 0
        prepared = engine.prepare(question, target=self.config.target, mode=engine_mode,
                                  top_k=top_k or self.config.top_k, replay=replay,
                                  document_ids=document_ids, refresh=0.0 if variant is None else variant.refresh,
                                  refresh_scoring=None if variant is None else variant.refresh_scoring,
                                  refresh_shift=None if variant is None else variant.refresh_shift,
                                  attention_bias=None if variant is None else variant.attention_bias,
                                  attention_bias_scope=None if variant is None else variant.bias_scope)
        return engine, prepared


def _artifact_loader(path: str) -> Callable[[str, str], Any]:
    """find_translator for one artifact folder, loaded once."""
    loaded: dict[tuple[str, str], Any] = {}

    def find(source_fp: str, target_fp: str) -> Any:
        if (source_fp, target_fp) not in loaded:
            from cagkv.translate import load_translator

            loaded[(source_fp, target_fp)] = load_translator(path, source_fp, target_fp)
        return loaded[(source_fp, target_fp)]

    return find


def _cached_finder() -> Callable[[str, str], Any]:
    """`cagkv.translate.find_translator`, loading each pair's artifact once per run."""
    found: dict[tuple[str, str], Any] = {}

    def find(source_fp: str, target_fp: str) -> Any:
        if (source_fp, target_fp) not in found:
            try:
                from cagkv.translate import find_translator
            except ImportError:
                return None
            found[(source_fp, target_fp)] = find_translator(source_fp, target_fp)
        return found[(source_fp, target_fp)]

    return find


# ---------------------------------------------------------------------- one example


def answer_ids(tokenizer: Any, prompt_ids: Sequence[int], answer: str) -> list[int]:
    """The gold answer's token ids as the model would write them after the prompt.

    After a prompt ending in whitespace (chat templates end with a newline) the answer
    starts bare; after "Answer:" it starts with a space, as a model writes it.
    """
    tail = tokenizer.decode(list(prompt_ids)[-3:]) if prompt_ids else ""
    text = answer.strip() if (not tail or tail[-1].isspace()) else " " + answer.strip()
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def continuation_logits(prepared: Any, ids: Sequence[int]) -> torch.Tensor:
    """Logits [T, V] of the target over `ids` placed after a copy of the prepared cache
    (its stale entries computed in the same forward, its attention bias applied, as `generate` does)."""
    import torch

    from cagkv.refresh import feed

    cache = copy.deepcopy(prepared.cache)  # generate() will mutate the original
    with torch.inference_mode():
        _, logits = feed(prepared.target.model, cache, prepared.next_position, ids,
                         getattr(prepared, "stale", None), keep=0, bias=getattr(prepared, "bias", None))
    return logits.float()  # [T, V]


def answer_logprob(prepared: Any, answer: str) -> float:
    """Mean log-probability per token of `answer`, teacher-forced after the prompt."""
    import torch

    prompt = list(prepared.prompt_ids)
    gold = answer_ids(prepared.target.tokenizer, prompt, answer)
    if not gold:
        return math.nan
    logits = continuation_logits(prepared, prompt + gold)  # [P + A, V]
    # the logits at position i predict token i + 1: the answer is predicted from P - 1 on
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)  # [A, V]
    picked = logp.gather(1, torch.tensor(gold, device=logp.device).unsqueeze(1)).squeeze(1)  # [A]
    return float(picked.mean())


def evaluate_example(runner: ModeRunner, example: Example, mode: str, config: EvalConfig,
                     document_id: str | None) -> dict[str, Any]:
    """One row: prepare the mode's cache, score the gold answer, decode the greedy answer."""
    restrict = [document_id] if (config.retrieval == "oracle" and document_id is not None) else None
    engine, prepared = runner.prepare(mode, example.question, restrict)
    t0 = time.perf_counter()
    logprob = answer_logprob(prepared, example.answers[0])
    # the engine measures first_token from prepared.started: leave the scoring time out
    prepared.started += time.perf_counter() - t0
    answer = engine.generate(prepared, max_new_tokens=config.max_new_tokens)
    prediction = answer_span(answer.text)
    timings = {k: round(float(v), 2) for k, v in answer.timings_ms.items() if v is not None}
    documents = [str(s.document) for s in answer.sources]
    return {
        "kind": "qa",
        "id": example.id,
        "mode": mode,
        "resolved_mode": getattr(prepared, "mode", mode),
        "translator": config.variants.get(mode),
        "prediction": prediction,
        "answer": answer.text[:200],
        "em": exact_match(prediction, example.answers),
        "f1": round(token_f1(prediction, example.answers), 4),
        "answer_logprob": None if math.isnan(logprob) else round(logprob, 4),
        # the engine's first_token is measured from the start of prepare: it is the TTFT
        "ttft_ms": timings.get("first_token", round(sum(timings.get(k, 0.0) for k in TTFT_KEYS), 2)),
        "timings_ms": timings,
        "tokens": dict(getattr(answer, "tokens", {}) or {}),
        "sources": documents,
        "retrieval_hit": None if mode == "none" else (str(document_id) in documents),
    }


def warm_up(runner: ModeRunner, example: Example, config: EvalConfig, document_id: str,
            modes: list[str]) -> None:
    """One untimed answer per mode, so model and translator loading are not counted as TTFT."""
    restrict = [document_id] if config.retrieval == "oracle" else None
    for mode in modes:
        engine, prepared = runner.prepare(mode, example.question, restrict)
        engine.generate(prepared, max_new_tokens=1)


# ---------------------------------------------------------------------- KL on real text


def kl_windows(text: str, tokenizer: Any, context_tokens: int, count: int) -> list[tuple[str, str]]:
    """(context, continuation) pairs of consecutive chunks of held-out text."""
    from cagkv.chunking import chunk_text

    chunks = [c.text for c in chunk_text(text, tokenizer, max_tokens=context_tokens) if c.text.strip()]
    pairs = [(chunks[i], chunks[i + 1]) for i in range(0, len(chunks) - 1, 2)]
    return pairs[:count]


def evaluate_kl_text(engine_factory: Callable[[Any], CAG], store_factory: Callable[[Path], Any],
                     config: EvalConfig, workdir: Path, results: PartialResults,
                     progress: bool = True) -> None:
    """Mean next-token KL(native || mode) of the target on continuations of real text."""
    import torch

    from cagkv.models import load

    assert config.kl_text is not None
    path = Path(config.kl_text)
    if not path.is_file():
        raise UsageError(f"--kl-text file not found: {path}")
    pairs = kl_windows(path.read_text(encoding="utf-8"), load(config.canonical).tokenizer,
                       config.kl_context_tokens, config.kl_windows)
    if not pairs:
        raise UsageError(f"--kl-text {path}: too short for one context/continuation window")
    todo = [(w, m) for w in range(len(pairs)) for m in config.modes if (m, w) not in results.kl]
    if not todo:
        return
    store = store_factory(workdir / "kl_store")
    doc_ids = ingest_contexts(store, [c for c, _ in pairs], config, prefix="kl", progress=progress)
    runner = ModeRunner(engine_factory(store), config)
    bar = _progress(len(todo), "kl-text", progress)
    for w, (_, continuation) in enumerate(pairs):
        modes = [m for m in config.modes if (m, w) not in results.kl]
        if not modes:
            continue
        native = _window_logits(runner, "native", doc_ids[w], continuation, config)
        ref = torch.log_softmax(native, dim=-1)  # [T, V]
        for mode in modes:
            logits = native if mode == "native" else _window_logits(runner, mode, doc_ids[w], continuation, config)
            logp = torch.log_softmax(logits, dim=-1)
            kl = (ref.exp() * (ref - logp)).sum(-1).mean()  # mean over positions of KL(native || mode)
            results.add({"kind": "kl", "mode": mode, "window": w, "kl": round(float(kl), 5)})
            bar.update(1)
    bar.close()


def _window_logits(runner: ModeRunner, mode: str, document_id: str, continuation: str,
                   config: EvalConfig) -> torch.Tensor:
    _, prepared = runner.prepare(mode, "Continue the text.", [document_id], top_k=8)
    ids = list(prepared.target.tokenizer(continuation, add_special_tokens=False)["input_ids"])
    ids = ids[: config.kl_continuation_tokens]
    return continuation_logits(prepared, ids)  # [T, V], no prompt suffix: the text goes on


# ---------------------------------------------------------------------- the run


def default_store_factory(config: EvalConfig) -> Callable[[Path], Any]:
    """`path -> CacheStore` for `config`'s canonical model (what `run_eval` uses unless given one)."""

    def make(path: Path) -> Any:
        from cagkv.ingest import parse_dtype
        from cagkv.models import load
        from cagkv.stores import CacheStore

        loaded = load(config.canonical, dtype=parse_dtype(config.ingest_dtype), device=config.device)
        return CacheStore.open(path, canonical=config.canonical, fingerprint=loaded.fingerprint,
                               embedder=config.embedder)

    return make


def default_engine_factory(config: EvalConfig) -> Callable[[Any], CAG]:
    """`store -> CAG` engine for `config` (what `run_eval` uses unless given one)."""

    def make(store: Any) -> CAG:
        from cagkv.pipeline import CAG

        return CAG(store, canonical=config.canonical, dtype=config.dtype, find_translator=_cached_finder(),
                   device=config.device)

    return make


def _progress_iter(items: Sequence[Any], desc: str, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(items, desc=desc, unit="doc", disable=not enabled, file=sys.stderr, dynamic_ncols=True)


def _progress(total: int, desc: str, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="row", disable=not enabled, file=sys.stderr,
                dynamic_ncols=True)


def run_eval(config: EvalConfig, progress: bool = True,
             engine_factory: Callable[[Any], CAG] | None = None,
             store_factory: Callable[[Path], Any] | None = None) -> dict[str, Any]:
    """Run (or resume) an evaluation and return its report; writes --out/--markdown files.

    `store_factory(path)` and `engine_factory(store)` default to `CacheStore.open(path,
    canonical=...)` and `CAG(store, canonical=...)`; tests pass tiny models and a hash embedder.
    """
    examples = load_dataset(config.dataset, config.limit, config.seed, config.max_context_chars)
    out = Path(config.out) if config.out else None
    partial_path = partial_path_for(out, config.shard) if out else None
    shard_files = sorted(out.parent.glob(f"{glob.escape(out.name)}.shard*of*.partial.jsonl")) if out else []
    others = [p for p in [partial_path_for(out, None), *shard_files] if p != partial_path] if out else []
    header = config.header()
    results = PartialResults.open(partial_path, header, final=out if config.shard is None else None, others=others)
    if config.shard is not None and out is not None:
        results.load_final(out)  # read only: a shard's file holds just the rows it answers
    store_name = "store"
    if config.shard is not None:
        k, n = config.shard
        examples = examples[k - 1 :: n]
        store_name = f"store.shard{k}of{n}"  # shards run side by side: each ingests into its own
    make_engine = engine_factory or default_engine_factory(config)
    make_store = store_factory or default_store_factory(config)
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    commit = git_commit()  # the code the rows are computed with: HEAD may move during a long run

    todo = [(e, m) for e in examples for m in config.modes if (e.id, m) not in results.qa]
    with tempfile.TemporaryDirectory(prefix="cagkv-eval-") as tmp:
        workdir = Path(config.store) if config.store else Path(tmp)
        if todo:
            store = make_store(workdir / store_name)
            doc_ids: dict[str, str] = {}

            def document_of(context: str) -> str:
                # oracle: ingest each context when first needed, so a run cut short has not
                # paid for the rest; open: every context is ingested before any question
                if context not in doc_ids:
                    doc_ids[context] = ingest_contexts(store, [context], config, prefix="ctx")[0]
                return doc_ids[context]

            if config.retrieval == "open":
                contexts = unique_contexts(examples)
                doc_ids.update(zip(contexts, ingest_contexts(store, contexts, config, progress=progress)))
            runner = ModeRunner(make_engine(store), config)
            # only the modes with rows left: a resumed run keeps the finished rows of a
            # translator whose folder is gone
            warm_up(runner, todo[0][0], config, document_of(todo[0][0].context),
                    list(dict.fromkeys(m for _, m in todo)))
            bar = _progress(len(todo), "eval", progress)
            for example, mode in todo:
                row = evaluate_example(runner, example, mode, config, document_of(example.context))
                # when and with which code: the report tells timings measured side by side from resumed ones
                row["measured"] = {"at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "commit": commit}
                results.add(row)
                bar.update(1)
            bar.close()
        if config.kl_text and config.shard is None:  # the KL windows run with the collecting run
            evaluate_kl_text(make_engine, make_store, config, workdir, results, progress)

    # in the sample's order whatever order the rows were answered in (shards, resumes): the
    # report, its bootstrap draws included, is the one a single uninterrupted run gives
    place = {e.id: k for k, e in enumerate(examples)}
    rows = sorted((r for (i, m), r in results.qa.items() if i in place and m in config.modes),
                  key=lambda r: place[r["id"]])
    kl_rows = [r for (m, _), r in results.kl.items() if m in config.modes]
    report = build_report(
        rows, dataset=Path(config.dataset).stem, canonical=config.canonical, target=config.target,
        modes=config.modes, kl_rows=kl_rows, n_boot=config.n_boot, seed=config.seed,
        config=_run_config(config, header, started, commit),
    )
    if config.shard is not None:
        return report  # this shard's examples only: the run without --shard writes the files
    # keep the partial files while they hold rows this report leaves out (a larger --limit ran)
    complete = len(rows) == len(results.qa) and len(kl_rows) == len(results.kl)
    _write_outputs(report, config, [partial_path, *shard_files] if complete else [])
    return report


def _run_config(config: EvalConfig, header: dict[str, Any], started: str, commit: str | None) -> dict[str, Any]:
    return {
        "header": header,
        "limit": config.limit,
        "max_context_chars": config.max_context_chars,
        "modes": list(config.modes),
        "seed": config.seed,
        "retrieval": config.retrieval,
        "command": config.command,
        "commit": commit,
        "machine": machine_description(config.device),
        "started": started,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }


def _write_outputs(report: dict[str, Any], config: EvalConfig, done_partials: Sequence[Path | None]) -> None:
    if config.out:
        out = Path(config.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(report, indent=1, allow_nan=False) + "\n", encoding="utf-8")
        os.replace(tmp, out)
        for partial_path in done_partials:
            if partial_path is not None and partial_path.exists():
                partial_path.unlink()  # every row it held is in the results file now
    if config.markdown:
        md = Path(config.markdown)
        md.parent.mkdir(parents=True, exist_ok=True)
        md.write_text(to_markdown(report), encoding="utf-8")


def git_commit() -> str | None:
    """The short commit of the checkout the code runs from, or None outside git."""
    try:
        root = Path(__file__).resolve().parents[2]
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=5, check=False)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def machine_description(device: str = "cpu") -> str:
    """The CPU, torch version, thread count and the translators' linear-path dtype a report
    was measured with (in the folded inference form, `cagkv.translate.folded`, since E56),
    and the GPU when the models ran on one."""
    import torch

    from cagkv.models.loading import parse_device
    from cagkv.translate.translator import linear_path_dtype

    cpus = os.cpu_count()
    linear = str(linear_path_dtype()).removeprefix("torch.")
    text = (f"{platform.machine()} {cpus}-core CPU, torch {torch.__version__}, "
            f"{torch.get_num_threads()} thread(s), translator linear path {linear}, folded")
    dev = parse_device(device)
    return text if dev.type == "cpu" else f"{text}; models on {torch.cuda.get_device_name(dev)}"


def command_line() -> str:
    """The command as typed, for the report."""
    return "cagkv " + " ".join(shlex.quote(a) for a in sys.argv[1:])


__all__ = ["EvalConfig", "ModeRunner", "run_eval", "evaluate_example", "answer_logprob", "answer_ids",
           "continuation_logits", "ingest_contexts", "PartialResults", "TIMING_KEYS", "default_store_factory",
           "default_engine_factory"]
