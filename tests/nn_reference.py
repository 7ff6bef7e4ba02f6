"""deep_ep.nn checks shared by test_nn.py (gloo) and test_nn_gpu.py (NCCL): dense models and rank workers.

The dense model computes the same MoE in one process over every rank's tokens, with the same weights
and routing. `dense_moe` also rounds to BF16 wherever the expert-parallel layer sends data in BF16
(forward and backward), and sums in the order the contract of `combine` gives (holder ranks
ascending; lanes ascending inside a rank in expand mode), so outputs and gradients agree to FP32
rounding; where both round an FP32 value to BF16 a last-bit difference of the FP32 value can flip
that rounding, so a few elements may differ by one BF16 step. `plain_moe` is the same MoE without
any rounding (a loose check that both models compute the intended function).
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import deep_ep
from deep_ep import nn as epnn
from deep_ep.handle import EPHandle
from deep_ep.utils.routing import uniform_routing

# ---------------------------------------------------------------------------------------------- experts


class ExpertMLP(nn.Module):
    """A small expert: `fc2(silu(fc1(x)))`, `[n, H] -> [n, H]`."""

    def __init__(self, hidden: int, ffn: int, gen: torch.Generator, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn, bias=True, device=device, dtype=dtype)
        self.fc2 = nn.Linear(ffn, hidden, bias=False, device=device, dtype=dtype)
        with torch.no_grad():
            for param, fan_in in ((self.fc1.weight, hidden), (self.fc1.bias, 1), (self.fc2.weight, ffn)):
                values = torch.randn(param.shape, generator=gen) / fan_in**0.5
                param.copy_(values.to(device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.silu(self.fc1(x)))


def make_experts(
    num_experts: int, hidden: int, ffn: int, seed: int, device: torch.device, dtype: torch.dtype
) -> list[ExpertMLP]:
    """The same `num_experts` experts on every rank (drawn from `seed`)."""
    gen = torch.Generator().manual_seed(seed)
    return [ExpertMLP(hidden, ffn, gen, device, dtype) for _ in range(num_experts)]


class GroupedExperts(nn.Module):
    """A grouped expert callable over the expanded layout: finds each expert's block from the handle.

    Local expert `e`'s real rows are `[psum[e] - count[e], psum[e])` (`psum_num_recv_tokens_per_expert`
    and `num_unaligned_recv_tokens_per_expert` of the handle); every other row (padding, worst-case
    tail) maps to zero.
    """

    def __init__(self, experts: list[nn.Module]) -> None:
        super().__init__()
        self.local_experts = nn.ModuleList(experts)

    def forward(self, x: torch.Tensor, handle: EPHandle) -> torch.Tensor:
        ends = handle.psum_num_recv_tokens_per_expert.tolist()
        counts = handle.num_unaligned_recv_tokens_per_expert.tolist()
        out = torch.zeros_like(x)
        for expert, end, count in zip(self.local_experts, ends, counts, strict=True):
            rows = torch.arange(end - count, end, device=x.device)
            out = out.index_copy(0, rows, expert(x[rows]).to(out.dtype))
        return out


# ---------------------------------------------------------------------------------------------- dense models


class _BF16Grad(torch.autograd.Function):
    """Identity forward; backward rounds the gradient to BF16 (a backward communication in BF16)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.to(torch.bfloat16).to(grad.dtype)


