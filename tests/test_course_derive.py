"""Passing means deriving (issues 26 and 36): for the TODOs whose point is a derivation, what the
learner reads before asking for help states no answer, and the help climbs one level at a time.
The answers to look for are kept beside this test, in tests/derive_answers.py, one short list per
TODO, each answer a recipe or formula (hint 2 may state it) or code (only hint 3 may):
  - the module's chapter and its skeletons (docstrings, given code and the TODOs' visible comments:
    what `python -m course.skeleton` writes) state none of them;
  - hint level 1 of any of the module's TODOs states none of them, and hint level 2 no code;
  - each answer is given by its own TODO's hint levels, at its level or above.
The rule these checks stand for is docs/maintainers.md's "Writing a TODO". Like the check that no
TODO shows a line of its own solution (tests/test_course_skeleton.py), this catches an answer
written where it does not belong, not every way of giving it away. Also here: no chapter sends the
learner to solutions/ or to the plant catalogue (course/mutants/).

    python tests/test_course_derive.py    how many TODOs of each module have answers listed (36.2)
"""
from __future__ import annotations

import functools
import importlib.util
import re
from dataclasses import dataclass

import pytest

from course import REPO
from course.catalog import MODULES
from course.hints import module_todos
from course.skeleton import TodoBlock, generate

_spec = importlib.util.spec_from_file_location("derive_answers", REPO / "tests" / "derive_answers.py")
derive_answers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(derive_answers)
FORBIDDEN = derive_answers.FORBIDDEN
LEVEL_NAMES = {0: "", 1: "hint 1", 2: "hint 2", 3: "hint 3"}


def normalized(text: str) -> str:
    """Lower case, without whitespace, backticks, table bars or comment marks: the same answer
    however it is spaced, wrapped, quoted in code or set in a table."""
    text = "\n".join(line.strip().lstrip("#") for line in text.splitlines())
    return re.sub(r"[\s`|]+", "", text.lower())


@dataclass(frozen=True)
class Answer:
    """One answer of the TODOs `key` names, in one or more wordings."""
    key: str
    wordings: tuple[str, ...]
    code: bool

    @property
    def level(self) -> int:
        """The first hint level that may state it."""
        return 3 if self.code else 2

    def kind(self) -> str:
        return "code: only hint 3 may state it" if self.code else "a recipe or formula: only hint 2 or 3 may state it"


def answers_of(number: str, forbidden: dict = FORBIDDEN) -> list[Answer]:
    """Module `number`'s answers, from derive_answers.FORBIDDEN's format (a string, a tuple of
    wordings, or code(...))."""
    listed = []
    for key, entries in forbidden[number].items():
        for entry in entries:
            wordings = (entry,) if isinstance(entry, str) else tuple(entry)
            listed.append(Answer(key, wordings, isinstance(entry, derive_answers.Code)))
    return listed


@functools.lru_cache(maxsize=None)
def todos(number: str) -> list[tuple[int, TodoBlock]]:
    """The module's TODOs, numbered as `python main.py hint` numbers them."""
    return list(enumerate(module_todos(MODULES[number]), start=1))


def named_by(key: str, block: TodoBlock) -> bool:
    """Whether a FORBIDDEN key names this TODO: its function (qualified or short) or its title."""
    return key in (block.function, block.function.rsplit(".", 1)[-1], block.title.split(": ", 1)[1])


def whose(number: str, answer: Answer) -> str:
    """'tp_traffic (TODO 9)': the TODOs an answer belongs to, as the hint command numbers them."""
    numbers = [str(n) for n, block in todos(number) if named_by(answer.key, block)]
    return f"{answer.key} (TODO {', '.join(numbers)})"


@dataclass(frozen=True)
class Text:
    """Something the learner reads: a file (level 0: read before any help), or one hint level."""
    where: str
    text: str
    level: int


@functools.lru_cache(maxsize=None)
def skeletons() -> dict[str, str]:
    return generate()


def readable_before_help(number: str) -> list[Text]:
    """The module's chapter and its skeletons, as a learner reads them."""
    [chapter] = sorted((REPO / "docs").glob(f"{number}-*.md"))
    texts = [Text(f"docs/{chapter.name}", chapter.read_text(), 0)]
    texts += [Text(f"steps/{stem}.py", skeletons()[f"{stem}.py"], 0) for stem in MODULES[number].files]
    return texts


def hint_levels(number: str, blocks: list[tuple[int, TodoBlock]] | None = None) -> list[Text]:
    """Every hint level of the module's TODOs (or of `blocks`), as `python main.py hint` shows them."""
    return [Text(f"hint {level} of TODO {n} (`python main.py hint {number} {n}`)", "\n".join(lines), level)
            for n, block in (todos(number) if blocks is None else blocks) for level, lines in sorted(block.hints.items())]


