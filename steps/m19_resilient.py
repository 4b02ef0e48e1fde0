# Generated from solutions/m19_resilient.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 19`. (skeleton 41a18a6f6b6a)
"""Module 19, part 4 - training that survives its failures: each start of the job resumes from the last
complete checkpoint, so a run whose ranks are killed at random steps computes the same losses, step
for step, as a run that was never interrupted.

Under `torchrun --max-restarts N`, a rank that dies (or fails a collective, m19_detect) ends its
attempt: the agent stops the other ranks and starts all of them again, in fresh processes, up to N
times. Each fresh process builds the model from the seed, then `train` finds the last complete
checkpoint under the checkpointer's root (module 17's `latest_checkpoint`: never a .partial one) and
continues from it. The steps after that checkpoint were done by the failed attempt and are done
again: that is the work a failure loses (m19_goodput prices it).

For the resumed run to compute what the uninterrupted one computes, bit for bit, every input of
every later step must be what it would have been: the weights, AdamW's moments and step count
(module 17's state_dict), and the data the steps read next (m19_data's position). The losses so far
travel with them, so the curve is whole at the end. What else a run keeps between steps, and where
it lives after a restart, is `training_state`'s question.
"""
from __future__ import annotations

import torch

from .m17_checkpoint import latest_checkpoint, load


def training_state(sampler, losses: list[float]) -> dict[str, torch.Tensor]:
    """What a checkpoint holds of the run besides the model and AdamW: module 17's state_dict saves these tensors
    under "train.NAME" and its load fills tensors of the same names and shapes in place."""
    # TODO(m19): the run's state a fresh process needs, besides the model and AdamW
    # Contract: a dict of tensors from which a process that starts with nothing but the configuration and the seed
    #   continues the run exactly: the losses so far (float64, one a step, for the curve) and everything else that
    #   decides a later step's result and is not part of the model or the optimizer. The tests kill ranks at random
    #   steps and compare every loss of the resumed runs with an uninterrupted run's, in float64, exactly.
    # The question: between two steps, what does this loop hold besides the model and AdamW? Which of it is lost
    #   with the process, and would a fresh one rebuild it differently?
    # Pitfalls: a resumed run whose reader starts again from the first batch repeats every sequence since the
    #   start and computes other losses from the first step after the resume.
    raise NotImplementedError("TODO(m19): the run's state a fresh process needs, besides the model and AdamW")


def train(model, sampler, steps: int, checkpointer, every: int, lr: float = 3e-3, n_microbatches: int = 1,
          on_step=None) -> list[float]:
    """Train `model` (module 17's ComposedLlama) on `sampler`'s batches (m19_data) up to `steps` steps, from the
    last complete checkpoint under checkpointer.root if there is one, with a checkpoint every `every` steps
    (`checkpointer`: m19_async_checkpoint's, or any object with its root, description, save, before_update and
    close). Returns every step's loss, those done before the resume included. `on_step(step, loss)` is called
    after each step (the demo times it; the tests kill a rank there)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    optimizer.register_step_pre_hook(lambda *_: checkpointer.before_update())
    losses, start = [], 0
    # TODO(m19): resume from the last complete checkpoint, if there is one
    # Contract: if checkpointer.root holds a complete checkpoint (module 17's latest_checkpoint), afterwards the
    #   model, the optimizer, the sampler and `losses` are those of its step, and `start` is that step (the first
    #   step to run); else all are as built. The checkpoint is read with module 17's load (the model, the
    #   optimizer, a training_state to fill, the directory, checkpointer.description).
    # The question: module 17's load fills tensors of the saved names and shapes in place: which tensors must exist
    #   before the load, how long is the losses tensor of checkpoint step_000k, and what must happen to the values
    #   once they are loaded?
    # Pitfalls: loading the sampler's tensors and not handing them back to the sampler leaves it at the first batch.
    raise NotImplementedError('TODO(m19): resume from the last complete checkpoint, if there is one')
    for step in range(start, steps):
        tokens, targets = sampler.next_batch()
        losses.append(model.train_step(tokens, targets, n_microbatches, optimizer))
        if every and (step + 1) % every == 0:
            checkpointer.save(model, optimizer, training_state(sampler, losses), step + 1)
        if on_step is not None:
            on_step(step, losses[-1])
    checkpointer.close()
    return losses
