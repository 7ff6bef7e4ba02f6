"""README.md's examples: the `ExpertParallelMoE` snippet runs as written on 2 CPU ranks (torchrun, gloo).

The test takes the code block from README.md itself, so README and test cannot drift apart.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
MOE_HEADING = "## An expert-parallel MoE layer in plain PyTorch"


def python_block(section: str) -> str:
    """The first ```python block after the README heading `section`."""
    text = README.read_text()
    start = text.index(section)
    match = re.search(r"```python\n(.*?)```", text[start:], re.DOTALL)
    assert match is not None, f"no python block after {section!r} in README.md"
    return match.group(1)


def test_readme_moe_snippet_is_device_neutral() -> None:
    code = python_block(MOE_HEADING)
    assert "torch.cuda.is_available()" in code
    assert '"gloo"' in code
    compile(code, "README.md", "exec")


def test_readme_moe_snippet_runs_on_cpu_ranks(tmp_path: Path) -> None:
    script = tmp_path / "moe.py"
    script.write_text(python_block(MOE_HEADING))
    env = os.environ | {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // 2))}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def table_row(text: str, variable: str) -> str:
    """The effect column of `variable`'s row in a Markdown table."""
    (row,) = [line for line in text.splitlines() if line.startswith(f"| `{variable}` |")]
    return row.strip("|").split("|")[1].strip()


def test_readme_and_jit_doc_give_the_nvcc_lookup_order_of_the_code() -> None:
    from deep_ep.jit import compiler

    jit_doc = (README.parent / "docs" / "jit.md").read_text()
    readme_row = table_row(README.read_text(), "EP_JIT_NVCC_COMPILER")
    assert readme_row == table_row(jit_doc, "EP_JIT_NVCC_COMPILER")
    order = ["$CUDA_HOME/bin/nvcc", "`nvcc` on `PATH`", str(compiler._DEFAULT_NVCC)]
    assert [readme_row.index(item) for item in order] == sorted(readme_row.index(item) for item in order)


def test_readme_says_what_the_cpu_suite_needs_and_names_deep_ep_jit() -> None:
    text = README.read_text()
    assert "needs nvcc and the CUDA" in text and "skipped with that reason" in text
    assert "`deep-ep jit warmup --ranks" in text
