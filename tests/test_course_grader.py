"""The grader can fail: every graded test must fail on the untouched skeleton, because of a TODO.

Two checks, each running graded tests in a subprocess against skeletons generated into a temporary
directory (so a learner's work in steps/ never affects them):
* the learner's starting point, every module a skeleton: every graded test fails fast on a TODO;
* one module at a time a skeleton, the others solved: each of its graded tests fails on one of
  *its own* TODOs, so a module's grade measures that module's code.
Both are long checks (`python -m pytest -m long`, run by .ci/run after the suite): the first re-runs
every graded test once more (about 85 s on two cores, a quarter of the suite's 6-minute budget), the
second runs one pytest per module. The second's subprocesses run four at a time: much of each one's
time is starting Python and waiting for its ranks, so on two cores four together finish in about
half the time of one after another.
"""
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from course.skeleton import REPO, generate

SKELETONS = generate()
MODULES_WITH_TODOS = sorted({name[1:3] for name, text in SKELETONS.items() if "raise NotImplementedError(" in text})


def grade(tmp: Path, skeleton_modules: set[str], test_files: list[str]) -> list[dict]:
    """Run the graded tests in `test_files` against a steps/ in which only `skeleton_modules` are
    skeletons (the rest is the reference); return the scorecard's results."""
    steps = tmp / "steps"
    steps.mkdir()
    for name, text in SKELETONS.items():
        solved = name[1:3] not in skeleton_modules or not name.startswith("m")
        (steps / name).write_text((REPO / "solutions" / name).read_text() if solved else text)
    report = tmp / "grades.json"
    env = {**os.environ, "COURSE_STEPS_DIR": str(steps), "COURSE_IMPL": "steps"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *test_files, "-q", "-p", "no:cacheprovider", "-m", "not given",
         "--impl=steps", f"--grading-json={report}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert report.exists(), f"the graded tests did not run:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(report.read_text())


def not_failed_on(results: list[dict], todo: str) -> list[str]:
    return [f"{r['test']}: {r['outcome']} ({r['reason'][:200]})" for r in results
            if r["outcome"] != "failed" or "NotImplementedError" not in r["reason"] or todo not in r["reason"]]


@pytest.fixture(scope="module")
def skeleton_results(tmp_path_factory) -> list[dict]:
    """The scorecard of the learner's starting point: every module a skeleton."""
    return grade(tmp_path_factory.mktemp("grade-all"), set(MODULES_WITH_TODOS), ["tests"])


@pytest.fixture(scope="module")
def graded_alone(tmp_path_factory) -> dict:
    """Each module's scorecard with only that module a skeleton (the others solved), by number.
    One pytest per module: most of each one's time is starting Python and collecting, so this is a
    long check (`python -m pytest -m long`, the second step of .ci/run)."""
    runs = {number: ({number}, [str(p) for p in sorted((REPO / "tests").glob(f"test_{number}_*.py"))])
            for number in MODULES_WITH_TODOS}
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {key: pool.submit(grade, tmp_path_factory.mktemp(f"grade-{key}"), modules, files)
                   for key, (modules, files) in runs.items()}
        return {key: future.result() for key, future in futures.items()}


@pytest.mark.long
def test_the_skeleton_fails_every_graded_test_because_of_a_todo(skeleton_results):
    assert skeleton_results, "no graded test was collected"
    wrong = not_failed_on(skeleton_results, "TODO(m")
    assert not wrong, "graded tests that did not fail on a TODO:\n" + "\n".join(wrong)


@pytest.mark.long
def test_graded_tests_exist_for_every_module_with_todos(skeleton_results):
    graded_modules = {r["test"].split("/")[-1][5:7] for r in skeleton_results}
    missing = sorted(set(MODULES_WITH_TODOS) - graded_modules)
    assert not missing, f"modules with TODOs but no graded test: {missing}"


@pytest.mark.long
@pytest.mark.parametrize("number", MODULES_WITH_TODOS)
def test_each_module_is_graded_on_its_own_todos(number, graded_alone):
    results = graded_alone[number]
    wrong = not_failed_on(results, f"TODO(m{number})")
    assert results and not wrong, f"module {number}'s graded tests that did not fail on its own TODO:\n" + "\n".join(wrong)
