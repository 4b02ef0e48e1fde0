# Generated from solutions/m01_manual_split.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 01`. (skeleton 922e42c68a1b)
"""Module 01 - a manual split.

The monolith cut in two: part one holds layers 0-7, part two holds layers 8-15 and the head. Both
live in one process, but we drive them as if they were on two devices: the activation that leaves
part one is handed over as a fresh leaf tensor (what a receiving device would get), and its
gradient is handed back by hand. The loss curve must equal the monolith's bit for bit.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from .m00_monolith import MLPConfig, make_batch


class PartOne(nn.Module):
    """The first half of the layers."""

    def __init__(self, cfg: MLPConfig):
        super().__init__()
        # Given. The monolith's first cfg.layers // 2 layers, made exactly as MonolithMLP.__init__ makes
        # them (steps/m00_monolith.py): one after the other, in a ModuleList, which registers them as
        # parameters (a plain list would hide them from .parameters(), so from the optimizer). Right after
        # the seed, in the same order, they take the same random draws, so they start equal to the
        # monolith's layers 0 .. k-1 without copying anything. Part two is yours.
        self.layers = nn.ModuleList(nn.Linear(cfg.hidden, cfg.hidden) for _ in range(cfg.layers // 2))

    def forward(self, x):
        for layer in self.layers:
            x = F.relu(layer(x))
        return x


class PartTwo(nn.Module):
    """The second half of the layers, then the classification head."""

    def __init__(self, cfg: MLPConfig):
        super().__init__()
        # TODO(m01): give part two the remaining hidden layers and the classification head
        # Contract: forward (given) applies self.layers in order, then self.head. Afterwards the two
        # parts together register exactly the monolith's parameters, no more and no fewer, and after
        # build_parts each equals the monolith's in the same place (hidden layer i, the head), bit for
        # bit, although nothing is copied from a monolith. The grader also builds a 5-layer model.
        # The question: build_parts creates part two right after part one, from the same stream;
        # what does the monolith draw after its first k layers, and in what order?
        # Pitfalls: is "the rest" of an odd number of layers the same count as half of it? Which
        # of part two's tensors would get which draws if they were created in another order?
        raise NotImplementedError('TODO(m01): give part two the remaining hidden layers and the classification head')

    def forward(self, x):
        for layer in self.layers:
            x = F.relu(layer(x))
        return self.head(x)


def build_parts(cfg: MLPConfig = MLPConfig()):
    # One seed, then part one before part two: the same random stream, in the same order, as the
    # monolith's construction, so both halves start from the monolith's weights.
    torch.manual_seed(cfg.seed)
    return PartOne(cfg), PartTwo(cfg)


def train_step(part_one: PartOne, part_two: PartTwo, optimizer, x, y) -> float:
    """One training step across the boundary between the parts; returns the loss."""
    optimizer.zero_grad()
    # TODO(m01): forward and backward through both parts, handing the gradient back across the cut
    # Contract: x (batch, hidden) is the batch, y (batch,) its class labels. Afterwards every
    # parameter of both parts holds in .grad exactly what one backward pass through the monolith
    # leaves there (bit for bit), and `loss` is the scalar loss tensor: the cross-entropy, averaged
    # over the batch, of part two's logits against y (the given lines below step the optimizer and
    # return its value). Part two receives its input as from another device: a tensor with part
    # one's output's values, no autograd history, that requires grad (the grader checks it).
    # The question: a backward from the loss stops at that tensor. What has to cross the cut back
    # to part one, and how does part one's backward start from it?
    # Pitfalls: what does .grad hold, after a backward, on a tensor that does not require grad?
    # What do part one's parameters hold if nothing starts a backward on part one's side? Does
    # anything you add (a scale, a sum over the batch) change the monolith's arithmetic?
    raise NotImplementedError('TODO(m01): forward and backward through both parts, handing the gradient back across the cut')
    optimizer.step()
    return loss.item()


def train(cfg: MLPConfig = MLPConfig()) -> tuple[nn.Sequential, list[float]]:
    """Train the two parts; return (the trained model, the loss of every step). The model is the
    two parts in a row: the same function as the monolith, cut in two."""
    part_one, part_two = build_parts(cfg)
    optimizer = torch.optim.Adam([*part_one.parameters(), *part_two.parameters()], lr=cfg.lr)
    x, y = make_batch(cfg)
    losses = [train_step(part_one, part_two, optimizer, x, y) for _ in range(cfg.steps)]
    return nn.Sequential(part_one, part_two), losses
