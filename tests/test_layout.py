"""deep_ep/backends/kernels/layout.py, deep_ep/records.py and include/deep_ep/common/layout.cuh + fault.cuh
describe the same bytes."""

from __future__ import annotations

import pytest
from deep_ep.jit import JITCompileError, KernelSpec, compile_spec

from deep_ep import records
from deep_ep.backends.kernels import layout
from deep_ep.paths import get_include_dir

SHAPES = [(14336, 0, 32), (14336, 0, 8), (7168, 224, 8), (7168, 56, 8), (4096, 128, 6), (256, 8, 1), (2048, 64, 32)]
COMBINE = [(7168, 8), (2048, 6), (128, 1), (4096, 32)]
# (ranks, top-k, rows per holder): which combine layout the kernels and the sizing agree on
COMBINE_LAYOUTS = [(8, 8, 1), (16, 8, 1), (2, 8, 1), (2, 8, 8), (4, 1, 1), (64, 9, 3)]


def _assertions(offset_delta: int = 0) -> str:
    lines = [
        f"static_assert(deep_ep::kMaxRanks == {layout.MAX_RANKS});",
        f"static_assert(deep_ep::kMaxChannels == {layout.MAX_CHANNELS});",
        f"static_assert(deep_ep::kSemaphoreOffset == {layout.SEMAPHORE_OFFSET});",
        f"static_assert(deep_ep::kRecvCountOffset == {layout.RECV_COUNT_OFFSET + offset_delta});",
        f"static_assert(deep_ep::kStatusOffset == {layout.STATUS_OFFSET});",
        f"static_assert(deep_ep::kEpilogueDoneOffset == {layout.EPILOGUE_DONE_OFFSET});",
        f"static_assert(deep_ep::kEpochOffset == {layout.EPOCH_OFFSET});",
        f"static_assert(deep_ep::kDispatchTaskQueueOffset == {layout.DISPATCH_TASK_QUEUE_OFFSET});",
        f"static_assert(deep_ep::kCombineTaskQueueOffset == {layout.COMBINE_TASK_QUEUE_OFFSET});",
        f"static_assert(deep_ep::kEpilogueTaskQueueOffset == {layout.EPILOGUE_TASK_QUEUE_OFFSET});",
        f"static_assert(deep_ep::kFaultReportedOffset == {layout.FAULT_REPORTED_OFFSET});",
        f"static_assert(deep_ep::kRankOffset == {layout.RANK_OFFSET});",
        f"static_assert(deep_ep::kNumRanksOffset == {layout.NUM_RANKS_OFFSET});",
        f"static_assert(deep_ep::kMaskedRanksOffset == {layout.MASKED_RANKS_OFFSET});",
        f"static_assert(deep_ep::kCreditOffset == {layout.CREDIT_OFFSET});",
        f"static_assert(deep_ep::kPeerWindowsOffset == {layout.PEER_WINDOWS_OFFSET});",
        f"static_assert(deep_ep::kOpSignatureOffset == {layout.OP_SIGNATURE_OFFSET});",
        f"static_assert(deep_ep::kPeerMessageOffset == {layout.PEER_MESSAGE_OFFSET});",
        f"static_assert(deep_ep::kPeerMessageBytes == {layout.PEER_MESSAGE_BYTES});",
        f"static_assert(deep_ep::kMaskOnTimeoutOffset == {layout.MASK_ON_TIMEOUT_OFFSET});",
        f"static_assert(deep_ep::kTimedOutRanksOffset == {layout.TIMED_OUT_RANKS_OFFSET});",
        f"static_assert(deep_ep::kScaleoutRegionOffset == {layout.SCALEOUT_REGION_OFFSET});",
        f"static_assert(deep_ep::kScaleoutRingBytesOffset == {layout.SCALEOUT_RING_BYTES_OFFSET});",
        f"static_assert(deep_ep::kNumScaleupRanksOffset == {layout.NUM_SCALEUP_RANKS_OFFSET});",
        f"static_assert(deep_ep::kFaultForwardedOffset == {layout.FAULT_FORWARDED_OFFSET});",
        f"static_assert(deep_ep::kStagingEntriesCapOffset == {layout.STAGING_ENTRIES_CAP_OFFSET});",
        f"static_assert(deep_ep::kAgrsFlagOffset == {layout.AGRS_FLAG_OFFSET});",
        f"static_assert(deep_ep::kRemoteCreditOffset == {layout.REMOTE_CREDIT_OFFSET});",
        f"static_assert(deep_ep::kRemoteSignatureOffset == {layout.REMOTE_SIGNATURE_OFFSET});",
        f"static_assert(deep_ep::kRemoteFaultOffset == {layout.REMOTE_FAULT_OFFSET});",
        f"static_assert(deep_ep::kRemoteBarrierOffset == {layout.REMOTE_BARRIER_OFFSET});",
        f"static_assert(deep_ep::kBarrierPassedOffset == {layout.BARRIER_PASSED_OFFSET});",
        f"static_assert(deep_ep::kRemoteArrivalOffset == {layout.REMOTE_ARRIVAL_OFFSET});",
        f"static_assert(deep_ep::kCountStagingOffset == {layout.COUNT_STAGING_OFFSET});",
        f"static_assert(deep_ep::kForwardExpertCountOffset == {layout.FORWARD_EXPERT_COUNT_OFFSET});",
        f"static_assert(deep_ep::kForwardCountFlagOffset == {layout.FORWARD_COUNT_FLAG_OFFSET});",
        f"static_assert(deep_ep::kForwardRecordFlagOffset == {layout.FORWARD_RECORD_FLAG_OFFSET});",
        f"static_assert(deep_ep::kForwardArrivalOffset == {layout.FORWARD_ARRIVAL_OFFSET});",
        f"static_assert(deep_ep::kStagingRingOffset == {layout.STAGING_RING_OFFSET});",
        f"static_assert(deep_ep::kRecvExpertCountOffset == {layout.RECV_EXPERT_COUNT_OFFSET});",
        f"static_assert(deep_ep::kArrivalOffset == {layout.ARRIVAL_OFFSET});",
        f"static_assert(deep_ep::kMaxArrivalBlocks == {layout.MAX_ARRIVAL_BLOCKS});",
        f"static_assert(deep_ep::kMaxGroupInts == {layout.MAX_GROUP_INTS});",
        f"static_assert(deep_ep::kMaxGroupsPerRank == {layout.MAX_GROUPS_PER_RANK});",
        f"static_assert(deep_ep::kWorkspaceBytes == {records.WORKSPACE_BYTES});",
        f"static_assert(deep_ep::kMaxLocalExperts == {layout.MAX_LOCAL_EXPERTS});",
        f"static_assert(deep_ep::kDispatchScratchInts == {layout.DISPATCH_SCRATCH_INTS});",
        f"static_assert(deep_ep::kErrWords == {len(layout.ERROR_WORDS)});",
        f"static_assert(deep_ep::kErrReporter == {layout.ERROR_WORDS.index('reporter')});",
        f"static_assert(deep_ep::kErrInputStatus == {layout.ERROR_WORDS.index('input_status')});",
        f"static_assert(deep_ep::kErrInputReason == {layout.ERROR_WORDS.index('input_reason')});",
        f"static_assert(deep_ep::kErrTimedOutHere == {layout.ERROR_TIMED_OUT_HERE});",
        f"static_assert(deep_ep::kErrReportedByPeer == {layout.ERROR_REPORTED_BY_PEER});",
        f"static_assert(deep_ep::kInputOutOfRange == {layout.INPUT_OUT_OF_RANGE});",
        f"static_assert(deep_ep::kInputRepeated == {layout.INPUT_REPEATED});",
        f"static_assert(deep_ep::kInputPpSize == {layout.INPUT_PP_SIZE});",
    ]
    for hidden_bytes, scale_bytes, topk in SHAPES:
        py = records.DispatchRecordLayout(hidden_bytes, scale_bytes, topk)
        record = f"deep_ep::DispatchRecord<{hidden_bytes}, {scale_bytes}, {topk}>"
        lines += [
            f"static_assert({record}::kBytes == {py.num_bytes});",
            f"static_assert({record}::kScaleOffset == {py.scale_offset});",
            f"static_assert({record}::kMetaOffset == {py.meta_offset});",
        ]
    for hidden, topk in COMBINE:
        py = records.CombineSlotLayout(hidden, topk)
        slot = f"deep_ep::CombineSlot<{hidden}, {topk}>"
        lines += [f"static_assert({slot}::kBytes == {py.num_bytes});",
                  f"static_assert({slot}::kWeightOffset == {py.weight_offset});"]  # fmt: skip
    for num_ranks, topk, rows in COMBINE_LAYOUTS:
        lane_slots = str(records.combine_uses_lane_slots(num_ranks, topk, rows)).lower()
        lines.append(f"static_assert(deep_ep::kCombineLaneSlots<{num_ranks}, {topk}, {rows}> == {lane_slots});")
    for code, name in layout.PHASES.items():
        constant = {"barrier": "kPhaseBarrier", "dispatch entry (peer window credit)": "kPhaseDispatchEntry",
                    "dispatch arrivals": "kPhaseDispatchArrival", "combine entry (peer window credit)": "kPhaseCombineEntry",
                    "combine arrivals": "kPhaseCombineArrival", "dispatch grid barrier": "kPhaseDispatchGrid",
                    "dispatch counts": "kPhaseDispatchCounts",
                    "operation mismatch (the ranks ran different sequences of operations)": "kPhaseOpMismatch",
                    "epilogue entry (peer's operation signature)": "kPhaseOpSignature",
                    "host error (a rank raised inside an operation or rejected its input)": "kPhaseHostError",
                    "transport deadline (the emulated NIC or a flush of the puts passed it)": "kPhaseNic",
                    "forwarder's counts (hybrid mode: a source's counts for our node)": "kPhaseForwardCounts",
                    "forwarder's arrivals (hybrid mode: a source's records for our node)": "kPhaseForwardArrival",
                    "AGRS arrivals (a peer's all-gather or reduce-scatter data)": "kPhaseAgrsArrival",
                    "PP credit (the receiver to free a slot of the pair's ring)": "kPhasePpCredit",
                    "PP arrival (the sender's next message)": "kPhasePpArrival"}[name]  # fmt: skip
        lines.append(f"static_assert(deep_ep::{constant} == {code});")
    return "\n".join(lines)


