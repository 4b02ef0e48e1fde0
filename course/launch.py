"""Run a function on N CPU ranks, the way the tests and `python main.py run` do.

Each rank is a process *forked* from the caller (about 0.1 s, versus seconds for a fresh
interpreter), joins a gloo process group through a rendezvous file (no TCP port to race for) and
runs `fn(*args)`. The caller gets every rank's return value, or an exception that says which rank
failed and where:

* a rank raises        -> `RankFailed` at once; the other ranks (maybe blocked in a `recv` that
                          will never complete) are killed, so a TODO fails in milliseconds;
* the timeout expires  -> every live rank dumps its Python stack (faulthandler, on SIGUSR1), all
  (or Ctrl-C, SIGTERM,    ranks are killed, and `RankTimeout` names each stuck rank and its line
  SIGHUP)                 (`RankInterrupted`: each rank still working, and where it was interrupted).

Ranks leave signals to their parent: they ignore Ctrl-C, SIGTERM and SIGHUP (the parent reports
and kills them), and die with it if it is killed (a parent-death signal). Their temporary folder
(rendezvous file, stack dumps) is removed on every way out.

A rank that has finished waits (without exiting) until every rank has, so a peer still blocked on
it shows up as stuck where it is, not as a "connection closed" error from a rank that left.

Under `torchrun` there is no parent to watch the ranks, so `run_under_torchrun` arms a per-rank
watchdog instead: on expiry the rank says where it was stuck and exits, and torchrun stops the rest.
A single-process demo runs under the same watchdog.

`run_demo` picks one of these for `python main.py run`, and `failures_explained` turns what a
rank raised into the short error and hint a learner reads.
"""
from __future__ import annotations

import ast
import contextlib
import faulthandler
import functools
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path

import torch
import torch.distributed as dist

from course import REPO
from course.arguments import check_timeout
from course.fork_safety import AUTOGRAD_AFTER_FORK
from course.interrupts import SIGNALS, interruption, signals_deferred
from course.skeleton import has_solution_blocks, todo_blocks, todo_owner

STACK_DUMP_GRACE_S = 0.5  # time a rank gets to write its stack after SIGUSR1
WATCHDOG_BACKSTOP_S = 30  # after the watchdog's own timeout: for a process that never lets it run
# gloo's words when the process at the other end of a connection is gone (killed, out of memory)
PEER_DIED = ("Connection closed by peer", "Connection reset by peer")


class RankFailed(RuntimeError):
    """A rank raised an exception (its message and location are in ours)."""


class RankTimeout(RuntimeError):
    """Ranks were still running when the timeout expired (deadlock, or just too slow)."""


class RankInterrupted(RankTimeout):
    """Ranks were still running when Ctrl-C, SIGTERM or SIGHUP stopped the run."""


def in_torchrun() -> bool:
    """True when this process was started by torchrun (it sets TORCHELASTIC_RUN_ID)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def run_ranks(fn, world_size: int, *args, timeout: float = 60.0, init_process_group: bool = True):
    """Run `fn(*args)` on `world_size` forked gloo ranks; return the list of their results by rank.

    With `init_process_group=False` the ranks only get torchrun's environment variables (RANK,
    WORLD_SIZE, LOCAL_RANK, ...) and must join a group themselves.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    check_timeout(timeout)
    _import_before_forking()
    ctx = mp.get_context("fork")
    procs, conns, tmp, hold_writer = [], [], None, None
    try:
        # Starting the ranks is not cut short by a signal (a rank forked but not yet listed here
        # would be left running): one that comes meanwhile is acted on once they are all listed.
        with signals_deferred():
            tmp = tempfile.mkdtemp(prefix="course-ranks-")
            # Finished ranks block reading `hold` until the parent closes its end (EOF) at the end.
            hold, hold_writer = ctx.Pipe(duplex=False)
            for rank in range(world_size):
                reader, writer = ctx.Pipe(duplex=False)
                proc = ctx.Process(
                    target=_rank_main,
                    args=(fn, args, rank, world_size, tmp, timeout, init_process_group, writer, hold, hold_writer),
                    name=f"rank{rank}",
                    daemon=True,
                )
                proc.start()
                writer.close()  # keep only the child's copy, so its exit reads as EOF here
                procs.append(proc)
                conns.append(reader)
        results = _collect(procs, conns, tmp, timeout)
        hold_writer.close()  # every rank is done: let them leave the group and exit
        for proc in procs:
            proc.join(timeout=5.0)
        return results
    finally:
        with signals_deferred():  # a second Ctrl-C must not leave ranks or their folder behind
            if hold_writer is not None:
                hold_writer.close()
            for proc in procs:  # after a failure, a timeout or a signal, or a rank slow to exit
                if proc.is_alive():
                    proc.kill()
                proc.join()
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)


