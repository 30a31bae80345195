"""The CAG engine: answer questions from stored KV caches.

    ask(question)            = prepare(...) + generate(...)
      prepare                  retrieve -> load -> translate -> assemble
        retrieve               store.search: top-k chunks for the question
        load                   store.load_blocks: the chunks' canonical KV blocks, placed
                               in reverse rank order (the best chunk next to the question)
        translate              canonical blocks -> target blocks (identity in `canonical`)
        assemble               target prefix (computed natively once per model) + blocks
                               rotated at their assembled positions, each followed by the
                               separator (computed natively) -> one HF cache
      generate                 prefill the question suffix natively, greedy decode; entries
                               still to compute (separators, refreshed tokens) go in the
                               same forward (`Prepared.stale`, `cagkv.refresh.feed`)

Modes:
    canonical   the target is the canonical model; stored blocks are used as they are.
    translate   a trained translator maps the canonical blocks to the target's KV;
                `replay=r` lets the target recompute its top r layers over the chunks
                (default: the translator card's measured `default_replay`);
                `refresh=f` lets it recompute the fraction f of the chunk tokens its
                question attends to most (by default beyond what a neutral prompt
                attends to: `refresh_scoring`, default the card's measured
                `default_refresh_scoring`, else contrast), through every layer (`cagkv.refresh`;
                default: the card's measured `default_refresh`, 0 where it names none).
    mot-window  the paper's reference inference (baseline): the target recomputes every
                layer over the chunks, attending over translated K/V in ~30 % of its layers.
    native      the target prefills the retrieved chunk text itself (the baseline).
    none        the question alone (prefix + suffix, no documents).
    auto        translate if a good-enough translator exists, else canonical when the
                target is the canonical model, else native; `Answer.mode` says which ran.

Example:
    >>> from cagkv.pipeline import CAG
    >>> cag = CAG.open()                                   # $CAGKV_HOME/store
    >>> answer = cag.ask("What does the pass statement do?", target="gemma3-270m")
    >>> print(answer.text, answer.mode, answer.timings_ms["first_token"])
    >>> for piece in cag.ask_stream("And break?"): print(piece, end="")
"""

from __future__ import annotations

import copy
import math
import os
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from cagkv.errors import StoreError, TranslatorError, UsageError
from cagkv.ingest import DEFAULT_CANONICAL, default_store_path, parse_dtype
from cagkv.models.layers import AttentionBias, BiasScope, decoder_of, forward_at, layer_types, parse_bias_scope
from cagkv.prompt import PromptFormat
from cagkv.refresh import DEFAULT_SCORING, NEEDS_DIFFICULTY, SCORINGS, feed, hardest_positions
from cagkv.stores.records import ChunksChangedError

if TYPE_CHECKING:
    from cagkv.kv import KVBlock
    from cagkv.models import LoadedModel

MODES = ("auto", "canonical", "translate", "mot-window", "native", "none")
TRANSLATED = ("translate", "mot-window")
FUSE_FEED_ENV = "CAGKV_FUSE_FEED"  # 0: separators and refreshed tokens in forwards of their own (E62)
TIMING_KEYS = ("retrieve", "load", "translate", "replay", "prefill", "first_token", "total")
# question-agnostic prompts that refresh scoring measures the question's attention against: "contrast"
# uses the first, "averaged" all (cagkv.refresh.score_positions; fixed before E49 ran)
NEUTRAL_QUESTIONS = ("What does the text say?", "What is this text about?", "Summarize the text.",
                     "What are the main facts in the text?")
_RETRIEVE_RETRIES = 5  # searches again when a concurrent writer removed a hit before its load


@dataclass(frozen=True)
class Source:
    """A retrieved chunk: its document id, chunk id, similarity score, text and origin."""

    document: str
    chunk: str
    score: float
    text: str
    source: str = ""  # the document's path / URI as ingested

    def to_dict(self) -> dict[str, Any]:
        return {"document": self.document, "chunk": self.chunk, "score": round(self.score, 4)}


@dataclass
class Answer:
    """What `ask` returns.

    Args:
        text: the generated answer.
        target: name of the model that answered.
        mode: the mode that ran (never "auto"); `mode_reason` says why auto chose it.
        sources: retrieved chunks, best first.
        timings_ms: retrieve, load, translate, replay, prefill, first_token, total.
        tokens: context (chunk tokens), prompt (all prompt tokens), generated.
    """

    text: str
    target: str
    mode: str
    sources: list[Source]
    timings_ms: dict[str, float]
    tokens: dict[str, int]
    mode_reason: str = ""
    token_ids: list[int] | None = None  # the generated ids (not in the JSON)

    def to_dict(self) -> dict[str, Any]:
        """The `cagkv ask --json` object."""
        return {
            "answer": self.text,
            "target": self.target,
            "mode": self.mode,
            "sources": [s.to_dict() for s in self.sources],
            "timings_ms": {k: round(v, 2) for k, v in self.timings_ms.items()},
        }


