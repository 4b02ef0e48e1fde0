"""Module 05: naive, GPipe and 1F1B reproduce the monolith, in the right order, in bounded memory.

The stage and comms come from the reference modules 02 and 04 (or are defined here: a float64 model
whose input is wider than its activations, and comms that record instead of sending), so only the
schedules are graded.
Microbatched schedules add the gradients of m microbatches instead of computing the full batch's
at once: the same sum in another order, so float32 results may differ in the last bits. We allow
that rounding (relative 1e-5, about 100 float32 ulps) and no more: a missing 1/m is a factor m.
Trained weights drift further: Adam moves every weight by about lr = 1e-3 a step whatever its
gradient's size, so a gradient rounded differently can change a step by a good fraction of lr where
the gradient is tiny (comparable to eps). After 50 steps we allow 1e-5 (1% of one step; measured on
2-core CPUs: up to 1.6e-6); a wrong microbatch or a missing 1/m is off by far more.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from course.emulated import EmulatedStage
from course.impl import load, reference
from course.launch import RankTimeout, run_ranks
from course.mesh import group_of, init_mesh
from course.profiler import Profiler

m05 = load("m05_schedules")
m00 = reference("m00_monolith")
ShardedMLP = reference("m04_sharded").ShardedMLP
ReferenceComms = reference("m02_comms").PipelineComms
LOSS_ATOL = 1e-6  # losses are ~0.2-0.7: a few float32 ulps
GRAD_RTOL = 1e-5
WEIGHT_ATOL = {3: 1e-6, 50: 1e-5}  # after that many Adam steps (see above)
SCHEDULES = ["naive", "gpipe", "1f1b"]  # naive (given) is gpipe with one microbatch


def schedule_ids(value):
    """Test ids name the schedule's function (1F1B's is one_f_one_b), so a failure's help points at it."""
    return "one_f_one_b" if value == "1f1b" else None


def _train(schedule, world_size, n_microbatches, steps, profile=False):
    """On each rank: train its stage with `schedule`; return losses, parameters, profiled F/B orders."""
    rank = dist.get_rank()
    cfg = m00.MLPConfig(steps=steps)
    comms = ReferenceComms()  # every rank of the job, in rank order
    stage = ShardedMLP(cfg, comms.pp)
    optimizer = torch.optim.Adam(stage.parameters(), lr=cfg.lr)
    profiler = Profiler(rank)
    # The stage the demo and the benchmark pass: an emulated device around the ShardedMLP (here with
    # no extra time). It offers is_first, is_last, hidden, loss and parameters, not ShardedMLP's
    # pp or layers: a schedule takes its place in the pipeline from its comms (comms.pp).
    model = EmulatedStage(stage, 0.0)
    if profile:
        model, comms = profiler.wrap_stage(model), profiler.wrap_comms(comms)
    run_step = profiler.wrap_schedule(m05.SCHEDULES[schedule])
    x, y = m00.make_batch(cfg)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = run_step(model, comms, x, y, n_microbatches)
        if rank == world_size - 1:
            assert isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.grad_fn is None, \
                (f"{schedule} returned {_describe(loss)} on the last rank, expected the batch loss as a detached "
                 "scalar tensor: detach the loss (each share before adding the shares up; a loss that keeps its autograd "
                 "history keeps the step's graphs alive after it)")
            losses.append(loss.item())
        else:
            assert loss is None, f"{schedule}: rank {rank} returned {_describe(loss)}; only the last rank has a loss (None elsewhere)"
        if steps == 1:  # keep the gradients for the caller
            return losses, [p.grad.clone() for p in stage.parameters()], profiler.ops(), profiler.peak_live
        optimizer.step()
    return losses, [p.detach().clone() for p in stage.parameters()], profiler.ops(), profiler.peak_live


def _describe(value):
    if isinstance(value, torch.Tensor):
        return (f"a tensor of shape {tuple(value.shape)}" +
                (f" with autograd history ({type(value.grad_fn).__name__})" if value.grad_fn is not None else ""))
    return repr(value)


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
    label = f"{schedule}, p={world_size}, m={n_microbatches}"
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


