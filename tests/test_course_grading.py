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


def test_a_test_file_that_cannot_be_imported_fails_the_grade(tmp_path):
    # A learner's IndentationError makes a whole test file fail to import: its checks never run, so the
    # grade must not read "7/7 checks pass" from the files that did (a learner run's finding).
    (tmp_path / "test_01_another.py").write_text("def test_fine():\n    pass\n")
    results = grade_all(tmp_path, "import broken_module_of_yours\n\ndef test_never_runs():\n    pass\n",
                        "--continue-on-collection-errors")
    failed = [r for r in results if r["outcome"] == "failed"]
    assert [r["outcome"] for r in results].count("passed") == 1 and len(failed) == 1, results
    assert failed[0]["reason"].startswith("cannot import test_01_example.py: none of its checks ran"), failed[0]


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
                                 "__import__('course.catalog').catalog.MODULES['01'])[1].title.split(': ', 1)[1])\n")
    assert unfinished["hint"] == "python main.py hint 01 2", unfinished
    wrong = grade(tmp_path, "import pytest\n\n@pytest.mark.exercises('train_step')\ndef test_value():\n    assert False\n")
    assert wrong["hint"] == "python main.py hint 01 2", wrong


def test_a_check_that_exercises_several_todos_points_at_the_first_it_lists():
    # The test's author lists the functions it grades most directly first (module 05: TODO 1 is
    # forward_step, TODO 4 one_f_one_b).
    from course.hints import hint_command_for
    assert hint_command_for("05", "one_f_one_b, forward_step") == "python main.py hint 05 4"
    assert hint_command_for("05", "forward_step, one_f_one_b") == "python main.py hint 05 1"


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


LONG = ("the order of calls differs at event 12: got gather(3) before release(1), expected release(1) first; "
        "a buffer is reused only after its layer is released, so the gather into it must wait for that release")


def test_a_failure_message_is_kept_whole_and_wrapped_never_cut(tmp_path):
    # Every line of the message, and nothing of pytest's explanation of the assert (what it compared).
    result = grade(tmp_path, f"def test_order():\n    x = [1, 2]\n    assert x == [1, 3], {LONG!r} + '\\nsecond line'\n")
    assert result["reason"] == f"AssertionError: {LONG}\nsecond line", result["reason"]
    from course.grading import scorecard_line
    lines = scorecard_line(result, width=60).splitlines()
    assert lines[0] == "  FAIL  test_order" and lines[-1] == "        second line", lines
    assert all(len(line) <= 60 for line in lines[1:-1]) and len(lines) > 4, lines
    assert " ".join(line.strip() for line in lines[1:-1]) == f"AssertionError: {LONG}", "a word was cut or lost"


def test_the_hint_points_at_the_todo_the_message_names_first(tmp_path):
    # The marker lists the likeliest culprit first (TODO 1 here); a message that says which of the
    # learner's functions fed the check ("your train_step", or Class.method) moves it to the front.
    source = ("import pytest\n\n@pytest.mark.exercises('PartTwo.__init__', 'train_step')\n"
              "def test_value():\n    assert False, {!r}\n")
    named = grade(tmp_path, source.format("the loss is off: the gradient your train_step hands back is twice too big"))
    assert named["hint"] == "python main.py hint 01 2", named
    unnamed = grade(tmp_path, source.format("the loss is off by a factor of 2"))
    assert unnamed["hint"] == "python main.py hint 01 1", unnamed


def test_in_order_of_blame_ranks_what_was_run_then_what_is_named():
    from course.grading import in_order_of_blame
    names = ["FlatLayout.shard", "ShardedWeights.get", "ShardedWeights.release", "fsdp_traffic"]
    assert in_order_of_blame(names, "", "no name here") == names
    assert in_order_of_blame(names, "", "ShardedWeights.release reset the layer; see also your fsdp_traffic") == \
        ["ShardedWeights.release", "fsdp_traffic", "FlatLayout.shard", "ShardedWeights.get"]
    # A bare word that is also a method's short name ("get", "shard") is not a name: only "your get" is.
    assert in_order_of_blame(names, "", "get the shard first") == names
    assert in_order_of_blame(names, "fsdp_traffic-2", "your get") == \
        ["fsdp_traffic", "ShardedWeights.get", "FlatLayout.shard", "ShardedWeights.release"]
    # Raised in the learner's own code: the function it was raised in first, then its caller.
    raised = ("IndexError: index 9 is out of bounds (at steps/m07_sharded_weights.py:88 in release <- "
              "steps/m07_fsdp.py:120 in get; raised in given code at course/checks.py:3 in check)")
    assert in_order_of_blame(names, "fsdp_traffic-2", raised) == \
        ["ShardedWeights.release", "ShardedWeights.get", "fsdp_traffic", "FlatLayout.shard"]


