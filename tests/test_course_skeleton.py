"""steps/ is generated from solutions/: the generator's rules, freshness, and matching APIs."""
import hashlib
import importlib
import inspect
import re

import pytest

from course.skeleton import FINGERPRINT, REPO, MarkerError, generate, skeleton_file, skeletonize, todo_blocks

SOURCE = '''def f(x):
    y = 1
    # >>> TODO(m07): double x
    # Hint: multiply.
    # Hint: by two.
    doubled = x * 2
    # a comment inside the solution is not a hint
    return doubled + y - 1
    # <<<
'''


def test_a_solution_block_becomes_its_hints_and_a_raise():
    assert skeletonize(SOURCE, "m07_example.py") == '''def f(x):
    y = 1
    # TODO(m07): double x
    # Hint: multiply.
    # Hint: by two.
    raise NotImplementedError('TODO(m07): double x')
'''


def test_the_generated_skeleton_raises_and_the_solution_works():
    solution, skeleton = {}, {}
    exec(SOURCE, solution)
    exec(skeletonize(SOURCE, "m07_example.py"), skeleton)
    assert solution["f"](5) == 10
    with pytest.raises(NotImplementedError, match=r"TODO\(m07\): double x"):
        skeleton["f"](5)


@pytest.mark.parametrize("broken, problem", [
    ("# >>> TODO(m07): a\n# >>> TODO(m07): b\n# <<<\n# <<<\n", "inside another"),
    ("x = 1\n# <<<\n", "without an opening"),
    ("# >>> TODO(m07): a\nx = 1\n", "never closed"),
    ("# >>> TODO(m05): a\n# <<<\n", "m05 marker in a m07 file"),
])
def test_malformed_markers_are_refused(broken, problem):
    with pytest.raises(MarkerError, match=problem):
        skeletonize(broken, "m07_example.py")


def test_steps_are_up_to_date_with_solutions():
    """steps/ holds the learner's work, so it is not compared whole: each skeleton's header carries
    a fingerprint of the text generated, which must be the one solutions/ generates now."""
    stale = []
    for name, text in generate().items():
        on_disk = REPO / "steps" / name
        fingerprint = FINGERPRINT.search(text)
        expected = fingerprint.group(0) if fingerprint else text  # steps/__init__.py has no header
        if not on_disk.exists() or expected not in on_disk.read_text():
            stale.append(f"steps/{name}")
    extra = {p.name for p in (REPO / "steps").glob("*.py")} - set(generate())
    assert not stale and not extra, (
        f"out of date with solutions/: {stale + sorted(extra)}. Maintainers: run `python -m course.skeleton` "
        "and commit steps/ with the solutions. Learners: this checks the course, not your work; pull the "
        "new steps/ (it overwrites your edits: keep a copy) or ignore this test.")


def given_lines(skeleton: str) -> list[str]:
    """The lines of a skeleton outside its TODO blocks (title, hints and raise), blank lines left out."""
    given, in_todo = [], False
    for line in skeleton.splitlines():
        in_todo = in_todo or re.match(r"\s*# TODO\(m\d\d\): ", line) is not None
        if not in_todo and line.strip():
            given.append(line.rstrip())
        in_todo = in_todo and "raise NotImplementedError(" not in line
    return given


def test_steps_keep_the_given_code_of_solutions():
    """Given code reaches steps/ only through the generator: every given line of the generated
    skeleton is still in steps/, in order (a learner's own added lines are allowed anywhere)."""
    changed = []
    for name, text in generate().items():
        on_disk = iter(line.rstrip() for line in (REPO / "steps" / name).read_text().splitlines())
        missing = [line for line in given_lines(text) if not any(line == seen for seen in on_disk)]
        if missing:
            changed.append(f"steps/{name}: {missing[0].strip()!r}")
    assert not changed, (f"given code differs from what solutions/ generates: {changed}. Maintainers: edit "
                         "solutions/ and run `python -m course.skeleton`. Learners: put back the given code "
                         "you changed; your code belongs where the TODOs were.")


def _filled(text: str) -> str:
    """A learner's work: their first TODO filled in."""
    filled = text.replace('raise NotImplementedError("TODO(m04)', 'raise RuntimeError("mine', 1)
    assert filled != text
    return filled


