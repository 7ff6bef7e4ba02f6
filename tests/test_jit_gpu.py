"""deep_ep.jit.kernel on a GPU: results, cooperative/cluster/PDL launches, opaque structs, launch overhead, warm loads.

Run on the GPU machine with `python -m pytest -m gpu tests/test_jit_gpu.py -s`; the measured figures
are printed and, when EP_TEST_REPORT_DIR is set, written to `$EP_TEST_REPORT_DIR/jit_gpu.json`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from deep_ep.jit import (
    F32,
    F64,
    I32,
    I64,
    U32,
    U64,
    Bool,
    CUDADriverError,
    Opaque,
    compile_spec,
    get_kernel,
    measure_launch_overhead,
)
from kernels import jit_specs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

POISON = -0x5A5A5A5A
TESTS_DIR = Path(__file__).resolve().parent


def report(name: str, value: Any) -> None:
    """Print a measured figure (visible with -s) and add it to $EP_TEST_REPORT_DIR/jit_gpu.json."""
    print(f"\n[jit-gpu] {name}: {value}")
    folder = os.environ.get("EP_TEST_REPORT_DIR")
    if folder:
        path = Path(folder) / "jit_gpu.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        data = json.loads(path.read_text()) if path.exists() else {}
        data[name] = value
        path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def wait(stream: torch.cuda.Stream | None = None, timeout: float = 30.0) -> None:
    """Wait for the stream's work with a deadline, so a hang fails the test instead of the job."""
    event = torch.cuda.Event()
    event.record(stream)
    deadline = time.monotonic() + timeout
    while not event.query():
        if time.monotonic() > deadline:
            pytest.fail(f"GPU work did not finish within {timeout} s (hang?)")
        time.sleep(1e-4)


def test_scalar_arguments_of_every_width_reach_the_kernel():
    kernel = get_kernel(jit_specs.scalars())
    assert kernel.param_sizes == [8, 8, 4, 4, 4, 8, 8, 4, 8, 1]
    n = 100_003
    x = torch.randint(-1000, 1000, (n,), dtype=torch.int32, device="cuda")
    out = torch.full((n + 64,), POISON, dtype=torch.int64, device="cuda")  # the tail must stay poisoned
    b, c, d, s, e = 3_000_000_000, -(2**40), (0xBEEF << 48) | 77, 2.5, -1.25
    bias = b + c + 0xBEEF + int(s * 4) + int(e * 8) + 1000
    side, raw = torch.cuda.Stream(), torch.cuda.Stream()
    for a, stream in ((-7, None), (11, side), (5, raw.cuda_stream)):
        out.fill_(POISON)
        args = (x, out, I32(n), I32(a), U32(b), I64(c), U64(d), F32(s), F64(e), Bool(True))
        kernel.launch(grid=(40,), block=(128,), args=args, stream=stream)
        if isinstance(stream, int):
            torch.cuda.synchronize()
        else:
            wait(stream)
        assert torch.equal(out[:n], x.long() * a + bias), f"stream {stream!r}"
        assert bool((out[n:] == POISON).all())
    assert get_kernel(jit_specs.scalars()) is kernel  # memoized per process and device


def test_cooperative_launch_with_grid_sync():
    kernel = get_kernel(jit_specs.coop())
    num_sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    per_sm = kernel.occupancy(128)
    grid = num_sms * min(per_sm, 2)
    slots = torch.full((grid,), -1, dtype=torch.int32, device="cuda")
    out = torch.full((grid,), POISON, dtype=torch.int64, device="cuda")
    kernel.launch(grid=(grid,), block=(128,), args=(slots, out), cooperative=True)
    wait()
    expected = 4 * ((torch.arange(grid, device="cuda") + 1) % grid)  # 4 rounds of the neighbour's value
    assert torch.equal(out, expected)
    # More blocks than can be co-resident: the driver refuses, and the error names the reason.
    with pytest.raises(CUDADriverError, match="CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE") as caught:
        kernel.launch(grid=(num_sms * per_sm + 1,), block=(128,), args=(slots, out), cooperative=True)
    assert caught.value.call == "cuLaunchKernelEx"


