"""Generate the learner's skeletons in steps/ from the reference code in solutions/.

solutions/ is the one source of truth. A solution block is written between two markers:

    # >>> TODO(m04): build this rank's layers
    # The contract, the question, the maths and the pitfalls: what the skeleton shows.
    # Hint 1: a question that points at the principle and the chapter's section.
    # Hint 2: the maths (no code); a hint's longer text goes on
    #         in comment lines indented under it.
    # Hint 3: pseudo-code or code.
    ...reference code...
    # <<<

In steps/ the block becomes its title and visible comment lines followed by
`raise NotImplementedError("TODO(m04): build this rank's layers")`, at the marker's indentation,
so an unfinished TODO fails at once (and never leaves a peer rank waiting). The `Hint N:` levels
stay out of the skeleton: `python main.py hint NN` shows them one at a time (course/hints.py).
Everything outside the markers is copied unchanged. The header of each skeleton records a fingerprint of the text
generated, so a test can tell that steps/ is up to date with solutions/ without comparing the
learner's code line by line.

A steps/ file is rewritten only when its text proves the generator wrote it and nobody edited it
since: it is the skeleton solutions/ generates now, or its first two lines are exactly a generated
header and the rest of the file hashes to the fingerprint in that header (an older skeleton,
untouched). Anything else holds a learner's work, whatever was added, removed or changed, and
wherever: it is kept, and named. A steps/ file with no counterpart in solutions/ is never deleted
(named too), and a missing one is generated.

    python -m course.skeleton          # write every missing or untouched skeleton; keep and name the rest
    python -m course.skeleton --force  # also overwrite every steps/ file that has a solutions/ file of the
                                       # same name, a learner's edits in it included (a learner's extra
                                       # files are still never deleted)
    python -m course.skeleton --check  # exit 1 if steps/ differs from what would be generated
"""
from __future__ import annotations

import ast
import hashlib
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from course import REPO

# The TODO marker format, defined here once: a tag names the module that owns a TODO.
TODO_TAG = r"TODO\((?P<module>m\d\d)\)"
BEGIN = re.compile(rf"^(?P<indent>\s*)# >>> (?P<title>{TODO_TAG}: .+)$")
END = re.compile(r"^\s*# <<<\s*$")
RAISED_TODO = re.compile(rf"raise NotImplementedError\(['\"]{TODO_TAG}")  # an unfinished TODO in steps/
HINT = re.compile(r"^\s*# Hint (?P<level>[1-9]): ")   # a level of help on request
CONTINUATION = re.compile(r"^\s*#\s{2,}\S")         # a comment line indented under the one before
HEADER = ("# Generated from solutions/{name} by `python -m course.skeleton`: fill in the TODOs.\n"
          "# Grade your work with `python main.py grade {number}`. (skeleton {fingerprint})\n")
GIVEN_HEADER = ("# Generated from solutions/{name} by `python -m course.skeleton`. Given code: nothing\n"
                "# to fill in here; read it, then run it with `python main.py run {number}`. (skeleton {fingerprint})\n")
FINGERPRINT = re.compile(r"\(skeleton [0-9a-f]{12}\)")  # in the header: which generated text this is


class MarkerError(ValueError):
    pass


def todo_owner(text: str) -> str | None:
    """'06' for an error message or line that names TODO(m06), else None."""
    tag = re.search(TODO_TAG, text)
    return tag["module"][1:] if tag else None


def count_todos(text: str) -> int:
    """How many unfinished TODOs (raises) a steps/ file still has."""
    return len(RAISED_TODO.findall(text))


def has_solution_blocks(text: str) -> bool:
    """Whether a solutions/ file has anything for a learner to fill in."""
    return any(BEGIN.match(line) for line in text.splitlines())


