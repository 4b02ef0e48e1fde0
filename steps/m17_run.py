# Generated from solutions/m17_run.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 17`. (skeleton 176e8d4146d7)
"""Module 17, part 7 - a training run that survives being stopped: the composed trainer on characters
of Shakespeare (course/chars.py), a validation loss now and then, a checkpoint every k steps, and a
resume from the last complete one, on the same mesh or on another.

Module 06's `fit` draws every global batch from one generator seeded once; so does this loop. What a
checkpoint must hold for a resumed run to continue the uninterrupted one bit for bit (on the same
mesh) is therefore: the weights, AdamW's moments and step count, and the generator's state after
the last batch drawn (the data position), plus the losses so far for the curve. On another mesh the
same numbers are summed in another order: the losses agree to rounding (float64: 1e-10).
"""
from __future__ import annotations

import torch

from course.chars import CharText
from course.dataset import random_batch
from .m17_checkpoint import describe, latest_checkpoint, load, save

VALIDATION_SEED = 1234  # the validation batches: the same windows at every evaluation


def validation_loss(model, text: CharText, batch: int, n_batches: int) -> float:
    """The mean loss of `n_batches` fixed global batches of the validation text, forwards only (given)."""
    generator = torch.Generator().manual_seed(VALIDATION_SEED)
    losses = [model.evaluate(*random_batch(text.validation, batch, model.cfg.max_seq_len, generator))
              for _ in range(n_batches)]
    return sum(losses) / len(losses)


def training_state(generator: torch.Generator, losses: list[float]) -> dict:
    """What a checkpoint keeps of the run besides the model (given): the data position and the curve."""
    return {"generator": generator.get_state(), "losses": torch.tensor(losses, dtype=torch.float64)}


def train(model, text: CharText, steps: int, batch: int = 8, lr: float = 3e-3, seed: int = 0, n_microbatches: int = 1,
          checkpoint_dir=None, checkpoint_every: int = 0, resume: bool = False, eval_every: int = 0,
          eval_batches: int = 2, on_step=None, on_validation=None, checkpoint_last: bool = False, make_writer=None):
    """Train `model` (a ComposedLlama) to `steps` steps on text.train; returns (losses, validation): every
    step's loss (those before a resume included) and [(step, validation loss)]. With checkpoint_dir and
    checkpoint_every, a checkpoint every checkpoint_every steps (and with checkpoint_last, after the last
    step too); with resume, from the latest complete one. `on_step(step, loss)` and `on_validation(step,
    loss)` are called as they come; `make_writer`: see m17_checkpoint.save."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    description = describe(model.cfg, text.chars, model.moe)
    losses, validation, start = [], [], 0
    latest = latest_checkpoint(checkpoint_dir) if resume and checkpoint_dir else None
    if latest is not None:
        start = int(latest.name.removeprefix("step_"))
        state = training_state(generator, [0.0] * start)
        load(model, optimizer, state, latest, description)
        generator.set_state(state["generator"])
        losses = state["losses"].tolist()
    for step in range(start, steps):
        tokens, targets = random_batch(text.train, batch, model.cfg.max_seq_len, generator)
        # TODO(m17): one step, then (every checkpoint_every steps) its checkpoint
        # Contract: append the step's loss (model.train_step on the global batch, optimizer) to `losses`. With
        #   checkpoint_dir and checkpoint_every set, the run leaves one checkpoint (m17_checkpoint's save of the model,
        #   the optimizer, training_state(generator, losses), under checkpoint_dir, with `description` and
        #   `make_writer`) for every number of steps done that checkpoint_every divides, saved under that number.
        # The question: checkpoint "step k" is what a run that has done k steps holds; a run resumed from it draws batch
        #   k next and must compute what the uninterrupted run computes there. When in this loop's iteration is that
        #   state there, and which k is it?
        # Pitfalls: what does a checkpoint written before the optimizer's step hold beside the data position of step k?
        #   What number of steps has the loop done when `step` is 0?
        raise NotImplementedError('TODO(m17): one step, then (every checkpoint_every steps) its checkpoint')
        if on_step is not None:
            on_step(step, losses[-1])
        if eval_every and ((step + 1) % eval_every == 0 or step + 1 == steps):
            validation.append((step + 1, validation_loss(model, text, batch, eval_batches)))
            if on_validation is not None:
                on_validation(*validation[-1])
    saved_last = checkpoint_every and steps % checkpoint_every == 0
    if checkpoint_dir and checkpoint_last and steps > start and not saved_last:
        save(model, optimizer, training_state(generator, losses), checkpoint_dir, steps, description, make_writer)
    return losses, validation