def _compile(tmp_path, body: str):
    (tmp_path / "layout_check.cuh").write_text(
        "#pragma once\n#include <deep_ep/common/layout.cuh>\n#include <deep_ep/common/fault.cuh>\n"
        "#include <deep_ep/common/scaleout.cuh>\n#include <deep_ep/kernels/dispatch_epilogue.cuh>\n"
        f"{body}\ntemplate <int kUnused> __global__ void layout_check_impl(int* out) {{ *out = kUnused; }}\n"
    )
    spec = KernelSpec(header="layout_check.cuh", name="layout_check_impl", template_args=(0,),
                      param_types=("int*",), include_dirs=(str(tmp_path), str(get_include_dir())))  # fmt: skip
    return compile_spec(spec)


@pytest.fixture(autouse=True)
def _sm90a_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EP_JIT_ARCH", "sm_90a")
    monkeypatch.setenv("EP_JIT_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.nvcc
def test_python_and_cuda_layouts_agree(tmp_path):
    _compile(tmp_path, _assertions())


@pytest.mark.nvcc
def test_a_wrong_constant_is_caught(tmp_path):
    with pytest.raises(JITCompileError, match="static assertion failed"):
        _compile(tmp_path, _assertions(offset_delta=4))


def test_window_size_counts_the_larger_of_the_records_and_the_combine_slots():
    # EP2, top-8: the records of 2 sources are fewer than the 8 lane slots per token without
    # multiple reduction, and more than the 2 holder slots with it
    record = records.DispatchRecordLayout(14336, 0, 8).num_bytes
    slot = records.CombineSlotLayout(7168, 8).num_bytes
    with_reduction = records.buffer_region_bytes(2, 8192, 7168, 8, False, True)
    assert with_reduction == 2 * 8192 * record
    assert records.buffer_region_bytes(2, 8192, 7168, 8, False, False) == 8 * 8192 * slot
    size = records.window_bytes(with_reduction)
    assert size % records.BUFFER_ALIGNMENT_BYTES == 0 and size >= records.WORKSPACE_BYTES + with_reduction
    # FP8 sizing counts MXFP8 records (a scale per 32 elements), which also hold 1x128 scales
    fp8 = records.buffer_region_bytes(64, 4096, 7168, 8, True, True)
    assert fp8 == 64 * 4096 * records.DispatchRecordLayout(7168, 4 * 224, 8).num_bytes
    assert (
        records.DispatchRecordLayout(7168, 4 * 56, 8).num_bytes < records.DispatchRecordLayout(7168, 896, 8).num_bytes
    )


@pytest.mark.parametrize("hidden_bytes, scale_bytes, topk", SHAPES)
def test_records_start_on_lines_where_v2s_record_size_leaves_room(hidden_bytes, scale_bytes, topk):
    record = records.DispatchRecordLayout(hidden_bytes, scale_bytes, topk)
    assert record.num_bytes <= records.v2_record_bytes(hidden_bytes, scale_bytes, topk)
    lined = -(-(record.meta_offset + topk * 8 + 4) // 128) * 128
    assert record.num_bytes % 128 == 0 or lined > records.v2_record_bytes(hidden_bytes, scale_bytes, topk)


# Layout columns: ranks, and in hybrid mode ranks plus nodes (64 ranks as 32 nodes of 2: 96)
@pytest.mark.parametrize("num_columns", [2, 3, 8, 64, 96])
@pytest.mark.parametrize("num_tokens", [0, 1, 31, 128, 4097, 8192, 65536, 262144])
def test_token_groups_and_arrival_blocks_fit_the_workspace(num_columns, num_tokens):
    group = layout.tokens_per_group(num_tokens, num_columns)
    assert group % 32 == 0 and group >= 32
    assert -(-num_tokens // group) * num_columns <= layout.MAX_GROUP_INTS  # every CTA keeps them all
    assert -(-num_tokens // group) <= layout.MAX_GROUPS_PER_RANK  # one warp scans them in one batch
    block = layout.arrival_block(num_tokens)
    assert block >= 32 and -(-num_tokens // block) <= layout.MAX_ARRIVAL_BLOCKS
