"""`deep-ep bench` and `deep-ep calibrate`: measurements of dispatch/combine on whatever is present.

- `deep_ep.bench.cases`: what a run measures (cases, options, inputs, traffic).
- `deep_ep.bench.timing`: eager timing, CUDA-graph capture and replay timing, kernel breakdown.
- `deep_ep.bench.torch_path`: the torch `all_to_all_single` path a user would write.
- `deep_ep.bench.runner`: the per-rank benchmark and `run()` (spawns the ranks, prints, writes).
- `deep_ep.bench.host`: `deep-ep bench --host`, the host cost of every call next to its GPU time.
- `deep_ep.bench.report`: the tables, the planner and issue checks, the JSON document and the plot.
- `deep_ep.bench.calibrate`: the planner's calibration (`deep_ep/data/hopper.json`).
"""

from __future__ import annotations

# Options of `deep-ep bench` (here, so that the CLI parser does not import torch)
DTYPES = ("fp8", "bf16")
ROUTINGS = ("uniform", "imbalanced")
DEFAULT_HOT_FRACTION = 0.5  # imbalanced routing: the share of tokens that prefer the hot rank's experts

# One rule for every figure of several ranks, in the tables, the JSON, the progress lines and the plots
MULTI_RANK_RULE = (
    "every time is the slowest rank's median time per call (a collective ends with its last rank); every byte "
    "count is the mean over ranks of each rank's records x record bytes (the JSON's `num_records`, "
    "`num_wire_records` and `dispatch_bytes` / `combine_bytes`); GB/s = those bytes / that time"
)
# The columns of the tables: (column, what it holds, shown on CPU ranks)
COLUMNS = (
    ("SMs", "SMs of every call; * = the planner's pick (num_sms=0); n/a on the reference backend (no SMs)", True),
    ("dispatch us, combine us", "eager calls: dispatch with CPU sync (exact shapes), then a combine of its handle",
     True),
    ("log GB/s", "logical bandwidth: every (token, destination rank) record, the rank's own included", True),
    ("wire GB/s", "wire bandwidth: only the records that leave the rank (over NVLink on GPUs)", True),
    ("torch d/c us", "dispatch / combine through torch.distributed all_to_all_single, as a user would write it",
     True),
    ("x torch d/c", "torch's time over ours, dispatch / combine (above 1: ours is faster)", True),
    ("%SoL d/c", "wire GB/s over the speed of light (our peer-store probe on all SMs, every rank writing)", False),
    ("fresh, cached, combine us", "CUDA-graph device time per call: dispatch without CPU sync, dispatch with "
     "handle=, combine", False),
    ("pred d/c us, err d/c %", "the planner's predicted graph time and its error against the measured one", False),
)  # fmt: skip

CPU_SMS = "n/a: the reference backend (torch collectives) uses no SMs"


def columns_text(cpu: bool = False) -> str:
    """The column legend of `deep-ep bench` (`cpu`: only the columns CPU ranks show)."""
    lines = [f"  {name}: {CPU_SMS if cpu and name == 'SMs' else meaning}" for name, meaning, on_cpu in COLUMNS
             if on_cpu or not cpu]  # fmt: skip
    return "\n".join(["columns:", *lines, f"several ranks: {MULTI_RANK_RULE}"])


# The columns of `deep-ep bench --host` (deep_ep.bench.host)
HOST_COLUMNS = """columns (--host):
  host wall us: the call's wall time from entry to return, on a drained stream (no GPU wait unless the call waits)
  moved us: the host wall with new addresses every call (inputs cycled through copies, results kept), so that a
    replay's graph has its kernels' parameters set again each call
  host CPU us: the calling thread's CPU time over that span (virtual ranks: waits for the interpreter left out)
  eager wall us: the call, then a wait until its stream is idle
  release us: dropping the call's results right after it returned (frees; the caller's time, not in host wall)
  GPU us: device time per call from CUDA-graph replays (n/a: a dispatch with CPU sync, or no GPU)
  count wait us: a CPU-sync dispatch's wait on the host for its counts (the kernel's launch and count phase)
  target us: issue 19's host-time targets on one H200: fresh dispatch without CPU sync 30, cached and combine 20,
    CPU-sync dispatch its count wait + 30; met or missed by the host wall, then by the moved wall
floor of this run (deep_ep.bench.host_floor), per case: an empty kernel's launch (each call launches two), one
  allocation from torch's caching allocator, and the bench's wall for a call that does nothing
several ranks: every time is the slowest rank's median"""
