"""Content-addressed on-disk cache of compiled artifacts (cubins, host shims).

Layout under the root (`EP_JIT_CACHE_DIR`, default `~/.cache/deep_ep/jit`):

    kernels/<key>/   one kernel: kernel.cubin, meta.json, source.cu (and kernel.sass on request)
    host/<key>/      one host shim: lib<name>.so, meta.json, the source
    tmp/             builds in progress and entries being deleted

`<key>` is the sha256 of everything that determines the binary (see `make_key`). An entry is
built in a private folder under `tmp/` and published with one `os.rename`, which is atomic: a
reader sees a complete entry or none. When two processes build the same key, the first rename
wins and the loser discards its copy. `meta.json` records the binary's size and sha256; lookups
check both, and an entry that fails (partial, truncated, corrupt) is removed and reported as a miss,
never loaded.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import env

SCHEMA = 1
KINDS = ("kernels", "host")
METADATA = "meta.json"

_stats: Counter[str] = Counter()
_stats_lock = threading.Lock()


def count(event: str) -> None:
    """Add one to the process-wide counter `event` (hit, miss, corrupt, compile, published, lost_race)."""
    with _stats_lock:
        _stats[event] += 1


def stats() -> dict[str, int]:
    """Return this process's cache counters: hits, misses, corrupt entries removed, compiles, ..."""
    with _stats_lock:
        return dict(_stats)


class CacheCorruptError(ValueError):
    """A cache entry does not match its metadata (it is removed, then rebuilt)."""


def make_key(fields: dict[str, Any]) -> str:
    """sha256 (hex) of the canonical JSON of `fields` plus the cache schema version."""
    text = json.dumps({"schema": SCHEMA, **fields}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def root() -> Path:
    """The cache root folder (it is created on first write)."""
    return env.cache_dir()


def entry_dir(kind: str, key: str) -> Path:
    """Where the entry `key` of `kind` (`"kernels"` or `"host"`) lives once published."""
    if kind not in KINDS:
        raise ValueError(f"unknown cache kind {kind!r}; expected one of {KINDS}")
    return root() / kind / key


@dataclass(frozen=True)
class CacheEntry:
    """A published, verified cache entry.

    Attributes:
        path: the entry folder.
        metadata: the parsed `meta.json` (kind, key, name, symbol, arch, sizes, compiler, ...).
    """

    path: Path
    metadata: dict[str, Any]

    @property
    def key(self) -> str:
        return str(self.metadata["key"])

    @property
    def kind(self) -> str:
        return str(self.metadata["kind"])

    @property
    def binary_path(self) -> Path:
        """The cubin (kernels) or shared library (host shims)."""
        return self.path / str(self.metadata["file"])

    @property
    def symbol(self) -> str | None:
        """The mangled kernel name (kernels only)."""
        return self.metadata.get("symbol")

    @property
    def name(self) -> str:
        """A readable name: the kernel instantiation or the host library name."""
        return str(self.metadata.get("name", self.key[:16]))

    def read_binary(self) -> bytes:
        """Read the binary and check it against the metadata.

        Raises:
            CacheCorruptError: when the size or sha256 differs (e.g. a truncated file).
        """
        try:
            data = self.binary_path.read_bytes()
        except OSError as error:
            raise CacheCorruptError(f"{self.binary_path}: {error}") from error
        if len(data) != self.metadata["size"]:
            raise CacheCorruptError(f"{self.binary_path}: {len(data)} bytes, metadata says {self.metadata['size']}")
        if hashlib.sha256(data).hexdigest() != self.metadata["sha256"]:
            raise CacheCorruptError(f"{self.binary_path}: sha256 differs from the metadata")
        return data


def _read_entry(path: Path, kind: str, key: str | None) -> CacheEntry:
    """Parse and verify one entry folder; raise `CacheCorruptError` when anything is off."""
    try:
        metadata = json.loads((path / METADATA).read_text())
    except (OSError, ValueError) as error:
        raise CacheCorruptError(f"{path / METADATA}: {error}") from error
    if not isinstance(metadata, dict):
        raise CacheCorruptError(f"{path / METADATA}: not a JSON object")
    expected = {"schema": SCHEMA, "kind": kind, "key": key if key is not None else path.name}
    for field, value in expected.items():
        if metadata.get(field) != value:
            raise CacheCorruptError(f"{path / METADATA}: {field} is {metadata.get(field)!r}, expected {value!r}")
    for field, types in (("file", str), ("size", int), ("sha256", str)):
        if not isinstance(metadata.get(field), types):
            raise CacheCorruptError(f"{path / METADATA}: missing or bad {field!r}")
    entry = CacheEntry(path, metadata)
    entry.read_binary()
    return entry


def remove(path: Path) -> None:
    """Delete an entry folder safely: rename it into `tmp/` first (atomic), then delete the copy."""
    trash = root() / "tmp" / f"trash-{uuid.uuid4().hex}"
    try:
        trash.parent.mkdir(parents=True, exist_ok=True)
        os.rename(path, trash)
    except FileNotFoundError:
        return  # another process removed it first
    shutil.rmtree(trash, ignore_errors=True)


def lookup(kind: str, key: str) -> CacheEntry | None:
    """Return the verified entry `key`, or `None` on a miss; a corrupt entry is removed (a miss)."""
    path = entry_dir(kind, key)
    if not path.exists():
        return None
    try:
        return _read_entry(path, kind, key)
    except CacheCorruptError as error:
        count("corrupt")
        env.debug(f"corrupt cache entry removed: {error}")
        remove(path)
        return None


def new_build_dir() -> Path:
    """Create a private folder under `tmp/` to build one entry in."""
    tmp = root() / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="build-", dir=tmp))