# A second model, in float64, whose first stage takes inputs of another width (FEATURES) than the
# activations between stages (HIDDEN); the course's MLP has 128 everywhere, which hides a receive
# buffer sized from x_mb or a gradient buffer sized from inp. Its stages offer only what the demo's
# EmulatedStage offers: is_first, is_last, hidden, loss and parameters.
FEATURES, HIDDEN, CLASSES, ROWS = 6, 4, 3, 12


def _wide_model(world_size):
    """The whole model, one block per stage, then the head: the reference and every stage's source."""
    torch.manual_seed(0)
    blocks = [nn.Linear(FEATURES if r == 0 else HIDDEN, HIDDEN, dtype=torch.float64) for r in range(world_size)]
    return blocks, nn.Linear(HIDDEN, CLASSES, dtype=torch.float64)


def _wide_batch():
    generator = torch.Generator().manual_seed(1)
    return (torch.randn(ROWS, FEATURES, dtype=torch.float64, generator=generator),
            torch.randint(0, CLASSES, (ROWS,), generator=generator))


class WideStage(nn.Module):
    def __init__(self, rank, world_size):
        super().__init__()
        self.is_first, self.is_last, self.hidden = rank == 0, rank == world_size - 1, HIDDEN
        blocks, head = _wide_model(world_size)
        self.block, self.head = blocks[rank], head if self.is_last else None

    def forward(self, x):
        x = torch.tanh(self.block(x))
        return self.head(x) if self.is_last else x

    def loss(self, logits, targets):
        return F.cross_entropy(logits, targets)


def _check_receive(comms, verb, shape, dtype, rows, note):
    """What a schedule asks to receive, checked before it is received (a wrong buffer makes gloo abort)."""
    expected = (rows, HIDDEN)
    if tuple(shape) != expected:
        what = ("the previous stage's activation" if verb == "recv_forward" else
                "the gradient of this stage's output (out's shape, not inp's: the first stage's input is "
                f"{FEATURES} wide here)")
        raise AssertionError(
            f"rank {comms.rank}: {verb} asked for shape {tuple(shape)}, but {what} has shape {expected} "
            f"(microbatch rows, stage.hidden; {note}): size receives from the microbatch's rows and stage.hidden, "
            "not from x_mb's shape")
    if dtype not in (None, comms.dtype):
        raise AssertionError(
            f"rank {comms.rank}: {verb} asked for dtype {dtype}, but this pipeline sends {comms.dtype}: leave the "
            "dtype out (the comms' default) rather than naming one")


class CheckedComms(ReferenceComms):
    """The reference comms in float64, checking the shape and dtype of every receive first."""

    def __init__(self, rows, note):
        super().__init__(dtype=torch.float64)
        self.rows, self.note = rows, note

    def recv_forward(self, shape, dtype=None):
        _check_receive(self, "recv_forward", shape, dtype, self.rows, self.note)
        return super().recv_forward(shape, dtype)

    def recv_backward(self, shape, dtype=None):
        _check_receive(self, "recv_backward", shape, dtype, self.rows, self.note)
        return super().recv_backward(shape, dtype)


def _rows_and_note(schedule, n_microbatches):
    if schedule == "naive":
        return ROWS, f"naive runs the whole batch of {ROWS} rows at once, whatever n_microbatches says"
    return ROWS // n_microbatches, f"{ROWS} rows in {n_microbatches} microbatches"


def _train_wide(schedule, world_size, n_microbatches):
    rank = dist.get_rank()
    stage = WideStage(rank, world_size)
    x, y = _wide_batch()
    comms = CheckedComms(*_rows_and_note(schedule, n_microbatches))
    loss = m05.SCHEDULES[schedule](stage, comms, x, y, n_microbatches)
    return (None if loss is None else loss.item()), [None if p.grad is None else p.grad.clone() for p in stage.parameters()]


class _RecordedHandle:
    def __init__(self):
        self.waited = False

    def wait(self):
        self.waited = True


