"""Executed copies of the notebooks (given), so that the site shows their outputs without running them twice.

The notebooks are committed without outputs. The test suite executes every one (tests/test_course_docs.py)
and keeps the executed copy in results/executed/ (`keep_executed`); the site takes a copy from there if it
is still the committed notebook's, cell for cell (`executed_copy`), and executes the others (`execute`).
A copy says nothing about the code it ran: after changing the course's code, `python main.py site
--execute` runs every notebook again.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from course import REPO, RESULTS

NOTEBOOKS = REPO / "notebooks"
EXECUTED = RESULTS / "executed"

# Run by a fresh Python: executes a notebook from its own folder, as the reference (COURSE_IMPL=solutions).
EXECUTE = """
import sys, nbclient, nbformat
notebook, executed = sys.argv[1], sys.argv[2]
nb = nbformat.read(notebook, as_version=4)
nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                        resources={"metadata": {"path": sys.argv[3]}}).execute()
nbformat.write(nb, executed)
"""


def cells(nb: dict) -> list[tuple[str, str]]:
    return [(cell["cell_type"], "".join(cell["source"])) for cell in nb["cells"]]


def keep_executed(executed: Path) -> None:
    """Keep `executed`, a notebook run top to bottom, as the executed copy of the notebook of that name."""
    EXECUTED.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(executed, EXECUTED / executed.name)


def executed_copy(notebook: Path) -> Path | None:
    """The kept executed copy of `notebook` if its cells are still the committed notebook's, else None."""
    import nbformat

    copy = EXECUTED / notebook.name
    if not copy.exists():
        return None
    try:
        same = cells(nbformat.read(copy, as_version=4)) == cells(nbformat.read(notebook, as_version=4))
    except Exception:  # a copy cut short (e.g. by Ctrl-C while it was written) is no copy
        return None
    return copy if same else None


def execute(notebook: Path, timeout: float = 900) -> Path:
    """Run `notebook` top to bottom and keep the executed copy; a RuntimeError with the end of the error
    (nbclient's names the cell that failed) if it does not run to the end. The run has a session of its
    own and a temporary folder of its own (its TMPDIR: the kernel's connection file, the folders of the
    ranks a notebook forks), so that `stop_running` can end it with its kernel and leave nothing behind."""
    EXECUTED.mkdir(parents=True, exist_ok=True)
    executed = EXECUTED / notebook.name
    partial = executed.with_suffix(".partial")
    scratch = tempfile.mkdtemp(prefix="course-notebook-")
    proc = subprocess.Popen([sys.executable, "-c", EXECUTE, str(notebook), str(partial), str(notebook.parent)],
                            env={**os.environ, "COURSE_IMPL": "solutions", "TMPDIR": scratch},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    RUNNING[proc] = scratch
    try:
        _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stderr = f"stopped after {timeout:.0f} s"
    finally:
        stop(proc)
        if proc.returncode:  # stopped, or failed: what it wrote is no executed notebook
            partial.unlink(missing_ok=True)
    if proc.returncode or not partial.exists():
        raise RuntimeError(f"{notebook.name} did not run to the end:\n{stderr[-3000:]}")
    partial.replace(executed)
    return executed


RUNNING: dict[subprocess.Popen, str] = {}  # the notebooks being executed (each the leader of its process group): their folders


def stop(proc: subprocess.Popen) -> None:
    """End a notebook's run and its kernel (jupyter_client starts it in a session of its own, with the ranks
    it forks), if they are still running, and remove the run's folder."""
    scratch = RUNNING.pop(proc, None)
    kernels = _children(proc.pid) if proc.poll() is None else []  # found while their parent is there to find
    for group in [proc.pid, *kernels]:
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)


def stop_running() -> None:
    """End every notebook still running (after Ctrl-C, or another notebook's failure)."""
    for proc in list(RUNNING):
        stop(proc)


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux's /proc; none elsewhere)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return found
