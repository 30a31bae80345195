"""Ingest orchestration: files / folders / stdin -> text -> chunks -> canonical KV -> store.

    ingest(paths, store)                     the whole flow, one document at a time
      collect_sources(paths)                 expand folders, check every input first
      load(canonical) / CacheStore.open      unknown model or foreign store: nothing written
      ingest_sources -> ingest_text          per document:
        read_document                        text of a .txt / .md / .html file (or stdin)
        chunk_text -> prefill_chunks         chunks, canonical KV blocks, batch by batch
        store.add_document(...)              blobs, embeddings, catalog, index: one document

A document is skipped as unchanged when its source is stored with the same text and the
same chunking parameters (`chunking_params`); other parameters re-chunk it. The store
records the canonical tokenizer's hash and refuses a model whose tokenizer differs.

Every input is validated before anything is written, so a bad input (missing path,
empty, binary, non-UTF-8 or oversized file) leaves the store unchanged. Blocks are
streamed: the store serialises each batch before the next is prefilled, so memory holds
one batch of caches, never a document's or the corpus's.

Example:
    >>> report = ingest(["examples/docs"], "/tmp/store", chunk_tokens=256)
    >>> print(report.summary())
"""

from __future__ import annotations

import hashlib
import html.parser
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from cagkv.errors import UsageError

DEFAULT_CANONICAL = "smollm2-135m"

if TYPE_CHECKING:
    import torch

    from cagkv.models import LoadedModel

TEXT_SUFFIXES = {".txt", ".text", ".md", ".markdown", ".rst"}
HTML_SUFFIXES = {".html", ".htm", ".xhtml"}
SUPPORTED_SUFFIXES = TEXT_SUFFIXES | HTML_SUFFIXES
DEFAULT_MAX_BYTES = 20 * 1024 * 1024  # per file; override with max_bytes / CAGKV_MAX_FILE_BYTES
# Names `cagkv.chunking.chunk_text`'s algorithm; bump it when a change there moves chunk boundaries.
CHUNKER = "sentences-v1"
STDIN = "-"


class InputError(UsageError):
    """An input file or folder that cannot be ingested (missing, empty, binary, too big)."""


@dataclass(frozen=True)
class Source:
    """One input document: a file path, or stdin with its text already read."""

    name: str  # what the catalog records: the resolved path, or "<stdin>"
    path: Path | None
    text: str | None = None  # set for stdin only (it cannot be read twice)


@dataclass
class IngestReport:
    """What one ingest did. `skipped` counts documents already stored with the same content."""

    documents: int = 0
    skipped: int = 0
    chunks: int = 0
    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    sources: list[str] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "documents": self.documents,
            "skipped": self.skipped,
            "chunks": self.chunks,
            "tokens": self.tokens,
            "bytes": self.bytes,
            "seconds": round(self.seconds, 3),
            "prefill_seconds": round(self.prefill_seconds, 3),
            "tokens_per_s": round(self.tokens_per_s, 1),
        }

    def summary(self) -> str:
        return (
            f"ingested {self.documents} document(s) ({self.skipped} unchanged, skipped): "
            f"{self.chunks} chunks, {self.tokens} tokens, {_human_bytes(self.bytes)} of KV, "
            f"{self.seconds:.1f} s, {self.tokens_per_s:.0f} tokens/s"
        )


