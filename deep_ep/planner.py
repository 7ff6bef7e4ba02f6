"""Analytic SM / QP / buffer planner: how many SMs and queue pairs a dispatch or combine needs.

No autotuning: the counts come from a bandwidth model of the links and of the SMs that drive them
(docs/planner.md explains the formulas with a worked example). The model plans for clusters we
cannot run here (up to EP2048); `deep-ep plan` prints it. Its rates are calibrated on our GPU
machine by `deep-ep calibrate` and stored, with their provenance, in `deep_ep/data/hopper.json`.

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

Time of one direction on `m` SMs (all times in microseconds):

    t(m) = smooth_max_k(t_link, t_sm(m)) + t_epilogue + t_fixed

with `t_link` the busier link, `t_sm(m) = SM bytes / (m r)` at the calibrated per-SM rate `r` of our
kernel, `smooth_max_k(a, b) = (a^k + b^k)^(1/k)` (the plain max for `k = None`; the calibrated `k`
says how gradually the link saturates), `t_epilogue = logical bytes / e` (the kernels whose cost does
not depend on `m`: layout, counts, epilogue) and `t_fixed` the cost of a call at tiny `T`.
"""

from __future__ import annotations

import functools
import glob
import importlib.resources
import json
import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from deep_ep.records import (
    DispatchRecordLayout,
    buffer_record_bytes,
    buffer_region_bytes,
    combine_region_bytes,
    dispatch_region_bytes,
    forward_region_bytes,
    hybrid_combine_region_bytes,
    window_bytes,
)

MAX_RANKS = 2048

# The SM pick: the fewest (even) SMs whose predicted time is within this fraction of the time at the
# reference SM count (half the device with `prefer_overlap_with_compute`, else all of it)
PICK_TOLERANCE = 0.04

# Planning shape of a buffer created without `num_max_tokens_per_rank` or `hidden`
DEFAULT_PLAN_TOKENS = 4096
DEFAULT_PLAN_HIDDEN = 7168

# Where the calibrated rates live (package data) and the document's format version
HARDWARE_FILE = "data/hopper.json"
HARDWARE_FORMAT = 1


@dataclass(frozen=True)
class Hardware:
    """Link rates of one GPU and the calibrated rates of our kernels on it, with where they come from.

    Attributes:
        nvlink_gbs: NVLink GB/s per direction with every rank writing at once (our peer-store probe).
        rdma_gbs: GB/s of the NIC per direction.
        num_device_sms: SMs of the device.
        dispatch_sm_gbs, combine_sm_gbs: logical GB/s one SM of our dispatch / combine kernel moves
            where the SMs are the limit (`r`).
        dispatch_knee_k, combine_knee_k: exponent `k` of the smooth max of link and SM time (`None`:
            the plain max).
        dispatch_epilogue_gbs, combine_epilogue_gbs: logical GB/s of the kernels whose cost does not
            depend on the SM count (`e`; `None`: no such term).
        dispatch_fixed_us, combine_fixed_us: cost of a call at tiny `T` (`t_fixed`).
        source: the provenance of these numbers.
    """

    nvlink_gbs: float
    rdma_gbs: float
    num_device_sms: int
    dispatch_sm_gbs: float
    combine_sm_gbs: float
    dispatch_knee_k: float | None
    combine_knee_k: float | None
    dispatch_epilogue_gbs: float | None
    combine_epilogue_gbs: float | None
    dispatch_fixed_us: float
    combine_fixed_us: float
    source: str

    def op_rates(self, op: str) -> tuple[float, float | None, float | None, float]:
        """`(sm_gbs, knee_k, epilogue_gbs, fixed_us)` of `op` (`'dispatch'` or `'combine'`)."""
        if op not in ("dispatch", "combine"):
            raise ValueError(f"Hardware.op_rates: `op` must be 'dispatch' or 'combine', got {op!r}")
        return (
            getattr(self, f"{op}_sm_gbs"),
            getattr(self, f"{op}_knee_k"),
            getattr(self, f"{op}_epilogue_gbs"),
            getattr(self, f"{op}_fixed_us"),
        )


