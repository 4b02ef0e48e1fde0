"""`python main.py hint NN [TODO] [--all]`: help with a TODO, one level at a time (given).

A TODO's skeleton states its contract (what must hold afterwards), the question to work out, the
definitions to reason from and its pitfalls, as questions. Help beyond that is asked for: each
solution block in solutions/ carries three levels, each closer to the code. `# Hint 1:` is a question
that points at the principle and the chapter's section that teaches it; `# Hint 2:` the maths (a
formula in the glossary's symbols, no code); `# Hint 3:` pseudo-code or code. (docs/maintainers.md,
"Writing a TODO", has the whole rule.) Each call shows the next level of one TODO; which levels were
shown is remembered in a git-ignored file (HINTS_SHOWN), so regenerating the skeletons or pulling the
course never resets it, and it never touches steps/. `python main.py grade NN` and `list` read it to
say how many TODOs were written with no hint seen, with hint 1 or 2 at most, and with hint 3:
when `grade` first passes a module it copies the module's levels to a second file (PASSED), and
from then on they are the count, so hints read afterwards, to compare, do not change it.
Each file is replaced whole on each save (never left half-written); one that does not hold such a
record is named and left as it is, never silently reset. It is keyed by the TODOs' titles: a title
renamed in solutions/ goes in RENAMED_TITLES, so that what a learner has seen follows it.

    python main.py hint 05                 the module's TODOs: number, where, levels seen
    python main.py hint 05 3               the next level of TODO 3
    python main.py hint 05 one_f_one_b     the same, named by the function that holds it (if only one)
    python main.py hint 05 3 --all         every level of TODO 3 at once

A TODO is named by its number, its exact title or the function that holds it; anything else (a
word of a title, an empty string) is refused rather than matched against every TODO.
"""
from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass

from course import REPO
from course.catalog import Module
from course.skeleton import TodoBlock, todo_blocks