def _raise_through(monkeypatch, files: list[str], functions: list[str] | None = None):
    """An error raised in the last of `files` (paths under the repository), called from each before it;
    the functions are f0 (the innermost), f1, ... unless `functions` names them (outermost first)."""
    monkeypatch.setenv("COURSE_IMPL", "steps")
    monkeypatch.delenv("COURSE_STEPS_DIR", raising=False)
    names = list(reversed(functions)) if functions else [f"f{depth}" for depth in range(len(files))]
    namespace, caller = {}, None
    for depth, name in enumerate(reversed(files)):
        body = "raise ValueError('bad spec')" if depth == 0 else f"{names[depth - 1]}()"
        exec(compile("\n" * (10 * depth) + f"def {names[depth]}():\n    {body}\n", str(REPO / name), "exec"),
             namespace)
        caller = names[depth]
    try:
        namespace[caller]()
    except ValueError as exc:
        return exc


def test_a_failure_shows_the_learners_own_frame_first(monkeypatch):
    from course.launch import where_raised
    # Raised in given code (m13_specs.py has no TODOs), called from the learner's two files.
    error = _raise_through(monkeypatch, ["steps/m13_llama_2d.py", "steps/m13_named_axes.py", "steps/m13_specs.py"])
    assert where_raised(error) == (" (at steps/m13_named_axes.py:12 in f1 <- steps/m13_llama_2d.py:22 in f2; "
                                   "raised in given code at steps/m13_specs.py:2 in f0)")
    # Raised in the learner's file: as before, that frame, then the learner's caller in another file.
    error = _raise_through(monkeypatch, ["steps/m12_tp_model.py", "steps/m12_vocab_parallel.py"])
    assert where_raised(error) == " (at steps/m12_vocab_parallel.py:2 in f0 <- steps/m12_tp_model.py:12 in f1)"
    # The reference called by a test as a trusted helper is not the learner's code.
    error = _raise_through(monkeypatch, ["steps/m12_tp_model.py", "solutions/m12_vocab_parallel.py"])
    assert where_raised(error) == (" (at steps/m12_tp_model.py:12 in f1; raised in given code at "
                                   "solutions/m12_vocab_parallel.py:2 in f0)")
    # Given code inside a learner's file (module 11's StageComms._check): the learner's function first.
    error = _raise_through(monkeypatch, ["steps/m11_executor.py", "steps/m11_executor.py"], ["run_action", "_check"])
    assert where_raised(error) == (" (at steps/m11_executor.py:12 in run_action; raised in given code at "
                                   "steps/m11_executor.py:2 in _check)")


def test_an_error_a_check_raises_from_the_learners_is_located_where_theirs_was(monkeypatch):
    # A learner run (module 17): a check that names the piece it ran ("your LlamaStage.forward raised ...", raised
    # from the learner's error) was located "in the check's own code, in piece", not in the learner's frames.
    from course.launch import where_raised
    cause = _raise_through(monkeypatch, ["steps/m17_stage.py", "steps/m12_tp_model.py"])
    try:
        raise RuntimeError(f"your LlamaStage.forward raised ValueError: {cause}") from cause
    except RuntimeError as error:
        where = where_raised(error)
    assert where == " (at steps/m12_tp_model.py:2 in f0 <- steps/m17_stage.py:12 in f1)", where


def test_a_helper_the_learner_defines_inside_a_todo_is_theirs(monkeypatch, tmp_path):
    # A learner run: a helper named `forward` inside module 05's one_f_one_b was reported as given code,
    # because the reference has a given function of that name.
    from course.launch import where_raised
    steps = tmp_path / "steps"
    steps.mkdir()
    monkeypatch.setenv("COURSE_IMPL", "steps")
    monkeypatch.setenv("COURSE_STEPS_DIR", str(steps))
    source = "def one_f_one_b():\n    def forward():\n        raise IndexError('list index out of range')\n" \
             "    forward()\n"
    (steps / "m05_schedules.py").write_text(source)
    namespace = {}
    exec(compile(source, str(steps / "m05_schedules.py"), "exec"), namespace)
    try:
        namespace["one_f_one_b"]()
    except IndexError as error:
        where = where_raised(error)
    assert "given code" not in where and "m05_schedules.py:3 in forward" in where, where


