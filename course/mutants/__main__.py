"""`python -m course.mutants [NN | NN.K ...] [--jobs K] [--timeout S]`: run the planted bugs of
course/mutants/mNN.py against their module's graded tests and say which test caught each (see
course/mutants/__init__.py for what a plant is and how to add one)."""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from course import REPO
from course.arguments import check_count, check_timeout, max_nproc
from course.catalog import MODULES
from course.grading import hung
from course.mutants import Plant, PlantError, modules, planted, plants, todo_of

PLANT_TIMEOUT_S = 300  # a plant's whole test run; a hang past it is reported, never waited on


@dataclass
class Job:
    number: str            # "05"
    index: int             # 0: the baseline (the solutions as they are); K: the module's K-th plant
    plant: Plant | None

    @property
    def name(self) -> str:
        return f"{self.number}.{self.index}"


@dataclass
class Outcome:
    verdict: str           # "caught", "SURVIVED" or "ERROR" (for the baseline: "passed" or "ERROR")
    detail: str            # which test caught it, and its one-line reason; or what went wrong
    seconds: float
    help: str | None = None  # the first failure's help line, as grade prints it: "python main.py hint 05 3"


class Runner:
    """Runs jobs in subprocesses, each in its own session, so that all of them (with the ranks they
    forked) can be killed at once on a timeout, Ctrl-C or SIGTERM."""

    def __init__(self, root: Path, timeout: float):
        self.root, self.timeout = root, timeout
        self.running: set[subprocess.Popen] = set()
        self.lock, self.stopping = threading.Lock(), threading.Event()

    def run(self, job: Job) -> Outcome:
        start = time.monotonic()
        try:
            return self._run(job, start)
        except Exception as error:  # a row that says what went wrong, not a runner that stops
            return Outcome("ERROR", f"{type(error).__name__}: {error}", time.monotonic() - start)

    def _run(self, job: Job, start: float) -> Outcome:
        scratch = self.root / job.name
        steps, tmp = scratch / "steps", scratch / "tmp"  # tmp: the test run's own temp files, removed with it
        steps.mkdir(parents=True)
        tmp.mkdir()
        for path in (REPO / "solutions").glob("*.py"):
            shutil.copyfile(path, steps / path.name)
        if job.plant is not None:
            try:
                (steps / job.plant.file).write_text(planted(job.plant))
            except (PlantError, OSError) as error:
                return Outcome("ERROR", str(error), time.monotonic() - start)
        report = scratch / "grades.json"
        # In the order `grade` runs them (build order), so "caught by" is the check a learner would see first.
        tests = [str(p.relative_to(REPO)) for p in MODULES[job.number].test_files()]
        env = {**os.environ, "COURSE_STEPS_DIR": str(steps), "COURSE_IMPL": "steps", "TMPDIR": str(tmp)}
        # -v prints each test's name as it starts: the last one printed is where a hang is.
        command = [sys.executable, "-m", "pytest", *tests, "-m", "not given", "--impl=steps", "-x", "-v",
                   "-p", "no:cacheprovider", f"--grading-json={report}"]
        with self.lock:
            if self.stopping.is_set():
                return Outcome("ERROR", "not run: interrupted", 0.0)
            proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, start_new_session=True)
            self.running.add(proc)
        try:
            output, _ = proc.communicate(timeout=self.timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            self.kill(proc)
            output, _ = proc.communicate()
            timed_out = True
        finally:
            with self.lock:
                self.running.discard(proc)
        seconds = time.monotonic() - start
        results = json.loads(report.read_text()) if report.exists() else None
        return judge(job, results, output, proc.returncode, timed_out, self.timeout, seconds)

    def kill(self, proc: subprocess.Popen):
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # pytest and every rank it forked
        except ProcessLookupError:
            pass

    def stop(self):
        with self.lock:
            self.stopping.set()
            for proc in self.running:
                self.kill(proc)


def judge(job: Job, results: list[dict] | None, output: str, returncode: int, timed_out: bool,
          timeout: float, seconds: float) -> Outcome:
    """The verdict on one job from its scorecard (`results`, None if pytest wrote none) and output."""
    baseline = job.plant is None
    if timed_out:
        started = [line.split()[0] for line in output.splitlines() if "::" in line and line.startswith("tests/")]
        where = started[-1].split("::", 1)[-1] if started else "collection"
        verdict = "ERROR" if baseline else "caught"
        return Outcome(verdict, f"by a hang in {where} (stopped after {timeout:g} s)", seconds)
    failed = [r for r in results or [] if r["outcome"] == "failed"]
    if failed:
        first = failed[0]
        how = "by a hang in" if hung(first["reason"]) else "by"
        detail = f"{how} {first['test'].split('::', 1)[-1]}: {first['reason'][:160]}"
        return Outcome("ERROR" if baseline else "caught", detail, seconds, first.get("hint"))
    if results and returncode == 0:
        return Outcome("passed" if baseline else "SURVIVED", f"{len(results)} tests passed", seconds)
    # No test failed, yet pytest did not pass: a test file that cannot be imported (a collection error).
    errors = [line[1:].strip() for line in output.splitlines() if line.startswith("E ")]
    why = (errors or output.strip().splitlines() or ["no output"])[-1][:160]
    if baseline or returncode not in (1, 2):
        return Outcome("ERROR", f"pytest exit code {returncode}: {why}", seconds)
    return Outcome("caught", f"at import (the test file cannot be imported): {why}", seconds)


def selected_jobs(args: list[str]) -> list[Job]:
    """Jobs for "NN" (a module's baseline and plants) and "NN.K" (one plant, and its baseline)."""
    wanted: dict[str, set[int] | None] = {}
    for arg in args or modules():
        match = re.fullmatch(r"(\d\d)(?:\.(\d+))?", arg)
        if not match or match[1] not in modules():
            raise ValueError(f"{arg!r} is not a module with plants ({', '.join(modules())}) or a plant NN.K")
        number, index = match[1], match[2]
        if index is None:
            wanted[number] = None
        elif wanted.get(number, set()) is not None:
            wanted.setdefault(number, set()).add(int(index))
    jobs = []
    for number, indices in wanted.items():
        catalogue = plants(number)
        for index in indices or []:
            if not 1 <= index <= len(catalogue):
                raise ValueError(f"module {number} has plants {number}.1 to {number}.{len(catalogue)}")
        jobs.append(Job(number, 0, None))
        jobs += [Job(number, k, p) for k, p in enumerate(catalogue, start=1) if indices is None or k in indices]
    return jobs


@dataclass
class Blame:
    right: bool
    todo: int | None       # the TODO the plant is in (None: it could not be told)
    said: str              # what the help line blamed, in words


def blame(job: Job, outcome: Outcome) -> Blame | None:
    """Whether a caught plant's first failure points the learner at the plant's own TODO, and only at
    it; None for a plant not caught (or the baseline)."""
    if job.plant is None or outcome.verdict != "caught":
        return None
    try:
        todo = todo_of(job.number, job.plant)
    except PlantError as error:
        return Blame(False, None, f"its TODO cannot be told ({error})")
    named = re.fullmatch(r"python main\.py hint (\d\d) (\d+)(?: \(it also exercises TODOs ([\d, ]+)\))?",
                         outcome.help or "")
    if named is None:
        return Blame(False, todo, "no help line" if not outcome.help else f"help: {outcome.help}")
    number, first = named[1], int(named[2])
    also = [int(n) for n in (named[3] or "").replace(",", " ").split()]
    if number != job.number:
        return Blame(False, todo, f"help names module {number}'s TODO {first}")
    if also:
        return Blame(False, todo, f"help names TODOs {', '.join(map(str, [first, *also]))}")
    return Blame(first == todo, todo, f"help names TODO {first}")


def row(job: Job, outcome: Outcome) -> str:
    teaches = f"\n        {job.plant.file}: {job.plant.teaches}" if job.plant else ""
    blamed = blame(job, outcome)
    if blamed is not None:
        verdict = "blamed right" if blamed.right else "blamed WRONG"
        teaches += f"\n        {verdict}: in TODO {blamed.todo or '?'}, {blamed.said}" + " (new)" * job.plant.new
    return f"{job.name:<6} {outcome.verdict:<8} {outcome.seconds:6.1f}s  {outcome.detail}{teaches}"


def summary(done: dict[str, tuple[Job, Outcome]]) -> list[str]:
    """The total per module, with the blame table: of the caught plants, how many were blamed on their
    own TODO (the catalogue before issue 37, and the plants marked new), then the plants blamed wrong."""
    lines = [f"{'module':<7} {'planted':>7} {'caught':>6} {'survived':>8} {'error':>5} {'time':>8}  "
             f"{'blamed right':>12}  {'new: right':>10}"]
    wrong = []
    for number in sorted({job.number for job, _ in done.values()}):
        mine = [(job, outcome) for job, outcome in done.values() if job.number == number]
        plants_ = [outcome.verdict for job, outcome in mine if job.plant is not None]
        errors = plants_.count("ERROR") + sum(o.verdict == "ERROR" for j, o in mine if j.plant is None)
        seconds = sum(outcome.seconds for _, outcome in mine)
        blames = [(job, blame(job, outcome)) for job, outcome in mine]
        blamed = {new: [(job, b) for job, b in blames if b is not None and job.plant.new == new] for new in (False, True)}
        right = {new: f"{sum(b.right for _, b in blamed[new])} of {len(blamed[new])}" if blamed[new] else "-"
                 for new in blamed}
        lines.append(f"{number:<7} {len(plants_):>7} {plants_.count('caught'):>6} {plants_.count('SURVIVED'):>8} "
                     f"{errors:>5} {seconds:>7.0f}s  {right[False]:>12}  {right[True]:>10}")
        wrong += [f"  {job.name:<6} in TODO {b.todo or '?'}, {b.said}" + " (new)" * job.plant.new
                  for job, b in blames if b is not None and not b.right]
    lines.append("blamed right: of the caught plants, those whose first failure's help line (`python main.py hint "
                 "NN K`) names their own TODO and no other; new: the plants marked new=True")
    if wrong:
        lines += ["blamed wrong:", *wrong]
    return lines


def interrupt(signum, frame):
    """SIGTERM stops the runner the way Ctrl-C does."""
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course.mutants", description=__doc__.split("\n\n")[0])
    parser.add_argument("which", nargs="*", metavar="NN[.K]", help="modules (05) or single plants (05.3); default: all")
    parser.add_argument("--jobs", type=int, default=2, help="test subprocesses at a time (default 2)")
    parser.add_argument("--timeout", type=float, default=PLANT_TIMEOUT_S,
                        help=f"seconds one plant's tests may run before it counts as a hang (default {PLANT_TIMEOUT_S})")
    args = parser.parse_args(argv)
    try:  # one line and exit code 2, as main.py's: --timeout nan or inf would make every row an ERROR
        check_count(args.jobs, "--jobs", 1, max_nproc())
        check_timeout(args.timeout, "--timeout")
        jobs = selected_jobs(args.which)
    except ValueError as error:
        parser.error(str(error))
    # The baselines first: a module's verdicts mean something only once its unplanted solutions pass.
    jobs.sort(key=lambda job: (job.index > 0, job.number, job.index))
    print(f"{len(jobs) - sum(j.plant is None for j in jobs)} plants of modules "
          f"{', '.join(sorted({j.number for j in jobs}))}, {args.jobs} at a time (NN.0: the unplanted baseline)",
          flush=True)
    root = Path(tempfile.mkdtemp(prefix="course-mutants-"))
    runner = Runner(root, args.timeout)
    previous = signal.signal(signal.SIGTERM, interrupt)
    done: dict[str, tuple[Job, Outcome]] = {}
    start = time.monotonic()
    pool = ThreadPoolExecutor(max_workers=args.jobs)
    try:
        futures = {pool.submit(runner.run, job): job for job in jobs}
        for future in as_completed(futures):
            job = futures[future]
            done[job.name] = (job, future.result())
            print(row(job, done[job.name][1]), flush=True)
    except KeyboardInterrupt:
        print(f"\ninterrupted: {len(done)} of {len(jobs)} runs had finished; stopping the others")
        return 130
    finally:  # no test process, rank or scratch directory outlives the runner
        runner.stop()
        pool.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(root, ignore_errors=True)
        signal.signal(signal.SIGTERM, previous)
    # A module whose baseline fails: its plants' "caught" means nothing.
    for job, outcome in list(done.values()):
        base = done.get(f"{job.number}.0")
        if job.plant is not None and base and base[1].verdict != "passed":
            done[job.name] = (job, Outcome("ERROR", f"the unplanted solutions fail too ({base[1].detail[:80]})",
                                           outcome.seconds))
    ordered = sorted(done.values(), key=lambda d: (d[0].number, d[0].index))
    print(f"\n=== every plant, in order ({time.monotonic() - start:.0f} s in all)")
    for job, outcome in ordered:
        print(row(job, outcome))
    print()
    print("\n".join(summary(done)))
    survived = [job.name for job, outcome in ordered if outcome.verdict == "SURVIVED"]
    errors = [job.name for job, outcome in ordered if outcome.verdict == "ERROR"]
    if survived:
        print(f"SURVIVED (holes in the grader): {', '.join(survived)}")
    if errors:
        print(f"ERROR (could not be judged): {', '.join(errors)}")
    return 1 if survived or errors else 0


if __name__ == "__main__":
    sys.exit(main())
