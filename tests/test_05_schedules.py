"""Module 05: naive, GPipe and 1F1B reproduce the monolith, in the right order, in bounded memory.

The stage and comms come from the reference modules 02 and 04, so only the schedules are graded.
Microbatched schedules add the gradients of M microbatches instead of computing the full batch's
at once: the same sum in another order, so float32 results may differ in the last bits. We allow
that rounding (relative 1e-5, about 100 float32 ulps) and no more: a missing 1/M is a factor M.
Trained weights drift further: Adam moves every weight by about lr = 1e-3 a step whatever its
gradient's size, so a gradient rounded differently can change a step by a good fraction of lr where
the gradient is tiny (comparable to eps). After 50 steps we allow 1e-5 (1% of one step; measured on
2-core CPUs: up to 1.6e-6); a wrong microbatch or a missing 1/M is off by far more.
"""
import pytest
import torch
import torch.distributed as dist

from course.impl import load, reference
from course.launch import RankTimeout, run_ranks
from course.profiler import Profiler

m05 = load("m05_schedules")
m00 = reference("m00_monolith")
ShardedMLP = reference("m04_sharded").ShardedMLP
ReferenceComms = reference("m02_comms").PipelineComms
LOSS_ATOL = 1e-6  # losses are ~0.2-0.7: a few float32 ulps
GRAD_RTOL = 1e-5
WEIGHT_ATOL = {3: 1e-6, 50: 1e-5}  # after that many Adam steps (see above)


def _train(schedule, world_size, n_microbatches, steps, profile=False):
    """On each rank: train its stage with `schedule`; return losses, parameters, profiled F/B orders."""
    rank = dist.get_rank()
    cfg = m00.MLPConfig(steps=steps)
    stage = ShardedMLP(cfg, rank, world_size)
    optimizer = torch.optim.Adam(stage.parameters(), lr=cfg.lr)
    profiler = Profiler(rank)
    model, comms = stage, ReferenceComms(rank, world_size)
    if profile:
        model, comms = profiler.wrap_stage(stage), profiler.wrap_comms(comms)
    run_step = profiler.wrap_schedule(m05.SCHEDULES[schedule])
    x, y = m00.make_batch(cfg)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = run_step(model, comms, x, y, n_microbatches)
        if rank == world_size - 1:
            losses.append(loss.item())
        else:
            assert loss is None, f"rank {rank} returned {loss!r}; only the last rank has a loss"
        if steps == 1:  # keep the gradients for the caller
            return losses, [p.grad.clone() for p in stage.parameters()], profiler.ops(), profiler.peak_live
        optimizer.step()
    return losses, [p.detach().clone() for p in stage.parameters()], profiler.ops(), profiler.peak_live


def _monolith_slices(model, world_size, attr):
    """The monolith's per-rank parameter lists (or their .grad), in ShardedMLP's order."""
    per_rank = m00.MLPConfig().layers // world_size
    slices = []
    for rank in range(world_size):
        layers = list(model.layers[rank * per_rank:(rank + 1) * per_rank])
        if rank == world_size - 1:
            layers.append(model.head)
        slices.append([getattr(p, attr) for layer in layers for p in layer.parameters()])
    return slices


_monolith_cache = {}


def _monolith(steps):
    """The monolith trained for `steps` steps and its losses (the reference)."""
    if steps not in _monolith_cache:
        _monolith_cache[steps] = m00.train(m00.MLPConfig(steps=steps))
    return _monolith_cache[steps]


def _check_against_monolith(schedule, world_size, n_microbatches, steps):
    results = run_ranks(_train, world_size, schedule, world_size, n_microbatches, steps, timeout=25)
    model, expected_losses = _monolith(steps)
    losses = results[-1][0]
    exact = schedule == "naive" or n_microbatches == 1
    label = f"{schedule}, P={world_size}, M={n_microbatches}"
    if exact:
        assert losses == expected_losses, f"{label}: losses {losses[:3]}... differ from the monolith's {expected_losses[:3]}..."
    else:
        worst = max(abs(a - b) for a, b in zip(losses, expected_losses))
        assert len(losses) == steps and worst <= LOSS_ATOL, \
            f"{label}: a loss differs from the monolith's by {worst:.2e} (allowed {LOSS_ATOL})"
    for rank, (params, want) in enumerate(zip([r[1] for r in results], _monolith_slices(model, world_size, "data"))):
        for i, (got, ref) in enumerate(zip(params, want)):
            if exact:
                assert torch.equal(got, ref), f"{label}: rank {rank} parameter {i} differs from the monolith's"
            else:
                torch.testing.assert_close(got, ref, rtol=GRAD_RTOL, atol=WEIGHT_ATOL[steps],
                                           msg=lambda m: f"{label}: rank {rank} parameter {i}: {m}")