def route(
    x: torch.Tensor, gate_weight: torch.Tensor, num_topk: int, normalize: bool, topk_idx: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k softmax routing in FP32: `(topk_idx [T, K] int64, topk_weights [T, K] float32)`.

    With `topk_idx` (the layer's choice, so that a near-tie cannot be broken differently by an FP32
    difference of the logits) the weights are this function's probabilities of those experts, and the
    experts must be a top-k of them up to FP32 rounding.
    """
    probs = torch.softmax(x.float() @ gate_weight.float().t(), dim=-1)
    if topk_idx is None:
        weights, topk_idx = torch.topk(probs, num_topk, dim=-1)
    else:
        weights = probs.gather(1, topk_idx)
        others = probs.detach().scatter(1, topk_idx, float("-inf")).amax(dim=1)
        chosen = weights.detach().amin(dim=1)
        # A different GEMM blocking may move the logits by a few FP32 ulps: allow 1e-4 relative
        assert bool((others <= chosen * (1 + 1e-4)).all()), "the layer's experts are not a top-k of the probabilities"
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return topk_idx, weights


def dense_moe(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    experts: list[nn.Module],
    num_ranks: int,
    num_topk: int,
    normalize: bool,
    expand: bool,
    topk_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """The MoE over all ranks' tokens `x` `[T_all, H]` (FP32), rounding where the EP layer communicates.

    Forward: each holder rank `d` of a token sums its weighted local expert outputs in FP32 (non-expand:
    experts ascending; expand: each lane rounded to BF16, then lanes ascending) and rounds to BF16; the
    token's output is the FP32 sum over `d` ascending, rounded to BF16. Backward: the gradient that
    reaches each holder's copy of a token (expand: each lane's copy, then each holder) is rounded to
    BF16, and the sum over holders again.
    """
    num_tokens, hidden = x.shape
    num_local = len(experts) // num_ranks
    idx, weights = route(x, gate_weight, num_topk, normalize, topk_idx)
    x_sent = x.to(torch.bfloat16).to(x.dtype)
    total = torch.zeros((num_tokens, hidden), dtype=torch.float32, device=x.device)
    for rank in range(num_ranks):
        x_held = _BF16Grad.apply(x_sent)
        local_experts = range(rank * num_local, (rank + 1) * num_local)
        if not expand:
            acc = torch.zeros((num_tokens, hidden), dtype=torch.float32, device=x.device)
            for e in local_experts:
                rows, lanes = (idx == e).nonzero(as_tuple=True)
                out = experts[e](x_held[rows]).float() * weights[rows, lanes].unsqueeze(1)
                acc = acc.index_add(0, rows, out)
        else:
            x_lanes = _BF16Grad.apply(x_held.unsqueeze(1).expand(num_tokens, num_topk, hidden))
            lane_rows = torch.zeros((num_tokens, num_topk, hidden), dtype=torch.float32, device=x.device)
            for e in local_experts:
                rows, lanes = (idx == e).nonzero(as_tuple=True)
                out = experts[e](x_lanes[rows, lanes]).float() * weights[rows, lanes].unsqueeze(1)
                lane_rows = lane_rows.index_put((rows, lanes), out.to(torch.bfloat16).float())
            acc = torch.zeros((num_tokens, hidden), dtype=torch.float32, device=x.device)
            for lane in range(num_topk):
                acc = acc + lane_rows[:, lane]
        total = total + acc.to(torch.bfloat16).float()
    return total.to(torch.bfloat16).to(x.dtype)


def plain_moe(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    experts: list[nn.Module],
    num_topk: int,
    normalize: bool,
    topk_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same MoE in FP32 without any rounding: `y[t] = sum_k w[t, k] * expert_{idx[t, k]}(x[t])`."""
    idx, weights = route(x, gate_weight, num_topk, normalize, topk_idx)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e, expert in enumerate(experts):
        rows, lanes = (idx == e).nonzero(as_tuple=True)
        out = out.index_add(
            0, rows, expert(x[rows].to(next(expert.parameters()).dtype)).float() * weights[rows, lanes, None]
        )
    return out


# ---------------------------------------------------------------------------------------------- comparisons


def assert_fp32_close(actual: torch.Tensor, expected: torch.Tensor, what: str, rtol: float = 2e-5) -> None:
    """Equal to FP32 rounding: every element within `rtol` of itself or of the tensor's largest element."""
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    if scale == 0:  # e.g. an expert that got no tokens
        assert not bool(actual.any()), f"{what}: expected all zeros, got max {float(actual.abs().max()):.3e}"
        return
    error = (actual - expected).abs()
    bound = rtol * (expected.abs() + scale)
    worst = int(error.sub(bound).argmax()) if error.numel() else 0
    assert bool((error <= bound).all()), (
        f"{what}: max error {float(error.max()):.3e} (scale {scale:.3e}); element {worst}: "
        f"{float(actual.flatten()[worst])} vs {float(expected.flatten()[worst])}"
    )


def assert_rounded_close(
    actual: torch.Tensor, expected: torch.Tensor, what: str, max_flip_fraction: float = 0.02
) -> None:
    """Equal to FP32 rounding except for a few BF16 rounding flips (one BF16 step of a partial sum each)."""
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    assert scale > 0 or expected.numel() == 0, f"{what}: the expected tensor is all zero (the check could not fail)"
    error = (actual - expected).abs()
    tight = 2e-5 * (expected.abs() + 1e-2 * scale)
    flips = error > tight
    fraction = float(flips.double().mean()) if error.numel() else 0.0
    assert fraction <= max_flip_fraction, (
        f"{what}: {fraction:.2%} of the elements differ by more than FP32 rounding (max error "
        f"{float(error.max()):.3e}, scale {scale:.3e})"
    )
    # A flip moves one partial sum by one BF16 step (2^-8 relative); allow two at the tensor's scale
    max_error = float(error.max()) if error.numel() else 0.0
    assert max_error <= 2.0**-7 * scale, f"{what}: max error {max_error:.3e} > 2^-7 * {scale:.3e}"


