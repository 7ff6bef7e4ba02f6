"""`deep-ep bench --nodes N`: the bytes that cross the NIC per token, on virtual nodes of one GPU.

The ranks are split into `N` virtual nodes (`deep_ep.loopback`), whose ranks reach other nodes only
through the emulated NIC (eager mode), which counts what each rank hands to it. Per case and mode
(direct, then hybrid), every rank runs one fresh dispatch with CPU sync and one combine of its
handle on the kernels, checks both bitwise against `deep_ep.reference` in the same mode, and reads
its NIC counters around each call:

- measured: the bytes put (records and counts in dispatch, rows in combine), puts and signals;
- expected in direct mode, from the routing: a record per (token, destination rank on another
  node), the per-expert counts once per rank on another node, a combine row per (received token,
  source on another node);
- expected in hybrid mode: a forward record (record and a header of the node's slots) per (token,
  destination node other than ours), so each token at most once per node, and the per-expert counts
  once per rank on another node (through its forwarder); in combine the forwarders' partials, a row
  per (token, node other than home's).

Measured and expected must agree to the byte: per rank, except hybrid mode's combine, whose partials
a rank puts for its rail peers' tokens (checked over the group's total). Totals are over all ranks,
per token of the group (`N_ranks x T` tokens).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..host_reads import host_list, to_host
from ..records import CombineSlotLayout, DispatchRecordLayout
from ..utils.math import align
from . import report
from .cases import BenchCase, BenchConfig, make_inputs, random_rows
from .cases import kernel_specs as direct_kernel_specs

TRAFFIC_FIELDS = ("dispatch_bytes", "dispatch_puts", "dispatch_signals", "combine_bytes", "combine_puts",
                  "combine_signals", "hybrid_dispatch_measured", "hybrid_combine_measured")  # fmt: skip
# The NIC between virtual nodes: eager (the calling warp copies; it counts what strict mode would)
NIC_TRANSPORT = "emulated-eager"
MODEL_FIELDS = ("direct_dispatch_bytes", "direct_combine_bytes", "hybrid_dispatch_bytes", "hybrid_combine_bytes",
                "remote_rank_hits", "remote_node_hits", "num_tokens")  # fmt: skip


def record_bytes(case: BenchCase) -> int:
    """A dispatch record of `case` (FP8 with per-128 FP32 scales, or BF16)."""
    if case.fp8_dispatch:
        return DispatchRecordLayout(case.hidden, 4 * -(-case.hidden // 128), case.num_topk).num_bytes
    return DispatchRecordLayout(2 * case.hidden, 0, case.num_topk).num_bytes


def modelled_bytes(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, num_ranks_per_node: int, rank: int,
                   num_recv_per_source: list[int], case: BenchCase) -> dict[str, int]:  # fmt: skip
    """What `rank` puts through the NIC in direct mode and in hybrid mode, for its routing `topk_idx`
    (`[T, K]` int64 on the CPU, `-1` for none) and the tokens it received from each source
    (`num_recv_per_source`, `[num_ranks]`): `direct_*` and `hybrid_*` bytes (dispatch and combine;
    hybrid combine: the partials of `rank`'s tokens, which its forwarders put), and the (token,
    remote rank) and (token, remote node) pairs."""
    num_local_experts = num_experts // num_ranks
    node = rank // num_ranks_per_node
    num_nodes = num_ranks // num_ranks_per_node
    record = record_bytes(case)
    slot = CombineSlotLayout(case.hidden, case.num_topk).num_bytes
    dst = torch.where(topk_idx >= 0, topk_idx // num_local_experts, -1)
    ranks_hit = torch.zeros((dst.shape[0], num_ranks + 1), dtype=torch.bool)
    ranks_hit.scatter_(1, torch.where(dst >= 0, dst, num_ranks), True)
    ranks_hit = ranks_hit[:, :num_ranks]
    is_remote = torch.arange(num_ranks) // num_ranks_per_node != node
    remote_rank_hits = int(ranks_hit[:, is_remote].sum())
    nodes_hit = ranks_hit.reshape(-1, num_nodes, num_ranks_per_node).any(dim=2)
    remote_node_hits = int(nodes_hit.sum() - nodes_hit[:, node].sum())
    num_remote_ranks = int(is_remote.sum())
    count_bytes = align(num_local_experts * 4, 16)
    header = align(4 * num_ranks_per_node, 16)
    received_remote = sum(n for s, n in enumerate(num_recv_per_source) if is_remote[s])
    return dict(
        direct_dispatch_bytes=remote_rank_hits * record + num_remote_ranks * count_bytes,
        direct_combine_bytes=received_remote * slot,
        hybrid_dispatch_bytes=remote_node_hits * (record + header) + num_remote_ranks * count_bytes,
        hybrid_combine_bytes=remote_node_hits * slot,
        remote_rank_hits=remote_rank_hits,
        remote_node_hits=remote_node_hits,
        num_tokens=int(dst.shape[0]),
    )


def _traffic_delta(links: Any, before: dict[str, int]) -> dict[str, int]:
    after = links.traffic()
    return {name: after[name] - before[name] for name in after}


def _measure(group: dist.ProcessGroup, case: BenchCase, config: BenchConfig, rank: int, hybrid: bool,
             what: str) -> tuple[dict, dict, list[int], torch.Tensor]:  # fmt: skip
    """One fresh dispatch and one combine on the kernels in direct or `hybrid` mode, checked against
    the reference in the same mode: the NIC counters' deltas around each, what this rank received
    from each source, and its routing."""
    import deep_ep

    from .runner import check_combine, check_dispatch

    num_ranks = group.size()
    buffers = [deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=case.num_tokens, hidden=case.hidden,
                                     num_topk=case.num_topk, use_fp8_dispatch=case.fp8_dispatch,
                                     allow_hybrid_mode=hybrid, backend=backend, explicitly_destroy=True)
               for backend in ("kernels", "reference")]  # fmt: skip
    ours, reference = buffers
    try:
        links = ours.backend.runtime.links
        x, topk_idx, weights = make_inputs(case, rank, num_ranks, config.device, config.seed, config.hot_fraction)
        routed = dict(topk_idx=topk_idx, topk_weights=weights, num_experts=case.num_experts,
                      num_max_tokens_per_rank=case.num_tokens)  # fmt: skip
        before = links.traffic()
        out = ours.dispatch(x, **routed)
        dispatched = _traffic_delta(links, before)
        ref_out = reference.dispatch(x, **routed)
        num_recv = out[3].num_recv_tokens
        check_dispatch(out, ref_out, num_recv, f"{what} dispatch")
        rows_in = random_rows(num_recv, case.hidden, config.device, config.seed * 7 + rank)
        before = links.traffic()
        combined = ours.combine(rows_in, out[3])[0]
        combined_traffic = _traffic_delta(links, before)
        check_combine(combined, reference.combine(rows_in, ref_out[3])[0], f"{what} combine")
        psum = host_list(out[3].psum_num_recv_tokens_per_scaleup_rank)
        per_source = [b - a for a, b in zip([0, *psum[:-1]], psum, strict=True)]
        return dispatched, combined_traffic, per_source, to_host(topk_idx)
    finally:
        for buffer in buffers:
            buffer.destroy()


def nodes_rank(rank: int, group: dist.ProcessGroup, config: BenchConfig, num_ranks_per_node: int) -> list[dict]:
    """Every case of `config` (the planner's SM pick) on this rank: one row per case with its NIC
    counters around one dispatch and one combine in each mode, and `modelled_bytes` (collective)."""
    num_ranks = group.size()
    num_nodes = num_ranks // num_ranks_per_node
    rows = []
    for case in {c.key: c for c in config.cases if c.num_sms == 0}.values():
        what = f"T={case.num_tokens} {case.dtype} {case.routing}, {num_nodes} nodes"
        dispatched, combined_traffic, per_source, topk_idx = _measure(group, case, config, rank, False, what)
        hybrid_dispatched, hybrid_combined, hybrid_per_source, _ = _measure(group, case, config, rank, True,
                                                                            f"{what}, hybrid mode")  # fmt: skip
        model = modelled_bytes(topk_idx, case.num_experts, num_ranks, num_ranks_per_node, rank, per_source, case)
        expected = (("dispatch", "direct_dispatch_bytes", dispatched["bytes"]),
                    ("combine", "direct_combine_bytes", combined_traffic["bytes"]),
                    ("hybrid dispatch", "hybrid_dispatch_bytes", hybrid_dispatched["bytes"]))  # fmt: skip
        for op, name, counted in expected:
            if counted != model[name]:
                raise AssertionError(f"{what}, rank {rank}: the NIC took {counted} bytes in {op}, {model[name]} expected "
                                     f"({name}) for this routing")  # fmt: skip
        # Hybrid mode's combine: a rank puts the partials of its rail peers' tokens, so the group's total
        totals = torch.tensor([hybrid_combined["bytes"], model["hybrid_combine_bytes"]], dtype=torch.int64)
        dist.all_reduce(totals, group=group)
        if totals[0] != totals[1]:
            raise AssertionError(f"{what}: the NICs took {int(totals[0])} bytes in hybrid combine, "
                                 f"{int(totals[1])} expected (a partial per token and remote node)")  # fmt: skip
        if hybrid_per_source != per_source:
            raise AssertionError(f"{what}, rank {rank}: hybrid mode received {hybrid_per_source}, direct {per_source}")
        rows.append(dict(case=dict(num_tokens=case.num_tokens, dtype=case.dtype, routing=case.routing,
                                   hidden=case.hidden, num_topk=case.num_topk, num_experts=case.num_experts),
                         rank=rank, **{f"dispatch_{k}": v for k, v in dispatched.items()},
                         **{f"combine_{k}": v for k, v in combined_traffic.items()},
                         hybrid_dispatch_measured=hybrid_dispatched["bytes"],
                         hybrid_combine_measured=hybrid_combined["bytes"],
                         **{f"hybrid_dispatch_{k}": v for k, v in hybrid_dispatched.items() if k != "bytes"},
                         **{f"hybrid_combine_{k}": v for k, v in hybrid_combined.items() if k != "bytes"},
                         **model))  # fmt: skip
    return rows


def kernel_specs(config: BenchConfig) -> list:
    """The kernels of both modes over the eager NIC: those of direct mode (`cases.kernel_specs`) and
    hybrid mode's dispatches, forwarding combine and node-stage combine epilogue."""
    from ..backends.kernels.specs import combine_epilogue_spec, combine_spec, dispatch_spec

    specs = direct_kernel_specs(config, NIC_TRANSPORT)
    for case in config.cases:
        hidden_bytes, scale_bytes = (
            (case.hidden, (case.hidden + 127) // 128 * 4) if case.fp8_dispatch else (2 * case.hidden, 0)
        )
        specs += [dispatch_spec(config.num_ranks, hidden_bytes, scale_bytes, case.num_topk, cached, False,
                                f"hybrid-{NIC_TRANSPORT}") for cached in (False, True)]  # fmt: skip
        specs += [combine_spec(config.num_ranks, case.hidden, case.num_topk, 1, False, False, f"hybrid-{NIC_TRANSPORT}"),
                  combine_epilogue_spec(config.num_ranks, case.hidden, case.num_topk, 1, False,
                                        f"hybrid-{NIC_TRANSPORT}")]  # fmt: skip
    return list(dict.fromkeys(specs))


def summarize(per_rank: list[list[dict]]) -> list[dict]:
    """One row per case: every count summed over the ranks, and per token of the group."""
    summary = []
    for same in zip(*per_rank, strict=True):
        row: dict[str, Any] = dict(case=same[0]["case"])
        for name in (*TRAFFIC_FIELDS, *MODEL_FIELDS):
            row[name] = sum(r[name] for r in same)
        tokens = max(1, row["num_tokens"])
        row["per_token"] = {
            name: row[name] / tokens for name in (*TRAFFIC_FIELDS, *MODEL_FIELDS) if name != "num_tokens"
        }
        summary.append(row)
    return summary


def format_table(rows: list[dict], hardware: str, num_nodes: int) -> str:
    lines = [f"bytes over the NIC per token ({hardware}; {num_nodes} virtual nodes, emulated NIC; totals over ranks):",
             f"{'T':>6} {'dtype':>5} {'routing':>10} | {'direct d/c':>23} | {'hybrid d/c':>23} | "
             f"{'hybrid/direct d/c':>17} | {'records/token direct/hybrid':>27}"]  # fmt: skip
    for row in rows:
        c, p = row["case"], row["per_token"]
        ratio = p["hybrid_dispatch_measured"] / p["dispatch_bytes"] if p["dispatch_bytes"] else float("nan")
        combine_ratio = p["hybrid_combine_measured"] / p["combine_bytes"] if p["combine_bytes"] else float("nan")
        lines.append(f"{c['num_tokens']:>6} {c['dtype']:>5} {c['routing']:>10} | "
                     f"{p['dispatch_bytes']:>11.0f} {p['combine_bytes']:>11.0f} | "
                     f"{p['hybrid_dispatch_measured']:>11.0f} {p['hybrid_combine_measured']:>11.0f} | "
                     f"{ratio:>8.3f} {combine_ratio:>8.3f} | "
                     f"{p['remote_rank_hits']:>13.3f} {p['remote_node_hits']:>13.3f}")  # fmt: skip
    lines.append("measured, both modes; equal to the bytes the routing gives (checked on every rank; hybrid combine "
                 "over the group): hybrid mode sends each token at most once per remote node, and its combine one "
                 "partial per (token, remote node) (docs/hybrid.md)")  # fmt: skip
    return "\n".join(lines)


def check_nodes(config: BenchConfig, num_nodes: int) -> int:
    """Ranks per node for `--nodes num_nodes`; raises `ValueError` naming the option where it cannot run."""
    if config.device != "cuda" or not config.virtual_ranks:
        raise ValueError(
            "bench: `--nodes` splits virtual ranks of one GPU into virtual nodes (the emulated NIC counts what "
            f"crosses between them), so it needs a machine with exactly one GPU; this one has "
            f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}"
        )
    if num_nodes < 2 or config.num_ranks % num_nodes:
        raise ValueError(
            f"bench: `--nodes` must be at least 2 and divide `--ranks` ({config.num_ranks}), got {num_nodes}"
        )
    return config.num_ranks // num_nodes


def run_nodes(config: BenchConfig, num_nodes: int, json_path: str | None = None,
              command: str | None = None) -> list[dict]:  # fmt: skip
    """Run every case on `num_nodes` virtual nodes, print the table and write the JSON when asked."""
    from ..backends.kernels.links import NicOptions
    from ..loopback import LoopbackWorld

    num_ranks_per_node = check_nodes(config, num_nodes)
    hardware = (f"{report.hardware_name(config.device, config.num_ranks, True)}, {num_nodes} virtual nodes of "
                f"{num_ranks_per_node}")  # fmt: skip
    print(f"deep-ep bench --nodes: {len(config.cases)} case(s) on {hardware}, seed {config.seed}", file=sys.stderr,
          flush=True)  # fmt: skip
    with LoopbackWorld(config.num_ranks, 0, num_ranks_per_node=num_ranks_per_node, nic=NicOptions(strict=False),
                       timeout_s=1800) as world:  # fmt: skip
        per_rank = world.run(nodes_rank, config, num_ranks_per_node)
    rows = summarize(per_rank)
    print(format_table(rows, hardware, num_nodes))
    print(f"measured: {report.provenance(command, hardware)}")
    if json_path:
        document = dict(commit=report.git_commit(), command=command or " ".join(sys.argv), hardware=hardware,
                        date=report.utc_now(), seed=config.seed, num_nodes=num_nodes,
                        num_ranks_per_node=num_ranks_per_node, rows=rows, per_rank=per_rank)  # fmt: skip
        Path(json_path).write_text(json.dumps(document, indent=2) + "\n")
    return rows