@pytest.mark.exercises("forward_step", "backward_step", "naive", "gpipe", "one_f_one_b")
@pytest.mark.parametrize("schedule,world_size,n_microbatches", [
    ("naive", 4, 1), ("gpipe", 4, 4), ("1f1b", 4, 4)])
def test_fifty_steps_reproduce_the_monolith(schedule, world_size, n_microbatches):
    _check_against_monolith(schedule, world_size, n_microbatches, steps=50)


@pytest.mark.exercises("forward_step", "backward_step", "naive", "gpipe", "one_f_one_b")
@pytest.mark.parametrize("schedule,world_size,n_microbatches", [
    ("naive", 2, 1), ("naive", 4, 8), ("gpipe", 2, 1), ("gpipe", 2, 2), ("gpipe", 2, 8), ("gpipe", 4, 1), ("gpipe", 4, 16),
    ("1f1b", 2, 1), ("1f1b", 2, 8), ("1f1b", 4, 2), ("1f1b", 4, 8), ("1f1b", 4, 32)])
def test_three_steps_reproduce_the_monolith(schedule, world_size, n_microbatches):
    # With one microbatch (M = 1) nothing is summed in another order: the results must be the
    # monolith's bit for bit, whatever the schedule. The demo hands every schedule the command
    # line's microbatch count, naive included: naive must still run the whole batch at once.
    _check_against_monolith(schedule, world_size, n_microbatches, steps=3)


@pytest.mark.exercises("forward_step", "backward_step", "naive", "gpipe", "one_f_one_b")
@pytest.mark.parametrize("schedule,world_size,n_microbatches", [
    ("naive", 4, 1), ("gpipe", 2, 4), ("gpipe", 4, 8), ("1f1b", 2, 4), ("1f1b", 4, 8)])
def test_gradients_equal_autograd_of_the_full_batch(schedule, world_size, n_microbatches):
    results = run_ranks(_train, world_size, schedule, world_size, n_microbatches, 1, timeout=20)
    cfg = m00.MLPConfig()
    model = m00.build_model(cfg)
    x, y = m00.make_batch(cfg)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    for rank, want in enumerate(_monolith_slices(model, world_size, "grad")):
        for i, (got, ref) in enumerate(zip(results[rank][1], want)):
            ratio = (got.norm() / ref.norm()).item()
            error = ((got - ref).norm() / ref.norm()).item()
            hint = ("is each microbatch loss divided by M?" if abs(ratio - n_microbatches) < 0.1 * n_microbatches or
                    abs(ratio - 1 / n_microbatches) < 0.1 / n_microbatches else
                    "does each backward use its own microbatch's saved input and output (oldest first in 1F1B)?")
            assert error <= (0 if schedule == "naive" else GRAD_RTOL), \
                (f"{schedule}, P={world_size}, M={n_microbatches}: rank {rank} gradient {i} has relative error "
                 f"{error:.2e} (|got|/|autograd| = {ratio:.4f}); {hint}")
    assert abs(results[-1][0][0] - loss.item()) <= LOSS_ATOL, \
        f"returned loss {results[-1][0][0]:.7f}, full-batch loss {loss.item():.7f}"


def _canonical_1f1b(world_size, rank, n_microbatches):
    """The 1F1B order from its definition: warm-up forwards, then F/B pairs, then the backwards."""
    warmup = min(world_size - rank - 1, n_microbatches)
    order = [("F", m) for m in range(warmup)]
    for m in range(n_microbatches - warmup):
        order += [("F", m + warmup), ("B", m)]
    return order + [("B", m) for m in range(n_microbatches - warmup, n_microbatches)]


