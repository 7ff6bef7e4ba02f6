"""The device headers' own rules: rooted includes and one kernel per header in `kernels/`."""

from __future__ import annotations

import re

from deep_ep.paths import get_include_dir

HEADERS = sorted((get_include_dir() / "deep_ep").rglob("*.cuh"))
_INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.MULTILINE)


def test_our_headers_include_each_other_by_rooted_paths() -> None:
    assert HEADERS, "no device headers found"
    relative = []
    for header in HEADERS:
        for bracket, name in _INCLUDE.findall(header.read_text()):
            ours = (get_include_dir() / name).is_file() or (header.parent / name).is_file()
            if bracket == '"' or (ours and not name.startswith("deep_ep/")):
                relative.append(f"{header.relative_to(get_include_dir())}: {bracket}{name}")
    assert relative == [], relative


def test_every_kernel_header_holds_one_kernel() -> None:
    kernels = [h for h in HEADERS if h.parent.name == "kernels"]
    counts = {h.name: len(re.findall(r"__global__", h.read_text())) for h in kernels}
    assert counts and all(count == 1 for count in counts.values()), counts