def hardware_from_document(document: dict[str, Any]) -> Hardware:
    """The `Hardware` of a calibration document (the format `deep-ep calibrate` writes)."""
    if document.get("format") != HARDWARE_FORMAT:
        raise ValueError(f"hardware document: `format` must be {HARDWARE_FORMAT}, got {document.get('format')!r}")
    values = document["hardware"]
    provenance = document["provenance"]
    # Concise: the machine, the day and the commit (the commands and their paths stay in the document)
    source = (
        f"{document['status']}: {provenance['machine']}, {provenance['date'][:10]}, commit {provenance['commit'][:7]}"
    )
    if "refit" in provenance:
        refit = provenance["refit"]
        source += f"; refit {refit['date'][:10]}, commit {refit['commit'][:7]}"
    names = [f.name for f in fields(Hardware) if f.name != "source"]
    missing = [name for name in names if name not in values]
    if missing:
        raise ValueError(f"hardware document: `hardware` lacks {missing}")
    return Hardware(**{name: values[name] for name in names}, source=source)


def load_hardware(path: str | Path | None = None) -> Hardware:
    """Load the calibrated rates from `path`, by default the package's `deep_ep/data/hopper.json`."""
    if path is None:
        text = importlib.resources.files("deep_ep").joinpath(HARDWARE_FILE).read_text()
    else:
        text = Path(path).read_text()
    return hardware_from_document(json.loads(text))


# Hopper (H200, NVLink NV18) as measured on our GPU machine; `HOPPER.source` says when and how.
HOPPER = load_hardware()


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
class Traffic:
    """Expected records per token leaving one rank (uniform top-k routing)."""

    mode: str
    hit_probability: float  # p: a given rank owns one of the token's experts
    nvlink_records: float
    rdma_records: float
    logical_records: float  # every (token, destination rank) record, the own one included: p N
    sm_records: float  # records the SMs write: NVLink, RDMA staging and the own copy


@dataclass(frozen=True)
class OpTime:
    """The predicted time of one direction on `num_sms` SMs, and its terms (microseconds)."""

    total_us: float
    link_us: float
    sm_us: float
    epilogue_us: float
    fixed_us: float
    link: str  # the busier link: 'nvlink' or 'rdma' ('none' without traffic over links)


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
    dispatch_link_us: float
    dispatch_sm_us: float
    combine_link_us: float
    combine_sm_us: float

    def as_dict(self) -> dict:
        return asdict(self)