HINTS_SHOWN = REPO / ".course-hints.json"  # {"TODO(m05): ...": levels shown}
PASSED = REPO / ".course-passed.json"      # {"05": {"TODO(m05): ...": levels shown when grade first passed 05}}
# A TODO's old title -> its new one ("TODO(m14): ..." both), oldest renaming first: a record read
# under an old title counts for the new one (the higher level seen, if it holds both).
RENAMED_TITLES: dict[str, str] = {
    "TODO(m01): give part two the remaining hidden layers, then the classification head":
        "TODO(m01): give part two the remaining hidden layers and the classification head",
    "TODO(m02): send an activation to the next stage, blocking":
        "TODO(m02): start sending a tensor to the neighbour its direction leads to, and return the handle",
    "TODO(m02): send a gradient back to the previous stage, blocking":
        "TODO(m02): start sending a tensor to the neighbour its direction leads to, and return the handle",
    "TODO(m02): start sending an activation to the next stage, and return its handle":
        "TODO(m02): start sending a tensor to the neighbour its direction leads to, and return the handle",
    "TODO(m02): start sending a gradient back to the previous stage, and return its handle":
        "TODO(m02): start sending a tensor to the neighbour its direction leads to, and return the handle",
    "TODO(m02): receive an activation from the previous stage into a new buffer and return it":
        "TODO(m02): receive a tensor from the neighbour its direction comes from, into a new buffer",
    "TODO(m02): receive a gradient from the next stage into a new buffer and return it":
        "TODO(m02): receive a tensor from the neighbour its direction comes from, into a new buffer",
    "TODO(m05): run the whole batch as a single microbatch, forward then backward":
        "TODO(m05): run GPipe: all m forwards, then all m backwards, and return the batch loss",
    "TODO(m07): this rank's rows, every microbatch divided by the global batch's tokens, one step":
        "TODO(m07): this rank's rows, the loss's divisor, one step",
    "TODO(m15): the two chunks a rank holds under zig-zag (head-tail) load balancing":
        "TODO(m15): the two chunks a rank holds under zig-zag load balancing",
    "TODO(m15): the backward: gather again, this rank's share of every key's gradient, reduce-scatter":
        "TODO(m15): the backward: every rank's keys' gradients, summed over the ranks, home to their owners",
    "TODO(m15): one step: this rank's share, every piece divided by the step's real tokens, the sum over d x c":
        "TODO(m15): one step: this rank's share of the batch, the step's mean loss and its gradient over d x c",
    "TODO(m16): sum the dense gradients over every data rank, the experts' over the expert-data group":
        "TODO(m16): sum each gradient over the ranks that hold a copy of its weight",
    "TODO(m16): the router's forward: scores, top-k with the bias for selection only, weights after top-k":
        "TODO(m16): the router's forward: the scores, each token's k experts and their combine weights",
    "TODO(m16): undo the regroup, then the all-to-all home":
        "TODO(m16): the way back: every row from the experts home to where it left",
    "TODO(m16): the MoE layer's backward: combine, the all-to-alls the other way, experts, router":
        "TODO(m16): the MoE layer's backward: every gradient of the layer, through every piece of its forward",
    "TODO(m12): the attention half: norm, column-parallel q/k/v, RoPE, attention on this rank's heads":
        "TODO(m12): the attention half on t ranks: what this rank computes and saves",
    "TODO(m12): the FFN half: row-parallel o, residual + norm, column-parallel gate/up, SwiGLU, row-parallel down":
        "TODO(m12): the FFN half on t ranks: from the attention's partial output to the block's output",
    "TODO(m12): backward of the FFN half: down (row), SwiGLU, gate/up (column), residual + norm":
        "TODO(m12): backward of the FFN half on t ranks",
    "TODO(m12): backward of the attention half: o (row), attention, RoPE, q/k/v (column), norm":
        "TODO(m12): backward of the attention half on t ranks",
    "TODO(m12): the forward and the loss: embedding, blocks, final norm, LM head, vocabulary-parallel loss":
        "TODO(m12): the forward and the loss, every piece tensor-parallel",
    "TODO(m12): the backward: LM head, final norm, blocks in reverse, embedding, into self.grads":
        "TODO(m12): the backward of the whole model, into self.grads",
    "TODO(m12): zero the accumulators, accumulate the microbatches, sum the norm gradients, step":
        "TODO(m12): one optimizer step over the microbatches",
    "TODO(m12): row-parallel backward: leave's backward, then the two GEMMs":
        "TODO(m12): row-parallel backward: the two GEMMs, and what they need of dy",
    "TODO(m12): column-parallel forward: enter the TP region once, then one GEMM per weight":
        "TODO(m12): column-parallel forward: every weight's slice of y from one whole input",
    "TODO(m12): vocabulary-parallel embedding: look up the tokens this rank owns, zeros elsewhere, leave":
        "TODO(m12): vocabulary-parallel embedding: the lookup from this rank's rows",
    "TODO(m12): vocabulary-parallel embedding backward: leave's backward, then add dx into the owned rows":
        "TODO(m12): vocabulary-parallel embedding backward: the gradient of this rank's rows",
    "TODO(m11): run every action of this rank's list in order; wait for every send; return the loss":
        "TODO(m11): one step: this rank's whole list, every send completed, the loss",
    "TODO(m14): after the backward: refuse gradients that never came, wait for every bucket, re-arm":
        "TODO(m14): after the backward: every bucket summed and ready for the next backward, or a clear error",
    "TODO(m14): ZeRO-1 all-reduces the bucket; ZeRO-2 reduce-scatters it, one bucket in flight at a time":
        "TODO(m14): ZeRO's launch: stage 1 as DDP's; stage 2 only this rank's shard of the sum, one bucket in flight",
    "TODO(m14): the global norm from every rank's shards, then scale this rank's shards":
        "TODO(m14): clip by the global norm when each rank holds only its shards",
    "TODO(m14): the sharded step: gradients of the shards, clipping, AdamW on the shards, all-gather":
        "TODO(m14): the sharded step: every rank ends with every updated weight",
    "TODO(m07): complete the reduce-scatter in flight; add its slice to the gradient shard":
        "TODO(m07): settle the reduce-scatter in flight into the block's gradient shard",
    "TODO(m08): on the side stream, once the buffer is released: copy the block in, mark it ready":
        "TODO(m08): bring the block into its device buffer, in order with the compute, without the host waiting",
    "TODO(m08): make compute wait for the block's copy, and hand the block out":
        "TODO(m08): hand the block out for compute to read",
    "TODO(m08): mark the point after which the buffer may be overwritten, and free it":
        "TODO(m08): give the buffer back once the compute that reads it has been queued",
}


def module_todos(module: Module) -> list[TodoBlock]:
    """The module's TODOs in reading order (its files in catalog order, then line order)."""
    return [block for stem in module.files
            for block in todo_blocks((REPO / "solutions" / f"{stem}.py").read_text(), f"{stem}.py")]


