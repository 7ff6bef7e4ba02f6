"""deep_ep.backends.kernels.transport: which peer windows a group would use, and why (no GPU needed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from deep_ep.backends.kernels import transport
from deep_ep.backends.kernels.backend import NvlinkBackend
from deep_ep.backends.kernels.layout import MAX_RANKS
from deep_ep.backends.kernels.links import NicOptions
from deep_ep.backends.kernels.transport import TransportChoice, choose_transport


class _VirtualGroup:
    """What `choose_transport` reads of a `deep_ep.loopback.LoopbackGroup`: its size and its world."""

    def __init__(self, num_ranks: int, device: str, num_ranks_per_node: int | None = None, nic: str = "strict") -> None:
        self.num_ranks = num_ranks
        self.loopback_world = SimpleNamespace(device=torch.device(device), nic=NicOptions(strict=nic == "strict"),
                                              num_ranks_per_node=num_ranks_per_node or num_ranks)  # fmt: skip

    def size(self) -> int:
        return self.num_ranks


def test_virtual_ranks_of_a_cuda_world_use_loopback() -> None:
    choice = choose_transport(_VirtualGroup(4, "cuda:0"))  # type: ignore[arg-type]
    assert choice == TransportChoice("loopback", "4 virtual ranks of cuda:0") and choice.supported
    assert NvlinkBackend.is_supported(_VirtualGroup(4, "cuda:0"))  # type: ignore[arg-type]


@pytest.mark.parametrize(("num_ranks", "device", "reason"), [(4, "cpu", "need a CUDA device"),
                                                             (MAX_RANKS + 1, "cuda:0", f"at most {MAX_RANKS}")])  # fmt: skip
def test_virtual_ranks_the_kernels_cannot_serve(num_ranks: int, device: str, reason: str) -> None:
    choice = choose_transport(_VirtualGroup(num_ranks, device))  # type: ignore[arg-type]
    assert choice.name is None and not choice.supported and reason in choice.reason


@pytest.mark.parametrize("nic", ["strict", "eager"])
def test_virtual_nodes_reach_each_other_through_the_emulated_nic(nic: str) -> None:
    choice = choose_transport(_VirtualGroup(8, "cuda:0", num_ranks_per_node=4, nic=nic))  # type: ignore[arg-type]
    assert choice == TransportChoice("loopback", "8 virtual ranks of cuda:0 in 2 virtual nodes of 4; across nodes "
                                                 f"through the emulated NIC (emulated-{nic})")  # fmt: skip


class _ProcessGroup:
    """What `choose_transport` reads of a process group of real ranks: its size (and, through
    `torch.distributed.get_backend`, patched here, its backend)."""

    def __init__(self, num_ranks: int) -> None:
        self.num_ranks = num_ranks

    def size(self) -> int:
        return self.num_ranks


@pytest.mark.parametrize(
    ("cuda", "backend", "num_devices", "peer_access", "name", "reason"),
    [
        (False, "nccl", 0, True, None, "CUDA is not available"),
        (True, "gloo", 2, True, None, "the group's backend is 'gloo', not NCCL"),
        (
            True,
            "nccl",
            1,
            True,
            "nccl_gin",
            "2 ranks, more than this host's 1 GPUs, so the group spans hosts: the kernels reach the other hosts' "
            "ranks through NCCL GIN in direct mode (NCCL 2.32.3); the GIN backend is read from "
            "ncclCommQueryProperties when a buffer is created. GIN has never run on a NIC in this project's tests, "
            "so backend='auto' takes the reference backend: pass backend='kernels' to use it",
        ),
        (True, "nccl", 2, False, None, "GPU 0 cannot reach GPU 1's memory (no peer access)"),
        (True, "nccl", 2, True, "nccl_lsa", "2 NCCL ranks on this host's 2 GPUs, all peers reachable"),
    ],
)
def test_real_ranks_use_nccl_lsa_inside_one_nvlink_domain(
    monkeypatch: pytest.MonkeyPatch, cuda: bool, backend: str, num_devices: int, peer_access: bool,
    name: str | None, reason: str,
) -> None:  # fmt: skip
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: num_devices)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: peer_access)
    monkeypatch.setattr(dist, "get_backend", lambda group: backend)
    monkeypatch.setattr(transport, "loaded_nccl_version", lambda: 23203)
    group = _ProcessGroup(2)
    auto = name != "nccl_gin"  # GIN across hosts only when the kernels are asked for by name
    assert choose_transport(group) == TransportChoice(name, reason, auto)  # type: ignore[arg-type]
    assert NvlinkBackend.is_supported(group) is (name is not None and auto)  # type: ignore[arg-type]
    assert NvlinkBackend.is_supported_by_name(group) is (name is not None)  # type: ignore[arg-type]


@pytest.mark.parametrize(("num_devices", "peer_access", "expected"), [
    (4, True, "an NCCL group of all 4 GPUs: nccl_lsa (4 NCCL ranks on this host's 4 GPUs, all peers reachable)"),
    (4, False, "an NCCL group of all 4 GPUs: the reference backend (GPU 0 cannot reach GPU 1's memory (no peer access))"),
    (1, True, "an NCCL group of the one GPU: nccl_lsa (1 NCCL rank on this host's 1 GPU, no peers to reach)"),
])  # fmt: skip
def test_info_says_which_transport_this_host_would_use(monkeypatch: pytest.MonkeyPatch, num_devices: int,
                                                       peer_access: bool, expected: str) -> None:  # fmt: skip
    from deep_ep.cli import _transport_line

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: num_devices)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: peer_access)
    line = _transport_line()
    assert line.startswith(expected + "; virtual ranks on one GPU (deep_ep.loopback): loopback"), line


@pytest.mark.parametrize(("version", "expected", "absent"), [
    (22809, ["needs NCCL >= 2.30.4", "loaded NCCL 2.28.9", "pip install -U nvidia-nccl-cu12", "nvidia-nccl-cu13",
             "backend='reference'"], "GIN direct mode"),
    (23003, ["needs NCCL >= 2.30.4", "loaded NCCL 2.30.3"], "GIN direct mode"),
    (None, ["no NCCL library could be loaded"], "GIN"),
])  # fmt: skip
def test_a_group_across_hosts_is_told_which_nccl_it_needs(version: int | None, expected: list[str],
                                                          absent: str) -> None:  # fmt: skip
    choice = transport.scale_out_choice(16, 8, version)
    assert choice.name is None and not choice.supported
    assert choice.reason.startswith("16 ranks, more than this host's 8 GPUs, so the group spans")
    for text in expected:
        assert text in choice.reason, choice.reason
    assert absent not in choice.reason, choice.reason


@pytest.mark.parametrize(("version", "text"), [(23004, "2.30.4"), (23102, "2.31.2"), (23203, "2.32.3")])
def test_a_group_across_hosts_gets_gin_from_nccl_2_30_4_but_not_by_auto(version: int, text: str) -> None:
    choice = transport.scale_out_choice(16, 8, version)
    assert choice.name == "nccl_gin" and choice.supported and not choice.auto
    assert choice.reason == (
        "16 ranks, more than this host's 8 GPUs, so the group spans hosts: the kernels reach the other hosts' ranks "
        f"through NCCL GIN in direct mode (NCCL {text}); the GIN backend is read from ncclCommQueryProperties when "
        "a buffer is created. GIN has never run on a NIC in this project's tests, so backend='auto' takes the "
        "reference backend: pass backend='kernels' to use it"
    )


@pytest.fixture
def hosts_of_8_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(dist, "get_backend", lambda group: "nccl")


def test_auto_takes_the_reference_for_a_group_across_hosts_and_kernels_must_be_asked_for(
    monkeypatch: pytest.MonkeyPatch, hosts_of_8_gpus: None
) -> None:
    from deep_ep.backends.reference.backend import ReferenceBackend
    from deep_ep.buffer import select_backend_class

    monkeypatch.setattr(transport, "loaded_nccl_version", lambda: 23203)
    group = _ProcessGroup(16)
    assert select_backend_class(group, "auto", agree=False) is ReferenceBackend  # type: ignore[arg-type]
    assert select_backend_class(group, "kernels") is NvlinkBackend  # type: ignore[arg-type]
    assert not NvlinkBackend.is_supported(group)  # type: ignore[arg-type]
    reason = NvlinkBackend.unsupported_reason(group)  # type: ignore[arg-type]
    assert reason is not None and reason.startswith("backend='auto' does not take the kernels here (16 ranks")


def test_asking_for_the_kernels_on_a_group_they_cannot_serve_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    from deep_ep.buffer import select_backend_class

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(dist, "get_backend", lambda group: "nccl")
    monkeypatch.setattr(transport, "loaded_nccl_version", lambda: 22809)
    with pytest.raises(
        ValueError, match=r"`backend`='kernels' does not support this group \(16 ranks, .*NCCL >= 2\.30\.4"
    ):
        select_backend_class(_ProcessGroup(16), "kernels")  # type: ignore[arg-type]


@pytest.mark.parametrize(("version", "expected"), [
    (22809, "the reference backend: a group across hosts needs NCCL >= 2.30.4"),
    (23203, "the reference backend with backend='auto'; with backend='kernels', nccl_gin (direct mode over NCCL "
            "2.32.3's GIN, >= 2.30.4; never run on a NIC here"),
    (None, "the reference backend: no NCCL library could be loaded"),
])  # fmt: skip
def test_info_says_what_a_group_across_hosts_would_get(monkeypatch: pytest.MonkeyPatch, version: int | None,
                                                       expected: str) -> None:  # fmt: skip
    from deep_ep.cli import _scale_out_line

    monkeypatch.setattr(transport, "loaded_nccl_version", lambda: version)
    assert _scale_out_line().startswith(expected), _scale_out_line()
