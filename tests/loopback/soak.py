"""Soak: many dispatch + combine iterations on one world of virtual ranks, with its buffers created
once, watching for leaks and for any difference from the reference.

    python3 tests/loopback/soak.py --iterations 10000 [--ranks 4] [--check-every N] [--json FILE]

Every iteration changes shape and mode: tokens per rank (0 on every rank, the maximum on every rank,
or a mix), hidden size, top-k and dtype (BF16, FP8 with FP32 or UE8M0 scales, as in `sweep.py`),
experts per rank, expand or not, expert alignment, a cached dispatch or not, CPU sync on or off,
top-k weights into dispatch and combine or not, and which buffer pair (`allow_multiple_reduction`).
On the first, the last and every `--check-every`-th iteration the reference buffer makes the same
calls and every output is compared bitwise; the others run the kernels only.

At the end of the warm-up, every `--sample-every` iterations and at the end, rank 0 samples the
process while every rank waits between two barriers, its streams drained: device memory (torch's
allocated and reserved bytes, the driver's free memory, and what the device holds outside torch),
host RSS, open file descriptors, OS threads, and live Python objects (tensors, CUDA events and
graphs, event handles, dispatch handles). The run fails when, from the warm-up's end to the end,
any of them grew by more than its entry in `leaks.TOLERANCES`.

Without a GPU (or with `--device cpu`) the world is CPU threads and both buffers run the reference
backend: that tests the soak itself and the reference's own leaks, not the kernels.
"""

from __future__ import annotations

import argparse
import random
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from runinfo import provenance, use_checkout, write_json

use_checkout()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from kernel_checks import check_dispatch, equal  # noqa: E402
from leaks import MIB, TOLERANCES, find_growth, sample_process  # noqa: E402
from sweep import LOCAL_EXPERTS, SHAPES, kernel_specs, make_buffers, num_max_tokens  # noqa: E402

import deep_ep.loopback  # noqa: E402  (sets the CUDA settings of virtual ranks before CUDA starts)
from deep_ep.host_reads import wait_for_stream  # noqa: E402
from deep_ep.utils.fp8 import per_token_cast_to_fp8  # noqa: E402
from deep_ep.utils.routing import uniform_routing  # noqa: E402


@dataclass(frozen=True)
class SoakConfig:
    """One soak: `iterations` on `num_ranks` ranks, comparing every `check_every`-th with the reference."""

    num_ranks: int
    iterations: int
    check_every: int
    warmup: int
    sample_every: int
    seed: int
    max_tokens: int
    max_local_experts: int
    backends: tuple[str, str]


def iteration_plan(
    num_ranks: int, index: int, seed: int, max_tokens: int, max_local_experts: int = 64
) -> dict[str, Any]:
    """The shape and mode of iteration `index` (the same on every rank; `tokens[r]` is rank r's T).
    Every eighth iteration has no tokens anywhere, the one after it the maximum everywhere. Experts
    per rank are at most `max_local_experts` where the top-k allows it."""
    rng = random.Random(seed * 1_000_003 + index)
    hidden, num_topk, dtypes = rng.choice(SHAPES[num_ranks])
    if index % 8 == 0:
        tokens = [0] * num_ranks
    elif index % 8 == 1:
        tokens = [max_tokens] * num_ranks
    else:
        tokens = [rng.choice((0, max_tokens)) if rng.random() < 0.2 else rng.randint(1, max_tokens)
                  for _ in range(num_ranks)]  # fmt: skip
    feasible = [e for e in LOCAL_EXPERTS if e * num_ranks >= num_topk]
    expand = rng.random() < 0.5
    return dict(
        index=index, tokens=tokens, hidden=hidden, num_topk=num_topk, dtype=rng.choice([d for d in dtypes if d in DTYPES]),
        num_local_experts=rng.choice([e for e in feasible if e <= max_local_experts] or feasible[:1]),
        masked=rng.choice((0.0, 0.25)), alignment=rng.choice((1, 128)), expand=expand,
        zero_padding=expand and rng.random() < 0.3, cached=rng.random() < 0.4, cpu_sync=rng.random() < 0.6,
        dispatch_weights=rng.random() < 0.7, combine_weights=rng.random() < 0.5,
        multiple_reduction=rng.random() < 0.5,
    )  # fmt: skip


def should_check(index: int, iterations: int, check_every: int) -> bool:
    """Whether iteration `index` is compared with the reference: the first, the last, every `check_every`-th."""
    return index == 0 or index == iterations - 1 or (index + 1) % check_every == 0


