"""steps/ is generated from solutions/: the generator's rules, freshness, and matching APIs."""
import importlib
import inspect
import re

import pytest

from course.skeleton import HEADER_LINES, REPO, MarkerError, generate, skeleton_file, skeletonize

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
    """steps/ holds the learner's work, so it is not compared line by line: each skeleton's header
    carries a fingerprint of the text generated, which must be what solutions/ generates now."""
    stale = []
    for name, text in generate().items():
        on_disk = REPO / "steps" / name
        if not on_disk.exists():
            stale.append(f"steps/{name}")
            continue
        expected = text.splitlines()[:HEADER_LINES] if name.startswith("m") else text.splitlines()
        lines = on_disk.read_text().splitlines()
        if lines[:len(expected)] != expected:
            stale.append(f"steps/{name}")
    extra = {p.name for p in (REPO / "steps").glob("*.py")} - set(generate())
    assert not stale and not extra, (
        f"out of date: {stale + sorted(extra)}; maintainers: run `python -m course.skeleton` and commit "
        "steps/ (it overwrites steps/, so never in a checkout with a learner's work in it)")


def test_a_change_to_the_skeleton_changes_its_fingerprint():
    name, text = next((n, t) for n, t in generate().items() if n.startswith("m01_"))
    source = (REPO / "solutions" / name).read_text()
    changed = skeleton_file(source.replace("# Hint:", "# Hint: (reworded)", 1), name)
    assert changed.splitlines()[:HEADER_LINES] != text.splitlines()[:HEADER_LINES]


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
