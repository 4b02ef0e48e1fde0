"""Module 18 step time: the stated model of m18_step_time's docstring, on a cost written out here.

A GEMM's time is the roofline's, counted here by hand: 2 r i c FLOPs at η of the peak, or its three
matrices' bytes at the memory's bandwidth, whichever is longer (bf16, and fp8 with 1-byte operands).
The bubble of each schedule is its closed form with τ_B = 2 τ_F, written out here from the papers
(GPipe and 1F1B: (p - 1)/(m + p - 1); interleaved 1F1B with v stages a rank: (p - 1)/(v m + p - 1),
Narayanan et al. 2021), checked against course/simulate.py's timeline for the zero-bubble ones. The
exposed axes' times add to the compute and stretch by 1/(1 - bubble); of the weights' traffic, each
kind of collective hides behind the compute it runs beside (written out here from the module
docstring's table), at most `hidden` of it. Exact arithmetic on floats built the same way: tolerance
1e-12 relative, for the order of additions.
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


@pytest.mark.exercises("step_time", "gemm_time")
@pytest.mark.parametrize("schedule, v, bubble", [("1f1b", 2, 3 / 11), ("gpipe", 2, 3 / 11), ("interleaved", 2, 3 / 19),
                                                 ("interleaved", 4, 3 / 35)])
def test_the_bubble_is_the_layouts_schedules(schedule, v, bubble):
    got = predicted(Layout(p=4, d=16, schedule=schedule, m=8, v=v), StepCost()).bubble
    assert got == pytest.approx(bubble, rel=1e-12), (f"{schedule}, p = 4, m = 8, v = {v}: bubble {bubble:.4f}, got "
                                                     f"{got:.4f}")


@pytest.mark.exercises("step_time", "gemm_time")
@pytest.mark.parametrize("schedule", ["zbh1", "zbv"])
def test_the_zero_bubble_schedules_idle_what_their_timeline_idles(schedule):
    order = m11.make_schedule(schedule, 4, 8)
    timeline = simulate_schedule(order.orders, order.placement, Costs())   # F = I = W = 1: τ_B = 2 τ_F
    got = predicted(Layout(p=4, d=16, schedule=schedule, m=8), StepCost()).bubble
    assert got == pytest.approx(float(timeline.bubble), rel=1e-12), (f"{schedule}, p = 4, m = 8: the timeline idles "
                                                                      f"{float(timeline.bubble):.4f}, got {got:.4f}")


# --- one GEMM: the roofline of its shape ---------------------------------------------------------

ETA = TIME.efficiency


@pytest.mark.exercises("gemm_time")
@pytest.mark.parametrize("rows, inner, cols, fp8", [(8192, 16384, 2304, False), (8192, 16384, 2304, True),
                                                    (16, 16384, 16384, False), (16, 16384, 16384, True)],
                         ids=["wide-bf16", "wide-fp8", "thin-bf16", "thin-fp8"])
def test_a_gemm_takes_its_flops_or_its_bytes_whichever_is_longer(rows, inner, cols, fp8):
    # an H100: 989 TFLOP/s bf16 (1979 fp8) at η, 3.35 TB/s. 8192 x 16384 x 2304: 6.2e11 FLOPs, 0.38 GB: the tensor
    # cores set the pace. 16 rows: 8.6e9 FLOPs but the 16384 x 16384 weight alone is 0.54 GB: the memory does.
    operand = 1 if fp8 else 2
    flops = 2 * rows * inner * cols
    moved = operand * (rows * inner + inner * cols) + 2 * rows * cols
    want = max(flops / (ETA * (GPU.fp8 if fp8 else GPU.bf16)), moved / GPU.bandwidth)
    got = step_time.gemm_time(rows, inner, cols, GPU, TIME, fp8)
    bound = "compute" if flops / (ETA * (GPU.fp8 if fp8 else GPU.bf16)) > moved / GPU.bandwidth else "memory"
    assert got == pytest.approx(want, rel=1e-12), (
        f"({rows} x {inner}) @ ({inner} x {cols}){' fp8' if fp8 else ''}: {bound}-bound, {want * 1e3:.4f} ms by the "
        f"roofline ({flops:.3g} FLOPs at η Φ, {moved:.3g} bytes at {GPU.bandwidth:.3g} B/s), got {got * 1e3:.4f} ms")


# --- what overlaps --------------------------------------------------------------------------------

def seconds(cost, axis, op, layout):
    bandwidth, alpha = given.link(axis, layout, GPU, TIME)
    return cost.calls.get((axis, op), 0) * alpha + cost.sent.get((axis, op), 0) / bandwidth


def check_axis_times(got, cost, layout):
    """Each axis's τ_x = ν_x α + Y_x / bandwidth, checked before the step it adds to, so that a wrong τ is named as
    such and not as a step a few milliseconds off."""
    for axis in sorted({a for a, _ in (*cost.sent, *cost.calls)}):
        bandwidth, alpha = given.link(axis, layout, GPU, TIME)
        calls, sent = cost.n_calls(axis), cost.sent_bytes(axis)
        want, have = calls * alpha + sent / bandwidth, got.comm.get(axis)
        why = ""
        if have is not None and calls > 1 and have == pytest.approx(alpha + sent / bandwidth, rel=1e-12):
            why = f": one latency for the whole axis? Each of its {calls} collectives waits α"
        elif have is not None and have == pytest.approx(sent / bandwidth, rel=1e-12):
            why = ": no latency? Each collective waits α before its bytes flow"
        assert have == pytest.approx(want, rel=1e-12), (
            f"τ_{axis} = ν α + Y / bandwidth = {calls} x {alpha * 1e6:.0f} µs + {sent:.3g} B / {bandwidth:.3g} B/s = "
            f"{want:.6g} s, your step_time's comm[{axis!r}] = {have}{why}")


def hides(tau, window):
    """What does not hide of tau seconds beside `window` seconds of compute (module 14: at most 80 % hides)."""
    return tau - min(TIME.hidden * tau, window)


@pytest.mark.exercises("step_time", "gemm_time")
def test_exposed_axes_add_to_the_compute_and_a_step_reduction_hides_behind_the_last_backward():
    layout = Layout(p=4, d=16, t=1, zero=1, schedule="1f1b", m=8)   # p groups span 64 ranks: the network; d too
    cost = StepCost({("p", "send"): 4e9, ("d", "all_reduce"): 6e9, ("d", "all_gather"): 1e9},
                    {("p", "send"): 64, ("d", "all_reduce"): 32, ("d", "all_gather"): 32})
    got = predicted(layout, cost)
    check_axis_times(got, cost, layout)
    forward, backward = given.compute_times(MODEL, layout, 512, GPU, TIME)
    tau_p = seconds(cost, "p", "send", layout)
    # ZeRO-1's all-reduce once a step: behind the last micro-step's backward only; its gather after the
    # optimizer step: behind nothing
    exposed = hides(seconds(cost, "d", "all_reduce", layout), backward / 8) + seconds(cost, "d", "all_gather", layout)
    want = (forward + backward + tau_p) / (1 - 3 / 11) + exposed
    assert got.step == pytest.approx(want, rel=1e-12), (
        f"step {got.step} s, want {want} s: p exposed and stretched by the bubble, the all-reduce hiding behind one "
        f"micro-step's backward ({backward / 8:.3f} s), the all-gather behind nothing")
    assert got.comm.get("p") == pytest.approx(tau_p, rel=1e-12)
    assert got.exposed == pytest.approx(exposed, rel=1e-12)


@pytest.mark.exercises("step_time", "gemm_time")
@pytest.mark.parametrize("once", [False, True])
def test_zero2s_reduce_scatters_hide_behind_the_backwards_they_run_beside(once):
    layout = Layout(d=64, zero=2, m=8, reduce_once=once)
    m = 8 if not once else 1   # module 14's ZeRO-2 sends m rounds, once a step one
    cost = StepCost({("d", "reduce_scatter"): m * 2e10, ("d", "all_gather"): 2e10},
                    {("d", "reduce_scatter"): m * 100, ("d", "all_gather"): 100})
    got = predicted(layout, cost)
    check_axis_times(got, cost, layout)
    forward, backward = given.compute_times(MODEL, layout, 512, GPU, TIME)
    window = backward / 8 if once else backward   # each micro-step's reduce-scatter beside its own backward
    exposed = hides(seconds(cost, "d", "reduce_scatter", layout), window) + seconds(cost, "d", "all_gather", layout)
    want = forward + backward + exposed
    assert got.step == pytest.approx(want, rel=1e-12), (
        f"ZeRO-2 {'once a step' if once else 'every micro-step'}: step {got.step} s, want {want} s (its reduce-scatter "
        f"beside {'the last micro-step' if once else 'every micro-step'}'s backward, {window:.3f} s)")


@pytest.mark.exercises("step_time", "gemm_time")
def test_fsdp_gathers_hide_behind_the_first_forward():
    layout = Layout(d=64, zero=3, m=4)
    cost = StepCost({("d", "all_gather"): 3e10, ("d", "reduce_scatter"): 6e10},
                    {("d", "all_gather"): 32, ("d", "reduce_scatter"): 32})
    got = predicted(layout, cost)
    check_axis_times(got, cost, layout)
    forward, backward = given.compute_times(MODEL, layout, 512, GPU, TIME)
    exposed = hides(seconds(cost, "d", "all_gather", layout), forward / 4) + \
        hides(seconds(cost, "d", "reduce_scatter", layout), backward / 4)
    assert got.step == pytest.approx(forward + backward + exposed, rel=1e-12), (
        f"ZeRO 3: gathers beside the first micro-step's forward, reduce-scatters beside the last one's backward; step "
        f"{forward + backward + exposed} s, got {got.step} s")


@pytest.mark.exercises("step_time", "gemm_time")
def test_an_axis_within_a_node_runs_at_nvlinks_bandwidth_and_a_long_weight_traffic_lengthens_the_step():
    layout = Layout(d=8, t=8, zero=2, m=1)          # t within a node, d across nodes
    cost = StepCost({("t", "all_gather"): 9e9, ("d", "reduce_scatter"): 4e12},
                    {("t", "all_gather"): 10, ("d", "reduce_scatter"): 1})
    got = predicted(layout, cost)
    check_axis_times(got, cost, layout)
    tau_t = 10 * TIME.latency_intra + 9e9 / (GPU.intra * TIME.link_efficiency)
    tau_d = TIME.latency_inter + 4e12 / (GPU.inter * TIME.link_efficiency)
    forward, backward = given.compute_times(MODEL, layout, 512, GPU, TIME)
    assert tau_d > forward + backward + tau_t   # the case under test: the weights' traffic is the longer
    assert got.comm["t"] == pytest.approx(tau_t, rel=1e-12), f"t over NVLink: {tau_t} s, got {got.comm['t']}"
    want = forward + backward + tau_t + hides(tau_d, backward)
    assert got.step == pytest.approx(want, rel=1e-12), f"step: {want} s (the d traffic mostly exposed), got {got.step}"
    assert got.bubble == 0.0


@pytest.mark.exercises("step_time", "gemm_time")
def test_context_attentions_traffic_is_exposed():
    layout = Layout(d=16, c=4, zero=0, m=1)      # c groups within a node, d across
    cost = StepCost({("c", "send"): 2e10, ("dc", "all_reduce"): 1e8}, {("c", "send"): 96, ("dc", "all_reduce"): 4})
    got = predicted(layout, cost)
    check_axis_times(got, cost, layout)
    forward, backward = given.compute_times(MODEL, layout, 512, GPU, TIME)
    tau_c = 96 * TIME.latency_intra + 2e10 / (GPU.intra * TIME.link_efficiency)
    tau_dc = 4 * TIME.latency_inter + 1e8 / (GPU.inter * TIME.link_efficiency)
    want = forward + backward + tau_c + hides(tau_dc, backward)
    assert got.step == pytest.approx(want, rel=1e-12), (
        f"c's ring runs inside the attention, on the critical path: step = compute + τ_c + the weights' exposed part "
        f"= {want} s, got {got.step} s")