class RecordingComms:
    """Comms with no peer, for one rank in a single process: receives return random tensors of the
    shape asked for (after the check above), non-blocking sends return handles that note whether
    they were waited for, blocking sends are noted."""

    def __init__(self, rank, world_size, rows, note, members=None):
        # `rank` is the place in the pipeline; `members`, if given, the pipeline's global ranks (one
        # axis of a mesh), whose member `rank` this comms is: then comms.rank is a global rank.
        self.pp = group_of("p", rank, range(world_size) if members is None else members)
        self.rank = rank if members is None else members[rank]
        self.world_size, self.rows, self.note = world_size, rows, note
        self.prev = rank - 1 if rank > 0 else None
        self.next = rank + 1 if rank < world_size - 1 else None
        self.device, self.dtype = torch.device("cpu"), torch.float64
        self.generator = torch.Generator().manual_seed(rank)
        self.calls = {"recv_forward": 0, "recv_backward": 0, "isend_forward": 0, "isend_backward": 0}
        self.handles, self.blocking = [], []
        self.received, self.sent = [], []  # the tensors handed to the schedule, and those it sent (verb, tensor)

    def _peer(self, verb, side):
        assert getattr(self, side) is not None, \
            (f"rank {self.rank} of {self.world_size} called {verb}, but it has no {side} rank (it is the "
             f"{'first' if side == 'prev' else 'last'} stage{'; the only stage is both' if self.world_size == 1 else ''})")

    def _recv(self, verb, shape, dtype):
        self._peer(verb, "prev" if verb == "recv_forward" else "next")
        _check_receive(self, verb, shape, dtype, self.rows, self.note)
        self.calls[verb] += 1
        self.received.append(torch.randn(shape, dtype=self.dtype, generator=self.generator))
        return self.received[-1]

    def recv_forward(self, shape, dtype=None):
        return self._recv("recv_forward", shape, dtype)

    def recv_backward(self, shape, dtype=None):
        return self._recv("recv_backward", shape, dtype)

    def _isend(self, verb, tensor):
        self._peer(verb, "next" if verb == "isend_forward" else "prev")
        assert isinstance(tensor, torch.Tensor), f"{verb} got {tensor!r}, not a tensor"
        self.calls[verb] += 1
        self.sent.append((verb, tensor))
        self.handles.append(_RecordedHandle())
        return self.handles[-1]

    def isend_forward(self, tensor):
        return self._isend("isend_forward", tensor)

    def isend_backward(self, tensor):
        return self._isend("isend_backward", tensor)

    def send_forward(self, tensor):
        self.blocking.append("send_forward")

    def send_backward(self, tensor):
        self.blocking.append("send_backward")


POSITIONS = pytest.mark.parametrize("rank, world_size", [(0, 2), (1, 3), (1, 2), (0, 1)],
                                    ids=["first", "middle", "last", "only"])
M_ALONE = 3  # microbatches of the step the helpers are checked in (ROWS = 12: 4 rows each)


def _microbatch_zero():
    x, y = _wide_batch()
    rows = ROWS // M_ALONE
    return x[:rows], y[:rows], rows


def _stage_output(stage, inp, y_mb):
    """This stage's output, computed from its modules (the test's own, given): logits' loss or the activation."""
    hidden = torch.tanh(stage.block(inp))
    return F.cross_entropy(stage.head(hidden), y_mb) if stage.is_last else hidden


