"""The transport self-test's arguments (deep_ep.backends.kernels.ping), refused with the argument
named before any kernel runs; the ping itself runs in test_transport_ping_gpu.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from deep_ep.backends.kernels.ping import PING_MISTAKES, transport_ping


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(num_bytes=24), "`num_bytes` must be a positive multiple of 16, got 24"),
        (dict(transport="gin"), "`transport` must be 'lsa' or one of ('emulated-eager', 'emulated-strict'), got 'gin'"),
        (dict(mistake="no_flush"), "`mistake` must be one of [None, 'no_flush', 'signal_first', 'split_contexts']"),
        (dict(transport="emulated-strict", mistake="late"), "got 'late' with 'emulated-strict'"),
    ],
)
def test_bad_ping_arguments_are_refused_naming_the_argument(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        transport_ping(None, **kwargs)  # type: ignore[arg-type]  (refused before the runtime is used)


def test_every_mistake_has_the_emulated_nics_code():
    header = Path(__file__).resolve().parents[2] / "include/deep_ep/transport/emulated.cuh"
    enum = re.search(r"enum NicMistake : int \{([^}]*)\}", header.read_text()).group(1)
    codes = {name.strip(): int(value) for name, value in re.findall(r"(\w+) = (\d+)", enum)}
    names = {None: "kNicCorrect", "no_flush": "kNicNoFlush", "signal_first": "kNicSignalFirst",
             "split_contexts": "kNicSplitContexts"}  # fmt: skip
    assert {mistake: codes[names[mistake]] for mistake in PING_MISTAKES} == PING_MISTAKES
