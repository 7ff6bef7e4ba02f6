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

Every private folder under `tmp/` names its owner (process id and host, `owner`), so that `clear()`
removes what is left of dead processes but never a build in progress. A root that cannot be written
(read-only, full, not a folder: found by writing a probe the first time a process builds) is left
for reading: entries found there are still used, and new ones go to a folder of this user under the
system's temporary directory, with a warning that says so.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
import warnings
from collections import Counter
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import Any

from . import env

SCHEMA = 1
KINDS = ("kernels", "host")
METADATA = "meta.json"
OWNER = "owner"
# A private folder whose owner cannot be checked (another host) counts as abandoned after this long
ABANDONED_AFTER_S = 24 * 3600
_PROBE_BYTES = 4096
# A private folder is created before its owner is written into it: so young, it counts as in progress
_UNMARKED_GRACE_S = 60.0

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


def configured_root() -> Path:
    """The cache root asked for (`EP_JIT_CACHE_DIR`, else `~/.cache/deep_ep/jit`)."""
    return env.cache_dir()


_writable: dict[Path, Path] = {}
_writable_lock = threading.Lock()


def _probe(folder: Path) -> str | None:
    """Why new entries cannot be written under `folder` (`None` when they can)."""
    try:
        (folder / "tmp").mkdir(parents=True, exist_ok=True)
        probe = folder / "tmp" / f"probe-{uuid.uuid4().hex}"
        probe.write_bytes(b"\0" * _PROBE_BYTES)
        probe.unlink()
    except OSError as error:
        return f"{type(error).__name__}: {error.strerror or error}"
    return None


def fallback_root() -> Path:
    """Where new entries go when the configured root cannot be written: this user's folder under
    the system's temporary directory."""
    return Path(tempfile.gettempdir()) / f"deep_ep-jit-{os.getuid()}"


def root() -> Path:
    """The folder new entries are written to: the configured root, or `fallback_root()` (with a
    warning, once per process and root) when the configured one cannot be written.

    Raises:
        OSError: when neither can be written.
    """
    configured = configured_root()
    with _writable_lock:
        chosen = _writable.get(configured)
        if chosen is None:
            problem = _probe(configured)
            chosen = configured
            if problem is not None:
                chosen = fallback_root()
                second = _probe(chosen)
                if second is not None:
                    raise OSError(f"deep_ep.jit: the JIT cache {configured} ({problem}) and {chosen} ({second}) "
                                  f"cannot be written; point {env.CACHE_DIR} at a writable folder")  # fmt: skip
                warnings.warn(f"deep_ep.jit: the JIT cache {configured} cannot be written ({problem}); new kernels "
                              f"go to {chosen} for this process (entries found in {configured} are still used)",
                              RuntimeWarning, stacklevel=2)  # fmt: skip
            _writable[configured] = chosen
    return chosen


def _lookup_roots() -> list[Path]:
    """Where entries are looked up: the configured root, then the fallback when it is in use."""
    configured = configured_root()
    with _writable_lock:
        chosen = _writable.get(configured, configured)
    return [configured] if chosen == configured else [configured, chosen]


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
    # The binary as verified when the entry was read: a later `clear()` cannot take it away
    verified: bytes | None = dataclass_field(default=None, repr=False, compare=False)

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
        if self.verified is not None:
            return self.verified
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
    return CacheEntry(path, metadata, CacheEntry(path, metadata).read_binary())


def remove(path: Path) -> None:
    """Delete an entry folder safely: rename it into its root's `tmp/` first (atomic), then delete
    the copy. An entry in a root that cannot be written stays (it is skipped on every lookup)."""
    trash = path.parent.parent / "tmp" / f"trash-{uuid.uuid4().hex}"
    try:
        trash.parent.mkdir(parents=True, exist_ok=True)
        os.rename(path, trash)
    except FileNotFoundError:
        return  # another process removed it first
    except OSError as error:
        env.debug(f"cannot remove {path}: {error}")
        return
    shutil.rmtree(trash, ignore_errors=True)


def lookup(kind: str, key: str) -> CacheEntry | None:
    """Return the verified entry `key`, or `None` on a miss; a corrupt entry is removed (a miss)."""
    if kind not in KINDS:
        raise ValueError(f"unknown cache kind {kind!r}; expected one of {KINDS}")
    for base in _lookup_roots():
        path = base / kind / key
        if not path.exists():
            continue
        try:
            return _read_entry(path, kind, key)
        except CacheCorruptError as error:
            count("corrupt")
            env.debug(f"corrupt cache entry removed: {error}")
            remove(path)
    return None


def new_private_dir(prefix: str) -> Path:
    """Create a folder under `tmp/` for one process's work, marked with its owner (see `clear`)."""
    tmp = root() / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=tmp))
    (folder / OWNER).write_text(f"{os.getpid()} {socket.gethostname()}\n")
    return folder


def _in_progress(folder: Path) -> bool:
    """Whether a private folder under `tmp/` belongs to a live process (so `clear` keeps it)."""
    try:
        age = time.time() - folder.stat().st_mtime
    except OSError:
        return False
    try:
        pid_text, host = (folder / OWNER).read_text().split()
    except (OSError, ValueError):
        return age < _UNMARKED_GRACE_S  # just created, its owner not written yet
    if host != socket.gethostname():
        return age < ABANDONED_AFTER_S
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def new_build_dir() -> Path:
    """Create a private folder under `tmp/` to build one entry in."""
    return new_private_dir("build-")


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
    (build_dir / OWNER).unlink(missing_ok=True)
    # Verified while still private: once published, a `clear()` may take the entry away at any time
    built = _read_entry(build_dir, kind, key)
    for _ in range(5):
        try:
            os.rename(build_dir, target)
            count("published")
            return CacheEntry(target, built.metadata, built.verified)
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
    """Delete every entry and what dead processes left under `tmp/` (builds of live processes stay:
    they publish when done); return how many entries were deleted."""
    deleted = 0
    for kind in KINDS:
        folder = root() / kind
        if folder.is_dir():
            for path in list(folder.iterdir()):
                remove(path)
                deleted += 1
    tmp = root() / "tmp"
    if tmp.is_dir():
        for path in list(tmp.iterdir()):
            if not path.is_dir():
                path.unlink(missing_ok=True)
            elif not _in_progress(path):
                shutil.rmtree(path, ignore_errors=True)
    return deleted
