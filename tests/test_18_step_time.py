"""Module 18 step time: the stated model of m18_step_time's docstring, on a cost written out here.

The bubble of each schedule is its closed form with τ_B = 2 τ_F, written out here from the papers
(GPipe and 1F1B: (p - 1)/(m + p - 1); interleaved 1F1B with v stages a rank: (p - 1)/(v m + p - 1),
Narayanan et al. 2021), checked against course/simulate.py's timeline for the zero-bubble ones. The
exposed axes' times add to the compute and stretch by 1/(1 - bubble); the weights' traffic hides
behind it unless it takes longer. Exact arithmetic on floats built the same way: tolerance 1e-12
relative, for the order of additions.
"""
import pytest

from course.costs import StepCost
from course.impl import load, reference
from course.simulate import Costs, simulate_schedule

step_time = load("m18_step_time")
given = reference("m18_step_time")    # compute_time and link are given code
layouts = reference("m18_layout")
presets = reference("m18_presets")
m11 = reference("m11_generators")

MODEL = presets.MODELS["llama3-8b"]
GPU = presets.GPUS["h100"]
TIME = given.TimeModel()
Layout = layouts.Layout


def predicted(layout, cost):
    return step_time.step_time(MODEL, layout, 512, GPU, cost, TIME)


@pytest.mark.exercises("step_time")
@pytest.mark.parametrize("schedule, bubble", [("1f1b", 3 / 11), ("gpipe", 3 / 11), ("interleaved", 3 / 19)])
def test_the_bubble_is_the_layouts_schedules(schedule, bubble):
    got = predicted(Layout(p=4, d=16, schedule=schedule, m=8), StepCost()).bubble
    assert got == pytest.approx(bubble, rel=1e-12), f"{schedule}, p = 4, m = 8: bubble {bubble:.4f}, got {got:.4f}"


@pytest.mark.exercises("step_time")
@pytest.mark.parametrize("schedule", ["zbh1", "zbv"])
def test_the_zero_bubble_schedules_idle_what_their_timeline_idles(schedule):
    order = m11.make_schedule(schedule, 4, 8)
    timeline = simulate_schedule(order.orders, order.placement, Costs())   # F = I = W = 1: τ_B = 2 τ_F
    got = predicted(Layout(p=4, d=16, schedule=schedule, m=8), StepCost()).bubble
    assert got == pytest.approx(float(timeline.bubble), rel=1e-12), (f"{schedule}, p = 4, m = 8: the timeline idles "
                                                                      f"{float(timeline.bubble):.4f}, got {got:.4f}")


@pytest.mark.exercises("step_time")
def test_exposed_axes_add_to_the_compute_and_the_weights_hide_behind_it():
    layout = Layout(p=4, d=16, t=1, schedule="1f1b", m=8)   # p groups span 64 ranks: the network; d too
    cost = StepCost({("p", "send"): 4e9, ("d", "all_gather"): 1e9}, {("p", "send"): 64, ("d", "all_gather"): 32})
    got = predicted(layout, cost)
    compute = given.compute_time(MODEL, layout, 512, GPU, TIME)
    bandwidth = GPU.inter * TIME.link_efficiency
    tau_p = 64 * TIME.latency_inter + 4e9 / bandwidth
    tau_d = 32 * TIME.latency_inter + 1e9 / bandwidth
    want = max((compute + tau_p) / (1 - 3 / 11), tau_d)
    assert got.step == pytest.approx(want, rel=1e-12), f"step {got.step} s, want {want} s (p exposed, d hidden)"
    assert got.comm.get("p") == pytest.approx(tau_p, rel=1e-12) and got.comm.get("d") == pytest.approx(tau_d, rel=1e-12)


@pytest.mark.exercises("step_time")
def test_an_axis_within_a_node_runs_at_nvlinks_bandwidth_and_a_long_weight_traffic_sets_the_step():
    layout = Layout(d=8, t=8)          # t within a node, d across nodes
    cost = StepCost({("t", "all_gather"): 9e9, ("d", "reduce_scatter"): 4e12},
                    {("t", "all_gather"): 10, ("d", "reduce_scatter"): 1})
    got = predicted(layout, cost)
    tau_t = 10 * TIME.latency_intra + 9e9 / (GPU.intra * TIME.link_efficiency)
    tau_d = TIME.latency_inter + 4e12 / (GPU.inter * TIME.link_efficiency)
    compute = given.compute_time(MODEL, layout, 512, GPU, TIME)
    assert tau_d > compute + tau_t   # the case under test: the weights' traffic is the longer
    assert got.comm["t"] == pytest.approx(tau_t, rel=1e-12), f"t over NVLink: {tau_t} s, got {got.comm['t']}"
    assert got.step == pytest.approx(tau_d, rel=1e-12), f"step: the d traffic's {tau_d} s, got {got.step}"
    assert got.bubble == 0.0


@pytest.mark.exercises("step_time")
def test_context_attentions_traffic_is_exposed():
    layout = Layout(d=16, c=4)            # c groups within a node, d across
    cost = StepCost({("c", "send"): 2e10, ("dc", "all_reduce"): 1e8}, {("c", "send"): 96, ("dc", "all_reduce"): 4})
    got = predicted(layout, cost)
    compute = given.compute_time(MODEL, layout, 512, GPU, TIME)
    tau_c = 96 * TIME.latency_intra + 2e10 / (GPU.intra * TIME.link_efficiency)
    tau_dc = 4 * TIME.latency_inter + 1e8 / (GPU.inter * TIME.link_efficiency)
    assert tau_dc < compute   # the case under test: the weights' traffic hides, the step is the compute and c's
    assert got.step == pytest.approx(compute + tau_c, rel=1e-12), (
        f"c's ring runs inside the attention, on the critical path: step = compute + τ_c = {compute + tau_c} s, "
        f"got {got.step} s")
