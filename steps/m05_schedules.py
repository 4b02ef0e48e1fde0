# Generated from solutions/m05_schedules.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 05`. (skeleton accf1e028d67)
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
loss: the microbatches' gradients, added up by autograd, are the gradient of the batch's mean loss.
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
    rank the output is this microbatch's share of the batch loss.
    """
    # TODO(m05): forward one microbatch through this stage and hand its result on
    # Contract: x_mb (rows, features) and y_mb (rows,) are this microbatch's inputs and labels, the
    # same on every rank; only the first stage reads x_mb, only the last y_mb. Returns (inp, out),
    # which backward_step gets back for this microbatch: inp is what this stage consumed, out
    # what it produced. On a later stage inp arrives from the previous rank, (rows, stage.hidden),
    # and collects its gradient during the backward. On the last stage out is this microbatch's
    # share of the batch loss, a scalar from the stage's own `loss` method (ShardedMLP.loss): the
    # m shares of a step, added up, are the full batch's loss, the mean over all its rows (the
    # microbatches are equal), and their gradients add up to its gradient. On every other stage
    # out is the activation, sent to the next rank without blocking: its handle goes into
    # `sends`, and nobody waits for it here (the schedule waits for all of them at the step's end).
    # The question: what must one microbatch's share be for the m shares to add up to the batch's
    # mean, and what makes a received input collect its gradient?
    # Pitfalls: what can backward_step send back if the received input never gets a .grad? Can
    # two neighbours that each wait in a send for the other's receive happen in 1F1B's steady
    # state? How wide is what arrives, when the first stage's input is wider than the
    # activations (the grader's float64 model)?
    raise NotImplementedError('TODO(m05): forward one microbatch through this stage and hand its result on')


def backward_step(stage, comms, inp, out, sends):
    """Backward one microbatch from its (input, output), as one stage of the relay."""
    # TODO(m05): backpropagate one microbatch and hand its input gradient back
    # Contract: (inp, out) are what forward_step returned for this microbatch. Afterwards this
    # microbatch's gradient has been added into every parameter's .grad (autograd accumulates,
    # which is how the m microbatches' gradients sum to the batch's), and the stage before this
    # one, if there is one, has been sent what its own backward of this microbatch needs, without
    # blocking (the handle in `sends`); the stage after this one, if any, sends this stage the
    # same. Returns nothing.
    # The question: where does this stage's backward start, on the last stage and on the others,
    # and what does the stage before it need to start its own?
    # Pitfalls: which stages have nothing to receive, which nothing to send? When the first
    # stage's input is wider than its output, which shape has the gradient that arrives? What is
    # in inp.grad if forward_step's received input does not require grad?
    raise NotImplementedError('TODO(m05): backpropagate one microbatch and hand its input gradient back')


def wait_all(sends):
    """Wait for every non-blocking send of the step. Until then the tensor being sent must stay
    untouched, and its handle must be kept: on gloo a send whose handle is dropped is usually lost
    (the peer then hangs in recv) or fails with "Cannot lock pointer to unbound buffer"; a step that
    ends with sends in flight could also overwrite what the next step sends."""
    for handle in sends:
        handle.wait()


def naive(stage, comms, x, y, n_microbatches=1):
    """The whole batch forward, then backward: one microbatch, whatever `n_microbatches` says (the
    demo hands every schedule the command line's count). It is GPipe with a single microbatch: its
    share of the loss is the whole loss, so the result is the monolith's bit for bit."""
    return gpipe(stage, comms, x, y, 1)


def gpipe(stage, comms, x, y, n_microbatches):
    """All forwards, then all backwards; returns the batch loss on the last rank."""
    # TODO(m05): run GPipe: all m forwards, then all m backwards, and return the batch loss
    # Contract: split x and y into n_microbatches (m) equal microbatches with split_microbatches
    # (given: it raises the ValueError the grader expects, before any message, when m does not
    # divide the batch). Every rank forwards microbatches 0 .. m-1 in that order, then runs every
    # microbatch's backward; every send of the step has completed when it returns. Returns the
    # batch loss on the last stage, a scalar tensor with no autograd history, None elsewhere.
    # Gradients: the full batch's, within float32 rounding (relative 1e-5; 1e-10 in float64).
    # naive (given) is gpipe with m = 1 and must equal the monolith bit for bit. Memory: each
    # rank holds all m microbatches' activations at its peak (the grader counts them from
    # autograd's saved tensors), and none once the step is over.
    # The question: what must be kept from each forward until its backward, and what does the
    # batch loss add up from?
    # Pitfalls: does the order of the backwards change the gradients? What keeps a loss that
    # still has its autograd history alive after the step? Where are the send handles waited
    # for, and what does gloo do with a send never waited for (the timeout then shows only the
    # peer's receive)?
    raise NotImplementedError('TODO(m05): run GPipe: all m forwards, then all m backwards, and return the batch loss')


def one_f_one_b(stage, comms, x, y, n_microbatches):
    """Warm-up forwards, then one forward / one backward in turn, then the remaining backwards."""
    # TODO(m05): run 1F1B: warm up with forwards, alternate one forward and one backward, then cool down
    # Contract: the same inputs, gradients (within rounding), return value and waited sends as
    # gpipe, in another order. On pipeline rank r of p (comms.pp.index of comms.pp.size, the
    # place in the pipeline, not the global rank): a warm-up of forwards only; a steady state in
    # which each forward of the next microbatch is followed by the backward of the oldest
    # microbatch in flight; a cool-down of the backwards left. At its peak rank r holds the
    # activations of min(p - r, m) microbatches, against m for GPipe: the grader counts them
    # from autograd's saved tensors, and checks the exact F/B order on every rank (it prints the
    # one expected), the gradients and 50 steps, on p = 2 and 4 with m from 1 to 32.
    # The question: how many forwards must rank r run before its first backward?
    # Pitfalls: what if m is smaller than that warm-up (the grader runs m = 1 and 2 on 4 ranks)?
    # On the last stage of a pipeline along one axis of a mesh (global ranks 2 and 3 of 4), is
    # the rank's place its global rank? Where are the sends waited for? Where is each share of
    # the loss added up, when the list of microbatches in flight is empty by the step's end?
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
