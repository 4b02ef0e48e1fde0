"""pytest plugin behind the scorecard: one line per check, and for a failure what went wrong (the
error's whole message, wrapped; not the traceback) and the hint for the TODO most likely at fault.

Loaded by the root conftest.py. `--grading-json PATH` writes the outcomes for tools:
`python main.py grade NN` and the grader's self-check (tests/test_course_grader.py).
`--grading-live` prints each check's line as soon as it finishes, in place of pytest's progress
dots, so a learner sees which check is running when one is slow or stuck.
"""
from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import signal
import sys
import textwrap
import threading
import traceback

import pytest

from course import REPO
from course.launch import RankFailed, RankInterrupted, RankTimeout, is_learners_file, where_raised, where_running
from course.skeleton import HEADER, todo_blocks, todo_owner

GIVEN = "given"  # marker for tests of given code: not graded, not expected to fail on skeletons
EXERCISES = "exercises"  # @pytest.mark.exercises("one_f_one_b", ...): the functions whose TODOs a check grades
# A graded check running longer than this is stuck (the slowest take a few seconds on 2 cores).
# Checks that start ranks stop them sooner, with their own timeout; this one catches a loop in one
# process.
CHECK_TIMEOUT_S = float(os.environ.get("COURSE_CHECK_TIMEOUT_S", 180))


class CheckTimeout(BaseException):
    """Not an Exception, so a learner's `except Exception` cannot swallow it (like KeyboardInterrupt)."""


def pytest_addoption(parser):
    parser.addoption("--grading-json", metavar="PATH", default=None,
                     help="write each test's outcome and one-line reason to PATH (JSON)")
    parser.addoption("--grading-live", action="store_true",
                     help="print a PASS/FAIL/SKIP line per test as it finishes (main.py grade)")
    parser.addoption("--grading-stop-on-hang", action="store_true",
                     help="stop after the first check that hung (main.py grade, unless --keep-going)")


def pytest_configure(config):
    config.addinivalue_line("markers", f"{GIVEN}: tests of given code (not graded)")
    config.addinivalue_line("markers", f"{EXERCISES}(*functions): the functions whose TODOs a graded check exercises")
    for number in range(100):
        config.addinivalue_line("markers", f"m{number:02d}: tests of module {number:02d}")
    config.pluginmanager.register(Scorecard(config), "course-scorecard")
    # SIGTERM and SIGHUP (a CI job's timeout, a closed terminal) stop the suite as Ctrl-C does, so the
    # ranks of the check in flight are killed and their folder removed (killed outright, it stayed in /tmp).
    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, _as_ctrl_c)
    _stop_with_grade()


# `python main.py grade` killed outright (SIGKILL, which it cannot catch) would leave its pytest running
# without a parent, and its folder in /tmp. So grade names itself (COURSE_GRADE_PARENT: its pid; TMPDIR: its
# folder) and its pytest asks Linux for SIGTERM when grade dies (prctl's parent-death signal, as course/
# launch.py's ranks do with SIGKILL): the session stops as on Ctrl-C, its ranks are cleaned up, and pytest,
# the one left, removes grade's folder on its way out.
GRADE = {}  # "parent": grade's pid, "folder": its temporary folder (under grade only)


def _stop_with_grade():
    parent = os.environ.pop("COURSE_GRADE_PARENT", None)  # popped: a pytest that a check starts is no grade's
    if parent is None or not sys.platform.startswith("linux"):
        return
    GRADE.update(parent=int(parent), folder=os.environ.get("TMPDIR"))
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if _grade_is_gone():  # it died before the request: no signal will come
        _remove_grade_folder()
        os._exit(1)


def _grade_is_gone() -> bool:
    return bool(GRADE) and os.getppid() != GRADE["parent"]


def _remove_grade_folder():
    if GRADE.get("folder"):
        shutil.rmtree(GRADE["folder"], ignore_errors=True)


def pytest_unconfigure(config):
    if _grade_is_gone():
        _remove_grade_folder()


