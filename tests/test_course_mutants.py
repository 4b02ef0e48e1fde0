"""The catalogue of planted bugs (course/mutants/) stays valid as the solutions change: every plant
still applies, where a learner writes code, and changes the code. Running the plants against the
graded tests takes far longer than the suite: `python -m course.mutants` (on demand)."""
import functools

import pytest

from course.catalog import MODULES
from course.mutants import Plant, PlantError, modules, planted, plants
from course.mutants.__main__ import Job, judge, selected_jobs
from course.skeleton import REPO, todo_blocks

WITH_TODOS = sorted(n for n, m in MODULES.items() if not m.is_given())
BIG = {"11", "12", "13"}  # the big modules: about ten plants each


def test_every_module_with_todos_has_its_plants():
    assert modules() == WITH_TODOS
    few = {n: len(plants(n)) for n in WITH_TODOS if len(plants(n)) < (10 if n in BIG else 6)}
    assert not few, f"modules with fewer plants than asked (6, or 10 for {sorted(BIG)}): {few}"


@functools.lru_cache(maxsize=None)
def blocks_of(name: str):
    return todo_blocks((REPO / "solutions" / name).read_text(), name)


@pytest.mark.parametrize("number", WITH_TODOS)
def test_every_plant_applies_once_inside_a_solution_block(number):
    module_files = {f"{stem}.py" for stem in MODULES[number].files}
    wrong = []
    for index, plant in enumerate(plants(number), start=1):
        where = f"{number}.{index} ({plant.file})"
        if plant.file not in module_files:
            wrong.append(f"{where}: not a file of module {number}")
            continue
        try:
            planted(plant)  # find occurs once; the planted file parses and its code differs
        except PlantError as error:
            wrong.append(f"{where}: {error}")
            continue
        source = (REPO / "solutions" / plant.file).read_text()
        first = source[:source.index(plant.find)].count("\n") + 1
        last = first + plant.find.rstrip("\n").count("\n")
        if not any(block.line < first and last < block.end for block in blocks_of(plant.file)):
            wrong.append(f"{where}: lines {first}-{last} are not inside one solution block")
        if not plant.teaches.strip() or "\n" in plant.teaches:
            wrong.append(f"{where}: `teaches` must say in one line what the mistake is")
    assert not wrong, "plants that no longer apply (fix them to the current solutions/):\n" + "\n".join(wrong)


def test_a_plant_that_no_longer_applies_is_refused():
    with pytest.raises(PlantError, match="occurs 0 times"):
        planted(Plant("m01_manual_split.py", "no such code", "x", "nothing"))
    with pytest.raises(PlantError, match="only comments"):
        planted(Plant("m01_manual_split.py", "    hidden = part_one(x)\n", "    hidden = part_one(x)  # mine\n", "-"))


PLANT = Job("05", 1, plants("05")[0])
BASELINE = Job("05", 0, None)


@pytest.mark.parametrize("job, results, output, code, timed_out, verdict, detail", [
    (PLANT, [{"test": "t.py::a", "outcome": "passed", "reason": ""},
             {"test": "t.py::b", "outcome": "failed", "reason": "AssertionError: off"}], "", 1, False,
     "caught", "by b: AssertionError: off"),
    (PLANT, [{"test": "t.py::a", "outcome": "failed", "reason": "RankTimeout: timed out after 60 s"}], "", 1, False,
     "caught", "by a hang in a"),
    (PLANT, None, "tests/test_05_x.py::test_slow ", -9, True, "caught", "by a hang in test_slow"),
    (PLANT, [{"test": "t.py::a", "outcome": "passed", "reason": ""}], "", 0, False, "SURVIVED", "1 tests passed"),
    (PLANT, None, "E   NameError: name 'x' is not defined\n1 error", 2, False, "caught", "at import"),
    (BASELINE, [{"test": "t.py::a", "outcome": "passed", "reason": ""}], "", 0, False, "passed", ""),
    (BASELINE, [{"test": "t.py::a", "outcome": "failed", "reason": "boom"}], "", 1, False, "ERROR", "by a: boom"),
])
def test_the_runner_judges_a_plant_by_its_first_failure(job, results, output, code, timed_out, verdict, detail):
    outcome = judge(job, results, output, code, timed_out, 300, 1.0)
    assert outcome.verdict == verdict and outcome.detail.startswith(detail), outcome


def test_the_runner_selects_modules_and_single_plants_each_with_its_baseline():
    assert [j.name for j in selected_jobs(["05.2", "01"])] == ["05.0", "05.2"] + [f"01.{k}" for k in range(len(plants("01")) + 1)]
    with pytest.raises(ValueError, match="not a module with plants"):
        selected_jobs(["00"])


@pytest.mark.parametrize("argv, said", [
    (["--timeout", "nan", "05"], "--timeout must be a positive number of seconds, at most 86400 (a day), got nan"),
    (["--timeout", "inf", "05"], "--timeout must be a positive number of seconds, at most 86400 (a day), got inf"),
    (["--jobs", "0", "05"], "--jobs must be at least 1, got 0"),
    (["00"], "'00' is not a module with plants"),
])
def test_a_bad_option_is_refused_in_one_line_with_exit_code_2(argv, said, capsys):
    # Issue 33: --timeout nan and inf were accepted (every row an ERROR), and a bad module exited with 1, not 2.
    from course.mutants.__main__ import main
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"error: {said}" in err.splitlines()[-1], err