@dataclass
class Prepared:
    """Everything before the question suffix: the assembled cache and what built it.

    `cache` holds prefix + chunks (`next_position` tokens); `prompt_ids` (the question
    suffix) are not in it yet. `generate` feeds them and decodes. `stale` (position -> token
    id) names cache entries not computed yet (placeholders of chunk separators, translated
    tokens chosen for refresh): the forward that feeds `prompt_ids` computes them first
    (`cagkv.refresh.feed`), so they cost no read of the weights of their own.
    """

    target: LoadedModel
    mode: str
    cache: Any
    next_position: int
    prompt_ids: list[int]
    sources: list[Source]
    timings_ms: dict[str, float]
    fmt: PromptFormat
    context_tokens: int
    started: float  # perf_counter() when prepare began (first_token / total count from here)
    mode_reason: str = ""
    stale: dict[int, int] = field(default_factory=dict)
    bias: AttentionBias | None = None  # added to the attention logits of the tokens left translated


class AnswerStream:
    """Iterate for text pieces; `.answer` holds the Answer once the stream is exhausted.

    Iterating is a generator that *returns* the Answer, so `answer = yield from stream`
    works inside another generator.
    """

    def __init__(self, pieces: Generator[str, None, Answer]) -> None:
        self._pieces = pieces
        self.answer: Answer | None = None

    def __iter__(self) -> Generator[str, None, Answer]:
        self.answer = yield from self._pieces
        return self.answer

    @property
    def text(self) -> str:
        return self.answer.text if self.answer else ""


