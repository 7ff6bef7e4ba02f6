"""Every kernel specialisation the virtual-rank GPU tests can launch compiles for sm_90a without local
memory or spills (EP_JIT_PTXAS_CHECK), so CI builds what the one-GPU suite runs."""

from __future__ import annotations

import pytest
from deep_ep.jit import compile_many
from sweep import SHAPES, kernel_specs

pytestmark = pytest.mark.usefixtures("sm90a_checked_cache")


def test_every_kernel_of_the_virtual_rank_sweep_compiles():
    specs = [spec for num_ranks in SHAPES for spec in kernel_specs(num_ranks)]
    entries = compile_many(specs)
    assert len(entries) == len(specs) and all(entry.binary_path.stat().st_size > 0 for entry in entries)
    names = {spec.name for spec in specs}
    assert {f"deep_ep::{k}_impl" for k in ("dispatch", "dispatch_expand_rank", "dispatch_epilogue", "combine",
                                           "combine_epilogue", "barrier")} <= names  # fmt: skip
    print(f"\n{len(specs)} virtual-rank kernel specialisations compiled")
