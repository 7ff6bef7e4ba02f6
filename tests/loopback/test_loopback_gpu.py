"""The NVLink kernels on virtual ranks of one GPU (`deep_ep.loopback`), bitwise against `deep_ep.reference`.

EP 2, 3, 4, 8 and 16: a random sweep of every dispatch and combine option, CUDA-graph capture and
replay, and the fault paths (a rank that skips a call, a failure inside a graph replay, invalid
routing inside a graph, an exception between two launches, ranks running different operations),
with guard bytes around every window and output. Run on the GPU machine: `python -m pytest -m gpu
tests/loopback`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist
from graphs import graph_rank

from deep_ep.loopback import LoopbackWorld

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

# Cases per world size (EP_LOOPBACK_CASES scales them, e.g. 0.1 for a quick look)
NUM_CASES = {n: max(4, round(c * float(os.environ.get("EP_LOOPBACK_CASES", "1")))) for n, c in
             {2: 70, 3: 60, 4: 70, 8: 60, 16: 50}.items()}  # fmt: skip
# The deadline of the fault tests (EP_FAULT_TIMEOUT_S: longer under compute-sanitizer, which slows kernels)
FAULT_TIMEOUT_S = float(os.environ.get("EP_FAULT_TIMEOUT_S", "2"))


def _seed() -> int:
    return int(os.environ.get("EP_TEST_SEED", time.time_ns() % 1_000_000))


def _compile(specs: list) -> None:
    from deep_ep.jit import compile_many

    compile_many(specs)


def _error_of(call, error_type: type[BaseException] | tuple) -> str | None:
    """The text of the `error_type` that `call()` raises, or `None` when it returns."""
    try:
        call()
    except error_type as error:
        return str(error)
    return None


def _run_guarded(num_ranks: int, fn, *args) -> tuple[list, list[str]]:
    """`fn` on a world with guard bytes around every window and output: the ranks' results, and
    what wrote outside them (`LoopbackWorld.check_guards`)."""
    world = LoopbackWorld(num_ranks, guard_bytes=64 << 10)
    outcomes = world.run(fn, *args)
    damaged = world.check_guards()
    world.close()
    return outcomes, damaged


# ---------------------------------------------------------------------------- the sweep


# 310 cases plus a cold compile of every variant: 145 to 213 s measured, past the suite's 240 s per
# test once the kernel cache is cold
@pytest.mark.timeout(540)
def test_random_configurations_at_ep2_to_ep16_bitwise_equal_to_the_reference():
    from sweep import kernel_specs, make_cases, sweep_rank

    seed = _seed()
    started = time.monotonic()
    _compile([spec for n in NUM_CASES for spec in kernel_specs(n)])
    compiled = time.monotonic()
    lines = []
    for num_ranks, num_cases in NUM_CASES.items():
        cases = make_cases(num_ranks, num_cases, seed)
        world = LoopbackWorld(num_ranks)
        begin = time.monotonic()
        counts = world.run(sweep_rank, cases, seed)
        world.close()
        assert counts == [num_cases] * num_ranks
        lines.append(f"EP{num_ranks}: {num_cases} cases in {time.monotonic() - begin:.1f} s")
    total = sum(NUM_CASES.values())
    print(f"\nloopback sweep, seed {seed}: {total} configurations bitwise equal to deep_ep.reference in "
          f"{time.monotonic() - compiled:.1f} s (+{compiled - started:.1f} s compiling): {'; '.join(lines)}")  # fmt: skip


# ---------------------------------------------------------------------------- CUDA graphs


@pytest.mark.parametrize("num_ranks", [4, 8])
def test_cuda_graph_replays_of_fresh_and_cached_dispatch_and_combine(num_ranks):
    seed = _seed()
    world = LoopbackWorld(num_ranks)
    checked = world.run(graph_rank, seed, 3)
    world.close()
    assert checked == [12] * num_ranks
    print(f"\ngraphs, EP{num_ranks}: {checked[0]} replays (BF16 and FP8, both layouts) checked, seed {seed}")


# ---------------------------------------------------------------------------- faults


def _fault_buffer(group, **kwargs):
    import deep_ep

    return deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=128, hidden=2048, num_topk=8, explicitly_destroy=True,
                                 num_gpu_timeout_secs=FAULT_TIMEOUT_S, num_cpu_timeout_secs=60, **kwargs)  # fmt: skip


def _no_sync_sequence(buf, x, topk_idx, weights, num_experts):
    """A fresh dispatch without CPU sync, its combine and a cached dispatch, queued without a host wait."""
    out = buf.dispatch(x, topk_idx=topk_idx, topk_weights=weights, num_experts=num_experts, do_cpu_sync=False)
    rows = torch.ones((out[3].num_recv_tokens, out[3].hidden), dtype=torch.bfloat16, device="cuda")
    buf.combine(rows, out[3])
    buf.dispatch(x, handle=out[3])
    return out


def _skip_rank(rank: int, group: dist.ProcessGroup, skipper: int) -> dict:
    from kernel_checks import make_inputs

    import deep_ep

    num_experts = 8 * group.size()
    buf = _fault_buffer(group)
    x, topk_idx, weights, _ = make_inputs(
        rank, group.size(), 100, 2048, "bf16", num_experts, 8, "uniform", 0.0, 0, 7, "cuda"
    )
    _no_sync_sequence(buf, x, topk_idx, weights, num_experts)  # every kernel loaded, on every rank
    torch.cuda.current_stream().synchronize()
    dist.barrier(group=group)
    started = time.monotonic()
    outcome: dict = {}
    if rank == skipper:
        # Skip one sequence; the next call finds the failure that the peers posted
        time.sleep(3 * FAULT_TIMEOUT_S)
        outcome["error"] = _error_of(
            lambda: buf.dispatch(x, topk_idx=topk_idx, topk_weights=weights, num_experts=num_experts),
            deep_ep.EPTimeoutError,
        )
    else:
        _no_sync_sequence(buf, x, topk_idx, weights, num_experts)
        torch.cuda.current_stream().synchronize()
        outcome["stopped_s"] = time.monotonic() - started
        outcome["error"] = _error_of(buf.barrier, deep_ep.EPTimeoutError)
        outcome["raised_s"] = time.monotonic() - started
        try:
            buf.dispatch(x, topk_idx=topk_idx, num_experts=num_experts)
            outcome["again"] = "no error"
        except (deep_ep.EPTimeoutError, ValueError) as error:
            outcome["again"] = type(error).__name__
    buf.destroy()
    return outcome


def _round_trip_rank(rank: int, group: dist.ProcessGroup, seed: int) -> bool:
    from sweep import make_buffers, make_cases, run_case

    buffers = make_buffers(group, group.size())
    for case in make_cases(group.size(), 3, seed):
        run_case(buffers, rank, group.size(), case, seed)
    for pair in buffers.values():
        for buffer in pair:
            buffer.destroy()
    return True


@pytest.mark.parametrize("num_ranks", [4, 16])
def test_a_rank_that_skips_a_call_stops_every_rank_within_one_deadline(num_ranks):
    skipper = num_ranks - 1
    outcomes, damaged = _run_guarded(num_ranks, _skip_rank, skipper)
    for rank, outcome in enumerate(outcomes):
        assert outcome["error"] is not None, f"rank {rank} did not raise: {outcome}"
        if rank == skipper:
            assert f"told rank {skipper}" in outcome["error"], outcome
        else:
            assert f"waiting for rank {skipper}" in outcome["error"], outcome
            assert outcome["raised_s"] < 2 * FAULT_TIMEOUT_S, f"rank {rank} took {outcome['raised_s']:.2f} s"
            assert outcome["again"] in ("EPTimeoutError", "ValueError"), outcome
    assert damaged == [], damaged
    # A new world works in the same process
    fresh = LoopbackWorld(num_ranks)
    assert fresh.run(_round_trip_rank, _seed()) == [True] * num_ranks
    fresh.close()
    slowest = max(o["raised_s"] for r, o in enumerate(outcomes) if r != skipper)
    print(f"\nskip, EP{num_ranks}: every rank raised, the last {slowest:.2f} s after the call (deadline "
          f"{FAULT_TIMEOUT_S:g} s); guards intact; rank 0: {outcomes[0]['error'][:160]}")  # fmt: skip


def _captured_sequence(rank: int, group: dist.ProcessGroup, num_tokens: int, dtype: str, routing: str,
                       seed: int) -> tuple:  # fmt: skip
    """A fault buffer, its inputs, and a CUDA graph of `_no_sync_sequence` captured after a warm-up
    (every rank lined up first: capture synchronizes the device)."""
    from kernel_checks import make_inputs

    num_experts = 8 * group.size()
    buf = _fault_buffer(group)
    x, topk_idx, weights, _ = make_inputs(rank, group.size(), num_tokens, 2048, dtype, num_experts, 8, routing, 0.1,
                                          0, seed, "cuda")  # fmt: skip
    _no_sync_sequence(buf, x, topk_idx, weights, num_experts)
    dist.barrier(group=group)
    torch.cuda.current_stream().synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=torch.cuda.current_stream(), capture_error_mode="thread_local"):
        out = _no_sync_sequence(buf, x, topk_idx, weights, num_experts)
    dist.barrier(group=group)  # every rank has captured (and allocated) before any replays
    return buf, topk_idx, graph, out


def _graph_fault_rank(rank: int, group: dist.ProcessGroup, skipper: int) -> dict:
    import deep_ep

    buf, _, graph, _ = _captured_sequence(rank, group, 100, "fp32", "hot", 9)
    graph.replay()
    torch.cuda.current_stream().synchronize()
    dist.barrier(group=group)
    outcome: dict = {}
    started = time.monotonic()
    if rank != skipper:
        graph.replay()  # the skipper does not replay this time
        torch.cuda.current_stream().synchronize()
    else:
        time.sleep(3 * FAULT_TIMEOUT_S)
    outcome["error"] = _error_of(buf.barrier, deep_ep.EPTimeoutError)
    outcome["raised_s"] = time.monotonic() - started
    del graph
    buf.destroy()
    return outcome


def test_a_failure_inside_a_graph_replay_stops_every_rank_and_writes_nothing_outside():
    num_ranks, skipper = 4, 2
    outcomes, damaged = _run_guarded(num_ranks, _graph_fault_rank, skipper)
    for rank, outcome in enumerate(outcomes):
        assert outcome["error"] is not None, f"rank {rank} did not raise: {outcome}"
        assert f"rank {skipper}" in outcome["error"], outcome
        if rank != skipper:
            assert outcome["raised_s"] < 2 * FAULT_TIMEOUT_S, outcome
    assert damaged == [], damaged
    print(f"\ngraph fault, EP{num_ranks}: every rank raised; guards intact; rank 0: {outcomes[0]['error'][:160]}")


def _bad_routing_rank(rank: int, group: dist.ProcessGroup, bad_rank: int, eager: bool) -> dict:
    from kernel_checks import check_dispatch, equal, make_inputs

    import deep_ep

    num_experts = 8 * group.size()
    graph = None
    outcome: dict = {}
    if eager:  # a no-sync dispatch leaves the values to the kernel: no host sync
        buf = _fault_buffer(group)
        x, topk_idx, weights, _ = make_inputs(rank, group.size(), 64, 2048, "bf16", num_experts, 8, "uniform", 0.1,
                                              0, 3, "cuda")  # fmt: skip
        _no_sync_sequence(buf, x, topk_idx, weights, num_experts)
        if rank == bad_rank:
            topk_idx = topk_idx.clone()
            topk_idx[17, 2] = num_experts + 5
        topk_before = topk_idx.clone()
        # No host wait: the dispatch raises once all its work is queued if its kernel has found the
        # value by then, else the rank's next call does
        outcome["error"] = _error_of(lambda: outcome.update(out=buf.dispatch(
            x, topk_idx=topk_idx, topk_weights=weights, num_experts=num_experts, do_cpu_sync=False)), ValueError)  # fmt: skip
        torch.cuda.current_stream().synchronize()
        outcome["inputs_intact"] = torch.equal(topk_idx, topk_before)
        out = outcome.pop("out", None)
    else:
        buf, topk_idx, graph, out = _captured_sequence(rank, group, 64, "bf16", "uniform", 3)
        if rank == bad_rank:
            topk_idx[17, 2] = num_experts + 5  # inside the graph: no host check sees it
        graph.replay()
        torch.cuda.current_stream().synchronize()
        outcome["error"] = None
    outcome["dst_slots"] = out[3].dst_buffer_slot_idx.unique().tolist() if rank == bad_rank and out else None
    # The bad rank raises (at its next call) and tells its peers, which raise at their next wait for it
    calls = (lambda: buf.barrier()) if rank == bad_rank else (lambda: (buf.barrier(), buf.barrier()))
    if outcome["error"] is None:
        outcome["error"] = _error_of(calls, (ValueError, deep_ep.EPPeerError))
    del graph
    torch.cuda.current_stream().synchronize()
    dist.barrier(group=group)
    buf.destroy()
    # A new buffer on the same group works: a dispatch and a combine against the reference
    buf = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=128, hidden=2048, num_topk=8, explicitly_destroy=True)
    reference = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=128, hidden=2048, num_topk=8,
                                      backend="reference", explicitly_destroy=True)  # fmt: skip
    x, topk_idx, weights, _ = make_inputs(
        rank, group.size(), 80, 2048, "bf16", num_experts, 8, "hot", 0.1, 0, 4, "cuda"
    )
    outs = [b.dispatch(x, topk_idx=topk_idx, topk_weights=weights, num_experts=num_experts) for b in (buf, reference)]
    handle = check_dispatch(outs[0], outs[1], False, False, "dispatch after the error")
    rows = torch.randn((handle.num_recv_tokens, 2048), device="cuda").to(torch.bfloat16)
    equal(buf.combine(rows, outs[0][3])[0], reference.combine(rows, outs[1][3])[0], "combine on the new buffer")
    buf.destroy()
    reference.destroy()
    return outcome


@pytest.mark.parametrize("eager", [False, True], ids=["graph", "eager-no-sync"])
def test_invalid_routing_without_cpu_sync_sends_nothing_and_raises_at_the_next_call(eager):
    num_ranks, bad_rank = 4, 1
    outcomes, damaged = _run_guarded(num_ranks, _bad_routing_rank, bad_rank, eager)
    bad = outcomes[bad_rank]
    # A handle came back unless the call itself raised (eager: its kernel was done by then)
    assert bad["dst_slots"] == [-1] or (eager and bad["dst_slots"] is None), bad
    if eager:
        assert all(o["inputs_intact"] for o in outcomes), outcomes
    assert bad["error"] is not None and "at [17, 2]" in bad["error"] and f"got {8 * num_ranks + 5}" in bad["error"], bad
    for rank, outcome in enumerate(outcomes):
        if rank != bad_rank:
            assert f"rank {bad_rank} stopped the buffer" in (outcome["error"] or ""), outcomes
    assert damaged == [], damaged
    print(f"\ninvalid routing ({'eager' if eager else 'graph'}): rank {bad_rank} raised {bad['error'][:140]}")


def _between_launches_rank(rank: int, group: dist.ProcessGroup) -> dict:
    import dataclasses

    from kernel_checks import make_inputs

    import deep_ep

    num_experts = 8 * group.size()
    buf = _fault_buffer(group)
    x, topk_idx, _, _ = make_inputs(rank, group.size(), 64, 2048, "bf16", num_experts, 8, "uniform", 0.0, 0, 5, "cuda")
    buf.dispatch(x, topk_idx=topk_idx, num_experts=num_experts)  # kernels loaded
    outcome: dict = {}
    if rank == 0:
        # The exact outputs of a CPU-sync dispatch are allocated after its first launch: fail at the
        # first allocation after a launch
        runtime = buf.backend.runtime
        buf._steady = None  # the Python path's allocations and launches (a replay makes its own in C++)
        state = {"launched": False, "failed": False}
        real_empty, real_launch = runtime.share.empty, runtime.launch

        def noting_launch(*args, **kwargs):
            state["launched"] = True
            return real_launch(*args, **kwargs)

        def failing_empty(*args, **kwargs):
            if state["launched"] and not state["failed"]:
                state["failed"] = True
                raise torch.cuda.OutOfMemoryError("injected after the first launch")
            return real_empty(*args, **kwargs)

        runtime.launch = noting_launch
        runtime.share = dataclasses.replace(runtime.share, empty=failing_empty)
        try:
            buf.dispatch(x, topk_idx=topk_idx, num_experts=num_experts)
        except torch.cuda.OutOfMemoryError:
            outcome["first"] = "OutOfMemoryError"
        try:
            buf.dispatch(x, topk_idx=topk_idx, num_experts=num_experts)
            outcome["retry"] = "ran"
        except (deep_ep.EPError, ValueError) as error:
            outcome["retry"] = str(error)
    else:
        try:
            buf.dispatch(x, topk_idx=topk_idx, num_experts=num_experts)
            buf.dispatch(x, topk_idx=topk_idx, num_experts=num_experts)
            outcome["retry"] = "ran"
        except deep_ep.EPTimeoutError as error:
            outcome["retry"] = str(error)
    buf.destroy()
    return outcome


def test_an_exception_between_two_launches_makes_the_buffer_unusable():
    outcomes, damaged = _run_guarded(2, _between_launches_rank)
    assert outcomes[0]["first"] == "OutOfMemoryError"
    assert "unusable" in outcomes[0]["retry"], outcomes
    assert "timed out" in outcomes[1]["retry"] or "unusable" in outcomes[1]["retry"], outcomes
    assert damaged == [], damaged


def _mismatch_rank(rank: int, group: dist.ProcessGroup) -> dict:
    from kernel_checks import make_inputs

    import deep_ep

    num_experts = 8 * group.size()
    buf = _fault_buffer(group)
    x, topk_idx, _, _ = make_inputs(rank, group.size(), 64, 2048, "bf16", num_experts, 8, "uniform", 0.0, 0, 5, "cuda")
    handle = buf.dispatch(x, topk_idx=topk_idx, num_experts=num_experts)[3]
    rows = torch.ones((handle.num_recv_tokens, 2048), dtype=torch.bfloat16, device="cuda")
    buf.combine(rows, handle)
    buf.dispatch(x, topk_idx=topk_idx, num_experts=num_experts)  # kernels loaded
    buf.combine(rows, handle)
    dist.barrier(group=group)
    started = time.monotonic()
    outcome: dict = {}
    try:
        if rank == 0:
            buf.combine(rows, handle)  # while the others dispatch
            buf.barrier()
        else:
            buf.dispatch(x, topk_idx=topk_idx, num_experts=num_experts)
        outcome["error"] = None
    except (deep_ep.EPOperationMismatchError, deep_ep.EPTimeoutError) as error:
        outcome["error"] = f"{type(error).__name__}: {error}"
    outcome["raised_s"] = time.monotonic() - started
    buf.destroy()
    return outcome


def test_ranks_running_different_operations_all_raise():
    world = LoopbackWorld(4)
    outcomes = world.run(_mismatch_rank)
    world.close()
    for rank, outcome in enumerate(outcomes):
        assert outcome["error"] is not None and "EPOperationMismatchError" in outcome["error"], (rank, outcome)
        assert outcome["raised_s"] < FAULT_TIMEOUT_S, (rank, outcome)
    print(f"\nmismatch: every rank raised at once; rank 1: {outcomes[1]['error'][:160]}")


def _late_peer_rank(rank: int, group: dist.ProcessGroup, seed: int) -> float:
    """A no-sync dispatch on the kernels, then the same dispatch on the reference, whose checks read
    `topk_idx` values on the host while this rank's stream still waits for the late rank 1."""
    from kernel_checks import check_dispatch, make_inputs

    import deep_ep
    from deep_ep.host_reads import wait_for_stream

    def make(backend: str):
        return deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=128, hidden=2560, num_topk=8, backend=backend,
                                     explicitly_destroy=True, num_gpu_timeout_secs=FAULT_TIMEOUT_S)  # fmt: skip

    kbuf, rbuf = make("kernels"), make("reference")
    x, topk_idx, weights, _ = make_inputs(rank, group.size(), 100, 2560, "bf16", 8 * group.size(), 8, "uniform", 0.1,
                                          0, seed, "cuda")  # fmt: skip
    args = dict(topk_idx=topk_idx, topk_weights=weights, num_experts=8 * group.size(), do_cpu_sync=False)
    kbuf.dispatch(x, **args)  # every kernel loaded
    rbuf.dispatch(x, **args)
    wait_for_stream()
    dist.barrier(group=group)
    started = time.monotonic()
    if rank == 1:
        time.sleep(FAULT_TIMEOUT_S / 4)
    out = kbuf.dispatch(x, **args)
    check_dispatch(out, rbuf.dispatch(x, **args), False, False, "dispatch with a late peer")
    elapsed = time.monotonic() - started
    kbuf.destroy()
    rbuf.destroy()
    return elapsed