# ---------------------------------------------------------------------- the flow
def ingest(
    paths: Sequence[str | os.PathLike[str]],
    store: str | os.PathLike[str] | None = None,
    *,
    canonical: str | None = None,
    chunk_tokens: int = 256,
    batch_size: int = 8,
    dtype: torch.dtype | str = "auto",
    max_bytes: int | None = None,
    db_url: str | None = None,
    embedder: str | None = None,
    progress: bool = True,
    stdin: Any = None,
    device: torch.device | str | None = None,
) -> IngestReport:
    """Ingest files, folders (recursive) or "-" (stdin) into the store at `store`.

    Order matters for "bad input leaves the store unchanged": every input is checked,
    then the canonical model is loaded, and only then is the store opened (created).

    Args:
        paths: files, folders, or "-" for stdin.
        store: the store folder (default `$CAGKV_HOME/store`).
        canonical: canonical model name or folder (default: the store's, else smollm2-135m).
        chunk_tokens: token budget per chunk (canonical tokens, sentence boundaries).
        batch_size: chunks per prefill forward.
        dtype: prefill (and stored block) dtype: "auto" = bfloat16 on a GPU or where the CPU
            computes it natively (AVX512-BF16 / AMX), else float32 (bf16 is ~5x slower than
            fp32 on an AVX2-only CPU); "bfloat16" or "float32" to force one.
        max_bytes: per-file size limit (default 20 MiB or $CAGKV_MAX_FILE_BYTES).
        db_url: SQLAlchemy URL for the catalog (default SQLite inside the store).
        embedder: embedder name for a new store (default minilm-l6; "hash-64" for tests).
        progress: show a progress bar on stderr.
        device: where the canonical model prefills: "cpu" (default), "cuda", "cuda:N" or
            "auto" (`cagkv.models.loading.parse_device`); blocks are stored from the host.
    """
    from cagkv.models import load
    from cagkv.models.loading import parse_device

    if chunk_tokens < 8:
        raise UsageError(f"--chunk-tokens must be at least 8, got {chunk_tokens}")
    if batch_size < 1:
        raise UsageError(f"batch size must be at least 1, got {batch_size}")
    dev = parse_device(device)
    torch_dtype = parse_dtype(dtype, dev)
    sources = collect_sources(paths, max_bytes=max_bytes, stdin=stdin)
    store_path = Path(store or default_store_path()).expanduser()
    if canonical and Path(canonical).expanduser().is_dir():  # a folder: recorded by absolute path
        canonical = str(Path(canonical).expanduser().resolve())
    canonical = canonical or _existing_canonical(store_path, db_url) or DEFAULT_CANONICAL
    _check_store_canonical(store_path, db_url, canonical)
    loaded = load(canonical, dtype=torch_dtype, device=dev)
    from cagkv.models.fingerprint import tokenizer_hash
    from cagkv.stores import CacheStore

    cache_store = CacheStore.open(
        store_path, db_url, canonical=canonical, fingerprint=loaded.fingerprint,
        tokenizer_hash=tokenizer_hash(loaded.tokenizer), embedder=embedder,
    )  # fmt: skip
    try:
        return ingest_sources(cache_store, loaded, sources, chunk_tokens, batch_size, progress)
    finally:
        cache_store.close()


def ingest_sources(
    store: Any,
    loaded: LoadedModel,
    sources: Sequence[Source],
    chunk_tokens: int = 256,
    batch_size: int = 8,
    progress: bool = True,
) -> IngestReport:
    """Read, chunk, prefill and store each source in turn; one document in memory at a time."""
    from tqdm.auto import tqdm

    report = IngestReport()
    t0 = time.perf_counter()
    sizes = [_size(s) for s in sources]
    bar = tqdm(total=sum(sizes), unit="B", unit_scale=True, desc="ingest", disable=not progress,
               file=sys.stderr, leave=False)  # fmt: skip
    try:
        for source, size in zip(sources, sizes):
            text = read_document(source)
            if store.has_document(source.name, text, chunking_params(chunk_tokens)):
                report.skipped += 1
                bar.update(size)
                continue
            done = [0.0]

            def advance(fraction: float, size: int = size, done: list[float] = done) -> None:
                bar.update(size * fraction - done[0])
                done[0] = size * fraction
                bar.set_postfix(chunks=report.chunks, tok_s=f"{report.tokens / max(1e-9, time.perf_counter() - t0):.0f}")

            result = ingest_text(
                store, text, source.name, loaded=loaded, chunk_tokens=chunk_tokens,
                batch_size=batch_size, report=report, on_progress=advance,
            )  # fmt: skip
            bar.update(size - done[0])
            if result.status == "unchanged":
                report.skipped += 1
            else:
                report.documents += 1
                report.sources.append(source.name)
    finally:
        bar.close()
    report.seconds = time.perf_counter() - t0
    return report


