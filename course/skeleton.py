"""Generate the learner's skeletons in steps/ from the reference code in solutions/.

solutions/ is the one source of truth. A solution block is written between two markers:

    # >>> TODO(m04): build this rank's layers
    # Hint: every rank builds every layer in order, so the random stream matches the monolith.
    ...reference code...
    # <<<

In steps/ the block becomes its comment lines followed by
`raise NotImplementedError("TODO(m04): build this rank's layers")`, at the marker's indentation,
so an unfinished TODO fails at once (and never leaves a peer rank waiting). Everything outside
the markers is copied unchanged. The header of each skeleton records a fingerprint of the text
generated, so a test can tell that steps/ is up to date with solutions/ without comparing the
learner's code line by line.

    python -m course.skeleton          # rewrite steps/ (maintainers; overwrites learners' edits)
    python -m course.skeleton --check  # exit 1 if steps/ differs from what would be generated
"""
from __future__ import annotations

import hashlib
import re
import sys
from pathlib import Path

from course import REPO

# The TODO marker format, defined here once: a tag names the module that owns a TODO.
TODO_TAG = r"TODO\((?P<module>m\d\d)\)"
BEGIN = re.compile(rf"^(?P<indent>\s*)# >>> (?P<title>{TODO_TAG}: .+)$")
END = re.compile(r"^\s*# <<<\s*$")
RAISED_TODO = re.compile(rf"raise NotImplementedError\(['\"]{TODO_TAG}")  # an unfinished TODO in steps/
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


def skeletonize(source: str, filename: str = "<source>") -> str:
    """Replace every solution block in `source` with its TODO comments and a raise."""
    out, block, in_hints = [], None, False
    module = re.match(r"m\d\d", Path(filename).name)
    for lineno, line in enumerate(source.splitlines(keepends=True), start=1):
        begin, end = BEGIN.match(line.rstrip("\n")), END.match(line)
        if begin:
            if block is not None:
                raise MarkerError(f"{filename}:{lineno}: a TODO block opens inside another one")
            if module and begin["module"] != module.group(0):
                raise MarkerError(f"{filename}:{lineno}: {begin['module']} marker in a {module.group(0)} file")
            block, in_hints = begin, True
            out.append(f"{begin['indent']}# {begin['title']}\n")
        elif end:
            if block is None:
                raise MarkerError(f"{filename}:{lineno}: '# <<<' without an opening '# >>> TODO(...)'")
            out.append(f"{block['indent']}raise NotImplementedError({block['title']!r})\n")
            block = None
        elif block is not None:
            # Keep the hint comments that open the block; drop the reference code after them.
            in_hints = in_hints and line.lstrip().startswith("#")
            if in_hints:
                out.append(line)
        else:
            out.append(line)
    if block is not None:
        raise MarkerError(f"{filename}: TODO block '{block['title']}' is never closed with '# <<<'")
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


def write(steps: Path = REPO / "steps") -> list[str]:
    steps.mkdir(exist_ok=True)
    generated = generate()
    for stale in set(p.name for p in steps.glob("*.py")) - set(generated):
        (steps / stale).unlink()
    for name, text in generated.items():
        (steps / name).write_text(text)
    return sorted(generated)


def main(argv: list[str]) -> int:
    if argv == ["--check"]:
        generated = generate()
        on_disk = {p.name: p.read_text() for p in (REPO / "steps").glob("*.py")}
        stale = sorted(n for n in set(generated) | set(on_disk) if generated.get(n) != on_disk.get(n))
        for name in stale:
            print(f"steps/{name} is out of date with solutions/")
        return 1 if stale else 0
    if argv:
        print(__doc__)
        return 2
    for name in write():
        print(f"wrote steps/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