def test_a_host_read_while_a_peer_is_late_does_not_hold_the_peer_back():
    """A copy to pageable host memory waits inside the driver and holds back the other threads' CUDA
    calls: before `deep_ep.host_reads`, rank 0's read here held rank 1's launch until the deadline."""
    world = LoopbackWorld(2)
    elapsed = world.run(_late_peer_rank, _seed())
    world.close()
    assert max(elapsed) < FAULT_TIMEOUT_S * 0.75, elapsed
    print(
        f"\nlate peer: both ranks done {max(elapsed):.2f} s after the barrier (rank 1 started {FAULT_TIMEOUT_S / 4:g} s late)"
    )


# ---------------------------------------------------------------------------- the world itself


def _green_rank(rank: int, group: dist.ProcessGroup, seed: int) -> bool:
    return _round_trip_rank(rank, group, seed)


def test_green_contexts_partition_the_sms():
    world = LoopbackWorld(4, green_contexts=True)
    assert world.num_sms_per_rank % 8 == 0 and world.num_sms_per_rank * 4 <= world.num_device_sms
    assert world.run(_green_rank, _seed()) == [True] * 4
    world.close()


def test_a_world_that_cannot_fit_is_refused():
    with pytest.raises(ValueError, match="do not fit"):
        LoopbackWorld(4, num_sms_per_rank=1000)
    with pytest.raises(ValueError, match="num_ranks"):
        LoopbackWorld(65)


