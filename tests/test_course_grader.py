"""The grader can fail: every graded test must fail on the untouched skeleton, because of a TODO.

The graded suite runs in a subprocess against a skeleton freshly generated into a temporary
directory, so a learner's work in steps/ never affects this check.
"""
import json
import os
import subprocess
import sys

import pytest

from course.skeleton import REPO, generate


@pytest.fixture(scope="module")
def skeleton_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("skeleton")
    steps = tmp / "steps"
    steps.mkdir()
    for name, text in generate().items():
        (steps / name).write_text(text)
    report = tmp / "grades.json"
    env = {**os.environ, "COURSE_STEPS_DIR": str(steps), "COURSE_IMPL": "steps"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "tests", "-q", "-p", "no:cacheprovider", "-m", "not given",
         "--impl=steps", f"--grading-json={report}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert report.exists(), f"the graded suite did not run:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(report.read_text())


def test_the_skeleton_fails_every_graded_test_because_of_a_todo(skeleton_results):
    assert skeleton_results, "no graded test was collected"
    wrong = [f"{r['test']}: {r['outcome']} ({r['reason'][:200]})" for r in skeleton_results
             if r["outcome"] != "failed" or "NotImplementedError" not in r["reason"] or "TODO(m" not in r["reason"]]
    assert not wrong, "graded tests that did not fail on a TODO:\n" + "\n".join(wrong)


def test_graded_tests_exist_for_every_module_with_todos(skeleton_results):
    graded_modules = {r["test"].split("/")[-1][5:7] for r in skeleton_results}
    with_todos = {name[1:3] for name, text in generate().items() if "raise NotImplementedError(" in text}
    assert with_todos <= graded_modules, f"modules with TODOs but no graded test: {sorted(with_todos - graded_modules)}"