def ingest_text(
    store: Any,
    text: str,
    source: str,
    *,
    metadata: dict[str, Any] | None = None,
    chunks: Sequence[str] | None = None,
    loaded: LoadedModel | None = None,
    chunk_tokens: int = 256,
    batch_size: int = 8,
    dtype: torch.dtype | str = "auto",
    report: IngestReport | None = None,
    on_progress: Any = None,
    device: torch.device | str | None = None,
) -> Any:
    """Store one document given as text; returns the store's AddResult (`.document_id`).

    Args:
        store: an open CacheStore.
        text: the document text.
        source: its identity (path / URI); same source + same text + same chunking
            (`chunking_params`) is a no-op.
        metadata: JSON-serialisable, kept in the catalog.
        chunks: pre-split chunk texts (e.g. LlamaIndex nodes), used as they are; their
            spans are found in `text` in order. None: chunk by canonical tokens.
        loaded: the canonical model (default: the store's canonical, loaded in `dtype` on
            `device`). A store that recorded another canonical tokenizer is refused (StoreError).
    """
    from cagkv.chunking import TextChunk, chunk_text
    from cagkv.models.fingerprint import tokenizer_hash
    from cagkv.prefill import prefill_chunks
    from cagkv.prompt import PromptFormat

    if not text.strip():
        raise InputError(f"empty document: {source}")
    if loaded is None:
        from cagkv.models import load
        from cagkv.models.loading import parse_device

        dev = parse_device(device)
        loaded = load(getattr(store, "canonical", None) or DEFAULT_CANONICAL, dtype=parse_dtype(dtype, dev), device=dev)
    store.check_tokenizer(tokenizer_hash(loaded.tokenizer), record=True)
    fmt = PromptFormat.for_model(loaded)
    if chunks is None:
        pieces = chunk_text(text, loaded.tokenizer, max_tokens=chunk_tokens)
    else:
        pieces = _spans_of(text, chunks, TextChunk)
    report = report if report is not None else IngestReport()

    def pairs() -> Iterator[tuple[Any, Any]]:
        # Generated lazily: the store serialises each block before the next batch is made.
        for start in range(0, len(pieces), batch_size):
            batch = pieces[start : start + batch_size]
            t = time.perf_counter()
            blocks = prefill_chunks(loaded, [c.text for c in batch], batch_size=batch_size, fmt=fmt)
            report.prefill_seconds += time.perf_counter() - t
            for chunk, block in zip(batch, blocks):
                report.chunks += 1
                report.tokens += block.num_tokens
                report.bytes += block.nbytes
                yield chunk, block
            if on_progress is not None:
                on_progress(batch[-1].end / max(1, len(text)))

    before = (report.chunks, report.tokens, report.bytes)
    chunking = chunking_params(chunk_tokens, chunks)
    result = store.add_document(source, text, metadata or {}, pairs(), chunking=chunking)
    if result.status == "unchanged":  # nothing was written: undo the counts of a raced re-ingest
        report.chunks, report.tokens, report.bytes = before
    return result


def chunking_params(chunk_tokens: int, chunks: Sequence[str] | None = None) -> dict[str, Any]:
    """What a document's chunks depend on besides its text and the tokenizer (recorded per
    document): the chunker and its token budget, or a digest of pre-split chunk texts."""
    if chunks is None:
        return {"chunker": CHUNKER, "chunk_tokens": int(chunk_tokens)}
    digest = hashlib.sha256(json.dumps(list(chunks), ensure_ascii=False).encode("utf-8")).hexdigest()
    return {"chunker": "given", "chunks_sha256": digest}