def line_of(text: str, wording: str) -> int:
    """The line of `text` on which `wording` (found in it, normalized) ends."""
    lines, wanted = text.splitlines(), normalized(wording)
    low, high = 1, len(lines)
    while low < high:  # the first prefix of the text that holds it
        middle = (low + high) // 2
        low, high = (low, middle) if wanted in normalized("\n".join(lines[:middle])) else (middle + 1, high)
    return low


def leaks(number: str, texts: list[Text], answers: list[Answer]) -> list[str]:
    """Where an answer is stated below its level: 'docs/12-x.md:88 states ...' (a file), or 'hint 1
    of TODO 3 (...) states ...'."""
    found = []
    for text in texts:
        flat = normalized(text.text)
        for answer in answers:
            for wording in answer.wordings:
                if text.level < answer.level and normalized(wording) in flat:
                    where = f"{text.where}:{line_of(text.text, wording)}" if text.level == 0 else text.where
                    found.append(f"{where} states {wording!r}, an answer of {whose(number, answer)}; {answer.kind()}")
    return found


def not_given(number: str, answers: list[Answer], blocks: list[tuple[int, TodoBlock]] | None = None) -> list[str]:
    """The answers that none of their own TODOs' hint levels (of the module, or of `blocks`) at or above
    their level states."""
    missing = []
    for answer in answers:
        mine = [(n, block) for n, block in (todos(number) if blocks is None else blocks) if named_by(answer.key, block)]
        given = normalized("\n".join(t.text for t in hint_levels(number, mine) if t.level >= answer.level))
        if not any(normalized(wording) in given for wording in answer.wordings):
            levels = "hint 3" if answer.code else "hint 2 or 3"
            missing.append(f"{' / '.join(map(repr, answer.wordings))} ({whose(number, answer)}): in no {levels}")
    return missing


def pending(number: str, until_rewrite: set[str]):
    """Module `number` as a parameter, expected to fail until issue 36.2's rewrite takes it out of the set."""
    marks = [pytest.mark.xfail(strict=True, reason="issue 36.2: the module's hints are not rewritten to the rule "
                               "yet (tests/derive_answers.py; take it out of the set once they pass)")]
    return pytest.param(number, marks=marks if number in until_rewrite else [])


@pytest.mark.parametrize("number", sorted(FORBIDDEN))
def test_no_chapter_or_skeleton_states_an_answer_its_todos_ask_for(number):
    found = leaks(number, readable_before_help(number), answers_of(number))
    assert not found, ("answers the TODOs ask the learner to derive, written where the learner reads before asking "
                       "for help (move them to a hint level, or derive a neighbouring case instead):\n" + "\n".join(found))


@pytest.mark.parametrize("number", [pending(n, derive_answers.HINT_LEAKS_UNTIL_REWRITE) for n in sorted(FORBIDDEN)])
def test_hint_1_states_no_answer_and_hint_2_no_code(number):
    found = leaks(number, hint_levels(number), answers_of(number))
    assert not found, ("hint 1 asks a question, hint 2 may give the maths, only hint 3 the code (docs/maintainers.md, "
                       "\"Writing a TODO\"); move these up a level:\n" + "\n".join(found))


@pytest.mark.parametrize("number",
                         [pending(n, derive_answers.ANSWERS_NOT_IN_HINTS_UNTIL_REWRITE) for n in sorted(FORBIDDEN)])
def test_the_hint_levels_give_every_answer_at_its_level(number):
    # Asking for help always gets the learner there: an answer kept from the chapter and hint 1 is in hint 2 or 3.
    missing = not_given(number, answers_of(number))
    assert not missing, ("answers listed in tests/derive_answers.py that no hint level of their TODO gives (give each "
                         "in its hint 2 or 3, code in hint 3, or list it as another wording of an answer given, in a "
                         "tuple):\n" + "\n".join(missing))


@pytest.mark.parametrize("number", sorted(FORBIDDEN))
def test_every_forbidden_answer_belongs_to_a_todo_of_its_module(number):
    # The keys name functions or titles as `python main.py hint` does, so the lists follow a renamed TODO.
    blocks = [block for _, block in todos(number)]
    unknown = sorted(key for key in FORBIDDEN[number] if not any(named_by(key, block) for block in blocks))
    assert not unknown, f"tests/derive_answers.py names functions or titles without a TODO in module {number}: {unknown}"
    empty = [key for key, entries in FORBIDDEN[number].items() if not entries]
    assert not empty, f"no answers listed for {empty}"
    malformed = [entry for entries in FORBIDDEN[number].values() for entry in entries
                 if not (isinstance(entry, str) or (isinstance(entry, tuple) and entry
                                                    and all(isinstance(w, str) and w.strip() for w in entry)))]
    assert not malformed, f"answers must be a string, a tuple of wordings or code(...): {malformed}"


