"""Ctrl-C, SIGTERM and SIGHUP: every command stops with one line and leaves no process and no
temporary folder behind; a single-process timeout says where it was (issue "reliability round 2",
items 4-6).

Each command runs as a subprocess in a session of its own, which everything it starts joins (ranks,
grade's pytest and its ranks; torchrun's ranks are its children), with a temporary folder of its
own (TMPDIR). Once it has started what it must clean up, it gets its signal; then none of its
processes may be left, nor any course-* folder. A fresh Python costs about 2 s of torch import, so the commands run together, in
one fixture, and the tests read their outcomes. The other cases (grade's other signals, SIGTERM to a
forked run, single-process runs, torchrun) are marked `long`: `python -m pytest -m long` runs them.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from course import REPO

GIVE_UP_S = 90  # for a case to get ready and end: far more than any needs, even on a busy machine


@dataclass
class Case:
    argv: list[str]                 # after `python`
    signal: int | None              # sent once ready; None: the command ends on its own
    ready_members: int = 1          # its processes before the signal: itself, then ranks...
    ready_line: str = ""            # ...and a line it has printed
    ready_map: str = ""             # ...and a library loaded (by main.py: its handlers are in place)...
    mapped: int = 1                 # ...in this many of its processes
    ready_folder: str = ""          # ...and a folder of this pattern somewhere in its TMPDIR
    delay: float = 0.0              # seconds after that
    settle: float = 5.0             # seconds what it started may take to go once it has ended
    env: dict = field(default_factory=dict)
    # What happened:
    returncode: int | None = None
    out: str = ""
    err: str = ""
    left: list[int] = field(default_factory=list)     # its processes still alive after it ended
    folders: list[str] = field(default_factory=list)  # course-* folders left in its TMPDIR
    kernel_files: list[str] = field(default_factory=list)  # Jupyter kernels' connection files left there


def processes() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, session id) of every live process (Linux /proc)."""
    table = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            table[int(stat.parent.name)] = (int(fields[1]), int(fields[3]))
    return table


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def family(pid: int, table: dict[int, tuple[int, int]] | None = None) -> set[int]:
    """The live processes of `pid`'s session, and its descendants (torchrun starts its ranks in
    sessions of their own)."""
    table = processes() if table is None else table
    members = {p for p, (_, sid) in table.items() if sid == pid}
    grown = True
    while grown:
        children = {p for p, (ppid, _) in table.items() if ppid in members | {pid}} - members
        members |= children
        grown = bool(children)
    return members


