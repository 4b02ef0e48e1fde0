"""Planted bugs, kept: the wrong versions of each module's solutions that its graded tests must catch.

While a module is built and checked, plausible learner mistakes are planted in its solutions/ to see
whether the grader fails them. They are kept here, one catalogue per module (`course/mutants/mNN.py`,
a list `PLANTS`), so the check can be run again whenever the solutions or the tests change:

    python -m course.mutants              # every module's plants (takes a while: tens of minutes)
    python -m course.mutants 05 12        # those of modules 05 and 12
    python -m course.mutants 12.3         # one plant (the third of module 12's list)
    python -m course.mutants 05 --jobs 4  # four subprocesses at a time (default 2: two cores)

For each plant the runner copies every solutions/ file into a scratch steps/ directory, replaces the
plant's `find` with its `replace` in its file, and runs that module's graded tests against it in a
subprocess, the way the grader's self-check does (tests/test_course_grader.py):

    COURSE_STEPS_DIR=<scratch>/steps COURSE_IMPL=steps python -m pytest tests/test_NN_*.py \
        -m "not given" --impl=steps -x -p no:cacheprovider --grading-json=<file>

It prints one row per plant: the graded test that caught it (the first failure), `SURVIVED` (every
test passed: a hole in the grader), or `ERROR` (the plant no longer applies, or the unplanted
solutions fail too), with the time it took; then a total per module. It exits 1 if a plant survived
or could not run.

It also measures the blame (issue 37): the TODO a plant is in is the solution block that holds its
`find`, numbered as `python main.py hint NN` numbers them (`todo_of`); a caught plant is blamed right
when its first failing check's help line (what `grade` prints under that FAIL: `python main.py hint
NN K`, one TODO: the likeliest culprit) names that TODO. A help line that names another TODO,
another module's, or none (a run stopped by the runner's timeout) is blamed wrong. Each caught plant's row says which; the total per module gives "blamed right" as a
count of the caught plants, the catalogue as it stood before issue 37 apart from the plants marked
`new=True` (the mistakes of issue 37's learner runs, and any added since), and lists the plants
blamed wrong. Over several modules (`python -m course.mutants 01 03 14`) that total is the blame
table per module. A plant whose tests run longer than --timeout (300 s) is stopped and reported as
caught by a hang in the test that was running. Each module's unplanted solutions run first as a
baseline (`NN.0`): a plant can only be said to be caught if they pass. Scratch directories are
removed at the end, also after Ctrl-C or SIGTERM, and no test process is left running.

It is not part of the test suite (it takes far longer than the suite's 6 minutes): run it on demand,
and before resolving a module's issue. tests/test_course_mutants.py (fast, in the suite) checks
only that every plant still applies: its `find` occurs exactly once in its solutions/ file, inside a
solution block (so its TODO is known), and the planted file still parses.

Adding plants: append `Plant(file=..., find=..., replace=..., teaches=...)` to `PLANTS` in
`course/mutants/mNN.py` (a new module: a new file, same form). `find` is a piece of a solution
block's code, long enough to occur once in its file; `replace` is what a learner might plausibly
write instead (wrong scale, wrong neighbour, missing wait, off by one, ...), never code that is
merely equivalent; `teaches` says in one line what the mistake is and why it is wrong; `new=True`
for a plant added from issue 37 on (reported apart in the blame count). Run the
module's plants; a plant that SURVIVES is a hole in the grader: add a graded test that fails it
(keep the plant, so the runner shows the test catching it from then on).
"""
from __future__ import annotations

import ast
import functools
import importlib
from dataclasses import dataclass
from pathlib import Path

from course import REPO


@dataclass(frozen=True)
class Plant:
    """One planted bug: `find` replaced by `replace` in solutions/`file`."""
    file: str       # a solutions/ file, e.g. "m05_schedules.py"
    find: str       # code of a solution block, exactly once in that file
    replace: str    # the plausible wrong version a learner might write
    teaches: str    # one line: what the mistake is and why it is wrong
    new: bool = False  # added from issue 37 on: blamed right or wrong, counted apart from the older catalogue


class PlantError(ValueError):
    """A plant that no longer applies to solutions/ (its `find` is missing or ambiguous)."""


def modules() -> list[str]:
    """The numbers of the modules that have a catalogue, e.g. ["01", ..., "13"]."""
    return sorted(path.stem[1:] for path in Path(__file__).parent.glob("m[0-9][0-9].py"))


def plants(number: str) -> list[Plant]:
    """Module `number`'s catalogue, in order (plant NN.1 is the first)."""
    return list(importlib.import_module(f"course.mutants.m{number}").PLANTS)


@functools.lru_cache(maxsize=None)
def _code_of(source: str) -> str:
    """The code of a file, comments and layout left out (its syntax tree, as text)."""
    return ast.dump(ast.parse(source))


def planted(plant: Plant, solutions: Path = REPO / "solutions") -> str:
    """The text of the plant's file with the plant applied; PlantError unless `find` occurs once."""
    source = (solutions / plant.file).read_text()
    count = source.count(plant.find)
    if count != 1:
        raise PlantError(f"`find` occurs {count} times in solutions/{plant.file} (it must occur once): {plant.find!r}")
    text = source.replace(plant.find, plant.replace)
    try:
        tree = ast.parse(text)
    except SyntaxError as error:
        raise PlantError(f"planted solutions/{plant.file} does not parse: {error}") from None
    if ast.dump(tree) == _code_of(source):
        raise PlantError(f"the plant changes only comments or layout in solutions/{plant.file}: {plant.find!r}")
    return text


@functools.lru_cache(maxsize=None)
def _todo_spans(number: str) -> tuple[tuple[int, str, int, int], ...]:
    """(TODO number, file, first line, closing line) of module `number`'s solution blocks, numbered as
    `python main.py hint` numbers them."""
    from course.catalog import MODULES
    from course.hints import module_todos
    return tuple((n, block.file, block.line, block.end)
                 for n, block in enumerate(module_todos(MODULES[number]), start=1))


def todo_of(number: str, plant: Plant, solutions: Path = REPO / "solutions") -> int:
    """The TODO the plant is in: the number (as `python main.py hint NN` gives it) of the solution block
    that holds its `find`; PlantError unless `find` occurs once, inside one block."""
    source = (solutions / plant.file).read_text()
    if source.count(plant.find) != 1:
        raise PlantError(f"`find` occurs {source.count(plant.find)} times in solutions/{plant.file}: {plant.find!r}")
    first = source[:source.index(plant.find)].count("\n") + 1
    last = first + plant.find.rstrip("\n").count("\n")
    for n, file, begin, end in _todo_spans(number):
        if file == plant.file and begin < first and last < end:
            return n
    raise PlantError(f"lines {first}-{last} of solutions/{plant.file} are not inside one solution block")
