"""NCCL GIN on the host, on a CPU: the `Gin::Args` bytes against the compiled struct, `GinLinks`'s QPs
and kind, the GIN windows' checks and their order, and the transport a group across hosts opens.
Nothing here talks to NCCL or a NIC (no machine of this project has one): the NCCL pieces are stand-ins
that record what they were asked."""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from deep_ep.jit import compiler
from deep_ep.jit.nccl_headers import find_nccl

from deep_ep.backends.kernels import specs, transport
from deep_ep.backends.kernels.links import LsaLinks
from deep_ep.backends.kernels.nccl import device_comm, gin_windows, library, peer_windows, window
from deep_ep.backends.kernels.nccl.gin import GinProperties
from deep_ep.backends.kernels.nccl.gin_links import GinLinks, gin_args_layout, gin_transport_kind, pack_gin_args
from deep_ep.paths import get_include_dir

PROXY = GinProperties(device_api=True, gin_type="proxy", num_lsa_teams=2, supported=("proxy",))
HANDLE = 0x7F00_DEAD_BEEF_0000
# The largest `ncclDevComm` the layout probe covers (248 bytes in 2.32.3)
PROBE_MAX_DEV_COMM_BYTES = 1024


# ------------------------------------------------------------------ Gin::Args layout


@pytest.mark.parametrize(("dev_comm_bytes", "expected"), [
    (200, (0, 200, 208, 212, 216)),  # 2.28.9
    (240, (0, 240, 248, 252, 256)),  # 2.30.4
    (248, (0, 248, 256, 260, 264)),  # 2.31.2, 2.32.3
    (244, (0, 248, 256, 260, 264)),  # not a multiple of 8: the window still lands on one
])  # fmt: skip
def test_the_layout_follows_the_size_of_the_device_communicator(dev_comm_bytes: int, expected: tuple) -> None:
    layout = gin_args_layout(dev_comm_bytes)
    assert (layout.comm, layout.window, layout.context, layout.num_contexts, layout.size) == expected


@pytest.mark.parametrize("bad", [0, -8, 248.0, True, "248"])
def test_the_layout_refuses_a_size_that_is_not_one(bad: object) -> None:
    with pytest.raises(ValueError, match="`dev_comm_bytes` must be an int > 0"):
        gin_args_layout(bad)  # type: ignore[arg-type]


def layout_probe_source() -> str:
    """C++ that `static_assert`s `gin_args_layout` (Python) against the compiled `Gin::Args`, whatever
    `sizeof(ncclDevComm)` the headers give: a table of the Python answers for every size up to
    `PROBE_MAX_DEV_COMM_BYTES`, indexed by the real size."""
    rows = []
    for size in range(PROBE_MAX_DEV_COMM_BYTES + 1):
        layout = gin_args_layout(size) if size else gin_args_layout(8)  # row 0 is never read
        rows.append(f"{{{layout.window}, {layout.context}, {layout.num_contexts}, {layout.size}}}")
    table = ",\n    ".join(rows)
    return f"""#include <cstddef>
#include <deep_ep/transport/gin.cuh>

// gin_links.gin_args_layout(n) for n = 0 .. {PROBE_MAX_DEV_COMM_BYTES}: window, context, num_contexts, size
constexpr size_t kPython[][4] = {{
    {table}
}};
using Args = deep_ep::transport::Gin::Args;
constexpr size_t kRow = sizeof(ncclDevComm);
static_assert(kRow <= {PROBE_MAX_DEV_COMM_BYTES}, "ncclDevComm outgrew the probe's table");
static_assert(offsetof(Args, comm) == 0, "comm");
static_assert(offsetof(Args, window) == kPython[kRow][0], "window");
static_assert(offsetof(Args, context) == kPython[kRow][1], "context");
static_assert(offsetof(Args, num_contexts) == kPython[kRow][2], "num_contexts");
static_assert(sizeof(Args) == kPython[kRow][3], "size");
"""


