"""The launcher every multi-rank test and demo relies on: results, fast failure, timeouts, cleanup."""
import argparse
import contextlib
import io
import os
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from course import REPO
from course.fork_safety import AUTOGRAD_AFTER_FORK, environment_with_gpus
from course.launch import RankFailed, RankTimeout, failures_explained, run_demo, run_ranks, watchdog


def _child_pids() -> set[int]:
    """Live (non-zombie) processes whose parent is this process (Linux /proc)."""
    pids = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            pids.add(int(stat.parent.name))
    return pids


def _identify(offset):
    return dist.get_rank(), dist.get_world_size(), os.environ["RANK"], torch.get_num_threads(), offset


def test_results_come_back_in_rank_order():
    assert run_ranks(_identify, 3, 7, timeout=20) == [(r, 3, str(r), 1, 7) for r in range(3)]


def _raise_on_rank_one():
    if dist.get_rank() == 1:
        raise NotImplementedError("TODO(m99): something")
    dist.recv(torch.empty(1), src=1)  # rank 0 would wait for ever: the launcher must not


def test_a_raising_rank_fails_the_run_at_once_and_says_where():
    start = time.monotonic()
    with pytest.raises(RankFailed) as failure:
        run_ranks(_raise_on_rank_one, 2, timeout=30)
    elapsed = time.monotonic() - start
    first_line = str(failure.value).splitlines()[0]
    assert first_line.startswith("rank 1 of 2 raised NotImplementedError: TODO(m99): something")
    assert "test_course_launch.py" in first_line and "_raise_on_rank_one" in first_line
    # Typically 0.1-0.3 s; the bound only separates failing at once from waiting for the 30 s timeout.
    assert elapsed < 10.0, f"took {elapsed:.2f} s: a failing rank must not wait for the timeout"


def _receive_from_each_other():
    dist.recv(torch.empty(1), src=1 - dist.get_rank())  # both ranks receive: a deadlock


def test_a_deadlock_times_out_naming_every_stuck_rank_and_line():
    with pytest.raises(RankTimeout) as timeout:
        run_ranks(_receive_from_each_other, 2, timeout=1.0)
    message = str(timeout.value)
    first_line = message.splitlines()[0]
    assert "still running: rank 0, 1" in first_line
    for rank in (0, 1):
        assert f"rank {rank} at tests/test_course_launch.py:" in first_line
    assert "in _receive_from_each_other" in first_line
    assert "--- rank 1 ---" in message, "the full stack dumps follow the summary"


def _rank_zero_leaves_early():
    if dist.get_rank() == 1:
        dist.recv(torch.empty(1), src=0)  # rank 0 never sends: rank 1 is the one stuck


def test_a_rank_stuck_on_a_finished_peer_is_reported_stuck():
    with pytest.raises(RankTimeout) as timeout:
        run_ranks(_rank_zero_leaves_early, 2, timeout=1.0)
    first_line = str(timeout.value).splitlines()[0]
    assert "still running: rank 1 (finished: rank 0)." in first_line and "in _rank_zero_leaves_early" in first_line


def test_no_rank_outlives_the_run():
    with pytest.raises(RankTimeout):
        run_ranks(_receive_from_each_other, 2, timeout=0.5)
    with pytest.raises(RankFailed):
        run_ranks(_raise_on_rank_one, 2, timeout=30)
    assert _child_pids() == set()


def _exit_abruptly():
    if dist.get_rank() == 0:
        os._exit(3)
    return "fine"


def test_a_rank_that_dies_without_a_word_is_reported():
    with pytest.raises(RankFailed, match=r"rank 0 of 2 died without a result \(exit code 3\)"):
        run_ranks(_exit_abruptly, 2, timeout=20)


def _abort():
    if dist.get_rank() == 1:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file left behind
        os.abort()  # what the C++ runtime does on, e.g., mismatched gloo collectives
    return "fine"


