"""The schedule explorer's data (given): every schedule of module 11, simulated over a grid at build time.

The schedules are the reference's generators (`SCHEDULES` in solutions/m11_generators.py, whatever it
holds); course/simulate.py times each one for every p, m, v and costs τ_F, τ_I, τ_W of the grid. The page
(static/explorer.js) only draws what is here: one script per schedule, `_static/explorer/NAME.js`, which
sets `EXPLORER.schedules[NAME]`, plus `index.js`, which sets `EXPLORER.index`: the grid and the list. Scripts, not JSON: a page
opened from file:// may load a script but not fetch a file.

For a run, the data hold each action's start (it ends τ later), every rank's idle time, the bubble
(exact, as a fraction) and the closed forms of solutions/m11_generators.py (`idle_per_rank`,
`bubble_formula`), or the reason they do not hold there.
"""
from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from course.impl import reference
from course.simulate import Costs, simulate_schedule


@dataclass(frozen=True)
class Grid:
    p: tuple[int, ...] = (2, 3, 4, 6, 8)
    m: tuple[int, ...] = tuple(range(1, 17))
    v: tuple[int, ...] = (2, 3, 4)       # for the schedules whose stages per rank can be chosen
    costs: tuple[int, ...] = (1, 2)      # each of τ_F, τ_I, τ_W, in units


SMALL = Grid(p=(2, 4), m=(1, 4, 8), v=(2,), costs=(1,))  # the in-suite build's: every page, little data
DEFAULT = {"schedule": "zbv", "p": 4, "m": 8, "v": 2, "F": 1, "I": 1, "W": 1}

# The closed forms of idle_per_rank as formulas, for the page to typeset: p ranks, costs F, I, W and B = I + W.
# Each is checked against idle_per_rank on the whole grid when the data are made; a schedule without one
# here (or whose form no longer agrees) shows only the closed form's value.
IDLE_FORMS = {
    "gpipe": "(p-1)*(F+B)",
    "1f1b": "(p-1)*(F+B)",
    "interleaved": "(p-1)*(F+B)",
    "zbh1": "(p-1)*max(F+I-W, F, I)",
    "zbv": "(p-1)*F",
    "dualpipev": "(p-1)*(F+I-W)",
}


def tex(form: str) -> str:
    """An IDLE_FORMS formula in TeX: (p-1)*(F+B) -> (p-1)(\\tau_F+\\tau_B)."""
    return re.sub(r"\b([FIWB])\b", r"\\tau_\1", form.replace("*", "").replace("max", r"\max"))


def number(x: Fraction):
    """A time for the page: an int where it is one (always, with whole costs), else a float."""
    return int(x) if x.denominator == 1 else float(x)


def takes_v(generators, name: str) -> bool:
    """Whether `name`'s stages per rank can be chosen (interleaved's v), or are fixed by the schedule."""
    return generators.stages_per_rank_of(name, 3) != generators.stages_per_rank_of(name, 2)


def configurations(generators, name: str, grid: Grid):
    """(p, m, v) over the grid: v from the grid if the schedule takes one, else its own stages per rank."""
    vs = grid.v if takes_v(generators, name) else (generators.stages_per_rank_of(name),)
    return itertools.product(grid.p, grid.m, vs)


def closed_form(generators, name: str, p: int, m: int, v: int, costs: Costs) -> dict:
    try:
        return {"idle": str(generators.idle_per_rank(name, p, m, costs)),
                "bubble": str(generators.bubble_formula(name, p, m, costs, stages_per_rank=v))}
    except ValueError as error:
        return {"error": str(error)}


def schedule_data(generators, name: str, grid: Grid) -> dict:
    """Everything the page shows of schedule `name`, for every point of the grid; the arguments the
    schedule refuses map to its one-line reason (check_arguments)."""
    configs, refused = {}, {}
    for p, m, v in configurations(generators, name, grid):
        key = f"{p},{m},{v}"
        try:
            schedule = generators.make_schedule(name, p, m, v)
        except ValueError as error:
            refused[key] = str(error)
            continue
        runs = {}
        for F, I, W in itertools.product(grid.costs, repeat=3):
            costs = Costs(Fraction(F), Fraction(I), Fraction(W))
            timeline = simulate_schedule(schedule.orders, schedule.placement, costs)
            runs[f"{F},{I},{W}"] = {
                "start": [[number(start) for _, start, _ in spans] for spans in timeline.spans],
                "makespan": number(timeline.makespan), "idle": [number(i) for i in timeline.idle],
                "bubble": str(timeline.bubble), "closed": closed_form(generators, name, p, m, v, costs)}
        configs[key] = {"placement": list(schedule.placement), "peak_live": timeline.peak_live,
                        "orders": [" ".join(map(str, order)) for order in schedule.orders], "runs": runs}
    return {"configs": configs, "refused": refused}


def verified_form(name: str, data: dict) -> str | None:
    """IDLE_FORMS[name] in TeX if it gives idle_per_rank's value wherever that holds on the grid, else None."""
    form = IDLE_FORMS.get(name)
    if form is None:
        return None
    for key, config in data["configs"].items():
        p, m, v = map(int, key.split(","))
        for costs, run in config["runs"].items():
            F, I, W = map(Fraction, costs.split(","))
            value = eval(form, {"max": max}, {"p": p, "m": m, "F": F, "I": I, "W": W, "B": I + W})
            if "idle" in run["closed"] and Fraction(run["closed"]["idle"]) != value:
                print(f"site: the explorer's formula for {name}, {form}, gives {value} at p={p}, m={m}, costs "
                      f"{costs}, but idle_per_rank gives {run['closed']['idle']}: the page shows the value only")
                return None
    return tex(form)


def write_explorer_data(folder: Path, grid: Grid = Grid()) -> list[str]:
    """Write index.js and one NAME.js per schedule into `folder`; return the schedules' names."""
    generators = reference("m11_generators")
    folder.mkdir(parents=True, exist_ok=True)
    schedules = []
    for name, generator in generators.SCHEDULES.items():
        data = schedule_data(generators, name, grid)
        data["form"] = verified_form(name, data)
        text = json.dumps(data, separators=(",", ":"))
        (folder / f"{name}.js").write_text(f"EXPLORER.schedules[{json.dumps(name)}] = {text};\n")
        summary = re.match(r"(.+?\.)(\s|$)", " ".join((generator.__doc__ or name).split()))
        schedules.append({"name": name, "summary": summary[1] if summary else name,
                          "takes_v": takes_v(generators, name),
                          "v": generators.stages_per_rank_of(name)})
    index = {"schedules": schedules, "default": DEFAULT,
             "grid": {"p": grid.p, "m": grid.m, "v": grid.v, "costs": grid.costs}}
    (folder / "index.js").write_text(f"window.EXPLORER = {{schedules: {{}}}};\nEXPLORER.index = {json.dumps(index)};\n")
    return [s["name"] for s in schedules]