def _spans_of(text: str, chunks: Sequence[str], make: Any) -> list[Any]:
    """TextChunks for pre-split chunk texts, located in `text` in order."""
    out, pos = [], 0
    for i, chunk in enumerate(chunks):
        if not chunk.strip():
            raise InputError(f"chunk {i} is empty")
        start = text.find(chunk, pos)
        if start < 0:
            raise InputError(f"chunk {i} does not occur in the document text (after offset {pos})")
        out.append(make(chunk, start, start + len(chunk)))
        pos = start + len(chunk)
    return out


def default_store_path() -> Path:
    """`$CAGKV_HOME/store`."""
    from cagkv.models.zoo import home

    return home() / "store"


def parse_dtype(dtype: torch.dtype | str, device: torch.device | None = None) -> torch.dtype:
    """"auto" / "bfloat16" / "bf16" / "float32" / "fp32" / "float16" / "fp16" -> torch dtype.
    "auto" is bfloat16 on a GPU `device` and on a CPU with native bf16 (`fast_bf16`), else float32."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        on_gpu = device is not None and device.type != "cpu"
        return torch.bfloat16 if on_gpu or fast_bf16() else torch.float32
    names = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32,
             "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16}  # fmt: skip
    if dtype not in names:
        raise UsageError(f"unknown dtype {dtype!r}: expected one of auto, bfloat16, float32, float16")
    return names[dtype]


def fast_bf16() -> bool:
    """True when this CPU has native bf16 arithmetic (AVX512-BF16 or AMX-BF16)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def _existing_canonical(path: Path, db_url: str | None) -> str | None:
    """The canonical model recorded by an existing store (None for a new one)."""
    if db_url is None and not (path / "catalog.db").exists():
        return None
    from cagkv.stores import CacheStore

    try:
        store = CacheStore.open(path, db_url, create=False)
    except Exception:  # noqa: BLE001 - unreadable here: opening it for writing reports why
        return None
    try:
        return store.canonical
    finally:
        store.close()


def _check_store_canonical(path: Path, db_url: str | None, canonical: str) -> None:
    existing = _existing_canonical(path, db_url)
    if existing is not None and existing != canonical:
        from cagkv.errors import StoreError

        raise StoreError(
            f"store {path} was made with canonical model {existing!r}, not {canonical!r}: "
            "use another --store"
        )


def _size(source: Source) -> int:
    if source.text is not None:
        return len(source.text.encode("utf-8"))
    assert source.path is not None
    return max(1, source.path.stat().st_size)


# ---------------------------------------------------------------------- reading inputs
def collect_sources(
    paths: Sequence[str | os.PathLike[str]],
    max_bytes: int | None = None,
    stdin: Any = None,
) -> list[Source]:
    """Expand and validate every input before anything is ingested.

    Folders are walked recursively for .txt/.md/.html files (other files are ignored);
    a file named explicitly is read as text (HTML by suffix) whatever its suffix.
    Raises InputError on the first bad input.
    """
    if not paths:
        raise InputError("no input given: pass files, folders or - for stdin")
    limit = _max_bytes(max_bytes)
    sources: list[Source] = []
    seen: set[Path] = set()
    for raw in paths:
        if str(raw) == STDIN:
            text = _decode((stdin or sys.stdin.buffer).read(limit + 1), "<stdin>", limit)
            sources.append(Source("<stdin>", None, text))
            continue
        path = Path(raw).expanduser()
        if not path.exists():
            raise InputError(f"no such file or folder: {raw}")
        files = _walk(path) if path.is_dir() else [path]
        if path.is_dir() and not files:
            raise InputError(f"no .txt, .md or .html files in folder: {raw}")
        for file in files:
            resolved = file.resolve()
            if resolved in seen:
                continue
            seen.add(resolved)
            _check_file(file, limit)
            sources.append(Source(str(resolved), resolved))
    return sources


