"""`python main.py hint NN [TODO] [--all]`: help with a TODO, one level at a time (given).

A TODO's skeleton states its contract, its maths and its pitfalls. Help beyond that is asked for:
each solution block in solutions/ carries up to three levels, `# Hint 1:` the idea in words,
`# Hint 2:` the primitives or formula to use, `# Hint 3:` pseudo-code. Each call shows the next
level of one TODO; which levels were shown is remembered in a git-ignored file (HINTS_SHOWN), so
regenerating the skeletons or pulling the course never resets it, and it never touches steps/.

    python main.py hint 05                 the module's TODOs: number, where, levels seen
    python main.py hint 05 3               the next level of TODO 3
    python main.py hint 05 one_f_one_b     the same, named by the function that holds it
    python main.py hint 05 3 --all         every level of TODO 3 at once
"""
from __future__ import annotations

import json
import re

from course import REPO
from course.catalog import Module
from course.skeleton import TodoBlock, todo_blocks

HINTS_SHOWN = REPO / ".course-hints.json"  # {"TODO(m05): ...": levels shown}


def module_todos(module: Module) -> list[TodoBlock]:
    """The module's TODOs in reading order (its files in catalog order, then line order)."""
    return [block for stem in module.files
            for block in todo_blocks((REPO / "solutions" / f"{stem}.py").read_text(), f"{stem}.py")]


def find(module: Module, which: str) -> list[tuple[int, TodoBlock]]:
    """TODOs named by `which`: their number (from 1), the function holding them ("one_f_one_b",
    "LlamaBlock.backward" or just "backward"), or words of their title; with their numbers."""
    todos = list(enumerate(module_todos(module), start=1))
    if which.isdigit():
        return [(n, b) for n, b in todos if n == int(which)]
    by_function = [(n, b) for n, b in todos if which in (b.function, b.function.rsplit(".", 1)[-1])]
    return by_function or [(n, b) for n, b in todos if which.lower() in b.title.lower()]


def command(module: Module, which: str | None, show_all: bool) -> int:
    """What `python main.py hint` prints; returns the exit code."""
    todos = module_todos(module)
    if not todos:
        print(f"module {module.number} has no TODOs: it is given code")
        return 0
    shown = _load_shown()
    if which is None:
        print(f"Module {module.number}'s TODOs (`python main.py hint {module.number} N` shows the next level of TODO N):")
        for number, block in enumerate(todos, start=1):
            levels = f"{shown.get(block.title, 0)}/{len(block.hints)} hint levels seen"
            print(f"  {number:2d}  steps/{block.file} in {block.function}: {_what(block)}  ({levels})")
        return 0
    found = find(module, which)
    if not found:
        print(f"module {module.number} has no TODO {which!r}: `python main.py hint {module.number}` lists them")
        return 2
    for number, block in found:
        if not block.hints:
            print(f"TODO {number} ({_what(block)}) has no hints beyond what the skeleton says")
            continue
        seen = shown.get(block.title, 0)
        levels = range(1, len(block.hints) + 1) if show_all else [min(seen + 1, len(block.hints))]
        print(f"TODO {number}, steps/{block.file} in {block.function}: {_what(block)}")
        for level in levels:
            print("\n".join(_strip_comment(line) for line in block.hints[level]))
        if not show_all and seen >= len(block.hints):
            print(f"(that was the last level; the chapter docs/{module.number}-*.md has the maths)")
        shown[block.title] = max(seen, levels[-1])
    _save_shown(shown)
    return 0


def hint_command_for(number: str, text: str) -> str | None:
    """The `python main.py hint` command for the TODO whose title `text` contains (an error that
    names it), or for the TODOs of the functions `text` lists ("forward_step, one_f_one_b", what a
    check exercises: the first function listed first); None if module `number` has no such TODO."""
    from course.catalog import MODULES
    module = MODULES.get(number)
    if module is None:
        return None
    todos = list(enumerate(module_todos(module), start=1))
    for n, block in todos:
        if block.title in text:
            return f"python main.py hint {number} {n}"
    wanted = [name.strip() for name in text.split(",") if name.strip()]
    def listed_at(block) -> int:  # where the check lists the TODO's function (a method by either name)
        names = (block.function, block.function.rsplit(".", 1)[-1])
        return min((i for i, name in enumerate(wanted) if name in names), default=len(wanted))
    numbers = sorted((n for n, block in todos if listed_at(block) < len(wanted)),
                     key=lambda n: listed_at(todos[n - 1][1]))
    if not numbers:
        return None
    more = f" (it also exercises TODOs {', '.join(map(str, numbers[1:]))})" if numbers[1:] else ""
    return f"python main.py hint {number} {numbers[0]}{more}"


def _what(block: TodoBlock) -> str:
    return block.title.split(": ", 1)[1]


def _strip_comment(line: str) -> str:
    return "  " + re.sub(r"^\s*# ?", "", line)


def _load_shown() -> dict[str, int]:
    try:
        return json.loads(HINTS_SHOWN.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _save_shown(shown: dict[str, int]):
    HINTS_SHOWN.write_text(json.dumps(shown, indent=1, sort_keys=True) + "\n")