@pytest.mark.exercises("forward_step")
@POSITIONS
def test_forward_step_alone(rank, world_size):
    # One microbatch (0 of 3) on one rank, comms that record: what it receives, returns and sends.
    x_mb, y_mb, rows = _microbatch_zero()
    comms = RecordingComms(rank, world_size, rows, f"{ROWS} rows in {M_ALONE} microbatches")
    stage, sends = WideStage(rank, world_size), []
    where = f"your forward_step on the {['first', 'middle', 'last'][(rank > 0) + (rank == world_size - 1)] if world_size > 1 else 'only'} stage (rank {rank} of {world_size}, m={M_ALONE})"
    result = m05.forward_step(stage, comms, x_mb, y_mb, M_ALONE, sends)
    assert not comms.blocking, f"{where} used the blocking {comms.blocking}: it must send without blocking"
    expected = {"recv_forward": int(rank > 0), "recv_backward": 0, "isend_forward": int(rank < world_size - 1),
                "isend_backward": 0}
    assert comms.calls == expected, f"{where} made the calls {comms.calls}, expected {expected}"
    assert isinstance(result, tuple) and len(result) == 2, f"{where} returned {_describe(result)}, expected (inp, out)"
    inp, out = result
    if rank == 0:
        assert isinstance(inp, torch.Tensor) and torch.equal(inp, x_mb), f"{where}: inp must be x_mb, got {_describe(inp)}"
    else:
        [arrived] = comms.received
        assert isinstance(inp, torch.Tensor) and torch.equal(inp, arrived), \
            f"{where}: inp must be the activation received from the previous rank, got {_describe(inp)}"
        assert inp.requires_grad and inp.grad_fn is None, \
            (f"{where}: the received input {'has autograd history' if inp.grad_fn is not None else 'does not require grad'}"
             ": it must be a leaf that collects its gradient in the backward, or backward_step has nothing to send back")
    want = _stage_output(stage, inp.detach().requires_grad_(rank > 0), y_mb)
    if rank < world_size - 1:
        assert isinstance(out, torch.Tensor) and out.shape == want.shape and torch.equal(out, want), \
            f"{where}: out must be the stage's activation {tuple(want.shape)}, got {_describe(out)}"
        assert out.grad_fn is not None, f"{where}: out has no autograd history, so no backward can run through it"
        assert [verb for verb, _ in comms.sent] == ["isend_forward"] and comms.sent[0][1] is out, \
            f"{where}: the tensor sent forward must be out, the stage's activation"
        assert sends == comms.handles, \
            (f"{where}: `sends` holds {len(sends)} handles, expected the {len(comms.handles)} of the sends it started "
             "(the schedule waits for them at the end of the step)")
    else:
        assert isinstance(out, torch.Tensor) and out.numel() == 1 and out.grad_fn is not None, \
            f"{where}: out must be this microbatch's share of the loss, a scalar with autograd history, got {_describe(out)}"
        share, full = want.item() / M_ALONE, want.item()
        factor = (f" = {out.item() / share:.4g} times the share: the microbatch's own loss, not its share of the batch's "
                  f"mean over {M_ALONE} microbatches?" if abs(out.item() - full) <= 1e-12 * abs(full) else "")
        assert abs(out.item() - share) <= 1e-12 * abs(share), \
            (f"{where}: out = {out.item():.15g}, expected this microbatch's share of the batch loss, "
             f"{share:.15g}{factor}")


@pytest.mark.exercises("backward_step")
@POSITIONS
def test_backward_step_alone(rank, world_size):
    # The forward is done here, by the test; backward_step must leave the reference's gradients and
    # send back the input's gradient. Reference: autograd through the same float64 modules.
    x_mb, y_mb, rows = _microbatch_zero()
    comms = RecordingComms(rank, world_size, rows, f"{ROWS} rows in {M_ALONE} microbatches")
    stage, sends = WideStage(rank, world_size), []
    where = f"your backward_step on the {['first', 'middle', 'last'][(rank > 0) + (rank == world_size - 1)] if world_size > 1 else 'only'} stage (rank {rank} of {world_size})"
    inp = x_mb if rank == 0 else torch.randn(rows, HIDDEN, dtype=torch.float64,
                                            generator=torch.Generator().manual_seed(7)).requires_grad_()
    out = _stage_output(stage, inp, y_mb)
    out = out / M_ALONE if stage.is_last else out
    m05.backward_step(stage, comms, inp, out, sends)
    assert not comms.blocking, f"{where} used the blocking {comms.blocking}: it must send without blocking"
    expected = {"recv_forward": 0, "recv_backward": int(rank < world_size - 1), "isend_forward": 0,
                "isend_backward": int(rank > 0)}
    assert comms.calls == expected, f"{where} made the calls {comms.calls}, expected {expected}"
    reference = WideStage(rank, world_size)
    ref_inp = inp.detach().clone().requires_grad_(rank > 0)
    ref_out = _stage_output(reference, ref_inp, y_mb)
    if stage.is_last:
        (ref_out / M_ALONE).backward()
    else:
        [g] = comms.received
        ref_out.backward(g)
    for (name, got), ref in zip(stage.named_parameters(), reference.parameters(), strict=True):
        assert got.grad is not None, f"{where}: {name} got no gradient"
        ratio = (got.grad.norm() / ref.grad.norm()).item()
        assert torch.allclose(got.grad, ref.grad, rtol=1e-12, atol=0), \
            (f"{where}: the gradient of {name} differs from autograd's, |got|/|expected| = {ratio:.4g}: "
             f"{'what does the backward start from?' if not stage.is_last else 'the share is already divided by m'}")
    if rank > 0:
        assert [verb for verb, _ in comms.sent] == ["isend_backward"], f"{where} sent {[v for v, _ in comms.sent]}"
        sent = comms.sent[0][1]
        assert isinstance(sent, torch.Tensor) and sent.shape == ref_inp.shape and torch.allclose(sent, ref_inp.grad,
                                                                                                  rtol=1e-12, atol=0), \
            f"{where}: the tensor sent back must be dloss/dinp, {tuple(ref_inp.shape)}, got {_describe(sent)}"
        assert sends == comms.handles, \
            f"{where}: `sends` holds {len(sends)} handles, expected the {len(comms.handles)} of the sends it started"
    else:
        assert not sends, f"{where}: the first stage sends nothing back, but `sends` holds {sends}"


