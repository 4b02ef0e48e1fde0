"""Module 18 search: the plan is a brute force's ranking of the same candidates, and a model that fits
nothing is told which layout came closest; the planner's command refuses bad input in one line.

The brute force is written here from the search's definition: every candidate of the given
`candidates` costed with the formulas the search itself calls (your module 18 costs and step time,
graded by their own tests within their tolerances: a search must rank what they return, and a
rounding apart from the reference's can swap two near-equal layouts), kept if its memory is at most (1 - RESERVE) of the GPU's, the fastest of each
family of layouts that differ only in the recompute option, ranked by step time then memory.
"""
import dataclasses
import math

import pytest

from course.impl import load, reference

search = load("m18_search")
given = reference("m18_search")        # candidates and RESERVE are given code
costs = load("m18_costs")            # what the search costs with: the ranking is search's, the numbers theirs
timing = load("m18_step_time")
layouts = reference("m18_layout")
presets = reference("m18_presets")
plan_command = pytest.importorskip("course.plan")

CFG = reference("m17_composition").CONFIG
TINY = presets.Model("tiny", CFG, batch=8)
TIME = timing.TimeModel()


def tiny_gpu(memory: float):
    return presets.GPU("tiny GPU", memory, 1e12, None, 1e9, 1e8, per_node=4)


def brute_force(gpu, gpus=8):
    """(the ranking of the fastest of each family that fits, as tuples; how many candidates fit)."""
    budget = (1 - given.RESERVE) * gpu.memory
    best, fitting = {}, 0
    for layout in given.candidates(TINY, gpus, 8, gpu):
        cost = costs.rank_cost(TINY, layout, 8, layouts.MIXED)
        memory = sum(cost.memory.values())
        if memory > budget:
            continue
        fitting += 1
        time = timing.step_time(TINY, layout, 8, gpu, cost, TIME).step
        if layout.family not in best or time < best[layout.family][0]:
            best[layout.family] = (time, memory, layout)
    return [dataclasses.astuple(layout) for _, _, layout in sorted(best.values(), key=lambda x: (x[0], x[1]))], fitting


@pytest.mark.exercises("search")
def test_the_plan_is_the_brute_forces_ranking_of_what_fits():
    gpu = tiny_gpu(3.0e5)   # 300 kB: about two thirds of the tiny model's candidates fit, the others do not
    plan = search.search(TINY, 8, 8, gpu, layouts.MIXED, TIME)
    want, fitting = brute_force(gpu)
    candidates = len(given.candidates(TINY, 8, 8, gpu))
    assert 0 < fitting < candidates, f"the case under test: some candidates fit and some do not ({fitting} of {candidates})"
    got = [dataclasses.astuple(planned.layout) for planned in plan.fits]   # steps' Layout is another class
    same = got == want   # compared outside the assert: pytest's diff of two long lists takes minutes
    if not same:   # where the two rankings part: the first place they differ, and what each holds there
        at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        shown = lambda ranking: ranking[at] if at < len(ranking) else "nothing"  # noqa: E731
        missing = [w for w in want if w not in set(got)]
        extra = [g for g in got if g not in set(want)]
    assert same, (f"the brute force ranks {len(want)} families' layouts that fit, your search {len(got)}; they part at "
                  f"place {at + 1 if not same else 0}: brute force {shown(want) if not same else ''}, yours "
                  f"{shown(got) if not same else ''}" + (f"; missing from yours: {missing[:2]}" if not same and missing
                                                         else "") + (f"; in yours only: {extra[:2]}" if not same and
                                                                     extra else "")
                  + " (p, d, c, t, e, zero, schedule, m, recompute, fp8, cp, ...)")
    assert plan.closest is None, (f"{fitting} of {candidates} candidates fit: there is no closest miss to report, "
                                  f"your search returns closest={plan.closest.layout}")
    assert plan.considered == candidates, f"the plan says it costed {plan.considered} candidates, not {candidates}"


@pytest.mark.exercises("search")
def test_of_a_family_the_plan_keeps_the_fastest_recompute_option_that_fits():
    # A slow GPU on a fast network: the compute sets the step. Recomputing attention (its q, k, v projections
    # and the causal core: 5120 FLOPs a token of the tiny model) is cheaper than recomputing the FFN (its gate
    # and up projections: 8192), but the FFN's option saves more memory and comes first in module 10's order.
    fixed = {"p": 1, "d": 8, "c": 1, "t": 1, "zero": 1, "m": 1}
    memory = {layout.recompute: sum(costs.rank_cost(TINY, layout, 8, layouts.MIXED).memory.values())
              for layout in given.candidates(TINY, 8, 8, tiny_gpu(1e9), fixed)}
    budget = (memory["attention"] + memory["norms"]) / 2     # ffn, attention and block fit; norms does not
    gpu = presets.GPU("slow GPU", budget / (1 - given.RESERVE), 1e9, None, 1e12, 1e12, per_node=4)
    plan = search.search(TINY, 8, 8, gpu, layouts.MIXED, TIME, fixed)
    got = [planned.layout.recompute for planned in plan.fits]
    assert got == ["attention"], (f"of ffn, attention and block (all fit), attention recomputes the fewest FLOPs; "
                                  f"the plan keeps {got}")


