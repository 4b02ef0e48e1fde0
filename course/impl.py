"""Which implementation is graded or run: the learner's `steps/` or the reference `solutions/`.

`pytest --impl steps`, `COURSE_IMPL=steps` or `python main.py ... --impl steps` select it. The
grader's self-check points COURSE_STEPS_DIR at a freshly generated skeleton so that it never grades
a learner's half-finished work by mistake.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

IMPLS = ("solutions", "steps")
from course import REPO


def selected() -> str:
    impl = os.environ.get("COURSE_IMPL", "solutions")
    if impl not in IMPLS:
        raise ValueError(f"COURSE_IMPL must be one of {IMPLS}, got {impl!r}")
    return impl


def steps_dir() -> Path:
    """Where the learner's steps/ is: the repository's, unless COURSE_STEPS_DIR points elsewhere."""
    return Path(os.environ.get("COURSE_STEPS_DIR") or REPO / "steps")


class MissingStepsFile(ModuleNotFoundError):
    """A module's steps/ file was deleted: say so in one line, and how to get it back."""

    def __init__(self, stem: str):
        super().__init__(f"steps/{stem}.py is missing: `git checkout steps/{stem}.py` brings back your last "
                         f"commit of it, `python -m course.skeleton` a fresh skeleton", name=f"steps.{stem}")


def load(stem: str, impl: str | None = None):
    """Import module `stem` (e.g. 'm04_sharded') from the selected implementation."""
    impl = impl or selected()
    if impl == "steps" and not (steps_dir() / f"{stem}.py").exists():
        raise MissingStepsFile(stem)
    if impl == "steps" and os.environ.get("COURSE_STEPS_DIR") and "steps" not in sys.modules:
        _import_package_from("steps", steps_dir())
    return importlib.import_module(f"{impl}.{stem}")


def reference(stem: str):
    """The reference implementation, for tests that need a trusted helper (never the code graded)."""
    return load(stem, "solutions")


def _import_package_from(name: str, directory: Path):
    spec = importlib.util.spec_from_file_location(
        name, directory / "__init__.py", submodule_search_locations=[str(directory)])
    package = importlib.util.module_from_spec(spec)
    sys.modules[name] = package
    spec.loader.exec_module(package)
