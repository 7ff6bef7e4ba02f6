"""Analytic SM / QP / buffer planner: how many SMs and queue pairs a dispatch or combine needs.

No autotuning: the counts come from a bandwidth model of the links and of the SMs that drive them
(docs/planner.md explains the formulas with a worked example). The model plans for clusters we
cannot run here (up to EP2048); `deep-ep plan` prints it.

Traffic per rank, for `T` tokens of `B` bytes each, `N` ranks in domains of `S` ranks (`n = N / S`
domains), `E` experts and top-`K` routing spread uniformly:

- `p` = probability that a given rank owns at least one of a token's experts
  = `1 - C(E - E/N, K) / C(E, K)`; `p_n` the same for a given domain.
- direct mode: every (token, rank) record goes straight to its rank: `p (S - 1)` records per token
  over NVLink, `p (N - S)` over RDMA.
- hybrid mode: one record per hit remote domain crosses RDMA (to the rank with our local index),
  `p_n (n - 1)` per token; inside the destination domain it is forwarded over NVLink, so
  `p (N - n)` records per token cross NVLink (every record except those whose final rank is the
  RDMA receiver or ourselves).

The bottleneck link sets the time; the SMs must store every record they deliver over NVLink (their
own included) and read every token, at calibrated per-SM rates, within that time.
"""

from __future__ import annotations

import glob
import math
from dataclasses import asdict, dataclass
from pathlib import Path

MAX_RANKS = 2048


@dataclass(frozen=True)
class Hardware:
    """Link and SM throughputs of one GPU, each in GB/s per direction, with where they come from."""

    nvlink_gbs: float
    rdma_gbs: float
    sm_read_gbs: float
    sm_write_gbs: float
    num_device_sms: int
    fixed_us: float  # launches, barriers and epilogue latency of one dispatch or combine
    source: str


# Hopper (H200, NVLink NV18) as measured on our GPU machine; see `source`.
HOPPER = Hardware(
    nvlink_gbs=347.0,
    rdma_gbs=50.0,
    sm_read_gbs=200.0,
    sm_write_gbs=50.6,
    num_device_sms=132,
    fixed_us=20.0,
    source=(
        "2x H200 NV18, 2026-11-29 (shared/docs/nccl.md): SM-driven peer stores 50.6 GB/s per SM, linear to "
        "~7 SMs; both ranks writing: 342/347/367 GB/s per direction at 8/24/132 CTAs. rdma_gbs: one 400 Gb/s "
        "NIC per GPU (nominal). sm_read_gbs and fixed_us: first estimates, to be replaced by "
        "bench/calibrate.py on the GPU machine"
    ),
)


@dataclass(frozen=True)
class MoEShape:
    """The per-rank problem: tokens, hidden size, routing, and the dtype of each direction."""

    num_tokens: int
    hidden: int
    num_topk: int
    num_experts: int
    fp8_dispatch: bool = True

    @property
    def dispatch_bytes(self) -> int:
        """Bytes of one dispatched token: data, scales (FP8), top-k ids and weights."""
        data = self.hidden + 4 * math.ceil(self.hidden / 128) if self.fp8_dispatch else 2 * self.hidden
        return data + 8 * self.num_topk

    @property
    def combine_bytes(self) -> int:
        """Bytes of one combined row (BF16)."""
        return 2 * self.hidden


@dataclass(frozen=True)
class Plan:
    """What the planner decides for one mode."""

    mode: str
    num_sms: int
    num_qps: int
    dispatch_buffer_bytes: int
    combine_buffer_bytes: int
    bottleneck: str
    predicted_dispatch_us: float
    predicted_combine_us: float
    nvlink_records_per_token: float
    rdma_records_per_token: float

    def as_dict(self) -> dict:
        return asdict(self)