@dataclass
class TodoBlock:
    """One solution block of a solutions/ file, as the generator and `python main.py hint` read it."""
    title: str                 # "TODO(m05): warm up with ..."
    file: str                  # "m05_schedules.py"
    line: int                  # the marker's line in solutions/
    function: str              # the def that holds it, e.g. "LlamaBlock.backward"
    indent: str
    visible: list[str] = field(default_factory=list)         # comment lines the skeleton keeps
    hints: dict[int, list[str]] = field(default_factory=dict)  # level -> its comment lines
    solution: list[str] = field(default_factory=list)        # the reference code
    end: int = 0               # the line of its closing marker


def todo_blocks(source: str, filename: str = "<source>") -> list[TodoBlock]:
    """The solution blocks of `source`, in order; MarkerError for markers that do not pair up."""
    blocks, block, in_header, level = [], None, False, None
    module = re.match(r"m\d\d", Path(filename).name)
    for lineno, line in enumerate(source.splitlines(), start=1):
        begin, end = BEGIN.match(line), END.match(line)
        if begin:
            if block is not None:
                raise MarkerError(f"{filename}:{lineno}: a TODO block opens inside another one")
            if module and begin["module"] != module.group(0):
                raise MarkerError(f"{filename}:{lineno}: {begin['module']} marker in a {module.group(0)} file")
            block = TodoBlock(begin["title"], Path(filename).name, lineno, "", begin["indent"])
            in_header, level = True, None
        elif end:
            if block is None:
                raise MarkerError(f"{filename}:{lineno}: '# <<<' without an opening '# >>> TODO(...)'")
            block.end = lineno
            blocks.append(block)
            block = None
        elif block is not None:
            # The comments that open the block are its header; the reference code follows them.
            in_header = in_header and line.lstrip().startswith("#")
            hint = HINT.match(line)
            if not in_header:
                block.solution.append(line)
            elif hint:
                level = int(hint["level"])
                block.hints.setdefault(level, []).append(line)
            elif level is not None and CONTINUATION.match(line):
                block.hints[level].append(line)
            else:
                level = None
                block.visible.append(line)
    if block is not None:
        raise MarkerError(f"{filename}: TODO block '{block.title}' is never closed with '# <<<'")
    _name_enclosing_functions(blocks, source)
    return blocks


