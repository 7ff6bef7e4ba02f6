"""NVLink kernels (backend='kernels') against deep_ep.reference on 2 GPUs: bitwise, faults, graphs.

Run on the GPU machine: `python -m pytest -m gpu tests/test_kernels_gpu.py`.
"""

from __future__ import annotations

import itertools
import os
import random
import time

import pytest
import torch

from deep_ep.utils.spawn import spawn_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

NUM_EXPERTS, NUM_TOPK = 64, 8


# ---------------------------------------------------------------------------- helpers (run in ranks)


def _make_inputs(rank, num_ranks, num_tokens, hidden, fp8, masked, imbalanced, num_bias, seed):
    from deep_ep.utils.fp8 import per_token_cast_to_fp8
    from deep_ep.utils.routing import imbalanced_routing, uniform_routing

    gen = torch.Generator().manual_seed(seed * 131 + rank)
    if imbalanced:
        topk_idx, weights = imbalanced_routing(num_tokens, NUM_EXPERTS, NUM_TOPK, num_ranks, hot_rank=1,
                                               masked_ratio=masked, generator=gen, device="cuda")  # fmt: skip
    else:
        topk_idx, weights = uniform_routing(num_tokens, NUM_EXPERTS, NUM_TOPK, masked_ratio=masked, generator=gen,
                                            device="cuda")  # fmt: skip
    x = torch.randn((num_tokens, hidden), generator=gen).to(torch.bfloat16).cuda()
    if fp8 != "none":
        x = per_token_cast_to_fp8(x, use_ue8m0=fp8 == "ue8m0")
    bias = [torch.randn((num_tokens, hidden), generator=gen).to(torch.bfloat16).cuda() for _ in range(num_bias)]
    bias = None if num_bias == 0 else (bias[0] if num_bias == 1 else tuple(bias))
    return x, topk_idx, weights, bias


def _buffer(backend, num_max_tokens_per_rank, hidden, **kwargs):
    import deep_ep

    return deep_ep.ElasticBuffer(torch.distributed.group.WORLD, num_max_tokens_per_rank=num_max_tokens_per_rank,
                                 hidden=hidden, num_topk=NUM_TOPK, backend=backend, explicitly_destroy=True,
                                 **kwargs)  # fmt: skip


def _bytes(t):
    return None if t is None else t.contiguous().view(torch.uint8) if t.dtype.itemsize == 1 else t


def _equal(a, b, what):
    if isinstance(a, tuple):
        for i, (u, v) in enumerate(zip(a, b, strict=True)):
            _equal(u, v, f"{what}[{i}]")
        return
    if a is None or b is None:
        assert a is None and b is None, f"{what}: one side is None"
        return
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert torch.equal(_bytes(a), _bytes(b)), f"{what}: values differ"


def _real_rows(handle):
    """Rows of the expanded layout that hold data (not padding), and the number of received tokens."""
    num_recv = int(handle.psum_num_recv_tokens_per_scaleup_rank[-1])
    counts = handle.num_unaligned_recv_tokens_per_expert.tolist()
    rows, offset = [], 0
    for count in counts:
        rows += range(offset, offset + count)
        offset += (count + handle.expert_alignment - 1) // handle.expert_alignment * handle.expert_alignment
    return torch.tensor(rows, dtype=torch.long, device="cuda"), num_recv, offset


def _check_dispatch(out_k, out_r, do_expand, zero_padding):
    recv_k, idx_k, w_k, h_k, _ = out_k
    recv_r, idx_r, w_r, h_r, _ = out_r
    for name in ("psum_num_recv_tokens_per_scaleup_rank", "psum_num_recv_tokens_per_expert",
                 "num_unaligned_recv_tokens_per_expert", "dst_buffer_slot_idx"):  # fmt: skip
        _equal(getattr(h_k, name), getattr(h_r, name), name)
    assert h_k.num_recv_tokens_per_expert_list == h_r.num_recv_tokens_per_expert_list
    assert (h_k.num_recv_tokens, h_k.num_expanded_tokens) == (h_r.num_recv_tokens, h_r.num_expanded_tokens)
    rows, num_recv, num_rows = _real_rows(h_k)
    _equal(h_k.recv_src_metadata[:num_recv], h_r.recv_src_metadata[:num_recv], "recv_src_metadata")
    data_k, data_r = (
        (recv_k if isinstance(recv_k, tuple) else (recv_k,)),
        (recv_r if isinstance(recv_r, tuple) else (recv_r,)),
    )
    pick = (
        (lambda t: t[:num_rows])
        if (do_expand and zero_padding)
        else ((lambda t: t[rows]) if do_expand else (lambda t: t[:num_recv]))
    )
    for i, (a, b) in enumerate(zip(data_k, data_r, strict=True)):
        assert a.shape == b.shape and a.stride() == b.stride(), (
            f"recv_x[{i}] layout {a.shape}/{a.stride()} vs {b.shape}/{b.stride()}"
        )
        _equal(pick(a), pick(b), f"recv_x[{i}]")
    if not do_expand:
        _equal(idx_k[:num_recv], idx_r[:num_recv], "recv_topk_idx")
    else:
        assert idx_k is None and idx_r is None
    if w_r is not None:
        _equal(pick(w_k), pick(w_r), "recv_topk_weights")
    return h_k, h_r, rows, num_recv