@pytest.mark.exercises("search")
def test_a_layout_whose_memory_equals_the_budget_fits():
    fixed = {"p": 1, "d": 8, "c": 1, "t": 1, "zero": 1, "m": 1, "recompute": "none", "fp8": False}
    (layout,) = given.candidates(TINY, 8, 8, tiny_gpu(1e9), fixed)
    memory = sum(costs.rank_cost(TINY, layout, 8, layouts.MIXED).memory.values())
    size = memory / (1 - given.RESERVE)
    for size in (size, math.nextafter(size, 0), math.nextafter(size, math.inf)):   # the float whose budget is exact
        if (1 - given.RESERVE) * size == memory:
            break
    assert (1 - given.RESERVE) * size == memory
    plan = search.search(TINY, 8, 8, tiny_gpu(size), layouts.MIXED, TIME, fixed)
    assert [p.layout.recompute for p in plan.fits] == ["none"], (
        f"{layout} keeps {memory} bytes, exactly the budget: it fits (memory at most the budget), the plan keeps "
        f"{len(plan.fits)} layouts")


@pytest.mark.exercises("search")
def test_when_nothing_fits_the_closest_is_the_candidate_with_the_least_memory():
    gpu = tiny_gpu(1.0e5)   # 100 kB: nothing fits
    plan = search.search(TINY, 8, 8, gpu, layouts.MIXED, TIME)
    memories = [sum(costs.rank_cost(TINY, layout, 8, layouts.MIXED).memory.values())
                for layout in given.candidates(TINY, 8, 8, gpu)]
    assert plan.fits == [], f"nothing fits in {gpu.memory:.0f} bytes, the plan ranks {len(plan.fits)} layouts"
    assert plan.closest is not None and plan.closest.memory == min(memories), (
        f"the closest miss keeps {min(memories)} bytes, the plan names one that keeps "
        f"{None if plan.closest is None else plan.closest.memory}")


def refused(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        plan_command.main([*argv, "--impl", "solutions"])
    message = str(exit_.value.code) if exit_.value.code not in (None, 0, 1, 2) else capsys.readouterr().err
    return message.strip()


@pytest.mark.given
@pytest.mark.parametrize("argv, words", [
    (["--model", "llama3-9b", "--gpus", "8"], "unknown model preset 'llama3-9b'"),
    (["--model", "llama3-8b", "--gpus", "8", "--gpu", "b200"], "unknown GPU preset 'b200'"),
    (["--model", "llama3-8b", "--gpus", "37"], "no layout of 37 GPUs runs Llama 3 8B"),
    (["--model", "llama3-8b", "--gpus", "8", "--gpu", "a100", "--fp8", "on"], "no FP8 tensor cores"),
    (["--model", "llama3-8b", "--gpus", "8", "--mesh", "p=1", "--schedule", "1f1b"], "no pipeline to schedule"),
    (["--model", "mixtral-8x7b", "--gpus", "8", "--mesh", "t=2"], "no tensor-parallel expert layer"),
    (["--model", "llama3-8b", "--gpus", "8", "--mesh", "t=3"], "does not divide --gpus 8"),
    (["--model", "dim=64,layers=2", "--gpus", "8"], "missing"),
    (["--gpus", "8"], "--model and --gpus are needed"),
    (["--published", "--gpus", "8"], "--published takes no other option"),
])
def test_bad_input_is_one_line_before_the_search(argv, words, capsys):
    message = refused(argv, capsys)
    assert words in message and "\n" not in message, f"{argv}: expected one line with {words!r}, got {message!r}"


@pytest.mark.exercises("search")
def test_a_model_that_fits_nothing_is_told_the_closest_layout_and_why():
    model = plan_command.parse_model("dim=4096,layers=32,heads=32,kv_heads=8,ffn=14336,vocab=128256,seq=8192", presets)
    gpu = plan_command.parse_gpu("memory=16,bf16=100,intra=100,inter=10", presets)
    plan = search.search(model, 2, model.batch, gpu, layouts.MIXED, TIME)
    assert plan.fits == [] and plan.closest is not None, "an 8B model on two 16 GB GPUs: nothing fits"
    message = plan_command.describe_miss(plan.closest, (1 - given.RESERVE) * gpu.memory)   # what `plan` prints
    assert message.startswith("nothing fits: the closest layout") and "the weights' state alone" in message, message