@pytest.mark.exercises("gpipe", "one_f_one_b", "forward_step", "backward_step")
@pytest.mark.parametrize("schedule", SCHEDULES, ids=schedule_ids)
@pytest.mark.parametrize("rank, world_size", [(0, 2), (1, 3), (1, 2)], ids=["first", "middle", "last"])
def test_every_send_is_non_blocking_and_waited_for_before_the_step_ends(schedule, rank, world_size):
    # One rank alone, with comms that record: a forgotten wait_all or a handle not kept in `sends`
    # shows here by name, where on real ranks the peer hangs in a receive until the timeout.
    n_microbatches = 4
    rows, note = _rows_and_note(schedule, n_microbatches)
    comms = RecordingComms(rank, world_size, rows, note)
    x, y = _wide_batch()
    stage = WideStage(rank, world_size)
    m05.SCHEDULES[schedule](stage, comms, x, y, n_microbatches)
    where = f"{schedule} on rank {rank} of {world_size}"
    assert not comms.blocking, \
        (f"{where} used blocking sends {comms.blocking}: forward_step and backward_step send with isend_forward / "
         "isend_backward and keep the handles (blocking sends in both directions deadlock 1F1B's steady state)")
    messages = 1 if schedule == "naive" else n_microbatches
    expected = {"recv_forward": messages * (comms.prev is not None), "recv_backward": messages * (comms.next is not None),
                "isend_forward": messages * (comms.next is not None), "isend_backward": messages * (comms.prev is not None)}
    assert comms.calls == expected, \
        (f"{where}, m={n_microbatches}: made the calls {comms.calls}, expected {expected} (one message each way per "
         "microbatch, to each neighbour it has)")
    unwaited = sum(not handle.waited for handle in comms.handles)
    assert unwaited == 0, \
        (f"{where} returned with {unwaited} of its {len(comms.handles)} non-blocking sends never waited for: keep "
         "every handle in `sends` and wait_all(sends) before returning (on gloo an unwaited send is usually lost, "
         "and the peer hangs in its receive)")


@pytest.mark.exercises("gpipe", "one_f_one_b", "forward_step", "backward_step")
@pytest.mark.parametrize("schedule", SCHEDULES, ids=schedule_ids)
def test_a_single_stage_is_first_and_last_and_sends_nothing(schedule):
    # `python main.py run 05 --nproc 1`: one stage, both the first (it reads x) and the last (it
    # computes the loss), with nobody to talk to. Reference: autograd of the same model in float64
    # (m = 4 microbatches sum in another order: measured up to 4.3e-16 relative, we allow 1e-10).
    n_microbatches = 4
    comms = RecordingComms(0, 1, *_rows_and_note(schedule, n_microbatches))
    stage, x, y = WideStage(0, 1), *_wide_batch()
    loss = m05.SCHEDULES[schedule](stage, comms, x, y, n_microbatches)
    assert not comms.blocking and not any(comms.calls.values()), \
        (f"{schedule} on a single stage sent or received {comms.calls} (blocking sends {comms.blocking}): the only "
         "stage is both stage.is_first and stage.is_last, so it has no neighbour to talk to")
    [block], head = _wide_model(1)
    expected_loss = F.cross_entropy(head(torch.tanh(block(x))), y)
    expected_loss.backward()
    for i, (got, ref) in enumerate(zip(stage.parameters(), [*block.parameters(), *head.parameters()], strict=True)):
        assert got.grad is not None and ((got.grad - ref.grad).norm() / ref.grad.norm()).item() <= 1e-10, \
            f"{schedule} on a single stage: parameter {i}'s gradient differs from autograd's on the whole batch"
    assert isinstance(loss, torch.Tensor) and abs(loss.item() - expected_loss.item()) <= 1e-12, \
        f"{schedule} on a single stage returned {_describe(loss)}, expected the loss {expected_loss.item():.15f}"