def compile_layout_probe(folder: Path, backend: str = "PROXY") -> None:
    """Compile `layout_probe_source()` against the NCCL headers `find_nccl()` gives (the installed
    wheel's, or `EP_JIT_NCCL_ROOT`'s) with only `backend` of GIN on; a layout the host would pack
    differently from the struct fails the compile."""
    source = folder / "gin_layout_probe.cu"
    source.write_text(layout_probe_source())
    flags = (*specs._with_transport(specs.transport_ping_spec("lsa"), f"gin-{backend.lower()}").extra_flags,)
    command = [
        str(compiler.find_nvcc()),
        *compiler.include_flags([get_include_dir()], find_nccl().include_dir),
        *compiler.base_flags(compiler.resolve_arch("sm_90a")),
        *flags,
        "-o", str(folder / "gin_layout_probe.cubin"), str(source),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"the host's Gin::Args layout is not the struct's:\n{result.stderr[-4000:]}"


@pytest.mark.nvcc
@pytest.mark.skipif(find_nccl().header_version < 23004, reason="the NCCL headers here are older than 2.30.4 (no GIN)")
def test_the_host_layout_is_the_compiled_struct(tmp_path: Path) -> None:
    compile_layout_probe(tmp_path)


@pytest.fixture
def shim(jit_cache):
    device_comm._shim.cache_clear()  # built into this test's cache
    yield device_comm._shim()
    device_comm._shim.cache_clear()


@pytest.mark.nvcc
def test_gin_args_pack_the_real_device_communicator_size_at_the_layout_offsets(shim) -> None:
    dev_comm_bytes = int(shim.ep_dev_comm_bytes())  # sizeof(ncclDevComm) of the installed headers
    raw = bytes((7 * i + 3) & 0xFF for i in range(dev_comm_bytes))
    packed = pack_gin_args(raw, HANDLE, 2, 9)
    layout = gin_args_layout(dev_comm_bytes)
    assert len(packed) == layout.size and layout.size % 8 == 0
    assert packed[: len(raw)] == raw
    assert packed[len(raw) : layout.window] == bytes(layout.window - len(raw))  # padding stays zero
    assert struct.unpack_from("<Q", packed, layout.window) == (HANDLE,)
    assert struct.unpack_from("<ii", packed, layout.context) == (2, 9)
    assert layout.num_contexts == layout.context + 4


# ------------------------------------------------------------------ GinLinks


def _gin_windows(properties: GinProperties = PROXY, num_qps: int = 17, dev_comm_bytes: int = 248) -> SimpleNamespace:
    """What `GinLinks.attach` reads of `GinPeerWindows`."""
    raw = bytes(i & 0xFF for i in range(dev_comm_bytes))
    return SimpleNamespace(properties=properties, dev_comm=SimpleNamespace(raw=raw),
                           window=SimpleNamespace(handle=HANDLE), num_qps=num_qps)  # fmt: skip


def _contexts(args: bytes, dev_comm_bytes: int = 248) -> tuple[int, int]:
    layout = gin_args_layout(dev_comm_bytes)
    assert len(args) == layout.size
    assert struct.unpack_from("<Q", args, layout.window) == (HANDLE,)
    return struct.unpack_from("<ii", args, layout.context)


@pytest.mark.parametrize(("num_qps", "expected"), [(0, 17), (1, 1), (5, 5), (17, 17), (18, 17), (129, 17), (-3, 17)])
def test_a_call_uses_its_qps_up_to_the_allocated_ones(num_qps: int, expected: int) -> None:
    links = GinLinks()
    links.attach(_gin_windows(num_qps=17))  # type: ignore[arg-type]
    for kernel_class in ("comm", "epilogue", "fault"):
        assert _contexts(links.args(kernel_class, num_qps)) == (0, expected)
    assert links.args("comm") == links.args("epilogue", 0)  # 0: every allocated QP
    assert links.nic_ctas == 0 and links.num_contexts == 17


def test_the_bytes_are_packed_once_per_qp_count() -> None:
    links = GinLinks()
    links.attach(_gin_windows())  # type: ignore[arg-type]
    assert links.args("comm", 5) is links.args("epilogue", 5)
    assert links.args("comm", 0) is links.args("comm", 17) is links.args("fault", 99)
    assert links.args("comm", 4) is not links.args("comm", 5)


@pytest.mark.parametrize("gin_type", ["proxy", "gdaki", "gpi", "efa_gda"])
def test_the_kind_is_the_backend_nccl_reports(gin_type: str) -> None:
    links = GinLinks()
    with pytest.raises(RuntimeError, match="known once the windows are attached"):
        _ = links.kind
    with pytest.raises(RuntimeError, match="attach the windows first"):
        links.args("comm")
    links.attach(_gin_windows(GinProperties(True, gin_type, 2, None)))  # type: ignore[arg-type]
    assert links.kind == f"gin-{gin_type}" and links.kind in specs.TRANSPORTS


@pytest.mark.parametrize(("properties", "message"), [
    (GinProperties(True, "none", 2, None), "no GIN backend here"),
    (GinProperties(False, "proxy", 2, None), "device API is not available"),
    (GinProperties(True, "type 9", 2, None), r"GIN type 'type 9'; the kernels are built for \('proxy', 'gdaki'"),
])  # fmt: skip
def test_a_gin_type_the_kernels_are_not_built_for_is_refused(properties: GinProperties, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        gin_transport_kind(properties)
    with pytest.raises(ValueError, match=message):
        GinLinks().attach(_gin_windows(properties))  # type: ignore[arg-type]


def test_gin_links_need_gin_windows() -> None:
    lsa_windows = SimpleNamespace(rank=0, num_ranks=2, ptr=1, num_bytes=4096, bytes=None, peer_ptrs=[1, 2])
    with pytest.raises(TypeError, match="needs GIN windows"):
        GinLinks().attach(lsa_windows)  # type: ignore[arg-type]


# ------------------------------------------------------------------ GIN windows


class _Recorder:
    """The NCCL pieces `GinPeerWindows` makes, as stand-ins that log each step into `log`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, properties: GinProperties = PROXY, version: int = 23203,
                 lsa: tuple[int, int] = (1, 8)) -> None:  # fmt: skip
        self.log: list[tuple] = []
        log = self.log

        class Comm:
            def __init__(self, group: object, force_own: bool = False) -> None:
                log.append(("comm", force_own))
                self.is_own, self.handle = force_own, 0x1000
                self.lib = SimpleNamespace(version=lambda: version)

            def destroy(self) -> None:
                log.append(("destroy comm",))

        class DevComm:
            def __init__(self, comm: Comm, lsa_barrier_count: int = 1, gin_contexts: int = 0,
                         gin_mode: str = "direct") -> None:  # fmt: skip
                log.append(("dev_comm", comm.is_own, gin_contexts, gin_mode))
                self.lsa_rank, self.lsa_size = lsa
                self.raw = bytes(248)

            def destroy(self) -> None:
                log.append(("destroy dev_comm",))

        class Window:
            def __init__(self, comm: Comm, num_bytes: int, flags: int = library.NCCL_WIN_COLL_SYMMETRIC) -> None:
                log.append(("window", num_bytes, flags))
                self.ptr, self.num_bytes, self.bytes, self.handle = 0xA000, num_bytes, None, HANDLE

            def destroy(self) -> None:
                log.append(("destroy window",))

        def query(comm: Comm) -> GinProperties:
            log.append(("query",))
            return properties

        def agree(group: object, reason: str | None) -> None:  # one rank's view of the exchange
            log.append(("agree", reason is None))
            if reason is not None:
                raise ValueError(reason)

        monkeypatch.setattr(gin_windows, "Communicator", Comm)
        monkeypatch.setattr(gin_windows, "DeviceCommunicator", DevComm)
        monkeypatch.setattr(gin_windows, "SymmetricWindow", Window)
        monkeypatch.setattr(gin_windows, "query_gin", query)
        monkeypatch.setattr(gin_windows, "agree", agree)
        monkeypatch.setattr(gin_windows.GinPeerWindows, "_lsa_pointers", lambda self: [0xB000 + i for i in range(8)])

    def steps(self) -> list[str]:
        return [entry[0] for entry in self.log]


class _Group:
    def __init__(self, rank: int, num_ranks: int) -> None:
        self._rank, self._num_ranks = rank, num_ranks

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._num_ranks


def test_gin_windows_query_nccl_before_asking_for_gin_on_a_communicator_of_their_own(monkeypatch) -> None:
    recorder = _Recorder(monkeypatch, lsa=(1, 8))
    windows = gin_windows.GinPeerWindows(_Group(9, 16), 1 << 20, num_ranks_per_node=8, num_qps=17)  # type: ignore[arg-type]
    assert recorder.steps() == ["comm", "agree", "query", "agree", "dev_comm", "agree", "window"]
    assert ("comm", True) in recorder.log  # never torch's communicator
    assert ("dev_comm", True, 17, "direct") in recorder.log  # one GIN context per QP, direct mode
    assert ("window", 1 << 20, library.NCCL_WIN_COLL_SYMMETRIC | library.NCCL_WIN_STRICT_ORDERING) in recorder.log
    assert windows.properties == PROXY and windows.num_qps == 17 and windows.window.handle == HANDLE
    # Node 1 (ranks 8-15) by its LSA pointers, node 0 through GIN only
    assert windows.peer_ptrs == [0] * 8 + [0xB000 + i for i in range(8)]
    links = GinLinks()
    links.attach(windows)  # type: ignore[arg-type]
    assert links.kind == "gin-proxy" and _contexts(links.args("comm", 4)) == (0, 4)
    windows.destroy()
    assert recorder.steps()[-3:] == ["destroy dev_comm", "destroy window", "destroy comm"]


@pytest.mark.parametrize(("properties", "message"), [
    (GinProperties(True, "none", 2, None), "NCCL cannot carry this group across nodes: NCCL GIN is not usable: NCCL "
                                           r"has no GIN backend here \(no RDMA NIC"),
    (GinProperties(False, "gdaki", 2, ("gdaki",)), "device API is not available"),
])  # fmt: skip
def test_gin_windows_refuse_with_nccls_reason_and_destroy_their_communicator(monkeypatch, properties, message) -> None:
    recorder = _Recorder(monkeypatch, properties=properties)
    with pytest.raises(ValueError, match=message):
        gin_windows.GinPeerWindows(_Group(0, 16), 1 << 20, num_ranks_per_node=8, num_qps=17)  # type: ignore[arg-type]
    assert recorder.steps() == ["comm", "agree", "query", "agree", "destroy comm"]  # no GIN request was made


def test_gin_windows_refuse_an_nccl_older_than_2_30_4_before_the_query(monkeypatch) -> None:
    recorder = _Recorder(monkeypatch, version=22809)
    with pytest.raises(ValueError, match=r"needs NCCL >= 2\.30\.4.*loaded NCCL 2\.28\.9"):
        gin_windows.GinPeerWindows(_Group(0, 16), 1 << 20, num_ranks_per_node=8, num_qps=17)  # type: ignore[arg-type]
    assert recorder.steps() == ["comm", "agree", "destroy comm"]


@pytest.mark.parametrize(("rank", "lsa"), [(9, (1, 16)), (9, (0, 8)), (3, (3, 4))])
def test_gin_windows_refuse_an_lsa_team_that_is_not_the_node(monkeypatch, rank: int, lsa: tuple[int, int]) -> None:
    recorder = _Recorder(monkeypatch, lsa=lsa)
    with pytest.raises(ValueError, match=f"NCCL's LSA team of rank {rank} is not its node"):
        gin_windows.GinPeerWindows(_Group(rank, 16), 1 << 20, num_ranks_per_node=8, num_qps=17)  # type: ignore[arg-type]
    assert recorder.steps()[-4:] == ["dev_comm", "agree", "destroy dev_comm", "destroy comm"]  # no window


@pytest.mark.parametrize("bad", [0, -1, True, 17.0])
def test_gin_windows_need_at_least_one_qp(monkeypatch, bad: object) -> None:
    recorder = _Recorder(monkeypatch)
    with pytest.raises(ValueError, match="`num_qps` must be an int >= 1"):
        gin_windows.GinPeerWindows(_Group(0, 16), 1 << 20, num_ranks_per_node=8, num_qps=bad)  # type: ignore[arg-type]
    assert recorder.log == []


def test_lsa_team_and_peer_pointers_of_a_node() -> None:
    assert gin_windows.lsa_team_error(13, 16, 8, 5, 8) is None
    assert "do not split into nodes of 6" in gin_windows.lsa_team_error(0, 16, 6, 0, 6)
    assert "expected (5, 8)" in gin_windows.lsa_team_error(13, 16, 8, 13, 16)
    assert gin_windows.node_peer_pointers(5, 12, [10, 11, 12, 13]) == [0, 0, 0, 0, 10, 11, 12, 13, 0, 0, 0, 0]


def test_every_rank_raises_the_first_failing_ranks_reason(group) -> None:
    gin_windows.agree(group, None)  # a gloo group of one rank: the exchange itself
    with pytest.raises(ValueError, match=r"^GIN windows: no$"):
        gin_windows.agree(group, "GIN windows: no")


# ------------------------------------------------------------------ window flags


class _FakeLibrary:
    def __init__(self, version: int) -> None:
        self._version = version
        self.calls: list[tuple] = []

    def version(self) -> int:
        return self._version

    def call(self, name: str, *args: object, comm: int | None = None) -> None:
        self.calls.append((name, *args))
        if name == "ncclMemAlloc":
            args[0]._obj.value = 0x10000  # type: ignore[attr-defined]
        if name == "ncclCommWindowRegister":
            args[3]._obj.value = HANDLE  # type: ignore[attr-defined]


@pytest.fixture
def symmetric_window_on_cpu(monkeypatch: pytest.MonkeyPatch):
    """`SymmetricWindow` with its NCCL library, collective and device memory made of stand-ins."""
    monkeypatch.setattr(window.dist, "all_gather_object", lambda out, value, group=None: out.__setitem__(0, value))
    monkeypatch.setattr(window, "_device_bytes", lambda ptr, num_bytes: torch.zeros(num_bytes, dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)

    def make(version: int, flags: int | None) -> tuple[window.SymmetricWindow, _FakeLibrary]:
        lib = _FakeLibrary(version)
        comm = SimpleNamespace(num_ranks=1, group=None, lib=lib, handle=0x1000)
        extra = {} if flags is None else {"flags": flags}
        return window.SymmetricWindow(comm, 5000, **extra), lib  # type: ignore[arg-type]

    return make


def _registered_flags(lib: _FakeLibrary) -> int:
    (register,) = [call for call in lib.calls if call[0] == "ncclCommWindowRegister"]
    return register[-1]


@pytest.mark.parametrize("version", [22809, 23004, 23203])
def test_a_window_is_symmetric_only_by_default(symmetric_window_on_cpu, version: int) -> None:
    win, lib = symmetric_window_on_cpu(version, None)
    assert _registered_flags(lib) == library.NCCL_WIN_COLL_SYMMETRIC and win.num_bytes == 8192
    assert win.handle == HANDLE


@pytest.mark.parametrize("version", [23004, 23102, 23203])
def test_a_gin_window_asks_for_strict_ordering_from_2_30_4(symmetric_window_on_cpu, version: int) -> None:
    _, lib = symmetric_window_on_cpu(version, gin_windows.GIN_WINDOW_FLAGS)
    assert _registered_flags(lib) == library.NCCL_WIN_COLL_SYMMETRIC | library.NCCL_WIN_STRICT_ORDERING == 0x03


@pytest.mark.parametrize("version", [22809, 23003])
def test_strict_ordering_never_reaches_an_older_nccl(symmetric_window_on_cpu, version: int) -> None:
    with pytest.raises(ValueError, match=r"NCCL_WIN_STRICT_ORDERING needs NCCL >= 2\.30\.4"):
        symmetric_window_on_cpu(version, gin_windows.GIN_WINDOW_FLAGS)
    with pytest.raises(ValueError, match="bits outside 0x3"):
        window.check_window_flags(0x04, 23203)


def test_one_nodes_windows_never_ask_for_strict_ordering(monkeypatch: pytest.MonkeyPatch) -> None:
    flags_seen = []

    class Window:
        def __init__(self, comm: object, num_bytes: int, flags: int = library.NCCL_WIN_COLL_SYMMETRIC) -> None:
            flags_seen.append(flags)
            self.ptr, self.num_bytes, self.bytes, self.handle = 0xA000, num_bytes, None, HANDLE

    comm = SimpleNamespace(is_own=True, handle=0x1000, destroy=lambda: None)
    monkeypatch.setattr(peer_windows, "Communicator", lambda group, force_own=False: comm)
    monkeypatch.setattr(peer_windows, "DeviceCommunicator", lambda c: SimpleNamespace(lsa_rank=0, lsa_size=2))
    monkeypatch.setattr(peer_windows, "SymmetricWindow", Window)
    monkeypatch.setattr(peer_windows.NcclPeerWindows, "_lsa_pointers", lambda self: [0xA000, 0xB000])
    peer_windows.NcclPeerWindows(_Group(0, 2), 4096)  # type: ignore[arg-type]
    assert flags_seen == [library.NCCL_WIN_COLL_SYMMETRIC]


# ------------------------------------------------------------------ the transport of a group across hosts


@pytest.fixture
def hosts_of_8_gpus(monkeypatch: pytest.MonkeyPatch):
    """An NCCL group on hosts of 8 GPUs each, NCCL 2.32.3 loaded; no collective runs."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)
    monkeypatch.setattr(dist, "get_backend", lambda group: "nccl")
    monkeypatch.setattr(transport, "loaded_nccl_version", lambda: 23203)
    monkeypatch.setattr(transport.DeviceShare, "whole_device", classmethod(lambda cls: cls(132)))
    monkeypatch.setattr(transport, "_all_ranks_agree", lambda group, fine: fine)
    opened = []
    monkeypatch.setattr(transport, "GinPeerWindows", lambda *args: opened.append(args) or SimpleNamespace())
    return opened


def test_a_group_across_hosts_opens_gin_windows_with_the_buffers_qps(monkeypatch, hosts_of_8_gpus) -> None:
    monkeypatch.setattr(transport, "get_physical_domain_size", lambda group: (2, 8))
    group = _Group(3, 16)
    opened = transport.open_transport(group, num_allocated_qps=33)  # type: ignore[arg-type]
    assert (opened.name, opened.num_ranks, opened.num_scaleup_ranks, opened.share.num_sms) == ("nccl_gin", 16, 8, 132)
    assert opened.has_remote_peers
    opened.open_windows(1 << 20)
    assert hosts_of_8_gpus == [(group, 1 << 20, 8, 33)]
    assert isinstance(opened.make_links(10**9), GinLinks)
    # 0 QPs: DeepEP V2's default for direct mode
    transport.open_transport(group).open_windows(4096)  # type: ignore[arg-type]
    assert hosts_of_8_gpus[-1] == (group, 4096, 8, 17)


def test_a_group_of_one_host_keeps_its_lsa_windows(monkeypatch, hosts_of_8_gpus) -> None:
    monkeypatch.setattr(transport, "get_physical_domain_size", lambda group: (1, 8))
    opened = transport.open_transport(_Group(3, 8), num_allocated_qps=33)  # type: ignore[arg-type]
    assert (opened.name, opened.num_scaleup_ranks) == ("nccl_lsa", 8) and not opened.has_remote_peers
    assert isinstance(opened.make_links(10**9), LsaLinks)


def test_a_small_group_across_hosts_is_refused_not_run_over_gin(monkeypatch, hosts_of_8_gpus) -> None:
    """2 ranks on 2 hosts of 8 GPUs: `choose_transport` (local) said nccl_lsa, which 'auto' may take,
    so GIN, which only `backend='kernels'` takes, is not opened behind its back."""
    monkeypatch.setattr(transport, "get_physical_domain_size", lambda group: (2, 1))
    with pytest.raises(ValueError, match=r"spans 2 hosts of 1 ranks.*not every rank's answer \(here: nccl_lsa"):
        transport.open_transport(_Group(0, 2))  # type: ignore[arg-type]
    assert hosts_of_8_gpus == []
