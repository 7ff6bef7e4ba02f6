"""The `deep-ep` command: `info`, `jit {list,clear,warmup}`, `bench`, `calibrate` and `plan`.

Every subcommand registers itself through one function taking the argparse subparsers; add new
ones (`bench`, `plan`) to `register_commands`. `info` must work on any machine, GPU or not, and
never crash: anything missing is printed as "not found" (or "none").
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import platform
import re
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

NOT_FOUND = "not found"


def _try(produce: Callable[[], str], missing: str = NOT_FOUND) -> str:
    """Run one probe of `info`; whatever fails prints as `missing` (with the reason, briefly)."""
    try:
        return produce()
    except Exception as error:  # info must never crash
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return f"{missing} ({reason[:100]})"


def _try_quiet(produce: Callable[[], str], missing: str) -> str:
    """Like `_try`, without the reason (e.g. "no driver" is the normal state of a CPU machine)."""
    try:
        return produce()
    except Exception:
        return missing


def _human_bytes(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size} B"


def _version(distribution: str) -> str:
    return importlib.metadata.version(distribution)


def _torch_line() -> str:
    import torch

    return torch.__version__


def _cuda_runtime_line() -> str:
    import torch

    return torch.version.cuda or "none (CPU build of torch)"


def _driver_line() -> str:
    from cuda.bindings import driver

    status, version = driver.cuDriverGetVersion()
    if status != driver.CUresult.CUDA_SUCCESS or not version:
        return "none"
    return f"{version // 1000}.{version % 1000 // 10}"


def _nvcc_line() -> str:
    from deep_ep.jit import compiler

    nvcc = compiler.find_nvcc()
    return f"{compiler.nvcc_release(nvcc)} ({nvcc})"


def _nccl_lines() -> list[tuple[str, str]]:
    from deep_ep.jit import nccl_headers

    def library() -> str:
        install = nccl_headers.find_nccl()
        runtime = nccl_headers.runtime_version(install)
        loaded = nccl_headers.loaded_libraries()
        return f"{nccl_headers.version_string(runtime)} ({loaded[0] if loaded else install.lib_path}; {install.origin})"

    def headers() -> str:
        install = nccl_headers.find_nccl()
        return f"{nccl_headers.version_string(install.header_version)} ({install.include_dir})"

    return [("NCCL library", _try(library)), ("NCCL headers", _try(headers))]


def _nvlink_lines(count: int) -> list[str]:
    """NVLink topology through pynvml (nvidia-ml-py) when importable, else `nvidia-smi topo -m`."""
    try:
        import pynvml
    except ImportError:
        pynvml = None
    if pynvml is not None:
        pynvml.nvmlInit()
        try:
            bus_to_index = {}
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            for index, handle in enumerate(handles):
                bus_to_index[pynvml.nvmlDeviceGetPciInfo(handle).busId] = index
            lines = []
            for index, handle in enumerate(handles):
                peers: dict[str, int] = {}
                for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
                    try:
                        if pynvml.nvmlDeviceGetNvLinkState(handle, link) != pynvml.NVML_FEATURE_ENABLED:
                            continue
                        remote = pynvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId
                    except pynvml.NVMLError:
                        continue
                    peer = bus_to_index.get(remote)
                    name = f"GPU{peer}" if peer is not None else "switch/other"
                    peers[name] = peers.get(name, 0) + 1
                links = ", ".join(f"{n} x{c}" for n, c in sorted(peers.items())) or "no active links"
                lines.append(f"GPU{index}: NVLink {links}")
            return lines
        finally:
            pynvml.nvmlShutdown()
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return ["NVLink topology: not found (no pynvml, no nvidia-smi)"]
    result = subprocess.run([smi, "topo", "-m"], capture_output=True, text=True, timeout=30, check=False)
    if result.returncode != 0:
        return [f"NVLink topology: not found (nvidia-smi topo -m: {result.stderr.strip()[:100]})"]
    return [line.rstrip() for line in result.stdout.splitlines() if line.strip() and not line.startswith("Legend")][:16]


def _gpu_lines() -> list[str]:
    import torch

    if not torch.cuda.is_available():
        return ["none"]
    lines = []
    count = torch.cuda.device_count()
    for index in range(count):
        props = torch.cuda.get_device_properties(index)
        lines.append(
            f"GPU{index}: {props.name}, sm_{props.major}{props.minor}, {props.multi_processor_count} SMs, "
            f"{props.total_memory / 2**30:.0f} GiB"
        )
    try:
        lines += _nvlink_lines(count)
    except Exception as error:
        lines.append(f"NVLink topology: not found ({str(error)[:100]})")
    return lines


def _cache_line() -> str:
    from deep_ep.jit import cache

    entries, size = cache.usage()
    return f"{cache.root()} ({entries} entries, {_human_bytes(size)})"


def _arch_line() -> str:
    from deep_ep.jit import compiler, env
    from deep_ep.jit import errors as jit_errors

    configured = env.value(env.ARCH)
    if configured is not None:
        return f"{compiler.parse_arch(configured).name} (from {env.ARCH})"
    try:
        return f"{compiler.resolve_arch().name} (from the GPU)"
    except jit_errors.JITError:
        return f"none (no GPU; set {env.ARCH}, e.g. sm_90a, to compile)"


def _transport_line() -> str:
    """Which transport the kernels would use here, and why: an NCCL group of every GPU of this host,
    and virtual ranks on one GPU; where neither applies, the reference backend."""
    import torch

    if not torch.cuda.is_available():
        return "none: CUDA is not available, so buffers use the reference backend (torch collectives)"
    from deep_ep.backends.kernels.transport import choose_nccl_transport

    num_devices = torch.cuda.device_count()
    choice = choose_nccl_transport(num_devices)
    gpus = "the one GPU" if num_devices == 1 else f"all {num_devices} GPUs"
    group = f"an NCCL group of {gpus}: " + (
        f"{choice.name} ({choice.reason})" if choice.supported else f"the reference backend ({choice.reason})"
    )
    return (
        f"{group}; virtual ranks on one GPU (deep_ep.loopback): loopback (with virtual nodes, the other nodes "
        "through the emulated NIC); groups across hosts: see scale-out"
    )


def _scale_out_line() -> str:
    """What a group across hosts would get here: the loaded NCCL against GIN's floor (no GPU needed)."""
    from deep_ep.backends.kernels.nccl.gin import scale_out_version_error
    from deep_ep.backends.kernels.transport import loaded_nccl_version
    from deep_ep.jit.nccl_headers import version_string

    version = loaded_nccl_version()
    if version is None:
        return "the reference backend: no NCCL library could be loaded"
    error = scale_out_version_error(version)
    if error is not None:
        return f"the reference backend: {error}"
    return (
        f"the reference backend with backend='auto'; with backend='kernels', nccl_gin (direct mode over NCCL "
        f"{version_string(version)}'s GIN, >= 2.30.4; never run on a NIC here, docs/transport.md); virtual nodes "
        "(deep_ep.loopback): the kernels, across nodes through the emulated NIC"
    )


