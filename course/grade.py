"""`python main.py grade NN`: run module NN's graded tests on the selected implementation and print
a scorecard, one line per check as it finishes, then the total (given).

The tests run in a pytest subprocess, with the scorecard plugin of course/grading.py printing each
check's line live; the total comes from the plugin's JSON report.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from course import REPO
from course.catalog import Module
from course.grading import hung
from course.impl import MissingStepsFile

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
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "grades.json"
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "pytest", *test_files, "-qq", "--no-header", "--no-summary", "--tb=no",
                 "--continue-on-collection-errors", "-p", "no:cacheprovider", "-m", "not given",
                 f"--impl={impl}", "--grading-live", f"--grading-json={report}",
                 *([] if keep_going else ["--grading-stop-on-hang"])],
                cwd=REPO, timeout=LAST_RESORT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            sys.exit(f"module {module.number}: grading was stopped after {LAST_RESORT_TIMEOUT_S // 60} minutes; "
                     "the last check shown is the one after which it got stuck")
        except KeyboardInterrupt:
            sys.exit(f"\nmodule {module.number}: grading interrupted")
        results = json.loads(report.read_text()) if report.exists() else []
    stopped_on_hang = proc.returncode == 2 and results and hung(results[-1]["reason"])
    if stopped_on_hang:
        print(f"Stopped after the check that hung: the next ones would likely hang too, each for its whole "
              f"timeout. Fix it first, or run every check anyway: python main.py grade {module.number} --keep-going",
              flush=True)
    elif proc.returncode not in (0, 1):  # 1: some checks failed; anything else: pytest itself stopped
        sys.exit(f"module {module.number}: pytest stopped early (exit code {proc.returncode}); "
                 "the checks shown above ran, the others did not")
    if not results:
        print(f"module {module.number}: no graded test ran; pytest's own output, printed before this line, "
              f"says why (exit code {proc.returncode})", flush=True)
        return 1
    passed = sum(r["outcome"] == "passed" for r in results)
    skipped = sum(r["outcome"] == "skipped" for r in results)
    graded = len(results) - skipped  # e.g. GPU checks on a machine without one
    print(f"{passed}/{graded} checks pass" + (f" ({skipped} skipped)" if skipped else "")
          + (" among those that ran before the one that hung" if stopped_on_hang else ""))
    if passed < graded:
        print(f"A check's whole output (tracebacks, your prints): python -m pytest --impl {impl} "
              f"{' '.join(os.path.relpath(f, REPO) for f in test_files)} -k NAME")
    return 0 if passed == graded else 1
