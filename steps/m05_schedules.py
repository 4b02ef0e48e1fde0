# Generated from solutions/m05_schedules.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 05`. (skeleton fbaa24a75b83)
"""Module 05 - pipeline schedules.

Module 04 relayed the whole batch through the ranks; while one rank computes, all the others wait.
A schedule decides which rank does what, when, to shrink that waiting (the *bubble*). With p
pipeline ranks and the batch split into m microbatches:

* naive  - the whole batch forward through all ranks, then the whole backward. Each rank is busy
           for 1/p of the step.
* gpipe  - run all m forwards, then all m backwards. Rank r starts its forward of microbatch i
           as soon as rank r-1 has sent it, so the ranks work at the same time. The idle fraction
           falls to (p-1)/(m+p-1), but every rank keeps the activations of all m microbatches
           until their backwards.
* 1f1b   - the same work, reordered: after a short warm-up of forwards, each rank alternates one
           forward and one backward, so rank r never holds more than p - r microbatches.

Here rank r is a place in the pipeline (comms.pp.index, 0 .. p - 1): the pipeline is a group of
ranks (course/mesh.py's `Group`), every rank of the job or one axis of a bigger mesh.

Every schedule is a function (stage, comms, x, y, n_microbatches) -> loss (on the last stage,
else None) that leaves this rank's gradients in its parameters, exactly those of the full-batch
loss: each microbatch's loss is divided by m, so their gradients add up to the gradient of the mean.
`fit` (given) is the pipeline track's one training loop: module 05's `train` runs a schedule in it,
and module 11's executor plugs into it too.
"""
import torch

from .m00_monolith import MLPConfig, make_batch


def split_microbatches(batch: torch.Tensor, n_microbatches: int) -> list[torch.Tensor]:
    """`n_microbatches` equal microbatches along dimension 0, or a ValueError if they cannot be equal.

    Equal sizes matter: a receiving rank sizes its buffer from the microbatch size.
    """
    if n_microbatches < 1 or batch.shape[0] % n_microbatches != 0:
        raise ValueError(f"cannot split a batch of {batch.shape[0]} into {n_microbatches} equal microbatches; "
                         f"use a number of microbatches that divides {batch.shape[0]}")
    return list(batch.chunk(n_microbatches))


def forward_step(stage, comms, x_mb, y_mb, n_microbatches, sends):
    """Forward one microbatch on this rank; return (input, output) for its backward_step.

    The input comes from x_mb on the first rank, from the previous rank elsewhere; the output goes
    to the next rank with a non-blocking send (its handle is appended to `sends`). On the last
    rank the output is this microbatch's share of the loss: its cross-entropy divided by `n_microbatches`.
    """
    # TODO(m05): forward one microbatch through this stage and hand its result on
    # Contract: x_mb (rows, features) and y_mb (rows,) are this microbatch's inputs and labels, the
    # same on every rank; only the first stage reads x_mb, only the last y_mb. Returns (inp, out),
    # which backward_step gets back for this microbatch: inp is what this stage consumed, out
    # what it produced. On a later stage inp arrives from the previous rank (rows, stage.hidden)
    # and must collect its gradient during the backward, like module 01's leaf at the cut. On
    # the last stage out is this microbatch's share of the batch loss: its cross-entropy (the
    # stage's own `loss` method, ShardedMLP.loss) divided by n_microbatches, because the batch
    # loss is the mean of the m microbatch means. On every other stage out is the activation, sent
    # to the next rank without blocking: its handle goes into `sends`, and nobody waits for it
    # here (the schedule waits for all of them at the end of the step).
    # Pitfalls:
    # - a received input that does not require grad: its .grad stays None, and backward_step
    #   later sends None. The comms refuse it ("isend_backward got NoneType, not a tensor");
    #   comms without that check fail inside the send with "'NoneType' object has no attribute
    #   'contiguous'". Both mean exactly this.
    # - a share without the 1/m: every gradient m times too large; the grader reports
    #   |got|/|autograd| = m and asks whether each microbatch loss is divided by m.
    # - a blocking send here and in backward_step: in 1F1B's steady state two neighbours each
    #   wait in their send for the other's receive. The grader stops the ranks after its timeout
    #   and names the lines they were stuck on (send_forward on one, send_backward on the other).
    # - the receive buffer has the microbatch's rows and the stage's width, not x_mb's shape.
    raise NotImplementedError('TODO(m05): forward one microbatch through this stage and hand its result on')