def test_cluster_launch_gives_blocks_a_cluster_rank_and_shared_memory_of_the_partner():
    kernel = get_kernel(jit_specs.cluster())
    grid = 16
    out = torch.full((grid * 3,), POISON, dtype=torch.int32, device="cuda")
    kernel.launch(grid=(grid,), block=(64,), args=(out,), cluster=(2,))
    wait()
    blocks = torch.arange(grid, device="cuda", dtype=torch.int32)
    expected = torch.stack([blocks % 2, torch.full_like(blocks, 2), blocks ^ 1], dim=1).flatten()
    assert torch.equal(out, expected)
    with pytest.raises(ValueError, match="multiple of cluster"):
        kernel.launch(grid=(7,), block=(64,), args=(out,), cluster=(2,))


def test_programmatic_dependent_launch_pair():
    producer, consumer = get_kernel(jit_specs.pdl_producer()), get_kernel(jit_specs.pdl_consumer())
    n, seed, spin_ns = 8192, 17, 200_000
    buf = torch.full((n,), -1, dtype=torch.int32, device="cuda")
    out = torch.full((n,), POISON, dtype=torch.int32, device="cuda")
    producer_end = torch.zeros(1, dtype=torch.int64, device="cuda")
    consumer_start = torch.full((1,), 2**63 - 1, dtype=torch.int64, device="cuda")
    stream = torch.cuda.Stream()
    producer.launch(grid=(4,), block=(256,), args=(buf, I32(n), I32(seed), U64(spin_ns), producer_end), stream=stream)
    consumer.launch(grid=(4,), block=(256,), args=(buf, out, I32(n), consumer_start), stream=stream, pdl=True)
    wait(stream)
    assert torch.equal(out, torch.arange(n, device="cuda", dtype=torch.int32) * 3 + seed + 1)
    head_start_us = (producer_end.item() - consumer_start.item()) / 1e3
    report("pdl_consumer_started_before_producer_end_us", round(head_start_us, 1))
    # The consumer started while the producer still spun: the PDL attribute took effect.
    assert head_start_us > 0, "the dependent kernel did not start before the producer finished"


def test_opaque_struct_arrives_byte_for_byte():
    kernel = get_kernel(jit_specs.opaque())
    assert kernel.param_sizes == [jit_specs.OPAQUE_BYTES, 8, 8, 8]
    blob = os.urandom(jit_specs.OPAQUE_BYTES)
    out = torch.full((jit_specs.OPAQUE_BYTES,), 0xA5, dtype=torch.uint8, device="cuda")
    tail = torch.zeros(1, dtype=torch.int64, device="cuda")
    kernel.launch(grid=(1,), block=(64,), args=(Opaque(blob), U64(0x0123456789ABCDEF), out, tail))
    wait()
    assert bytes(out.cpu().numpy().tobytes()) == blob
    assert tail.item() == 0x0123456789ABCDEF
    with pytest.raises(TypeError, match="248 bytes"):  # e.g. a 2.32 ncclDevComm sent to a 2.28 kernel
        kernel.launch(grid=(1,), block=(64,), args=(Opaque(bytes(248)), U64(0), out, tail))


def test_dynamic_shared_memory_above_48_kib():
    kernel = get_kernel(jit_specs.smem())
    threads, num_ints, grid = 256, 100 * 1024 // 4, 3
    out = torch.full((grid * threads,), POISON, dtype=torch.int64, device="cuda")
    kernel.launch(grid=(grid,), block=(threads,), args=(out, I32(num_ints)), shared_mem=num_ints * 4)
    wait()
    words = torch.arange(num_ints, dtype=torch.int64) * 7
    per_class = torch.zeros(threads, dtype=torch.int64).index_add_(0, torch.arange(num_ints) % threads, words)
    counts = torch.bincount(torch.arange(num_ints) % threads, minlength=threads)
    lane = (torch.arange(threads) + 1) % threads
    expected = torch.cat([per_class[lane] + counts[lane] * block for block in range(grid)])
    assert torch.equal(out.cpu(), expected)


