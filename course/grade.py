"""`python main.py grade NN`: run module NN's graded tests on the selected implementation and print
a scorecard, one line per check as it finishes, then the total (given); when every check of your
steps/ passes, the total also says how many TODOs you wrote without a hint (course/hints.py's record).

The tests run in a pytest subprocess, with the scorecard plugin of course/grading.py printing each
check's line live; the total comes from the plugin's JSON report. pytest and the ranks it forks
run in a process group of their own, with their temporary files in a folder of grade's: Ctrl-C,
SIGTERM or SIGHUP kills the whole group and removes the folder, so nothing outlives the command.
Killed outright (SIGKILL), grade cannot clean up: its pytest then gets SIGTERM from Linux (a
parent-death signal), stops with its ranks and removes the folder itself (course/grading.py).
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from course import REPO
from course.catalog import Module
from course.impl import MissingStepsFile
from course.interrupts import interruption, signals_deferred

LAST_RESORT_TIMEOUT_S = 1800  # each check has its own timeout (course/grading.py); this catches the rest


def grade(module: Module, impl: str, keep_going: bool = False) -> int:
    """Grade `impl`/ for `module`; return the exit code (0: every check passes). Grading stops after
    the first check that hangs, unless `keep_going`."""
    if module.is_given():
        print(f"module {module.number} is given: nothing to fill in or grade. Its checks run with "
              f"`python -m pytest -m m{module.number}`; `python main.py run {module.number}` shows it.")
        return 0
    missing = module.missing_steps() if impl == "steps" else []
    if missing:  # its test file could not even be imported: say why in one line
        print(f"module {module.number}: {MissingStepsFile(missing[0])}")
        return 1
    print(f"Grading {impl}/ for module {module.number}: {module.title}\n", flush=True)
    test_files = [str(p) for p in module.test_files()]
    with tempfile.TemporaryDirectory(prefix="course-grade-") as tmp:
        report = Path(tmp) / "grades.json"
        returncode = _pytest(
            [sys.executable, "-m", "pytest", *test_files, "-qq", "--no-header", "--no-summary", "--tb=no",
             "--continue-on-collection-errors", "-p", "no:cacheprovider", "-m", "not given",
             f"--impl={impl}", "--grading-live", f"--grading-json={report}",
             *([] if keep_going else ["--grading-stop-on-hang"])],
            tmp, module)
        results = json.loads(report.read_text()) if report.exists() else []
    return _scorecard(module, impl, results, returncode)


def _pytest(command: list[str], tmp: str, module: Module) -> int:
    """Run pytest in a process group of its own (its ranks inherit it), its temporary files under
    `tmp`; on a signal or the last-resort timeout, kill the whole group and exit in one line."""
    # pytest leads a process group of its own, which its ranks join (Python 3.10: a session of its own).
    group = {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}
    proc = None
    try:
        with signals_deferred():  # a Ctrl-C while pytest starts is acted on once its process is known
            # COURSE_GRADE_PARENT: if this process is killed outright, pytest stops and removes `tmp` (course/grading.py)
            proc = subprocess.Popen(command, cwd=REPO, env={**os.environ, "TMPDIR": tmp,
                                                            "COURSE_GRADE_PARENT": str(os.getpid())}, **group)
        return proc.wait(timeout=LAST_RESORT_TIMEOUT_S)
    except (KeyboardInterrupt, subprocess.TimeoutExpired) as exc:
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # pytest and every rank it forked
            proc.wait()
        if isinstance(exc, KeyboardInterrupt):
            sys.exit(f"module {module.number}: grading interrupted by {interruption(exc)}")
        sys.exit(f"module {module.number}: grading was stopped after {LAST_RESORT_TIMEOUT_S // 60} minutes; "
                 "the last check shown is the one after which it got stuck")


def _scorecard(module: Module, impl: str, results: list[dict], returncode: int) -> int:
    from course.grading import hung  # imports torch: not before pytest, which needs the cores to start

    stopped_on_hang = returncode == 2 and results and hung(results[-1]["reason"])
    if stopped_on_hang:
        print(f"Stopped after the check that hung: the next ones would likely hang too, each for its whole "
              f"timeout. Fix it first, or run every check anyway: python main.py grade {module.number} --keep-going",
              flush=True)
    elif returncode not in (0, 1):  # 1: some checks failed; anything else: pytest itself stopped
        sys.exit(f"module {module.number}: pytest stopped early (exit code {returncode}); "
                 "the checks shown above ran, the others did not")
    if not results:
        print(f"module {module.number}: no graded test ran; pytest's own output, printed before this line, "
              f"says why (exit code {returncode})", flush=True)
        return 1
    passed = sum(r["outcome"] == "passed" for r in results)
    skipped = sum(r["outcome"] == "skipped" for r in results)
    graded = len(results) - skipped  # e.g. GPU checks on a machine without one
    derived = ""
    if passed == graded and impl == "steps":  # what the learner derived: TODOs written without a hint
        from course.hints import what_was_derived
        derived = f"; {what_was_derived(module)}"
    unimported = sum(r["reason"].startswith("cannot import") for r in results if r["outcome"] == "failed")
    print(f"{passed}/{graded} checks pass" + (f" ({skipped} skipped)" if skipped else "")
          + (" among those that ran before the one that hung" if stopped_on_hang else "")
          + (" (a checks' file that could not be imported counts as one failed check: its checks did not run)"
             if unimported == 1 else f" ({unimported} checks' files that could not be imported count as one failed "
             "check each: their checks did not run)" if unimported else "") + derived)
    if passed < graded:
        # by the module's marker, not its test files: the learner runs the checks and need not open them
        print(f"A check's whole output (tracebacks, your prints): python -m pytest --impl {impl} -m m{module.number} "
              f"-k NAME")
    return 0 if passed == graded else 1
