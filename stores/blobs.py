"""Blob stores: bytes under string keys, written atomically, checked by sha256 on read.

Bytes below, tensors above: nothing here imports torch. Two backends share one narrow
interface (`put / get / contains / remove / keys / quarantine`):

- `LocalBlobStore(root)`: a folder. `put` writes a temporary file in the target folder,
  fsyncs it, renames it over the key and fsyncs the folder, so a crash leaves either the
  old state or the whole new blob (plus at worst a `*.tmp` file that `clean_temp` removes).
- `FsspecBlobStore(url)`: any fsspec filesystem (`memory://`, `s3://`, ...); object
  stores write whole objects, so a put is atomic there too.

Keys are relative paths of safe segments (`[A-Za-z0-9._-]`, no leading dot, no `..`):
a key can never leave the store's root.

Example:
    >>> blobs = open_blob_store("/tmp/store/blobs")
    >>> sha = blobs.put("ab/abcd.kv", b"...")
    >>> blobs.get("ab/abcd.kv", expected_sha=sha)
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from cagkv.errors import CorruptBlobError, StoreError

_SEGMENT = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}$")
TMP_SUFFIX = ".tmp"
QUARANTINE = "quarantine"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def check_key(key: str) -> str:
    """Return `key` when it is a safe relative key, else raise ValueError naming it."""
    if not isinstance(key, str) or not key or len(key) > 512:
        raise ValueError(f"invalid blob key {key!r}: expected a non-empty relative path")
    parts = key.split("/")
    if any(not _SEGMENT.match(p) for p in parts) or key.endswith(TMP_SUFFIX) or parts[0] == QUARANTINE:
        raise ValueError(f"invalid blob key {key!r}: segments must match [A-Za-z0-9_-][A-Za-z0-9._-]*")
    return key


class BlobStore(Protocol):
    """Bytes under keys. `get` returns None on a miss and raises CorruptBlobError on a bad checksum."""

    url: str

    def put(self, key: str, data: bytes) -> str: ...
    def get(self, key: str, expected_sha: str | None = None) -> bytes | None: ...
    def contains(self, key: str) -> bool: ...
    def remove(self, key: str) -> bool: ...
    def keys(self) -> Iterator[str]: ...
    def quarantine(self, key: str) -> str | None: ...
    def clean_temp(self, older_than_s: float = 0.0) -> int: ...
    def close(self) -> None: ...


def _verify(key: str, data: bytes, expected_sha: str | None) -> bytes:
    if expected_sha is not None:
        got = sha256(data)
        if got != expected_sha:
            raise CorruptBlobError(f"blob {key!r} is corrupt: sha256 {got[:12]}..., expected {expected_sha[:12]}...")
    return data


class LocalBlobStore:
    """Blobs as files under `root` (created when missing)."""

    def __init__(self, root: str | os.PathLike[str], fsync: bool = True) -> None:
        self.root = Path(root)
        self.url = str(self.root)
        self.fsync = fsync
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"cannot create blob folder {self.root}: {e.strerror}") from None

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def put(self, key: str, data: bytes) -> str:
        """Write `data` under `key` atomically; return its sha256 (hex)."""
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{time.monotonic_ns()}{TMP_SUFFIX}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            if self.fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        os.replace(tmp, path)
        if self.fsync:
            _fsync_dir(path.parent)
        return sha256(data)

    def get(self, key: str, expected_sha: str | None = None) -> bytes | None:
        path = self._path(key)
        if path.is_symlink() or (path.exists() and not path.resolve().is_relative_to(self.root.resolve())):
            raise CorruptBlobError(f"blob {key!r} is a link or leaves the store: refused")
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except IsADirectoryError:
            raise CorruptBlobError(f"blob {key!r} is not a regular file") from None
        return _verify(key, data, expected_sha)

    def contains(self, key: str) -> bool:
        return self._path(key).is_file()

    def remove(self, key: str) -> bool:
        try:
            self._path(key).unlink()
            return True
        except FileNotFoundError:
            return False

    def keys(self) -> Iterator[str]:
        """Every stored key (temporary files and the quarantine excluded)."""
        for dirpath, dirnames, filenames in os.walk(self.root):
            rel = Path(dirpath).relative_to(self.root)
            if rel.parts[:1] == (QUARANTINE,):
                dirnames[:] = []
                continue
            for name in filenames:
                key = "/".join((*rel.parts, name))
                try:
                    yield check_key(key)
                except ValueError:
                    continue

    def quarantine(self, key: str) -> str | None:
        """Move a blob under `quarantine/` (kept for inspection); return its new path."""
        path = self._path(key)
        if not path.exists():
            return None
        dest = self.root / QUARANTINE / f"{key.replace('/', '__')}.{int(time.time())}"
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, dest)
        return str(dest)

    def clean_temp(self, older_than_s: float = 0.0) -> int:
        """Remove temporary files left by interrupted writes; return how many."""
        n, now = 0, time.time()
        for p in self.root.rglob(f"*{TMP_SUFFIX}"):
            try:
                if now - p.stat().st_mtime >= older_than_s:
                    p.unlink()
                    n += 1
            except FileNotFoundError:
                continue
        return n

    def close(self) -> None:
        pass


class FsspecBlobStore:
    """Blobs on an fsspec filesystem URL (`memory://bucket/prefix`, `s3://...`)."""

    def __init__(self, url: str) -> None:
        import fsspec

        self.url = url.rstrip("/")
        try:
            self.fs, self.base = fsspec.core.url_to_fs(self.url)
        except (ImportError, ValueError) as e:
            raise StoreError(f"cannot open blob store {url!r}: {e}") from None
        self.base = self.base.rstrip("/")

    def _path(self, key: str) -> str:
        return f"{self.base}/{check_key(key)}"

    def put(self, key: str, data: bytes) -> str:
        self.fs.pipe_file(self._path(key), bytes(data))
        return sha256(data)

    def get(self, key: str, expected_sha: str | None = None) -> bytes | None:
        try:
            data = self.fs.cat_file(self._path(key))
        except FileNotFoundError:
            return None
        return _verify(key, data, expected_sha)

    def contains(self, key: str) -> bool:
        return bool(self.fs.isfile(self._path(key)))

    def remove(self, key: str) -> bool:
        try:
            self.fs.rm_file(self._path(key))
            return True
        except FileNotFoundError:
            return False

    def keys(self) -> Iterator[str]:
        try:
            found = self.fs.find(self.base)
        except FileNotFoundError:
            return
        prefix = self.base.lstrip("/") + "/"
        for p in found:
            key = p.lstrip("/")[len(prefix) :] if p.lstrip("/").startswith(prefix) else p
            try:
                yield check_key(key)
            except ValueError:
                continue

    def quarantine(self, key: str) -> str | None:
        data = self.get(key)
        if data is None:
            return None
        dest = f"{self.base}/{QUARANTINE}/{key.replace('/', '__')}.{int(time.time())}"
        self.fs.pipe_file(dest, data)
        self.remove(key)
        return dest

    def clean_temp(self, older_than_s: float = 0.0) -> int:
        return 0  # object stores write whole objects: no temporary files

    def close(self) -> None:
        pass


def open_blob_store(url_or_path: str | os.PathLike[str]) -> BlobStore:
    """A local folder path or `file://` URL -> LocalBlobStore; another fsspec URL -> FsspecBlobStore."""
    s = str(url_or_path)
    scheme = s.split("://", 1)[0] if "://" in s else ""
    match scheme:
        case "":
            return LocalBlobStore(s)
        case "file":
            return LocalBlobStore(s[len("file://") :])
        case _:
            import fsspec

            if scheme not in fsspec.available_protocols():
                raise StoreError(
                    f"unknown blob store scheme {scheme!r}: expected a folder, file:// or one of fsspec's "
                    f"protocols (memory, s3, gcs, ...)"
                )
            return FsspecBlobStore(s)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