def test_an_error_from_the_learners_code_in_the_check_itself_says_where(tmp_path):
    # Raised in pytest's process (not in a rank, whose error says where itself): their line, in steps/.
    from course.skeleton import generate
    steps = tmp_path / "skeleton" / "steps"
    steps.mkdir(parents=True)
    for name, text in generate().items():
        (steps / name).write_text(text)
    source = ("from types import SimpleNamespace\nfrom course.impl import load\n\ndef test_step():\n"
              "    load('m01_manual_split').train_step(None, None, SimpleNamespace(zero_grad=lambda: None), None, None)\n")
    result = grade(tmp_path, source, COURSE_IMPL="steps", COURSE_STEPS_DIR=str(steps))
    assert re.fullmatch(r"NotImplementedError: TODO\(m01\): .* \(at .*steps/m01_manual_split\.py:\d+ in train_step\)",
                        result["reason"]), result["reason"]


def test_a_stuck_rank_shows_the_learners_own_frame_first(monkeypatch):
    # A rank stuck in given code (a collective's wait) is reported at the learner's line that called it.
    from course.launch import _innermost_course_frames
    monkeypatch.setenv("COURSE_IMPL", "steps")
    monkeypatch.delenv("COURSE_STEPS_DIR", raising=False)
    dump = "\n".join(["Stack (most recent call first):",
                      f'  File "{REPO}/course/collectives.py", line 120 in all_gather',
                      f'  File "{REPO}/steps/m07_sharded_weights.py", line 110 in gather',
                      f'  File "{REPO}/steps/m07_fsdp.py", line 130 in backward_blocks',
                      f'  File "{REPO}/course/launch.py", line 300 in _rank_main'])
    assert _innermost_course_frames(dump) == ("steps/m07_sharded_weights.py:110 in gather <- steps/m07_fsdp.py:130 in "
                                              "backward_blocks; stuck in given code at course/collectives.py:120 in "
                                              "all_gather")
    learners_first = dump.replace("course/collectives.py", "steps/m02_comms.py")
    assert _innermost_course_frames(learners_first).startswith("steps/m02_comms.py:120 in all_gather <- steps/m07")


CHECK_EXCHANGE = ("rank 1 of 4 raised ValueError: member 0 receives 3 rows from member 1 by its recv_splits, but 1 "
                  "sends 2; take them from the counts you received (at solutions/m16_expert_parallel.py:{line} in "
                  "check_exchange)")


def test_a_frame_in_the_reference_is_shown_where_the_learner_has_it(tmp_path, monkeypatch):
    # Issue 37.4: a check that runs given code from the reference (module 16's check_exchange) reported its
    # error at solutions/m16_expert_parallel.py:85, a file the learner never needs to open.
    from types import SimpleNamespace

    from course.grading import as_in_steps, failure_reason
    from course.skeleton import skeleton_file, todo_blocks
    source = (REPO / "solutions" / "m16_expert_parallel.py").read_text().splitlines()
    line = next(n for n, text in enumerate(source, start=1) if "receives {int(recv[t])} rows" in text)
    message = CHECK_EXCHANGE.format(line=line)
    monkeypatch.setenv("COURSE_IMPL", "steps")
    steps = tmp_path / "steps"
    steps.mkdir()
    skeleton = skeleton_file("\n".join(source) + "\n", "m16_expert_parallel.py")
    for mine in (skeleton, "# my notes\n" * 5 + skeleton):  # as generated, then 5 lines longer above it
        (steps / "m16_expert_parallel.py").write_text(mine)
        monkeypatch.setenv("COURSE_STEPS_DIR", str(steps))
        shown = as_in_steps(message)
        at = int(re.search(r"at steps/m16_expert_parallel\.py:(\d+) in check_exchange\)$", shown)[1])
        assert mine.splitlines()[at - 1] == source[line - 1], shown
    report = SimpleNamespace(outcome="failed", longrepr=SimpleNamespace(reprcrash=SimpleNamespace(message=message)))
    assert "solutions/" not in failure_reason(report) and "steps/m16_expert_parallel.py:" in failure_reason(report)
    # In the reference's own answer to a TODO: no file to open, only whose code it is.
    [block] = [b for b in todo_blocks("\n".join(source), "m16_expert_parallel.py") if b.function == "plan_exchange"]
    inside = as_in_steps(f"boom (at solutions/m16_expert_parallel.py:{block.end - 1} in plan_exchange)")
    assert inside == "boom (at the check's reference plan_exchange)", inside
    monkeypatch.setenv("COURSE_IMPL", "solutions")  # grading the reference: its own files, as they are
    assert as_in_steps(message) == message


