"""Find the headers a generated source includes, transitively, so their contents key the cache.

We parse `#include "..."` and `#include <...>` lines ourselves (no preprocessor run): a quoted
include is looked up next to the including file first, then in the include dirs; an angle include
only in the include dirs. Includes that resolve nowhere in them (CUDA, NCCL, the C++ library) are
left out here: the nvcc version and the NCCL tree digest cover those. Conditional compilation is
ignored, so the set may be a little larger than what nvcc reads: that only makes the key stricter.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from pathlib import Path

_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*([<"])([^>"\n]+)[>"]', re.MULTILINE)


def _resolve(name: str, quoted: bool, including_dir: Path | None, include_dirs: list[Path]) -> Path | None:
    candidates = ([including_dir] if quoted and including_dir is not None else []) + include_dirs
    for folder in candidates:
        path = folder / name
        if path.is_file():
            return path.resolve()
    return None


def included_headers(source: str, include_dirs: Iterable[str | Path]) -> list[Path]:
    """Return every header under `include_dirs` that `source` includes, directly or not.

    Arguments:
        source: the text of the generated `.cu` file (its own folder does not count).
        include_dirs: the folders nvcc gets with `-I`, in order.

    Returns:
        Resolved header paths, in first-seen order, each once.
    """
    dirs = [Path(d).resolve() for d in include_dirs]
    seen: dict[Path, None] = {}
    pending: list[tuple[str, Path | None]] = [(source, None)]
    while pending:
        text, folder = pending.pop()
        for bracket, name in _INCLUDE.findall(text):
            path = _resolve(name.strip(), bracket == '"', folder, dirs)
            if path is None or path in seen:
                continue
            seen[path] = None
            pending.append((path.read_text(errors="replace"), path.parent))
    return list(seen)


def headers_digest(headers: Iterable[Path], include_dirs: Iterable[str | Path]) -> list[list[str]]:
    """Describe headers for the cache key: `[name, sha256]` pairs, sorted.

    The name is the path relative to the first include dir that contains it, so the same headers
    in two checkouts (or a wheel and a checkout) give the same key.
    """
    dirs = [Path(d).resolve() for d in include_dirs]
    described = []
    for path in headers:
        name = str(path)
        for folder in dirs:
            if path.is_relative_to(folder):
                name = str(path.relative_to(folder))
                break
        described.append([name, hashlib.sha256(path.read_bytes()).hexdigest()])
    return sorted(described)
