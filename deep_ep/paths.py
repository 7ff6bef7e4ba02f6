"""Where the library's CUDA headers live, for a wheel install and for a source checkout."""

from __future__ import annotations

from pathlib import Path


def get_include_dir() -> Path:
    """Return the folder that holds `deep_ep/common/*.cuh` and `deep_ep/kernels/*.cuh`.

    A wheel installs the headers inside the package (`site-packages/deep_ep/include`); an editable
    install or `PYTHONPATH=<checkout>` finds them in the checkout's top-level `include/`.
    """
    package_dir = Path(__file__).resolve().parent
    for candidate in (package_dir / "include", package_dir.parent / "include"):
        if (candidate / "deep_ep").is_dir():
            return candidate
    raise FileNotFoundError(
        f"deep_ep CUDA headers not found next to {package_dir} (looked in ./include and ../include); "
        "reinstall the package"
    )
