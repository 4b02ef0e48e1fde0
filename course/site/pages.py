"""The site's Markdown, as build.py stages it (given): the home page and the chapters and notebooks as they are,
with their backticked names of other pages made links to them.

The navigation follows README.md's tracks (its bullets "**Pipeline track (modules 00-05, 11).**") in the
order of course/catalog.py; every chapter has its notebook under it. A module in no track is listed after
them, under "More modules".
"""
from __future__ import annotations

import re
from pathlib import Path

from course import REPO
from course.catalog import MODULES

TRACK = re.compile(r"^- \*\*(?P<name>[^*(]+?) track \(modules (?P<modules>[\d ,-]+)\)\.\*\*(?P<text>.*(?:\n  .*)*)", re.M)
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
PAGE_SPAN = re.compile(r"(?<!\[)`((?:docs|notebooks)/[\w.-]+\.(?:md|ipynb))`")
EXPLORER_CHAPTERS = ("05", "11")  # the chapters whose schedules the explorer draws
CALCULATOR_CHAPTERS = ("07", "13", "14", "17", "18")  # the chapters whose choices the layout calculator costs
HARDWARE_CHAPTERS = ("03", "09", "18")  # the chapters whose numbers the hardware page sources


def tracks(readme: str) -> list[tuple[str, list[str], str]]:
    """README.md's tracks: (name, module numbers, what the bullet says)."""
    found = []
    for match in TRACK.finditer(readme):
        numbers = []
        for part in match["modules"].split(","):
            first, _, last = part.strip().partition("-")
            numbers += [f"{n:02d}" for n in range(int(first), int(last or first) + 1)]
        found.append((match["name"].strip(), numbers, " ".join(match["text"].split())))
    return found


def title(page: Path) -> str:
    """A chapter's or notebook's first heading, as the navigation shows it."""
    if page.suffix == ".ipynb":
        import nbformat

        text = "".join(nbformat.read(page, as_version=4).cells[0].source)
    else:
        text = page.read_text()
    heading = re.search(r"^# (.+)$", text, re.M)
    return heading[1].strip() if heading else page.stem


def link_pages(markdown: str, here: str, staged: set[str]) -> str:
    """Make `docs/X.md` and `notebooks/Y.ipynb`, named in code outside fenced blocks, links to those pages
    (those that are staged: `staged` holds their repository paths) from a page in folder `here`."""
    def link(match):
        path = match[1]
        if path not in staged:
            return match[0]
        folder, name = path.split("/")
        return f"[`{path}`]({name if folder == here else f'../{folder}/{name}'})"
    parts, last = [], 0
    for fence in FENCE.finditer(markdown):
        parts += [PAGE_SPAN.sub(link, markdown[last:fence.start()]), fence[0]]
        last = fence.end()
    return "".join(parts + [PAGE_SPAN.sub(link, markdown[last:])])


def chapter_page(chapter: Path, notebook: Path | None, staged: set[str]) -> str:
    """The chapter, its page links made, then what goes with it: its notebook (also under it in the
    navigation) and, for the schedules' chapters, the explorer."""
    text = link_pages(chapter.read_text(), "docs", staged).rstrip() + "\n"
    extra = []
    if notebook is not None:
        extra.append(f"- The notebook: [{title(notebook)}](../notebooks/{notebook.name}), executed, with its plots.")
    if chapter.name[:2] in EXPLORER_CHAPTERS:
        extra.append("- The [schedule explorer](../explorer.md): any schedule of module 11 at any p, m, v and "
                     "costs of its grid, and the [timelines](../timelines.md) of all of them at p = 4, m = 8.")
    if chapter.name[:2] in CALCULATOR_CHAPTERS:
        extra.append("- The [layout calculator](../calculator.md): module 18's plan of real models on real GPUs, "
                     "for any mesh, ZeRO stage, recompute option, FP8 choice, m and schedule it costs.")
    if chapter.name[:2] in HARDWARE_CHAPTERS:
        extra.append("- The [hardware page](../hardware.md): the GPUs and links the costs assume, with their "
                     "sources, and a roofline of each GPU.")
    if extra:
        text += "\n---\n\n**On this site:**\n\n" + "\n".join(extra) + "\n"
    if notebook is not None:
        text += f"\n```{{toctree}}\n:hidden:\n\n/notebooks/{notebook.stem}\n```\n"
    return text


def home_page(chapters: dict[str, Path], notebooks: dict[str, Path]) -> str:
    """index.md: what the course is, its tracks, the syllabus, and the navigation's table of contents."""
    readme = (REPO / "README.md").read_text()
    intro = readme.split("\n\n")[1].strip()
    lines = ["# Distributed LLM training, built by hand", "", intro, "",
             "The chapters are the course's `docs/`, the notebooks its `notebooks/` with the outputs of a run "
             "on CPU. The [schedule explorer](explorer.md) shows every schedule of module 11 as the course's "
             "simulator times it, the [layout calculator](calculator.md) what module 18's plan predicts for a "
             "real model on real GPUs, the [hardware page](hardware.md) the GPUs and links it assumes; the "
             "[glossary](docs/glossary.md) names every quantity. To take the course, "
             "clone it and run `pip install -r requirements.txt && python main.py`.", ""]
    toctrees, placed = [], set()
    for name, numbers, text in tracks(readme):
        numbers = [n for n in MODULES if n in numbers and n in chapters]
        placed |= set(numbers)
        lines += [f"## {name} track", "", text, ""]
        for n in numbers:
            notebook = f" (and its [notebook](notebooks/{notebooks[n].name}))" if n in notebooks else ""
            lines.append(f"- [{title(chapters[n])}](docs/{chapters[n].name}){notebook}")
        lines.append("")
        toctrees.append((f"{name} track", numbers))
    rest = [n for n in MODULES if n in chapters and n not in placed]
    if rest:
        toctrees.append(("More modules", rest))
    lines += ["## Syllabus", "", "| module | chapter | notebook |", "| --- | --- | --- |"]
    for number, module in MODULES.items():
        chapter = f"[{module.title}](docs/{chapters[number].name})" if number in chapters else module.title
        notebook = f"[{notebooks[number].stem}](notebooks/{notebooks[number].name})" if number in notebooks else ""
        lines.append(f"| {number} | {chapter} | {notebook} |")
    lines.append("")
    for caption, numbers in toctrees:
        entries = "\n".join(f"docs/{chapters[n].stem}" for n in numbers)
        lines += ["```{toctree}", f":caption: {caption}", ":hidden:", "", entries, "```", ""]
    lines += ["```{toctree}", ":caption: Explore", ":hidden:", "", "explorer", "timelines", "calculator", "hardware",
              "docs/glossary", "```", ""]
    return "\n".join(lines)
