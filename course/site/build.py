"""`python main.py site`: the course as a static website under results/site/ (given).

Sphinx (with MyST-NB and the book theme, configured in conf.py beside this file) renders a staged copy of
the course: the chapters of docs/ and the glossary, the notebooks with their outputs (notebooks.py: the
copies the test suite executed, or executed here), the home page with the tracks (pages.py), the
chapters' figures (figures.py, drawn by drawings.py), the schedule explorer and its data (explorer.py),
the layout calculator's (calculator.py), the hardware page (hardware.py) and the timelines of module 11's
schedules (timelines.py).
Nothing on a page comes from the network: open results/site/index.html, or serve the folder with
`python -m http.server -d results/site`.
"""
from __future__ import annotations

import argparse
import importlib.util
import io
import shutil
import sys
import tempfile
import time
import webbrowser
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from course import REPO, RESULTS
from course.arguments import cannot_write_in
from course.site import calculator, explorer, figures, hardware, notebooks, pages, timelines

SITE = RESULTS / "site"
HERE = Path(__file__).resolve().parent


def module_files(folder: Path, suffix: str) -> dict[str, Path]:
    """Module number -> its chapter (docs/NN-*.md) or notebook (notebooks/NN-*.ipynb)."""
    return {path.name[:2]: path for path in sorted(folder.glob(f"[0-9][0-9]-*{suffix}"))}


def executed_notebooks(execute: str) -> dict[Path, Path | None]:
    """Each notebook -> its executed copy. execute: "all" runs every notebook again, "missing" those
    without a current copy (two at a time, as the test suite does), "none" runs none (None: no outputs)."""
    found = {nb: None if execute == "all" else notebooks.executed_copy(nb)
             for nb in sorted(notebooks.NOTEBOOKS.glob("*.ipynb"))}
    to_run = [nb for nb, copy in found.items() if copy is None] if execute != "none" else []
    if to_run:
        print(f"site: executing {len(to_run)} notebook(s) (the test suite's copies are used where current)...", flush=True)
        pool = ThreadPoolExecutor(max_workers=2)
        try:
            found.update(zip(to_run, pool.map(notebooks.execute, to_run)))
        finally:  # after Ctrl-C or a failure too: no notebook left running, none started
            pool.shutdown(wait=False, cancel_futures=True)
            notebooks.stop_running()
    return found


def stage(source: Path, execute: str, grid: explorer.Grid, cases=calculator.CASES) -> Path:
    """Lay out Sphinx's source folder: docs/, notebooks/, the home page, the chapters' figures, the explorer, the
    calculator, the hardware page and the timelines; return the folder of generated static files (the explorer's
    and the calculator's data)."""
    import nbformat

    chapters, nbs = module_files(REPO / "docs", ".md"), module_files(notebooks.NOTEBOOKS, ".ipynb")
    staged = {f"docs/{p.name}" for p in [*chapters.values(), REPO / "docs" / "glossary.md"]}
    staged |= {f"notebooks/{p.name}" for p in notebooks.NOTEBOOKS.glob("*.ipynb")}
    shutil.copytree(REPO / "docs", source / "docs", ignore=shutil.ignore_patterns("*.md"))  # pictures, if any
    (source / "notebooks").mkdir()
    for number, chapter in chapters.items():
        (source / "docs" / chapter.name).write_text(pages.chapter_page(chapter, nbs.get(number), staged))
    glossary = (REPO / "docs" / "glossary.md").read_text()
    (source / "docs" / "glossary.md").write_text(pages.link_pages(glossary, "docs", staged))
    for notebook, executed in executed_notebooks(execute).items():
        nb = nbformat.read(executed or notebook, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "markdown":
                cell.source = pages.link_pages(cell.source, "notebooks", staged)
        nbformat.write(nb, source / "notebooks" / notebook.name)
    (source / "index.md").write_text(pages.home_page(chapters, nbs))
    for page in ("explorer.md", "calculator.md"):
        shutil.copyfile(HERE / page, source / page)
    figures.write_figures(source / "figures")
    (source / "timelines.md").write_text(timelines.write_timelines(source / "timelines"))
    (source / "hardware.md").write_text(hardware.write_hardware(source / "hardware"))
    generated = source.parent / "generated"
    explorer.write_explorer_data(generated / "explorer", grid)
    calculator.write_calculator_data(generated / "calculator", cases)
    return generated


def build(out: Path = SITE, execute: str = "missing", grid: explorer.Grid = explorer.Grid(),
          quiet: bool = True, cases=calculator.CASES) -> tuple[Path, list[str]]:
    """Build the site into `out` (replacing what was there); return its index.html and Sphinx's warnings (a
    link to a page that is not there is one), which are also printed. Its progress only if not `quiet`.
    `grid` and `cases` are the explorer's and the calculator's (the test suite builds with smaller ones)."""
    from sphinx.application import Sphinx

    with tempfile.TemporaryDirectory(prefix="course-site-") as work:
        work = Path(work)
        generated = stage(work / "source", execute, grid, cases)
        if out.exists():
            shutil.rmtree(out)
        warnings = io.StringIO()
        app = Sphinx(work / "source", HERE, out, work / "doctrees", "html",
                     confoverrides={"html_static_path": [str(HERE / "static"), str(generated)]},
                     status=None if quiet else sys.stdout, warning=warnings, freshenv=True)
        app.build()
    sys.stderr.write(warnings.getvalue())
    return out / "index.html", warnings.getvalue().splitlines()


def main(args: argparse.Namespace) -> int:
    """`python main.py site [--execute] [--open] [--check]`; returns the exit status."""
    if importlib.util.find_spec("myst_nb") is None:
        print(f"error: this Python ({sys.executable}) has no Sphinx and MyST-NB, which build the site: install the "
              "course's requirements into it (pip install -r requirements.txt)")
        return 2
    for folder in (SITE, notebooks.EXECUTED):  # before minutes of work (a read-only checkout, a full disk)
        why = cannot_write_in(folder)
        if why:
            print(f"error: the site cannot be built: cannot write in {folder} ({why})", file=sys.stderr)
            return 1
    started = time.perf_counter()
    index, _ = build(SITE, execute="all" if args.execute else "missing")
    print(f"site: built in {time.perf_counter() - started:.0f} s: open {index.as_uri()}\n"
          f"      or serve it: python -m http.server -d {index.parent.relative_to(REPO)} (then http://localhost:8000)",
          flush=True)
    if args.open:
        webbrowser.open(index.as_uri())
    if args.check:
        from course.site.browser_check import check

        return check(index.parent)
    return 0