def _walk(folder: Path) -> list[Path]:
    """Supported files under `folder`. Never read, with a one-line notice on stderr: a link
    (or a file under a linked folder) that resolves outside the folder, and special files
    (FIFOs, sockets, devices: opening a FIFO would block)."""
    root = folder.resolve()
    files = []
    for p in sorted(folder.rglob("*")):
        if p.suffix.lower() not in SUPPORTED_SUFFIXES or p.name.startswith("."):
            continue
        target = p.resolve()
        if not target.is_relative_to(root):
            _notice(f"skipping {p}: it links to {target}, outside {root}")
        elif p.is_file():
            files.append(p)
        elif p.exists() and not p.is_dir():
            _notice(f"skipping {p}: not a regular file (FIFO, socket or device)")
    return files


def _notice(message: str) -> None:
    print(f"cagkv: {message}", file=sys.stderr)


def _max_bytes(max_bytes: int | None) -> int:
    if max_bytes is not None:
        return max_bytes
    return int(os.environ.get("CAGKV_MAX_FILE_BYTES", DEFAULT_MAX_BYTES))


def _check_file(path: Path, limit: int) -> None:
    if not path.is_file():
        raise InputError(f"not a regular file: {path}")
    size = path.stat().st_size
    if size > limit:
        raise InputError(
            f"file too large: {path} is {_human_bytes(size)}, the limit is {_human_bytes(limit)} "
            "(set --max-bytes or CAGKV_MAX_FILE_BYTES)"
        )
    try:
        data = path.read_bytes()
    except OSError as e:
        raise InputError(f"cannot read {path}: {e.strerror}") from None
    text = _decode(data, str(path), limit)
    if path.suffix.lower() in HTML_SUFFIXES and not html_to_text(text).strip():
        raise InputError(f"empty document (no text in the HTML): {path}")


def _decode(data: bytes, name: str, limit: int) -> str:
    """UTF-8 text of an input, or InputError for oversized, empty, binary, non-UTF-8 data."""
    if len(data) > limit:
        raise InputError(f"input too large: {name} is over the limit of {_human_bytes(limit)}")
    if b"\x00" in data:
        raise InputError(f"binary file (NUL bytes), not text: {name}")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise InputError(f"not UTF-8 text: {name} (invalid byte at offset {e.start})") from None
    if not text.strip():
        raise InputError(f"empty document: {name}")
    return text


def read_document(source: Source) -> str:
    """The plain text of a source: HTML reduced to its visible text, others as they are."""
    if source.text is not None:
        return source.text
    assert source.path is not None
    text = source.path.read_bytes().decode("utf-8-sig")
    if source.path.suffix.lower() in HTML_SUFFIXES:
        return html_to_text(text)
    return text


class _HTMLText(html.parser.HTMLParser):
    """Visible text of an HTML page; block elements become line breaks."""

    _SKIP: ClassVar[set[str]] = {"script", "style", "head", "title", "noscript", "template", "svg"}
    _BLOCK: ClassVar[set[str]] = {
        "p", "div", "br", "li", "ul", "ol", "h1", "h2", "h3", "h4", "h5", "h6", "tr", "table",
        "section", "article", "pre", "blockquote", "dt", "dd", "dl", "header", "footer", "hr",
    }  # fmt: skip

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self._skipping = 0

    def handle_starttag(self, tag: str, attrs: Any) -> None:
        if tag in self._SKIP:
            self._skipping += 1
        elif tag in self._BLOCK:
            self.parts.append("\n\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in self._SKIP:
            self._skipping = max(0, self._skipping - 1)
        elif tag in self._BLOCK:
            self.parts.append("\n\n")

    def handle_data(self, data: str) -> None:
        if not self._skipping:
            self.parts.append(data)


def html_to_text(markup: str) -> str:
    """Visible text of an HTML document, paragraphs separated by blank lines."""
    parser = _HTMLText()
    parser.feed(markup)
    parser.close()
    lines = [" ".join(line.split()) for line in "".join(parser.parts).split("\n")]
    paragraphs: list[str] = []
    current: list[str] = []
    for line in lines + [""]:
        if line:
            current.append(line)
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    return "\n\n".join(paragraphs)


def content_hash(text: str) -> str:
    """sha256 hex of the document text (what makes ingest idempotent)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"