def test_regenerating_keeps_a_learners_work_unless_forced(tmp_path):
    from course.skeleton import write
    steps = tmp_path / "steps"
    write(steps)
    mine = steps / "m04_sharded.py"
    filled = _filled(mine.read_text())
    mine.write_text(filled)
    # An untouched skeleton generated from an older solutions/ (its own fingerprint in its header) is replaced.
    old = steps / "m05_schedules.py"
    header, second, body = old.read_text().split("\n", 2)
    body = "# an older skeleton\n" + body
    fingerprint = FINGERPRINT.sub(f"(skeleton {hashlib.sha256(body.encode()).hexdigest()[:12]})", second)
    old.write_text(f"{header}\n{fingerprint}\n{body}")

    done = write(steps)
    assert list(done.kept) == ["m04_sharded.py"] and done.written == ["m05_schedules.py"] and mine.read_text() == filled
    assert old.read_text() == generate()["m05_schedules.py"]
    done = write(steps, force=True)
    assert done.kept == {} and done.overwritten == ["m04_sharded.py"] and mine.read_text() == generate()["m04_sharded.py"]


@pytest.mark.parametrize("edit", ["a comment above the header", "the header deleted", "the header reworded",
                                  "a fingerprint that fits the edited text"])
def test_a_learners_work_is_recognised_by_its_whole_text(tmp_path, edit):
    """A file is rewritten only if its whole text is the generator's: its header may be moved, deleted
    or reworded by the learner, and their code is still theirs."""
    from course.skeleton import write
    steps = tmp_path / "steps"
    write(steps)
    mine = steps / "m04_sharded.py"
    header, second, body = _filled(mine.read_text()).split("\n", 2)
    edited = {
        "a comment above the header": f"# my notes for module 04\n{header}\n{second}\n{body}",
        "the header deleted": body,
        "the header reworded": f"# My pipeline, after the course's skeleton\n{second}\n{body}",
        "a fingerprint that fits the edited text": "# my header\n" + FINGERPRINT.sub(
            f"(skeleton {hashlib.sha256(body.encode()).hexdigest()[:12]})", second) + "\n" + body,
    }[edit]
    mine.write_text(edited)
    done = write(steps)
    assert mine.read_text() == edited, "a learner's file was overwritten"
    assert "m04_sharded.py" in done.kept and "m04_sharded.py" not in done.written


def test_a_learners_own_file_in_steps_is_kept_and_named(tmp_path, capsys):
    from course.skeleton import main
    steps = tmp_path / "steps"
    steps.mkdir()
    mine = steps / "my_helpers.py"
    mine.write_text("def mine(): ...\n")
    for argv in ([], ["--force"]):
        assert main(argv, steps) == 0
        assert mine.read_text() == "def mine(): ...\n"
        assert "kept steps/my_helpers.py: not generated from solutions/" in capsys.readouterr().out


def test_an_unknown_option_is_one_line_with_exit_code_2(tmp_path, capsys):
    # Issue 33: the module's docstring (40 lines) and no error line.
    from course.skeleton import main
    assert main(["--bogus"], tmp_path / "steps") == 2 and not (tmp_path / "steps").exists()
    out, err = capsys.readouterr()
    assert out == "" and err == ("error: unrecognized arguments: --bogus; usage: python -m course.skeleton "
                                 "[--force | --check]\n"), err


def test_a_read_only_checkout_gets_one_line_not_a_traceback(tmp_path, capsys, monkeypatch):
    from pathlib import Path

    from course.skeleton import main

    def read_only(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))
    monkeypatch.setattr(Path, "write_text", read_only)
    assert main([], tmp_path) == 1
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith("error: ") and "Permission denied" in out, out


def test_an_up_to_date_steps_is_not_written(tmp_path, capsys, monkeypatch):
    from pathlib import Path

    from course.skeleton import main, write
    steps = tmp_path / "steps"
    write(steps)
    monkeypatch.setattr(Path, "write_text", lambda *args, **kwargs: pytest.fail("wrote an up-to-date file"))
    assert main([], steps) == 0
    assert capsys.readouterr().out.startswith("steps/ is up to date with solutions/")


def test_a_change_to_the_skeleton_changes_its_fingerprint():
    name, text = next((n, t) for n, t in generate().items() if n.startswith("m01_"))
    source = (REPO / "solutions" / name).read_text()
    changed = skeleton_file(source.replace("# >>> TODO(m01): ", "# >>> TODO(m01): (reworded) ", 1), name)
    assert FINGERPRINT.search(changed).group(0) != FINGERPRINT.search(text).group(0)


def _stable_repr(value) -> str:
    """repr, with sets sorted: a set's order can differ between two imports of the same code."""
    if isinstance(value, (set, frozenset)):
        return f"{type(value).__name__}({sorted(map(_stable_repr, value))})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_stable_repr(k)}: {_stable_repr(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _public_api(module) -> dict[str, str]:
    """Public functions, classes (with their public methods) and constants defined in `module`."""
    package = module.__name__.split(".")[0] + "."
    api = {}
    for name, obj in vars(module).items():
        if name.startswith("_") or inspect.ismodule(obj) or getattr(obj, "__module__", module.__name__) != module.__name__:
            continue
        api[name] = str(inspect.signature(obj)) if callable(obj) else _stable_repr(obj)
        if inspect.isclass(obj):
            for method, member in vars(obj).items():
                if not method.startswith("_") and callable(member):
                    api[f"{name}.{method}"] = str(inspect.signature(member))
    return {name: re.sub(r" at 0x[0-9a-f]+", "", text.replace(package, "")) for name, text in api.items()}


