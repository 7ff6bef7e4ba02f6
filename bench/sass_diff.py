"""Compare the machine code (SASS) of the communication kernels of this tree with those of a git revision.

    python bench/sass_diff.py REV [--ranks 8] [--hidden 7168]

Compiles every specialisation of one MoE shape (BF16 and FP8 with 1x128 scales, top-8, 256 experts;
`moe_specs` with its defaults) for sm_90a in both trees, each in its own JIT cache, and prints per
kernel the instruction counts and whether the instruction streams are identical (symbol names and
addresses aside, and telling apart code that only reads its arguments at other offsets), then the
same counts for the rank-masking variants of this tree. Shows that a
compile-time option costs nothing when it is off. Needs nvcc and cuobjdump on PATH; no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A load of a kernel argument from the constant bank: where it sits moves when the argument struct grows
_PARAM = re.compile(r"c\[0x0\]\[0x[0-9a-f]+\]")
_LIST = r"""
import json, re, subprocess, sys
from deep_ep.backends.kernels import specs
from deep_ep.jit import compile_many
ranks, hidden, masked = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
extra = {"rank_masking": True} if masked else {}
chosen = [s for s in specs.moe_specs(ranks, hidden, 8, 256, (-(-hidden // 128) * 4,), **extra) if "barrier" not in s.header]
out = {}
for spec, entry in zip(chosen, compile_many(chosen, arch="sm_90a")):
    text = subprocess.run(["cuobjdump", "-sass", str(entry.binary_path)], capture_output=True, text=True, check=True).stdout
    code = [re.sub(r"\(\*\"[^\"]*\"\*\)|_Z\w+", "SYM", m.group(1))
            for m in (re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?);", line) for line in text.splitlines()) if m]
    out[spec.header.split("/")[-1] + ":" + ",".join(map(str, spec.template_args))] = code
print(json.dumps(out))
"""


def _sass(tree: Path, ranks: int, hidden: int, masked: bool, cache: Path) -> dict[str, list[str]]:
    env = {**os.environ, "EP_JIT_CACHE_DIR": str(cache), "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, "-c", _LIST, str(ranks), str(hidden), "1" if masked else "0"], cwd=tree,
                          env=env, capture_output=True, text=True, check=True)  # fmt: skip
    return json.loads(done.stdout.splitlines()[-1])


def _by_shape(found: dict[str, list[str]]) -> dict[str, list[str]]:
    """The kernels keyed without their transport argument (the LSA kernels of a tree from before the
    transports had none), so that the same kernel of both trees meets."""
    return {re.sub(r",deep_ep::transport::Lsa$", "", key): code for key, code in found.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rev", help="the git revision to compare against (e.g. the commit before a change)")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=7168)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        old_tree = Path(scratch) / "tree"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(old_tree), args.rev], check=True
        )
        try:
            old = _sass(old_tree, args.ranks, args.hidden, False, Path(scratch) / "cache-old")
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old_tree)], check=True)
        new = _sass(ROOT, args.ranks, args.hidden, False, Path(scratch) / "cache-new")
        masked = _sass(ROOT, args.ranks, args.hidden, True, Path(scratch) / "cache-new")
    old, new, masked = (_by_shape(found) for found in (old, new, masked))
    num_same = 0
    for key, code in sorted(new.items()):
        # A revision from before rank masking has no trailing `kRankMasking` argument
        before = old.get(key, old.get(key.rsplit(",", 1)[0])) or []
        masked_code = masked[key.rsplit(",", 1)[0] + ",true"]
        if before == code:
            verdict = "identical"
        elif [_PARAM.sub("PARAM", line) for line in before] == [_PARAM.sub("PARAM", line) for line in code]:
            verdict = "identical but for kernel-argument offsets"  # a field added to the argument struct
        else:
            verdict = "differs"
        num_same += verdict != "differs"
        print(
            f"{key:58s} {args.rev[:10]} {len(before):6d}  here {len(code):6d}  {verdict:42s}  "
            f"masking on {len(masked_code):6d} ({len(masked_code) - len(code):+d})"
        )
    print(f"{num_same} of {len(new)} kernels the same instruction for instruction")


if __name__ == "__main__":
    main()