def _cuda_python_line() -> str:
    """The `cuda-python` meta package is optional: `cuda-bindings` (`cuda.bindings`) is what we call."""
    try:
        return _version("cuda-python")
    except Exception:
        bindings = _version("cuda-bindings")  # raises, and so reads "not found", when neither is there
        return f"not installed as a package; its cuda-bindings {bindings} is (what deep_ep calls)"


def _steady_line() -> str:
    """Whether buffers on the kernels take the steady path (deep_ep.backends.kernels.steady), without building it."""
    import sysconfig

    from deep_ep.backends.kernels.steady import ENV_SWITCH, steady_enabled

    if not steady_enabled():
        return f"off ({ENV_SWITCH}=0): every call takes the Python path"
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not headers.exists():
        return f"off: no {headers} to build it with (install python3-dev); every call takes the Python path"
    return "on: repeated shapes replay in C++ (built with the JIT at the first buffer)"


def cmd_info(args: argparse.Namespace) -> int:
    """Print versions, GPUs and the JIT cache; never fails."""
    import deep_ep

    rows: list[tuple[str, str]] = [
        ("deep_ep", f"{deep_ep.__version__} ({Path(deep_ep.__file__).resolve().parent})"),
        ("python", f"{platform.python_version()} ({sys.executable})"),
        ("torch", _try(_torch_line)),
        ("CUDA runtime", _try(_cuda_runtime_line)),
        ("CUDA driver", _try_quiet(_driver_line, "none")),
        ("nvcc", _try(_nvcc_line)),
        *_nccl_lines(),
        ("cuda-python", _try(_cuda_python_line)),
        ("cuda-bindings", _try(lambda: _version("cuda-bindings"))),
        ("cuda-core", _try(lambda: _version("cuda-core"))),
        ("transport", _try(_transport_line)),
        ("scale-out", _try(_scale_out_line)),
        ("steady path", _try(_steady_line)),
        ("JIT cache", _try(_cache_line)),
        ("JIT arch", _try(_arch_line, "not set")),
    ]
    width = max(len(name) for name, _ in rows) + 2
    for name, value in rows:
        print(f"{name:<{width}}{value}")
    gpu_lines = [_try(lambda: "\n".join(_gpu_lines()), "none")]
    print(f"{'GPUs':<{width}}" + gpu_lines[0].replace("\n", "\n" + " " * width))
    return 0


