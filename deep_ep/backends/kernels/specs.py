"""Typed kernel specs: which header, which template, which compile-time constants, which arguments.

Each function returns a loaded `deep_ep.jit` kernel for one specialisation. Compile-time constants
are the shape of the problem that never changes between steps (ranks, hidden bytes, scale bytes,
top-k, rows per combine slot); token counts are runtime arguments, so a new batch size never
recompiles. `rank_masking` specialises the communication kernels for a buffer with rank masking
(rank_mask.cuh); without it every test of the mask folds away. `transport` is the transport the
kernels reach remote peers through (docs/transport.md: `TRANSPORTS`); over `'lsa'` there are none
and every test of the scale-out path folds away. `warmup_specs()` lists the specialisations the
tests and benchmarks use, for `deep-ep jit warmup` and for the CPU compile tests.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import zlib

from deep_ep.jit import KernelSpec, get_kernel
from deep_ep.paths import get_include_dir

NUM_THREADS = 512
NUM_EXPAND_RANK_THREADS = 1024


class DispatchArgs(ctypes.Structure):
    """Mirror of `deep_ep::DispatchArgs` (dispatch.cuh), passed by value."""

    _fields_ = [
        ("window_base", ctypes.c_uint64),
        ("x", ctypes.c_uint64),
        ("x_scales", ctypes.c_uint64),
        ("topk_idx", ctypes.c_uint64),
        ("topk_idx_copy", ctypes.c_uint64),
        ("topk_weights", ctypes.c_uint64),
        ("slot_idx", ctypes.c_uint64),
        ("dst_slot_idx", ctypes.c_uint64),
        ("layout_scratch", ctypes.c_uint64),
        ("num_tokens_per_rank", ctypes.c_uint64),
        ("num_recv_tokens_per_expert", ctypes.c_uint64),
        ("counts_out", ctypes.c_uint64),
        ("cumulative_stats", ctypes.c_uint64),
        ("num_masked_lanes", ctypes.c_uint64),
        ("num_tokens", ctypes.c_int),
        ("num_max_tokens_per_rank", ctypes.c_int),
        ("rank", ctypes.c_int),
        ("num_experts_per_rank", ctypes.c_int),
        ("tokens_per_group", ctypes.c_int),
        ("tokens_per_task", ctypes.c_int),
        ("arrival_block", ctypes.c_int),
        ("op_hash", ctypes.c_int),
        ("error_block", ctypes.c_uint64),
        ("timeout_ns", ctypes.c_uint64),
        ("counts_ready", ctypes.c_uint64),
        ("counts_sequence", ctypes.c_uint64),
        ("counts_before_sends", ctypes.c_int),
        ("node_slot_idx", ctypes.c_uint64),
        ("num_hybrid_nodes", ctypes.c_int),
        ("num_tokens_per_node", ctypes.c_uint64),
        ("forward_map", ctypes.c_uint64),
        ("forward_counts", ctypes.c_uint64),
    ]


class DispatchEpilogueArgs(ctypes.Structure):
    """Mirror of `deep_ep::DispatchEpilogueArgs` (dispatch_epilogue.cuh), passed by value."""

    _fields_ = [
        ("window_base", ctypes.c_uint64),
        ("x", ctypes.c_uint64),
        ("x_scales", ctypes.c_uint64),
        ("num_max_tokens_per_rank", ctypes.c_int),
        ("rank", ctypes.c_int),
        ("num_experts_per_rank", ctypes.c_int),
        ("expert_alignment", ctypes.c_int),
        ("num_out_rows", ctypes.c_int),
        ("num_meta_rows", ctypes.c_int),
        ("scale_col_stride", ctypes.c_int64),
        ("recv_x", ctypes.c_uint64),
        ("recv_scales", ctypes.c_uint64),
        ("recv_topk_idx", ctypes.c_uint64),
        ("recv_topk_weights", ctypes.c_uint64),
        ("recv_src_metadata", ctypes.c_uint64),
        ("psum_num_recv_tokens_per_rank", ctypes.c_uint64),
        ("num_recv_tokens_per_expert", ctypes.c_uint64),
        ("psum_num_recv_tokens_per_expert", ctypes.c_uint64),
        ("expand_rank_in_expert", ctypes.c_uint64),
        ("is_cached", ctypes.c_int),
        ("do_zero_padding", ctypes.c_int),
        ("drain_only", ctypes.c_int),
        ("arrival_block", ctypes.c_int),
        ("op_hash", ctypes.c_int),
        ("error_block", ctypes.c_uint64),
        ("timeout_ns", ctypes.c_uint64),
    ]


class CombineArgs(ctypes.Structure):
    """Mirror of `deep_ep::CombineArgs` (combine.cuh), passed by value."""

    _fields_ = [
        ("window_base", ctypes.c_uint64),
        ("x", ctypes.c_uint64),
        ("topk_weights", ctypes.c_uint64),
        ("recv_src_metadata", ctypes.c_uint64),
        ("psum_num_recv_tokens_per_rank", ctypes.c_uint64),
        ("num_x_rows", ctypes.c_int),
        ("num_meta_rows", ctypes.c_int),
        ("num_max_tokens_per_rank", ctypes.c_int),
        ("rank", ctypes.c_int),
        ("rows_per_task", ctypes.c_int),
        ("arrival_block", ctypes.c_int),
        ("op_hash", ctypes.c_int),
        ("error_block", ctypes.c_uint64),
        ("timeout_ns", ctypes.c_uint64),
        ("forward_map", ctypes.c_uint64),
        ("forward_counts", ctypes.c_uint64),
    ]


class CombineEpilogueArgs(ctypes.Structure):
    """Mirror of `deep_ep::CombineEpilogueArgs` (combine_epilogue.cuh), passed by value."""

    _fields_ = [
        ("window_base", ctypes.c_uint64),
        ("topk_idx", ctypes.c_uint64),
        ("slot_idx", ctypes.c_uint64),
        ("bias_0", ctypes.c_uint64),
        ("bias_1", ctypes.c_uint64),
        ("combined_x", ctypes.c_uint64),
        ("combined_topk_weights", ctypes.c_uint64),
        ("local_x", ctypes.c_uint64),
        ("local_topk_weights", ctypes.c_uint64),
        ("psum_num_recv_tokens_per_rank", ctypes.c_uint64),
        ("num_tokens_per_rank", ctypes.c_uint64),
        ("num_local_rows", ctypes.c_int),
        ("num_tokens", ctypes.c_int),
        ("num_max_tokens_per_rank", ctypes.c_int),
        ("num_experts_per_rank", ctypes.c_int),
        ("rank", ctypes.c_int),
        ("arrival_block", ctypes.c_int),
        ("op_hash", ctypes.c_int),
        ("error_block", ctypes.c_uint64),
        ("timeout_ns", ctypes.c_uint64),
        ("num_ranks_per_node", ctypes.c_int),
        ("node_slot_idx", ctypes.c_uint64),
        ("num_tokens_per_node", ctypes.c_uint64),
        ("forward_counts", ctypes.c_uint64),
    ]


class LsaTransportArgs(ctypes.Structure):
    """Mirror of `deep_ep::transport::Lsa::Args` (transport/lsa.cuh), passed by value."""

    _fields_ = [("peer_windows", ctypes.c_uint64), ("rank", ctypes.c_int)]


# The emulated NIC's modes (transport/emulated.cuh): the calling warp copies at once, or a NIC CTA
# runs the puts late, shuffled, in contexts
EMULATED_TRANSPORTS = ("emulated-eager", "emulated-strict")
NIC_CONTEXTS = 2  # kNicContexts
NIC_WORDS = 2 * NIC_CONTEXTS + 2  # kNicWords; the status is the last one
# kNicTraffic*: what a rank handed to its NIC, as int64 words: bytes put, puts, signals
NIC_TRAFFIC_WORDS = ("bytes", "puts", "signals")
# `Emulated::Args::mistake` (NicMistake): the protocol broken on purpose, for the tests that show the
# strict NIC catches it
NIC_MISTAKES = {None: 0, "no_flush": 1, "signal_first": 2, "split_contexts": 3}


class EmulatedTransportArgs(ctypes.Structure):
    """Mirror of `deep_ep::transport::Emulated<kStrict>::Args` (transport/emulated.cuh), passed by value."""

    _fields_ = [
        ("peer_windows", ctypes.c_uint64),
        ("queue", ctypes.c_uint64),
        ("words", ctypes.c_uint64),
        ("capacity", ctypes.c_int),
        ("rank", ctypes.c_int),
        ("context", ctypes.c_int),
        ("mistake", ctypes.c_int),
        ("seed", ctypes.c_uint32),
        ("delay_ns", ctypes.c_uint64),
        ("timeout_ns", ctypes.c_uint64),
        ("traffic", ctypes.c_uint64),
    ]


# NCCL's GIN backends, compiled one at a time (every backend at once costs registers and a stack)
GIN_BACKENDS = ("PROXY", "GDAKI", "GPI", "EFA_GDA")
# The transports of the communication kernels and their epilogues (docs/transport.md): LSA only (one
# scale-up domain), the emulated NIC of virtual nodes, or NCCL GIN built for one of its backends
TRANSPORTS = ("lsa", *EMULATED_TRANSPORTS, *(f"gin-{b.lower()}" for b in GIN_BACKENDS))
# Hybrid mode over a transport with remote peers (hybrid.cuh): `hybrid-` and its name; `hybrid-lanes-`
# for its combine with lane slots (fewer top-k lanes than ranks per node, combine_forward.cuh)
HYBRID_TRANSPORTS = tuple(f"hybrid-{lanes}{t}" for t in TRANSPORTS if t != "lsa" for lanes in ("", "lanes-"))


def _base_transport(transport: str) -> str:
    return transport.removeprefix("hybrid-").removeprefix("lanes-")


def transport_type(transport: str) -> str:
    """The C++ type of `transport` (one of `TRANSPORTS` or `HYBRID_TRANSPORTS`), the kernels' `Transport`
    template argument."""
    if transport in HYBRID_TRANSPORTS:
        lanes = ", true" if transport.startswith("hybrid-lanes-") else ""
        return f"deep_ep::transport::Hybrid<{transport_type(_base_transport(transport))}{lanes}>"
    if transport == "lsa":
        return "deep_ep::transport::Lsa"
    if transport in EMULATED_TRANSPORTS:
        return f"deep_ep::transport::Emulated<{'true' if transport == 'emulated-strict' else 'false'}>"
    if transport in TRANSPORTS:
        return "deep_ep::transport::Gin"
    raise ValueError(f"kernel specs: `transport` must be one of {TRANSPORTS + HYBRID_TRANSPORTS}, got {transport!r}")


def _with_transport(spec: KernelSpec, transport: str) -> KernelSpec:
    """`spec` built for `transport`: a GIN one against the NCCL headers, with only its backend on."""
    transport = _base_transport(transport)
    if not transport.startswith("gin-"):
        return spec
    backend = transport.removeprefix("gin-").upper()
    flags = ("-DDEEP_EP_WITH_GIN=1", *(f"-DNCCL_GIN_{b}_ENABLE={int(b == backend)}" for b in GIN_BACKENDS))
    return dataclasses.replace(spec, use_nccl=True, extra_flags=flags)


class TransportPingArgs(ctypes.Structure):
    """Mirror of `deep_ep::TransportPingArgs` (transport_ping.cuh), passed by value."""

    _fields_ = [
        ("src_offset", ctypes.c_uint64),
        ("dst_offset", ctypes.c_uint64),
        ("num_bytes", ctypes.c_uint64),
        ("signal_offset", ctypes.c_uint64),
        ("snapshot_offset", ctypes.c_uint64),
        ("round", ctypes.c_uint64),
        ("timeout_ns", ctypes.c_uint64),
        ("own_window", ctypes.c_uint64),
        ("rank", ctypes.c_int),
        ("num_ranks", ctypes.c_int),
        ("status", ctypes.c_uint64),
    ]


class AgrsArgs(ctypes.Structure):
    """Mirror of `deep_ep::AgrsArgs` (agrs.cuh), passed by value."""

    _fields_ = [
        ("window", ctypes.c_uint64),
        ("error_block", ctypes.c_uint64),
        ("timeout_ns", ctypes.c_uint64),
        ("rows", ctypes.c_uint64),
        ("out", ctypes.c_uint64),
        ("num_elements", ctypes.c_int64),
        ("sequence", ctypes.c_int),
        ("rank", ctypes.c_int),
        ("num_ranks", ctypes.c_int),
        ("signature", ctypes.c_uint32),
    ]


class PpArgs(ctypes.Structure):
    """Mirror of `deep_ep::PpArgs` (pp.cuh), passed by value."""

    _fields_ = [
        ("window", ctypes.c_uint64),
        ("error_block", ctypes.c_uint64),
        ("timeout_ns", ctypes.c_uint64),
        ("region_offset", ctypes.c_int64),
        ("num_bytes", ctypes.c_int64),
        ("sequence", ctypes.c_int),
        ("num_slots", ctypes.c_int),
        ("slot", ctypes.c_int),
        ("rank", ctypes.c_int),
        ("peer", ctypes.c_int),
    ]


class EngramFetchArgs(ctypes.Structure):
    """Mirror of `deep_ep::EngramFetchArgs` (engram_fetch.cuh), passed by value."""

    _fields_ = [
        ("window_base", ctypes.c_uint64),
        ("error_block", ctypes.c_uint64),
        ("timeout_ns", ctypes.c_uint64),
        ("indices", ctypes.c_uint64),
        ("out", ctypes.c_uint64),
        ("table_offset", ctypes.c_int64),
        ("staging_offset", ctypes.c_int64),
        ("num_rows", ctypes.c_int64),
        ("num_entries", ctypes.c_int64),
        ("row_bytes", ctypes.c_int64),
        ("entry_stride", ctypes.c_int64),
        ("rank", ctypes.c_int),
    ]


# Spec builders are memoized: building a KernelSpec resolves include paths on disk, which would
# otherwise be paid by every kernel of every dispatch and combine.
def _spec(kernel: str, template_args: tuple, param_types: tuple[str, ...], use_nccl: bool = False) -> KernelSpec:
    return KernelSpec(
        header=f"deep_ep/kernels/{kernel}.cuh",
        name=f"deep_ep::{kernel}_impl",
        template_args=template_args,
        param_types=param_types,
        include_dirs=(str(get_include_dir()),),
        use_nccl=use_nccl,
    )


def _bool(value: bool) -> str:
    return "true" if value else "false"


def _transport_spec(kernel: str, template_args: tuple, param_types: tuple[str, ...], transport: str) -> KernelSpec:
    """A kernel templated on its transport (the last template argument)."""
    name = transport_type(transport)
    return _with_transport(_spec(kernel, (*template_args, name), (*param_types, f"{name}::Args")), transport)


@functools.cache
def dispatch_spec(num_ranks: int, hidden_bytes: int, scale_bytes: int, num_topk: int, cached: bool,
                  rank_masking: bool = False, transport: str = "lsa") -> KernelSpec:  # fmt: skip
    return _transport_spec(
        "dispatch",
        (num_ranks, hidden_bytes, scale_bytes, num_topk, NUM_THREADS, _bool(cached), _bool(rank_masking)),
        ("deep_ep::DispatchArgs",), transport,
    )  # fmt: skip


@functools.cache
def dispatch_expand_rank_spec(num_ranks: int, hidden_bytes: int, scale_bytes: int, num_topk: int,
                              rank_masking: bool = False, transport: str = "lsa") -> KernelSpec:  # fmt: skip
    """It sends nothing: the transport only says where remote sources' arrival counters are."""
    spec = _spec(
        "dispatch_expand_rank",
        (num_ranks, hidden_bytes, scale_bytes, num_topk, NUM_EXPAND_RANK_THREADS, _bool(rank_masking),
         transport_type(transport)),
        ("char*", "int", "int", "int", "int*", "int", "int", "int64_t*", "uint64_t"),
    )  # fmt: skip
    return _with_transport(spec, transport)