def test_a_rank_killed_by_a_signal_is_reported_with_the_likely_cause_and_line(capfd):
    with pytest.raises(RankFailed, match=r"rank 1 of 2 died without a result \(killed by SIGABRT: .*gloo.*\) "
                                         r"at tests/test_course_launch.py:\d+ in _abort"):
        run_ranks(_abort, 2, timeout=20)
    # The dying rank's "Fatal Python error" stack goes to its stack file, not into the terminal.
    assert "Fatal Python error" not in capfd.readouterr().err


def recv_forward():
    """Stands in for a pipeline receive whose sender has returned without sending."""
    if dist.get_rank() == 1:
        dist.recv(torch.empty(1), src=0)


def test_a_receive_left_waiting_by_a_finished_peer_hints_at_a_dropped_send_handle():
    with pytest.raises(RankTimeout) as timeout:
        run_ranks(recv_forward, 2, timeout=1.0)
    first_line = str(timeout.value).splitlines()[0]
    assert "still running: rank 1 (finished: rank 0)" in first_line and "in recv_forward" in first_line, first_line
    assert "was a non-blocking send's handle dropped" in first_line, first_line


def test_without_a_group_ranks_get_torchrun_variables_only():
    def environment():
        return dist.is_initialized(), os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]
    assert run_ranks(environment, 2, timeout=20, init_process_group=False) == [
        (False, "0", "2", "0"), (False, "1", "2", "1")]


def test_a_timeout_shorter_than_the_start_of_the_ranks_still_names_them():
    # Issue "reliability round 2", item 6: the report read a stack file that no rank had written yet.
    with pytest.raises(RankTimeout) as timeout:
        run_ranks(_receive_from_each_other, 2, timeout=0.001)
    assert "still running: rank 0, 1" in str(timeout.value).splitlines()[0]


@pytest.mark.parametrize("timeout", [float("inf"), 1e300, 0.0, -1.0, float("nan")])
def test_a_timeout_is_positive_and_at_most_a_day(timeout):
    # inf, 1e300 (and 1e9 on some timers) overflowed once the ranks had started.
    with pytest.raises(ValueError, match="a timeout must be a positive number of seconds, at most 86400"):
        run_ranks(_identify, 2, 0, timeout=timeout)
    assert _child_pids() == set()


def _sleep_under_the_watchdog():
    with watchdog(0.2):
        time.sleep(30)  # the line the report must name


def test_a_process_no_parent_watches_says_where_it_timed_out(capfd):
    # Item 6: a single-process run (or a torchrun rank) printed a bare faulthandler dump, no `error:`
    # line, and once in 16 runs crashed with SIGSEGV. A forked rank stands in for that process.
    with pytest.raises(RankFailed, match=r"died without a result \(exit code 1\)"):
        run_ranks(_sleep_under_the_watchdog, 1, timeout=20, init_process_group=False)
    err = capfd.readouterr().err
    assert re.search(r"^error: timed out after 0.2 s at tests/test_course_launch.py:\d+ in _sleep_under_the_watchdog$",
                     err, re.MULTILINE), err


def test_ctrl_c_in_a_single_process_run_is_one_line_saying_where(capfd):
    # Item 5: a traceback before. Here the demo sends itself the Ctrl-C.
    def demo(args):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)  # interrupted here

    # Python's own Ctrl-C handler, even where this pytest was started with SIGINT ignored (a
    # background job of a non-interactive shell inherits SIG_IGN, and Python then keeps it).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(SystemExit) as exit_:
            with failures_explained("06", "solutions"):
                run_demo(demo, argparse.Namespace(world_size=1, timeout=60))
    except KeyboardInterrupt:
        pytest.fail("the Ctrl-C went through failures_explained: a traceback")
    finally:
        signal.signal(signal.SIGINT, previous)
    err = capfd.readouterr().err
    assert exit_.value.code == 1 and len(err.splitlines()) == 1, err
    assert re.fullmatch(r"error: interrupted by Ctrl-C \(at tests/test_course_launch.py:\d+ in demo\)\n", err), err


