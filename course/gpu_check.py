"""For tests with a GPU part. The pytest process must never touch CUDA (ranks forked from it could
not use it; conftest.py hides the GPUs from it), so the CUDA part runs in a child process that gets
the GPUs back; without an NVIDIA GPU the test is skipped."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from course.fork_safety import environment_with_gpus

needs_gpu = pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="needs an NVIDIA GPU")


def run_cuda_check(test_file: str, function: str, timeout: float = 300):
    """Call `function` of the test module `test_file` in a child process; fail with its last error line."""
    path = Path(test_file).resolve()
    code = f"import sys; sys.path.insert(0, {str(path.parent)!r}); import {path.stem}; {path.stem}.{function}()"
    child = subprocess.run([sys.executable, "-c", code], cwd=path.parent.parent, env=environment_with_gpus(),
                           capture_output=True, text=True, timeout=timeout)
    last_line = (child.stderr.strip().splitlines() or ["no error output"])[-1]
    assert child.returncode == 0, f"CUDA check failed: {last_line}"