class HintError(Exception):
    """A TODO that cannot be named that way (exit code 2), in one line."""


class HintRecordError(HintError):
    """The record of hints seen cannot be read or saved (exit code 1), in one line."""


def find(module: Module, which: str) -> tuple[int, TodoBlock]:
    """The TODO named by `which`, with its number: its number (from 1), its exact title (with or
    without the "TODO(m05): " tag) or the function holding it ("one_f_one_b", "LlamaBlock.backward"
    or just "backward") when it holds only that one. Anything else raises HintError."""
    todos = list(enumerate(module_todos(module), start=1))
    listed = f"`python main.py hint {module.number}` lists them"
    if which.isdigit():
        if 1 <= int(which) <= len(todos):
            return todos[int(which) - 1]
        raise HintError(f"module {module.number} has TODOs 1 to {len(todos)}, not {which}; {listed}")
    by_title = [(n, b) for n, b in todos if which.strip() in (b.title, _what(b))]
    by_function = [(n, b) for n, b in todos if which in (b.function, b.function.rsplit(".", 1)[-1])]
    if len(by_title) == 1 or len(by_function) == 1:
        return (by_title or by_function)[0]
    if by_function:
        raise HintError(f"{which} holds TODOs {', '.join(str(n) for n, _ in by_function)}: name one by its number")
    raise HintError(f"module {module.number} has no TODO {which!r}: give its number, its exact title or "
                    f"the function that holds it; {listed}")


def command(module: Module, which: str | None, show_all: bool) -> int:
    """What `python main.py hint` prints; returns the exit code."""
    todos = module_todos(module)
    if not todos:
        print(f"module {module.number} has no TODOs: it is given code")
        return 0
    try:
        return _command(module, todos, which, show_all)
    except HintError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1 if isinstance(exc, HintRecordError) else 2


def _command(module: Module, todos: list[TodoBlock], which: str | None, show_all: bool) -> int:
    if which is not None:
        number, block = find(module, which)  # refused before the record is read
    shown = load_shown()
    if which is None:
        print(f"Module {module.number}'s TODOs (`python main.py hint {module.number} N` shows the next level of TODO N):")
        for number, block in enumerate(todos, start=1):
            levels = f"{shown.get(block.title, 0)}/{len(block.hints)} hint levels seen"
            print(f"  {number:2d}  steps/{block.file} in {block.function}: {_what(block)}  ({levels})")
        return 0
    if not block.hints:
        print(f"TODO {number} ({_what(block)}) has no hints beyond what the skeleton says")
        return 0
    seen = shown.get(block.title, 0)
    levels = range(1, len(block.hints) + 1) if show_all else [min(seen + 1, len(block.hints))]
    print(f"TODO {number}, steps/{block.file} in {block.function}: {_what(block)}")
    for level in levels:
        print("\n".join(_strip_comment(line) for line in block.hints[level]))
    if not show_all and seen >= len(block.hints):
        print(f"(that was the last level; the chapter docs/{module.number}-*.md has the maths)")
    if levels[-1] > seen:
        shown[block.title] = levels[-1]
        _save_shown(shown)
    return 0


def hint_command_for(number: str, text: str) -> str | None:
    """The `python main.py hint` command for the TODO whose title `text` contains (an error that
    names it), or for the first TODO of the functions `text` lists ("forward_step, one_f_one_b", what
    a check exercises, likeliest culprit first); None if module `number` has no such TODO."""
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
    # One TODO, the likeliest culprit: a list of several sends the learner to read them all, and a
    # check that cannot tell its TODOs apart should compare each one's piece before the whole.
    return f"python main.py hint {number} {numbers[0]}" if numbers else None


@dataclass(frozen=True)
class HintsSeen:
    """How many of a module's TODOs the learner wrote with no hint seen, with hint 1 or 2 at most (the
    question, or the question and the maths), and with hint 3 (the code), by the record of hints seen."""
    without: int
    up_to_2: int
    with_3: int

    def __str__(self) -> str:
        """'11 of 14 TODOs without a hint, 2 with hint 1 or 2, 1 with hint 3': the highest level seen of
        each TODO (never "up to level 2", which would claim level 2 was seen where only level 1 was)."""
        total = self.without + self.up_to_2 + self.with_3
        more = [f"{self.up_to_2} with hint 1 or 2"] * bool(self.up_to_2) + \
               [f"{self.with_3} with hint 3"] * bool(self.with_3)
        return ", ".join([f"{self.without} of {total} TODOs without a hint", *more])

    def compact(self) -> str:
        """'11/2/1': `python main.py list`'s column, headed none/1-2/3."""
        return f"{self.without}/{self.up_to_2}/{self.with_3}"