@functools.cache
def dispatch_epilogue_spec(num_ranks: int, hidden_bytes: int, scale_bytes: int, num_topk: int, expand: bool,
                           rank_masking: bool = False, transport: str = "lsa") -> KernelSpec:  # fmt: skip
    return _transport_spec(
        "dispatch_epilogue",
        (num_ranks, hidden_bytes, scale_bytes, num_topk, NUM_THREADS, _bool(expand), _bool(rank_masking)),
        ("deep_ep::DispatchEpilogueArgs",), transport,
    )  # fmt: skip


@functools.cache
def combine_spec(num_ranks: int, hidden: int, num_topk: int, num_rows: int, expand: bool,
                 rank_masking: bool = False, transport: str = "lsa") -> KernelSpec:  # fmt: skip
    return _transport_spec(
        "combine",
        (num_ranks, hidden, num_topk, num_rows, NUM_THREADS, _bool(expand), _bool(rank_masking)),
        ("deep_ep::CombineArgs",), transport,
    )  # fmt: skip


@functools.cache
def combine_epilogue_spec(num_ranks: int, hidden: int, num_topk: int, num_rows: int,
                          rank_masking: bool = False, transport: str = "lsa") -> KernelSpec:  # fmt: skip
    return _transport_spec(
        "combine_epilogue",
        (num_ranks, hidden, num_topk, num_rows, NUM_THREADS, _bool(rank_masking)),
        ("deep_ep::CombineEpilogueArgs",), transport,
    )  # fmt: skip


