"""`NvlinkBackend`: the `EPBackend` that runs the JIT-compiled NVLink kernels (one NVLink domain,
or the virtual ranks of one GPU)."""

from __future__ import annotations

import os
from typing import ClassVar

import torch
import torch.distributed as dist

from deep_ep.backends.base import (
    BufferConfig,
    CombineRequest,
    CombineResult,
    DispatchRequest,
    DispatchResult,
    EPBackend,
    loopback_world_of,
)
from deep_ep.event import current_stream

from .agrs import NvlinkAgrs
from .combine import run_combine
from .dispatch import run_dispatch
from .engram import NvlinkEngram
from .layout import MAX_LOCAL_EXPERTS
from .pp import NvlinkPp
from .runtime import NvlinkRuntime
from .steady import SteadyPath, steady_enabled, steady_module
from .transport import choose_transport, open_transport


def hybrid_nodes(config: BufferConfig) -> int:
    """The nodes of hybrid mode (`config.num_scaleup_ranks` ranks each), or 0 for direct mode."""
    per_node = config.num_scaleup_ranks
    return config.num_ranks // per_node if 0 < per_node < config.num_ranks else 0


class NvlinkBackend(EPBackend):
    """Dispatch and combine through NCCL symmetric memory and LSA stores over NVLink."""

    name = "kernels"
    checks_topk_values_on_device: ClassVar[bool] = True
    supports_graph_capture: ClassVar[bool] = True
    supports_rank_masking: ClassVar[bool] = True
    supports_mask_on_timeout: ClassVar[bool] = True
    # Hybrid mode (docs/hybrid.md): a dispatch sends each token once per remote node, to its forwarder
    # there; a combine with one row per holder sends one partial per (token, remote node), summed by
    # the forwarders
    supports_hybrid_mode: ClassVar[bool] = True

    @classmethod
    def hybrid_mode_unsupported_reason(cls, allow_multiple_reduction: bool, enable_rank_masking: bool) -> str | None:
        if enable_rank_masking:
            return "its hybrid mode does not mask ranks yet (pass enable_rank_masking=False)"
        return None

    def __init__(self, group: dist.ProcessGroup, config: BufferConfig) -> None:
        super().__init__(group, config)
        self._device_index = config.device.index if config.device.index is not None else torch.cuda.current_device()
        transport = open_transport(group, config.num_allocated_qps, config.physical_domain_size)
        world = loopback_world_of(group)
        self.runtime = NvlinkRuntime(transport, config.num_bytes,
                                     num_gpu_timeout_secs=config.num_gpu_timeout_secs,
                                     num_cpu_timeout_secs=config.num_cpu_timeout_secs,
                                     rank_masking=config.enable_rank_masking,
                                     mask_on_timeout=config.mask_ranks_on_timeout, hidden=config.hidden,
                                     num_topk=config.num_topk, num_max_tokens_per_rank=config.num_max_tokens_per_rank,
                                     use_fp8_dispatch=config.use_fp8_dispatch,
                                     allow_multiple_reduction=config.allow_multiple_reduction,
                                     ring_entries_per_warp=None if world is None else world.nic.ring_entries_per_warp,
                                     num_hybrid_nodes=hybrid_nodes(config))  # fmt: skip
        self._agrs: NvlinkAgrs | None = None
        self._pp: NvlinkPp | None = None
        self._engram: NvlinkEngram | None = None

    @classmethod
    def is_supported(cls, group: dist.ProcessGroup) -> bool:
        """Whether some transport reaches every peer of `group` from here (`transport.choose_transport`)
        and `backend='auto'` may take it: not GIN across hosts (`TransportChoice.auto`), which has
        never run on a NIC."""
        choice = choose_transport(group)
        return choice.supported and choice.auto

    @classmethod
    def is_supported_by_name(cls, group: dist.ProcessGroup) -> bool:
        """Whether some transport reaches every peer of `group` from here (`backend='kernels'` takes
        GIN across hosts too)."""
        return choose_transport(group).supported

    @classmethod
    def unsupported_reason(cls, group: dist.ProcessGroup) -> str | None:
        choice = choose_transport(group)
        if not choice.supported:
            return choice.reason
        return None if choice.auto else f"backend='auto' does not take the kernels here ({choice.reason})"

    @property
    def dead_reason(self) -> str | None:
        return self.runtime.dead_reason

    def announce(self, op: str, error: BaseException | None) -> None:
        """Nothing when this rank goes ahead (no cost per call); a rejection stops the buffer on
        every rank at once (`NvlinkRuntime.post_fault`): peers may already wait for our records."""
        if error is not None:
            self.runtime.post_fault(op, error)

    def fail(self, op: str, error: BaseException) -> None:
        self.runtime.post_fault(op, error)

    def timed_out_ranks(self) -> frozenset[int]:
        return self.runtime.timed_out_ranks()

    def set_masked_ranks(self, masked_ranks: frozenset[int]) -> None:
        self.runtime.set_masked_ranks(masked_ranks, torch.cuda.current_stream())

    def steady_path(self, comm_stream: torch.cuda.Stream | None, buffer_id: int) -> SteadyPath | None:
        """Replays of recorded shapes in C++ (`steady`), where every call of the shape is on this
        runtime's plain path: no rank masking, hybrid mode, remote peers or guarded outputs."""
        runtime = self.runtime
        plain = not (runtime.rank_masking or runtime.num_hybrid_nodes or runtime.scaleout is not None
                     or runtime.share.guarded)  # fmt: skip
        # A host check of every `topk_idx` (EP_CHECK_VALUES=1, read here) is the Python path's
        if comm_stream is None or not plain or not steady_enabled() or os.environ.get("EP_CHECK_VALUES") == "1":
            return None
        module, _ = steady_module()
        if module is None:
            return None
        # A graph is built only on a GPU of this rank's own (`SteadyPath.graphs_refused`)
        return SteadyPath(module, runtime, comm_stream, buffer_id, own_gpu=not runtime.share.shared)

    def dispatch(self, request: DispatchRequest) -> DispatchResult:
        num_local_experts = request.num_experts // self.config.num_ranks
        if num_local_experts > MAX_LOCAL_EXPERTS:
            raise ValueError(f"dispatch: at most {MAX_LOCAL_EXPERTS} local experts, got {num_local_experts}")
        handle = request.cached_handle
        scales = None if request.scales is None else request.scales.contiguous()
        out = run_dispatch(
            self.runtime,
            current_stream(self._device_index),
            request.x,
            scales,
            request.topk_idx,
            request.topk_weights,
            num_experts=request.num_experts,
            num_max_tokens_per_rank=request.num_max_tokens_per_rank,
            expert_alignment=request.expert_alignment,
            num_sms=request.num_sms,
            do_cpu_sync=request.do_cpu_sync,
            do_expand=request.do_expand,
            do_zero_padding=request.do_zero_padding,
            use_tma_aligned_col_major_sf=request.use_tma_aligned_col_major_sf,
            cumulative_stats=request.cumulative_local_expert_recv_stats,
            cached=None if handle is None else handle.backend_state,
            cached_num_recv_tokens_per_expert=None if handle is None else handle.num_unaligned_recv_tokens_per_expert,
            cached_recv_src_metadata=None if handle is None else handle.recv_src_metadata,
            before_epilogue=request.wait_before_epilogue,
            num_qps=request.num_qps,
            do_handle_copy=request.do_handle_copy,
        )
        state = out["state"]
        if handle is None:
            dst_slot = out["dst_slot_idx"]  # written by the dispatch kernel
            counts_list = out["num_recv_tokens_per_expert_host"]
            psum_per_rank = out["psum_num_recv_tokens_per_rank"]
            psum_per_expert = out["psum_num_recv_tokens_per_expert"]
        else:  # the handle's (a cached dispatch's epilogue writes no prefix sums)
            dst_slot = handle.dst_buffer_slot_idx
            counts_list = handle.num_recv_tokens_per_expert_list
            psum_per_rank = handle.psum_num_recv_tokens_per_scaleup_rank
            psum_per_expert = handle.psum_num_recv_tokens_per_expert
        return DispatchResult(
            recv_x=out["recv_x"],
            recv_scales=out["recv_scales"],
            recv_topk_idx=out["recv_topk_idx"],
            recv_topk_weights=out["recv_topk_weights"],
            num_recv_tokens=state.num_meta_rows,
            num_expanded_tokens=state.num_expanded_rows,
            num_recv_tokens_per_expert_list=counts_list,
            psum_num_recv_tokens_per_scaleup_rank=psum_per_rank,
            psum_num_recv_tokens_per_expert=psum_per_expert,
            num_unaligned_recv_tokens_per_expert=out["num_recv_tokens_per_expert"],
            recv_src_metadata=out["recv_src_metadata"],
            dst_buffer_slot_idx=dst_slot,
            backend_state=state,
            num_masked_lanes=out["num_masked_lanes"] if handle is None else handle.num_masked_lanes,
            handle_topk_idx=out["topk_idx_copy"],
        )

    def combine(self, request: CombineRequest) -> CombineResult:
        handle = request.handle
        combined_x, combined_w = run_combine(
            self.runtime,
            current_stream(self._device_index),
            request.x,
            request.topk_weights,
            request.bias_0,
            request.bias_1,
            topk_idx=handle.topk_idx,
            recv_src_metadata=handle.recv_src_metadata,
            psum_num_recv_tokens_per_rank=handle.psum_num_recv_tokens_per_scaleup_rank,
            state=handle.backend_state,
            num_experts=handle.num_experts,
            num_max_tokens_per_rank=handle.num_max_tokens_per_rank,
            num_sms=request.num_sms,
            do_expand=handle.do_expand,
            allow_multiple_reduction=request.allow_multiple_reduction,
            before_epilogue=request.wait_before_epilogue,
            num_qps=request.num_qps,
        )
        return CombineResult(combined_x, combined_w)

    def agrs(self) -> NvlinkAgrs | None:
        """AGRS over the window when every peer is reached by stores; across scale-up domains, None
        (torch collectives: the copy engines reach only this domain's windows)."""
        if self.runtime.scaleout is not None:
            return None
        if self._agrs is None:
            self._agrs = NvlinkAgrs(self.runtime)
        return self._agrs

    def pp(self) -> NvlinkPp | None:
        """Pipeline sends over a ring in the window when every peer is reached by stores, else None."""
        if self.runtime.scaleout is not None:
            return None
        if self._pp is None:
            self._pp = NvlinkPp(self.runtime)
        return self._pp

    def engram(self) -> NvlinkEngram | None:
        """Engram's table in the windows: fetched by loads in our scale-up domain, by the transport's get
        from the others."""
        if self._engram is None:
            self._engram = NvlinkEngram(self.runtime)
        return self._engram

    def barrier(self) -> None:
        stream = torch.cuda.current_stream()
        self.runtime.barrier(stream)
        self.runtime.wait(stream, "barrier")
        self.runtime.take_input_error()

    def destroy(self) -> None:
        self.runtime.destroy()
