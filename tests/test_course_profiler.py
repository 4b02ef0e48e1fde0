"""The profiler, the emulated device and the unit-cost simulator (given infrastructure)."""
import json
import time
from fractions import Fraction

import pytest
import torch
import torch.nn as nn

from course.bubble import summarize, theoretical_bubble
from course.emulated import EmulatedStage
from course.profiler import Profiler, export
from course.simulate import simulate
from course.trace import chrome_trace


def _gpipe_orders(world_size, n_microbatches):
    return [[("F", m) for m in range(n_microbatches)] + [("B", m) for m in range(n_microbatches)]] * world_size


def _1f1b_orders(world_size, n_microbatches):
    orders = []
    for rank in range(world_size):
        warmup = min(world_size - rank - 1, n_microbatches)
        order = [("F", m) for m in range(warmup)]
        for m in range(n_microbatches - warmup):
            order += [("F", m + warmup), ("B", m)]
        orders.append(order + [("B", m) for m in range(n_microbatches - warmup, n_microbatches)])
    return orders


@pytest.mark.parametrize("orders", [_gpipe_orders, _1f1b_orders])
@pytest.mark.parametrize("world_size,n_microbatches", [(2, 1), (2, 8), (4, 1), (4, 4), (4, 16), (8, 3)])
def test_simulator_reproduces_the_textbook_bubble(orders, world_size, n_microbatches):
    result = simulate(orders(world_size, n_microbatches))
    assert result["bubble"] == Fraction(world_size - 1, n_microbatches + world_size - 1)
    assert result["makespan"] == 3 * (n_microbatches + world_size - 1)  # F = 1, B = 2
    assert theoretical_bubble(world_size, n_microbatches) == pytest.approx(float(result["bubble"]))


def test_simulator_reports_a_deadlocking_order():
    with pytest.raises(ValueError, match="deadlocks"):
        simulate([[("F", 0), ("B", 1)], [("F", 0), ("B", 0), ("F", 1), ("B", 1)]])


class _Stage(nn.Module):
    def __init__(self, layers=2, hidden=8):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers))
        self.hidden, self.is_first, self.is_last = hidden, True, False

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def test_profiled_stage_records_compute_order_and_live_activations():
    profiler = Profiler(rank=0)
    stage = profiler.wrap_stage(_Stage())
    with profiler.step():
        outs = [stage(torch.randn(4, 8)) for _ in range(3)]  # three alive at once
        for out in outs[::-1]:
            out.sum().backward()
        del outs
        again = stage(torch.randn(4, 8))
        again.sum().backward()
    assert profiler.ops() == [("F", 0), ("F", 1), ("F", 2), ("B", 2), ("B", 1), ("B", 0), ("F", 3), ("B", 3)]
    assert profiler.peak_live == [3]
    assert stage.hidden == 8  # everything else is the stage's


def test_emulated_stage_sleeps_per_layer_forward_and_twice_in_backward():
    stage = EmulatedStage(_Stage(layers=2), ms_per_layer=50)
    start = time.perf_counter()
    out = stage(torch.randn(4, 8))
    forward = time.perf_counter() - start
    out.sum().backward()
    backward = time.perf_counter() - start - forward
    # Sleeps make the lower bounds exact; the upper ones leave 50 ms for a busy machine and still
    # tell twice (200 ms) from three times (300 ms) the forward in backward.
    assert 0.100 <= forward < 0.150 and 0.200 <= backward < 0.250, (forward, backward)
    reference = _Stage(layers=2)
    reference.load_state_dict(stage.stage.state_dict())
    x = torch.randn(4, 8)
    assert torch.equal(stage(x), reference(x))  # emulation changes time, never values


def _fake_profile(rank, compute):
    """A rank that computes `compute` seconds out of a 1-second step, two steps."""
    spans = [{"rank": rank, "kind": "forward", "microbatch": 0, "start": s + 0.1, "end": s + 0.1 + compute,
              "step": i} for i, s in enumerate((0.0, 1.0))]
    return {"rank": rank, "steps": [(0.0, 1.0), (1.0, 2.0)], "peak_live": [1, 1], "spans": spans}


def test_summary_and_chrome_trace(tmp_path):
    profiles = [_fake_profile(0, 0.5), _fake_profile(1, 0.25)]
    summary = summarize(profiles)
    assert summary["step_s"] == pytest.approx(1.0)
    assert [r["idle"] for r in summary["ranks"]] == pytest.approx([0.5, 0.75])
    assert summary["idle"] == pytest.approx(0.625)
    chrome_trace(profiles, tmp_path / "trace.json")
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert {e["tid"] for e in events if e["ph"] == "X"} == {0, 1}
    assert export(Profiler(3))["rank"] == 3


def test_timeline_png(tmp_path):
    from course.plotting import plot_timeline

    plot_timeline([_fake_profile(0, 0.5), _fake_profile(1, 0.25)], tmp_path / "t.png", title="t")
    assert (tmp_path / "t.png").stat().st_size > 1000


def test_timeline_draws_a_ranks_idle_end_of_step_grey_as_its_legend_says():
    from matplotlib.colors import to_rgba
    from matplotlib.figure import Figure

    from course.plotting import plot_timeline

    ax = plot_timeline([_fake_profile(0, 0.5), _fake_profile(1, 0.25)], ax=Figure().add_subplot())
    grey = [(round(bar.get_x(), 6), round(bar.get_width(), 6)) for bar in ax.patches
            if bar.get_facecolor() == to_rgba("0.7")]
    # Step 2 runs from 1.0 to 2.0 s; rank 0 computes until 1.6 s, rank 1 until 1.35 s: idle after that.
    assert sorted(grey) == [(350.0, 650.0), (600.0, 400.0)], grey
    assert "grey: waiting or idle" in ax.get_xlabel()