def _drain(device: torch.device) -> None:
    # Polling, not a blocking wait: a peer's launch must not queue behind this thread in the driver
    if device.type == "cuda":
        wait_for_stream()


# Blocks of random values are made on the device: the host would take longer than the kernels (the
# largest no-sync outputs have 24576 rows of 7168 at EP4), and a whole-size FP32 temporary could
# outgrow what the world reserved for the rank's stream (a cudaMalloc there stalls the peers)
_BLOCK_ELEMENTS = 1 << 21


def wide_rows(num_rows: int, hidden: int, gen: torch.Generator) -> torch.Tensor:
    """`[num_rows, hidden]` BF16 values like `sweep.wide_bf16` (FP32 sums of them depend on the order),
    made on `gen`'s device a block of rows at a time."""
    y = torch.empty((num_rows, hidden), dtype=torch.bfloat16, device=gen.device)
    step = max(1, _BLOCK_ELEMENTS // max(1, hidden))
    for begin in range(0, num_rows, step):
        block = y[begin : begin + step]
        scale = torch.exp2(torch.randint(-12, 13, block.shape, generator=gen, device=gen.device).float())
        block.copy_(torch.randn(block.shape, generator=gen, device=gen.device) * scale)
    return y


# The soak makes its inputs on the device (fast over 10,000 iterations): real BF16 and FP8 values; the
# sweep's raw kinds (any dtype as bytes) are the fuzzer's
DTYPES = ("bf16", "fp32", "ue8m0")


def soak_inputs(rank: int, num_ranks: int, plan: dict[str, Any], seed: int, device: torch.device) -> tuple:
    """`(x, topk_idx, topk_weights, gen)` of one rank for `plan`: x BF16 or FP8 with scales, and the
    device generator that also makes the combine's inputs."""
    num_tokens, num_experts = plan["tokens"][rank], plan["num_local_experts"] * num_ranks
    topk_idx, weights = uniform_routing(num_tokens, num_experts, plan["num_topk"], masked_ratio=plan["masked"],
                                        generator=seed * 131 + plan["index"] * 17 + rank, device=device)  # fmt: skip
    gen = torch.Generator(device=device).manual_seed(seed * 7919 + plan["index"] * 31 + rank)
    x = torch.randn((num_tokens, plan["hidden"]), generator=gen, device=device).to(torch.bfloat16)
    if plan["dtype"] != "bf16":
        x = per_token_cast_to_fp8(x, use_ue8m0=plan["dtype"] == "ue8m0")
    return x, topk_idx, weights, gen


def run_iteration(buffers: dict, rank: int, num_ranks: int, plan: dict[str, Any], seed: int, check: bool) -> None:
    """One iteration on one rank: a fresh dispatch, maybe a cached one, a combine; with `check`, the
    reference makes the same calls and the outputs are compared bitwise (raises `AssertionError`)."""
    pair = buffers[plan["multiple_reduction"]]
    used = pair if check else pair[:1]
    device = pair[0].device
    num_experts = plan["num_local_experts"] * num_ranks
    x, topk_idx, weights, gen = soak_inputs(rank, num_ranks, plan, seed, device)
    weights = weights if plan["dispatch_weights"] else None
    modes = dict(do_expand=plan["expand"], do_zero_padding=plan["zero_padding"])
    fresh = [b.dispatch(x, topk_idx=topk_idx, topk_weights=weights, num_experts=num_experts,
                        expert_alignment=plan["alignment"], do_cpu_sync=plan["cpu_sync"], **modes)
             for b in used]  # fmt: skip
    _drain(device)
    runtime = getattr(pair[0].backend, "runtime", None)
    if runtime is not None:
        runtime.check_error()  # a device failure explains a difference best
    if check:
        check_dispatch(fresh[0], fresh[1], plan["expand"], plan["zero_padding"], "fresh dispatch")
    if plan["cached"]:
        cached = [
            b.dispatch(x, handle=out[3], topk_weights=weights, **modes) for b, out in zip(used, fresh, strict=True)
        ]
        if check:
            _drain(device)
            check_dispatch(cached[0], cached[1], plan["expand"], plan["zero_padding"], "cached dispatch")
    handle = fresh[0][3]
    num_rows = handle.num_expanded_tokens if plan["expand"] else handle.num_recv_tokens
    y = wide_rows(num_rows, plan["hidden"], gen)
    y_weights = None
    if plan["combine_weights"]:
        shape = (num_rows,) if plan["expand"] else (num_rows, plan["num_topk"])
        y_weights = torch.rand(shape, generator=gen, device=device)
    combined = [b.combine(y, out[3], topk_weights=y_weights) for b, out in zip(used, fresh, strict=True)]
    _drain(device)
    if runtime is not None:
        runtime.check_error()
    if check:
        equal(combined[0][0], combined[1][0], "combined_x")
        equal(combined[0][1], combined[1][1], "combined_topk_weights")


def _sample_point(rank: int, group: Any, device: torch.device, samples: list, index: int, phase: str,
                  started: float, on_sample: Callable[[], None] | None) -> None:  # fmt: skip
    """Every rank drained and waiting: rank 0 samples the process (then calls `on_sample`)."""
    _drain(device)
    dist.barrier(group=group)
    if rank == 0:
        values = sample_process(device)
        samples.append(dict(iteration=index, phase=phase, seconds=round(time.monotonic() - started, 2), **values))
        shown = {k: values[k] for k in ("device_allocated_bytes", "host_rss_bytes", "open_fds", "threads",
                                        "live_tensors") if k in values}  # fmt: skip
        print(f"[{time.monotonic() - started:7.1f} s] iteration {index} ({phase}): {shown}", flush=True)
        if on_sample is not None:
            on_sample()
    dist.barrier(group=group)


def soak_rank(rank: int, group: Any, config: SoakConfig, samples: list,
              on_sample: Callable[[], None] | None = None) -> dict[str, float]:  # fmt: skip
    """Every iteration on one rank, on buffers created once; rank 0 appends its samples to `samples`
    (calling `on_sample` after each). Returns the number and seconds of checked and of kernels-only
    iterations."""
    num_ranks = group.size()
    buffers = make_buffers(group, num_ranks, backends=config.backends, max_tokens=config.max_tokens)
    device = buffers[True][0].device
    times = dict(checked=0, checked_s=0.0, plain=0, plain_s=0.0)
    started = time.monotonic()
    try:
        for index in range(config.iterations):
            if index >= config.warmup and (index - config.warmup) % config.sample_every == 0:
                phase = "warm-up end" if index == config.warmup else "periodic"
                _sample_point(rank, group, device, samples, index, phase, started, on_sample)
            plan = iteration_plan(num_ranks, index, config.seed, config.max_tokens, config.max_local_experts)
            check = should_check(index, config.iterations, config.check_every)
            begin = time.monotonic()
            try:
                run_iteration(buffers, rank, num_ranks, plan, config.seed, check)
            except Exception as error:
                raise AssertionError(f"iteration {index} ({'checked' if check else 'kernels only'}), rank {rank}, "
                                     f"seed {config.seed}, plan {plan}: {error}") from error  # fmt: skip
            kind = "checked" if check else "plain"
            times[kind] += 1
            times[f"{kind}_s"] += time.monotonic() - begin
        _sample_point(rank, group, device, samples, config.iterations, "end", started, on_sample)
    finally:
        for pair in buffers.values():
            for buffer in pair:
                buffer.destroy()
    return times


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--iterations", type=int, default=10_000)
    add("--ranks", type=int, default=4, choices=sorted(SHAPES))
    add(
        "--check-every",
        type=int,
        default=25,
        help="compare with the reference every N iterations (and the first and last)",
    )
    add("--warmup", type=int, default=50, help="iterations before the first sample")
    add("--sample-every", type=int, default=0, help="iterations between samples (0: a twentieth of the run)")
    add("--seed", type=int, default=None, help="default: a fresh one, printed")
    add("--max-tokens", type=int, default=0, help="the largest T (0: the buffers' maximum)")
    add("--max-local-experts", type=int, default=max(LOCAL_EXPERTS), help="the most experts per rank")
    add("--rss-tolerance-mib", type=int, default=TOLERANCES["host_rss_bytes"] // MIB, help="allowed RSS growth")
    add("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    add("--timeout", type=float, default=3600.0, help="seconds for the whole run")
    add("--json", default=None, help="write the result (samples, provenance) here")
    return parser


def parse_config(argv: list[str]) -> tuple[argparse.Namespace, SoakConfig]:
    """The command line and the soak it asks for (a fresh seed unless `--seed`); exits on a bad request."""
    parser = _parser()
    args = parser.parse_args(argv)
    limit = num_max_tokens(args.ranks)
    max_tokens = args.max_tokens or limit
    if (
        not 1 <= max_tokens <= limit
        or min(args.check_every, args.max_local_experts) < 1
        or not 0 <= args.warmup < args.iterations
    ):
        parser.error(
            f"need 1 <= --max-tokens <= {limit}, --check-every and --max-local-experts >= 1, 0 <= --warmup < --iterations"
        )
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1_000_000)
    sample_every = args.sample_every or max(1, (args.iterations - args.warmup) // 20)
    backends = ("kernels", "reference") if args.device == "cuda" else ("reference", "reference")
    config = SoakConfig(args.ranks, args.iterations, args.check_every, args.warmup, sample_every, seed, max_tokens,
                        args.max_local_experts, backends)  # fmt: skip
    return args, config


def rerun_command(argv: list[str], seed: int) -> str:
    """The command line that repeats a run exactly: its arguments with the seed it drew."""
    kept, skip = [], False
    for arg in argv:
        if skip or arg.startswith("--seed="):
            skip = False
            continue
        skip = arg == "--seed"
        if not skip:
            kept.append(arg)
    return shlex.join(["python3", "tests/loopback/soak.py", *kept, "--seed", str(seed)])


def _projection(times: dict[str, float]) -> dict[str, float] | None:
    """Seconds 10,000 iterations would take at this run's rates, per `--check-every`, to choose it from."""
    if not times["plain"] or not times["checked"]:
        return None
    plain, checked = times["plain_s"] / times["plain"], times["checked_s"] / times["checked"]
    return {f"check every {n}": round(10_000 * plain + 10_000 // n * (checked - plain), 1) for n in (1, 10, 25, 50)}


def main(argv: list[str] | None = None) -> int:
    """Run the soak; 0 when every check passed and nothing grew, 1 otherwise, 2 for a bad request."""
    argv = sys.argv[1:] if argv is None else argv
    args, config = parse_config(argv)
    tolerances = dict(TOLERANCES, host_rss_bytes=args.rss_tolerance_mib * MIB)
    print(f"soak: seed {config.seed}, {config.num_ranks} virtual ranks on {args.device}, {config.iterations} "
          f"iterations, T up to {config.max_tokens}, {config.backends[0]} against {config.backends[1]} on the first, "
          f"the last and every {config.check_every}th", flush=True)  # fmt: skip
    started = time.monotonic()
    if args.device == "cuda":
        from deep_ep.jit import compile_many

        compile_many(kernel_specs(config.num_ranks))
    compiled_s = time.monotonic() - started
    world = deep_ep.loopback.LoopbackWorld(config.num_ranks, device=args.device)
    samples: list[dict[str, Any]] = []
    base = dict(provenance("tests/loopback/soak.py", argv), config=asdict(config), device=args.device,
                tolerances=tolerances)  # fmt: skip

    def checkpoint() -> None:
        write_json(args.json, dict(base, passed=None, complete=False, samples=samples), quiet=True)

    error, times = None, None
    try:
        times = world.run(soak_rank, config, samples, checkpoint, timeout_s=args.timeout)[0]
    except deep_ep.loopback.LoopbackRankError as failure:
        # The rank's own assertion names the iteration; the others only stopped because of it
        origin = next((e for e in failure.errors if isinstance(e, AssertionError)), None)
        error = str(origin if origin is not None else failure)
    finally:
        world.close()
    seconds = time.monotonic() - started - compiled_s
    problems = find_growth(samples, tolerances) if error is None else []
    rerun = rerun_command(argv, config.seed)
    if error is not None:
        print(f"FAILED: {error}\nrerun: {rerun} (add --check-every 1 to find the first iteration that differs)")
    for problem in problems:
        print(f"LEAK: {problem}")
    projection = _projection(times) if times is not None else None
    if projection is not None:
        print(f"per iteration: kernels only {1e3 * times['plain_s'] / times['plain']:.1f} ms, checked "
              f"{1e3 * times['checked_s'] / times['checked']:.1f} ms; 10,000 iterations would take (s): {projection}")  # fmt: skip
    passed = error is None and not problems
    print(f"soak {'PASSED' if passed else 'FAILED'}: {len(samples)} samples, {seconds:.1f} s (+{compiled_s:.1f} s "
          f"compiling), seed {config.seed}", flush=True)  # fmt: skip
    write_json(args.json, dict(
        base, passed=passed, complete=True, error=error, leaks=problems, rerun=rerun, seconds=round(seconds, 1),
        compile_seconds=round(compiled_s, 1), times=times, projection=projection, samples=samples,
    ))  # fmt: skip
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