def _as_ctrl_c(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A signal that came while ranks ran ends their check as RankInterrupted (they are cleaned up):
    stop the session there, as pytest stops on a Ctrl-C elsewhere."""
    yield
    if call.excinfo is not None and call.excinfo.errisinstance(RankInterrupted):
        item.session.shouldstop = str(call.excinfo.value).splitlines()[0]


def pytest_collection_modifyitems(config, items):
    """tests/test_NN_topic.py -> marker mNN; module 00 and tests/test_course_*.py -> `given`."""
    for item in items:
        name = item.path.name
        match = re.match(r"test_(\d\d)_", name)
        if match:
            item.add_marker(f"m{match.group(1)}")
        if name.startswith("test_course_") or name.startswith("test_00_"):
            item.add_marker(GIVEN)
        exercised = [f for mark in item.iter_markers(EXERCISES) for f in mark.args]
        if match and exercised:  # carried to the report, where the scorecard looks up the hint
            item.user_properties.append((EXERCISES, ", ".join(exercised)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """Stop a graded check that runs too long, naming the line it was stuck on. SIGALRM interrupts
    Python code of the main thread (not a blocking C++ call); forked ranks do not inherit the timer."""
    if item.get_closest_marker(GIVEN) or threading.current_thread() is not threading.main_thread():
        yield
        return

    def stuck(signum, frame):
        raise CheckTimeout(f"this check ran for over {CHECK_TIMEOUT_S:g} s and was stopped at "
                           f"{where_running(frame)} (an endless loop?)")

    previous = signal.signal(signal.SIGALRM, stuck)
    signal.setitimer(signal.ITIMER_REAL, CHECK_TIMEOUT_S)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous if previous is not None else signal.SIG_DFL)


class Scorecard:
    """Collects one result per test: its call phase, or the setup phase that failed or skipped it."""

    def __init__(self, config):
        self.config, self.results, self.session = config, [], None
        self.path, self.live = config.getoption("--grading-json"), config.getoption("--grading-live")
        self.stop_on_hang = config.getoption("--grading-stop-on-hang")

    def pytest_sessionstart(self, session):
        self.session = session

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        """An error raised in this process by the learner's code (a rank's error says where itself):
        keep where, their own frame first, for the reason."""
        report = (yield).get_result()
        error = call.excinfo.value if call.excinfo is not None else None
        if report.failed and error is not None and not isinstance(error, (RankFailed, RankTimeout, CheckTimeout)):
            report.course_where = where_raised(error) if raised_by_code_under_test(error) else ""

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            result = {"test": report.nodeid, "outcome": report.outcome, "reason": failure_reason(report)}
            if report.outcome == "failed":
                result["hint"] = hint_for(report)
            if self.results and self.results[-1]["test"] == report.nodeid:  # a teardown that failed too
                if self.results[-1]["outcome"] != "passed":
                    return  # the first failure is the one to read
                result["reason"] = f"(in teardown) {result['reason']}"
                self.results.pop()
            self.results.append(result)
            if self.live:
                self.write(scorecard_line(result))
            if self.stop_on_hang and result["outcome"] == "failed" and hung(result["reason"]):
                # A mistake that hangs one check (a deadlock, a lost message) usually hangs the next
                # ones too, each costing its whole timeout: stop here, the learner fixes this first.
                self.session.shouldstop = "a check hung"

    def pytest_report_teststatus(self, report, config):
        """Live: no progress letter (the scorecard line replaces it); the outcome still counts."""
        if self.live and (report.when == "call" or report.outcome != "passed"):
            return report.outcome, "", ""

    def pytest_collectreport(self, report):
        """A test file that cannot even be imported (a syntax error in your code) runs none of its checks:
        it counts as one failed check, so the grade cannot pass; live, the end of the error says where and
        why."""
        if not report.failed:
            return
        lines = [line for line in report.longreprtext.strip().splitlines()
                 if not line.startswith("Hint: make sure your test modules")]  # pytest's, misleading here
        where_and_why = without_test_paths("\n".join(lines[-8:]))
        what = without_test_paths(report.nodeid)
        self.results.append({"test": report.nodeid, "outcome": "failed",
                             "reason": f"cannot import {what}: none of its checks ran\n{where_and_why}"})
        if self.live:
            self.write(f"  cannot import {what}:\n{where_and_why}")

    def write(self, text: str):
        # pytest's terminal writer is the one stream its output capturing leaves alone.
        self.config.pluginmanager.get_plugin("terminalreporter").write_line(text, flush=True)

    def pytest_sessionfinish(self, session):
        if self.path:
            with open(self.path, "w") as f:
                json.dump(self.results, f, indent=1)


def scorecard_line(result: dict, width: int | None = None) -> str:
    """'  PASS  test_name', and for a failure or skip its whole reason below it, wrapped to the
    terminal's width (never cut), then for a failure the hint command for the TODO it points at."""
    mark = {"passed": "PASS", "failed": "FAIL", "skipped": "SKIP"}[result["outcome"]]
    line = f"  {mark}  {without_test_paths(result['test'].split('::', 1)[-1])}"
    if result["reason"] and mark != "PASS":
        line += "\n" + wrapped(result["reason"], width)
    return line + (f"\n        help: {result['hint']}" if result.get("hint") else "")