@functools.cache
def barrier_spec(num_ranks: int, transport: str = "lsa") -> KernelSpec:
    return _transport_spec("barrier", (num_ranks,), ("char*", "int", "int64_t*", "uint64_t"), transport)


@functools.cache
def post_fault_spec(transport: str = "lsa") -> KernelSpec:
    return _transport_spec("post_fault", (32,), ("char*", "int64_t*", "const int4*", "uint64_t"), transport)


@functools.cache
def peer_store_spec() -> KernelSpec:
    return _spec("peer_store", (NUM_THREADS,), ("char*", "int", "int", "uint64_t", "const int4*", "uint64_t"))


@functools.cache
def launch_floor_spec() -> KernelSpec:
    """The empty kernel of the host bench's launch floor (launch_floor.cuh)."""
    return _spec("launch_floor", (NUM_THREADS,), ("int64_t",))


@functools.cache
def transport_ping_spec(transport: str = "lsa") -> KernelSpec:
    """The transport self-test (transport_ping.cuh) over `transport` (one of `TRANSPORTS`): LSA, the
    emulated NIC (transport/emulated.cuh), or GIN built against NCCL >= 2.30.4 for one backend."""
    name = transport_type(transport)
    return _with_transport(_spec("transport_ping", (name, 256), (f"{name}::Args", "deep_ep::TransportPingArgs")),
                           transport)  # fmt: skip