def _import_before_forking():
    """What every rank would otherwise import after the fork, each on its own: the first optimizer
    imports torch._dynamo (seconds per rank when several import it at once on a few cores)."""
    torch.optim.Adam([torch.zeros(1, requires_grad=True)])


def run_under_torchrun(fn, *args, timeout: float = 300.0):
    """Run `fn(*args)` in this torchrun-started rank, under a watchdog."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    try:
        with watchdog(timeout, f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} "):
            return fn(*args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def watchdog(timeout: float, who: str = ""):
    """For a process no parent watches (one rank under torchrun, or a single-process demo): if it is
    still running after `timeout` seconds, it says where it was stuck, prints its stack and exits.

    A thread does it while holding the interpreter's lock, so the stack it reads stands still
    (faulthandler's timer reads it without the lock: a crash if it fires while Python code runs).
    faulthandler remains as a backstop, for native code that never lets the thread run."""
    check_timeout(timeout)
    watched = threading.current_thread().ident

    def expire():
        frame = sys._current_frames().get(watched)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else ""
        print(f"error: {who}timed out after {timeout:g} s at {where_running(frame)}\n\n{stack}",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)

    timer = threading.Timer(timeout, expire)
    timer.daemon = True
    timer.start()
    faulthandler.dump_traceback_later(timeout + WATCHDOG_BACKSTOP_S, exit=True)
    try:
        yield
    finally:
        timer.cancel()
        faulthandler.cancel_dump_traceback_later()


def run_demo(demo, args):
    """`python main.py run`: `demo(args)` as one rank of torchrun's, in this process (a single-process
    module), or on `args.world_size` forked ranks (a distributed demo on one rank too, e.g. module 17 on
    the mesh p=1: it joins a process group); each way stops after `args.timeout` seconds."""
    if in_torchrun():
        return run_under_torchrun(demo, args, timeout=args.timeout)
    distributed = getattr(args, "module", None) is not None and args.module.world_size > 1
    if args.world_size == 1 and not distributed:
        with watchdog(args.timeout):
            return demo(args)
    run_ranks(demo, args.world_size, args, timeout=args.timeout)


@contextlib.contextmanager
def failures_explained(number: str, impl: str):
    """A rank that raised or got stuck, an unfinished TODO, code that cannot be imported, Ctrl-C, or
    (under torchrun) a peer rank that died end `run` and `bench` with a short error (and the stuck
    ranks' stacks) and a hint, instead of a long traceback."""
    try:
        yield
    except RankTimeout as exc:
        # The summary line (where each rank was), then for a timeout every stuck rank's stack.
        print(f"error: {str(exc).splitlines()[0] if isinstance(exc, RankInterrupted) else exc}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM or SIGHUP (main.py): say where it was
        rank = f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} " if in_torchrun() else ""
        print(f"error: {rank}interrupted by {interruption(exc)}{where_raised(exc)}", file=sys.stderr)
        sys.exit(1)
    except (ImportError, SyntaxError) as exc:  # the implementation itself cannot be imported
        where = f" (at {_short(exc.filename)}:{exc.lineno})" if isinstance(exc, SyntaxError) else where_raised(exc)
        message = exc.msg if isinstance(exc, SyntaxError) else str(exc)
        print(f"error: {type(exc).__name__}: {message}{where}", file=sys.stderr)
        sys.exit(1)
    except (RankFailed, NotImplementedError) as exc:
        first_line = str(exc).splitlines()[0]
        if isinstance(exc, NotImplementedError):  # raised here, in the one process: say where
            first_line += where_raised(exc)
        print(f"error: {first_line}", file=sys.stderr)
        owner = todo_owner(first_line)
        if owner and impl == "steps":
            if owner != number:
                print(f"hint: module {number} builds on your module {owner}: fill that TODO in first "
                      f"(`python main.py grade {owner}`); `--impl solutions` runs the reference", file=sys.stderr)
            else:
                print("hint: that TODO is yours to fill in steps/; `--impl solutions` runs the reference",
                      file=sys.stderr)
        sys.exit(1)
    except RuntimeError as exc:  # under torchrun: a peer's process is gone (killed, out of memory)
        if not any(words in str(exc) for words in PEER_DIED):
            raise
        rank = f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}: " if in_torchrun() else ""
        print(f"error: {rank}a peer rank died, so this one stopped{where_raised(exc)}; torchrun's report names "
              f"the rank that died", file=sys.stderr)
        sys.exit(1)


