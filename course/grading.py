"""pytest plugin behind the scorecard: one line per check, and for a failure the one line that
says what went wrong (the first line of the error), not the whole traceback.

Loaded by the root conftest.py. `--grading-json PATH` writes the outcomes for tools:
`python main.py grade NN` and the grader's self-check (tests/test_course_grader.py).
"""
from __future__ import annotations

import json
import re

GIVEN = "given"  # marker for tests of given code: not graded, not expected to fail on skeletons


def pytest_addoption(parser):
    parser.addoption("--grading-json", metavar="PATH", default=None,
                     help="write each test's outcome and one-line reason to PATH (JSON)")


def pytest_configure(config):
    config.addinivalue_line("markers", f"{GIVEN}: tests of given code (not graded)")
    for number in range(100):
        config.addinivalue_line("markers", f"m{number:02d}: tests of module {number:02d}")
    config.pluginmanager.register(Scorecard(config.getoption("--grading-json")), "course-scorecard")


def pytest_collection_modifyitems(config, items):
    """tests/test_NN_topic.py -> marker mNN; module 00 and tests/test_course_*.py -> `given`."""
    for item in items:
        name = item.path.name
        match = re.match(r"test_(\d\d)_", name)
        if match:
            item.add_marker(f"m{match.group(1)}")
        if name.startswith("test_course_") or name.startswith("test_00_"):
            item.add_marker(GIVEN)


class Scorecard:
    """Collects one result per test: its call phase, or the setup phase that failed or skipped it."""

    def __init__(self, path):
        self.path, self.results = path, []

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            self.results.append({"test": report.nodeid, "outcome": report.outcome,
                                 "reason": one_line_reason(report)})

    def pytest_sessionfinish(self, session):
        if self.path:
            with open(self.path, "w") as f:
                json.dump(self.results, f, indent=1)


def one_line_reason(report) -> str:
    if report.outcome == "passed":
        return ""
    if report.outcome == "skipped":
        return str(report.longrepr[2]) if isinstance(report.longrepr, tuple) else "skipped"
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    return text.strip().splitlines()[0] if text.strip() else "failed"