def wrapped(text: str, width: int | None = None, indent: str = " " * 8) -> str:
    """Every line of `text`, indented and folded at spaces to `width` columns (the terminal's, at
    least 60): words are never cut, so a long path or number stays whole on a line of its own."""
    width = width or max(60, shutil.get_terminal_size((100, 24)).columns)
    return "\n".join(textwrap.fill(line, width, initial_indent=indent, subsequent_indent=indent,
                                   break_long_words=False, break_on_hyphens=False) or indent
                      for line in text.splitlines())


def hint_for(report) -> str | None:
    """The `python main.py hint` command for a failed check: the TODO its error names (an unfinished
    one), else the TODOs of the functions it exercises (its `exercises` marker), the likeliest culprit
    first: the function a parametrized check ran ("test_orders[zbh1-P3-M4]"), then the functions its
    message names ("your tp_traffic", "ShardedWeights.release", in the order named), then the rest
    in the marker's order of blame."""
    from course.hints import hint_command_for

    match = re.search(r"test_(\d\d)_", report.nodeid)
    if not match:
        return None
    reason = failure_reason(report)
    owner = todo_owner(reason)
    if owner:  # possibly another module's TODO that this one builds on
        return hint_command_for(owner, reason)
    exercised = dict(report.user_properties).get(EXERCISES)
    if not exercised:
        return None
    return hint_command_for(match.group(1), ", ".join(in_order_of_blame(
        [n.strip() for n in exercised.split(",")], report.nodeid.partition("[")[2], reason)))


def in_order_of_blame(names: list[str], params: str, reason: str) -> list[str]:
    """`names` (a check's exercises, listed likeliest culprit first) reordered by what this failure
    says: the ones in whose code it was raised first (the learner's frames the message shows,
    "at steps/m12_tp_model.py:88 in embedding_backward", innermost first), then the ones its
    parameters name, then the ones its message names (a qualified name such as
    "Llama2D.ffn_half_backward", or "your tp_traffic"), by where the message names them. When a given
    check raised it (check_get, say), the ones its message names come first."""
    frames = re.findall(r"(?:steps|solutions)/m\d\d_\w+\.py:\d+ in (\w+)", reason)
    raised_in = [n for f in dict.fromkeys(frames) for n in names if n.rsplit(".", 1)[-1] == f]
    names = list(dict.fromkeys(raised_in + names))
    # Given code raised it ("raised in given code at ... in check_get"): a given check knows what went
    # wrong better than the call stack does, so a function its message blames ("your gather(3) must ...")
    # goes before the functions the error passed through.
    checked = "raised in given code at" in reason
    ran = [n for n in names if n not in raised_in
           and re.search(rf"(?<!\w){re.escape(n.rsplit('.', 1)[-1])}(?!\w)", params)]

    def named_at(name: str) -> int | None:
        patterns = [rf"\byour {re.escape(name.rsplit('.', 1)[-1])}(?!\w)"]
        if "." in name:
            patterns.append(rf"(?<![\w.]){re.escape(name)}(?!\w)")
        found = [m.start() for p in patterns for m in [re.search(p, reason)] if m]
        return min(found) if found else None

    if checked:
        blamed = sorted((n for n in names if named_at(n) is not None), key=named_at)
        raised_in = blamed + [n for n in raised_in if n not in blamed]
    first = list(dict.fromkeys(raised_in + ran))
    named = sorted((n for n in names if n not in first and named_at(n) is not None), key=named_at)
    return first + named + [n for n in names if n not in first and n not in named]


def hung(reason: str) -> bool:
    """Whether a failed check's reason is a timeout (ranks stuck, or a check that ran too long)."""
    return "timed out after" in reason or "was stopped at" in reason


def raised_by_code_under_test(error: BaseException) -> bool:
    """Whether an error went through the learner's code (the check's own failed assertions need no
    location: their message says what was expected)."""
    return any(is_learners_file(frame.filename) for frame in traceback.extract_tb(error.__traceback__))