def _combine_input(handle, do_expand, gen):
    num = handle.num_expanded_tokens if do_expand else handle.num_recv_tokens
    x = torch.randn((num, handle.hidden), generator=gen, device="cuda").to(torch.bfloat16)
    w = torch.rand((num,) if do_expand else (num, NUM_TOPK), generator=gen, device="cuda")
    return x, w


# ---------------------------------------------------------------------------- sweep


def _sweep_rank(rank, num_ranks, seed, cases):
    import deep_ep

    group = torch.distributed.group.WORLD
    gen = torch.Generator(device="cuda").manual_seed(seed + 7 * rank)
    buffers, buffer_tokens = {}, 0
    for i, case in enumerate(cases):
        if case["max_tokens"] != buffer_tokens:
            for buf in buffers.values():
                buf.destroy()
            buffer_tokens = case["max_tokens"]
            buffers = {
                backend: deep_ep.ElasticBuffer(
                    group, num_max_tokens_per_rank=buffer_tokens, hidden=7168, num_topk=NUM_TOPK, backend=backend,
                    explicitly_destroy=True, num_gpu_timeout_secs=20)
                for backend in ("kernels", "reference")
            }  # fmt: skip
            assert type(buffers["kernels"].backend).__name__ == "NvlinkBackend"
        num_tokens = 0 if (case["zero_rank"] and rank == 1) else case["num_tokens"]
        x, topk_idx, weights, bias = _make_inputs(
            rank,
            num_ranks,
            num_tokens,
            case["hidden"],
            case["fp8"],
            case["masked"],
            case["imbalanced"],
            case["num_bias"],
            seed + i,
        )
        kwargs = dict(topk_idx=topk_idx, topk_weights=weights, num_experts=NUM_EXPERTS,
                      expert_alignment=case["alignment"], do_cpu_sync=case["cpu_sync"], do_expand=case["expand"],
                      use_tma_aligned_col_major_sf=case["col_major"], num_sms=case["num_sms"])  # fmt: skip
        outs = {b: buf.dispatch(x, **kwargs) for b, buf in buffers.items()}
        try:
            h_k = _check_dispatch(outs["kernels"], outs["reference"], case["expand"], False)[0]
            if case["cached"]:
                x2 = _make_inputs(
                    rank,
                    num_ranks,
                    num_tokens,
                    case["hidden"],
                    case["fp8"],
                    case["masked"],
                    case["imbalanced"],
                    0,
                    seed + 1000 + i,
                )[0]
                cached = {b: buffers[b].dispatch(x2, handle=o[3], topk_weights=weights, do_expand=case["expand"],
                                                 do_zero_padding=case["expand"], num_sms=case["num_sms"],
                                                 use_tma_aligned_col_major_sf=case["col_major"])
                          for b, o in outs.items()}  # fmt: skip
                _check_dispatch(cached["kernels"], cached["reference"], case["expand"], case["expand"])
            y, w = _combine_input(h_k, case["expand"], gen)
            comb = {b: buffers[b].combine(y, o[3], topk_weights=w, bias=bias) for b, o in outs.items()}
            _equal(comb["kernels"][0], comb["reference"][0], "combined_x")
            _equal(comb["kernels"][1], comb["reference"][1], "combined_topk_weights")
        except AssertionError as error:
            raise AssertionError(f"case {i} {case} seed {seed}: {error}") from error
    for buf in buffers.values():
        buf.destroy()
    return len(cases)