_TEARDOWN = """
import datetime, torch, torch.distributed as dist
import deep_ep
from deep_ep.utils.spawn import find_free_port
dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{find_free_port()}", rank=0, world_size=1,
                        device_id=torch.device("cuda", 0), timeout=datetime.timedelta(seconds=60))
buf = deep_ep.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=64, hidden=1024, num_topk=4,
                            explicitly_destroy={explicit})
assert buf.backend.name == "kernels", buf.backend.name
x = torch.randn(32, 1024, device="cuda").to(torch.bfloat16)
topk = torch.randint(0, 8, (32, 4), device="cuda")
topk = torch.stack([torch.randperm(8, device="cuda")[:4] for _ in range(32)])
recv, _, _, handle, _ = buf.dispatch(x, topk_idx=topk, num_experts=8)
y = buf.combine(recv, handle)[0]
torch.cuda.synchronize()
if {explicit}:
    buf.destroy()
if {destroy_group}:
    dist.destroy_process_group()
print("done")
"""


@pytest.mark.parametrize("explicit", [False, True], ids=["finalizer", "explicit"])
@pytest.mark.parametrize("destroy_group", [True, False], ids=["group-destroyed", "group-alive"])
def test_a_world_of_one_rank_tears_down_silently_at_exit(explicit, destroy_group):
    script = (
        textwrap.dedent(_TEARDOWN).replace("{explicit}", str(explicit)).replace("{destroy_group}", str(destroy_group))
    )
    env = dict(os.environ, CUDA_MODULE_LOADING="LAZY")  # one real rank: no virtual ranks here
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240, check=False,
                            env=env)  # fmt: skip
    assert result.returncode == 0 and result.stdout.strip().endswith("done"), result.stdout + result.stderr
    for word in ("NCCLError", "Traceback", "Exception", "invalid device ordinal"):
        assert word not in result.stderr, result.stderr