# --- inside a forked rank ---------------------------------------------------------------------

def _rank_main(fn, args, rank, world_size, tmp, timeout, init_process_group, conn, hold, hold_writer):
    for s in SIGNALS:  # Ctrl-C (sent to the whole terminal's group), SIGTERM, SIGHUP: the parent's
        signal.signal(s, signal.SIG_IGN)  # to handle: it reports where the ranks were, then kills them
    _die_with_parent()
    hold_writer.close()  # only the parent may keep it open, or `hold` would never see EOF
    torch.set_num_threads(1)  # N ranks share the cores; also avoids a fork-after-OpenMP hang
    if hasattr(sys.stdout, "reconfigure"):  # not in a Jupyter kernel, whose stdout is its own
        # A print is two writes (text, then "\n"); buffered until the newline they leave as one
        # write of the whole line, so ranks' lines do not interleave (even under python -u).
        sys.stdout.reconfigure(line_buffering=True, write_through=False)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    stack_file = open(Path(tmp) / f"stack-{rank}.txt", "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=False)
    # A fatal signal (SIGABRT from gloo, SIGSEGV) writes its stack here too, not into the terminal,
    # where it would land in the middle of whatever the parent prints next: the parent reads it.
    faulthandler.enable(file=stack_file, all_threads=False)
    try:
        if init_process_group:
            # The group's own timeout is a backstop; the parent's watchdog should fire first.
            dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank,
                                    world_size=world_size, timeout=timedelta(seconds=timeout + 30))
        message = ("ok", fn(*args))
    except BaseException as exc:  # report everything, KeyboardInterrupt and SystemExit included
        message = ("error", _describe_exception(exc, rank, world_size))
    try:
        payload = pickle.dumps(message)
    except Exception as exc:
        payload = pickle.dumps(("error", f"rank {rank} returned a value that cannot be pickled: {exc}"))
    conn.send_bytes(payload)
    conn.close()
    try:
        hold.recv_bytes()
    except EOFError:
        pass
    if dist.is_initialized():
        dist.destroy_process_group()