def write_metadata(build_dir: Path, kind: str, key: str, binary_name: str, fields: dict[str, Any]) -> None:
    """Write `meta.json` for the binary `build_dir/binary_name`, with its size and sha256."""
    data = (build_dir / binary_name).read_bytes()
    metadata = {
        **fields,
        "schema": SCHEMA,
        "kind": kind,
        "key": key,
        "file": binary_name,
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "created": time.time(),
    }
    (build_dir / METADATA).write_text(json.dumps(metadata, indent=1, sort_keys=True) + "\n")


def publish(build_dir: Path, kind: str, key: str) -> CacheEntry:
    """Move a finished build folder into place atomically and return the published entry.

    If another process published the same key first, its entry is kept and ours is discarded;
    if what is there is corrupt, it is removed and we try again.
    """
    target = entry_dir(kind, key)
    target.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(5):
        try:
            os.rename(build_dir, target)
            count("published")
            return _read_entry(target, kind, key)
        except OSError as error:
            if error.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                shutil.rmtree(build_dir, ignore_errors=True)
                raise
        existing = lookup(kind, key)  # removes the entry when it is corrupt
        if existing is not None:
            count("lost_race")
            shutil.rmtree(build_dir, ignore_errors=True)
            return existing
    shutil.rmtree(build_dir, ignore_errors=True)
    raise OSError(f"could not publish cache entry {target}: it keeps reappearing corrupt")


def entries(kind: str | None = None) -> list[CacheEntry]:
    """Return every valid published entry (of `kind`, or all kinds), oldest first; skip broken ones."""
    found = []
    for each in [kind] if kind else KINDS:
        folder = root() / each
        if not folder.is_dir():
            continue
        for path in folder.iterdir():
            try:
                found.append(_read_entry(path, each, None))
            except CacheCorruptError:
                continue
    return sorted(found, key=lambda e: e.metadata.get("created", 0))


def usage() -> tuple[int, int]:
    """Return (number of entry folders, total bytes) under the cache root, valid or not."""
    count_, size = 0, 0
    for kind in KINDS:
        folder = root() / kind
        if folder.is_dir():
            count_ += sum(1 for p in folder.iterdir() if p.is_dir())
    if root().is_dir():
        size = sum(p.stat().st_size for p in root().rglob("*") if p.is_file())
    return count_, size


def clear() -> int:
    """Delete every entry and every leftover temporary build; return how many entries were deleted."""
    deleted = 0
    for kind in KINDS:
        folder = root() / kind
        if folder.is_dir():
            for path in list(folder.iterdir()):
                remove(path)
                deleted += 1
    shutil.rmtree(root() / "tmp", ignore_errors=True)
    return deleted
