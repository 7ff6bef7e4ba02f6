"""`deep-ep bench --nodes` on CPU: the expected and modelled NIC bytes against a brute-force count of
the routing, the totals per token, and the option's refusals (the measurement itself needs one GPU:
tests/test_bench_gpu.py)."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch

from deep_ep.bench import cases, nodes
from deep_ep.records import CombineSlotLayout
from deep_ep.utils.math import align


def _brute_force(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, per_node: int, rank: int,
                 per_source: list[int], case: cases.BenchCase) -> dict[str, int]:  # fmt: skip
    """The same counts, token by token, from the definitions in deep_ep.bench.nodes's docstring."""
    local_experts = num_experts // num_ranks
    record, slot = nodes.record_bytes(case), CombineSlotLayout(case.hidden, case.num_topk).num_bytes
    remote_ranks = remote_nodes = 0
    for row in topk_idx.tolist():
        ranks = {e // local_experts for e in row if e >= 0}
        remote_ranks += sum(1 for d in ranks if d // per_node != rank // per_node)
        remote_nodes += len({d // per_node for d in ranks} - {rank // per_node})
    num_remote_ranks = num_ranks - per_node
    remote_received = sum(n for s, n in enumerate(per_source) if s // per_node != rank // per_node)
    return dict(
        direct_dispatch_bytes=remote_ranks * record + num_remote_ranks * align(4 * local_experts, 16),
        direct_combine_bytes=remote_received * slot,
        hybrid_dispatch_bytes=remote_nodes * (record + align(4 * per_node, 16))
        + num_remote_ranks * align(4 * local_experts, 16),
        hybrid_combine_bytes=remote_nodes * slot,
        remote_rank_hits=remote_ranks,
        remote_node_hits=remote_nodes,
        num_tokens=topk_idx.shape[0],
    )


@pytest.mark.parametrize("num_nodes,per_node", [(2, 4), (4, 2), (4, 4), (8, 1)])
def test_the_expected_and_modelled_bytes_match_a_brute_force_count(num_nodes: int, per_node: int) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    num_ranks, num_experts, num_topk = num_nodes * per_node, 64, 6
    for fp8 in (True, False):
        case = cases.BenchCase(rng.choice([1, 17, 96]), 2048, num_topk, num_experts, fp8)
        rank = rng.randrange(num_ranks)
        gen = torch.Generator().manual_seed(seed)
        topk_idx = torch.stack([torch.randperm(num_experts, generator=gen)[:num_topk] for _ in range(case.num_tokens)])
        topk_idx[torch.rand(topk_idx.shape, generator=gen) < 0.2] = -1
        per_source = [rng.randrange(0, 50) for _ in range(num_ranks)]
        got = nodes.modelled_bytes(topk_idx, num_experts, num_ranks, per_node, rank, per_source, case)
        assert got == _brute_force(topk_idx, num_experts, num_ranks, per_node, rank, per_source, case), seed
        # Hybrid never sends more records over the NIC than direct mode: a node holds a rank of the token
        assert got["remote_node_hits"] <= got["remote_rank_hits"], seed


def test_totals_are_summed_over_ranks_and_divided_by_the_group_s_tokens() -> None:
    row = dict(case=dict(num_tokens=4, dtype="fp8", routing="uniform"), **{name: 2 for name in nodes.TRAFFIC_FIELDS},
               **{name: 8 for name in nodes.MODEL_FIELDS})  # fmt: skip
    (summary,) = nodes.summarize([[dict(row, rank=0)], [dict(row, rank=1, dispatch_bytes=6)]])
    assert summary["dispatch_bytes"] == 8 and summary["num_tokens"] == 16
    assert summary["per_token"]["dispatch_bytes"] == 0.5 and summary["per_token"]["hybrid_combine_bytes"] == 1.0
    assert "num_tokens" not in summary["per_token"]
    table = nodes.format_table([summary], "2 virtual ranks", 2).splitlines()
    # The data line: T, dtype, routing, then hybrid over direct in dispatch (4 / 8 bytes) and combine (2 / 2)
    assert table[2].split()[:3] == ["4", "fp8", "uniform"] and "|    0.500    1.000 |" in table[2], table
    assert "at most once per remote node" in table[-1]


def test_the_node_count_must_divide_the_virtual_ranks_of_one_gpu() -> None:
    config = cases.BenchConfig([], 8, "cuda", virtual_ranks=True)
    assert nodes.check_nodes(config, 2) == 4 and nodes.check_nodes(config, 8) == 1
    for bad in (1, 3, 0):
        with pytest.raises(ValueError, match="`--nodes` must be at least 2 and divide `--ranks` \\(8\\)"):
            nodes.check_nodes(config, bad)
    for device, virtual in (("cpu", True), ("cuda", False)):
        with pytest.raises(ValueError, match="exactly one GPU"):
            nodes.check_nodes(cases.BenchConfig([], 8, device, virtual_ranks=virtual), 2)


def test_the_kernels_it_compiles_are_the_eager_nic_s_in_both_modes() -> None:
    config = cases.BenchConfig(cases.make_cases([128], None, ["fp8", "bf16"], ["uniform"], 7168, 8, 256), 4, "cuda",
                               virtual_ranks=True)  # fmt: skip
    specs = nodes.kernel_specs(config)
    direct = "deep_ep::transport::Emulated<false>"
    hybrid = f"deep_ep::transport::Hybrid<{direct}>"
    assert specs and {s.template_args[-1] for s in specs} == {direct, hybrid}, specs
    assert {s.name for s in specs} >= {"deep_ep::dispatch_impl", "deep_ep::combine_impl", "deep_ep::post_fault_impl"}
    # Hybrid mode's dispatches (fresh and cached, per dtype), its forwarding combine and node-stage epilogue
    assert sum(s.template_args[-1] == hybrid for s in specs) == 6, specs


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without a GPU")
def test_the_command_refuses_without_a_gpu_and_beside_host_options(tmp_path) -> None:
    def bench(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "deep_ep.cli", "bench", *args], capture_output=True, text=True,
                              timeout=300, cwd=tmp_path)  # fmt: skip

    result = bench("--nodes", "2")
    assert result.returncode != 0 and "needs a machine with exactly one GPU; this one has 0" in result.stderr
    result = bench("--nodes", "2", "--host", "--sms", "8")
    assert result.returncode != 0 and "drop --host, --sms" in result.stderr