def _die_with_parent():
    """Ask Linux to kill this rank if its parent dies, so no rank outlives a killed test run."""
    if sys.platform.startswith("linux"):
        import ctypes
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def where_raised(exc: BaseException) -> str:
    """' (at steps/m13_named_axes.py:40 in all_gather <- steps/m13_llama_2d.py:215 in attention_half;
    raised in given code at steps/m13_specs.py:180 in check_matches)': the learner's own frames first
    (the innermost one in a file they fill in, and the innermost in another such file that led
    there: the bug is often in the caller), then where it was raised if that is given code; or ''.
    With no learner's frame on the stack: the innermost course frame and its caller in steps/ or
    solutions/. An error a check raised `from` the learner's ("your LlamaStage.forward raised ...") is
    located where the learner's one was."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if _is_course_file(f.filename)]
    mine = [f for f in frames if is_learners_file(f.filename) and not _is_given_function(f)]
    if not mine and exc.__cause__ is not None and where_raised(exc.__cause__):
        return where_raised(exc.__cause__)
    if not frames:
        return ""
    innermost = mine[-1] if mine else frames[-1]
    callers = [f for f in reversed(mine or frames) if f.filename != innermost.filename
               and (mine or _short(f.filename).startswith(("steps/", "solutions/")))]
    where = " <- ".join(_frame(f) for f in [innermost, *callers[:1]])
    if mine and frames[-1] is not innermost:
        where += f"; raised in given code at {_frame(frames[-1])}"
    return f" (at {where})"


def _frame(f: traceback.FrameSummary) -> str:
    return f"{_short(f.filename)}:{f.lineno} in {f.name}"


def is_learners_file(filename: str) -> bool:
    """Whether `filename` is one the learner fills in: a file of the implementation being run (steps/,
    or solutions/ when it is the one graded) whose module has TODOs (not a given file such as
    m13_specs.py, and not the reference that a test calls as a trusted helper)."""
    from course.impl import selected, steps_dir
    path = Path(filename).resolve()
    home = steps_dir() if selected() == "steps" else REPO / "solutions"
    return path.parent == home.resolve() and _has_todos(path.name)


def _is_given_function(f: traceback.FrameSummary) -> bool:
    """Whether a frame in a learner's file runs given code there (module 11's StageComms._check): a
    function the reference defines with no TODO in it. A function of the learner's own is theirs, and
    so is one they define inside a function with a TODO (a helper named `forward` in module 05's
    one_f_one_b is not the given forward)."""
    given, with_todos = _given_functions(Path(f.filename).name)
    if f.name not in given:
        return False
    return not any(outer in with_todos for outer in _enclosing_functions(f.filename, f.lineno))


@functools.cache
def _given_functions(name: str) -> tuple[frozenset, frozenset]:
    """(the functions the reference defines with no TODO in them, those with one) of a module file."""
    solution = REPO / "solutions" / name
    if not solution.is_file():
        return frozenset(), frozenset()
    source = solution.read_text()
    defined = {node.name for node in ast.walk(ast.parse(source))
               if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    with_todos = {block.function.rsplit(".", 1)[-1] for block in todo_blocks(source, name)}
    return frozenset(defined - with_todos), frozenset(with_todos)


def _enclosing_functions(filename: str, line: int) -> list[str]:
    """The functions around the innermost one that holds `line` in the file as it is now (the learner's)."""
    try:
        tree = ast.parse(Path(filename).read_text())
    except (OSError, SyntaxError, ValueError):
        return []
    spans = [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
             and node.lineno <= line <= (node.end_lineno or node.lineno)]
    spans.sort(key=lambda node: node.lineno)      # outermost first; the innermost (the frame's own) is last
    return [node.name for node in spans[:-1]]


@functools.cache
def _has_todos(name: str) -> bool:
    solution = REPO / "solutions" / name
    return solution.is_file() and has_solution_blocks(solution.read_text())


def _describe_exception(exc, rank, world_size) -> str:
    # Where it was raised goes on the first line, which is all a scorecard shows of a long message.
    first, *rest = str(exc).splitlines() or [""]
    summary = "\n".join([f"rank {rank} of {world_size} raised {type(exc).__name__}: {first}{where_raised(exc)}", *rest])
    if AUTOGRAD_AFTER_FORK in first:
        summary += ("\nThe process that forked the ranks ran a backward while torch saw a GPU. Start it with the GPUs "
                    "hidden (CUDA_VISIBLE_DEVICES= python ..., or course.fork_safety.hide_gpus_from_autograd() before "
                    "any backward), as main.py and pytest do.")
    return summary + "\n\n" + "".join(traceback.format_exception(exc))


# --- in the parent -----------------------------------------------------------------------------

def _collect(procs, conns, tmp, timeout):
    results = [None] * len(procs)
    waiting = {conn: rank for rank, conn in enumerate(conns)}
    deadline = time.monotonic() + timeout
    while waiting:
        try:
            ready = wait(list(waiting), timeout=max(0.0, deadline - time.monotonic()))
        except KeyboardInterrupt as exc:
            with signals_deferred():  # the report takes half a second: a second Ctrl-C waits for it
                report = _stuck_report(procs, sorted(waiting.values()), tmp, f"interrupted by {interruption(exc)}",
                                       interrupted=True)
            raise RankInterrupted(report) from None
        if not ready:
            raise RankTimeout(_stuck_report(procs, sorted(waiting.values()), tmp, f"timed out after {timeout:g} s"))
        for conn in ready:
            rank = waiting.pop(conn)
            try:
                status, value = pickle.loads(conn.recv_bytes())
            except EOFError:
                procs[rank].join(1.0)
                dump = _stack_dump(tmp, rank)
                where = f" at {_innermost_course_frames(dump)}" if "File " in dump else ""
                raise RankFailed(f"rank {rank} of {len(procs)} died without a result "
                                 f"({_why_it_died(procs[rank].exitcode)}){where}") from None
            if status == "error":
                raise RankFailed(value)
            results[rank] = value
    return results


def _why_it_died(exitcode) -> str:
    """A dead rank's exit code in words; a negative code is the signal that killed it."""
    if exitcode is None or exitcode >= 0:
        return f"exit code {exitcode}"
    name = signal.Signals(-exitcode).name
    causes = {"SIGABRT": "the C++ runtime aborted, often gloo on messages that differ between ranks "
                         "(a recv buffer whose size or dtype is not what the peer sends, collectives in "
                         "another order, or one rank skipping one); its own message went to stderr "
                         "(pytest shows it under 'Captured stderr')",
              "SIGKILL": "killed from outside, often for running out of memory",
              "SIGSEGV": "a crash in native code"}
    return f"killed by {name}" + (f": {causes[name]}" if name in causes else "")


def _stuck_report(procs, stuck, tmp, what, interrupted: bool = False) -> str:
    """Where each rank still running was: stuck (a timeout), or working and `interrupted` (Ctrl-C, a signal),
    which says nothing about a bug: no diagnosis then, only the places."""
    for rank in stuck:
        if procs[rank].is_alive():
            os.kill(procs[rank].pid, signal.SIGUSR1)
    time.sleep(STACK_DUMP_GRACE_S)
    summary, details = [], []
    for rank in stuck:
        dump = _stack_dump(tmp, rank)
        where = (_innermost_course_frames(dump, stuck=not interrupted) if dump.strip()
                 else "(starting: no stack written yet)")
        summary.append(f"rank {rank} at {where}")
        details.append(f"--- rank {rank} ---\n{dump.strip() or '(none)'}")
    ranks = ", ".join(str(r) for r in stuck)
    finished = [str(r) for r in range(len(procs)) if r not in stuck]
    done = f" (finished: rank {', '.join(finished)})" if finished else ""
    if interrupted:
        many = len(stuck) > 1
        return (f"{what}; {'ranks' if many else 'rank'} {ranks} interrupted where {'they were' if many else 'it was'}"
                f"{done}: " + "; ".join(summary) + "\n\n"
                + "\n".join(details))
    hint = ""
    if finished and any(" in recv" in line for line in summary):
        # The peer returned without a matching send still owed: often a non-blocking send whose
        # handle was dropped. On gloo such a message may never leave, and the receiver waits forever.
        hint = (" A rank waits in a receive while a peer has finished: was a non-blocking send's handle "
                "dropped (not kept and waited for)? Then its message may never be delivered.")
    return (f"{what}; still running: rank {ranks}{done}. "
            + "; ".join(summary) + hint + "\n\n" + "\n".join(details))


def _stack_dump(tmp, rank) -> str:
    """What rank `rank` wrote to its stack file: '' if it has not opened it yet (a very short timeout)."""
    try:
        return (Path(tmp) / f"stack-{rank}.txt").read_text()
    except FileNotFoundError:
        return ""


def _innermost_course_frames(dump: str, depth: int = 3, stuck: bool = True) -> str:
    """'file:line in func <- caller...' for the innermost course frames of a faulthandler dump; when
    the rank is in given code, the learner's own frames first, as where_raised shows them (`stuck`:
    said of a rank that timed out, not of one interrupted while it worked)."""
    frames = []  # (filename, 'file:line in func'), innermost first
    for line in dump.splitlines():  # faulthandler lists the most recent call first
        line = line.strip()
        if line.startswith("File "):
            filename = line.split('"')[1]
            lineno, func = line.rsplit("line ", 1)[1].split(" in ", 1)
            if func == "_rank_main":
                break  # older frames belong to the parent the rank was forked from
            if _is_course_file(filename):
                frames.append((filename, f"{_short(filename)}:{lineno} in {func}"))
    mine = [f for f in frames if is_learners_file(f[0])]
    if mine and frames[0] is not mine[0]:
        callers = [f for f in mine if f[0] != mine[0][0]]
        given = f"; {'stuck ' if stuck else ''}in given code at {frames[0][1]}"
        return " <- ".join(text for _, text in [mine[0], *callers[:1]]) + given
    return " <- ".join(text for _, text in frames[:depth]) or "(no course frame on the stack)"


def where_running(frame) -> str:
    """'file:line in func' of the innermost course frame of a running stack (`frame` is its innermost
    frame, e.g. the one a signal interrupted), so the learner sees their line, not torch's."""
    while frame is not None and not _is_course_file(frame.f_code.co_filename):
        frame = frame.f_back
    return f"{_short(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}" if frame else "?"


def _is_course_file(filename: str) -> bool:
    """Course code is anything that is neither Python's nor an installed package's, nor the
    machinery around it: this file, the signal handler that raises Ctrl-C's KeyboardInterrupt,
    main.py (never where a run was stuck)."""
    if filename.startswith("<") or "site-packages" in filename:
        return False
    path = Path(filename).resolve()
    return (path not in (Path(__file__).resolve(), REPO / "course" / "interrupts.py", REPO / "main.py")
            and not path.is_relative_to(Path(sys.base_prefix).resolve()))


def _short(filename: str) -> str:
    path = Path(filename).resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else filename
