"""Passing means deriving (issue 26): for the TODOs whose point is a derivation, neither the
module's chapter nor its skeleton (docstrings, given code and the TODOs' visible comments: what
`python -m course.skeleton` writes, the hint levels left out) states the answer. The answers to
look for are kept beside this test, in tests/derive_answers.py, one short list per TODO.

Like the check that no TODO shows a line of its own solution (tests/test_course_skeleton.py), this
catches an answer written back into a chapter or a comment, not every way of giving it away."""
import importlib.util
import re

import pytest

from course import REPO
from course.catalog import MODULES
from course.hints import module_todos
from course.skeleton import generate

_spec = importlib.util.spec_from_file_location("derive_answers", REPO / "tests" / "derive_answers.py")
answers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(answers)
FORBIDDEN = answers.FORBIDDEN


def normalized(text: str) -> str:
    """Lower case, without whitespace, backticks, table bars or comment marks: the same answer
    however it is spaced, wrapped, quoted in code or set in a table."""
    text = "\n".join(line.strip().lstrip("#") for line in text.splitlines())
    return re.sub(r"[\s`|]+", "", text.lower())


def readable_by_the_learner(number: str) -> dict[str, str]:
    """The module's chapter and its skeletons, as a learner reads them, by path."""
    [chapter] = sorted((REPO / "docs").glob(f"{number}-*.md"))
    skeletons = generate()
    texts = {f"docs/{chapter.name}": chapter.read_text()}
    texts.update({f"steps/{stem}.py": skeletons[f"{stem}.py"] for stem in MODULES[number].files})
    return texts


@pytest.mark.parametrize("number", sorted(FORBIDDEN))
def test_no_chapter_or_skeleton_states_an_answer_its_todos_ask_for(number):
    texts = {path: normalized(text) for path, text in readable_by_the_learner(number).items()}
    found = [f"{path} states {answer!r} (the answer of {function})"
             for function, forbidden in FORBIDDEN[number].items() for answer in forbidden
             for path, text in texts.items() if normalized(answer) in text]
    assert not found, ("answers the TODOs ask the learner to derive, written where the learner reads (move them "
                       "to a hint level, or derive a neighbouring case instead):\n" + "\n".join(found))


@pytest.mark.parametrize("number", sorted(FORBIDDEN))
def test_every_forbidden_answer_belongs_to_a_todo_of_its_module(number):
    # The keys name functions as `python main.py hint` does, so the lists follow a renamed TODO.
    functions = {name for block in module_todos(MODULES[number])
                 for name in (block.function, block.function.rsplit(".", 1)[-1])}
    unknown = sorted(set(FORBIDDEN[number]) - functions)
    assert not unknown, f"tests/derive_answers.py names functions without a TODO in module {number}: {unknown}"
    empty = [function for function, forbidden in FORBIDDEN[number].items() if not forbidden]
    assert not empty, f"no answers listed for {empty}"


def test_the_guard_sees_an_answer_however_it_is_spaced_wrapped_or_tabled():
    chapter = "| all-gathers | 2 L m -\n# kept (2m-1) |\n`\"B/d T M, F/t M ->  B/d T F/t\"`"
    text = normalized(chapter)
    assert normalized("2Lm - kept (2m - 1)") in text and normalized("B/d T M, F/t M -> B/d T F/t") in text
    assert normalized("B/d T M, F/t M -> B/d T M") not in text


def test_the_hint_levels_may_hold_the_answers():
    # What the guard leaves alone: the hint levels are asked for, one at a time (course/hints.py).
    [block] = [b for b in module_todos(MODULES["07"]) if b.function == "fsdp_traffic"]
    hints = normalized("\n".join(line for level in block.hints.values() for line in level))
    assert normalized("all-gathers = 2 L m - kept turns") in hints
    assert normalized("all-gathers = 2 L m - kept turns") not in normalized(generate()["m07_payload.py"])