def expected_hit_groups(num_experts: int, num_topk: int, num_groups: int) -> float:
    """Expected number of distinct groups (of `num_experts / num_groups` experts) hit by one token's
    `num_topk` distinct experts drawn uniformly."""
    miss = math.comb(num_experts - num_experts // num_groups, num_topk) / math.comb(num_experts, num_topk)
    return num_groups * (1.0 - miss)


def check_inputs(shape: MoEShape, num_ranks: int, num_ranks_per_domain: int) -> None:
    """Raise `ValueError` naming the argument for shapes no plan exists for."""
    if not 1 <= num_ranks <= MAX_RANKS:
        raise ValueError(f"plan: `ranks` must be in [1, {MAX_RANKS}], got {num_ranks}")
    if num_ranks_per_domain < 1 or num_ranks % num_ranks_per_domain != 0:
        raise ValueError(f"plan: `ranks` ({num_ranks}) must be a multiple of `ranks_per_node` ({num_ranks_per_domain})")
    if shape.num_experts < 1 or shape.num_experts % num_ranks != 0:
        raise ValueError(f"plan: `experts` ({shape.num_experts}) must be a positive multiple of `ranks` ({num_ranks})")
    if not 1 <= shape.num_topk <= shape.num_experts:
        raise ValueError(f"plan: `topk` must be in [1, experts = {shape.num_experts}], got {shape.num_topk}")
    if shape.hidden < 1 or shape.num_tokens < 1:
        raise ValueError(f"plan: `hidden` and `tokens` must be positive, got {shape.hidden} and {shape.num_tokens}")


def _buffer_bytes(record_bytes: int, num_tokens: int, num_ranks: int, num_domains: int, mode: str) -> int:
    """Receive slots per rank: one per (source rank, token); hybrid adds one per (source domain, token)."""
    from .layout import BUFFER_ALIGNMENT, WORKSPACE_BYTES, align

    slots = num_ranks * num_tokens + (num_domains * num_tokens if mode == "hybrid" else 0)
    return align(WORKSPACE_BYTES + slots * align(record_bytes + 16, 16), BUFFER_ALIGNMENT)


def plan(
    shape: MoEShape,
    num_ranks: int,
    num_ranks_per_domain: int,
    mode: str = "direct",
    hardware: Hardware = HOPPER,
    prefer_overlap_with_compute: bool = True,
) -> Plan:
    """Plan one mode for `shape` on `num_ranks` ranks in NVLink domains of `num_ranks_per_domain`.

    Arguments:
        shape: tokens per rank, hidden, top-k, experts, dispatch dtype.
        num_ranks: `N`, ranks of the expert-parallel group.
        num_ranks_per_domain: `S`, ranks that share one NVLink domain (GPUs per node).
        mode: `'direct'` (every record straight to its rank) or `'hybrid'` (RDMA between domains to
            the same local index, NVLink forwarding inside).
        hardware: link and SM rates.
        prefer_overlap_with_compute: leave SMs to the model; without it, use at least 64.

    Returns:
        The plan: SMs, QPs, buffer bytes, bottleneck link, predicted times.
    """
    check_inputs(shape, num_ranks, num_ranks_per_domain)
    if mode not in ("direct", "hybrid"):
        raise ValueError(f"plan: `mode` must be 'direct' or 'hybrid', got {mode!r}")
    num_domains = num_ranks // num_ranks_per_domain
    if num_domains == 1:
        mode = "direct"  # one NVLink domain: nothing to forward, both modes are the same
    p = expected_hit_groups(shape.num_experts, shape.num_topk, num_ranks) / num_ranks
    if mode == "direct":
        nvlink_records = p * (num_ranks_per_domain - 1)
        rdma_records = p * (num_ranks - num_ranks_per_domain)
        forwarded_records = 0.0
    else:
        p_domain = expected_hit_groups(shape.num_experts, shape.num_topk, num_domains) / num_domains
        rdma_records = p_domain * (num_domains - 1)
        nvlink_records = p * (num_ranks - num_domains)
        forwarded_records = rdma_records
    stored_records = nvlink_records + p  # every NVLink record plus the one a rank keeps for itself

    def times(record_bytes: int, num_sms: int) -> tuple[float, float, str]:
        tokens_bytes = shape.num_tokens * record_bytes
        t_nvlink = tokens_bytes * nvlink_records / (hardware.nvlink_gbs * 1e3)
        t_rdma = tokens_bytes * rdma_records / (hardware.rdma_gbs * 1e3) if rdma_records > 0 else 0.0
        t_link, bottleneck = (t_rdma, "rdma") if t_rdma > t_nvlink else (t_nvlink, "nvlink")
        t_sm = max(
            tokens_bytes * stored_records / (num_sms * hardware.sm_write_gbs * 1e3),
            tokens_bytes * (1 + forwarded_records) / (num_sms * hardware.sm_read_gbs * 1e3),
        )
        if t_sm > t_link:
            bottleneck = "sm"
        return max(t_link, t_sm) + hardware.fixed_us, t_link, bottleneck

    # The fewest SMs whose store and read rates keep up with the bottleneck link, for the heavier direction
    heavier = max(shape.dispatch_bytes, shape.combine_bytes)
    _, t_link, _ = times(heavier, hardware.num_device_sms)
    if t_link > 0:
        tokens_bytes = shape.num_tokens * heavier
        needed = max(
            tokens_bytes * stored_records / (t_link * hardware.sm_write_gbs * 1e3),
            tokens_bytes * (1 + forwarded_records) / (t_link * hardware.sm_read_gbs * 1e3),
        )
        num_sms = max(2, 2 * math.ceil(needed / 2))
    else:
        num_sms = 2  # nothing crosses a link (one rank): the local copy needs few SMs
    if not prefer_overlap_with_compute:
        num_sms = max(num_sms, 64)
    num_sms = min(num_sms, hardware.num_device_sms)

    predicted_dispatch, _, bottleneck = times(shape.dispatch_bytes, num_sms)
    predicted_combine, _, _ = times(shape.combine_bytes, num_sms)
    if rdma_records == 0:
        num_qps = 0
    else:
        num_qps = num_sms * 16 + 1 if mode == "hybrid" else min(num_sms, 8) + 1
    return Plan(
        mode=mode,
        num_sms=num_sms,
        num_qps=num_qps,
        dispatch_buffer_bytes=_buffer_bytes(shape.dispatch_bytes, shape.num_tokens, num_ranks, num_domains, mode),
        combine_buffer_bytes=_buffer_bytes(shape.combine_bytes, shape.num_tokens, num_ranks, num_domains, mode),
        bottleneck=bottleneck,
        predicted_dispatch_us=predicted_dispatch,
        predicted_combine_us=predicted_combine,
        nvlink_records_per_token=nvlink_records,
        rdma_records_per_token=rdma_records,
    )


def _nvml_nvlink_gbs() -> float | None:
    """NVLink GB/s per direction of GPU 0 from NVML (active links x per-link speed), if NVML is there."""
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        num_links = 0
        for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
            try:
                num_links += pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED
            except pynvml.NVMLError:
                break
        # NVLink 4 (Hopper): 26.56 GB/s per link per direction, as `nvidia-smi nvlink -s` reports
        return num_links * 26.5625 if num_links else None
    except pynvml.NVMLError:
        return None


def _infiniband_gbs() -> float | None:
    """Fastest InfiniBand/RoCE port rate from sysfs (e.g. '400 Gb/sec (4X NDR)'), in GB/s."""
    rates = []
    for path in glob.glob("/sys/class/infiniband/*/ports/*/rate"):
        try:
            rates.append(float(Path(path).read_text().split()[0]) / 8)
        except (OSError, ValueError, IndexError):
            continue
    return max(rates) if rates else None


def detect_hardware(num_device_sms: int | None = None) -> Hardware:
    """HOPPER's calibrated SM rates with the link bandwidths of this machine where they can be read."""
    nvlink = _nvml_nvlink_gbs()
    rdma = _infiniband_gbs()
    return Hardware(
        nvlink_gbs=min(nvlink, HOPPER.nvlink_gbs) if nvlink else HOPPER.nvlink_gbs,
        rdma_gbs=rdma or HOPPER.rdma_gbs,
        sm_read_gbs=HOPPER.sm_read_gbs,
        sm_write_gbs=HOPPER.sm_write_gbs,
        num_device_sms=num_device_sms or HOPPER.num_device_sms,
        fixed_us=HOPPER.fixed_us,
        source=HOPPER.source + (" ; nvlink from NVML" if nvlink else "") + (" ; rdma from sysfs" if rdma else ""),
    )
