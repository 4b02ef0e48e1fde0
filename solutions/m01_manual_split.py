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
        # >>> TODO(m01): create the first cfg.layers // 2 Linear(hidden, hidden) layers
        # Hint: store them in an nn.ModuleList called self.layers, created in order.
        self.layers = nn.ModuleList(nn.Linear(cfg.hidden, cfg.hidden) for _ in range(cfg.layers // 2))
        # <<<

    def forward(self, x):
        for layer in self.layers:
            x = F.relu(layer(x))
        return x


class PartTwo(nn.Module):
    """The second half of the layers, then the classification head."""

    def __init__(self, cfg: MLPConfig):
        super().__init__()
        # >>> TODO(m01): create the remaining layers (self.layers) and the head (self.head)
        # Hint: the head is Linear(hidden, classes); create it after the layers, as the monolith does.
        self.layers = nn.ModuleList(
            nn.Linear(cfg.hidden, cfg.hidden) for _ in range(cfg.layers - cfg.layers // 2))
        self.head = nn.Linear(cfg.hidden, cfg.classes)
        # <<<

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
    # >>> TODO(m01): forward through both parts and backward through both, across the boundary
    # Hint: what part two receives must be a *leaf*: hidden.detach().requires_grad_(), just as
    #       a tensor arriving from another device has no autograd history.
    # Hint: after loss.backward(), that leaf's .grad is what part one needs:
    # Hint: hidden.backward(received.grad) continues the backward pass inside part one.
    hidden = part_one(x)
    received = hidden.detach().requires_grad_()
    loss = F.cross_entropy(part_two(received), y)
    loss.backward()
    hidden.backward(received.grad)
    # <<<
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
