"""Module 19, part 2 - a data position that survives a restart.

Module 17's run draws random windows of the text, with replacement, from one generator: its state is
the whole data position. Real pre-training reads a fixed set of sequences once an epoch, in a
shuffled order, and must neither repeat a sequence nor skip one when a failure restarts the job in
fresh processes: the processes' memory is gone, and what is left is the checkpoint.

`ShuffledSequences` is such a reader. The training text is cut into n windows of T + 1 tokens (window
k starts at token k (T + 1); the tail that does not fill a window is never read). Epoch e visits
every window once, in an order drawn from one generator seeded once (the same generator draws epoch
after epoch, as a torch DataLoader's shuffling sampler does). A global batch is the next B windows of
that order; the batch that crosses the end of an epoch takes its last windows from the next epoch's
order. Every rank reads the same global batch, and each data rank trains on its own rows of it
(module 17's ComposedLlama.share): so the position is one number for the whole job, and a job
restarted on another mesh (another d) reads on from the same place.

What the checkpoint must hold so that a fresh process continues the sequence of batches exactly, and
in a size that does not grow with the data (a real corpus has billions of sequences), is `state`'s
question.
"""
from __future__ import annotations

import torch


class ShuffledSequences:
    """The windows of `data` (int64 token ids) of seq_len + 1 tokens, `batch` at a time, in an order shuffled
    once an epoch by a generator seeded with `seed`."""

    def __init__(self, data: torch.Tensor, seq_len: int, batch: int, seed: int = 0):
        n = len(data) // (seq_len + 1)
        if n < 1 or batch < 1:
            raise ValueError(f"{len(data)} tokens make {n} windows of {seq_len + 1}; a batch of {batch} needs at least one")
        self.windows = data[:n * (seq_len + 1)].view(n, seq_len + 1)
        self.batch, self.seed = batch, seed
        self.generator = torch.Generator().manual_seed(seed)
        self.epoch, self.position = 0, 0                   # the window of self.order to read next
        self.order = self.draw_order()

    @property
    def n_sequences(self) -> int:
        return self.windows.shape[0]

    def draw_order(self) -> torch.Tensor:
        """The next epoch's order of the windows, from the generator (given)."""
        return torch.randperm(self.n_sequences, generator=self.generator)

    def next_ids(self) -> torch.Tensor:
        """The ids of the next global batch's B windows, in order, moving on to the next epoch's order as the
        current one runs out (given)."""
        ids = []
        while len(ids) < self.batch:
            if self.position == self.n_sequences:
                self.epoch, self.position = self.epoch + 1, 0
                self.order = self.draw_order()
            take = min(self.batch - len(ids), self.n_sequences - self.position)
            ids += self.order[self.position:self.position + take].tolist()
            self.position += take
        return torch.tensor(ids)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next global batch: tokens and targets (B, T), the targets the tokens shifted by one (given)."""
        windows = self.windows[self.next_ids()]
        return windows[:, :-1], windows[:, 1:]

    def state(self) -> dict[str, torch.Tensor]:
        """Where the reader is, as tensors a checkpoint can hold (DCP saves each; module 17's load fills tensors of
        the same names and shapes in place)."""
        # >>> TODO(m19): the data position, as tensors of a fixed size
        # Contract: a dict of tensors whose shapes never change (not with the position, nor with the number of
        #   windows: the tests compare the total size for 100 and 100,000 windows), such that a ShuffledSequences
        #   made from the same data, seq_len, batch and seed, then given restore(state()), returns from then on
        #   exactly the batches this one returns, across any number of epoch ends (the tests cut at every step of
        #   several epochs, at an epoch's end included).
        # The question: what decides every batch still to come? The current epoch's order is needed to finish the
        #   epoch, and the generator has already moved past the draw that made it: what, of a fixed size, lets a
        #   fresh reader get that same order back?
        # Pitfalls: the generator's state as it is now draws the *next* epoch's order, not this one's: a reader
        #   restored from it finishes the epoch in another order, repeating some windows and skipping others. The
        #   order itself is as long as the data.
        # Hint 1: a fresh reader with the same seed draws epoch 0's order, then epoch 1's, ...: how many draws does it
        #   take to be where this reader is?
        # Hint 2: the epoch and the position in it (two numbers, whatever the number of sequences); restore
        #   reseeds the generator and draws epoch + 1 orders.
        # Hint 3: return {"epoch": torch.tensor(self.epoch), "position": torch.tensor(self.position)}
        return {"epoch": torch.tensor(self.epoch), "position": torch.tensor(self.position)}
        # <<<

    def restore(self, state: dict[str, torch.Tensor]):
        """Continue from a position `state()` returned, here or in another process (same data, T, B, seed)."""
        # >>> TODO(m19): back to a saved data position
        # Contract: afterwards this reader returns exactly the batches the reader that produced `state` returns
        #   from that point on; it may have been used before (restore replaces its position).
        # The question: the inverse of state(): which orders must the generator draw again, from where?
        # Hint 1: the generator's state is not saved: how does a fresh reader come to hold the order of epoch e?
        # Hint 2: a reseeded generator that draws the orders of epochs 0, 1, ..., e is where this reader was when
        #   it drew epoch e's order; the position then says where in it.
        # Hint 3: self.generator.manual_seed(self.seed)
        #         for _ in range(epoch + 1): self.order = self.draw_order()
        #         self.epoch, self.position = epoch, position
        epoch, position = int(state["epoch"]), int(state["position"])
        self.generator.manual_seed(self.seed)
        for _ in range(epoch + 1):
            self.order = self.draw_order()
        self.epoch, self.position = epoch, position
        # <<<