def failure_reason(report) -> str:
    """What a failed check says: its error's whole message, without what follows it (a rank's
    traceback, the stuck ranks' stacks, pytest's explanation of an assert); for a tensor mismatch,
    how many elements and how far off; for an error raised by the learner's code in this process,
    where (their own frame first), every frame in a file the learner has (`as_in_steps`). A skipped
    check: why."""
    if report.outcome == "passed":
        return ""
    if report.outcome == "skipped":
        return str(report.longrepr[2]) if isinstance(report.longrepr, tuple) else "skipped"
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    lines = text.strip().splitlines()
    if not lines:
        return "failed"
    assertion = lines[0].startswith("AssertionError")
    message = [lines[0] + getattr(report, "course_where", "")]
    for line in lines[1:]:
        if not line.strip() or line.startswith("assert "):
            break  # the message ends at a blank line, or where pytest explains a failed assert
        message.append(line[2:] if assertion and line.startswith("  ") else line)  # pytest indents its lines
    # torch.testing.assert_close says how far off after a blank line: keep how many and how much
    # (once: a rank's error repeats its message in the traceback that follows).
    details = {}
    for line in lines[len(message):]:
        for what in ("Mismatched elements", "Greatest absolute"):
            if line.strip().startswith(what):
                details.setdefault(what, line.strip())
    return without_test_paths(as_in_steps("\n".join(message) + (f" ({'; '.join(details.values())})" if details else "")))


# A frame in the grader's own files (tests/..., as course.launch shortens a path in the repository), with
# what led to it ("given code at", "at" or nothing).
_TESTS = rf"(?<![\w./-])(?:{re.escape(str(REPO))}/)?tests/[\w/]*?(?P<file>\w+\.py)"
TEST_FRAME = re.compile(rf"(?P<lead>(?:in )?given code at |at )?{_TESTS}:\d+ in (?P<function>[\w<>]+)")
TEST_FILE = re.compile(_TESTS)


def without_test_paths(message: str) -> str:
    """A message that never sends the learner into tests/: a frame in a check's own file ("raised in
    given code at tests/test_01_manual_split.py:61 in check_boundary", a rank "at tests/...:62 in
    _train") becomes "in the check's own code, in check_boundary", and any other path there the bare
    file's name. The learner fixes their steps/ file; the check says in words what it expected."""
    message = TEST_FRAME.sub(lambda frame: f"{'in ' if frame['lead'] else ''}the check's own code, in {frame['function']}",
                             message)
    return TEST_FILE.sub(lambda path: f"the checks' file {path['file']}", message)


REFERENCE_FRAME = re.compile(r"(?<![\w/.])solutions/(?P<file>m\d\d_\w+\.py):(?P<line>\d+) in (?P<function>[\w<>]+)")


def as_in_steps(message: str) -> str:
    """A message whose frames the learner can follow: when steps/ is graded, a frame in solutions/
    (given code a check runs from the reference as a trusted helper, e.g. module 16's check_exchange)
    is shown at the same line of the learner's steps/ file, and a frame in the reference's own answer
    to a TODO names no file: the learner never needs to open solutions/ (issue 37.4)."""
    from course.impl import selected
    return REFERENCE_FRAME.sub(_in_steps, message) if selected() == "steps" else message


def _in_steps(frame: re.Match) -> str:
    from course import REPO
    from course.impl import steps_dir
    name, line, function = frame["file"], int(frame["line"]), frame["function"]
    try:
        source = (REPO / "solutions" / name).read_text().splitlines()
        blocks = todo_blocks("\n".join(source), name)
    except (OSError, ValueError):
        return frame[0]
    if any(block.line <= line <= block.end for block in blocks):
        return f"the check's reference {function}"
    # The line in the skeleton as generated: the header, and each earlier block cut to its title, comments and raise.
    generated = line + HEADER.count("\n") - sum((block.end - block.line + 1) - (len(block.visible) + 2)
                                                 for block in blocks if block.end < line)
    try:  # the learner's file: the same given line, the one nearest where it was generated
        mine = (steps_dir() / name).read_text().splitlines()
        same = [n for n, text in enumerate(mine, start=1) if text == source[line - 1]]
    except OSError:
        same = []
    return f"steps/{name}:{min(same, key=lambda n: abs(n - generated), default=generated)} in {function}"
