"""The catalogue of planted bugs (course/mutants/) stays valid as the solutions change: every plant
still applies, where a learner writes code, and changes the code. Running the plants against the
graded tests takes far longer than the suite: `python -m course.mutants` (on demand)."""
import pytest

from course.catalog import MODULES
from course.hints import module_todos
from course.mutants import Plant, PlantError, modules, planted, plants, todo_of
from course.mutants.__main__ import Job, Outcome, blame, judge, selected_jobs, summary

WITH_TODOS = sorted(n for n, m in MODULES.items() if not m.is_given())
BIG = {"11", "12", "13"}  # the big modules: about ten plants each


def test_every_module_with_todos_has_its_plants():
    assert modules() == WITH_TODOS
    few = {n: len(plants(n)) for n in WITH_TODOS if len(plants(n)) < (10 if n in BIG else 6)}
    assert not few, f"modules with fewer plants than asked (6, or 10 for {sorted(BIG)}): {few}"


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
        try:
            todo_of(number, plant)  # inside one solution block: the TODO the blame report holds it to
        except PlantError as error:
            wrong.append(f"{where}: {error}")
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


def test_a_plants_todo_is_the_solution_block_that_holds_it_numbered_as_hint_numbers_them():
    for number in ("05", "12"):
        todos = module_todos(MODULES[number])
        for plant in plants(number):
            block = todos[todo_of(number, plant) - 1]
            source = plant.find.strip().splitlines()[0].strip()
            assert block.file == plant.file and any(source in line for line in block.solution), (plant, block.title)


CAUGHT = "by test_x: AssertionError: off"


@pytest.mark.parametrize("help, right, said", [
    ("python main.py hint 05 {todo}", True, "help names TODO {todo}"),
    ("python main.py hint 05 {other}", False, "help names TODO {other}"),
    ("python main.py hint 05 {todo} (it also exercises TODOs {other})", False, "help names TODOs {todo}, {other}"),
    ("python main.py hint 02 {todo}", False, "help names module 02's TODO {todo}"),
    (None, False, "no help line"),
])
def test_a_caught_plant_is_blamed_right_only_when_its_help_names_its_own_todo_alone(help, right, said):
    todo = todo_of("05", PLANT.plant)
    other = todo % 5 + 1
    outcome = Outcome("caught", CAUGHT, 1.0, help and help.format(todo=todo, other=other))
    blamed = blame(PLANT, outcome)
    assert (blamed.right, blamed.todo, blamed.said) == (right, todo, said.format(todo=todo, other=other))
    assert blame(PLANT, Outcome("SURVIVED", "3 tests passed", 1.0)) is None
    assert blame(BASELINE, Outcome("passed", "3 tests passed", 1.0)) is None


def test_the_total_gives_the_blame_per_module_old_and_new_plants_apart():
    todo = todo_of("05", PLANT.plant)
    new = Job("05", 2, Plant(PLANT.plant.file, PLANT.plant.find, "x", "a new plant", new=True))
    done = {"05.0": (BASELINE, Outcome("passed", "", 1.0)),
            "05.1": (PLANT, Outcome("caught", CAUGHT, 1.0, f"python main.py hint 05 {todo}")),
            "05.2": (new, Outcome("caught", CAUGHT, 1.0, f"python main.py hint 05 {todo % 5 + 1}")),
            "05.3": (Job("05", 3, plants("05")[2]), Outcome("SURVIVED", "4 tests passed", 1.0))}
    lines = summary(done)
    assert lines[0].split()[-4:] == ["blamed", "right", "new:", "right"], lines[0]
    assert lines[1].split()[:5] == ["05", "3", "2", "1", "0"] and lines[1].endswith("1 of 1      0 of 1"), lines[1]
    assert lines[-2] == "blamed wrong:" and lines[-1].startswith(f"  05.2   in TODO {todo}, help names TODO"), lines
    assert lines[-1].endswith("(new)")


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
