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
