"""Every NVLink kernel specialisation the GPU tests and the benchmark use compiles for sm_90a
against the installed NCCL headers, with no local memory and no spills (EP_JIT_PTXAS_CHECK)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from deep_ep.jit import KernelSpec, compile_spec

from deep_ep import kernels


@pytest.fixture(autouse=True)
def _sm90a_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("EP_JIT_ARCH", "sm_90a")
    monkeypatch.setenv("EP_JIT_PTXAS_CHECK", "1")
    monkeypatch.setenv("EP_JIT_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "jit-kernels"))


def test_warmup_specs_compile_without_spills():
    specs = kernels.warmup_specs()
    names = {spec.name for spec in specs}
    for kernel in ("dispatch", "dispatch_expand_rank", "dispatch_epilogue", "combine", "combine_epilogue",
                   "barrier", "peer_store"):  # fmt: skip
        assert f"deep_ep::{kernel}_impl" in names, kernel
    with ThreadPoolExecutor(max_workers=2) as pool:
        entries = list(pool.map(compile_spec, specs))
    assert len(entries) == len(specs)
    for spec, entry in zip(specs, entries, strict=True):
        assert entry.binary_path.stat().st_size > 0, spec
        assert spec.name.split("::")[-1] in entry.symbol, (spec.name, entry.symbol)


def test_moe_specs_cover_both_layouts_and_scale_formats():
    specs = kernels.moe_specs(num_ranks=8, hidden=4096, num_topk=8, num_experts=256, fp8_scale_bytes=(128, 32))
    dispatch = [s for s in specs if s.name == "deep_ep::dispatch_impl"]
    assert {s.template_args[1:3] for s in dispatch} == {(8192, 0), (4096, 128), (4096, 32)}
    combine = {s.template_args[3:6] for s in specs if s.name == "deep_ep::combine_impl"}
    assert combine == {(1, 512, "false"), (1, 512, "true"), (8, 512, "true")}
    assert all(isinstance(s, KernelSpec) for s in specs)
