"""The layout calculator's data (given): module 18's plan for a few (model, GPU, GPU count) cases, computed
when the site is built, through the planner's own functions, so that the page repeats no formula.

For each case, the layouts offered are module 18's `candidates` (every mesh the model can run on that many
GPUs, every ZeRO stage, recompute option and FP8 choice), narrowed to a few schedules, one context variant and
1 or 4 sequences a microbatch, so that the data stay small. Each is costed as `python main.py plan` costs
it: `rank_cost` (memory by kind, bytes and calls by axis) and, if it fits the GPU, `step_time`. What the page
prints as the plan's row is `course/plan.py`'s `print_plan` itself, run on these layouts, and for a layout that
does not fit its `describe_miss`: the same text the command prints for that layout pinned (`plan_command`),
which the browser check runs and compares. Everything else is the planner's objects written out field by
field (`StepCost`'s dicts, `StepTime`'s fields), so the page follows the model when its fields change.

The page (static/calculator.js) loads `_static/calculator/index.js` (the cases) and one script per case and
mesh, `_static/calculator/CASE/MESH.js`: scripts, not JSON, so that it works from file://.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import json
import re
from dataclasses import dataclass
from pathlib import Path

from course.impl import reference

SCHEDULES = ("1f1b", "interleaved", "zbv")   # of module 11's: the classic, the looped, the zero-bubble V
SEQUENCES_PER_MICROBATCH = (1, 4)
CONTEXT_VARIANT = "allgather"                        # Llama 3's; `plan --cp` compares the others
MESH_AXES = ("p", "d", "c", "t", "e")
CHOICES = ("zero", "schedule", "m", "recompute", "fp8", "cp")  # a layout's fields besides its mesh


@dataclass(frozen=True)
class Case:
    model: str   # a key of m18_presets.MODELS
    gpu: str     # a key of m18_presets.GPUS
    gpus: int

    @property
    def key(self) -> str:
        return f"{self.model}-{self.gpus}x{self.gpu}"

    def title(self) -> str:
        presets = reference("m18_presets")
        return f"{presets.MODELS[self.model].name} on {self.gpus} x {presets.GPUS[self.gpu].name}"

    def arguments(self) -> list[str]:
        return ["--model", self.model, "--gpus", str(self.gpus), "--gpu", self.gpu]


CASES = (Case("llama3-8b", "h100", 8), Case("llama3-70b", "h200", 16), Case("mixtral-8x7b", "h200", 8))
SMALL = CASES[:1]   # the in-suite build's


def choice(layout, field: str):
    """A layout's value of one of CHOICES as the page and plan's options name it: ZeRO-2 reducing once a step is
    "2once", a layout apart from ZeRO-2 reducing every micro-step ("2")."""
    if field == "zero":
        return f"{layout.zero}{'once' * layout.reduce_once}"
    return getattr(layout, field)


def plan_command(case: Case, layout) -> list[str]:
    """The arguments of `python main.py plan` that pin every choice of `layout` (the reference's code)."""
    mesh = ",".join(f"{axis}={getattr(layout, axis)}" for axis in MESH_AXES)   # every axis, 1 too: e is searched
    pinned = case.arguments() + ["--mesh", mesh, "--zero", choice(layout, "zero"), "--microbatches",
                                 str(layout.m), "--recompute", layout.recompute, "--fp8", "on" if layout.fp8 else "off"]
    if layout.p > 1:
        pinned += ["--schedule", layout.schedule]
    if layout.c > 1:
        pinned += ["--cp", layout.cp]
    return pinned + ["--impl", "solutions"]


def offered(case: Case) -> list:
    """The layouts the page offers: the planner's candidates, narrowed (see the module docstring)."""
    presets, search = reference("m18_presets"), reference("m18_search")
    model, gpu = presets.MODELS[case.model], presets.GPUS[case.gpu]
    return [layout for layout in search.candidates(model, case.gpus, model.batch, gpu, {"cp": CONTEXT_VARIANT})
            if layout.schedule in ("none", *SCHEDULES)
            and model.batch // (layout.d * layout.m) in SEQUENCES_PER_MICROBATCH]


@functools.lru_cache(maxsize=None)
def costed(case: Case) -> tuple:
    """Every offered layout as the search costs it: a Planned with its time if it fits the GPU, else None."""
    presets, search = reference("m18_presets"), reference("m18_search")
    costs, layouts, step_time = reference("m18_costs"), reference("m18_layout"), reference("m18_step_time")
    model, gpu = presets.MODELS[case.model], presets.GPUS[case.gpu]
    out = []
    for layout in offered(case):
        planned = search.Planned(layout, costs.rank_cost(model, layout, model.batch, layouts.MIXED))
        if planned.memory <= budget(case):
            planned.time = step_time.step_time(model, layout, model.batch, gpu, planned.cost, step_time.TimeModel())
        out.append(planned)
    return tuple(out)


def budget(case: Case) -> float:
    """The memory a layout may keep on one GPU: what the search allows (all but its RESERVE)."""
    gpu = reference("m18_presets").GPUS[case.gpu]
    return (1 - reference("m18_search").RESERVE) * gpu.memory


def fastest(case: Case, n: int, one_per_mesh: bool = False) -> list:
    """The n fastest offered layouts that fit, ordered as the plan orders its rows (by step time, then memory);
    with one_per_mesh, only the fastest of each mesh."""
    ranked = sorted((q for q in costed(case) if q.time is not None), key=lambda q: (q.time.step, q.memory))
    if one_per_mesh:
        seen = set()
        ranked = [q for q in ranked if not (mesh_key(q.layout) in seen or seen.add(mesh_key(q.layout)))]
    return ranked[:n]


def axes_on_the_path() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the axes whose collectives the step waits for, those that run behind the compute): module 18's."""
    step_time = reference("m18_step_time")
    return tuple(step_time.EXPOSED_AXES), tuple(step_time.HIDDEN_AXES)


def printed_plan(case: Case, fits: list) -> tuple[list[str], str, list[str]]:
    """What `python main.py plan` prints for these layouts, as (the lines above the table, the table's header,
    each layout's row), the rank column left out: course/plan.py's print_plan, captured."""
    presets, search, step_time = reference("m18_presets"), reference("m18_search"), reference("m18_step_time")
    from course import plan

    model, gpu = presets.MODELS[case.model], presets.GPUS[case.gpu]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        plan.print_plan(model, gpu, case.gpus, model.batch, search.Plan(list(fits), None, len(fits)), step_time,
                        step_time.TimeModel(), len(fits))
    lines = printed.getvalue().splitlines()
    at = next(i for i, line in enumerate(lines) if re.match(r"\s*#\s", line))
    rows = [re.sub(r"^\s*\d+\s\s", "", line) for line in lines[at + 1:at + 1 + len(fits)]]
    # the counts of the search ("N layouts costed, M fit") are not this page's: the page gives its own
    notes = [re.sub(r";?\s*\d+ layouts costed.*$", "", line) for line in lines[:at] + lines[at + 1 + len(fits):]]
    return notes, re.sub(r"^\s*#\s\s", "", lines[at]), rows


def missed(case: Case, planned) -> str:
    """What the command prints for a pinned layout that does not fit (course/plan.py's describe_miss)."""
    from course import plan

    return f"error: {plan.describe_miss(planned, budget(case))}"


def plain(value):
    """A planner's value as JSON: dataclasses field by field, tuples as lists, dict keys as strings."""
    if dataclasses.is_dataclass(value):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {" ".join(k) if isinstance(k, tuple) else str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def by_axis(entries: dict) -> dict[str, float]:
    """StepCost's {(axis, collective): n} summed per axis."""
    out = {}
    for (axis, _), n in entries.items():
        out[axis] = out.get(axis, 0) + n
    return out


def mesh_name(layout) -> str:
    return " ".join(f"{axis}={getattr(layout, axis)}" for axis in MESH_AXES if getattr(layout, axis) > 1) or "one GPU"


def mesh_key(layout) -> str:
    return "-".join(f"{axis}{getattr(layout, axis)}" for axis in MESH_AXES)


def rounded(value):
    """Seconds and fractions to 6 significant digits for the page's charts (the plan's row holds its printed
    numbers whole); integers (bytes) as they are."""
    if isinstance(value, float):
        return float(f"{value:.6g}")
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v) for v in value]
    return value


