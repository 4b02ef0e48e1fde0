"""The grading plugin (course/grading.py): what a scorecard line says about a failed check."""
import json
import os
import re
import subprocess
import sys

from course.skeleton import REPO


def grade(tmp_path, test_source: str, **env) -> dict:
    """Run one graded check (a file named like tests/test_01_*) under the plugin; its result."""
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["course.grading"]\n')
    (tmp_path / "test_01_example.py").write_text(test_source)
    report = tmp_path / "grades.json"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                    str(tmp_path), f"--grading-json={report}"], cwd=tmp_path, capture_output=True, text=True,
                   env={**os.environ, "PYTHONPATH": str(REPO), **env}, timeout=60)
    [result] = json.loads(report.read_text())
    return result


def test_a_check_stuck_in_a_loop_is_stopped_and_says_where(tmp_path):
    result = grade(tmp_path, "def test_an_endless_loop():\n    while True:\n        pass\n",
                   COURSE_CHECK_TIMEOUT_S="1")
    assert result["outcome"] == "failed"
    assert "ran for over 1 s and was stopped at" in result["reason"], result["reason"]
    assert re.search(r"test_01_example.py:[23] in test_an_endless_loop", result["reason"]), result["reason"]


def test_a_tensor_mismatch_says_how_many_and_how_far(tmp_path):
    result = grade(tmp_path, "import torch\n\ndef test_close():\n"
                             "    torch.testing.assert_close(torch.ones(3), torch.tensor([1.0, 2.0, 1.0]))\n")
    assert result["reason"].startswith("AssertionError: Tensor-likes are not close!"), result["reason"]
    assert "Mismatched elements: 1 / 3" in result["reason"] and "Greatest absolute difference: 1.0" in result["reason"]