def expected_hit_groups(num_experts: int, num_topk: int, num_groups: int) -> float:
    """Expected number of distinct groups (of `num_experts / num_groups` experts) hit by one token's
    `num_topk` distinct experts drawn uniformly."""
    miss = math.comb(num_experts - num_experts // num_groups, num_topk) / math.comb(num_experts, num_topk)
    return num_groups * (1.0 - miss)


# How `check_inputs` names the quantities it checks (`deep-ep plan` passes its options' names)
PLAN_INPUT_NAMES = {"ranks": "ranks", "ranks_per_node": "ranks_per_node", "tokens": "tokens", "hidden": "hidden",
                    "experts": "experts", "topk": "topk"}  # fmt: skip


def check_inputs(shape: MoEShape, num_ranks: int, num_ranks_per_domain: int,
                 names: dict[str, str] = PLAN_INPUT_NAMES) -> None:  # fmt: skip
    """Raise `ValueError` naming the argument (as `names` calls it) for shapes no plan exists for."""
    if not 1 <= num_ranks <= MAX_RANKS:
        raise ValueError(f"plan: `{names['ranks']}` must be in [1, {MAX_RANKS}], got {num_ranks}")
    if num_ranks_per_domain < 1 or num_ranks % num_ranks_per_domain != 0:
        raise ValueError(f"plan: `{names['ranks']}` ({num_ranks}) must be a multiple of `{names['ranks_per_node']}` "
                         f"({num_ranks_per_domain})")  # fmt: skip
    for name, value in (("tokens", shape.num_tokens), ("hidden", shape.hidden), ("experts", shape.num_experts)):
        if value < 1:
            raise ValueError(f"plan: `{names[name]}` must be positive, got {value}")
    if shape.num_experts % num_ranks != 0:
        raise ValueError(f"plan: `{names['experts']}` ({shape.num_experts}) must be a multiple of `{names['ranks']}` "
                         f"({num_ranks})")  # fmt: skip
    if not 1 <= shape.num_topk <= shape.num_experts:
        raise ValueError(f"plan: `{names['topk']}` must be in [1, {names['experts']} = {shape.num_experts}], got "
                         f"{shape.num_topk}")  # fmt: skip


def traffic(shape: MoEShape, num_ranks: int, num_ranks_per_domain: int, mode: str = "direct") -> Traffic:
    """Expected records per token over each link for `mode` (one domain: always direct)."""
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
    else:
        p_domain = expected_hit_groups(shape.num_experts, shape.num_topk, num_domains) / num_domains
        rdma_records = p_domain * (num_domains - 1)
        nvlink_records = p * (num_ranks - num_domains)
    return Traffic(mode, p, nvlink_records, rdma_records, p * num_ranks, nvlink_records + rdma_records + p)


def smooth_max(a: float, b: float, k: float | None) -> float:
    """`(a^k + b^k)^(1/k)` for non-negative `a`, `b`: the plain max for `k = None`."""
    high = max(a, b)
    if k is None or high <= 0 or min(a, b) <= 0:
        return high
    return high * ((a / high) ** k + (b / high) ** k) ** (1.0 / k)


def op_time(op: str, shape: MoEShape, flows: Traffic, num_sms: int, hardware: Hardware) -> OpTime:
    """Predicted time of one dispatch (`op='dispatch'`) or combine on `num_sms` SMs."""
    record_bytes = shape.dispatch_bytes if op == "dispatch" else shape.combine_bytes
    sm_gbs, knee_k, epilogue_gbs, fixed_us = hardware.op_rates(op)
    token_bytes = shape.num_tokens * record_bytes  # GB/s x 1e3 = bytes per microsecond
    t_nvlink = token_bytes * flows.nvlink_records / (hardware.nvlink_gbs * 1e3)
    t_rdma = token_bytes * flows.rdma_records / (hardware.rdma_gbs * 1e3) if flows.rdma_records > 0 else 0.0
    t_link, link = (t_rdma, "rdma") if t_rdma > t_nvlink else (t_nvlink, "nvlink" if t_nvlink > 0 else "none")
    t_sm = token_bytes * flows.sm_records / (max(1, num_sms) * sm_gbs * 1e3)
    t_epilogue = token_bytes * flows.logical_records / (epilogue_gbs * 1e3) if epilogue_gbs else 0.0
    total = smooth_max(t_link, t_sm, knee_k) + t_epilogue + fixed_us
    return OpTime(total, t_link, t_sm, t_epilogue, fixed_us, link)


def reference_num_sms(num_device_sms: int, prefer_overlap_with_compute: bool = True) -> int:
    """The SM count the pick compares against: half the device (even) when SMs are left to compute."""
    if not prefer_overlap_with_compute:
        return num_device_sms
    return max(min(2, num_device_sms), num_device_sms // 4 * 2)


def pick_num_sms(shape: MoEShape, flows: Traffic, hardware: Hardware, prefer_overlap_with_compute: bool = True) -> int:
    """The fewest even SMs whose predicted dispatch and combine times are both within `PICK_TOLERANCE`
    of their times at `reference_num_sms` (at least 64 without `prefer_overlap_with_compute`)."""
    num_device_sms = hardware.num_device_sms
    if num_device_sms < 2:
        return max(1, num_device_sms)
    reference = reference_num_sms(num_device_sms, prefer_overlap_with_compute)
    num_sms = 2
    for op in ("dispatch", "combine"):
        limit = (1 + PICK_TOLERANCE) * op_time(op, shape, flows, reference, hardware).total_us
        op_sms = next(
            (m for m in range(2, reference + 1, 2) if op_time(op, shape, flows, m, hardware).total_us <= limit),
            reference,
        )
        num_sms = max(num_sms, op_sms)
    if not prefer_overlap_with_compute:
        num_sms = max(num_sms, 64)
    return min(num_sms, num_device_sms)


# Where the RDMA devices describe themselves (`hca_type`, e.g. "MT4131")
INFINIBAND_SYSFS = "/sys/class/infiniband"


def has_fast_rdma_atomics_nic(sysfs: str = INFINIBAND_SYSFS) -> bool:
    """Whether an RDMA device here is a ConnectX of CA type MT4131, whose fast RDMA atomics let
    DeepEP V2 allocate fewer queue pairs in hybrid mode."""
    import glob

    for path in glob.glob(f"{sysfs}/*/hca_type"):
        try:
            with open(path) as f:
                if f.read().strip() == "MT4131":
                    return True
        except OSError:
            continue
    return False


def default_num_allocated_qps(allow_hybrid_mode: bool, sysfs: str = INFINIBAND_SYSFS) -> int:
    """DeepEP V2's default `num_allocated_qps`: 129 with hybrid mode allowed (65 on an MT4131 NIC),
    else 17."""
    if not allow_hybrid_mode:
        return 17
    return 65 if has_fast_rdma_atomics_nic(sysfs) else 129


def theoretical_num_qps(num_sms: int, use_hybrid: bool) -> int:
    """RDMA queue pairs for `num_sms` SMs (V2's rule): one per channel and peer plus one for counts
    in hybrid mode (`16 num_sms + 1`), else `min(num_sms, 9)`."""
    return num_sms * 16 + 1 if use_hybrid else min(num_sms, 8 + 1)


def buffer_size_hint(
    num_ranks: int,
    num_max_tokens_per_rank: int,
    hidden: int,
    num_topk: int = 0,
    use_fp8_dispatch: bool = False,
    allow_hybrid_mode: bool = True,
    allow_multiple_reduction: bool = True,
    num_ranks_per_domain: int | None = None,
) -> int:
    """Buffer bytes per rank for the MoE shape (2 MiB aligned): the window layout of
    `deep_ep.records` (`buffer_region_bytes`: no larger than DeepEP V2's hint for the same arguments,
    plus our workspace); when hybrid mode may run across domains (`num_ranks_per_domain <
    num_ranks`), room for its dispatch's forward records after the records (`forward_region_bytes`)
    and for its combine's holder slots and node partials (`hybrid_combine_region_bytes`). The
    kernels' scale-out region comes on top (`deep_ep.backends.kernels.scaleout`); `num_topk = 0`
    counts as 32 lanes."""
    num_topk = num_topk if num_topk > 0 else 32
    per_domain = num_ranks if num_ranks_per_domain is None else num_ranks_per_domain
    region = buffer_region_bytes(num_ranks, num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch,
                                 allow_multiple_reduction)  # fmt: skip
    if allow_hybrid_mode and per_domain < num_ranks:
        record = buffer_record_bytes(hidden, num_topk, use_fp8_dispatch)
        region = max(region, _hybrid_region_bytes(num_ranks, num_ranks // per_domain, num_max_tokens_per_rank,
                                                  hidden, num_topk, record))  # fmt: skip
    return window_bytes(region)


def _hybrid_region_bytes(num_ranks: int, num_domains: int, num_tokens: int, hidden: int, num_topk: int,
                         record_bytes: int) -> int:  # fmt: skip
    """Hybrid mode's data region: a dispatch's records then its forward region, or a combine's slots."""
    dispatch = dispatch_region_bytes(num_ranks, num_tokens, record_bytes)
    dispatch += forward_region_bytes(num_domains, num_ranks // num_domains, num_tokens, record_bytes)
    return max(dispatch, hybrid_combine_region_bytes(num_ranks, num_domains, num_tokens, hidden, num_topk))


def _buffer_bytes(shape: MoEShape, num_ranks: int, num_domains: int, mode: str) -> tuple[int, int]:
    """Window bytes per rank for this shape's dispatch records and combine slots alone."""
    hidden_bytes = shape.hidden if shape.fp8_dispatch else 2 * shape.hidden
    scale_bytes = 4 * math.ceil(shape.hidden / 128) if shape.fp8_dispatch else 0
    record = DispatchRecordLayout(hidden_bytes, scale_bytes, shape.num_topk).num_bytes
    dispatch = dispatch_region_bytes(num_ranks, shape.num_tokens, record)
    if mode == "hybrid":
        dispatch += forward_region_bytes(num_domains, num_ranks // num_domains, shape.num_tokens, record)
        combine = hybrid_combine_region_bytes(num_ranks, num_domains, shape.num_tokens, shape.hidden, shape.num_topk)
    else:
        combine = combine_region_bytes(num_ranks, shape.num_tokens, shape.hidden, shape.num_topk, 1)
    return window_bytes(dispatch), window_bytes(combine)


def plan(
    shape: MoEShape,
    num_ranks: int,
    num_ranks_per_domain: int,
    mode: str = "direct",
    hardware: Hardware = HOPPER,
    prefer_overlap_with_compute: bool = True,
    num_sms: int | None = None,
) -> Plan:
    """Plan one mode for `shape` on `num_ranks` ranks in NVLink domains of `num_ranks_per_domain`.

    Arguments:
        shape: tokens per rank, hidden, top-k, experts, dispatch dtype.
        num_ranks: `N`, ranks of the expert-parallel group.
        num_ranks_per_domain: `S`, ranks that share one NVLink domain (GPUs per node).
        mode: `'direct'` (every record straight to its rank) or `'hybrid'` (RDMA between domains to
            the same local index, NVLink forwarding inside).
        hardware: link rates and the calibrated rates of our kernels.
        prefer_overlap_with_compute: compare against half the device's SMs; without it, use at least 64.
        num_sms: predict for this SM count instead of picking one.

    Returns:
        The plan: SMs, QPs, buffer bytes, bottleneck link, predicted times and their link and SM terms.
    """
    flows = traffic(shape, num_ranks, num_ranks_per_domain, mode)
    if num_sms is None:
        num_sms = pick_num_sms(shape, flows, hardware, prefer_overlap_with_compute)
    elif num_sms < 1:
        raise ValueError(f"plan: `num_sms` must be positive, got {num_sms}")
    dispatch = op_time("dispatch", shape, flows, num_sms, hardware)
    combine = op_time("combine", shape, flows, num_sms, hardware)

    # The bottleneck: the link that bounds the heavier direction, or the SMs if all of them cannot keep up
    heavier = "combine" if combine.total_us >= dispatch.total_us else "dispatch"
    at_all_sms = op_time(heavier, shape, flows, hardware.num_device_sms, hardware)
    bottleneck = "sm" if at_all_sms.sm_us > at_all_sms.link_us else at_all_sms.link
    num_qps = 0 if flows.rdma_records == 0 else theoretical_num_qps(num_sms, flows.mode == "hybrid")
    dispatch_buffer, combine_buffer = _buffer_bytes(shape, num_ranks, num_ranks // num_ranks_per_domain, flows.mode)
    return Plan(
        mode=flows.mode,
        num_sms=num_sms,
        num_qps=num_qps,
        dispatch_buffer_bytes=dispatch_buffer,
        combine_buffer_bytes=combine_buffer,
        bottleneck=bottleneck,
        predicted_dispatch_us=dispatch.total_us,
        predicted_combine_us=combine.total_us,
        nvlink_records_per_token=flows.nvlink_records,
        rdma_records_per_token=flows.rdma_records,
        dispatch_link_us=dispatch.link_us,
        dispatch_sm_us=dispatch.sm_us,
        combine_link_us=combine.link_us,
        combine_sm_us=combine.sm_us,
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
    except Exception:  # no driver, no device, an old NVML: the calibrated rate stands
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


@functools.cache
def detect_hardware(num_device_sms: int | None = None) -> Hardware:
    """HOPPER's calibrated rates with the link bandwidths of this machine where they can be read
    (the NVLink rate capped by the calibrated one); memoized."""
    nvlink = _nvml_nvlink_gbs()
    rdma = _infiniband_gbs()
    return replace(
        HOPPER,
        nvlink_gbs=min(nvlink, HOPPER.nvlink_gbs) if nvlink else HOPPER.nvlink_gbs,
        rdma_gbs=rdma or HOPPER.rdma_gbs,
        num_device_sms=num_device_sms or HOPPER.num_device_sms,
        source=HOPPER.source + (" ; nvlink from NVML" if nvlink else "") + (" ; rdma from sysfs" if rdma else ""),
    )


def theoretical_num_sms(
    num_tokens: int,
    hidden: int,
    num_topk: int,
    num_experts: int,
    use_fp8_dispatch: bool,
    num_ranks: int,
    num_ranks_per_domain: int,
    use_hybrid: bool,
    prefer_overlap_with_compute: bool = True,
    num_device_sms: int | None = None,
) -> int:
    """The SM count `ElasticBuffer.get_theoretical_num_sms` returns: the plan's pick on this machine."""
    shape = MoEShape(num_tokens, hidden, num_topk, num_experts, fp8_dispatch=use_fp8_dispatch)
    mode = "hybrid" if use_hybrid else "direct"
    hardware = detect_hardware(num_device_sms)
    return plan(shape, num_ranks, num_ranks_per_domain, mode, hardware, prefer_overlap_with_compute).num_sms