def cmd_jit_list(args: argparse.Namespace) -> int:
    """List the JIT cache entries: kind, name, arch, size, date, key."""
    from deep_ep.jit import cache

    found = cache.entries()
    print(f"{cache.root()}: {len(found)} entries")
    for entry in found:
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(entry.metadata.get("created", 0)))
        arch = entry.metadata.get("arch", "host")
        print(
            f"  {entry.kind:<8}{entry.name:<48} {arch:<9}{_human_bytes(entry.metadata['size']):>10}  {created}  {entry.key[:12]}"
        )
    return 0


def cmd_jit_clear(args: argparse.Namespace) -> int:
    """Delete every JIT cache entry."""
    from deep_ep.jit import cache

    print(f"removed {cache.clear()} entries from {cache.root()}")
    return 0


def default_warmup_specs() -> list[Any]:
    """The kernels to warm up when `deep_ep.backends.kernels.specs` (the library's kernel specs) is absent."""
    from deep_ep.jit import KernelSpec
    from deep_ep.paths import get_include_dir

    return [
        KernelSpec(
            header="deep_ep/kernels/peer_store.cuh",
            name="deep_ep::peer_store_impl",
            template_args=(512,),
            param_types=("char*", "int", "int", "uint64_t", "const int4*", "uint64_t"),
            include_dirs=(str(get_include_dir()),),
        )
    ]


def warmup_specs(**shape: Any) -> list[Any]:
    """`deep_ep.backends.kernels.specs.warmup_specs(**shape)` when that module exists, else `default_warmup_specs()`."""
    if importlib.util.find_spec("deep_ep.backends.kernels.specs") is not None:
        return list(importlib.import_module("deep_ep.backends.kernels.specs").warmup_specs(**shape))
    return default_warmup_specs()


def _warmup_shape(args: argparse.Namespace) -> dict[str, Any]:
    """The MoE shape `deep-ep jit warmup` was given, checked as `ElasticBuffer` would check it."""
    from deep_ep.backends.kernels.layout import MAX_RANKS

    given = {name: getattr(args, name) for name in ("ranks", "hidden", "topk", "experts")}
    if all(value is None for value in given.values()):
        return {}
    ranks = given["ranks"] or 2
    hidden = given["hidden"] or 7168
    topk, experts = given["topk"] or 8, given["experts"] or 256
    if not 1 <= ranks <= MAX_RANKS:
        raise ValueError(f"jit warmup: `--ranks` must be in [1, {MAX_RANKS}], got {ranks}")
    if hidden % 16:
        raise ValueError(f"jit warmup: `--hidden` must be a multiple of 16 (rows of 16-byte vectors), got {hidden}")
    if experts % ranks:
        raise ValueError(f"jit warmup: `--experts` must be a multiple of `--ranks` ({ranks}), got {experts}")
    if not 1 <= topk <= experts:
        raise ValueError(f"jit warmup: `--topk` must be in [1, --experts={experts}], got {topk}")
    return dict(num_ranks=ranks, hiddens=(hidden,), num_topk=topk, num_experts=experts)


def cmd_jit_warmup(args: argparse.Namespace) -> int:
    """Compile the library's kernels into the cache in parallel (ninja), with a progress bar."""
    from deep_ep.jit import compile_many, stats

    specs = warmup_specs(**_warmup_shape(args))
    if args.filter:
        pattern = re.compile(args.filter)
        specs = [spec for spec in specs if pattern.search(spec.display_name)]
    if args.dry_run:
        from deep_ep.jit import cache, plan_build

        for spec in specs:
            cached = cache.lookup("kernels", plan_build(spec, arch=args.arch).key) is not None
            print(f"  {'cached ' if cached else 'missing'} {spec.display_name}")
        print(f"{len(specs)} kernels")
        return 0
    started = time.perf_counter()
    before = stats().get("compile", 0)
    entries = compile_many(specs, arch=args.arch, jobs=args.jobs, progress=not args.no_progress)
    compiled = stats().get("compile", 0) - before
    print(
        f"{len(entries)} kernels ready ({compiled} compiled, {len(entries) - compiled} cached) in {time.perf_counter() - started:.1f} s"
    )
    return 0