def run_cases(cases: dict[str, Case], tmp: Path) -> dict[str, Case]:
    """Start every case at once, signal each when it is ready, and record how it ended."""
    procs, signal_at, seen = {}, {}, {}
    for name, case in cases.items():
        folder = tmp / name
        (folder / "tmp").mkdir(parents=True)
        procs[name] = subprocess.Popen(
            [sys.executable, *case.argv], cwd=REPO, env={**os.environ, **case.env, "TMPDIR": str(folder / "tmp")},
            stdout=open(folder / "out", "w"), stderr=open(folder / "err", "w"), start_new_session=True)
        seen[name] = {procs[name].pid}
    deadline = time.monotonic() + GIVE_UP_S
    try:
        while any(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
            table = processes()
            for name, case in cases.items():
                proc = procs[name]
                if proc.poll() is not None:
                    continue
                seen[name] |= family(proc.pid, table)
                if case.signal is None or name in signal_at:
                    continue
                members = family(proc.pid, table)
                if (len(members) >= case.ready_members and case.ready_line in (tmp / name / "out").read_text()
                        and (not case.ready_map
                             or sum(case.ready_map in _read(f"/proc/{p}/maps") for p in members) >= case.mapped)
                        and (not case.ready_folder or any((tmp / name / "tmp").rglob(case.ready_folder)))):
                    signal_at[name] = time.monotonic() + case.delay
            for name in [n for n, at in signal_at.items() if at is not None and time.monotonic() >= at]:
                procs[name].send_signal(cases[name].signal)  # to the command alone, as `kill` does
                signal_at[name] = None  # sent
            time.sleep(0.05)
        for name, case in cases.items():
            case.returncode = procs[name].poll()
            until = time.monotonic() + case.settle  # what it killed may take a moment to go
            while (seen[name] | family(procs[name].pid)) & set(processes()) and time.monotonic() < until:
                time.sleep(0.05)
            case.left = sorted((seen[name] | family(procs[name].pid)) & set(processes()))
            case.out, case.err = (tmp / name / "out").read_text(), (tmp / name / "err").read_text()
            case.folders = [str(p.relative_to(tmp / name / "tmp")) for p in (tmp / name / "tmp").rglob("course-*")]
            case.kernel_files = [str(p.relative_to(tmp / name / "tmp")) for p in (tmp / name / "tmp").rglob("*.json")]
    finally:
        for name, proc in procs.items():  # whatever a failed case left running
            for pid in seen[name] | family(proc.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()
    return cases


@pytest.fixture(scope="module")
def hanging_steps(tmp_path_factory) -> Path:
    """A steps/ folder that is the reference, except that module 03's ping_pong hangs (on every rank)."""
    steps = tmp_path_factory.mktemp("hanging") / "steps"
    shutil.copytree(REPO / "solutions", steps)
    with open(steps / "m03_ping_pong.py", "a") as f:
        f.write("\n\ndef ping_pong(comms, x, round_trips):  # planted: a hang\n    import time\n    time.sleep(600)\n")
    return steps


def grade(hanging_steps, sig) -> Case:
    # main.py, pytest and the two ranks of the first check of module 03, which hang.
    return Case(["main.py", "grade", "03"], sig, ready_members=4, delay=0.3,
                env={"COURSE_STEPS_DIR": str(hanging_steps)})


def forked_run(sig) -> Case:
    # main.py and two ranks, each layer's forward 1 s: ranks that sleep, or wait for one that does.
    return Case(["main.py", "run", "05", "--impl", "solutions", "--nproc", "2", "--emulate-ms", "1000",
                 "--trace", "{tmp}/trace"], sig, ready_members=3, delay=0.3)


@pytest.fixture(scope="module")
def ended(hanging_steps, tmp_path_factory) -> dict[str, Case]:
    tmp = tmp_path_factory.mktemp("signals")
    cases = {
        "grade-SIGTERM": grade(hanging_steps, signal.SIGTERM),
        # Killed outright, grade cannot clean up: its pytest stops on its own, with its ranks, and removes
        # grade's folder (it takes a few seconds on a busy machine: settle).
        "grade-SIGKILL": dataclasses.replace(grade(hanging_steps, signal.SIGKILL), settle=60.0),
        "run-SIGHUP": forked_run(signal.SIGHUP),
        # While torch is imported (main.py's own start-up, not the interpreter's: that is Python's).
        "start-up-SIGINT": Case(["main.py", "run", "05", "--impl", "solutions"], signal.SIGINT, ready_map="libtorch"),
    }
    for case in cases.values():
        case.argv = [a.replace("{tmp}", str(tmp)) for a in case.argv]
    return run_cases(cases, tmp)


@pytest.fixture(scope="module")
def ended_long(hanging_steps, tmp_path_factory) -> dict[str, Case]:
    tmp = tmp_path_factory.mktemp("signals-long")
    cases = {
        "grade-SIGINT": grade(hanging_steps, signal.SIGINT),
        "grade-SIGHUP": grade(hanging_steps, signal.SIGHUP),
        "run-SIGTERM": forked_run(signal.SIGTERM),
        # Also in tests/test_course_launch.py, in a forked process: these two check main.py's way there.
        "single-SIGINT": Case(["main.py", "run", "06", "--impl", "solutions", "--steps", "100000", "--sample", "0"],
                              signal.SIGINT, ready_line="step    0 "),
        "single-timeout": Case(["main.py", "run", "00", "--impl", "solutions", "--timeout", "0.01"], None),
        # torchrun and its 4 ranks; Ctrl-C reaches torchrun only (its ranks have sessions of their
        # own), which passes it on.
        "torchrun-SIGINT": Case(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                                 "main.py", "run", "05", "--impl", "solutions", "--emulate-ms", "200"],
                                signal.SIGINT, ready_members=5, ready_map="libtorch", mapped=5, delay=3.0),
        # While a notebook's kernel runs ranks (a notebook that `site` executes, in a session of its own).
        "site-SIGTERM": Case(["main.py", "site", "--execute"], signal.SIGTERM, ready_folder="course-ranks-*",
                             delay=0.5, settle=15.0),
    }
    for case in cases.values():
        case.argv = [a.replace("{tmp}", str(tmp)) for a in case.argv]
    return run_cases(cases, tmp)


def assert_left_nothing(case: Case):
    assert case.returncode is not None, f"still running after {GIVE_UP_S} s:\n{case.out}{case.err}"
    assert case.left == [], f"processes left running: {case.left}\n{case.err}"
    assert case.folders == [], f"temporary folders left: {case.folders}"


@pytest.mark.parametrize("name", ["grade-SIGTERM", "grade-SIGKILL", "run-SIGHUP", "start-up-SIGINT"])
def test_no_process_and_no_folder_outlives_a_command(name, ended):
    # Issue 33: killed outright (SIGKILL), grade left its pytest running without a parent, and its folder.
    assert_left_nothing(ended[name])


def test_sigterm_stops_grade_with_its_pytest_and_ranks(ended):
    # Item 4: pytest and its ranks went on after grade had gone, printing PASS lines at the prompt.
    case = ended["grade-SIGTERM"]
    assert case.returncode == 1 and case.err == "module 03: grading interrupted by SIGTERM\n", case.err


def test_sighup_stops_a_run_in_one_line_naming_where_each_rank_was(ended):
    # Item 4: the ranks died with their parent, but their folder stayed in /tmp.
    case = ended["run-SIGHUP"]
    assert case.returncode == 1 and len(case.err.splitlines()) == 1, case.err
    assert case.err.startswith("error: interrupted by SIGHUP; ranks 0, 1 interrupted where they were: rank 0 at "), case.err


def test_ctrl_c_during_start_up_is_one_line(ended):
    # Item 5: a traceback from wherever torch's import (or the forking of the ranks) was.
    case = ended["start-up-SIGINT"]
    assert case.returncode == 1 and case.err == "error: interrupted by Ctrl-C\n", case.err


@pytest.mark.long
@pytest.mark.parametrize("name", ["grade-SIGINT", "grade-SIGHUP", "run-SIGTERM", "single-SIGINT", "single-timeout",
                                  "torchrun-SIGINT", "site-SIGTERM"])
def test_no_process_and_no_folder_outlives_a_command_long(name, ended_long):
    assert_left_nothing(ended_long[name])


@pytest.mark.long
def test_sigterm_stops_site_with_its_notebooks_kernels_and_ranks(ended_long):
    # Issue 33: the kernel (in a session of its own) and its ranks' folder and connection file stayed.
    case = ended_long["site-SIGTERM"]
    assert case.returncode == 1 and case.err.endswith("error: interrupted by SIGTERM\n"), case.err
    assert case.kernel_files == [], f"kernel files left: {case.kernel_files}"


@pytest.mark.long
@pytest.mark.parametrize("name, said", [("grade-SIGINT", "module 03: grading interrupted by Ctrl-C\n"),
                                        ("grade-SIGHUP", "module 03: grading interrupted by SIGHUP\n")])
def test_ctrl_c_and_sighup_stop_grade(name, said, ended_long):
    assert ended_long[name].returncode == 1 and ended_long[name].err == said, ended_long[name].err


@pytest.mark.long
def test_sigterm_stops_a_forked_run_in_one_line(ended_long):
    case = ended_long["run-SIGTERM"]
    assert case.returncode == 1 and case.err.startswith("error: interrupted by SIGTERM; ranks 0, 1 interrupted where they were: "), case.err
    assert len(case.err.splitlines()) == 1, case.err


@pytest.mark.long
def test_ctrl_c_stops_a_single_process_run_in_one_line(ended_long):
    case = ended_long["single-SIGINT"]
    assert case.returncode == 1 and len(case.err.splitlines()) == 1, case.err
    assert case.err.startswith("error: interrupted by Ctrl-C (at "), case.err


@pytest.mark.long
def test_a_single_process_timeout_says_where_it_was(ended_long):
    case = ended_long["single-timeout"]
    assert case.returncode == 1 and case.err.startswith("error: timed out after 0.01 s at "), case.err


@pytest.mark.long
def test_ctrl_c_under_torchrun_is_one_line_per_rank(ended_long):
    # Item 5: about 200 lines before, 40 of them per rank. torchrun's own report of the signal (its
    # warnings and a traceback of its own code) is torchrun's, and remains.
    case = ended_long["torchrun-SIGINT"]
    ours = [line for line in case.err.splitlines() if "interrupted by Ctrl-C" in line]
    assert len(ours) == 4 and all(line.startswith("error: ") for line in ours), case.err
    assert not re.search(r'File ".*(main\.py|/course/|/solutions/)', case.err), case.err  # no traceback through ours
