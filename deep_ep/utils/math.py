"""Integer helpers shared by the library (no torch import)."""

from __future__ import annotations


def ceil_div(x: int, y: int) -> int:
    """Return `ceil(x / y)` for non-negative `x` and positive `y`."""
    return (x + y - 1) // y


def align(x: int, y: int) -> int:
    """Round the non-negative `x` up to a multiple of the positive `y`."""
    return ceil_div(x, y) * y