@pytest.mark.exercises("gpipe", "one_f_one_b", "forward_step", "backward_step")
@pytest.mark.parametrize("schedule", SCHEDULES, ids=schedule_ids)
def test_a_stage_whose_input_is_wider_than_its_activations_in_float64(schedule):
    # p = 3 (an odd number of stages; 1F1B's middle rank warms up with one forward), m = 4, and the
    # first stage's input 6 wide where the activations are 4 wide. Reference: autograd of the
    # whole model on the whole batch, in one process. In float64 the microbatches' sums round
    # differently (measured: up to 4.3e-16 relative); we allow 1e-10, and a wrong scale is a factor.
    world_size, n_microbatches = 3, 4
    results = run_ranks(_train_wide, world_size, schedule, world_size, n_microbatches, timeout=20)
    blocks, head = _wide_model(world_size)
    x, y = _wide_batch()
    hidden = x
    for block in blocks:
        hidden = torch.tanh(block(hidden))
    loss = F.cross_entropy(head(hidden), y)
    loss.backward()
    expected = [[p.grad for p in block.parameters()] for block in blocks]
    expected[-1] += [p.grad for p in head.parameters()]
    for rank, ((_, grads), want) in enumerate(zip(results, expected)):
        assert len(grads) == len(want), f"rank {rank}: {len(grads)} parameters, expected {len(want)}"
        for i, (got, ref) in enumerate(zip(grads, want)):
            assert got is not None, f"{schedule}: rank {rank} parameter {i} got no gradient: did its backward run?"
            error = ((got - ref).norm() / ref.norm()).item()
            assert error <= 1e-10, \
                (f"{schedule}, p=3, m=4, float64: rank {rank} gradient {i} has relative error {error:.2e} "
                 f"(|got|/|autograd| = {(got.norm() / ref.norm()).item():.4f}); expected <= 1e-10")
    got_loss = results[-1][0]
    assert got_loss is not None and abs(got_loss - loss.item()) <= 1e-12, \
        f"{schedule}: the last rank returned the loss {got_loss}, expected the full-batch loss {loss.item():.15f}"


@pytest.mark.exercises("gpipe", "one_f_one_b", "forward_step", "backward_step")
@pytest.mark.parametrize("schedule,world_size,n_microbatches", [
    ("naive", 4, 1), ("gpipe", 4, 4), ("1f1b", 4, 4)], ids=schedule_ids)
def test_fifty_steps_reproduce_the_monolith(schedule, world_size, n_microbatches):
    _check_against_monolith(schedule, world_size, n_microbatches, steps=50)


@pytest.mark.exercises("gpipe", "one_f_one_b", "forward_step", "backward_step")
@pytest.mark.parametrize("schedule,world_size,n_microbatches", [
    ("naive", 2, 1), ("naive", 4, 8), ("gpipe", 2, 1), ("gpipe", 2, 2), ("gpipe", 2, 8), ("gpipe", 4, 1), ("gpipe", 4, 16),
    ("1f1b", 2, 1), ("1f1b", 2, 8), ("1f1b", 4, 2), ("1f1b", 4, 8), ("1f1b", 4, 32)], ids=schedule_ids)
def test_three_steps_reproduce_the_monolith(schedule, world_size, n_microbatches):
    # With one microbatch (m = 1) nothing is summed in another order: the results must be the
    # monolith's bit for bit, whatever the schedule. The demo hands every schedule the command
    # line's microbatch count, naive included: naive must still run the whole batch at once.
    _check_against_monolith(schedule, world_size, n_microbatches, steps=3)