def register_info(subparsers: Any) -> None:
    """`deep-ep info`."""
    parser = subparsers.add_parser(
        "info", help="print versions (torch, CUDA, nvcc, NCCL, cuda-python), GPUs and the JIT cache"
    )
    parser.set_defaults(handler=cmd_info)


def register_jit(subparsers: Any) -> None:
    """`deep-ep jit {list,clear,warmup}`."""
    parser = subparsers.add_parser("jit", help="inspect, clear or fill the JIT kernel cache")
    actions = parser.add_subparsers(dest="jit_command", required=True, metavar="{list,clear,warmup}")
    actions.add_parser("list", help="list cached kernels and host shims").set_defaults(handler=cmd_jit_list)
    actions.add_parser("clear", help="delete every cache entry").set_defaults(handler=cmd_jit_clear)
    warmup = actions.add_parser(
        "warmup",
        help="compile the kernels of one MoE shape in parallel (ninja)",
        description="Kernels are specialised on the rank count, hidden size, top-k and experts per rank: give "
        "the shape your job runs (e.g. --ranks 8 --hidden 7168 --topk 8 --experts 256) and every kernel it can "
        "launch (BF16 and FP8 dispatch, both layouts, combine) is compiled. Without a shape: the 2-rank shapes "
        "of the GPU tests and the benchmark (hidden 2048 and 7168, top-8, 256 experts).",
    )
    warmup.add_argument("--ranks", type=int, default=None, help="ranks of the expert-parallel group (default 2)")
    warmup.add_argument("--hidden", type=int, default=None, help="hidden size (default 7168)")
    warmup.add_argument("--topk", type=int, default=None, help="experts per token (default 8)")
    warmup.add_argument("--experts", type=int, default=None, help="experts in all (default 256)")
    warmup.add_argument("--arch", default=None, help="target such as sm_90a (default: EP_JIT_ARCH, else the GPU)")
    warmup.add_argument("--jobs", type=int, default=None, help="parallel nvcc processes (default: CPU count)")
    warmup.add_argument("--no-progress", action="store_true", help="no progress bar")
    warmup.add_argument("--filter", default=None, help="only kernels whose name matches this regular expression")
    warmup.add_argument("--dry-run", action="store_true", help="list the kernels and whether they are cached")
    warmup.set_defaults(handler=cmd_jit_warmup)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(item) for item in text.split(",") if item.strip()]
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from error
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _checked(convert: Callable[[str], Any], accept: Callable[[Any], bool], expected: str) -> Callable[[str], Any]:
    """An argparse type: `convert` the text and `accept` the value, else an error saying what was `expected`."""

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from error
        if not accept(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


_positive_int = _checked(int, lambda value: value >= 1, "a positive integer")
_fraction = _checked(float, lambda value: 0.0 <= value <= 1.0, "a number in [0, 1] (a share of the tokens)")


def _choice_list(choices: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        values = [item.strip() for item in text.split(",") if item.strip()]
        wrong = [v for v in values if v not in choices]
        if not values or wrong:
            raise argparse.ArgumentTypeError(f"expected comma-separated values from {', '.join(choices)}, got {text!r}")
        return values

    return parse


def cmd_bench(args: argparse.Namespace) -> int:
    """Run the dispatch/combine benchmark on whatever is present (see `deep_ep.bench.runner`)."""
    import deep_ep.loopback  # noqa: F401  (before CUDA starts: the CUDA settings virtual ranks need)
    from deep_ep.bench import cases, runner

    if args.op != "moe":
        return _bench_side_op(args)
    config = cases.default_config(sms=args.sms, tokens=args.tokens, dtypes=args.dtype, routings=args.routing,
                                  num_ranks=args.ranks, min_ranks=1 if args.host else 2)  # fmt: skip
    if args.iters is not None:
        config.num_iters = args.iters
    if args.samples is not None:
        config.num_graph_samples = args.samples
    if args.seed is not None:
        config.seed = args.seed
    config.graphs = config.graphs and not args.no_graphs
    config.breakdown = args.breakdown
    config.host_profile = args.profile
    config.host_soak_calls = args.soak or 0
    if args.soak and not args.host:
        raise ValueError("bench: `--soak` repeats the calls of `--host`; add --host")
    config.host_graph_ab_rounds = args.graph_ab or 0
    if args.graph_ab and not args.host:
        raise ValueError("bench: `--graph-ab` times the calls of `--host`; add --host")
    config.hot_fraction = args.hot_fraction
    if args.profile and not args.host:
        raise ValueError("bench: `--profile` profiles the calls of `--host`; add --host")
    if args.profile and config.virtual_ranks and config.num_ranks > 1:
        raise ValueError(
            f"bench: `--profile` with virtual ranks needs `--ranks` 1, got {config.num_ranks}: virtual ranks are "
            "threads of one process, which take turns in the interpreter, and cProfile (Python >= 3.12) sees them all"
        )
    if args.nodes is not None:
        options = (("--host", args.host), ("--sms", args.sms), ("--plot", args.plot), ("--breakdown", args.breakdown))
        if given := [name for name, value in options if value]:
            raise ValueError(
                f"bench: `--nodes` counts the bytes of the planner's SM pick, without host times, plots or a "
                f"breakdown; drop {', '.join(given)}"
            )
    if args.host:
        options = (("--sms", args.sms), ("--plot", args.plot), ("--breakdown", args.breakdown))
        if given := [name for name, value in options if value]:
            raise ValueError(
                f"bench: `--host` times the planner's SM pick, without plots or a breakdown; drop {', '.join(given)}"
            )
    runner.check_config(config)
    if args.nodes is not None:
        from deep_ep.bench import nodes

        nodes.check_nodes(config, args.nodes)
    if config.device == "cuda":
        from deep_ep.jit import compile_many

        print("deep-ep bench: compiling the kernels (cached ones load at once)", file=sys.stderr)
        compile_many(nodes.kernel_specs(config) if args.nodes is not None else cases.kernel_specs(config, "lsa"),
                     progress=True)  # fmt: skip
    command = " ".join(["deep-ep", *sys.argv[1:]])
    if args.nodes is not None:
        nodes.run_nodes(config, args.nodes, json_path=args.json, command=command)
    elif args.host:
        from deep_ep.bench import host

        host.run_host(config, json_path=args.json, command=command)
    else:
        runner.run(config, json_path=args.json, plot_path=args.plot, command=command)
    return 0


def _bench_side_op(args: argparse.Namespace) -> int:
    """`deep-ep bench --op agrs|pp|engram`: the side operations against torch collectives on virtual
    ranks (deep_ep.bench.agrs, .pp, .engram)."""
    import torch

    from deep_ep.bench import agrs, engram, pp

    op = args.op
    options = (("--sms", args.sms), ("--tokens", args.tokens), ("--dtype", args.dtype), ("--routing", args.routing),
               ("--host", args.host), ("--nodes", args.nodes is not None), ("--plot", args.plot),
               ("--breakdown", args.breakdown))  # fmt: skip
    if given := [name for name, value in options if value]:
        what = {"agrs": "AGRS", "pp": "PP", "engram": "Engram"}[op]
        raise ValueError(f"bench: `--op {op}` times {what} calls of fixed sizes; drop {', '.join(given)}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    num_ranks = args.ranks or 4
    if num_ranks < 2:
        raise ValueError(f"bench: `--op {op}` needs `--ranks` >= 2, got {num_ranks}")
    run, gpu_sizes, cpu_sizes = {
        "agrs": (agrs.run_agrs, agrs.DEFAULT_SIZES, (4 << 10, 64 << 10)),
        "pp": (pp.run_pp, pp.DEFAULT_SIZES, (4 << 10, 64 << 10)),
        "engram": (engram.run_engram, engram.DEFAULT_TOKENS, (16, 128)),
    }[op]
    num_iters = args.iters or (20 if device == "cuda" else 3)
    seed = args.seed if args.seed is not None else time.time_ns() % 1_000_000
    command = " ".join(["deep-ep", *sys.argv[1:]])
    run(num_ranks, device, gpu_sizes if device == "cuda" else cpu_sizes, num_iters, seed, json_path=args.json,
        command=command)  # fmt: skip
    return 0


def register_bench(subparsers: Any) -> None:
    """`deep-ep bench`."""
    from deep_ep.bench import DEFAULT_HOT_FRACTION, DTYPES, HOST_COLUMNS, ROUTINGS, columns_text

    parser = subparsers.add_parser(
        "bench",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"{columns_text()}\n\n{HOST_COLUMNS}",
        help="time dispatch/combine against torch all_to_all_single and the NVLink speed of light",
        description=textwrap.fill(
            "GPUs: all local GPUs with the NVLink kernels (DeepSeek-V3 shape, FP8 dispatch, BF16 combine); "
            "one GPU: the same kernels on virtual ranks sharing it (deep_ep.loopback; the times show the kernels' "
            "own cost, not NVLink); no GPUs: 2 CPU ranks with the reference backend on a small shape. Results are "
            "checked against deep_ep.reference before they are timed (on CPU ranks, where the reference is what "
            "runs, that is a self-consistency check). On GPUs every case is timed eagerly (dispatch with CPU sync, "
            "then combine) and, from CUDA-graph replays, as device time of a fresh no-sync dispatch, a cached "
            "dispatch and a combine. Each (dtype, routing, tokens) runs the planner's SM pick plus the --sms sweep.",
            100,
        ),
    )
    parser.add_argument(
        "--sms", type=_int_list, default=None, help="SM counts to sweep besides the planner's pick, e.g. 8,16,24"
    )
    parser.add_argument("--ranks", type=int, default=None,
                        help="ranks: virtual ranks on a machine with one GPU (default 4), at most the GPUs "
                             "on a machine with several (default all), CPU ranks without GPUs (default 2); at "
                             "least 2, 1 with --host")  # fmt: skip
    parser.add_argument("--tokens", type=_int_list, default=None, help="tokens per rank, e.g. 8192,4096,128")
    parser.add_argument("--dtype", type=_choice_list(DTYPES), default=None,
                        help="dispatch dtypes: fp8 (per-128 FP32 scales), bf16, or both, e.g. fp8,bf16 (default fp8)")  # fmt: skip
    parser.add_argument("--routing", type=_choice_list(ROUTINGS), default=None,
                        help="uniform, imbalanced (one hot rank: rank 0), or both (default uniform)")  # fmt: skip
    parser.add_argument("--hot-fraction", type=_fraction, default=DEFAULT_HOT_FRACTION,
                        help="imbalanced routing: share of tokens (0 to 1) that prefer the hot rank's experts "
                             "(default %(default)s)")  # fmt: skip
    parser.add_argument("--iters", type=_positive_int, default=None,
                        help="timed eager iterations per measurement (default 30 on GPUs, 5 on CPU ranks)")  # fmt: skip
    parser.add_argument("--samples", type=_positive_int, default=None,
                        help="graph-replay samples per measurement (GPUs; default 5)")  # fmt: skip
    parser.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph timing (GPUs)")
    parser.add_argument("--breakdown", action="store_true",
                        help="per-kernel device times of the planner's cases (torch profiler; GPUs)")  # fmt: skip
    parser.add_argument("--host", action="store_true",
                        help="instead of bandwidth: what each call costs the host (wall and CPU time from entry to "
                             "return), its eager wall time and its GPU time, per operation (deep_ep.bench.host)")  # fmt: skip
    parser.add_argument("--profile", action="store_true",
                        help="with --host: profile the first rank's calls and print where their host time goes, by "
                             "area and by function (deep_ep.bench.host_profile)")  # fmt: skip
    parser.add_argument("--soak", type=_positive_int, default=None, metavar="N",
                        help="with --host: after the timed calls, N more of each operation, and the device memory "
                             "allocated before and after them (growth means a leak)")  # fmt: skip
    parser.add_argument("--graph-ab", type=_positive_int, default=None, metavar="N",
                        help="with --host: after the timed calls, N rounds of each operation alternating between "
                             "the replays' CUDA graphs and kernel-by-kernel launches, in one process (A/B)")  # fmt: skip
    parser.add_argument("--nodes", type=int, default=None, metavar="N",
                        help="instead of bandwidth: split the virtual ranks of one GPU into N virtual nodes and "
                             "count the bytes per token that cross the emulated NIC between them, measured in "
                             "direct mode and modelled for hybrid mode (deep_ep.bench.nodes)")  # fmt: skip
    parser.add_argument("--op", choices=("moe", "agrs", "pp", "engram"), default="moe",
                        help="what to time: dispatch/combine (moe, the default); or against torch collectives on "
                             "virtual ranks AGRS sessions' all-gather and reduce-scatter (agrs), pipeline send/recv "
                             "(pp) or Engram's fetch (engram): deep_ep.bench.agrs, .pp, .engram")  # fmt: skip
    parser.add_argument("--seed", type=int, default=None, help="seed of the inputs (default: from the clock)")
    parser.add_argument(
        "--json", default=None, metavar="FILE", help="write the results (with commit, command, hardware, date)"
    )
    parser.add_argument("--plot", default=None, metavar="FILE.png",
                        help="plot bandwidth vs tokens and vs SMs (the planner's pick marked)")  # fmt: skip
    parser.set_defaults(handler=cmd_bench)


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Measure the planner's rates on the local GPUs (or refit a document) and write the document."""
    from deep_ep.bench import calibrate

    settings = calibrate.CalibrationSettings()
    if args.tokens:
        settings.tokens = args.tokens
    if args.sms:
        settings.sms = args.sms
    if args.samples is not None:
        settings.num_samples = args.samples
    command = " ".join(["deep-ep", *sys.argv[1:]])
    calibrate.run(command, out=args.out, refit_path=args.refit, settings=settings)
    return 0


def register_calibrate(subparsers: Any) -> None:
    """`deep-ep calibrate`."""
    parser = subparsers.add_parser(
        "calibrate",
        help="measure the planner's link and per-SM rates on the local GPUs and write deep_ep/data/hopper.json",
        description="Needs 2+ GPUs in one NVLink domain: times our peer-store probe and CUDA-graph replays of "
        "dispatch (fresh, cached) and combine over token and SM counts, fits the planner's model "
        "(docs/planner.md) and writes the rates with their provenance. --refit FILE redoes the fit on any machine.",
    )
    parser.add_argument("--out", default=None, metavar="FILE",
                        help="where to write the document (default: the package's deep_ep/data/hopper.json)")  # fmt: skip
    parser.add_argument("--refit", default=None, metavar="FILE", help="refit the measurements of this document")
    parser.add_argument("--tokens", type=_int_list, default=None, help="tokens per rank (default 8192,4096,1024,128)")
    parser.add_argument("--sms", type=_int_list, default=None, help="SM counts (default 2..96; all SMs are added)")
    parser.add_argument("--samples", type=int, default=None, help="graph-replay samples per point (default 5)")
    parser.set_defaults(handler=cmd_calibrate)


# `deep-ep plan` warns when a buffer is larger than this per rank (an H200 has 141 GB)
PLAN_LARGE_BUFFER_BYTES = 32 << 30
# Ranks per NVLink domain when `--ranks-per-node` is not given: up to one node of 8 GPUs
DEFAULT_RANKS_PER_NODE = 8
NOT_BUILT_NOTE = (
    "not built: across nodes (RDMA) ElasticBuffer falls back to the reference backend (torch collectives) "
    "today; these rows are the model's prediction for kernels not written yet"
)


def plan_report(args: argparse.Namespace) -> dict[str, Any]:
    """The plans `deep-ep plan` prints, with the shape as the user gave it and any warnings."""
    import dataclasses

    from deep_ep import planner
    from deep_ep.records import hidden_row_error

    # The default node size depends on --ranks, so these two come first, and say when the default applied
    if not 1 <= args.ranks <= planner.MAX_RANKS:
        raise ValueError(f"plan: `--ranks` must be in [1, {planner.MAX_RANKS}], got {args.ranks}")
    ranks_per_node = args.ranks_per_node or min(args.ranks, DEFAULT_RANKS_PER_NODE)
    if args.ranks % ranks_per_node != 0:
        raise ValueError(f"plan: `--ranks` ({args.ranks}) must be a positive multiple of `--ranks-per-node` "
                         f"({ranks_per_node}{'' if args.ranks_per_node else ', the default min(ranks, 8)'})")  # fmt: skip
    shape = planner.MoEShape(args.tokens, args.hidden, args.topk, args.experts, fp8_dispatch=args.fp8)
    # The planner's checks, naming the options as typed
    planner.check_inputs(shape, args.ranks, ranks_per_node, {name: f"--{name.replace('_', '-')}"
                                                             for name in planner.PLAN_INPUT_NAMES})  # fmt: skip
    error = hidden_row_error(args.hidden, 1 if args.fp8 else 2)
    if error is not None:
        raise ValueError(f"plan: `--hidden` {error}, as dispatch requires")
    hardware = planner.detect_hardware()
    num_nodes = args.ranks // ranks_per_node
    modes = ("direct",) if num_nodes == 1 else ("direct", "hybrid")
    plans = [planner.plan(shape, args.ranks, ranks_per_node, mode, hardware) for mode in modes]
    warnings = []
    largest = max(max(p.dispatch_buffer_bytes, p.combine_buffer_bytes) for p in plans)
    if largest > PLAN_LARGE_BUFFER_BYTES:
        warnings.append(
            f"warning: a buffer of {_human_bytes(largest)} per rank (more than {_human_bytes(PLAN_LARGE_BUFFER_BYTES)}; "
            f"an H200 has 141 GB): --tokens is tokens per rank, {args.tokens} here"
        )
    return {
        "shape": {"num_ranks": args.ranks, "num_ranks_per_node": ranks_per_node, **dataclasses.asdict(shape)},
        "hardware": dataclasses.asdict(hardware),
        "plans": [p.as_dict() | {"built": num_nodes == 1} for p in plans],
        "notes": [] if num_nodes == 1 else [NOT_BUILT_NOTE],
        "warnings": warnings,
    }


def cmd_plan(args: argparse.Namespace) -> int:
    """Print the planner's SMs, QPs, buffer bytes, bottleneck and predicted times (one row per mode)."""
    import json

    report = plan_report(args)
    for warning in report["warnings"]:
        print(f"deep-ep plan: {warning}", file=sys.stderr)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    shape = report["shape"]
    ranks, per_node = shape["num_ranks"], shape["num_ranks_per_node"]
    print(f"EP{ranks} ({ranks // per_node} node{'s' if ranks > per_node else ''} x {per_node} rank{'s' if per_node > 1 else ''}), "
          f"T={args.tokens} tokens per rank, H={args.hidden}, top-{args.topk} of {args.experts} experts, "
          f"{'FP8' if args.fp8 else 'BF16'} dispatch")  # fmt: skip
    print(f"{'mode':<8} {'SMs':>4} {'QPs':>4} {'dispatch buf':>13} {'combine buf':>12} {'bottleneck':>10} "
          f"{'dispatch us':>11} {'combine us':>10} {'NVL rec/tok':>11} {'RDMA rec/tok':>12}")  # fmt: skip
    for p in report["plans"]:
        mode = p["mode"] + ("" if p["built"] else "*")
        print(f"{mode:<8} {p['num_sms']:>4} {p['num_qps']:>4} {_human_bytes(p['dispatch_buffer_bytes']):>13} "
              f"{_human_bytes(p['combine_buffer_bytes']):>12} {p['bottleneck']:>10} {p['predicted_dispatch_us']:>11.1f} "
              f"{p['predicted_combine_us']:>10.1f} {p['nvlink_records_per_token']:>11.3f} "
              f"{p['rdma_records_per_token']:>12.3f}")  # fmt: skip
    for note in report["notes"]:
        print(f"* {note}")
    print("times: predicted CUDA-graph device time per call; buf: window bytes per rank; rec/tok: records per "
          "token leaving a rank over NVLink / RDMA")  # fmt: skip
    print(f"rates: {report['hardware']['source']}")
    return 0


def register_plan(subparsers: Any) -> None:
    """`deep-ep plan` (runs anywhere: no GPU needed)."""
    parser = subparsers.add_parser(
        "plan",
        help="SMs, QPs, buffer bytes and predicted times from the bandwidth model",
        description="The planner's answer for an MoE shape (docs/planner.md): SMs, RDMA queue pairs, buffer "
        "bytes per rank, the bottleneck link and the predicted dispatch and combine times, for direct mode and, "
        "across nodes, hybrid mode. Runs anywhere (no GPU needed).",
    )
    parser.add_argument("--ranks", type=int, required=True, help="expert-parallel ranks N (1 to 2048)")
    parser.add_argument("--ranks-per-node", type=int, default=None,
                        help="ranks per NVLink domain, i.e. GPUs per node (default: min(ranks, "
                             f"{DEFAULT_RANKS_PER_NODE}))")  # fmt: skip
    parser.add_argument("--hidden", type=int, default=7168,
                        help="hidden size H in elements; a multiple of 16 with --fp8, of 8 for BF16 (default %(default)s)")  # fmt: skip
    parser.add_argument("--topk", type=int, default=8, help="experts per token K (default %(default)s)")
    parser.add_argument("--experts", type=int, default=256,
                        help="experts E, a multiple of --ranks (default %(default)s)")  # fmt: skip
    parser.add_argument("--tokens", type=int, default=8192,
                        help="tokens per rank T, the buffer's num_max_tokens_per_rank (default %(default)s)")  # fmt: skip
    parser.add_argument("--fp8", action="store_true", help="FP8 dispatch with per-128 FP32 scales (default: BF16)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(handler=cmd_plan)


def register_commands(subparsers: Any) -> None:
    """Register every subcommand. Each one is a `register_<name>(subparsers)` function."""
    register_info(subparsers)
    register_jit(subparsers)
    register_bench(subparsers)
    register_calibrate(subparsers)
    register_plan(subparsers)


def build_parser() -> argparse.ArgumentParser:
    """The `deep-ep` argument parser with every registered subcommand."""
    parser = argparse.ArgumentParser(prog="deep-ep", description="deep_ep: expert-parallel dispatch/combine tools")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    register_commands(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `deep-ep` command; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except Exception as error:
        from deep_ep.jit.errors import JITError

        if isinstance(error, (JITError, OSError, ValueError)):
            print(f"deep-ep: error: {error}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