# AGRS calls (agrs.cuh): threads per CTA (at least one per rank: each waits for one peer's flag)
AGRS_THREADS = 256
AGRS_ELEMENTS = {None: "void", "bfloat16": "__nv_bfloat16", "float32": "float"}


@functools.cache
def agrs_spec(element: str | None) -> KernelSpec:
    """An AGRS call's kernel (agrs.cuh): the flags and the wait of an all-gather (`element` None), or
    also a reduce-scatter's sum of `element` rows (`'bfloat16'` or `'float32'`)."""
    return _spec("agrs", (AGRS_ELEMENTS[element], AGRS_THREADS), ("deep_ep::AgrsArgs",))


# The steps of a pipeline send and receive (pp.cuh's `PpStep`), each a one-warp kernel
PP_STEPS = ("send_wait", "send_signal", "recv_wait", "recv_free")


@functools.cache
def pp_spec(step: str) -> KernelSpec:
    """One step of a pipeline send or receive (pp.cuh): `step` one of `PP_STEPS`."""
    return _spec("pp", (PP_STEPS.index(step),), ("deep_ep::PpArgs",))


# Engram's fetch (engram_fetch.cuh): threads per CTA, a warp per row at a time
ENGRAM_THREADS = 256
ENGRAM_INDEX_TYPES = {"int32": "int32_t", "int64": "int64_t"}