def test_driver_errors_carry_the_driver_name_and_string():
    kernel = get_kernel(jit_specs.empty())
    with pytest.raises(CUDADriverError) as caught:
        kernel.launch(grid=(1,), block=(4096,))  # more threads than a block may have
    assert caught.value.name == "CUDA_ERROR_INVALID_VALUE" and "cuLaunchKernelEx" in str(caught.value)
    assert caught.value.description and caught.value.description in str(caught.value)


def test_launch_host_overhead():
    empty, with_args = get_kernel(jit_specs.empty()), get_kernel(jit_specs.empty_args())
    src = torch.zeros(16, dtype=torch.int32, device="cuda")
    args = (Opaque(bytes(jit_specs.OPAQUE_BYTES)), U64(1 << 40), src, I32(128), U64(1 << 20))
    stream = torch.cuda.Stream()
    figures = {
        "no_args_raw_stream": measure_launch_overhead(empty, 1, 32, (), stream=stream.cuda_stream),
        "5_args_raw_stream": measure_launch_overhead(with_args, 1, 32, args, stream=stream.cuda_stream),
        "5_args_torch_stream": measure_launch_overhead(with_args, 1, 32, args, stream=stream),
        "5_args_current_stream": measure_launch_overhead(with_args, 1, 32, args),
        "5_args_pdl": measure_launch_overhead(with_args, 1, 32, args, stream=stream.cuda_stream, pdl=True),
    }
    for name, figure in figures.items():
        report(f"launch_overhead_{name}_median_us", round(figure["median_us"], 2))
        report(f"launch_overhead_{name}_p90_us", round(figure["p90_us"], 2))
    report("launch_overhead_target_10us_met", all(f["median_us"] < 10 for f in figures.values()))
    for name, figure in figures.items():
        assert figure["median_us"] < 50, f"{name}: {figure}"


_WARM_LOAD = textwrap.dedent(
    """
    import json, sys, time
    started = time.perf_counter()
    import torch
    torch.zeros(1, device="cuda")
    sys.path.insert(0, {tests!r})
    from deep_ep.jit import I32, get_kernel, stats
    from kernels import jit_specs
    ready = time.perf_counter()
    loads = []
    for make in (jit_specs.scalars, jit_specs.coop, jit_specs.cluster):
        begin = time.perf_counter()
        kernel = get_kernel(make())
        loads.append(time.perf_counter() - begin)
    out = torch.zeros(1024, dtype=torch.int32, device="cuda")
    get_kernel(jit_specs.cluster()).launch(grid=(2,), block=(64,), args=(out,), cluster=(2,))
    torch.cuda.synchronize()
    print(json.dumps({{"startup_s": ready - started, "loads_s": loads, "stats": stats(),
                      "ok": out[:6].tolist() == [0, 2, 1, 1, 2, 0]}}))
    """
)


def test_warm_cache_load_in_a_fresh_process(jit_cache):
    started = time.perf_counter()
    for make in (jit_specs.scalars, jit_specs.coop, jit_specs.cluster):
        compile_spec(make())
    report("cold_compile_3_kernels_s", round(time.perf_counter() - started, 3))

    result = subprocess.run(
        [sys.executable, "-c", _WARM_LOAD.format(tests=str(TESTS_DIR))],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ.copy(),
        check=False,
    )
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["ok"]
    assert figures["stats"].get("compile", 0) == 0 and figures["stats"].get("hit", 0) == 3
    report("fresh_process_startup_s", round(figures["startup_s"], 3))
    report("warm_load_first_kernel_ms", round(figures["loads_s"][0] * 1e3, 2))
    report("warm_load_next_kernels_ms", [round(s * 1e3, 2) for s in figures["loads_s"][1:]])
