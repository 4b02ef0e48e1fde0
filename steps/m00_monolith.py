# Generated from solutions/m00_monolith.py by `python -m course.skeleton`. Given code: nothing
# to fill in here; read it, then run it with `python main.py run 00`. (skeleton f9d111691b8d)
"""Module 00 - the monolith.

A 16-layer MLP (Linear + ReLU, width 128) with a 2-class head, trained with Adam on one fixed
random batch. It is small enough for any laptop; we pretend it is not. Every later module splits
this model across processes and must reproduce its loss curve, so this file is the reference the
grader compares against. It is given: there is nothing to fill in.
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class MLPConfig:
    hidden: int = 128
    layers: int = 16
    classes: int = 2
    batch: int = 32
    steps: int = 50
    lr: float = 1e-3
    seed: int = 42


class MonolithMLP(nn.Module):
    def __init__(self, cfg: MLPConfig):
        super().__init__()
        # Layers are created in order, head last: the split models rely on this order to draw the
        # same random initial weights from the same seeded stream.
        self.layers = nn.ModuleList(nn.Linear(cfg.hidden, cfg.hidden) for _ in range(cfg.layers))
        self.head = nn.Linear(cfg.hidden, cfg.classes)

    def forward(self, x):
        for layer in self.layers:
            x = F.relu(layer(x))
        return self.head(x)


def build_model(cfg: MLPConfig = MLPConfig()) -> MonolithMLP:
    torch.manual_seed(cfg.seed)
    return MonolithMLP(cfg)


def make_batch(cfg: MLPConfig = MLPConfig()):
    """The fixed batch the model learns: random inputs and random class labels.

    It has its own generator, so it is the same on every rank whatever each rank has drawn before.
    """
    generator = torch.Generator().manual_seed(cfg.seed)
    x = torch.randn(cfg.batch, cfg.hidden, generator=generator)
    y = torch.randint(0, cfg.classes, (cfg.batch,), generator=generator)
    return x, y


def train(cfg: MLPConfig = MLPConfig()) -> tuple[MonolithMLP, list[float]]:
    """Train the monolith; return (the trained model, the loss of every step)."""
    model = build_model(cfg)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    x, y = make_batch(cfg)
    losses = []
    for _ in range(cfg.steps):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return model, losses
