"""The learner-facing docs must not lie about the repository, and the notebooks must run.

(a) every backticked path in README.md and the chapters docs/NN-*.md exists;
(b) every backticked `name()` is defined (def or class) in the repo's Python, or is allow-listed;
(c) every notebooks/*.ipynb executes top to bottom on CPU (one test per notebook).

Only inline code spans are checked (fenced blocks hold commands and output). The maintainers'
page is not a chapter and may name files that are still planned, so it is not checked here.
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

import pytest

from course import REPO
# EXECUTE: run by a fresh Python each, it executes a notebook as the reference (COURSE_IMPL=solutions) and
# writes the executed notebook, outputs included, to a file; the site shows the copies kept.
from course.site.notebooks import EXECUTE, keep_executed
DOCS = [REPO / "README.md", REPO / "docs" / "glossary.md", *sorted((REPO / "docs").glob("[0-9][0-9]-*.md"))]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))

PATH_SUFFIXES = (".py", ".md", ".ipynb", ".json", ".txt", ".toml")
GENERATED = ("results/", ".course-hints.json", ".course-passed.json")  # by bench, hint and grade, git-ignored
# Names the docs may call that are PyTorch's or Python's own, not the course's.
KNOWN_CALLS = {
    "send", "recv", "isend", "irecv", "wait", "init_process_group", "destroy_process_group",
    "is_initialized", "get_backend", "backward", "detach", "requires_grad_", "manual_seed",
    "empty", "perf_counter", "median",
}
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
CODE_SPAN = re.compile(r"`([^`\n]+)`")
CALL = re.compile(r"(?:[A-Za-z_]\w*\.)*([A-Za-z_]\w*)\(\)")


def code_spans(doc: Path) -> list[str]:
    return CODE_SPAN.findall(FENCE.sub("", doc.read_text()))


def is_path(token: str) -> bool:
    if " " in token or "://" in token or "(" in token or token.startswith(('"', "'")):  # a quoted string: a spec
        return False
    return "/" in token or token.endswith(PATH_SUFFIXES)


def path_exists(token: str) -> bool:
    token = re.sub(r":\d+$", "", token.removeprefix("./"))  # steps/m02_comms.py:35 -> the file
    if token.startswith(GENERATED):
        return True
    if "NN" in token or "*" in token:
        pattern = token.replace("NN", "[0-9][0-9]").rstrip("/")
        return any(REPO.glob(pattern))
    if (REPO / token).exists():
        return True
    return "/" not in token and any(REPO.rglob(token))  # a bare file name, e.g. `launch.py`


@lru_cache(maxsize=None)
def defined_names() -> frozenset[str]:
    names = set()
    for path in REPO.rglob("*.py"):
        if any(part.startswith(".") or part == "__pycache__" for part in path.relative_to(REPO).parts):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
    return frozenset(names)


def bad_paths(doc: Path) -> list[str]:
    return [t for t in code_spans(doc) if is_path(t) and not path_exists(t)]


def bad_calls(doc: Path) -> list[str]:
    calls = [CALL.fullmatch(t) for t in code_spans(doc)]
    return [m.group(0) for m in calls if m and m.group(1) not in defined_names() | KNOWN_CALLS]


def test_there_are_docs_to_check():
    assert (REPO / "README.md").exists() and len(DOCS) > 1, f"found only {DOCS}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_backticked_paths_exist(doc):
    missing = bad_paths(doc)
    assert not missing, f"{doc.name} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_backticked_calls_are_defined(doc):
    undefined = bad_calls(doc)
    assert not undefined, f"{doc.name} names functions defined nowhere in the repo: {undefined}"


@pytest.mark.parametrize("doc", [d for d in DOCS if re.match(r"(0[1-9]|1\d)-", d.name)], ids=lambda p: p.name)
def test_every_chapter_typesets_its_formulas(doc):
    # Issue 38.2: MyST dollar maths, rendered by the site's vendored KaTeX (site --check looks at the pages).
    assert re.search(r"\$[^$\s][^$]*\$", doc.read_text()), f"{doc.name} has no $...$ or $$...$$ formula"


def test_the_checks_catch_bad_references(tmp_path):
    doc = tmp_path / "bad.md"
    doc.write_text("See `steps/m99_nothing.py`, `docs/NN-nothing.md` and `comms.teleport_forward()`;\n"
                   "but `steps/m04_sharded.py:57`, `results/bench-03.json`, `launch.py`,\n"
                   "`comms.send_forward()` and `dist.send()` are fine.\n"
                   "```\nnot/checked.py inside a fence: `fenced/path.py`\n```\n")
    assert bad_paths(doc) == ["steps/m99_nothing.py", "docs/NN-nothing.md"]
    assert bad_calls(doc) == ["comms.teleport_forward()"]


@pytest.fixture(scope="module")
def executed_notebooks(tmp_path_factory) -> dict:
    """Every notebook executed, two at a time (each is mostly one busy core: a kernel; CI has two):
    name -> (the finished process, the executed notebook or None)."""
    pytest.importorskip("nbclient")
    nbformat = pytest.importorskip("nbformat")
    out = tmp_path_factory.mktemp("notebooks")

    def execute(notebook: Path):
        executed = out / notebook.name
        command = [sys.executable, "-c", EXECUTE, str(notebook), str(executed), str(notebook.parent)]
        env = {**os.environ, "COURSE_IMPL": "solutions"}
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        # Two kernels starting at once can pick the same free port (jupyter_client checks a port is
        # free, then binds it later): that start failed before the notebook ran, so start it again.
        if proc.returncode != 0 and "ZMQError: Address already in use" in proc.stderr:
            proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode == 0 and executed.exists():
            keep_executed(executed)  # for the site (`python main.py site`), which shows the outputs
        return proc, (nbformat.read(executed, as_version=4) if executed.exists() else None)
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip((nb.name for nb in NOTEBOOKS), pool.map(execute, NOTEBOOKS)))


def test_notebooks_are_committed_without_outputs_and_with_cell_ids():
    """Outputs belong to the executed copies (results/executed/); a cell without an id is a warning in
    every nbformat read today and an error in a future nbformat (`nbformat.validator.normalize` adds them)."""
    import json
    for notebook in NOTEBOOKS:
        cells = json.loads(notebook.read_text())["cells"]
        assert all("id" in cell for cell in cells), f"{notebook.name}: cells without an id"
        assert not any(cell.get("outputs") for cell in cells), f"{notebook.name}: committed with outputs"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(notebook, executed_notebooks):
    proc, nb = executed_notebooks[notebook.name]
    # nbclient's CellExecutionError names the cell that failed and shows its traceback.
    assert proc.returncode == 0 and nb is not None, f"{notebook.name} did not run to the end:\n{proc.stderr[-3000:]}"
    # A picture that silently fails to show (e.g. an import switched matplotlib to a file-only
    # backend) would still execute: every cell that shows a plot must have produced an image.
    blank = [cell.source.splitlines()[0] for cell in nb.cells
             if cell.cell_type == "code" and "plt.show()" in cell.source
             and not any("image/png" in out.get("data", {}) for out in cell.outputs)]
    assert not blank, f"cells that call plt.show() but display no image: {blank}"
