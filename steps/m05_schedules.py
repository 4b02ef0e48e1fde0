# Generated from solutions/m05_schedules.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 05`. (skeleton ed8f07e01db8)
"""Module 05 - pipeline schedules.

Module 04 relayed the whole batch through the ranks; while one rank computes, all the others wait.
A schedule decides which rank does what, when, to shrink that waiting (the *bubble*):

* naive  - the whole batch forward through all ranks, then the whole backward. Each rank is busy
           for 1/P of the step.
* gpipe  - split the batch into M microbatches; run all M forwards, then all M backwards. Rank r
           starts its forward of microbatch m as soon as rank r-1 has sent it, so the ranks work
           at the same time. The idle fraction falls to (P-1)/(M+P-1), but every rank keeps the
           activations of all M microbatches until their backwards.
* 1f1b   - the same work, reordered: after a short warm-up of forwards, each rank alternates one
           forward and one backward, so rank r never holds more than P - r microbatches.

Every schedule is a function (stage, comms, x, y, n_microbatches) -> loss (on the last stage,
else None) that leaves this rank's gradients in its parameters, exactly those of the full-batch
loss: each microbatch's loss is divided by M, so their gradients add up to the gradient of the mean.
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
    # TODO(m05): receive (unless first), run the stage, send (unless last) or compute the loss share
    # Hint: stage.is_first and stage.is_last say where this rank's stage sits; stage.loss(logits,
    #       targets) is the last stage's cross-entropy.
    # Hint: a received input is a fresh leaf: .requires_grad_() so backward fills its .grad.
    # Hint: the receive buffer's shape is (x_mb.shape[0], stage.hidden).
    # Hint: sends.append(comms.isend_forward(output)): with blocking sends in both directions (here
    #       and in backward_step) 1F1B deadlocks.
    raise NotImplementedError('TODO(m05): receive (unless first), run the stage, send (unless last) or compute the loss share')


def backward_step(stage, comms, inp, out, sends):
    """Backward one microbatch from its (input, output): receive the output's gradient (unless
    last rank), backpropagate, send the input's gradient back (unless first rank)."""
    # TODO(m05): backpropagate this microbatch and pass the input gradient to the previous rank
    # Hint: the last rank's output is a loss: out.backward(). Elsewhere the gradient arrives from
    #       the next rank: comms.recv_backward(out.shape), then out.backward(that gradient).
    # Hint: sends.append(comms.isend_backward(inp.grad)) unless this is the first rank.
    raise NotImplementedError('TODO(m05): backpropagate this microbatch and pass the input gradient to the previous rank')


def wait_all(sends):
    """Wait for every non-blocking send of the step. Until then the tensor being sent must stay
    untouched, and its handle must be kept: on gloo a send whose handle is dropped is usually lost
    (the peer then hangs in recv) or fails with "Cannot lock pointer to unbound buffer"; a step that
    ends with sends in flight could also overwrite what the next step sends."""
    for handle in sends:
        handle.wait()


def naive(stage, comms, x, y, n_microbatches=1):
    """The whole batch forward, then backward: one microbatch, whatever `n_microbatches` says."""
    # TODO(m05): one forward_step and one backward_step of the whole batch
    raise NotImplementedError('TODO(m05): one forward_step and one backward_step of the whole batch')


def gpipe(stage, comms, x, y, n_microbatches):
    """All forwards, then all backwards; returns the batch loss on the last rank."""
    # TODO(m05): split x and y; forward every microbatch, then backward every one; wait the sends
    # Hint: keep each microbatch's (input, output) until its backward. Any backward order gives
    #       the same gradients (they are summed); the loss is the sum of the shares, detached.
    raise NotImplementedError('TODO(m05): split x and y; forward every microbatch, then backward every one; wait the sends')


def one_f_one_b(stage, comms, x, y, n_microbatches):
    """Warm-up forwards, then one forward / one backward in turn, then the remaining backwards."""
    # TODO(m05): warm up with min(P - rank - 1, M) forwards; steady state F(m + warm-up), B(m); cool down
    # Hint: keep (input, output) of the microbatches in flight in a list; backward the oldest.
    # Hint: with M < P - rank - 1 the warm-up alone forwards every microbatch (cap it at M).
    raise NotImplementedError('TODO(m05): warm up with min(P - rank - 1, M) forwards; steady state F(m + warm-up), B(m); cool down')


SCHEDULES = {"naive": naive, "gpipe": gpipe, "1f1b": one_f_one_b}


def train(schedule, stage, comms, n_microbatches: int, cfg: MLPConfig = MLPConfig()):
    """Train this rank's `stage` with `schedule` (one of SCHEDULES' values) for cfg.steps steps;
    return (stage, losses), the losses on the last stage only (elsewhere an empty list).

    The caller builds the stage (a ShardedMLP) and the comms, so it can wrap them first: the demo
    profiles them and emulates a device, and the loop here does not change."""
    optimizer = torch.optim.Adam(stage.parameters(), lr=cfg.lr)
    x, y = (t.to(comms.device) for t in make_batch(cfg))
    losses = []
    for _ in range(cfg.steps):
        optimizer.zero_grad()
        loss = schedule(stage, comms, x, y, n_microbatches)
        optimizer.step()
        if stage.is_last:
            losses.append(loss.item())
    return stage, losses
