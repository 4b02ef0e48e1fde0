"""steps/ is generated from solutions/: the generator's rules, freshness, and matching APIs."""
import importlib
import inspect
import re
import subprocess

import pytest

from course.skeleton import REPO, MarkerError, generate, skeletonize

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


def _committed(path: str) -> str | None:
    """The file as committed in git (HEAD), or None outside a git checkout."""
    result = subprocess.run(["git", "show", f"HEAD:{path}"], cwd=REPO, capture_output=True, text=True)
    return result.stdout if result.returncode == 0 else None


def test_committed_steps_are_up_to_date_with_solutions():
    """Compares with git's HEAD when possible, so a learner's edits in steps/ do not count."""
    stale = []
    for name, text in generate().items():
        committed = _committed(f"steps/{name}")
        on_disk = REPO / "steps" / name
        current = committed if committed is not None else (on_disk.read_text() if on_disk.exists() else None)
        if current != text:
            stale.append(f"steps/{name}")
    extra = {p.name for p in (REPO / "steps").glob("*.py")} - set(generate())
    assert not stale and not extra, \
        f"out of date: {stale + sorted(extra)}; run `python -m course.skeleton` and commit steps/"


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
    assert _public_api(skeleton) == _public_api(solution)