@pytest.mark.parametrize("stem", sorted(p.stem for p in (REPO / "solutions").glob("m[0-9][0-9]_*.py")))
def test_steps_and_solutions_expose_the_same_names_and_signatures(stem):
    solution = importlib.import_module(f"solutions.{stem}")
    skeleton = importlib.import_module(f"steps.{stem}")
    # Every name of the solution, with the same signature; a learner may add helpers of their own.
    steps_api, solution_api = _public_api(skeleton), _public_api(solution)
    assert {name: steps_api.get(name) for name in solution_api} == solution_api


def _normalized(line: str) -> str:
    return " ".join(line.strip().removeprefix("#").split())


def _visible_and_solution(block):
    visible = " ".join(_normalized(line) for line in [block.title, *block.visible])
    solution = [_normalized(line) for line in block.solution]
    return visible, [line for line in solution if len(re.findall(r"\w+|[^\s\w]", line)) > 4]


def _all_blocks():
    return [block for path in sorted((REPO / "solutions").glob("m[0-9][0-9]_*.py"))
            for block in todo_blocks(path.read_text(), path.name)]


def test_no_todo_shows_a_line_of_its_own_solution():
    """What the skeleton shows of a TODO (its title and visible comments) states the contract, the
    maths and the pitfalls; passing must mean understanding, so no line of its solution (of more
    than four tokens, whitespace normalized) may appear in it. Code-level help is in the hint levels."""
    shown = [f"solutions/{block.file}:{block.line} ({block.title}) shows {line!r}"
             for block in _all_blocks() for visible, lines in [_visible_and_solution(block)]
             for line in lines if line in visible]
    assert not shown, "TODOs whose visible text gives away their code:\n" + "\n".join(shown)


def test_every_todo_has_three_hint_levels():
    missing = [f"solutions/{block.file}:{block.line} ({block.title}): levels {sorted(block.hints)}"
               for block in _all_blocks() if sorted(block.hints) != [1, 2, 3]]
    assert not missing, "TODOs without hint levels 1, 2 and 3 (`python main.py hint` shows them):\n" + "\n".join(missing)


def test_the_guard_catches_a_hint_that_gives_the_code_away():
    source = "def f(x):\n    # >>> TODO(m07): double x\n    # Write: return x * 2 + 0\n    return x * 2 + 0\n    # <<<\n"
    [block] = todo_blocks(source, "m07_example.py")
    visible, lines = _visible_and_solution(block)
    assert lines == ["return x * 2 + 0"] and lines[0] in visible


@pytest.fixture
def steps_without_m05(tmp_path, monkeypatch):
    """A learner's steps/ from which steps/m05_schedules.py was deleted."""
    from course.skeleton import write
    write(tmp_path / "steps")
    (tmp_path / "steps" / "m05_schedules.py").unlink()
    monkeypatch.setenv("COURSE_STEPS_DIR", str(tmp_path / "steps"))
    return tmp_path / "steps"


def test_list_says_which_steps_file_is_missing_never_done(steps_without_m05):
    from course.catalog import MODULES
    module = MODULES["05"]
    assert module.status() == "missing steps/m05_schedules.py"
    # `main.py list` reads todos_left too: a deleted file has every TODO left, not none.
    assert module.todos_left() == len(todo_blocks((REPO / "solutions" / "m05_schedules.py").read_text())) > 0
    assert MODULES["04"].status() == "3 left" and MODULES["00"].status() == "given"


def test_run_and_grade_of_a_deleted_steps_file_say_so_in_one_line(steps_without_m05, capsys):
    from course.catalog import MODULES
    from course.grade import grade
    from course.impl import MissingStepsFile, load
    with pytest.raises(MissingStepsFile, match=r"^steps/m05_schedules.py is missing: `git checkout"):
        load("m05_schedules", "steps")  # what `run` and `bench` report, one line per rank that raised it
    assert grade(MODULES["05"], "steps") == 1
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith("module 05: steps/m05_schedules.py is missing: "), out


def test_a_file_without_a_header_is_kept_unless_forced(tmp_path):
    from course.skeleton import write
    steps = tmp_path / "steps"
    write(steps)
    package = steps / "__init__.py"
    package.write_text('"""An older docstring."""\n')
    done = write(steps)
    assert package.read_text() == '"""An older docstring."""\n' and "no header" in done.kept["__init__.py"]
    assert write(steps, force=True).overwritten == ["__init__.py"]
    assert package.read_text() == generate()["__init__.py"]
