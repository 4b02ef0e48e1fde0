"""The grading plugin (course/grading.py): a graded check stuck in one process is stopped by its
timeout, and the scorecard says where it was stuck."""
import json
import os
import re
import subprocess
import sys

from course.skeleton import REPO

STUCK_CHECK = '''
def test_an_endless_loop():
    while True:
        pass
'''


def test_a_check_stuck_in_a_loop_is_stopped_and_says_where(tmp_path):
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["course.grading"]\n')
    (tmp_path / "test_01_stuck.py").write_text(STUCK_CHECK)  # graded (marker m01), like tests/test_01_*
    report = tmp_path / "grades.json"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                          str(tmp_path), f"--grading-json={report}"], cwd=tmp_path, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO), "COURSE_CHECK_TIMEOUT_S": "1"}, timeout=60)
    assert run.returncode == 1, run.stdout + run.stderr
    [result] = json.loads(report.read_text())
    assert result["outcome"] == "failed"
    assert "ran for over 1 s and was stopped at" in result["reason"], result["reason"]
    assert re.search(r"test_01_stuck.py:[34] in test_an_endless_loop", result["reason"]), result["reason"]