def test_an_error_raised_in_the_checks_own_code_shows_no_tests_path(tmp_path):
    # A learner run's finding: module 01's check said "raised in given code at tests/test_01_manual_split.py:61
    # in check_boundary" (its hook on part two, called from their train_step), inviting them into tests/.
    # The same mistake here: part two handed the activation itself, not a leaf.
    import shutil
    steps = tmp_path / "steps"
    shutil.copytree(REPO / "solutions", steps, ignore=shutil.ignore_patterns("__pycache__"))
    mine = steps / "m01_manual_split.py"
    mine.write_text(mine.read_text().replace("received = hidden.detach().requires_grad_()", "received = hidden"))
    report = tmp_path / "grades.json"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_01_manual_split.py",
                    "-k", "test_gradients_cross_the_boundary_exactly and 16", "--impl=steps", f"--grading-json={report}"],
                   cwd=REPO, capture_output=True, text=True, env={**os.environ, "COURSE_STEPS_DIR": str(steps)},
                   timeout=120)
    [result] = json.loads(report.read_text())
    assert result["outcome"] == "failed" and "tests/" not in result["reason"], result
    assert re.search(r"\(at \S*steps/m01_manual_split\.py:\d+ in train_step; raised in the check's own code, in "
                     r"check_boundary\)$", result["reason"]), result["reason"]


def test_no_form_of_a_frame_in_tests_reaches_the_scorecard():
    # A rank's error raised by the check itself, a stuck rank, a check stopped in its own loop, a test
    # file that cannot be imported: each says "the check's own code", never a path into tests/.
    from types import SimpleNamespace

    from course.grading import failure_reason, scorecard_line
    messages = [
        "rank 0 of 2 raised AssertionError: gpipe returned None (at tests/test_05_schedules.py:62 in _train)",
        "rank 1 of 2 raised AssertionError: bad shape (at steps/m05_schedules.py:70 in forward_step; raised in given "
        "code at tests/test_05_schedules.py:167 in _check_receive)",
        "RankTimeout: timed out after 3 s; still running: rank 0, 1. rank 0 at steps/m05_schedules.py:3 in gpipe <- "
        f"{REPO}/tests/test_05_schedules.py:62 in _train; rank 1 stuck in given code at tests/moe_checks.py:9 in check",
        "CheckTimeout: this check ran for over 180 s and was stopped at tests/test_04_sharded.py:3 in test_relay",
    ]
    for message in messages:
        report = SimpleNamespace(outcome="failed", longrepr=SimpleNamespace(reprcrash=SimpleNamespace(message=message)))
        reason = failure_reason(report)
        assert "tests/" not in reason and "test_05_schedules.py" not in reason and "the check's own code, in " in reason, \
            reason
    assert "steps/m05_schedules.py:70 in forward_step; raised in the check's own code, in _check_receive)" in \
        failure_reason(SimpleNamespace(outcome="failed", longrepr=SimpleNamespace(
            reprcrash=SimpleNamespace(message=messages[1]))))
    line = scorecard_line({"test": "tests/test_05_schedules.py", "outcome": "failed",
                           "reason": "cannot import the checks' file test_05_schedules.py: none of its checks ran"})
    assert "tests/" not in line, line


def test_a_checks_file_that_cannot_be_imported_is_said_in_the_count(capsys):
    # A learner run: an indentation error in their file left "10/18 checks pass", and the learner read it as
    # checks dropped from the count. The line says what the failed entry stands for.
    from course.catalog import MODULES
    from course.grade import _scorecard
    results = [{"test": f"t.py::test_{k}", "outcome": "passed", "reason": ""} for k in range(3)]
    results.append({"test": "tests/test_05_schedules.py", "outcome": "failed", "hint": None,
                    "reason": "cannot import the checks' file test_05_schedules.py: none of its checks ran"})
    assert _scorecard(MODULES["05"], "steps", results, 1) == 1
    line = next(line for line in capsys.readouterr().out.splitlines() if "checks pass" in line)
    assert line.startswith("3/4 checks pass (a checks' file that could not be imported counts as one failed check: "
                           "its checks did not run)"), line