def _sweep_cases(seed: int) -> list[dict]:
    rng = random.Random(seed)
    axes = itertools.product((False, True), (1, 128), ("none", "fp32", "ue8m0"), (0, 1, 2), (True, False),
                             (False, True), (0.0, 0.2), (False, True))  # fmt: skip
    cases = []
    for expand, alignment, fp8, num_bias, cpu_sync, cached, masked, imbalanced in axes:
        cases.append(dict(expand=expand, alignment=alignment, fp8=fp8, num_bias=num_bias, cpu_sync=cpu_sync,
                          cached=cached, masked=masked, imbalanced=imbalanced, hidden=rng.choice((2048, 7168)),
                          num_tokens=rng.randint(1, 300), max_tokens=300, zero_rank=rng.random() < 0.05,
                          col_major=fp8 != "none" and rng.random() < 0.5, num_sms=rng.choice((4, 8, 24))))  # fmt: skip
    # A few large batches: T up to 8192
    for num_tokens in (4096, 8192):
        for hidden in (2048, 7168):
            cases.append(dict(expand=rng.random() < 0.5, alignment=128, fp8=rng.choice(("none", "fp32")),
                              num_bias=1, cpu_sync=True, cached=True, masked=0.2, imbalanced=True, hidden=hidden,
                              num_tokens=num_tokens, max_tokens=8192, zero_rank=False, col_major=False, num_sms=24))  # fmt: skip
    return cases


def test_kernels_bitwise_equal_reference_sweep():
    seed = int(os.environ.get("EP_TEST_SEED", time.time_ns() % 100000))
    cases = _sweep_cases(seed)
    started = time.monotonic()
    counts = spawn_ranks(_sweep_rank, 2, backend="nccl", args=(seed, cases), timeout_s=1200)
    print(f"\nkernels sweep: {counts[0]} cases x 2 ranks bitwise equal to the reference, seed {seed}, "
          f"{time.monotonic() - started:.1f} s")  # fmt: skip


# ---------------------------------------------------------------------------- endurance and lifetime


def _roundtrip(buffers, rank, num_ranks, num_tokens, seed, gen, expand=False):
    x, topk_idx, weights, bias = _make_inputs(rank, num_ranks, num_tokens, 2048, "none", 0.1, False, 1, seed)
    kwargs = dict(topk_idx=topk_idx, topk_weights=weights, num_experts=NUM_EXPERTS, do_expand=expand)
    outs = {b: buf.dispatch(x, **kwargs) for b, buf in buffers.items()}
    h_k = _check_dispatch(outs["kernels"], outs["reference"], expand, False)[0]
    y, w = _combine_input(h_k, expand, gen)
    comb = {b: buffers[b].combine(y, o[3], topk_weights=w, bias=bias) for b, o in outs.items()}
    _equal(comb["kernels"][0], comb["reference"][0], "combined_x")


def _endurance_rank(rank, num_ranks, seed):

    gen = torch.Generator(device="cuda").manual_seed(seed + rank)
    buffers = {b: _buffer(b, 512, 2048) for b in ("kernels", "reference")}
    rng = random.Random(seed)
    memory = []
    for i in range(200):
        _roundtrip(buffers, rank, num_ranks, rng.randint(1, 512), seed + i, gen, expand=i % 2 == 1)
        if i in (20, 199):
            torch.cuda.synchronize()
            memory.append(torch.cuda.memory_allocated())
    for buf in buffers.values():
        buf.destroy()
    # Destroy and recreate a kernel buffer 20 times in one process
    reference = _buffer("reference", 512, 2048)
    for i in range(20):
        buf = _buffer("kernels", 512, 2048)
        _roundtrip({"kernels": buf, "reference": reference}, rank, num_ranks, 64, seed + 500 + i, gen)
        buf.destroy()
    reference.destroy()
    return memory


def test_kernels_200_iterations_no_memory_growth_and_20_recreations():
    seed = time.time_ns() % 100000
    memory = spawn_ranks(_endurance_rank, 2, backend="nccl", args=(seed,), timeout_s=900)
    for before, after in memory:
        # Allocations of the last iteration may differ in size; growth across 180 iterations must not
        assert after - before < 64 << 20, f"memory grew from {before} to {after} bytes"
    print(f"\nendurance: 200 round trips + 20 recreations, memory {memory}, seed {seed}")