@pytest.mark.exercises("forward_step", "backward_step", "one_f_one_b")
@pytest.mark.parametrize("world_size,n_microbatches", [(2, 4), (4, 8), (4, 2), (4, 1)])
def test_1f1b_runs_the_canonical_order_and_holds_at_most_p_minus_rank_microbatches(world_size, n_microbatches):
    results = run_ranks(_train, world_size, "1f1b", world_size, n_microbatches, 1, True, timeout=20)
    for rank, (_, _, ops, peak) in enumerate(results):
        assert ops == _canonical_1f1b(world_size, rank, n_microbatches), \
            f"rank {rank} of {world_size}, M={n_microbatches}: ran {ops}, expected {_canonical_1f1b(world_size, rank, n_microbatches)}"
        assert peak == [min(world_size - rank, n_microbatches)], \
            f"rank {rank}: at most {peak[0]} microbatches' activations alive, expected {min(world_size - rank, n_microbatches)}"


@pytest.mark.exercises("forward_step", "backward_step", "gpipe")
@pytest.mark.parametrize("world_size,n_microbatches", [(2, 4), (4, 8)])
def test_gpipe_runs_all_forwards_then_all_backwards_holding_m_microbatches(world_size, n_microbatches):
    results = run_ranks(_train, world_size, "gpipe", world_size, n_microbatches, 1, True, timeout=20)
    for rank, (_, _, ops, peak) in enumerate(results):
        assert ops[:n_microbatches] == [("F", m) for m in range(n_microbatches)], f"rank {rank}: forwards {ops[:n_microbatches]}"
        assert sorted(ops[n_microbatches:]) == [("B", m) for m in range(n_microbatches)], f"rank {rank}: then {ops[n_microbatches:]}"
        assert peak == [n_microbatches], f"rank {rank}: peak {peak[0]} live microbatches, expected all {n_microbatches}"


@pytest.mark.exercises("gpipe", "one_f_one_b")
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_microbatch_counts_that_do_not_divide_the_batch_are_a_clear_error(schedule):
    stage = ShardedMLP(m00.MLPConfig(), 0, 2)
    x, y = m00.make_batch()
    with pytest.raises(ValueError, match="cannot split a batch of 32 into 5"):
        m05.SCHEDULES[schedule](stage, ReferenceComms(0, 2), x, y, 5)  # before any message is sent


def _blocking_1f1b_steady_state():
    """A broken 1F1B step for P = 2: rank 0 sends its second forward with a *blocking* send while
    rank 1, also blocking, sends back the first gradient. Each waits for the other's receive."""
    comms = ReferenceComms(dist.get_rank(), 2)
    activation = torch.zeros(4, 128)
    if comms.rank == 0:
        comms.send_forward(activation)  # warm-up: F0
        comms.send_forward(activation)  # steady state: F1 ... blocks: rank 1 is sending, not receiving
        comms.recv_backward(activation.shape)
    else:
        comms.recv_forward(activation.shape)  # F0
        comms.send_backward(activation)  # B0 ... blocks: rank 0 is sending, not receiving
        comms.recv_forward(activation.shape)


@pytest.mark.given
def test_a_deadlocked_schedule_fails_within_its_timeout_naming_ranks_and_lines():
    with pytest.raises(RankTimeout) as failure:
        run_ranks(_blocking_1f1b_steady_state, 2, timeout=1.5)
    first_line = str(failure.value).splitlines()[0]
    assert "rank 0 at" in first_line and "rank 1 at" in first_line, first_line
    assert "in send_forward" in first_line and "in send_backward" in first_line, first_line
    assert "test_05_schedules.py" in first_line, first_line


@pytest.mark.given
@pytest.mark.parametrize("argv,message", [
    (["--schedule", "zigzag"], "unknown schedule 'zigzag'"),
    (["--nproc", "3"], "16 layers cannot be split evenly over 3 ranks"),
    (["--microbatches", "5"], "a batch of 32 cannot be split into 5"),
    (["--microbatches", "0"], "--microbatches must be at least 1"),
])
def test_bad_arguments_are_refused_before_any_process_starts(argv, message, capsys):
    import main

    with pytest.raises(SystemExit):
        main.parse(["run", "05", *argv])
    assert message in capsys.readouterr().err