@pytest.mark.exercises("gpipe", "one_f_one_b", "forward_step", "backward_step")
@pytest.mark.parametrize("schedule,world_size,n_microbatches", [
    ("naive", 4, 1), ("gpipe", 2, 4), ("gpipe", 4, 8), ("1f1b", 2, 4), ("1f1b", 4, 8)], ids=schedule_ids)
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
            hint = ("is each microbatch loss divided by m?" if abs(ratio - n_microbatches) < 0.1 * n_microbatches or
                    abs(ratio - 1 / n_microbatches) < 0.1 / n_microbatches else
                    "does each backward use its own microbatch's saved input and output (oldest first in 1F1B)?")
            assert error <= (0 if schedule == "naive" else GRAD_RTOL), \
                (f"{schedule}, p={world_size}, m={n_microbatches}: rank {rank} gradient {i} has relative error "
                 f"{error:.2e} (|got|/|autograd| = {ratio:.4f}); {hint}")
    assert abs(results[-1][0][0] - loss.item()) <= LOSS_ATOL, \
        f"returned loss {results[-1][0][0]:.7f}, full-batch loss {loss.item():.7f}"


def _train_along_one_axis(schedule, n_microbatches, steps):
    """A 2-stage pipeline along the p axis of a p=2 x d=2 mesh: ranks (0, 2) and (1, 3) are two
    pipelines, one per d replica, each training its own model on its own batch (seed 42 + i_d)."""
    mesh = init_mesh({"p": 2, "d": 2})
    pp = mesh.group("p")
    cfg = m00.MLPConfig(steps=steps, seed=42 + mesh.index["d"])
    profiler = Profiler(dist.get_rank())
    _, losses = m05.train(profiler.wrap_schedule(m05.SCHEDULES[schedule]), profiler.wrap_stage(ShardedMLP(cfg, pp)),
                          profiler.wrap_comms(ReferenceComms(pp)), n_microbatches, cfg)
    return pp.ranks, mesh.index["d"], losses, profiler.ops()


def _order_alone(members, index, n_microbatches):
    """1F1B's F/B order on member `index` of the pipeline `members` (global ranks), run in this
    process with comms that record (no peer, no process group)."""
    profiler = Profiler(members[index])
    comms = RecordingComms(index, len(members), ROWS // n_microbatches, f"{ROWS} rows in {n_microbatches} microbatches",
                           members)
    stage, (x, y) = profiler.wrap_stage(WideStage(index, len(members))), _wide_batch()
    with profiler.step():
        m05.one_f_one_b(stage, comms, x, y, n_microbatches)
    return profiler.ops()


@pytest.mark.exercises("one_f_one_b", "forward_step", "backward_step")
def test_a_pipeline_along_one_axis_of_a_mesh_trains_like_the_monolith():
    # The schedule's place in the pipeline is comms.pp.index, not the global rank: on ranks 2 and 3
    # (the last stage of each pipeline) a warm-up read off the global rank asks for stages that do not
    # exist. m = 4 microbatches: module 05's 1e-6 on losses against the monolith.
    schedule, n_microbatches, steps = "1f1b", 4, 3
    # First each member of the pipeline (1, 3) alone, in this process: a wrong place shows as a wrong
    # order here, where on real ranks the pipeline would hang until its timeout.
    for index in (0, 1):
        ops, want = _order_alone((1, 3), index, n_microbatches), _canonical_1f1b(2, index, n_microbatches)
        assert ops == want, \
            (f"your one_f_one_b at place {index} of the pipeline of global ranks (1, 3) (comms.rank {(1, 3)[index]}, "
             f"comms.pp.index {index}), m={n_microbatches}, ran {ops}, expected 1F1B's {want}: the warm-up counts the "
             "stages after this one in the pipeline group (comms.pp), not in the whole job")
    results = run_ranks(_train_along_one_axis, 4, schedule, n_microbatches, steps, timeout=30)
    for rank, (members, replica, losses, ops) in enumerate(results):
        assert members == (replica, replica + 2), (rank, members, replica)
        want = _canonical_1f1b(2, members.index(rank), n_microbatches)
        assert ops == want, \
            (f"rank {rank}, stage {members.index(rank)} of the pipeline {members}: ran {ops}, expected 1F1B's {want}: "
             "the warm-up counts the stages after this one in the pipeline group (comms.pp), not in the whole job")
        if rank != members[-1]:
            assert losses == [], f"rank {rank} holds the first stage of pipeline {members}: it has no loss, got {losses}"
            continue
        _, want = m00.train(m00.MLPConfig(steps=steps, seed=42 + replica))
        worst = max((abs(a - b) for a, b in zip(losses, want)), default=float("inf"))
        assert len(losses) == steps and worst <= LOSS_ATOL, \
            (f"{schedule}, m={n_microbatches}, the pipeline of ranks {members} (replica d={replica}, its own batch) "
             f"along the p axis of a p=2 x d=2 mesh: losses {losses}, that replica's monolith {want}")


