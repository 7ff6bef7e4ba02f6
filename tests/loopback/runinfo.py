"""What the command-line tools of this folder (`fuzz_kernels.py`, `soak.py`) share: the import path
of a run from the repository root, and the provenance their JSON carries into `bench/results/`."""

from __future__ import annotations

import json
import platform
import shlex
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def use_checkout() -> None:
    """Import `deep_ep` from this checkout and the shared test helpers (`kernel_checks`) from `tests/`,
    whatever is installed: a result must describe the code next to the script."""
    for path in (ROOT / "tests", ROOT):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))


def provenance(script: str, argv: list[str]) -> dict[str, Any]:
    """`commit` (`EP_BENCH_COMMIT`, else git's HEAD), `hardware` (the CUDA device's name, or the CPU),
    `date` (UTC), `command` (as typed from the repository root) and the torch version."""
    import torch

    from deep_ep.bench.report import git_commit, utc_now

    if torch.cuda.is_available():
        hardware = torch.cuda.get_device_name()
    else:
        hardware = f"CPU ({platform.processor() or platform.machine()})"
    return dict(commit=git_commit(), hardware=hardware, date=utc_now(),
                command=shlex.join(["python3", script, *argv]), torch=torch.__version__)  # fmt: skip


def write_json(path: str | None, document: dict[str, Any], quiet: bool = False) -> None:
    """Write `document` to `path` (nothing without one), creating its folder; a run rewrites it as it
    goes (`quiet`), so that one stopped by a time limit still leaves what it found."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(document, indent=2, default=str) + "\n")
        if not quiet:
            print(f"wrote {path}", flush=True)