def assert_bf16_close(actual: torch.Tensor, expected: torch.Tensor, what: str, rtol: float = 2.0**-5) -> None:
    """Equal up to BF16 arithmetic: every element within `rtol` times the tensor's largest element."""
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    error = float((actual - expected).abs().max()) if expected.numel() else 0.0
    assert error <= rtol * scale, f"{what}: max error {error:.3e} > {rtol:.1e} * {scale:.3e}"


def small_ints(shape: tuple[int, ...], gen: torch.Generator, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Random non-zero integers in [-8, 8]: exact in BF16 and in FP32 sums of a few of them."""
    values = torch.randint(1, 9, shape, generator=gen) * (torch.randint(0, 2, shape, generator=gen) * 2 - 1)
    return values.to(dtype).to(device)


def _dot(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None or b is None:
        return 0.0
    return float((a.detach().double().cpu() * b.detach().double().cpu()).sum())


def _global_sum(value: float, device: torch.device) -> float:
    """Sum a host float over the ranks (FP64: the test's integer sums stay exact)."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item())


def _make_buffer(setup: dict[str, Any], **kwargs: Any) -> deep_ep.ElasticBuffer:
    return deep_ep.ElasticBuffer(
        dist.group.WORLD,
        num_max_tokens_per_rank=setup["num_max_tokens"],
        hidden=setup["hidden"],
        num_topk=setup["num_topk"],
        backend=setup["backend"],
        explicitly_destroy=True,
        **kwargs,
    )


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


# ---------------------------------------------------------------------------------------------- workers


def adjoint_worker(rank: int, num_ranks: int, seed: int, setup: dict[str, Any]) -> int:
    """Fast-mode gradcheck of `deep_ep.nn.dispatch` and `combine`: `<J u, v> == <u, J^T v>` exactly.

    Both maps are linear; with small integers every sum is exact in BF16 and FP32, so the identity
    over all ranks must hold bit for bit for random `u` (inputs) and `v` (output gradients). Also checks
    the forward clean-ups: non-local lane weights `0` and zero rows past the real ones.
    """
    device = _device()
    gen = torch.Generator().manual_seed(seed * 97 + rank)
    shared_gen = torch.Generator().manual_seed(seed)
    buffer = _make_buffer(setup)
    num_experts, num_topk, hidden = setup["num_experts"], setup["num_topk"], setup["hidden"]
    checked = 0
    try:
        for mode_idx, (do_expand, do_cpu_sync, alignment) in enumerate(setup["modes"]):
            token_counts = torch.randint(0, setup["num_max_tokens"] + 1, (num_ranks,), generator=shared_gen)
            if mode_idx == 0:
                token_counts[num_ranks - 1] = 0  # a rank without tokens
            token_counts[0] = max(1, int(token_counts[0]))  # but some tokens in all, or no gradient to check
            num_tokens = int(token_counts[rank])
            topk_idx, _ = uniform_routing(num_tokens, num_experts, num_topk, masked_ratio=0.2, generator=gen)
            topk_idx = topk_idx.to(device)
            x = small_ints((num_tokens, hidden), gen, torch.bfloat16, device).requires_grad_()
            w = small_ints((num_tokens, num_topk), gen, torch.float32, device).requires_grad_()
            recv_x, recv_idx, recv_w, handle, _ = epnn.dispatch(
                buffer, x, topk_idx, w, num_experts=num_experts, expert_alignment=alignment,
                do_expand=do_expand, do_cpu_sync=do_cpu_sync,
            )  # fmt: skip
            what = f"mode {do_expand=} {do_cpu_sync=} {alignment=}"
            if not do_expand:
                assert not bool(recv_w[recv_idx < 0].any()), f"{what}: a non-local lane kept its weight"
            if not do_cpu_sync:
                psum = (
                    handle.psum_num_recv_tokens_per_expert
                    if do_expand
                    else handle.psum_num_recv_tokens_per_scaleup_rank
                )
                tail = torch.arange(recv_x.shape[0], device=device) >= int(psum[-1])
                assert not bool(recv_x[tail].float().any()) and not bool(recv_w[tail].any()), f"{what}: tail not zero"
            gy = small_ints(tuple(recv_x.shape), gen, torch.bfloat16, device)
            gw = small_ints(tuple(recv_w.shape), gen, torch.float32, device)
            ((recv_x.float() * gy.float()).sum() + (recv_w * gw).sum()).backward()
            lhs = _global_sum(_dot(recv_x, gy) + _dot(recv_w, gw), device)
            rhs = _global_sum(_dot(x, x.grad) + _dot(w, w.grad), device)
            assert lhs == rhs, f"dispatch {what}: <D u, v> = {lhs} != <u, D^T v> = {rhs}"
            assert _global_sum(float(x.grad.float().abs().sum()), device) > 0, f"dispatch {what}: zero gradient"

            # Combine with the same handle: rows, lane weights and two biases
            rows = handle.num_combine_rows
            y = small_ints((rows, hidden), gen, torch.bfloat16, device).requires_grad_()
            wr_shape = (rows,) if do_expand else (rows, num_topk)
            wr = small_ints(wr_shape, gen, torch.float32, device).requires_grad_()
            biases = [small_ints((num_tokens, hidden), gen, torch.bfloat16, device).requires_grad_() for _ in range(2)]
            z, zw, _ = epnn.combine(buffer, y, handle, topk_weights=wr, bias=(biases[0], biases[1]))
            gz = small_ints((num_tokens, hidden), gen, torch.bfloat16, device)
            gzw = small_ints((num_tokens, num_topk), gen, torch.float32, device)
            ((z.float() * gz.float()).sum() + (zw * gzw).sum()).backward()
            lhs = _global_sum(_dot(z, gz) + _dot(zw, gzw), device)
            rhs = _global_sum(_dot(y, y.grad) + _dot(wr, wr.grad) + sum(_dot(b, b.grad) for b in biases), device)
            assert lhs == rhs, f"combine {what}: <C u, v> = {lhs} != <u, C^T v> = {rhs}"
            assert all(torch.equal(b.grad, gz) for b in biases), f"combine {what}: bias gradient != output gradient"
            checked += 1
    finally:
        buffer.destroy()
    return checked


def micro_batch_worker(rank: int, num_ranks: int, seed: int, setup: dict[str, Any]) -> int:
    """Two handles in flight: dispatch A, dispatch B, combine B, combine A, one backward.

    The expert side multiplies every received row by `rank + 1`, so the result has a closed form:
    `y[t] = x[t] * s[t]` with `s[t]` the sum of `d + 1` over the holder ranks `d` of `t` (expand: over
    its valid lanes' ranks), and `x.grad = g * s`; weights round-trip to themselves (`0` on `-1` lanes).
    """
    device = _device()
    gen = torch.Generator().manual_seed(seed * 131 + rank)
    buffer = _make_buffer(setup)
    num_experts, num_topk, hidden = setup["num_experts"], setup["num_topk"], setup["hidden"]
    num_local = num_experts // num_ranks
    try:
        for do_expand in (False, True):
            batches = []
            for mb in range(2):
                num_tokens = int(torch.randint(1, setup["num_max_tokens"] + 1, (1,), generator=gen))
                topk_idx, _ = uniform_routing(num_tokens, num_experts, num_topk, masked_ratio=0.2, generator=gen)
                x = small_ints((num_tokens, hidden), gen, torch.bfloat16, device).requires_grad_()
                w = small_ints((num_tokens, num_topk), gen, torch.float32, device).requires_grad_()
                result = epnn.dispatch(
                    buffer, x, topk_idx.to(device), w, num_experts=num_experts, do_expand=do_expand,
                    async_with_compute_stream=mb == 1,
                )  # fmt: skip
                batches.append((topk_idx, x, w, result))
            combined: list[Any] = [None, None]
            for mb in (1, 0):
                result = batches[mb][3]
                result.event.current_stream_wait()
                rows = (result.recv_x.float() * (rank + 1)).to(torch.bfloat16)
                combined[mb] = epnn.combine(buffer, rows, result.handle, topk_weights=result.recv_topk_weights)
            loss = torch.zeros((), device=device)
            grads = []
            for mb in range(2):
                z, zw, _ = combined[mb]
                gz = small_ints(tuple(z.shape), gen, torch.bfloat16, device)
                gzw = small_ints(tuple(zw.shape), gen, torch.float32, device)
                grads.append((gz, gzw))
                loss = loss + (z.float() * gz.float()).sum() + (zw * gzw).sum()
            loss.backward()
            for mb in range(2):
                topk_idx, x, w, _ = batches[mb]
                owners = torch.where(topk_idx >= 0, topk_idx // num_local, -1)
                if do_expand:
                    factor = (owners + 1).clamp(min=0).sum(dim=1)
                else:
                    holders = torch.zeros((topk_idx.shape[0], num_ranks + 1), dtype=torch.bool)
                    holders.scatter_(1, torch.where(owners >= 0, owners, num_ranks), True)
                    factor = (holders[:, :num_ranks].float() * torch.arange(1, num_ranks + 1)).sum(dim=1)
                factor = factor.float().unsqueeze(1).to(device)
                z, zw, _ = combined[mb]
                gz, gzw = grads[mb]
                what = f"micro-batch {mb} {do_expand=}"
                valid = (topk_idx >= 0).to(device)
                assert torch.equal(z.float(), x.detach().float() * factor), f"{what}: combined_x"
                assert torch.equal(zw, torch.where(valid, w.detach(), 0.0)), f"{what}: combined_topk_weights"
                assert torch.equal(x.grad.float(), gz.float() * factor), f"{what}: x.grad"
                assert torch.equal(w.grad, torch.where(valid, gzw, 0.0)), f"{what}: topk_weights.grad"
    finally:
        buffer.destroy()
    return 2


def moe_worker(rank: int, num_ranks: int, seed: int, setup: dict[str, Any]) -> list[str]:
    """`ExpertParallelMoE` (two micro-batches, one backward) against the dense model, per configuration.

    Every rank draws every rank's inputs from the shared seed, runs the layer on its own tokens and the
    dense model on all tokens, and compares its slice of the outputs and input gradients, its experts'
    gradients, and the gate (and shared expert) gradients summed over the ranks.
    """
    device = _device()
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    hidden, ffn, num_experts, num_topk = setup["hidden"], setup["ffn"], setup["num_experts"], setup["num_topk"]
    num_local = num_experts // num_ranks
    buffer = _make_buffer(setup)
    done = []
    try:
        for cfg_idx, cfg in enumerate(setup["configs"]):
            cfg_seed = seed * 1009 + cfg_idx
            dtype = getattr(torch, cfg.get("dtype", "float32"))
            gen = torch.Generator().manual_seed(cfg_seed)  # the same stream on every rank
            experts_all = make_experts(num_experts, hidden, ffn, cfg_seed, device, dtype)
            local = [copy.deepcopy(experts_all[rank * num_local + i]) for i in range(num_local)]
            experts = GroupedExperts(local) if cfg["grouped"] else nn.ModuleList(local)
            shared_all = make_experts(1, hidden, ffn, cfg_seed + 1, device, dtype)[0] if cfg.get("shared") else None
            gate_weight = (torch.randn((num_experts, hidden), generator=gen) / hidden**0.5).to(device)
            layer = epnn.ExpertParallelMoE(
                buffer, hidden, num_experts, num_topk, experts, do_expand=cfg["expand"],
                expert_alignment=cfg.get("alignment", 1), do_cpu_sync=cfg.get("cpu_sync", True),
                normalize_topk=cfg.get("normalize", True), async_with_compute_stream=cfg.get("async", False),
                shared_experts=copy.deepcopy(shared_all) if shared_all is not None else None,
            )  # fmt: skip
            gathered = [torch.empty_like(layer.gate.weight) for _ in range(num_ranks)]
            dist.all_gather(gathered, layer.gate.weight.detach())
            assert all(torch.equal(g, gathered[0]) for g in gathered), "the gate starts from rank 0's weights"
            with torch.no_grad():
                layer.gate.weight.copy_(gate_weight)

            # Inputs and loss probes of every rank, for two micro-batches
            inputs, probes = [], []
            for _ in range(2):
                counts = torch.randint(0, setup["num_max_tokens"] + 1, (num_ranks,), generator=gen)
                if cfg.get("empty_rank"):
                    counts[num_ranks - 1] = 0
                counts[0] = max(1, int(counts[0]))  # some tokens in all
                inputs.append([torch.randn((int(n), hidden), generator=gen).to(device, dtype) for n in counts])
                probes.append([torch.randn((int(n), hidden), generator=gen).to(device) for n in counts])

            # Expert-parallel: two forwards, then one backward
            xs = [inputs[mb][rank].clone().requires_grad_() for mb in range(2)]
            # The layer's routing of every rank's tokens (the same batch gives the same bits as on that rank)
            with torch.no_grad():
                layer_idx = [torch.cat([layer.route(t)[0] for t in inputs[mb]]) for mb in range(2)]
            outs = [layer(xs[mb]) for mb in range(2)]
            sum(
                ((outs[mb].float() * probes[mb][rank]).sum() for mb in range(2)), torch.zeros((), device=device)
            ).backward()
            gate_grad = layer.gate.weight.grad.clone()
            dist.all_reduce(gate_grad)

            # Dense: all tokens in one process
            dense_gate = gate_weight.clone().requires_grad_()
            dense_xs = [torch.cat(inputs[mb]).requires_grad_() for mb in range(2)]
            dense_outs = []
            for mb in range(2):
                normalize = cfg.get("normalize", True)
                if dtype == torch.float32:
                    out = dense_moe(dense_xs[mb], dense_gate, experts_all, num_ranks, num_topk, normalize,
                                    cfg["expand"], layer_idx[mb])  # fmt: skip
                else:
                    out = plain_moe(dense_xs[mb], dense_gate, experts_all, num_topk, normalize, layer_idx[mb])
                if shared_all is not None:
                    out = out + shared_all(dense_xs[mb])
                dense_outs.append(out)
            sum((dense_outs[mb].float() * torch.cat(probes[mb])).sum() for mb in range(2)).backward()

            what = f"config {cfg} seed {seed} rank {rank}"
            starts = [[sum(int(t.shape[0]) for t in inputs[mb][:r]) for r in range(num_ranks + 1)] for mb in range(2)]
            for mb in range(2):
                lo, hi = starts[mb][rank], starts[mb][rank + 1]
                expected_out, expected_grad = dense_outs[mb][lo:hi], dense_xs[mb].grad[lo:hi]
                if hi == lo:
                    assert outs[mb].shape == (0, hidden) and xs[mb].grad.shape == (0, hidden), what
                    continue
                if dtype == torch.float32:
                    assert_rounded_close(outs[mb], expected_out, f"{what}: output of micro-batch {mb}")
                    assert_rounded_close(xs[mb].grad, expected_grad, f"{what}: x.grad of micro-batch {mb}")
                    plain = plain_moe(
                        dense_xs[mb].detach(), gate_weight, experts_all, num_topk, cfg.get("normalize", True),
                        layer_idx[mb],
                    )  # fmt: skip
                    if shared_all is not None:
                        plain = plain + shared_all(dense_xs[mb].detach())
                    assert_bf16_close(outs[mb], plain[lo:hi], f"{what}: output vs the unrounded MoE")
                else:
                    assert_bf16_close(outs[mb], expected_out, f"{what}: output of micro-batch {mb}")
                    assert_bf16_close(xs[mb].grad, expected_grad, f"{what}: x.grad of micro-batch {mb}", rtol=2.0**-4)
            check = assert_fp32_close if dtype == torch.float32 else assert_bf16_close
            check(gate_grad, dense_gate.grad, f"{what}: gate.weight.grad")
            for i, expert in enumerate(local):
                dense_expert = experts_all[rank * num_local + i]
                for (name, param), dense_param in zip(
                    expert.named_parameters(), dense_expert.parameters(), strict=True
                ):
                    assert param.grad is not None, f"{what}: expert {i} {name} has no gradient"
                    check(param.grad, dense_param.grad, f"{what}: local expert {i} {name}.grad")
            if shared_all is not None:
                for (name, param), dense_param in zip(
                    layer.shared_experts.named_parameters(), shared_all.parameters(), strict=True
                ):
                    grad = param.grad.clone()
                    dist.all_reduce(grad)
                    check(grad, dense_param.grad, f"{what}: shared expert {name}.grad")
            done.append(str(cfg))
    finally:
        buffer.destroy()
    return done


WORKERS = {"adjoint": adjoint_worker, "micro_batches": micro_batch_worker, "moe": moe_worker}


def suite_worker(rank: int, num_ranks: int, seed: int, setup: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """Run several workers in one spawn (start-up costs more than the checks)."""
    return {name: WORKERS[name](rank, num_ranks, seed, setup) for name in names}


def fresh_seed() -> int:
    """A new seed per run (printed in every failure message)."""
    return time.time_ns() % 1_000_000