def backward_step(stage, comms, inp, out, sends):
    """Backward one microbatch from its (input, output): receive the output's gradient (unless
    last rank), backpropagate, send the input's gradient back (unless first rank)."""
    # TODO(m05): backpropagate one microbatch and hand its input gradient back
    # Contract: (inp, out) are what forward_step returned for this microbatch. Afterwards this
    # microbatch's gradient has been added into every parameter's .grad (autograd accumulates,
    # which is how the m microbatches' gradients sum to the batch's), and, on every stage but the
    # first, dloss/dinp has been sent to the previous rank without blocking, its handle in
    # `sends`. Returns nothing.
    # The maths: on the last stage out is a scalar loss share, so the backward starts from it.
    # Elsewhere the next rank sends dloss/dout (out's shape); backpropagating out with it is
    # module 01's vector-Jacobian product, and it leaves dloss/dinp in inp's .grad.
    # Pitfalls:
    # - "isend_backward got NoneType, not a tensor" (or, from comms without that check,
    #   "'NoneType' object has no attribute 'contiguous'" inside the send): the gradient sent is
    #   None, because forward_step's received input does not require grad.
    # - a receive on the last stage or a send from the first: the comms' clear error ("rank r is
    #   the last stage: it has no next rank to recv_backward with").
    # - a blocking send here and in forward_step deadlocks 1F1B (see forward_step): the grader's
    #   timeout names the line each rank is stuck on.
    # - a wrong (inp, out) pair is the schedule's mistake, not this one's: see one_f_one_b.
    raise NotImplementedError('TODO(m05): backpropagate one microbatch and hand its input gradient back')


def wait_all(sends):
    """Wait for every non-blocking send of the step. Until then the tensor being sent must stay
    untouched, and its handle must be kept: on gloo a send whose handle is dropped is usually lost
    (the peer then hangs in recv) or fails with "Cannot lock pointer to unbound buffer"; a step that
    ends with sends in flight could also overwrite what the next step sends."""
    for handle in sends:
        handle.wait()


def naive(stage, comms, x, y, n_microbatches=1):
    """The whole batch forward, then backward: one microbatch, whatever `n_microbatches` says."""
    # TODO(m05): run the whole batch as a single microbatch, forward then backward
    # Contract: the whole batch (x, y) is one microbatch, whatever n_microbatches says, so its
    # loss share is the whole loss. Afterwards this rank's parameters hold the full-batch
    # gradients and every send of the step has completed. Returns the batch loss, a detached
    # scalar tensor, on the last stage (the caller calls .item()), and None on every other.
    # The result must be the monolith's bit for bit (the grader compares with ==).
    # Pitfalls:
    # - handing n_microbatches on: the demo passes the command line's count to every schedule,
    #   and a loss divided by m is no longer the monolith's; the grader runs naive with m = 8.
    # - not waiting for the sends: on gloo a send whose handle is dropped is usually lost, and
    #   the peer then hangs in its recv_forward / recv_backward. The grader's timeout report shows
    #   only those receives, and says nothing about the dropped handles: that is the sign.
    # - a loss on a rank that is not the last: the grader says only the last rank has a loss.
    raise NotImplementedError('TODO(m05): run the whole batch as a single microbatch, forward then backward')


def gpipe(stage, comms, x, y, n_microbatches):
    """All forwards, then all backwards; returns the batch loss on the last rank."""
    # TODO(m05): run GPipe: all m forwards, then all m backwards, and return the batch loss
    # Contract: split x and y into n_microbatches (m) equal microbatches with split_microbatches
    # (given: it raises the ValueError the grader expects, before any message, when m does not
    # divide the batch). Forward microbatches 0 .. m-1 in that order, keeping each one's
    # (inp, out) until its backward; then run every microbatch's backward; wait for every send
    # before returning. Returns the batch loss on the last stage (the sum of the m shares,
    # each already divided by m, detached), None elsewhere.
    # The maths: the gradients of the shares add up to the full batch's gradient, in any backward
    # order (each depends only on the fixed weights and its own activations), equal to it within
    # float32 rounding (the grader allows a relative 1e-5). Memory: every microbatch's activations
    # live from its forward to its backward, so each rank holds all m at the peak; the grader
    # counts them from autograd's saved tensors and checks the order F0 .. F(m-1), then the Bs.
    # Pitfalls:
    # - the same order of microbatches on every rank: a neighbour receives the messages in the
    #   order they were sent.
    # - the mean of the shares instead of their sum: the returned loss is m times too small (the
    #   grader prints it beside the full-batch loss).
    # - forgetting the final wait: on gloo the dropped sends are usually lost and a peer hangs
    #   in recv; the timeout report shows only the receive, nothing about the handles.
    raise NotImplementedError('TODO(m05): run GPipe: all m forwards, then all m backwards, and return the batch loss')