def hints_seen(module: Module, shown: dict[str, int] | None = None) -> HintsSeen:
    """The module's TODOs counted by the highest hint level seen before `grade` first passed the module
    (after that the learner reads hints to compare, not to write), or until now if it has not (from the
    record, unless `shown` is given); HintRecordError if a record cannot be read."""
    at_pass = load_passed().get(module.number)
    if at_pass is None:
        at_pass = load_shown() if shown is None else shown
    levels = [at_pass.get(block.title, 0) for block in module_todos(module)]
    return HintsSeen(sum(level == 0 for level in levels), sum(1 <= level <= 2 for level in levels),
                     sum(level >= 3 for level in levels))


def what_was_derived(module: Module) -> str:
    """What `grade` adds to a passing module's total: how many TODOs were written without a hint (the
    levels seen until now are kept as those it was written with, if it had not passed before)."""
    try:
        passed = load_passed()
        if module.number not in passed:
            shown = load_shown()
            passed[module.number] = {block.title: shown[block.title] for block in module_todos(module)
                                     if shown.get(block.title)}
            try:
                _save(PASSED, passed, "which hints you had seen when the module passed")
            except HintRecordError:
                pass  # a read-only checkout: counted from the record of hints seen, as it stands now
        return str(hints_seen(module))
    except HintRecordError as exc:
        return f"which hints you saw is unknown: {exc}"


def _what(block: TodoBlock) -> str:
    return block.title.split(": ", 1)[1]


def _strip_comment(line: str) -> str:
    return "  " + re.sub(r"^\s*# ?", "", line)


def _read(path, what: str, shape: str, valid) -> dict:
    """The record in `path`: {} if there is none yet; HintRecordError if it cannot be read or `valid`
    refuses it (it is then left as it is)."""
    try:
        data = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):  # none yet
        return {}
    except OSError as exc:  # e.g. a folder of that name
        raise HintRecordError(f"the record of {what}, {path}, cannot be read ({exc.strerror or exc})") from None
    try:
        record = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        record = None  # refused below, like JSON that is not a record (bytes that are not UTF-8 are no JSON)
    if not (isinstance(record, dict) and valid(record)):
        raise HintRecordError(f"{path} is not a record of {what} ({shape}); it was left as it is: move it away to "
                              "start a new one")
    return record


def _levels(record) -> bool:
    return all(isinstance(title, str) and type(levels) is int and levels >= 0 for title, levels in record.items())


def _renamed(shown: dict[str, int]) -> dict[str, int]:
    for old, new in RENAMED_TITLES.items():
        if old in shown:
            shown[new] = max(shown.pop(old), shown.get(new, 0))
    return shown


def load_shown() -> dict[str, int]:
    """The record of hint levels seen: {} if there is none yet; HintError if it is not one."""
    return _renamed(_read(HINTS_SHOWN, "hints seen", '{"TODO(mNN): ...": levels seen}', _levels))


def load_passed() -> dict[str, dict[str, int]]:
    """The levels seen of each module `grade` has passed, when it first passed it: {} if none yet."""
    passed = _read(PASSED, "hints seen when a module passed", '{"NN": {"TODO(mNN): ...": levels seen}}',
                   lambda record: all(isinstance(levels, dict) and _levels(levels) for levels in record.values()))
    return {number: _renamed(levels) for number, levels in passed.items()}


def _save_shown(shown: dict[str, int]):
    _save(HINTS_SHOWN, shown, "which hint levels you have seen")


def _save(path, record: dict, what: str):
    """Write the record whole, then put it in place (os.replace): an interrupted save never
    leaves half a file, and the old record stays until the new one is complete."""
    text = json.dumps(record, indent=1, sort_keys=True) + "\n"
    partial = None
    try:
        fd, partial = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".partial")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(partial, path)
    except BaseException as exc:  # a read-only checkout (OSError), or Ctrl-C: no partial file left
        if partial and os.path.exists(partial):
            os.unlink(partial)
        if not isinstance(exc, OSError):
            raise
        raise HintRecordError(f"{what} could not be saved in {path} ({exc.strerror or exc})"
                              + (": the next call shows this level again" if path == HINTS_SHOWN else "")) from None