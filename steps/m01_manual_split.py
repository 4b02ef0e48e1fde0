# Generated from solutions/m01_manual_split.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 01`. (skeleton e4fa1afd8828)
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
        # TODO(m01): give part one the first half of the monolith's hidden layers
        # Contract: self.layers holds the monolith's layers 0 .. k-1, k = cfg.layers // 2 (part two
        # takes the rest), each cfg.hidden to cfg.hidden, in index order, registered as parameters of
        # this module; forward (given) applies them. After build_parts (given: one seed, then
        # PartOne, then PartTwo) each equals the monolith's layer of the same index, weight and bias,
        # bit for bit, although nothing is copied from a monolith.
        # The question: what must this constructor create, and in what order, for its layers to get
        # the very random draws that MonolithMLP.__init__ (steps/m00_monolith.py) makes for its
        # first k layers?
        # Pitfalls: would one more draw here (an extra layer, a random tensor) change what every
        # later layer gets? Does the optimizer see a layer kept where .parameters() does not look?
        raise NotImplementedError("TODO(m01): give part one the first half of the monolith's hidden layers")

    def forward(self, x):
        for layer in self.layers:
            x = F.relu(layer(x))
        return x


class PartTwo(nn.Module):
    """The second half of the layers, then the classification head."""

    def __init__(self, cfg: MLPConfig):
        super().__init__()
        # TODO(m01): give part two the remaining hidden layers and the classification head
        # Contract: self.layers holds the monolith's layers k .. cfg.layers-1 (every layer part one
        # did not take, k as in PartOne), hidden to hidden, in index order; self.head maps
        # cfg.hidden features to cfg.classes logits. Together the parts register exactly the
        # monolith's parameters, and after build_parts each equals the monolith's of the same name
        # (layer i, head), bit for bit. The grader also builds a 5-layer model.
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