def one_f_one_b(stage, comms, x, y, n_microbatches):
    """Warm-up forwards, then one forward / one backward in turn, then the remaining backwards."""
    # TODO(m05): run 1F1B: warm up with forwards, alternate one forward and one backward, then cool down
    # Contract: the same inputs, gradients (within rounding), return value and waited sends as
    # gpipe, in another order. On pipeline rank r of p (comms.pp.index, comms.pp.size): a warm-up of
    # forwards only; a steady state in which each forward of the next microbatch is followed by
    # the backward of the oldest microbatch in flight; a cool-down of the backwards left.
    # The invariant to derive the warm-up from: in the steady state every stage after this one
    # is busy with a microbatch this rank has forwarded and not yet backwarded, one each, so the
    # warm-up must fill the pipeline behind this rank exactly (the last stage needs none) and no
    # more. Then rank r holds at most p - r microbatches' activations (all m if m is smaller), as
    # against m for GPipe. Backwards go oldest first: the next gradient to arrive is the oldest's.
    # What the grader checks: the exact F/B order on every rank (it prints the one expected), the
    # peak of live microbatches counted from autograd's saved tensors, the gradients, 50 steps.
    # Pitfalls:
    # - m smaller than the warm-up you derived: forwards of microbatches that do not exist (an
    #   IndexError); the grader runs m = 1 and 2 on 4 ranks.
    # - a warm-up one too long or too short: that rank's order and peak differ from the expected.
    # - the newest microbatch backwarded instead of the oldest: the gradient received is applied
    #   to another microbatch's graph. The losses leave the monolith's, and the gradient check
    #   asks whether each backward uses its own microbatch's saved input and output.
    # - blocking sends in both helpers: the steady state deadlocks (see forward_step).
    # - forgetting the final wait: on gloo the dropped sends are usually lost and a peer hangs
    #   in recv; the timeout report shows only the receive, nothing about the handles.
    raise NotImplementedError('TODO(m05): run 1F1B: warm up with forwards, alternate one forward and one backward, then cool down')


SCHEDULES = {"naive": naive, "gpipe": gpipe, "1f1b": one_f_one_b}


def fit(run_step, parameters, cfg: MLPConfig = MLPConfig(), device=torch.device("cpu"), on_step=None) -> list[float]:
    """The pipeline track's one training loop (given): Adam on the monolith's batch for cfg.steps
    steps; returns this rank's losses, one a step on the rank holding the last stage (elsewhere an
    empty list).

    `run_step(x, y)` runs one step's forwards and backwards on this rank and returns the batch loss
    where the last stage is, else None: module 05's `train` hands it a schedule on this rank's
    stage, module 11's its executor. `on_step(step, loss)`, if given, is called after each step's
    backwards and before the optimizer moves the weights, so the parameters' .grad are that step's
    (the benchmarks keep the first step's to compare with PyTorch's); `loss` is None off the last
    stage."""
    optimizer = torch.optim.Adam(parameters, lr=cfg.lr)
    x, y = (t.to(device) for t in make_batch(cfg))
    losses = []
    for step in range(cfg.steps):
        optimizer.zero_grad()
        loss = run_step(x, y)
        loss = None if loss is None else loss.item()
        if on_step is not None:
            on_step(step, loss)
        optimizer.step()
        if loss is not None:
            losses.append(loss)
    return losses


def train(schedule, stage, comms, n_microbatches: int, cfg: MLPConfig = MLPConfig(), on_step=None):
    """Train this rank's `stage` with `schedule` (one of SCHEDULES' values) for cfg.steps steps, in
    `fit`; return (stage, losses), the losses on the last stage only (elsewhere an empty list).

    The caller builds the stage (a ShardedMLP) and the comms, so it can wrap them first: the demo
    profiles them and emulates a device, and the loop here does not change."""
    losses = fit(lambda x, y: schedule(stage, comms, x, y, n_microbatches), stage.parameters(), cfg, comms.device,
                 on_step)
    return stage, losses