@functools.cache
def engram_fetch_spec(index: str, transport: str = "lsa") -> KernelSpec:
    """Engram's fetch by global index (engram_fetch.cuh), indices of `index` (`'int32'` or `'int64'`),
    remote owners read through `transport` (one of `TRANSPORTS`; a hybrid one's base)."""
    return _transport_spec("engram_fetch", (ENGRAM_INDEX_TYPES[index], ENGRAM_THREADS), ("deep_ep::EngramFetchArgs",),
                           _base_transport(transport))  # fmt: skip


@functools.cache
def nccl_peer_pointers_spec() -> KernelSpec:
    """The only kernel built against NCCL's headers: an NCCL window's LSA peer pointers."""
    return _spec("nccl_peer_pointers", (32,), ("ncclWindow_t", "int", "uint64_t*"), use_nccl=True)


@functools.cache
def op_hash(kind: str, num_max_tokens_per_rank: int, slot_bytes: int, num_topk: int) -> int:
    """What an operation is, for the signature every rank checks against its peers' (arrivals.cuh):
    `kind` (`'dispatch'` or `'combine'`) and the sizes that place its slots."""
    return zlib.crc32(f"{kind}:{num_max_tokens_per_rank}:{slot_bytes}:{num_topk}".encode()) & 0xFFFF