class CAG:
    """The engine bound to a store.

    Args:
        store: an open `cagkv.stores.CacheStore`.
        canonical: the canonical model name or folder (default: the store's, else smollm2-135m).
        dtype: dtype the models answer in (float32 by default; bfloat16 is about 2x faster).
        device: where the models run: "cpu" (default), "cuda", "cuda:N" or "auto" (a GPU
            where there is one). Stored blocks stay on the host and move to it per question.
        find_translator: `(canonical_fp, target_fp) -> Translator | None`; defaults to
            `cagkv.translate.find_translator` when that exists.

    `fuse_feed` (default True; `CAGKV_FUSE_FEED=0` sets False): chunk separators and
    refreshed tokens are computed in the question's own forward, one read of the weights
    instead of two (docs/EXPERIMENTS.md E62); False computes them in forwards of their own,
    as before (for side-by-side checks).
    """

    def __init__(
        self,
        store: Any,
        canonical: str | None = None,
        dtype: torch.dtype | str = torch.float32,
        find_translator: Callable[[str, str], Any] | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        from cagkv.models.loading import parse_device

        self.store = store
        self.canonical = canonical or _store_canonical(store) or DEFAULT_CANONICAL
        self.dtype = parse_dtype(dtype)
        self.device = parse_device(device)
        self._find_translator = find_translator
        self._formats: dict[str, PromptFormat] = {}
        self._embedder_warm = False
        self._prefixes: dict[tuple[str, str], tuple[Any, int]] = {}
        self._translators: dict[tuple[str, str], Any] = {}  # loaded once per (canonical, target)
        self._tokenizer_checked = False  # the store's canonical tokenizer hash, checked once
        self.fuse_feed = os.environ.get(FUSE_FEED_ENV, "1").strip() not in ("0", "false", "no")

    @classmethod
    def open(cls, path: str | None = None, db_url: str | None = None, **kwargs: Any) -> CAG:
        """A CAG over the existing store at `path` (default `$CAGKV_HOME/store`)."""
        from cagkv.stores import CacheStore

        where = path or default_store_path()
        try:
            store = CacheStore.open(where, db_url, create=False)
        except StoreError as e:
            raise StoreError(f"{e}: ingest documents first (cagkv ingest PATH --store {where})") from None
        return cls(store, **kwargs)

    # ------------------------------------------------------------------ public API
    def ask(
        self,
        question: str,
        target: str | None = None,
        mode: str = "auto",
        top_k: int = 3,
        max_new_tokens: int = 64,
        replay: int | None = None,
        document_ids: Sequence[Any] | None = None,
        refresh: float | None = None,
        refresh_scoring: str | None = None,
        attention_bias: float | None = None,
        attention_bias_scope: str | None = None,
    ) -> Answer:
        """Answer `question` with `target` (default: the canonical model) from the store;
        the options are `prepare`'s."""
        prepared = self.prepare(question, target, mode, top_k, replay, document_ids, refresh, refresh_scoring,
                                attention_bias=attention_bias, attention_bias_scope=attention_bias_scope)
        return self.generate(prepared, max_new_tokens)

    def ask_stream(
        self,
        question: str,
        target: str | None = None,
        mode: str = "auto",
        top_k: int = 3,
        max_new_tokens: int = 64,
        replay: int | None = None,
        document_ids: Sequence[Any] | None = None,
        refresh: float | None = None,
        refresh_scoring: str | None = None,
        attention_bias: float | None = None,
        attention_bias_scope: str | None = None,
    ) -> AnswerStream:
        """Like `ask`, but yields text pieces as they are decoded; see AnswerStream."""

        def run() -> Generator[str, None, Answer]:
            prepared = self.prepare(question, target, mode, top_k, replay, document_ids, refresh, refresh_scoring,
                                    attention_bias=attention_bias, attention_bias_scope=attention_bias_scope)
            return (yield from self._decode(prepared, max_new_tokens))

        return AnswerStream(run())

    def prepare(
        self,
        question: str,
        target: str | None = None,
        mode: str = "auto",
        top_k: int = 3,
        replay: int | None = None,
        document_ids: Sequence[Any] | None = None,
        refresh: float | None = None,
        refresh_scoring: str | None = None,
        refresh_shift: bool | None = None,
        attention_bias: float | None = None,
        attention_bias_scope: str | None = None,
    ) -> Prepared:
        """retrieve -> load -> translate -> assemble: the cache before the question suffix.

        `refresh_shift` (with `refresh`): also move each block's tokens left translated by its
        refreshed tokens' mean change (`CAG.refresh`); an experiment that lost 6.7 points
        (docs/EXPERIMENTS.md E84), off by default.
        `attention_bias` (mode translate): added to the attention logits of every chunk token
        left translated, for the question and the answer (docs/EXPERIMENTS.md E86-E88); None:
        the translator card's `attention_bias` where a refresh runs (what it was measured
        for: the tokens left translated against the refreshed ones), its `attention_bias_r0`
        for pure translation (no refresh, no replay), else 0. `attention_bias_scope`
        "question": for the question's tokens only, not the answer's (E86c); "answerK": for the
        question's and the first K answer tokens' (E88e); "all" (every one); after a comma,
        "sliding" or "full" keeps it to the layers of that attention kind, and after "question"
        or "answerK" a "rest:sliding" / "rest:full" gives the answer's later tokens the bias in
        those layers (E90; as in "all,sliding", "question,rest:full"); "hardF": on the share F of
        the translated tokens the translator's difficulty table ranks hardest (E92); "fitted": scaled
        in each layer and head by the translator's fitted attention table (E95); None: the
        card's scope for its own bias (`attention_bias_r0_scope` ...), else "all".
        Timings start after the one-time costs (loading models, the embedder and the
        translator), which a long-running process pays once.
        """
        question = _check_question(question)
        if mode not in MODES:
            raise UsageError(f"unknown mode {mode!r}: expected one of {', '.join(MODES)}")
        if top_k < 1:
            raise UsageError(f"top_k must be at least 1, got {top_k}")
        if replay is not None and replay < 0:
            raise UsageError(f"replay must be >= 0, got {replay}")
        if refresh is not None and not 0 <= refresh <= 1:
            raise UsageError(f"refresh is a fraction of the chunk tokens in [0, 1], got {refresh}")
        if refresh_scoring is not None and refresh_scoring not in SCORINGS:
            raise UsageError(f"unknown refresh_scoring {refresh_scoring!r}: expected one of {', '.join(SCORINGS)}")
        target_model = self.model(target or self.canonical)
        mode, reason, translator = self._resolve_mode(mode, target_model)
        if replay and mode != "translate":
            raise UsageError(f"replay needs mode translate (mode {mode} ran)")
        if refresh and mode != "translate":
            raise UsageError(f"refresh needs mode translate (mode {mode} ran)")
        if replay is None:  # the translator's measured default (0 where its card names none)
            replay = int(getattr(translator, "default_replay", 0) or 0) if mode == "translate" else 0
        if refresh is None:  # likewise the card's measured default_refresh (docs/EXPERIMENTS.md E45)
            refresh = float(getattr(translator, "default_refresh", 0.0) or 0.0) if mode == "translate" else 0.0
            if refresh:
                reason = "; ".join(r for r in (reason, f"refresh {refresh:g} (the translator card's default_refresh)") if r)
        if refresh_shift and not refresh:
            raise UsageError("refresh_shift moves the tokens a refresh leaves translated: it needs refresh > 0")
        if attention_bias is not None and not math.isfinite(attention_bias):
            raise UsageError(f"attention_bias must be a finite number, got {attention_bias}")
        if attention_bias and mode != "translate":
            raise UsageError(f"attention_bias acts on translated tokens: it needs mode translate (mode {mode} ran)")
        if attention_bias is None:  # the card's, measured apart with and without a refresh (E87, E88)
            field = "attention_bias" if refresh else "attention_bias_r0" if not replay else None
            attention_bias = float(getattr(translator, field, 0.0) or 0.0) if mode == "translate" and field else 0.0
            if attention_bias:
                if attention_bias_scope is None:
                    attention_bias_scope = getattr(translator, f"{field}_scope", "all")
                scope = "" if attention_bias_scope == "all" else f", scope {attention_bias_scope}"
                reason = "; ".join(r for r in (reason, f"attention bias {attention_bias:g} on the tokens left translated "
                                                        f"(the translator card's {field}{scope})") if r)
        bias_scope = _bias_scope(attention_bias_scope, bool(attention_bias), translator, target_model)
        if refresh_scoring is None:  # the card's measured scoring (docs/EXPERIMENTS.md E69), else contrast
            refresh_scoring = getattr(translator, "default_refresh_scoring", None) or DEFAULT_SCORING
            if refresh and refresh_scoring != DEFAULT_SCORING:
                reason = "; ".join(r for r in (reason, f"scoring {refresh_scoring} (the translator card's "
                                                        "default_refresh_scoring)") if r)
        difficulty = None  # read before timing, and refused before any work when missing
        if refresh and refresh_scoring in NEEDS_DIFFICULTY:
            difficulty = getattr(translator, "difficulty", None)
            if difficulty is None:
                raise UsageError(f"refresh scoring {refresh_scoring!r} needs a translator with a difficulty table "
                                 "(benchmarks/fit_difficulty.py writes one)")
        if mode in ("canonical", *TRANSLATED):
            self._check_tokenizer()
        fmt = self.prompt_format(target_model)
        self._prefix_entry(target_model, fmt)  # computed once per model, before timing
        if mode in TRANSLATED and hasattr(translator, "warm"):
            translator.warm(target_model)  # its inference form, built once per target, before timing
        if mode != "none":
            self._warm_embedder()
        started = time.perf_counter()
        timings = {k: 0.0 for k in TIMING_KEYS}

        hits: list[Any] = []
        blocks: list[KVBlock] = []
        for attempt in range(_RETRIEVE_RETRIES + 1):
            if mode != "none":
                with _timer(timings, "retrieve"):
                    hits = self.retrieve(question, top_k, document_ids)
            # Context order: the best chunk last, next to the question (small models lean on
            # what they read last); `sources` stay best first.
            in_context = hits[::-1]
            if mode not in ("canonical", *TRANSLATED) or not hits:
                break
            try:
                with _timer(timings, "load"):
                    blocks = self.load(in_context)
                break
            except ChunksChangedError:  # a concurrent writer removed a hit: search again
                if attempt == _RETRIEVE_RETRIES:
                    raise
        sources = [_source(h) for h in hits]
        if blocks:
            if mode in TRANSLATED:
                blocks = self.translate(blocks, translator, target_model, replay, timings, window=mode == "mot-window")

        stale: dict[int, int] = {}
        chosen: dict[int, int] = {}
        with _timer(timings, "prefill"):
            if mode == "native":
                cache, n, pending = self.prefill_native(target_model, fmt, [h.text for h in in_context])
            else:
                cache, n, pending, starts, stale = self.assemble(target_model, fmt, blocks, keep_all=refresh > 0)
        prompt_ids = pending + fmt.question_suffix_ids(question)
        if refresh and blocks:
            with _timer(timings, "replay"):
                neutral_ids = [pending + fmt.question_suffix_ids(q) for q in NEUTRAL_QUESTIONS]
                chosen = self.refresh(target_model, cache, n, prompt_ids, zip(starts, blocks), refresh, neutral_ids,
                                      refresh_scoring, stop_ids=fmt.stop_ids, defer=self.fuse_feed and not refresh_shift,
                                      difficulty=difficulty, peak_z=getattr(translator, "peak_z", None),
                                      shift=bool(refresh_shift))
            if self.fuse_feed and not refresh_shift:
                stale.update(chosen)
        context = n + len(pending) - len(fmt.context_prefix_ids())
        bias = None
        if attention_bias and blocks:
            left = [p for start, block in zip(starts, blocks) for p in range(start, start + block.num_tokens)
                    if p not in chosen]
            if bias_scope.hard is not None and left:  # the share of them the translator expects to get most wrong
                left = hardest_positions(translator.difficulty, zip(starts, blocks), left, bias_scope.hard)
            until = None if bias_scope.answer_tokens is None else n + len(prompt_ids) + bias_scope.answer_tokens
            if left:  # everything refreshed: nothing translated to bias, the model's own forward
                bias = AttentionBias(torch.tensor(left, dtype=torch.long), attention_bias, until, bias_scope.kinds,
                                     bias_scope.rest_kinds, translator.attention_fit if bias_scope.fitted else None)
        return Prepared(
            target=target_model,
            mode=mode,
            cache=cache,
            next_position=n,
            prompt_ids=prompt_ids,
            sources=sources,
            timings_ms=timings,
            fmt=fmt,
            context_tokens=context,
            started=started,
            mode_reason=reason,
            stale=stale,
            bias=bias,
        )

    def generate(self, prepared: Prepared, max_new_tokens: int = 64) -> Answer:
        """Feed the question suffix into the prepared cache and greedy-decode the answer."""
        pieces = self._decode(prepared, max_new_tokens)
        while True:
            try:
                next(pieces)
            except StopIteration as done:
                return done.value

    # ------------------------------------------------------------------ phases
    def model(self, name: str) -> LoadedModel:
        """A loaded model (cached per process by `cagkv.models.load`)."""
        from cagkv.models import load

        return load(name, dtype=self.dtype, device=self.device)

    def _check_tokenizer(self) -> None:
        """Stored blocks hold canonical token ids: refuse a canonical tokenizer the store did
        not record (once per engine; StoreError naming both hashes)."""
        if not self._tokenizer_checked and hasattr(self.store, "check_tokenizer"):
            from cagkv.models.fingerprint import tokenizer_hash

            self.store.check_tokenizer(tokenizer_hash(self.model(self.canonical).tokenizer))
            self._tokenizer_checked = True

    def _warm_embedder(self) -> None:
        """Load the store's embedder once (its first call loads a model)."""
        if not self._embedder_warm:
            self.store.embedder.embed(["warm up"])
            self._embedder_warm = True

    def prompt_format(self, loaded: LoadedModel) -> PromptFormat:
        key = loaded.fingerprint
        if key not in self._formats:
            self._formats[key] = PromptFormat.for_model(loaded)
        return self._formats[key]

    def retrieve(self, question: str, top_k: int, document_ids: Sequence[Any] | None) -> list[Any]:
        """Top-k chunks for the question (store hits, best first)."""
        if document_ids is not None:  # Source.document is a string: accept it back
            document_ids = [int(d) if isinstance(d, str) and d.isdigit() else d for d in document_ids]
        return list(self.store.search(question, k=top_k, document_ids=document_ids))

    def load(self, hits: Sequence[Any]) -> list[KVBlock]:
        """The stored canonical KV blocks of the hits, in hit order."""
        blocks = list(self.store.load_blocks([h.chunk_id for h in hits]))
        canonical_fp = self.model(self.canonical).fingerprint
        for b in blocks:
            if b.model_fingerprint != canonical_fp:
                raise StoreError(
                    f"a stored block was made by model {b.model_fingerprint}, not the canonical "
                    f"{self.canonical} ({canonical_fp}); re-ingest into a new store"
                )
        return blocks

    def translate(
        self,
        blocks: list[KVBlock],
        translator: Any,
        target: LoadedModel,
        replay: int,
        timings: dict[str, float],
        window: bool = False,
    ) -> list[KVBlock]:
        """Canonical blocks -> the target's blocks (its own tokens, keys position-free)."""
        kwargs: dict[str, Any] = {"replay": replay} if replay else {}
        if window:
            kwargs["window"] = True
        with _timer(timings, "translate"):
            if hasattr(translator, "translate_many"):  # one batched expert dispatch for all chunks
                out = list(translator.translate_many(blocks, target, **kwargs))
            else:
                out = [translator.translate(b, target, **kwargs) for b in blocks]
        # the target's own layers over the chunk (replay, window, or a translator's native lower
        # layers) are reported apart from the translation
        spent = getattr(translator, "last_replay_ms", 0.0)
        timings["replay"], timings["translate"] = spent, timings["translate"] - spent
        return out

    def assemble(
        self, target: LoadedModel, fmt: PromptFormat, blocks: Sequence[KVBlock], keep_all: bool = False
    ) -> tuple[Any, int, list[int], list[int], dict[int, int]]:
        """The prefix cache, then each block rotated at its assembled position.

        Canonical blocks carry their separator's KV (see `cagkv.prefill`): no forward at
        all. A block without one (a translated block holds the chunk text's tokens only)
        gets the separator computed natively after it, over everything before it. With
        `fuse_feed` (and not `keep_all`) they are left as placeholders, returned as stale
        entries for the question's forward to compute (`cagkv.refresh.feed`: one read of the
        weights for both, which dominates a few tokens' cost on CPU); otherwise all of them
        are computed here in one forward (`cagkv.refresh.refresh_tokens`). The last block's
        separator is left pending, to go with the question suffix.

        keep_all: sliding-window layers keep every token (what `refresh` needs: its scoring
        pass reads the separators, so they are computed here).
        Returns (cache, tokens in the cache, ids still to feed before the question, the
        position each block starts at, stale entries: position -> token id).
        """
        from cagkv.models import append_kv
        from cagkv.models.cache import model_layout
        from cagkv.refresh import refresh_tokens

        sep = fmt.separator_ids()
        # computing separators over the blocks needs every token (a trimmed window would not do)
        full = keep_all or any(not _has_separator(b, sep) for b in blocks[:-1])
        cache, n = self.prefix_cache(target, fmt, keep_all=full)
        first = n
        pending: list[int] = []
        starts: list[int] = []
        gaps: list[int] = []  # separator positions, filled in below
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for block in blocks:
            if pending:  # the previous block's separator: a placeholder for now
                shape = (*block.keys.shape[:2], len(pending), block.keys.shape[3])
                keys.append(block.keys.new_zeros(shape))
                values.append(block.values.new_zeros(shape))
                gaps += range(n, n + len(pending))
                n += len(pending)
            starts.append(n)
            keys.append(block.keys)
            values.append(block.values)
            n += block.num_tokens
            pending = [] if _has_separator(block, sep) else list(sep)
        if keys:  # one copy per layer; keys rotate in fp32, then cast (bf16-exact)
            append_kv(cache, target.spec, torch.cat(keys, dim=2), torch.cat(values, dim=2),
                      torch.arange(first, n, dtype=torch.long, device=target.device), dtype=target.dtype)
        gap_ids = sep * (len(gaps) // len(sep))
        if gaps and self.fuse_feed and not keep_all:  # the question's forward computes them
            return cache, n, pending, starts, dict(zip(gaps, gap_ids))
        if gaps:
            refresh_tokens(target.model, cache, gap_ids, gaps)
        if full and not keep_all:
            cache = model_layout(target.config, cache)
        return cache, n, pending, starts, {}

    def prefill_native(
        self, target: LoadedModel, fmt: PromptFormat, chunk_texts: Sequence[str]
    ) -> tuple[Any, int, list[int]]:
        """The target prefills the chunk texts itself after its prefix (the `native` baseline).

        Returns (cache, tokens in the cache, ids still to feed before the question).
        """
        cache, n = self.prefix_cache(target, fmt)
        ids: list[int] = []
        for text in chunk_texts:
            ids += fmt.chunk_ids(text) + fmt.separator_ids()
        if ids:
            cache = _forward(target, ids, cache, n).cache
        return cache, n + len(ids), []

    def prefix_cache(self, target: LoadedModel, fmt: PromptFormat, keep_all: bool = False) -> tuple[Any, int]:
        """A fresh copy of the target's cache of its context prefix (computed once per model);
        with `keep_all`, one whose sliding-window layers never drop a token."""
        from cagkv.models.cache import full_copy

        cache, n = self._prefix_entry(target, fmt)
        return (full_copy(copy.deepcopy(cache)) if keep_all else copy.deepcopy(cache)), n

    def refresh(self, target: LoadedModel, cache: Any, n: int, prompt_ids: Sequence[int],
                placed: Iterable[tuple[int, KVBlock]], fraction: float,
                neutral_ids: Sequence[Sequence[int]] = (), scoring: str = DEFAULT_SCORING,
                stop_ids: Sequence[int] = (), defer: bool = False,
                difficulty: torch.Tensor | None = None, peak_z: float | None = None,
                shift: bool = False) -> dict[int, int]:
        """Recompute, in place, the `fraction` of the placed blocks' tokens (block start
        position, block) that `prompt_ids` need most over `cache`, ranked by `scoring` (by
        default relative to what the question-agnostic `neutral_ids` attend to:
        `cagkv.refresh.score_positions`; "drafted" first drafts the answer's first tokens,
        ending before `stop_ids`; the difficulty scorings read the translator's expected error
        per token id, `difficulty` `[V]`, and "adaptive" switches at `peak_z`, default
        `cagkv.refresh.PEAK_Z`). Returns the chosen positions -> their token ids; with
        `defer` they are only chosen, for the question's forward to recompute (`Prepared.stale`).
        With `shift` (which needs them recomputed here: not `defer`) each block's tokens left
        translated move by the block's mean change of its refreshed ones (`cagkv.refresh.shift_translated`;
        measured harmful, E84: kept for the comparison)."""
        from cagkv.models.cache import layer_span
        from cagkv.refresh import (NEEDS_DIFFICULTY, PEAK_Z, draft_answer, expected_error, refresh_tokens,
                                   score_positions, shift_translated, token_ids_at, top_positions)

        if shift and defer:
            raise ValueError("shift needs the refreshed tokens recomputed before the question (defer=False)")
        placed = list(placed)
        token_at = token_ids_at(placed)
        candidates = sorted(token_at)
        drafted = draft_answer(target.model, cache, n, prompt_ids, stop_ids=stop_ids) if scoring == "drafted" else []
        expected = None
        if scoring in NEEDS_DIFFICULTY:
            if difficulty is None:
                raise UsageError(f"refresh scoring {scoring!r} needs a translator with a difficulty table "
                                 "(benchmarks/fit_difficulty.py writes one)")
            expected = expected_error(difficulty, token_at, candidates, n)
        mass = score_positions(target.model, cache, n, prompt_ids, neutral_ids, candidates, scoring, drafted, expected,
                               PEAK_Z if peak_z is None else peak_z)
        chosen = top_positions(mass, candidates, fraction)
        stale = []
        if shift:  # the translated entries the refresh replaces: what the shift is measured against
            for i, layer in enumerate(cache.layers):
                local = torch.as_tensor(chosen, dtype=torch.long, device=layer.keys.device) - layer_span(cache, i)[0]
                stale.append((layer.keys[:, :, local].clone(), layer.values[:, :, local].clone()))
        if not defer:
            refresh_tokens(target.model, cache, [token_at[p] for p in chosen], chosen)
        if shift:
            shift_translated(cache, target.spec.rope, [(start, block.num_tokens) for start, block in placed], chosen, stale)
        return {p: token_at[p] for p in chosen}

    def _prefix_entry(self, target: LoadedModel, fmt: PromptFormat) -> tuple[Any, int]:
        key = (target.fingerprint, str(target.dtype))
        if key not in self._prefixes:
            ids = fmt.context_prefix_ids()
            self._prefixes[key] = (_forward(target, ids, None, 0).cache, len(ids))
        return self._prefixes[key]

    # ------------------------------------------------------------------ mode choice
    def _resolve_mode(self, mode: str, target: LoadedModel) -> tuple[str, str, Any]:
        canonical = self.model(self.canonical)
        same = target.fingerprint == canonical.fingerprint
        if mode == "canonical" and not same:
            raise UsageError(
                f"mode canonical needs the canonical model {self.canonical} as target, got "
                f"{target.name}; use --mode translate or native"
            )
        if mode in ("native", "none", "canonical"):
            return mode, "", None
        translator = None if same else self.translator_for(canonical, target)
        if mode in TRANSLATED:
            if same and mode == "translate":
                return "canonical", "target is the canonical model: no translation needed", None
            if same:
                raise UsageError(f"mode {mode} needs a target other than the canonical model {canonical.name}")
            if translator is None:
                raise TranslatorError(
                    f"no translator from {canonical.name} to {target.name}: train one "
                    "(cagkv train) or use --mode native"
                )
            return mode, "", translator
        # auto
        if translator is not None:
            ok, why = _good_enough(translator)
            if ok:
                return "translate", f"auto: translator {canonical.name} -> {target.name} ({why})", translator
            return "native", f"auto: translator below the quality threshold ({why}); native prefill", None
        if same:
            return "canonical", "auto: target is the canonical model", None
        return "native", f"auto: no translator {canonical.name} -> {target.name}; native prefill", None

    def translator_for(self, canonical: LoadedModel, target: LoadedModel) -> Any:
        """The translator artifact for (canonical, target), or None; read from disk once."""
        key = (canonical.fingerprint, target.fingerprint)
        if key not in self._translators:
            finder = self._find_translator
            if finder is None:
                try:
                    from cagkv.translate import find_translator as finder  # type: ignore[attr-defined]
                except ImportError:
                    return None
            self._translators[key] = finder(*key)
        return self._translators[key]

    # ------------------------------------------------------------------ decoding
    def _decode(self, prepared: Prepared, max_new_tokens: int) -> Generator[str, None, Answer]:
        """Feed the suffix, then greedy-decode; yields text pieces, returns the Answer."""
        if max_new_tokens < 1:
            raise UsageError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        timings = prepared.timings_ms
        fmt, target = prepared.fmt, prepared.target
        t0 = time.perf_counter()
        with torch.inference_mode():
            cache, logits = feed(target.model, prepared.cache, prepared.next_position, prepared.prompt_ids,
                                 prepared.stale, bias=prepared.bias)
        timings["prefill"] += (time.perf_counter() - t0) * 1000
        # the first token is the argmax of these logits: time to first token ends here
        timings["first_token"] = _ms_since(prepared.started)
        generated: list[int] = []
        text = ""
        step = _cache_step(target, cache, prepared.next_position + len(prepared.prompt_ids), prepared.bias)
        for piece, generated, text in greedy_decode(target.tokenizer, fmt, logits[-1], step, max_new_tokens):
            if piece:
                yield piece
        timings["total"] = _ms_since(prepared.started)
        prompt = prepared.next_position + len(prepared.prompt_ids)
        return Answer(
            text=text.strip(),
            target=target.name,
            mode=prepared.mode,
            sources=prepared.sources,
            timings_ms=timings,
            tokens={"context": prepared.context_tokens, "prompt": prompt, "generated": len(generated)},
            mode_reason=prepared.mode_reason,
            token_ids=list(generated),
        )


# ---------------------------------------------------------------------- helpers
def generate_text(loaded: LoadedModel, prompt_ids: Sequence[int], max_new_tokens: int = 64) -> Iterator[str]:
    """Greedy-decode from raw prompt ids with the model's stop tokens; yields text pieces."""
    fmt = PromptFormat.for_model(loaded)
    fmt = PromptFormat(fmt.tokenizer, True, "", "", "", (), fmt.stop_ids)  # no newline stop
    out = _forward(loaded, list(prompt_ids), None, 0)
    step = _cache_step(loaded, out.cache, len(prompt_ids), None)
    for piece, _, _ in greedy_decode(loaded.tokenizer, fmt, out.logits[0, -1], step, max_new_tokens):
        if piece:
            yield piece


def greedy_decode(
    tokenizer: Any, fmt: PromptFormat, logits: torch.Tensor, step: Callable[[int], torch.Tensor], max_new_tokens: int
) -> Iterator[tuple[str, list[int], str]]:
    """The engine's greedy decoding from the first token's `logits`; `step(token)` feeds a chosen
    token and returns the next logits. Yields (new text piece, generated ids, text so far) per
    decoded token.

    Leading whitespace is not shown (base models often start with a space or newline);
    base-layout models stop at the end of their first answer line.
    """
    generated: list[int] = []
    emitted = ""
    for _ in range(max_new_tokens):
        token = int(torch.argmax(logits))
        if token in fmt.stop_ids:
            break
        generated.append(token)
        text = tokenizer.decode(generated, skip_special_tokens=True).lstrip()
        stop = fmt.stop_on_newline and "\n" in text
        if stop:
            text = text[: text.index("\n")]
        if text.endswith("\ufffd") and not stop:  # half a UTF-8 character: wait for the rest
            yield "", generated, emitted
        else:
            piece, emitted = text[len(emitted) :], text
            yield piece, generated, emitted
        if stop or len(generated) == max_new_tokens:
            break
        logits = step(token)


def _cache_step(target: LoadedModel, cache: Any, position: int,
                bias: AttentionBias | None) -> Callable[[int], torch.Tensor]:
    """`step(token) -> logits` for `greedy_decode`: one token at a time into `cache` from `position`."""

    def step(token: int) -> torch.Tensor:
        nonlocal cache, position
        out = _forward(target, [token], cache, position, bias)
        cache, position = out.cache, position + 1
        return out.logits[0, -1]

    return step


@torch.inference_mode()
def _forward(loaded: LoadedModel, ids: Sequence[int], cache: Any, start: int,
             bias: AttentionBias | None = None) -> Any:
    """One forward of `ids` at positions start.. into `cache` (a new one when None)."""
    if not ids:
        raise UsageError("empty prompt")
    return forward_at(loaded.model, ids, start, cache, bias=bias)


def _bias_scope(text: str | None, biased: bool, translator: Any, target: LoadedModel) -> BiasScope:
    """`attention_bias_scope` parsed (None: "all"), and refused where the bias it scopes could not
    act as named: hardF without the translator's difficulty table, fitted without its fitted
    attention table (or one of another head count), a layer kind the target lacks."""
    try:
        scope = parse_bias_scope(text or "all")
    except ValueError as err:
        raise UsageError(f"attention_bias_scope: {err}") from None
    if biased and scope.hard is not None and getattr(translator, "difficulty", None) is None:
        raise UsageError(f"attention_bias_scope {text!r}: hardF needs a translator with a difficulty table "
                         "(benchmarks/fit_difficulty.py writes one)")
    if biased and scope.fitted:
        table = getattr(translator, "attention_fit", None)
        heads = target.model.config.num_attention_heads
        if table is None:
            raise UsageError(f"attention_bias_scope {text!r}: fitted needs a translator with a fitted attention table "
                             "(benchmarks/fit_attention_bias.py writes one)")
        if table.shape[1] != heads:
            raise UsageError(f"attention_bias_scope {text!r}: the translator's fitted table has {table.shape[1]} heads "
                             f"per layer, {target.name} {heads}")
    if biased and (scope.kinds or scope.rest_kinds):
        inner = decoder_of(target.model)
        present = set(layer_types(inner.config, len(inner.layers)))
        for named in (scope.kinds, scope.rest_kinds):
            if named and not named & present:
                raise UsageError(f"attention_bias_scope {text!r}: {target.name} has no {'/'.join(sorted(named))} layers")
    return scope


def _has_separator(block: KVBlock, sep: list[int]) -> bool:
    """Whether a block ends with the prompt separator's tokens (canonical blocks do)."""
    n = int(block.extra.get("separator_tokens", "0") or 0)
    return n == len(sep) and n > 0 and block.token_ids[-n:].tolist() == sep


def _check_question(question: str) -> str:
    if not isinstance(question, str) or not question.strip():
        raise UsageError("empty question: ask something")
    return question.strip()


def _good_enough(translator: Any) -> tuple[bool, str]:
    """Whether `auto` may use a translator: its card's verdict when it gives one."""
    check = getattr(translator, "good_enough", None)
    if callable(check):
        verdict = check()
        if isinstance(verdict, tuple):
            return bool(verdict[0]), str(verdict[1])
        return bool(verdict), "card passes the threshold" if verdict else "card below threshold"
    if isinstance(check, bool):
        return check, "card passes the threshold" if check else "card below threshold"
    return False, "its card records no quality verdict"


def _source(hit: Any) -> Source:
    return Source(
        document=str(hit.document_id),
        chunk=str(hit.chunk_id),
        score=float(hit.score),
        text=hit.text,
        source=str(getattr(hit, "source", "") or ""),
    )


def _store_canonical(store: Any) -> str | None:
    name = getattr(store, "canonical", None)
    return name if isinstance(name, str) and name else None


def _ms_since(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


class _timer:
    """Adds the block's wall time in ms to timings[key]."""

    def __init__(self, timings: dict[str, float], key: str) -> None:
        self.timings, self.key = timings, key

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.timings[self.key] += (time.perf_counter() - self.t0) * 1000


__all__ = ["CAG", "MODES", "Answer", "AnswerStream", "Prepared", "Source", "generate_text"]