def test_the_guard_sees_an_answer_however_it_is_spaced_wrapped_or_tabled():
    chapter = "| all-gathers | 2 L m -\n# kept (2m-1) |\n`\"B/d T M, F/t M ->  B/d T F/t\"`"
    text = normalized(chapter)
    assert normalized("2Lm - kept (2m - 1)") in text and normalized("B/d T M, F/t M -> B/d T F/t") in text
    assert normalized("B/d T M, F/t M -> B/d T M") not in text
    assert line_of("one\ntwo 2 L m -\n# kept (2m-1)\nfour", "2Lm - kept (2m - 1)") == 3


def test_the_guard_holds_each_kind_of_answer_to_its_level():
    # Module 01's train_step, with hints written three ways: each answer's leaks are named where they are.
    [(n, block)] = [(n, b) for n, b in todos("01") if b.function == "train_step"]
    forbidden = {"01": {"train_step": ["detach the output", ("seed its backward", "seeded backward"),
                                       derive_answers.code("hidden.backward(received.grad)")]}}
    answers = answers_of("01", forbidden)
    assert [a.level for a in answers] == [2, 2, 3] and answers[1].wordings == ("seed its backward", "seeded backward")

    def hinted(*levels: str) -> list[tuple[int, TodoBlock]]:
        return [(n, TodoBlock(block.title, block.file, block.line, block.function, block.indent,
                              hints={level: [f"# Hint {level}: {text}"] for level, text in enumerate(levels, start=1)}))]

    right = hinted("Which tensor must the gradient cross by hand?", "Detach the output; a seeded backward.",
                   "hidden.backward(received.grad)")
    assert leaks("01", hint_levels("01", right), answers) == [] and not_given("01", answers, right) == []
    wrong = hinted("Detach the output, then a seeded backward.", "hidden.backward(received.grad)", "the code")
    assert len(not_given("01", answers, wrong)) == 3  # each said too early, or not at all
    found = leaks("01", hint_levels("01", wrong), answers)
    assert [f.split(" states ")[0] for f in found] == [f"hint 1 of TODO {n} (`python main.py hint 01 {n}`)"] * 2 + \
        [f"hint 2 of TODO {n} (`python main.py hint 01 {n}`)"], found
    assert f"an answer of train_step (TODO {n}); code: only hint 3 may state it" in found[-1], found


def test_no_chapter_sends_the_learner_to_solutions_or_the_plant_catalogue():
    # Issue 37.4: a learner works from the chapter, the skeleton and the command's output, never from the
    # reference, the tests' internals or the planted bugs. Fenced blocks (a run's output) are left alone.
    found = []
    for chapter in sorted((REPO / "docs").glob("[0-9][0-9]-*.md")):
        prose = re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), chapter.read_text(), flags=re.S | re.M)
        for lineno, line in enumerate(chapter.read_text().splitlines(), start=1):
            if "course/mutants" in line:
                found.append(f"docs/{chapter.name}:{lineno} cites the plant catalogue: {line.strip()}")
        for lineno, line in enumerate(prose.splitlines(), start=1):
            if re.search(r"solutions/m\d\d", line):
                found.append(f"docs/{chapter.name}:{lineno} names a solutions/ file: {line.strip()}")
    assert not found, ("chapters that send the learner where they never need to look (name the steps/ file, or say "
                       "what the grader checks in words):\n" + "\n".join(found))


def coverage() -> list[str]:
    """The maintainer's view of issue 36.2: per module, how many TODOs have answers listed, and whether
    its hint levels are held to the rule yet."""
    rows = [f"{'module':<7} {'TODOs':>5} {'listed':>6}  hint levels"]
    for number, module in MODULES.items():
        if module.is_given():
            continue
        keys = FORBIDDEN.get(number, {})
        listed = sum(any(named_by(key, block) for key in keys) for _, block in todos(number))
        waiting = [what for what, until in (("hint 1 or 2 leaks", derive_answers.HINT_LEAKS_UNTIL_REWRITE),
                                            ("answers not in hints", derive_answers.ANSWERS_NOT_IN_HINTS_UNTIL_REWRITE))
                   if number in until]
        checked = ("not checked (no answers listed)" if not keys
                   else f"expected to fail until 36.2: {', '.join(waiting)}" if waiting else "checked")
        rows.append(f"{number:<7} {len(todos(number)):>5} {listed:>6}  {checked}")
    return rows


if __name__ == "__main__":
    print("\n".join(coverage()))