@functools.cache
def load(spec: KernelSpec):
    """Compile (or take from the cache) and load one specialisation; memoized per process."""
    return get_kernel(spec)


def moe_specs(num_ranks: int, hidden: int, num_topk: int, num_experts: int, fp8_scale_bytes: tuple[int, ...] = (),
              rank_masking: bool = False, transport: str = "lsa") -> list[KernelSpec]:  # fmt: skip
    """Every specialisation one MoE shape uses: BF16 and each FP8 scale format, both layouts."""
    num_local_experts = num_experts // num_ranks
    specs = [barrier_spec(num_ranks, transport)]
    for hidden_bytes, scale_bytes in [(hidden * 2, 0), *[(hidden, s) for s in fp8_scale_bytes]]:
        shape = (num_ranks, hidden_bytes, scale_bytes, num_topk)
        specs += [dispatch_spec(*shape, c, rank_masking, transport) for c in (False, True)]
        specs.append(dispatch_expand_rank_spec(*shape, rank_masking, transport))
        specs += [dispatch_epilogue_spec(*shape, e, rank_masking, transport) for e in (False, True)]
    for num_rows, expand in ((1, False), (1, True), (min(num_topk, num_local_experts), True)):
        specs.append(combine_spec(num_ranks, hidden, num_topk, num_rows, expand, rank_masking, transport))
        specs.append(combine_epilogue_spec(num_ranks, hidden, num_topk, num_rows, rank_masking, transport))
    return list(dict.fromkeys(specs))


def warmup_specs(num_ranks: int = 2, hiddens: tuple[int, ...] = (2048, 7168), num_topk: int = 8,
                 num_experts: int = 256) -> list[KernelSpec]:  # fmt: skip
    """The probes and every specialisation of one MoE shape per hidden size (BF16 and both FP8 scale
    packs). The defaults are the 2-rank shapes of the GPU tests and the benchmark."""
    specs = [peer_store_spec(), nccl_peer_pointers_spec(), post_fault_spec(), transport_ping_spec("lsa")]
    specs.append(launch_floor_spec())  # the host bench's launch floor
    specs += [agrs_spec(element) for element in AGRS_ELEMENTS]
    specs += [pp_spec(step) for step in PP_STEPS] + [engram_fetch_spec(index) for index in ENGRAM_INDEX_TYPES]
    specs += [engram_fetch_spec("int64", transport) for transport in EMULATED_TRANSPORTS]
    for hidden in hiddens:
        fp8 = (-(-hidden // 128) * 4, -(-hidden // 512) * 4)
        specs += moe_specs(num_ranks, hidden, num_topk, num_experts, fp8)
    return list(dict.fromkeys(specs))