def case_data(case: Case) -> tuple[dict, dict[str, list]]:
    """The case's summary (for index.js) and its layouts by mesh (one script each). A layout is a list:
    the values of CHOICES, its name (str(layout)), memory by kind (bytes), bytes sent and calls by axis, its
    StepTime field by field (None if it does not fit), the rest of its plan row after the name (None if it does
    not fit), and what the command prints if it does not fit, "{layout}" standing for its name."""
    presets = reference("m18_presets")
    model, gpu = presets.MODELS[case.model], presets.GPUS[case.gpu]
    planned = costed(case)
    fits = [q for q in planned if q.time is not None]
    above, header, rows = printed_plan(case, fits)
    row_of = {id(q): row for q, row in zip(fits, rows)}
    meshes, names = {}, {}
    for q in planned:
        name, row = str(q.layout), row_of.get(id(q))
        if row is not None and not row.startswith(name):
            raise ValueError(f"the plan's row {row!r} does not start with its layout {name!r}")
        key = mesh_key(q.layout)
        names[key] = mesh_name(q.layout)
        meshes.setdefault(key, []).append([
            [choice(q.layout, field) for field in CHOICES], name, plain(q.cost.memory), by_axis(q.cost.sent),
            by_axis(q.cost.calls), rounded(plain(q.time)), None if row is None else row[len(name):],
            None if q.time is not None else missed(case, q).replace(name, "{layout}")])
    exposed, hidden = axes_on_the_path()
    summary = {"key": case.key, "title": case.title(), "arguments": case.arguments(), "above": above,
               "header": header, "gpu_memory": gpu.memory, "budget": budget(case), "exposed": exposed,
               "hidden": hidden, "choices": CHOICES, "meshes": [{"key": k, "name": names[k], "layouts": len(v)}
                                                                for k, v in meshes.items()],
               "fastest": [{"mesh": mesh_key(q.layout), "name": str(q.layout)}
                           for q in fastest(case, 10, one_per_mesh=True)],
               "costed": len(planned), "fit": len(fits)}
    return summary, meshes


def write_calculator_data(folder: Path, cases=CASES) -> list[str]:
    """Write index.js and CASE/MESH.js for every case into `folder`; return the cases' keys."""
    folder.mkdir(parents=True, exist_ok=True)
    summaries = []
    for case in cases:
        summary, meshes = case_data(case)
        (folder / case.key).mkdir(exist_ok=True)
        for key, layouts in meshes.items():
            text = json.dumps(layouts, separators=(",", ":"))
            (folder / case.key / f"{key}.js").write_text(
                f"CALCULATOR.layouts[{json.dumps(case.key + '/' + key)}] = {text};\n")
        summaries.append(summary)
    (folder / "index.js").write_text("window.CALCULATOR = {layouts: {}};\nCALCULATOR.cases = "
                                     f"{json.dumps(summaries, separators=(',', ':'))};\n")
    return [case.key for case in cases]
