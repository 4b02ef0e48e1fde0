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
    # >>> TODO(m19): the run's state a fresh process needs, besides the model and AdamW
    # Contract: a dict of tensors from which a process that starts with nothing but the configuration and the seed
    #   continues the run exactly: the losses so far under "losses" (float64, one a step, for the curve) and, under
    #   names "data.NAME" (train below hands those back), everything else that decides a later step's result and is
    #   not part of the model or the optimizer. The tests kill ranks at random steps and compare every loss of the
    #   resumed runs with an uninterrupted run's, in float64, exactly.
    # The question: between two steps, what does this loop hold besides the model and AdamW? Which of it is lost
    #   with the process, and would a fresh one rebuild it differently?
    # Pitfalls: a resumed run whose reader starts again from the first batch repeats every sequence since the
    #   start and computes other losses from the first step after the resume.
    # Hint 1: list what the loop holds between two steps: which of it is the model's, which AdamW's, and what is left?
    # Hint 2: the weights and AdamW's moments are the optimizer's and the model's; the batches to come depend on one
    #   more thing, the reader's position, whose state() is already a dict of tensors; the losses as one float64
    #   tensor.
    # Hint 3: return {**{f"data.{k}": v for k, v in sampler.state().items()},
    #                 "losses": torch.tensor(losses, dtype=torch.float64)}
    return {**{f"data.{name}": value for name, value in sampler.state().items()},
            "losses": torch.tensor(losses, dtype=torch.float64)}
    # <<<


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
    # Resume (given: module 17's resume, with the data position handed back to the sampler): the tensors
    # training_state names are made in the shapes of checkpoint k's (k losses), load fills them in place.
    latest = latest_checkpoint(checkpointer.root)
    if latest is not None:
        start = int(latest.name.removeprefix("step_"))
        state = training_state(sampler, [0.0] * start)
        load(model, optimizer, state, latest, checkpointer.description)
        position = {name.removeprefix("data."): value for name, value in state.items() if name.startswith("data.")}
        if not position:
            raise ValueError(f"resuming from {latest.name}: your training_state holds nothing of the sampler's (no "
                             f"'data.NAME' entry), so the resumed run would read its batches from the first one again")
        sampler.restore(position)
        losses = state["losses"].tolist()
    for step in range(start, steps):
        tokens, targets = sampler.next_batch()
        losses.append(model.train_step(tokens, targets, n_microbatches, optimizer))
        if every and (step + 1) % every == 0:
            checkpointer.save(model, optimizer, training_state(sampler, losses), step + 1)
        if on_step is not None:
            on_step(step, losses[-1])
    checkpointer.close()
    return losses