def _epoch_wrap_rank(rank, num_ranks, seed):
    from deep_ep.backends.kernels.layout import CREDIT_OFFSET, EPOCH_OFFSET

    buffers = {b: _buffer(b, 128, 2048) for b in ("kernels", "reference")}
    # Start every rank's epoch and credits 3 operations before int32 wraps around
    words = buffers["kernels"].backend.runtime.windows.bytes[: CREDIT_OFFSET + 4 * num_ranks].view(torch.int32)
    start = 2**31 - 3
    words[EPOCH_OFFSET // 4] = start
    words[CREDIT_OFFSET // 4 :] = start
    torch.cuda.synchronize()
    torch.distributed.barrier()
    gen = torch.Generator(device="cuda").manual_seed(seed + rank)
    for i in range(4):
        _roundtrip(buffers, rank, num_ranks, 100, seed + i, gen, expand=i % 2 == 1)
    torch.cuda.synchronize()
    epoch, credits = int(words[EPOCH_OFFSET // 4]), words[CREDIT_OFFSET // 4 :].tolist()
    for buf in buffers.values():
        buf.destroy()
    return epoch, credits


def test_kernels_window_credits_wrap_around():
    seed = time.time_ns() % 100000
    results = spawn_ranks(_epoch_wrap_rank, 2, backend="nccl", args=(seed,), timeout_s=300)
    # 4 round trips = 8 operations, each counted once by every rank and credited to every rank
    wrapped = 2**31 - 3 + 8 - 2**32
    assert results == [(wrapped, [wrapped, wrapped])] * 2, results


# ---------------------------------------------------------------------------- faults


def _fault_rank(rank, num_ranks, timeout_s):
    import deep_ep

    group = torch.distributed.group.WORLD

    def make():
        return _buffer("kernels", 128, 2048, num_gpu_timeout_secs=timeout_s, num_cpu_timeout_secs=60)

    buf = make()
    x, topk_idx, weights, _ = _make_inputs(rank, num_ranks, 64, 2048, "none", 0.0, False, 0, 1)
    outcome = "ok"
    if rank == 0:
        started = time.monotonic()
        try:
            buf.dispatch(x, topk_idx=topk_idx, topk_weights=weights, num_experts=NUM_EXPERTS)
        except deep_ep.EPTimeoutError as error:
            elapsed = time.monotonic() - started
            outcome = f"{elapsed:.2f}s: {error}"
            assert elapsed < timeout_s + 5, f"took {elapsed:.1f} s for a {timeout_s} s deadline"
            assert "dispatch" in str(error) and "rank 1" in str(error), str(error)
            with pytest.raises((deep_ep.EPTimeoutError, ValueError), match="timed out"):
                buf.dispatch(x, topk_idx=topk_idx, topk_weights=weights, num_experts=NUM_EXPERTS)
        else:
            raise AssertionError("rank 0 dispatched alone without EPTimeoutError")
    # Rank 1 skipped the dispatch; both ranks recreate their buffer and work again
    torch.distributed.barrier()
    buf.destroy()
    buf = make()
    reference = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=128, hidden=2048, num_topk=NUM_TOPK,
                                      backend="reference", explicitly_destroy=True)  # fmt: skip
    gen = torch.Generator(device="cuda").manual_seed(rank)
    _roundtrip({"kernels": buf, "reference": reference}, rank, num_ranks, 100, 5, gen)
    buf.destroy()
    reference.destroy()
    return outcome


def test_kernels_peer_skipping_dispatch_raises_timeout_then_recovers():
    outcomes = spawn_ranks(_fault_rank, 2, backend="nccl", args=(3,), timeout_s=300)
    print(f"\nfault: rank 0 -> {outcomes[0]}")


def _bad_topk_rank(rank, num_ranks, seed):
    import deep_ep

    group = torch.distributed.group.WORLD
    buf = _buffer("kernels", 128, 2048)
    reference = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=128, hidden=2048, num_topk=NUM_TOPK,
                                      backend="reference", explicitly_destroy=True)  # fmt: skip
    x, topk_idx, weights, _ = _make_inputs(rank, num_ranks, 64, 2048, "none", 0.0, False, 0, seed)
    stats = torch.randint(0, 100, (NUM_EXPERTS // num_ranks,), dtype=torch.int32, device="cuda")
    stats_before = stats.clone()
    received_from_peer = []
    for bad_value, message in ((NUM_EXPERTS, "must be in"), (None, "must not repeat")):
        bad = topk_idx.clone()
        if bad_value is None:
            bad[17, 0], bad[17, 1] = 3, 3  # a repeated expert
        else:
            bad[5, 2] = bad_value
        bad_before = bad.clone()
        if rank == 0:
            # The kernel validates on the device, sends nothing and the CPU-sync wait raises
            with pytest.raises(ValueError, match=f"`topk_idx`.*{message}"):
                buf.dispatch(x, topk_idx=bad, topk_weights=weights, num_experts=NUM_EXPERTS,
                             cumulative_local_expert_recv_stats=stats)  # fmt: skip
            assert torch.equal(bad, bad_before) and torch.equal(stats, stats_before), "an input was modified"
        else:
            handle = buf.dispatch(x, topk_idx=topk_idx, topk_weights=weights, num_experts=NUM_EXPERTS)[3]
            received_from_peer.append(int(handle.psum_num_recv_tokens_per_scaleup_rank[0]))
    # The buffer still works on both ranks
    gen = torch.Generator(device="cuda").manual_seed(seed + rank)
    _roundtrip({"kernels": buf, "reference": reference}, rank, num_ranks, 100, seed + 1, gen)
    buf.destroy()
    reference.destroy()
    return received_from_peer


def test_kernels_reject_bad_topk_idx_on_device_and_stay_usable():
    seed = time.time_ns() % 100000
    received = spawn_ranks(_bad_topk_rank, 2, backend="nccl", args=(seed,), timeout_s=300)
    # Rank 1 completed both dispatches and got no tokens from the rank whose input was bad
    assert received[1] == [0, 0], received


# ---------------------------------------------------------------------------- CUDA graphs


def _graph_rank(rank, num_ranks, seed):

    hidden, num_tokens = 2048, 96
    kernels_buf, reference_buf = _buffer("kernels", 128, hidden), _buffer("reference", 128, hidden)
    x, topk_idx, weights, bias = _make_inputs(rank, num_ranks, num_tokens, hidden, "none", 0.1, False, 1, seed)
    results = []
    for do_expand in (False, True):
        args = dict(topk_idx=topk_idx, topk_weights=weights, num_experts=NUM_EXPERTS, do_expand=do_expand)
        handle_k = kernels_buf.dispatch(x, do_cpu_sync=False, **args)[3]
        handle_r = reference_buf.dispatch(x, **args)[3]
        static_x = x.clone()
        rows = handle_k.num_expanded_tokens if do_expand else handle_k.num_recv_tokens
        static_y = torch.zeros((rows, hidden), dtype=torch.bfloat16, device="cuda")
        static_bias = bias.clone()

        # Capture cached dispatch + combine on a side stream
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            kernels_buf.dispatch(static_x, handle=handle_k, do_expand=do_expand)  # warm-up outside capture (JIT load)
            kernels_buf.combine(static_y, handle_k, bias=static_bias)
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, stream=stream):
                recv = kernels_buf.dispatch(static_x, handle=handle_k, do_expand=do_expand)[0]
                combined = kernels_buf.combine(static_y, handle_k, bias=static_bias)[0]
        torch.cuda.current_stream().wait_stream(stream)

        gen = torch.Generator(device="cuda").manual_seed(seed + rank)
        for replay in range(3):
            new_x = _make_inputs(rank, num_ranks, num_tokens, hidden, "none", 0.1, False, 0, seed + 10 + replay)[0]
            new_bias = torch.randn((num_tokens, hidden), generator=gen, device="cuda").to(torch.bfloat16)
            static_x.copy_(new_x)
            static_bias.copy_(new_bias)
            static_y.copy_(torch.randn(static_y.shape, generator=gen, device="cuda").to(torch.bfloat16))
            graph.replay()
            torch.cuda.synchronize()
            ref = reference_buf.dispatch(new_x, handle=handle_r, do_expand=do_expand)
            num_recv = int(handle_k.psum_num_recv_tokens_per_scaleup_rank[-1])
            if do_expand:
                real_rows = _real_rows(handle_k)[0]
                _equal(recv[real_rows], ref[0][real_rows], "graph recv_x")
                ref_y = static_y[: handle_r.num_expanded_tokens]
            else:
                _equal(recv[:num_recv], ref[0][:num_recv], "graph recv_x")
                ref_y = static_y[:num_recv]
            ref_combined = reference_buf.combine(ref_y.contiguous(), handle_r, bias=new_bias)[0]
            _equal(combined, ref_combined, "graph combined_x")
            results.append(replay)
    kernels_buf.destroy()
    reference_buf.destroy()
    return len(results)


def test_kernels_cuda_graph_capture_and_replay():
    seed = time.time_ns() % 100000
    replays = spawn_ranks(_graph_rank, 2, backend="nccl", args=(seed,), timeout_s=300)
    print(f"\ngraph: {replays[0]} replays checked against the reference, seed {seed}")


# ---------------------------------------------------------------------------- stream options, stats, lifetime


def _options_rank(rank, num_ranks, seed, own_comm):
    import gc

    import deep_ep

    if own_comm:
        os.environ["EP_NCCL_OWN_COMM"] = "1"
    buffers = {b: _buffer(b, 256, 2048, deterministic=True) for b in ("kernels", "reference")}
    assert buffers["kernels"].backend.runtime.windows.comm.is_own == own_comm
    num_local_experts = NUM_EXPERTS // num_ranks
    gen = torch.Generator(device="cuda").manual_seed(seed + rank)
    for step, (previous, asynchronous, on_comm) in enumerate(itertools.product((False, True), repeat=3)):
        if previous and not on_comm:
            continue  # previous_event needs allocate_on_comm_stream (V2)
        x, topk_idx, weights, bias = _make_inputs(rank, num_ranks, 200, 2048, "fp32", 0.1, True, 2, seed + step)
        outs, stats = {}, {}
        for b, buf in buffers.items():
            stats[b] = torch.randint(0, 100, (num_local_experts,), dtype=torch.int32, device="cuda")
            start = stats[b].clone()
            kwargs = dict(topk_idx=topk_idx, topk_weights=weights, num_experts=NUM_EXPERTS, expert_alignment=128,
                          do_expand=step % 2 == 1, cumulative_local_expert_recv_stats=stats[b],
                          async_with_compute_stream=asynchronous, allocate_on_comm_stream=on_comm)  # fmt: skip
            if previous:
                kwargs["previous_event"] = deep_ep.ElasticBuffer.capture()
            outs[b] = buf.dispatch(x, **kwargs)
            if asynchronous:
                outs[b][4].current_stream_wait()
            _equal(stats[b] - start, outs[b][3].num_unaligned_recv_tokens_per_expert, "stats increment")
        _check_dispatch(outs["kernels"], outs["reference"], step % 2 == 1, False)
        y, w = _combine_input(outs["kernels"][3], step % 2 == 1, gen)
        comb = {}
        for b, buf in buffers.items():
            kwargs = dict(topk_weights=w, bias=bias, async_with_compute_stream=asynchronous,
                          allocate_on_comm_stream=on_comm)  # fmt: skip
            if previous:
                kwargs["previous_event"] = deep_ep.ElasticBuffer.capture()
            comb[b] = buf.combine(y, outs[b][3], **kwargs)
            if asynchronous:
                comb[b][2].current_stream_wait()
        _equal(comb["kernels"][0], comb["reference"][0], "combined_x")
        _equal(comb["kernels"][1], comb["reference"][1], "combined_topk_weights")
    # Kernel buffers without explicitly_destroy are released when collected, and can be made again
    for _ in range(2):
        # Same num_max_tokens_per_rank as the reference: it is part of the source metadata
        transient = deep_ep.ElasticBuffer(torch.distributed.group.WORLD, num_max_tokens_per_rank=256, hidden=2048,
                                          num_topk=NUM_TOPK, backend="kernels")  # fmt: skip
        _roundtrip({"kernels": transient, "reference": buffers["reference"]}, rank, num_ranks, 32, seed, gen)
        torch.distributed.barrier()
        del transient
        gc.collect()
    for buf in buffers.values():
        buf.destroy()
    return own_comm


@pytest.mark.parametrize("own_comm", [False, True], ids=["torch-comm", "own-comm"])
def test_kernels_stream_options_stats_deterministic_and_lifetime(own_comm):
    seed = time.time_ns() % 100000
    spawn_ranks(_options_rank, 2, backend="nccl", args=(seed, own_comm), timeout_s=300)
    print(f"\noptions ({'own' if own_comm else 'torch'} communicator): previous_event x async x "
          f"allocate_on_comm_stream, stats, deterministic, collected buffers; seed {seed}")  # fmt: skip
