"""The course's command line.

    python main.py                      a short tour: the modules, then demos that run on CPU
    python main.py list                 modules, with the TODOs left in your steps/
    python main.py run NN [--nproc N]   run module NN's demo on N CPU ranks (your code: --impl steps)
    python main.py grade NN             grade your steps/ for module NN: a scorecard
    python main.py bench NN             measured-versus-theory tables

`run` starts its own ranks (forked, gloo), or runs as one of them under
`torchrun --nproc-per-node N main.py run NN`. Bad arguments are refused before any process starts.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import faulthandler
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent
TOUR = ("00", "05")  # the baseline, then the latest module that reproduces it across ranks


def modules() -> dict[str, dict]:
    """Module number -> {stem, title, nproc}, read from solutions/ without importing anything."""
    found = {}
    for path in sorted((REPO / "solutions").glob("m[0-9][0-9]_*.py")):
        values = {node.targets[0].id: node.value.value for node in ast.parse(path.read_text()).body
                  if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
                  and isinstance(node.value, ast.Constant)}
        if "TITLE" in values:  # a module split over several files has one entry file
            found[path.name[1:3]] = {"stem": path.stem, "title": values["TITLE"], "nproc": values.get("NPROC", 1)}
    return found


def todos_left(number: str) -> int:
    pattern = re.compile(r"raise NotImplementedError\(['\"]TODO\(")
    return sum(len(pattern.findall(p.read_text())) for p in (REPO / "steps").glob(f"m{number}_*.py"))


def is_given(number: str) -> bool:
    """A module with nothing for the learner to write (00): its solution files have no TODO markers."""
    return not any("# >>> TODO(" in p.read_text() for p in (REPO / "solutions").glob(f"m{number}_*.py"))


def cmd_list(args=None):
    print(f"{'module':<7} {'ranks':>5}  {'your TODOs':>10}  title")
    for number, info in modules().items():
        left = todos_left(number)
        status = "given" if is_given(number) else ("done" if left == 0 else f"{left} left")
        print(f"{number:<7} {info['nproc']:>5}  {status:>10}  {info['title']}")


def cmd_run(args):
    from course.launch import in_torchrun, run_ranks, run_under_torchrun

    from course.impl import load

    module = load(args.info["stem"], args.impl)
    with failures_explained(args.number, args.impl):
        if in_torchrun():
            return run_under_torchrun(module.demo, args, timeout=args.timeout)
        if args.nproc == 1:
            faulthandler.dump_traceback_later(args.timeout, exit=True)  # a watchdog here too
            try:
                return module.demo(args)
            finally:
                faulthandler.cancel_dump_traceback_later()
        run_ranks(module.demo, args.nproc, args, timeout=args.timeout)


@contextlib.contextmanager
def failures_explained(number: str, impl: str):
    """A rank that raised or got stuck, or an unfinished TODO, ends `run` and `bench` with a short
    error (and the stuck ranks' stacks) and a hint, instead of a long traceback."""
    from course.launch import RankFailed, RankTimeout, where_raised
    try:
        yield
    except RankTimeout as exc:
        print(f"error: {exc}", file=sys.stderr)  # the summary line, then every stuck rank's stack
        sys.exit(1)
    except (RankFailed, NotImplementedError) as exc:
        first_line = str(exc).splitlines()[0]
        if isinstance(exc, NotImplementedError):  # raised here, in the one process: say where
            first_line += where_raised(exc)
        print(f"error: {first_line}", file=sys.stderr)
        todo = re.search(r"TODO\(m(\d\d)\)", first_line)
        if todo and impl == "steps":
            owner = todo.group(1)
            if owner != number:
                print(f"hint: module {number} builds on your module {owner}: fill that TODO in first "
                      f"(`python main.py grade {owner}`); `--impl solutions` runs the reference", file=sys.stderr)
            else:
                print("hint: that TODO is yours to fill in steps/; `--impl solutions` runs the reference",
                      file=sys.stderr)
        sys.exit(1)


def test_files_in_build_order(number: str) -> list[str]:
    """Module NN's test files, those of the files it builds on first (06: ops, block, model), so a
    scorecard's first failure is the root cause, not a symptom further up."""
    def builds_on(test: Path) -> int:  # how many files of the same module its solution imports
        solution = REPO / "solutions" / f"m{test.stem.removeprefix('test_')}.py"
        return solution.read_text().count(f"from .m{number}_") if solution.exists() else 0
    return [str(p) for p in sorted((REPO / "tests").glob(f"test_{number}_*.py"), key=lambda p: (builds_on(p), p.name))]


def cmd_grade(args):
    if is_given(args.number):
        print(f"module {args.number} is given: nothing to fill in or grade. Its checks run with "
              f"`python -m pytest -m m{args.number}`; `python main.py run {args.number}` shows it.")
        return
    print(f"Grading {args.impl}/ for module {args.number}: {args.info['title']}\n", flush=True)
    test_files = test_files_in_build_order(args.number)
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "grades.json"
        # pytest prints each check's line as it finishes (--grading-live), so a slow or stuck
        # check shows which one it is; the summary comes from the report.
        try:  # each check has its own timeout (course/grading.py); this one is a last resort
            proc = subprocess.run(
                [sys.executable, "-m", "pytest", *test_files, "-qq", "--no-header", "--no-summary", "--tb=no",
                 "--continue-on-collection-errors", "-p", "no:cacheprovider", "-m", "not given",
                 f"--impl={args.impl}", "--grading-live", f"--grading-json={report}"],
                cwd=REPO, timeout=1800)
        except subprocess.TimeoutExpired:
            sys.exit(f"module {args.number}: grading was stopped after 30 minutes; the last check shown is "
                     "the one after which it got stuck")
        except KeyboardInterrupt:
            sys.exit(f"\nmodule {args.number}: grading interrupted")
        results = json.loads(report.read_text()) if report.exists() else []
    if proc.returncode not in (0, 1):  # 1: some checks failed; anything else: pytest itself stopped
        sys.exit(f"module {args.number}: pytest stopped early (exit code {proc.returncode}); "
                 "the checks shown above ran, the others did not")
    if not results:
        print(f"module {args.number}: no graded test ran (see pytest's output above; exit code {proc.returncode})")
        sys.exit(1)
    passed = sum(r["outcome"] == "passed" for r in results)
    skipped = sum(r["outcome"] == "skipped" for r in results)
    graded = len(results) - skipped  # e.g. GPU checks on a machine without one
    print(f"{passed}/{graded} checks pass" + (f" ({skipped} skipped)" if skipped else ""))
    if passed < graded:
        print(f"A check's whole output (tracebacks, your prints): python -m pytest --impl {args.impl} "
              f"{' '.join(os.path.relpath(f, REPO) for f in test_files)} -k NAME")
    sys.exit(0 if passed == graded else 1)


def cmd_bench(args):
    # --impl is main.py's; everything else is the benchmark's. By default the published tables
    # measure the reference.
    impl_parser = argparse.ArgumentParser(prog=f"main.py bench {args.number}", add_help=False)
    impl_parser.add_argument("--impl", choices=("steps", "solutions"), default="solutions")
    known, rest = impl_parser.parse_known_args(args.rest)
    impl = known.impl
    os.environ["COURSE_IMPL"] = impl  # read by course.impl.load, here and in forked ranks
    try:
        bench = importlib.import_module(f"course.bench.m{args.number}")
    except ModuleNotFoundError:
        sys.exit(f"error: module {args.number} has no benchmark")
    print(f"Benchmarking {impl}/" + (" (`--impl steps` benchmarks your code)" if impl == "solutions" else ""))
    with failures_explained(args.number, impl):
        bench.main(rest)


def cmd_tour(args):
    print("Distributed LLM training, built step by step: the modules, then two demos on CPU.\n")
    cmd_list()
    for number in TOUR:
        info = modules()[number]
        nproc = info["nproc"]
        print(f"\n=== module {number}: {info['title']} ({nproc} rank{'s' * (nproc > 1)}, reference solution)")
        cmd_run(parse(["run", number, "--impl", "solutions"]))
    print("\nMeasured bubbles sit above theory on a few shared CPU cores; docs/05-schedules.md explains why."
          "\nNext: read docs/00-monolith.md and docs/01-manual-split.md, fill in steps/m01_manual_split.py,"
          "\nthen `python main.py grade 01`. `python main.py --help` lists the commands.")


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="main.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("list")
    for name in ("run", "grade", "bench"):
        cmd = sub.add_parser(name, add_help=name != "run")  # run's --help also lists the module's options
        cmd.add_argument("number", help="module number, e.g. 04")
        if name == "run":
            cmd.add_argument("-h", "--help", action="store_true", help="show this help and the module's options")
            cmd.add_argument("--nproc", type=int, default=None, help="number of ranks (default: the module's)")
            cmd.add_argument("--impl", choices=("steps", "solutions"), default="steps")
            cmd.add_argument("--timeout", type=float, default=None,
                             help="seconds before the run is stopped (default: 60 with ranks, 600 without)")
        if name == "grade":
            cmd.add_argument("--impl", choices=("steps", "solutions"), default="steps")
        if name == "bench":
            cmd.add_argument("rest", nargs=argparse.REMAINDER,
                             help="the benchmark's own options, and --impl steps|solutions (default solutions)")
    args, extra = parser.parse_known_args(argv)
    if args.command in ("run", "grade", "bench"):
        known = modules()
        args.number = args.number.zfill(2)
        if args.number not in known:
            parser.error(f"unknown module {args.number!r}; modules: {', '.join(known)}")
        args.info = known[args.number]
    if args.command == "run":
        add_module_args(args, extra, parser, sub.choices["run"])
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def add_module_args(args, extra, parser, run_parser):
    """Parse the module's own options and check everything before any process starts."""
    from course.impl import load

    module = load(args.info["stem"], "solutions")  # option parsing and checks are given code
    own = argparse.ArgumentParser(prog=f"main.py run {args.number}", add_help=False,
                                  description=f"module {args.number}'s own options")
    if hasattr(module, "add_args"):
        module.add_args(own)
    if args.help:
        run_parser.print_help()
        print()
        own.print_help()
        raise SystemExit(0)
    try:
        vars(args).update(vars(own.parse_args(extra)))
    except SystemExit:
        raise SystemExit(2)
    if "WORLD_SIZE" in os.environ:  # under torchrun, which decides the number of ranks
        if args.nproc not in (None, int(os.environ["WORLD_SIZE"])):
            parser.error(f"--nproc {args.nproc} disagrees with torchrun's {os.environ['WORLD_SIZE']} ranks; drop --nproc")
        args.nproc = int(os.environ["WORLD_SIZE"])
    default = args.info["nproc"]
    args.nproc = default if args.nproc is None else args.nproc
    if args.timeout is None:
        args.timeout = 60.0 if args.nproc > 1 else 600.0
    if default == 1 and args.nproc != 1:
        parser.error(f"module {args.number} runs in a single process; drop --nproc")
    if default > 1 and args.nproc < 2:
        parser.error(f"module {args.number} is distributed: it needs --nproc of at least 2, got {args.nproc}")
    try:
        if hasattr(module, "check_args"):
            module.check_args(args)
    except ValueError as exc:
        parser.error(str(exc))


def main(argv: list[str]) -> None:
    args = parse(argv)
    commands = {None: cmd_tour, "list": cmd_list, "run": cmd_run, "grade": cmd_grade, "bench": cmd_bench}
    commands[args.command](args)


if __name__ == "__main__":
    main(sys.argv[1:])
