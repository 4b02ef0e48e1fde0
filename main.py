"""The course's command line.

    python main.py                      a short tour: the modules, then demos that run on CPU
    python main.py list                 modules, with the TODOs left in your steps/ and the hints you saw
    python main.py run NN [--nproc N]   run module NN's demo on N CPU ranks
    python main.py grade NN             grade module NN: a scorecard
    python main.py hint NN [TODO]       the next level of help with a TODO
    python main.py bench NN             measured-versus-theory tables
    python main.py site [--check]       the course as a website, in results/site/ (checked in Chromium)
    python main.py plan --model M --gpus N --gpu G   module 18's planner: the layouts of a real cluster, ranked

Every command runs your steps/; add `--impl solutions` for the reference (the tour runs it).
`run` starts its own ranks (forked, gloo), or runs as one of them under
`torchrun --nproc-per-node N main.py run NN`. Bad arguments are refused before any process starts
(course/arguments.py states the bounds: e.g. at most 64 forked ranks, COURSE_MAX_NPROC raises it).
Ctrl-C, SIGTERM and SIGHUP end any command in one line, with every process it started.
This file only reads the command and calls the course/ code that does it.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys

from course.catalog import MODULES
from course.fork_safety import hide_gpus_from_autograd
from course.interrupts import interrupt_on_signals, interruption

TOUR = ("00", "05")  # the baseline, then the latest module that reproduces it across ranks


def cmd_list(args=None):
    from course.hints import HintError, hints_seen, load_shown
    from course.impl import steps_dir

    try:
        shown = load_shown()
    except HintError as exc:  # a record that cannot be read: said in one line, the table printed all the same
        print(f"error: {exc}", file=sys.stderr)
        shown = None
    # hints: of each module's TODOs, how many with no hint seen / with hints up to level 2 / with level 3
    print(f"{'module':<7} {'ranks':>5}  {'your TODOs':>10}  {'hints: none/≤2/3':>16}  title")
    for m in MODULES.values():
        seen = "" if m.is_given() else "?" if shown is None else hints_seen(m, shown).compact()
        print(f"{m.number:<7} {m.ranks:>5}  {m.status(steps_dir()):>10}  {seen:>16}  {m.title}")


def cmd_tour(args):
    print("Distributed LLM training, built step by step: the modules, then two demos on CPU.\n")
    cmd_list()
    for number in TOUR:
        m = MODULES[number]
        print(f"\n=== module {number}: {m.title} ({m.ranks} rank{'s' * (m.ranks > 1)}, reference solution)")
        cmd_run(parse(["run", number, "--impl", "solutions"]))
    print("\nNext: read docs/00-monolith.md and docs/01-manual-split.md, fill in steps/m01_manual_split.py,"
          "\nthen `python main.py grade 01`. `python main.py --help` lists the commands.")


def cmd_run(args):
    from course.launch import failures_explained, run_demo

    select(args)
    with failures_explained(args.module.number, args.impl):
        load_implementation(args.module)
        run_demo(importlib.import_module(args.module.demo).demo, args)


def cmd_grade(args):
    from course.grade import grade

    if grade(args.module, args.impl, args.keep_going):
        sys.exit(1)


def cmd_hint(args):
    from course.hints import command

    sys.exit(command(args.module, args.todo, args.all))


def cmd_bench(args):
    from course.bench import check_results_writable
    from course.launch import failures_explained

    select(args)  # before the benchmark is imported: it measures the implementation selected
    if importlib.util.find_spec(f"course.bench.m{args.module.number}") is None:
        sys.exit(f"error: module {args.module.number} has no benchmark")
    if not {"-h", "--help"} & set(args.extra):
        check_results_writable()  # before measuring for minutes
    with failures_explained(args.module.number, args.impl):
        load_implementation(args.module)
        importlib.import_module(f"course.bench.m{args.module.number}").main(args.extra)


def cmd_site(args):
    from course.site.build import main as build_site

    sys.exit(build_site(args))


def cmd_plan(args):
    from course.plan import main as plan

    plan(args.extra)  # course/plan.py parses its own options (--help lists them)


def select(args):
    """Make `--impl` the implementation that course.impl.load returns, here and in forked ranks."""
    os.environ["COURSE_IMPL"] = args.impl


def load_implementation(module):
    """Import the module's files from the implementation selected, once, before any rank starts:
    code that cannot be imported is one error here, not one per rank."""
    from course.impl import load

    for stem in module.files:
        load(stem)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="main.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("list")
    sub.add_parser("plan", add_help=False)  # its options are course/plan.py's
    for name in ("run", "grade", "hint", "bench"):  # run's and bench's --help also show the module's options
        cmd = sub.add_parser(name, add_help=name in ("grade", "hint"))
        cmd.add_argument("number", help="module number, e.g. 04")
        if name != "hint":
            cmd.add_argument("--impl", choices=("steps", "solutions"), default="steps",
                             help="your steps/ (default) or the reference solutions/")
    sub.choices["grade"].add_argument("--keep-going", action="store_true", help="run every check, also after one hangs")
    hint = sub.choices["hint"]
    hint.add_argument("todo", nargs="?", help="a TODO's number (or its exact title, or the function that holds "
                      "it); default: list them")
    hint.add_argument("--all", action="store_true", help="every level at once")
    run = sub.choices["run"]
    run.add_argument("-h", "--help", action="store_true", help="show this help and the module's options")
    run.add_argument("--nproc", dest="world_size", type=int, default=None,
                     help="number of ranks (default: the module's)")
    run.add_argument("--timeout", type=float, default=None,
                     help="seconds before the run is stopped (default: 60 with ranks, 600 without)")
    site = sub.add_parser("site")
    site.add_argument("--execute", action="store_true", help="run every notebook again (default: reuse the "
                      "executed copies the test suite keeps in results/executed/, run the others)")
    site.add_argument("--open", action="store_true", help="open the site in your web browser")
    site.add_argument("--check", action="store_true", help="then check every page in headless Chromium")
    args, args.extra = parser.parse_known_args(argv)
    if args.command != "run" and "TORCHELASTIC_RUN_ID" in os.environ:  # course.launch.in_torchrun
        parser.error(f"only `run` runs under torchrun (each rank would run its own "
                     f"`{args.command or 'tour'}`); run it without torchrun: python main.py {' '.join(argv)}".rstrip())
    if args.command in ("run", "grade", "hint", "bench"):
        args.number = args.number.zfill(2) if args.number.isdigit() else args.number  # "4" is 04; "" is no module
        if args.number not in MODULES:
            parser.error(f"unknown module {args.number!r}; modules: {', '.join(MODULES)}")
        args.module = MODULES[args.number]
        if args.command != "hint" and importlib.util.find_spec("torch") is None:
            sys.exit(f"error: this Python ({sys.executable}) has no torch; install the course's requirements into "
                     "it (pip install -r requirements.txt) or run main.py with the Python that has them")
    if args.command == "run":
        from course.demos import parse_run_options

        parse_run_options(args, run, parser.error)
    elif args.extra and args.command not in ("bench", "plan"):  # a benchmark and the planner parse their own
        parser.error(f"unrecognized arguments: {' '.join(args.extra)}")
    return args


def asks_for_a_gpu(args) -> bool:
    """A benchmark run with --device cuda[:N]; every other command forks CPU ranks or needs no GPU."""
    extra = " ".join(args.extra).replace("=", " ").split()
    return args.command == "bench" and any(a == "--device" and b.startswith("cuda") for a, b in zip(extra, extra[1:]))


def main(argv: list[str]) -> None:
    args = parse(argv)
    if "TORCHELASTIC_RUN_ID" not in os.environ and not asks_for_a_gpu(args):
        hide_gpus_from_autograd()  # before torch runs a backward (course/fork_safety.py says why)
    commands = {None: cmd_tour, "list": cmd_list, "run": cmd_run, "grade": cmd_grade, "hint": cmd_hint, "bench": cmd_bench,
                "site": cmd_site, "plan": cmd_plan}
    commands[args.command](args)


if __name__ == "__main__":
    interrupt_on_signals(under_torchrun="TORCHELASTIC_RUN_ID" in os.environ)
    try:
        main(sys.argv[1:])
    except KeyboardInterrupt as stop:  # before a command took over (e.g. while torch was imported)
        sys.exit(f"error: interrupted by {interruption(stop)}")
    except BrokenPipeError:  # the reader left early (python main.py list | head): stop without a traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's flush at exit would fail again
        sys.exit(1)
