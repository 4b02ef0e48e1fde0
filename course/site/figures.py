"""The chapters' figures: which chapter shows which figure, and the code that draws it (given).

`FIGURES` is the manifest. Each row names a chapter, the figure's file and the function of
course/site/drawings.py that draws it, from what (the course's code, its saved GPU tables). The build draws
every figure into the staged site's `figures/` folder (`write_figures`); a chapter shows its figure with one
MyST directive at the place it explains:

    ```{figure} /figures/05-bubble.png
    :name: fig-05-bubble

    One sentence that says what the figure shows.
    ```

The test suite checks that every chapter names exactly its figures of the manifest (`named_figures`), and the
browser check that each is drawn on the chapter's page.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from course.site import drawings


@dataclass(frozen=True)
class ChapterFigure:
    chapter: str   # the module number: docs/NN-*.md shows it
    name: str      # the file, figures/NAME.png, and the directive's :name: fig-NAME
    draw: str      # the function of course/site/drawings.py that draws it
    reads: str     # what it is computed from


FIGURES = (
    ChapterFigure("03", "03-alpha-beta", "alpha_beta", "module 18's presets and TimeModel: α and β of real links"),
    ChapterFigure("04", "04-relay", "relay", "course/simulate.py: GPipe with one microbatch on 8 ranks"),
    ChapterFigure("05", "05-bubble", "bubble", "course/simulate.py: GPipe and 1F1B, p = 3, m = 6"),
    ChapterFigure("06", "06-attention-memory", "attention_memory", "module 06's ATTENTION_CHUNK, Llama 3 8B's shape"),
    ChapterFigure("07", "07-prefetch", "fsdp_prefetch",
                  "module 07's FSDPLlama's calls on a group of one, timed with module 18's time model"),
    ChapterFigure("08", "08-overlap", "stream_overlap",
                  "module 08's HostWeights on course/streams.py's recorder, timed with bench-08-gpu.json"),
    ChapterFigure("09", "09-fp8-speedup", "fp8_speedup", "notebooks/data/bench-09-gpu.json (H200)"),
    ChapterFigure("10", "10-recompute", "recompute_memory",
                  "module 10's activation_bytes and DROPPED; notebooks/data/bench-10-gpu.json (H200)"),
    ChapterFigure("11", "11-zero-bubble", "zero_bubble", "course/simulate.py: 1F1B, ZB-H1, ZB-V, p = 3, m = 6"),
    ChapterFigure("12", "12-sequence-parallel", "sequence_parallel", "module 12's tp_activations_by_name, Llama 3 70B"),
    ChapterFigure("13", "13-mesh-costs", "mesh_costs", "module 13's state_bytes, block_activation_bytes, step_traffic"),
    ChapterFigure("14", "14-buckets", "bucket_timeline",
                  "module 14's assign_buckets on module 18's rank_parameters of Llama 3 8B, timed with its time model"),
    ChapterFigure("15", "15-ring-balance", "ring_balance", "module 15's SequenceLayout, c = 3, T = 48"),
    ChapterFigure("16", "16-expert-exchange", "expert_exchange", "module 16's route and plan_dispatch, e = 4"),
    ChapterFigure("17", "17-mesh-groups", "mesh_groups", "course/mesh.py's index_of, p = d = c = t = 2"),
    ChapterFigure("18", "18-step-time", "step_time_parts",
                  "module 18's step_time on the layout calculator's Llama 3 70B case"),
)

DIRECTIVE = re.compile(r"^```\{figure\} /figures/([\w.-]+)\.png\s*$", re.M)


def of_chapter(number: str) -> list[ChapterFigure]:
    return [f for f in FIGURES if f.chapter == number]


def named_figures(chapter_text: str) -> list[str]:
    """The figures a chapter's directives show, in its order."""
    return DIRECTIVE.findall(chapter_text)


def write_figures(folder: Path) -> list[Path]:
    """Draw every figure of the manifest into `folder`; return the files."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for figure in FIGURES:
        path = folder / f"{figure.name}.png"
        getattr(drawings, figure.draw)(path)
        written.append(path)
    return written