def _name_enclosing_functions(blocks: list[TodoBlock], source: str):
    """Set each block's `function`: the innermost def around its marker ("Class.method" in a class)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return  # a fragment (the generator's own tests): no functions to name
    spans = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    spans.append((child.lineno, child.end_lineno, name))
                visit(child, name + ".")
    visit(tree, "")
    for block in blocks:
        around = [s for s in spans if s[0] < block.line <= s[1]]
        block.function = max(around, key=lambda s: s[0])[2] if around else "<module>"


def skeletonize(source: str, filename: str = "<source>") -> str:
    """Replace every solution block in `source` with its title, its visible comments and a raise."""
    lines = source.splitlines(keepends=True)
    out, start = [], 1
    for block in todo_blocks(source, filename):
        out += lines[start - 1:block.line - 1]
        out.append(f"{block.indent}# {block.title}\n")
        out += [line + "\n" for line in block.visible]
        out.append(f"{block.indent}raise NotImplementedError({block.title!r})\n")
        start = block.end + 1
    out += lines[start - 1:]
    return "".join(out)


def skeleton_file(source: str, name: str) -> str:
    """The steps/ file for solutions/`name`: its skeleton under a header (modules' files only)."""
    text = skeletonize(source, name)
    number = name[1:3] if re.match(r"m\d\d_", name) else None
    if number is None:
        return text
    header = HEADER if text != source else GIVEN_HEADER
    fingerprint = hashlib.sha256(text.encode()).hexdigest()[:12]
    return header.format(name=name, number=number, fingerprint=fingerprint) + text


def generate(solutions: Path = REPO / "solutions") -> dict[str, str]:
    """File name -> skeleton text, for every Python file in solutions/."""
    return {path.name: skeleton_file(path.read_text(), path.name) for path in sorted(solutions.glob("*.py"))}


def generated_unchanged(text: str, name: str, generated: str | None) -> bool:
    """Whether `text`, the steps/ file `name`, is provably the generator's output, untouched: the
    skeleton it generates now (`generated`), or an older one whose whole text checks out: its two
    header lines exactly a generated header for this file, the rest the text its fingerprint hashes."""
    if text == generated:
        return True
    first, second, body = (text.split("\n", 2) + ["", ""])[:3]
    recorded = FINGERPRINT.search(second)
    if recorded is None or not re.match(r"m\d\d_", name):
        return False
    fingerprint = recorded[0][len("(skeleton "):-1]
    headers = {h.format(name=name, number=name[1:3], fingerprint=fingerprint) for h in (HEADER, GIVEN_HEADER)}
    return f"{first}\n{second}\n" in headers and hashlib.sha256(body.encode()).hexdigest()[:12] == fingerprint


@dataclass
class Regenerated:
    """What `write` did to each steps/ file it did not leave as it was."""
    written: list[str] = field(default_factory=list)       # created, or an untouched skeleton replaced
    overwritten: list[str] = field(default_factory=list)   # held edits, replaced because of --force
    kept: dict[str, str] = field(default_factory=dict)     # name -> why it was left as it is


def write(steps: Path = REPO / "steps", force: bool = False) -> Regenerated:
    """Bring `steps` up to date with solutions/ without losing a learner's work: see the module's
    docstring. Files that are already what would be generated are not touched (a read-only checkout
    that is up to date needs no write). OSError if a file cannot be written."""
    steps.mkdir(exist_ok=True)
    generated = generate()
    done = Regenerated()
    for path in sorted(steps.glob("*.py")):
        if path.name not in generated:
            done.kept[path.name] = "not generated from solutions/ (no solutions/ file of that name)"
    for name, text in generated.items():
        path = steps / name
        on_disk = path.read_text() if path.exists() else None
        if on_disk == text:
            continue
        if on_disk is None or generated_unchanged(on_disk, name, text):
            done.written.append(name)
        elif force:
            done.overwritten.append(name)
        elif re.match(r"m\d\d_", name):
            done.kept[name] = ("it holds your work: it is not a skeleton the generator wrote, untouched "
                               "(--force overwrites it with the new skeleton)")
            continue
        else:  # a file without a header (steps/__init__.py): nothing proves the generator wrote it
            done.kept[name] = (f"it differs from solutions/{name} and has no header to prove the generator "
                               "wrote it (--force overwrites it)")
            continue
        path.write_text(text)
    return done


def main(argv: list[str], steps: Path = REPO / "steps") -> int:
    if argv == ["--check"]:
        generated = generate()
        on_disk = {p.name: p.read_text() for p in steps.glob("*.py")}
        stale = sorted(n for n in set(generated) | set(on_disk) if generated.get(n) != on_disk.get(n))
        for name in stale:
            print(f"steps/{name} is out of date with solutions/")
        return 1 if stale else 0
    if argv in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if argv not in ([], ["--force"]):  # one line, exit code 2, as main.py's (the docstring says the rest)
        print(f"error: unrecognized arguments: {' '.join(argv)}; usage: python -m course.skeleton [--force | --check]",
              file=sys.stderr)
        return 2
    try:
        done = write(steps, force=argv == ["--force"])
    except OSError as error:  # a read-only checkout, a full disk: one line that says which file, no traceback
        where = f"{error.filename}: " if error.filename else ""
        print(f"error: steps/ was not brought up to date: {where}{error.strerror or error}")
        return 1
    for name in done.written:
        print(f"wrote steps/{name}")
    for name in done.overwritten:
        print(f"overwrote steps/{name} (--force): the edits it held are gone")
    for name, why in done.kept.items():
        print(f"kept steps/{name}: {why}")
    if not (done.written or done.overwritten or done.kept):
        print(f"steps/ is up to date with solutions/ ({len(generate())} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
