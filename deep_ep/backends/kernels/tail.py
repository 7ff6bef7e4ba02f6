"""Regions kept at the end of a window's data region for features that outlive one call: the pipeline
ring (`pp.py`) and Engram's table (`engram.py`).

Dispatch, combine and AGRS sessions use the data region from its start, so a kept region only
lowers what they may use (`free_end`), and their capacity errors say so. The first region kept sits
at the very end, the next below it. Keeping one again (a new ring, a new table: its content starts
over) at most its size keeps its place; only the lowest may grow, downwards, so that no other
region ever moves under a peer that writes or reads it.
"""

from __future__ import annotations

from deep_ep.records import WORKSPACE_BYTES
from deep_ep.utils.math import align

REGION_ALIGNMENT_BYTES = 256


class TailRegions:
    """The kept regions of one window's data region, which ends at `data_bytes`."""

    def __init__(self, data_bytes: int) -> None:
        self.data_bytes = data_bytes
        self._regions: dict[str, tuple[int, int]] = {}  # name -> (offset, bytes), in the order kept

    @property
    def free_end(self) -> int:
        """Where the data region that calls may use ends: the lowest kept region's start."""
        return min((offset for offset, _ in self._regions.values()), default=self.data_bytes)

    def describe(self) -> str:
        """The kept regions, for an error's text (empty when none)."""
        return ", ".join(f"{name} {size} bytes" for name, (_, size) in self._regions.items())

    def fits(self, name: str, num_bytes: int) -> bool:
        """Whether `keep(name, num_bytes)` would succeed."""
        try:
            self._place(name, align(num_bytes, REGION_ALIGNMENT_BYTES), "fits")
        except ValueError:
            return False
        return True

    def keep(self, name: str, num_bytes: int, op: str) -> int:
        """Keep `num_bytes` for `name` (at its old place when they fit there); returns its window offset,
        or raises `ValueError` (naming `op`) when the data region cannot hold it."""
        num_bytes = align(num_bytes, REGION_ALIGNMENT_BYTES)
        offset = self._place(name, num_bytes, op)
        if name not in self._regions or num_bytes > self._regions[name][1]:
            self._regions[name] = (offset, num_bytes)
        return offset

    def _place(self, name: str, num_bytes: int, op: str) -> int:
        if name in self._regions:
            offset, size = self._regions[name]
            if num_bytes <= size:
                return offset
            if offset != self.free_end:
                raise ValueError(
                    f"{op}: needs {num_bytes} bytes at the end of the buffer's window for its {name} region, which holds "
                    f"{size} and cannot grow below the regions kept after it ({self.describe()}); keep the larger size "
                    "from the start"
                )
            end = offset + size
        else:
            end = self.free_end
        offset = (end - num_bytes) // REGION_ALIGNMENT_BYTES * REGION_ALIGNMENT_BYTES
        if offset < WORKSPACE_BYTES:
            kept = self.describe()
            raise ValueError(
                f"{op}: needs {num_bytes} bytes of the buffer's window for its {name} region; the window's data region "
                f"holds {self.data_bytes - WORKSPACE_BYTES}"
                + (f", of which {kept} are kept" if kept else "")
                + " (create the buffer with room for it: add its size hint)"
            )
        return offset
