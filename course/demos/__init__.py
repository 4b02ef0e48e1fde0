"""The demos behind `python main.py run NN`: one file per module, course/demos/mNN.py (given code).

A demo file may define `add_args(parser)` (the module's own `run` options), `check_args(args)`
(raise ValueError with a one-line message; main.py calls it before any process starts, with
`args.world_size` set) and `default_world_size(args)` (the ranks when --nproc is not given, e.g. the
product of a --mesh; else the module's), and must define `demo(args)`, which runs once, or on every
rank. A demo loads the code it shows with `course.impl.load`, so it runs the learner's steps/ or
the reference solutions/ alike (`--impl`). What a module file teaches stays in solutions/; how it is shown
(options, printing, tables, plots) lives here.
"""
from __future__ import annotations

import argparse
import importlib
import os

from course.arguments import MAX_NPROC_VARIABLE, cannot_write_in, check_timeout, max_nproc
from course.compare import first_not_finite


def print_losses(losses: list[float], expected: list[float] | None = None, every: int = 5):
    """Every `every`-th loss and the last, beside the `expected` curve if there is one."""
    def line(label, step):
        beside = f"   expected {expected[step]:.6f}" if expected else ""
        return f"  {label}  loss {losses[step]:.6f}{beside}"
    for step in range(0, len(losses), every):
        print(line(f"step {step:3d}", step))
    print(line("final   ", -1))


def same_curve(losses: list[float], expected: list[float]) -> str:
    """'bit for bit', 'up to float32 rounding (1.2e-07)' or 'NO: ...', for a demo's verdict line. A
    nan or inf anywhere is a NO that says so (max() would skip a nan unless it came first)."""
    not_finite = first_not_finite(losses, expected)
    if not_finite:
        return f"NO: {not_finite}"
    if losses == expected:
        return "bit for bit"
    worst = max(abs(a - b) for a, b in zip(losses, expected, strict=True))
    return f"up to float32 rounding ({worst:.1e})" if worst <= 1e-6 else f"NO: they differ by up to {worst:.1e}"


def printable(text: str) -> str:
    """`text` with its control characters (escape sequences, bells, form feeds: what a barely
    trained model samples) shown as U+FFFD, so printing it cannot drive the terminal. Newlines stay."""
    return "".join(c if c.isprintable() or c == "\n" else "\ufffd" for c in text)


def parse_run_options(args, run_parser, error):
    """`run`'s options for `args.module`: the demo's own (`args.extra`), then every check, before
    any process starts. `error` is the command line's (one line, exit code 2)."""
    demo = importlib.import_module(args.module.demo)
    own = argparse.ArgumentParser(prog=f"main.py run {args.number}", add_help=False,
                                  description=f"module {args.number}'s own options")
    if hasattr(demo, "add_args"):
        demo.add_args(own)
    if args.help:
        run_parser.print_help()
        print()
        own.print_help()
        raise SystemExit(0)
    vars(args).update(vars(own.parse_args(args.extra)))
    default = args.module.world_size
    if hasattr(demo, "default_world_size") and default > 1:
        try:
            default = demo.default_world_size(args)
        except ValueError as exc:
            error(str(exc))
    single = args.module.world_size == 1  # a single-process module (a mesh of one rank is still distributed)
    if "WORLD_SIZE" in os.environ:  # under torchrun, which decides the number of ranks
        if single:
            error(f"module {args.number} runs in a single process: run it without torchrun, "
                  f"python main.py run {args.number}")
        if args.world_size not in (None, int(os.environ["WORLD_SIZE"])):
            error(f"--nproc {args.world_size} disagrees with torchrun's {os.environ['WORLD_SIZE']} ranks; drop --nproc")
        args.world_size = int(os.environ["WORLD_SIZE"])
    args.world_size = default if args.world_size is None else args.world_size
    if single and args.world_size != 1:
        error(f"module {args.number} runs in a single process; drop --nproc")
    # A module with a mesh (13, 17) may run on one rank (the mesh d=1); its check_args compares mesh and ranks.
    if not single and args.world_size < 2 and not hasattr(demo, "default_world_size"):
        error(f"module {args.number} is distributed: it needs --nproc of at least 2, got {args.world_size}")
    try:
        check_ranks(args.world_size)
        # A demo may say how long it runs by default (TIMEOUT_S, e.g. module 17's real run); else 60 s with ranks.
        default_timeout = getattr(demo, "TIMEOUT_S", 60.0 if args.world_size > 1 else 600.0)
        args.timeout = args.timeout if args.timeout is not None else default_timeout
        check_timeout(args.timeout, "--timeout")
    except ValueError as exc:
        error(str(exc))
    if getattr(args, "trace", None):
        check_writable(args.trace, "--trace", error)
    try:
        if hasattr(demo, "check_args"):
            demo.check_args(args)
    except ValueError as exc:
        error(str(exc))


def check_ranks(world_size: int):
    """The ranks this machine forks (--nproc, or a mesh's product), at most max_nproc(); torchrun's are its own."""
    if world_size < 1:
        raise ValueError(f"--nproc must be at least 1, got {world_size}")
    if "WORLD_SIZE" not in os.environ and world_size > max_nproc():
        raise ValueError(f"{world_size} ranks: at most {max_nproc()} are forked on one machine (each a process); "
                         f"set {MAX_NPROC_VARIABLE} to allow more")


def check_writable(prefix: str, option: str, error):
    """`error` unless files PREFIX.* can be written (a file where a folder should be, no permission, a
    read-only disk), so a bad path is refused before the run, not found after it."""
    folder = os.path.dirname(prefix) or "."
    why = cannot_write_in(folder)
    if why:
        error(f"{option} {prefix}: cannot write in {folder} ({why})")


def log_every(every: int, steps: int):
    """An `on_step(step, loss)` for a training loop: prints every `every`-th step and the last."""
    def on_step(step: int, loss: float):
        if step % every == 0 or step == steps - 1:
            print(f"  step {step:4d}  loss {loss:.4f}", flush=True)
    return on_step