def _a_peer_dies(tmp):
    # This rank and a process it forks form a gloo group of 2, as torchrun's ranks do; the peer leaves
    # without a word (as if killed), then this rank waits for a message from it.
    rank = 1 if os.fork() == 0 else 0
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=2)
    dist.barrier()
    if rank == 1:
        os._exit(0)
    os.environ.update(TORCHELASTIC_RUN_ID="test", RANK="0", WORLD_SIZE="2")
    err, code = io.StringIO(), None
    with contextlib.redirect_stderr(err):
        try:
            with failures_explained("05", "solutions"):
                dist.recv(torch.zeros(1), 1)
        except SystemExit as exit_:
            code = exit_.code
    os.wait()
    return code, err.getvalue()


def test_a_torchrun_peer_that_dies_is_one_line(tmp_path):
    # Issue 33: `RuntimeError: ... Connection closed by peer` with a traceback through course/launch.py.
    [(code, err)] = run_ranks(_a_peer_dies, 1, str(tmp_path), timeout=60, init_process_group=False)
    assert code == 1 and len(err.splitlines()) == 1, err
    assert re.fullmatch(r"error: rank 0 of 2: a peer rank died, so this one stopped \(at tests/test_course_launch.py:\d+ "
                        r"in _a_peer_dies\); torchrun's report names the rank that died\n", err), err


def _autograd_refuses_after_fork():
    raise RuntimeError(f"{AUTOGRAD_AFTER_FORK}. See https://github.com/pytorch/pytorch/wiki/Autograd-and-Fork")


def test_pytest_hides_the_gpus_and_a_gpu_check_gets_them_back(monkeypatch):
    # On a CUDA build that sees a GPU, one backward in this process would make every forked rank's
    # backward fail (measured on an H200 with torch 2.11: test_05 and the tour's module 05 failed).
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    monkeypatch.setenv("COURSE_CUDA_VISIBLE_DEVICES", "1,3")
    assert environment_with_gpus()["CUDA_VISIBLE_DEVICES"] == "1,3"
    monkeypatch.setenv("COURSE_CUDA_VISIBLE_DEVICES", "<unset>")
    assert "CUDA_VISIBLE_DEVICES" not in environment_with_gpus()


def test_main_hides_the_gpus_unless_a_benchmark_asks_for_cuda():
    import main

    asks = [main.asks_for_a_gpu(main.parse(argv)) for argv in
            (["bench", "09", "--device", "cuda"], ["bench", "12", "--device=cuda:1"], ["bench", "05"],
             ["run", "05"], [])]
    assert asks == [True, True, False, False, False]


def test_a_rank_refused_by_autograd_after_a_fork_is_told_what_to_do():
    with pytest.raises(RankFailed, match="ran a backward while torch saw a GPU.*CUDA_VISIBLE_DEVICES="):
        run_ranks(_autograd_refuses_after_fork, 1, timeout=20)


SLEEPING_CHECK = """import time
from pathlib import Path

from course.launch import run_ranks


def _sleep(started):
    Path(started).touch()
    time.sleep(60)


def test_sleeps():
    run_ranks(_sleep, 2, {started!r}, timeout=60, init_process_group=False)


def test_after():
    pass
"""


def test_sigterm_stops_pytest_and_its_ranks_leave_no_folder(tmp_path):
    # Killed outright by SIGTERM (a CI timeout), pytest left the ranks' folder in /tmp.
    started, tmp = tmp_path / "started", tmp_path / "tmp"
    tmp.mkdir()
    (tmp_path / "test_sleeping.py").write_text(SLEEPING_CHECK.format(started=str(started)))
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "course.grading", "-p", "no:cacheprovider", "-v",
                             str(tmp_path / "test_sleeping.py")], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp)})
    deadline = time.monotonic() + 60
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    # Stopped as by Ctrl-C (pytest's exit status 2), before the next check, whether the signal came while
    # the ranks ran (their check fails as interrupted) or while they were being started.
    assert proc.returncode == 2 and "SIGTERM" in out and "test_after" not in out, out
    assert not list(tmp.glob("course-ranks-*")), "the ranks' folder outlived the run"
