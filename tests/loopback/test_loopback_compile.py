"""Every kernel specialisation the virtual-rank and virtual-node GPU tests can launch compiles for sm_90a
without local memory or spills (EP_JIT_PTXAS_CHECK), so CI builds what the one-GPU suite runs."""

from __future__ import annotations

import pytest
from deep_ep.jit import compile_many
from nodes import node_test_specs
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


def test_every_kernel_of_the_virtual_node_tests_compiles_over_both_emulated_nics():
    specs = node_test_specs()
    entries = compile_many(specs)
    assert len(entries) == len(specs) and all(entry.binary_path.stat().st_size > 0 for entry in entries)
    transports = {spec.template_args[-1] for spec in specs}
    assert transports == {"deep_ep::transport::Emulated<false>", "deep_ep::transport::Emulated<true>",
                          "deep_ep::transport::Hybrid<deep_ep::transport::Emulated<false>>",
                          "deep_ep::transport::Hybrid<deep_ep::transport::Emulated<true>>",
                          "deep_ep::transport::Hybrid<deep_ep::transport::Emulated<false>, true>",
                          "deep_ep::transport::Hybrid<deep_ep::transport::Emulated<true>, true>"}, transports  # fmt: skip
    print(f"\n{len(specs)} virtual-node kernel specialisations compiled")
