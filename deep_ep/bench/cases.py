"""What `deep-ep bench` measures: the cases, the run's options, the inputs and the traffic of a rank.

Bandwidth convention (design section 6): logical bytes are all (token, destination rank) records,
the rank's own included; wire bytes leave out the records a rank keeps for itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from . import DEFAULT_HOT_FRACTION, DTYPES, ROUTINGS

HOT_RANK = 0  # imbalanced routing: the rank whose experts are preferred


@dataclass(frozen=True)
class BenchCase:
    """One benchmarked MoE shape.

    Attributes:
        num_tokens: tokens per rank `T` (also the buffer's and each call's `num_max_tokens_per_rank`).
        hidden, num_topk, num_experts: the MoE shape.
        fp8_dispatch: FP8 dispatch (per-128 FP32 scales) or BF16; combine is always BF16.
        num_sms: SMs of every call (`0`: the planner's pick, `ElasticBuffer.get_theoretical_num_sms`).
        routing: `'uniform'` or `'imbalanced'` (a hot rank, `deep_ep.utils.routing.imbalanced_routing`).
    """

    num_tokens: int
    hidden: int
    num_topk: int
    num_experts: int
    fp8_dispatch: bool
    num_sms: int = 0
    routing: str = "uniform"

    @property
    def dtype(self) -> str:
        return "fp8" if self.fp8_dispatch else "bf16"

    @property
    def key(self) -> tuple:
        """Everything but the SM count: cases with one key share inputs, reference and torch timings."""
        return (self.num_tokens, self.hidden, self.num_topk, self.num_experts, self.fp8_dispatch, self.routing)


@dataclass
class BenchConfig:
    """What `deep-ep bench` runs.

    Attributes:
        cases: the cases, in the order of the table.
        num_ranks: ranks to run (all local GPUs, virtual ranks on one GPU, or CPU ranks).
        device: `'cuda'` or `'cpu'`.
        virtual_ranks: the ranks are threads of this process sharing one GPU (`deep_ep.loopback`):
            times show the kernels' own cost (layouts, epilogues, host launches), not NVLink.
        num_warmups, num_iters: eager timing iterations.
        num_rotations: input sets per case (eager iterations rotate among them).
        num_graph_rotations: input sets captured in graphs (replays rotate among them; GPUs only).
        num_graph_samples: barrier-aligned samples of back-to-back graph replays (GPUs only).
        graphs: time CUDA-graph replays (GPUs only).
        breakdown: per-kernel device times of the planner's cases from the torch profiler.
        host_profile: `--host` only: profile the first rank's calls (`deep_ep.bench.host_profile`).
        host_soak_calls: `--host` only: after the timed calls, this many more of each operation, and the
            device memory allocated before and after them (0: none).
        host_graph_ab_rounds: `--host` only: after the timed calls, this many rounds of each operation
            alternating between the replays' graphs and kernel-by-kernel launches (0: none).
        speed_of_light: measure our peer-store probe (GPUs only).
        hot_fraction: the share of tokens that prefer the hot rank in imbalanced routing.
        seed: the seed of every input.
    """

    cases: list[BenchCase]
    num_ranks: int
    device: str
    virtual_ranks: bool = False
    num_warmups: int = 5
    num_iters: int = 30
    num_rotations: int = 3
    num_graph_rotations: int = 2
    num_graph_samples: int = 5
    graphs: bool = True
    breakdown: bool = False
    host_profile: bool = False
    host_soak_calls: int = 0
    host_graph_ab_rounds: int = 0
    speed_of_light: bool = True
    hot_fraction: float = DEFAULT_HOT_FRACTION
    seed: int = field(default_factory=lambda: time.time_ns() % 1_000_000)


def make_cases(
    tokens: list[int],
    sms: list[int] | None,
    dtypes: list[str],
    routings: list[str],
    hidden: int,
    num_topk: int,
    num_experts: int,
) -> list[BenchCase]:
    """Cases for every (dtype, routing, tokens): the planner's pick (`num_sms=0`), then the `sms` sweep."""
    for dtype in dtypes:
        if dtype not in DTYPES:
            raise ValueError(f"bench: `--dtype` values must be in {DTYPES}, got {dtype!r}")
    for routing in routings:
        if routing not in ROUTINGS:
            raise ValueError(f"bench: `--routing` values must be in {ROUTINGS}, got {routing!r}")
    sm_list = [0, *[s for s in dict.fromkeys(sms or []) if s != 0]]
    return [
        BenchCase(t, hidden, num_topk, num_experts, dtype == "fp8", s, routing)
        for dtype in dict.fromkeys(dtypes)
        for routing in dict.fromkeys(routings)
        for t in dict.fromkeys(tokens)
        for s in sm_list
    ]


DEFAULT_VIRTUAL_RANKS = 4


def default_config(
    sms: list[int] | None = None,
    tokens: list[int] | None = None,
    dtypes: list[str] | None = None,
    routings: list[str] | None = None,
    num_ranks: int | None = None,
    min_ranks: int = 2,
) -> BenchConfig:
    """DeepSeek-V3 shape on GPUs (T=8192/4096/128, H=7168, top-8, 256 experts, FP8 dispatch): one rank
    per GPU, or with one GPU `num_ranks` virtual ranks on it (default 4); a small shape on CPU ranks
    (default 2). Every (dtype, routing, tokens) gets the planner's pick plus the `sms` sweep.
    `min_ranks`: the fewest ranks the run measures anything with (the host cost: 1)."""
    from ..backends.kernels.layout import MAX_RANKS

    dtypes, routings = dtypes or ["fp8"], routings or ["uniform"]
    if num_ranks is not None and not min_ranks <= num_ranks <= MAX_RANKS:
        raise ValueError(f"bench: `--ranks` must be in [{min_ranks}, {MAX_RANKS}], got {num_ranks}")
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if num_gpus >= 2 and num_ranks is not None and num_ranks > num_gpus:
        raise ValueError(f"bench: `--ranks` {num_ranks} is more than the {num_gpus} GPUs of this machine")
    num_experts = 256 if num_gpus else 32
    if num_ranks is not None and num_experts % num_ranks:
        raise ValueError(f"bench: `--ranks` must divide the {num_experts} experts, got {num_ranks}")
    if num_gpus:
        cases = make_cases(tokens or [8192, 4096, 128], sms, dtypes, routings, 7168, 8, num_experts)
        if num_gpus >= 2:
            return BenchConfig(cases, num_ranks or num_gpus, "cuda")
        return BenchConfig(cases, num_ranks or DEFAULT_VIRTUAL_RANKS, "cuda", virtual_ranks=True)
    cases = make_cases(tokens or [512, 128], sms, dtypes, routings, 1024, 4, num_experts)
    return BenchConfig(cases, num_ranks or 2, "cpu", num_warmups=2, num_iters=5, num_rotations=2, graphs=False,
                       speed_of_light=False)  # fmt: skip


def make_inputs(case: BenchCase, rank: int, num_ranks: int, device: str, seed: int, hot_fraction: float):
    """`(x, topk_idx, topk_weights)` of one rank: random BF16 data (cast to FP8 with per-128 scales
    for FP8 dispatch) and routing drawn on the CPU (device-independent)."""
    from ..utils.fp8 import per_token_cast_to_fp8
    from ..utils.routing import imbalanced_routing, uniform_routing

    gen = torch.Generator().manual_seed(seed * 1009 + rank)
    if case.routing == "uniform":
        topk_idx, weights = uniform_routing(case.num_tokens, case.num_experts, case.num_topk, generator=gen,
                                            device=device)  # fmt: skip
    else:
        topk_idx, weights = imbalanced_routing(case.num_tokens, case.num_experts, case.num_topk, num_ranks,
                                               hot_rank=HOT_RANK, hot_fraction=hot_fraction, generator=gen,
                                               device=device)  # fmt: skip
    data_gen = torch.Generator(device=device).manual_seed(seed * 1013 + rank)
    x = torch.randn((case.num_tokens, case.hidden), generator=data_gen, device=device).to(torch.bfloat16)
    return (per_token_cast_to_fp8(x) if case.fp8_dispatch else x), topk_idx, weights


def random_rows(num_rows: int, hidden: int, device: str, seed: int) -> torch.Tensor:
    """`[num_rows, hidden]` BF16 normal values (the expert outputs combine sends back)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn((num_rows, hidden), generator=gen, device=device).to(torch.bfloat16)


def payload_bytes(x: Any, num_topk: int) -> int:
    """Bytes one dispatched token carries: data, scales, top-k ids and weights (int32 + float)."""
    tensors = x if isinstance(x, tuple) else (x,)
    return sum(t[0].numel() * t.element_size() for t in tensors) + num_topk * 8


def records_per_rank(topk_idx: torch.Tensor, num_experts: int, num_ranks: int) -> list[int]:
    """Tokens this rank sends to each rank (a token hitting several experts of a rank counts once)."""
    owner = torch.where(topk_idx >= 0, topk_idx // (num_experts // num_ranks), -1)
    return torch.stack([(owner == d).any(dim=1) for d in range(num_ranks)]).sum(dim=1).tolist()


def kernel_specs(config: BenchConfig, transport: str = "lsa") -> list:
    """The kernels `config`'s cases use on `config.num_ranks` ranks over `transport`, and the speed-of-light
    probe over NVLink (else the post of a host's fault, which a buffer over another transport loads):
    `deep-ep bench` compiles them up front (in parallel, with a progress bar) instead of inside the ranks."""
    from ..backends.kernels.specs import moe_specs, peer_store_spec, post_fault_spec

    specs = [peer_store_spec() if transport == "lsa" else post_fault_spec(transport)]
    for case in config.cases:
        fp8_scale_bytes = ((case.hidden + 127) // 128 * 4,) if case.fp8_dispatch else ()
        specs += moe_specs(config.num_ranks, case.hidden, case.num_topk, case.num_experts, fp8_scale_bytes,
                           transport=transport)  # fmt: skip
    return list(dict.fromkeys(specs))
