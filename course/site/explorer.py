"""The schedule explorer's data (given): every schedule of module 11, simulated over a grid at build time.

The schedules are the reference's generators (`SCHEDULES` in solutions/m11_generators.py, whatever it
holds); course/simulate.py times each one for every p, m, v and costs τ_F, τ_I, τ_W of the grid. The page
(static/explorer.js) only draws what is here: one script per schedule, `_static/explorer/NAME.js`, which
sets `EXPLORER.schedules[NAME]`, plus `index.js`, which sets `EXPLORER.index`: the grid and the list. Scripts, not JSON: a page
opened from file:// may load a script but not fetch a file.

For a run, the data hold each action's start (it ends τ later), every rank's idle time, the bubble
(exact, as a fraction) and the closed forms of solutions/m11_generators.py (`idle_per_rank`,
`bubble_formula`), or the reason they do not hold there. The formula the page typesets for a schedule is
idle_per_rank's own expression for it, read from the function's source and written in TeX (`branches`,
`tex`): the code is the only copy.
"""
from __future__ import annotations

import ast
import inspect
import itertools
import json
import re
import textwrap
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

def branches(generators) -> dict[str, ast.expr]:
    """Each schedule's closed form, as idle_per_rank's source writes it: the expression its branch for that
    schedule returns (`if name == ...` or `if name in (...)` at the top of the function; in a branch that
    returns more than once, the one at its top level: the default case)."""
    function = ast.parse(textwrap.dedent(inspect.getsource(generators.idle_per_rank))).body[0]
    found = {}
    for statement in function.body:
        test = statement.test if isinstance(statement, ast.If) else None
        if not (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "name"):
            continue
        names = ast.literal_eval(test.comparators[0])
        returns = [s.value for s in statement.body if isinstance(s, ast.Return)]
        for name in ([names] if isinstance(names, str) else names):
            if returns:
                found[name] = returns[-1]
    return found


TAU = {"F": r"\tau_F", "I": r"\tau_I", "W": r"\tau_W", "B": r"\tau_B", "pair": r"\tau_{F\&B}"}


def tex(node: ast.expr) -> str:
    """A closed form's expression in TeX: p, m, v as they are, costs.X as τ_X, products juxtaposed."""
    def sum_in_parentheses(child):
        text = tex(child)
        is_sum = isinstance(child, ast.BinOp) and isinstance(child.op, (ast.Add, ast.Sub))
        return f"({text})" if is_sum else text

    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "costs":
        return TAU[node.attr]
    if isinstance(node, ast.Constant):
        return str(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return "-" + sum_in_parentheses(node.operand)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("max", "min"):
        return rf"\{node.func.id}(" + ", ".join(tex(a) for a in node.args) + ")"
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return f"{tex(node.left)}+{tex(node.right)}"
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub):
        return f"{tex(node.left)}-{sum_in_parentheses(node.right)}"
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        left, right = sum_in_parentheses(node.left), sum_in_parentheses(node.right)
        return f"{left} \\cdot {right}" if right[0].isdigit() else f"{left}{right}"
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        return rf"\frac{{{tex(node.left)}}}{{{tex(node.right)}}}"
    raise ValueError(f"no TeX for {ast.unparse(node)!r}")


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
        return {"idle": str(generators.idle_per_rank(name, p, m, costs, stages_per_rank=v)),
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


def verified_form(generators, name: str, data: dict) -> str | None:
    """idle_per_rank's closed form for `name`, in TeX, if evaluating it gives idle_per_rank's value wherever
    that holds on the grid (it is the code's own expression: this checks that the right branch was read),
    else None (the page then shows the value only)."""
    expression = branches(generators).get(name)
    if expression is None:
        return None
    code = compile(ast.Expression(expression), "idle_per_rank", "eval")
    for key, config in data["configs"].items():
        p, m, v = map(int, key.split(","))
        for costs, run in config["runs"].items():
            costs = Costs(*map(Fraction, costs.split(",")))
            if "idle" in run["closed"]:
                value = eval(code, {"max": max, "min": min}, {"p": p, "m": m, "v": v, "costs": costs})
                if Fraction(run["closed"]["idle"]) != value:
                    print(f"site: idle_per_rank's branch for {name}, {ast.unparse(expression)}, gives {value} at "
                          f"p={p}, m={m}, v={v}, costs {costs}, but the function gives {run['closed']['idle']}: "
                          "the explorer shows the value only")
                    return None
    try:
        return tex(expression)
    except ValueError:
        return None


def write_explorer_data(folder: Path, grid: Grid = Grid()) -> list[str]:
    """Write index.js and one NAME.js per schedule into `folder`; return the schedules' names."""
    generators = reference("m11_generators")
    folder.mkdir(parents=True, exist_ok=True)
    schedules = []
    for name, generator in generators.SCHEDULES.items():
        data = schedule_data(generators, name, grid)
        data["form"] = verified_form(generators, name, data)
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