def _canonical_1f1b(world_size, rank, n_microbatches):
    """The 1F1B order from its definition: warm-up forwards, then F/B pairs, then the backwards."""
    warmup = min(world_size - rank - 1, n_microbatches)
    order = [("F", m) for m in range(warmup)]
    for m in range(n_microbatches - warmup):
        order += [("F", m + warmup), ("B", m)]
    return order + [("B", m) for m in range(n_microbatches - warmup, n_microbatches)]


@pytest.mark.exercises("one_f_one_b", "forward_step", "backward_step")
@pytest.mark.parametrize("world_size,n_microbatches", [(2, 4), (4, 8), (4, 2), (4, 1)])
def test_1f1b_runs_the_canonical_order_and_holds_at_most_p_minus_rank_microbatches(world_size, n_microbatches):
    results = run_ranks(_train, world_size, "1f1b", world_size, n_microbatches, 1, True, timeout=20)
    for rank, (_, _, ops, peak) in enumerate(results):
        assert ops == _canonical_1f1b(world_size, rank, n_microbatches), \
            f"rank {rank} of {world_size}, m={n_microbatches}: ran {ops}, expected {_canonical_1f1b(world_size, rank, n_microbatches)}"
        assert peak == [min(world_size - rank, n_microbatches)], \
            f"rank {rank}: at most {peak[0]} microbatches' activations alive, expected {min(world_size - rank, n_microbatches)}"


@pytest.mark.exercises("gpipe", "forward_step", "backward_step")
@pytest.mark.parametrize("world_size,n_microbatches", [(2, 4), (4, 8)])
def test_gpipe_runs_all_forwards_then_all_backwards_holding_m_microbatches(world_size, n_microbatches):
    results = run_ranks(_train, world_size, "gpipe", world_size, n_microbatches, 1, True, timeout=20)
    for rank, (_, _, ops, peak) in enumerate(results):
        assert ops[:n_microbatches] == [("F", m) for m in range(n_microbatches)], f"rank {rank}: forwards {ops[:n_microbatches]}"
        assert sorted(ops[n_microbatches:]) == [("B", m) for m in range(n_microbatches)], f"rank {rank}: then {ops[n_microbatches:]}"
        assert peak == [n_microbatches], f"rank {rank}: peak {peak[0]} live microbatches, expected all {n_microbatches}"


@pytest.mark.exercises("gpipe", "one_f_one_b")
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"], ids=schedule_ids)
def test_microbatch_counts_that_do_not_divide_the_batch_are_a_clear_error(schedule):
    pp = group_of("p", 0, (0, 1))
    stage = ShardedMLP(m00.MLPConfig(), pp)
    x, y = m00.make_batch()
    with pytest.raises(ValueError, match="cannot split a batch of 32 into 5"):
        m05.SCHEDULES[schedule](stage, ReferenceComms(pp), x, y, 5)  # before any message is sent


def _blocking_1f1b_steady_state():
    """A broken 1F1B step for p = 2: rank 0 sends its second forward with a *blocking* send while
    rank 1, also blocking, sends back the first gradient. Each waits for the other's receive."""
    comms = ReferenceComms()
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
    (["--nproc", "3"], "16 layers cannot be split evenly into 3 stages"),
    (["--microbatches", "5"], "a batch of 32 cannot be split into 5"),
    (["--microbatches", "0"], "--microbatches must be at least 1"),
])
def test_bad_arguments_are_refused_before_any_process_starts(argv, message, capsys):
    import main

    with pytest.raises(SystemExit):
        main.parse(["run", "05", *argv])
    assert message in capsys.readouterr().err
