"""deep_ep.nn on the NVLink kernels (backend='kernels', NCCL, 2 GPUs, H=7168): the checks of test_nn.py.

Run on the GPU machine: `python -m pytest -m gpu tests/test_nn_gpu.py`. The rank workers and the dense
model are in `nn_reference.py`; here they run with BF16 communication at H=7168 on the kernels.
"""

from __future__ import annotations

import os

import pytest
import torch
from nn_reference import fresh_seed, suite_worker

from deep_ep.utils.spawn import spawn_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

MODES = [(False, True, 1), (False, False, 1), (True, True, 1), (True, True, 128), (True, False, 128)]
CONFIGS = [
    dict(grouped=False, expand=False, shared=True, empty_rank=True, **{"async": True}),
    dict(grouped=False, expand=True, alignment=8),
    dict(grouped=True, expand=True, alignment=128, cpu_sync=True),
    dict(grouped=True, expand=True, alignment=128, cpu_sync=False, **{"async": True}),
    dict(grouped=False, expand=False, dtype="bfloat16"),
]
SETUP = dict(backend="kernels", hidden=7168, ffn=64, num_experts=16, num_topk=4, num_max_tokens=128, modes=MODES)


def _seed() -> int:
    return int(os.environ.get("EP_TEST_SEED", fresh_seed()))


def test_nn_kernels_gradcheck_and_micro_batches() -> None:
    seed = _seed()
    results = spawn_ranks(
        suite_worker, 2, backend="nccl", args=(seed, SETUP, ["adjoint", "micro_batches"]), timeout_s=600
    )
    assert results[0] == {"adjoint": len(MODES), "micro_batches": 2}, f"seed {seed}: {results}"
    print(
        f"\nnn kernels: dispatch/combine adjoint identity exact in {len(MODES)} layouts, 2 handles in flight; seed {seed}"
    )


def test_nn_kernels_moe_layer_matches_dense() -> None:
    seed = _seed()
    results = spawn_ranks(suite_worker, 2, backend="nccl", args=(seed, dict(SETUP, configs=CONFIGS), ["moe"]),
                          timeout_s=600)  # fmt: skip
    assert len(results[0]["moe"]) == len(CONFIGS), f"seed {seed}: {results}"
    print(f"\nnn kernels: ExpertParallelMoE = dense MoE in {len(CONFIGS)} configurations; seed {seed}")
