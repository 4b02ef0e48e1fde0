"""The grading plugin (course/grading.py): what a scorecard line says about a failed check."""
import json
import os
import re
import subprocess
import sys

from course.skeleton import REPO


def grade_all(tmp_path, test_source: str, *options, **env) -> list[dict]:
    """Run graded checks (a file named like tests/test_01_*) under the plugin; their results."""
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["course.grading"]\n')
    (tmp_path / "test_01_example.py").write_text(test_source)
    report = tmp_path / "grades.json"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                    str(tmp_path), f"--grading-json={report}", *options], cwd=tmp_path, capture_output=True,
                   text=True, env={**os.environ, "PYTHONPATH": str(REPO), **env}, timeout=60)
    return json.loads(report.read_text())


def grade(tmp_path, test_source: str, **env) -> dict:
    """Run one graded check under the plugin; its result."""
    [result] = grade_all(tmp_path, test_source, **env)
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


HANG_THEN_PASS = ("def test_hangs():\n    raise RuntimeError('timed out after 20 s; still running: rank 0')\n\n"
                  "def test_would_hang_too():\n    pass\n")


def test_grading_stops_after_the_first_check_that_hangs(tmp_path):
    # A deadlock usually hangs the checks after it too, each for its whole timeout: the scorecard
    # stops after the first (main.py grade passes --grading-stop-on-hang unless --keep-going).
    results = grade_all(tmp_path, HANG_THEN_PASS, "--grading-stop-on-hang")
    assert [r["test"].split("::")[1] for r in results] == ["test_hangs"], results
    assert len(grade_all(tmp_path, HANG_THEN_PASS)) == 2, "without the option every check runs"


def test_a_failed_check_names_the_hint_for_its_todo(tmp_path):
    # The TODO a NotImplementedError names, or the functions a check declares it exercises.
    unfinished = grade(tmp_path, "def test_todo():\n    raise NotImplementedError("
                                 "'TODO(m01): ' + __import__('course.hints').hints.module_todos("
                                 "__import__('course.catalog').catalog.MODULES['01'])[2].title.split(': ', 1)[1])\n")
    assert unfinished["hint"] == "python main.py hint 01 3", unfinished
    wrong = grade(tmp_path, "import pytest\n\n@pytest.mark.exercises('train_step')\ndef test_value():\n    assert False\n")
    assert wrong["hint"] == "python main.py hint 01 3", wrong


def test_a_check_that_exercises_several_todos_points_at_the_first_it_lists():
    # The test's author lists the functions it grades most directly first (module 05: TODO 1 is
    # forward_step, TODO 5 one_f_one_b).
    from course.hints import hint_command_for
    assert hint_command_for("05", "one_f_one_b, forward_step") == "python main.py hint 05 5 (it also exercises TODOs 1)"
    assert hint_command_for("05", "forward_step, one_f_one_b") == "python main.py hint 05 1 (it also exercises TODOs 5)"


def test_every_graded_test_names_the_todos_it_exercises():
    # The scorecard points a failed check at `python main.py hint NN K` through this marker, so every
    # graded test declares the functions (holding TODOs of its own module) whose code it grades.
    import importlib.util

    from course.catalog import MODULES
    from course.hints import module_todos

    wrong = []
    for test_file in sorted(REPO.glob("tests/test_[0-9][0-9]_*.py")):
        number = test_file.name[5:7]
        if number == "00" or number not in MODULES:
            continue
        functions = {name for block in module_todos(MODULES[number])
                     for name in (block.function, block.function.rsplit(".", 1)[-1])}
        spec = importlib.util.spec_from_file_location(f"_marks_of_{test_file.stem}", test_file)
        tests = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(tests)
        module_marks = getattr(tests, "pytestmark", [])
        if any(mark.name == "given" for mark in (module_marks if isinstance(module_marks, list) else [module_marks])):
            continue
        for name, function in vars(tests).items():
            if not name.startswith("test_") or not callable(function):
                continue
            marks = getattr(function, "pytestmark", [])
            if any(mark.name == "given" for mark in marks):
                continue
            named = [arg for mark in marks if mark.name == "exercises" for arg in mark.args]
            if not named or set(named) - functions:
                wrong.append(f"{test_file.name}::{name} exercises {named or 'nothing declared'}")
    assert not wrong, ("graded tests without @pytest.mark.exercises(...) naming functions that hold their module's "
                       "TODOs:\n" + "\n".join(wrong))
