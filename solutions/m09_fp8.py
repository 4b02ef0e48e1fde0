"""Module 09 - FP8 matmuls: train the same small model with FP8 linears and with fp32 ones.

The model is a stack of pre-norm residual feed-forward blocks (the MLP half of a transformer
block) on a fixed synthetic task: inputs labelled by a random "teacher" network. Every linear
calls `policy.linear(x, w)`, so the FP8 run and the reference run differ only in the policy
object. The Llama block of module 06 takes the same policy; this stand-in keeps the demo
self-contained and fast on a CPU.

All matmuls here are far below the size where FP8 pays off (see `python main.py bench 09`), so
the demo forces FP8 everywhere (min_dim=0): it shows that training *works* in FP8, not that it
is faster.
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .m09_fp8_matmul import FP8Matmul, HighPrecisionMatmul

TITLE = "FP8 matmuls: scaled e4m3/e5m2 linears, forward and backward"
NPROC = 1


@dataclass(frozen=True)
class StackConfig:
    width: int = 64      # every dimension a multiple of 16, as FP8 matmuls need
    hidden: int = 256
    blocks: int = 4
    classes: int = 16
    tokens: int = 256    # one fixed batch of token vectors
    steps: int = 100
    lr: float = 1e-3
    seed: int = 0


class FeedForwardStack(nn.Module):
    """x -> blocks of x + W2 relu(W1 rmsnorm(x)) -> rmsnorm -> head. All matmuls go through `policy`."""

    def __init__(self, cfg: StackConfig, policy):
        super().__init__()
        self.policy = policy
        torch.manual_seed(cfg.seed)
        # Same initial weights whatever the policy: the runs differ only in how they multiply.
        self.up = nn.ParameterList(_weight(cfg.hidden, cfg.width) for _ in range(cfg.blocks))
        self.down = nn.ParameterList(_weight(cfg.width, cfg.hidden) for _ in range(cfg.blocks))
        self.head = _weight(cfg.classes, cfg.width)

    def forward(self, x):
        for up, down in zip(self.up, self.down):
            h = F.relu(self.policy.linear(F.rms_norm(x, x.shape[-1:]), up))
            x = x + self.policy.linear(h, down)
        return self.policy.linear(F.rms_norm(x, x.shape[-1:]), self.head)


def _weight(out_features: int, in_features: int) -> nn.Parameter:
    return nn.Parameter(torch.randn(out_features, in_features) / in_features ** 0.5)


def make_task(cfg: StackConfig):
    """Random inputs, labelled by a random two-layer teacher (its own generator: fixed data)."""
    generator = torch.Generator().manual_seed(cfg.seed + 1)
    x = torch.randn(cfg.tokens, cfg.width, generator=generator)
    teacher_1 = torch.randn(cfg.width, cfg.hidden, generator=generator)
    teacher_2 = torch.randn(cfg.hidden, cfg.classes, generator=generator)
    labels = (torch.tanh(x @ teacher_1) @ teacher_2).argmax(dim=-1)
    return x, labels


def train(policy, cfg: StackConfig = StackConfig()) -> list[float]:
    """Train the stack with `policy` for its linears; return the loss of every step."""
    model = FeedForwardStack(cfg, policy)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    x, labels = make_task(cfg)
    losses = []
    for _ in range(cfg.steps):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), labels)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def add_args(parser):
    parser.add_argument("--steps", type=int, default=StackConfig.steps, help="training steps")


def check_args(args):
    if args.steps < 1:
        raise ValueError(f"--steps must be at least 1, got {args.steps}")


def demo(args):
    cfg = StackConfig(steps=args.steps)
    print(f"Training a {cfg.blocks}-block feed-forward stack (width {cfg.width}, hidden {cfg.hidden}, "
          f"{cfg.tokens} tokens) with fp32 linears and with FP8 linears:")
    reference = train(HighPrecisionMatmul(), cfg)
    fp8 = train(FP8Matmul(min_dim=0), cfg)  # force FP8: every matmul here is tiny
    print(f"  {'step':>4}  {'fp32 loss':>10}  {'fp8 loss':>10}  {'difference':>10}")
    for step in [*range(0, cfg.steps, max(1, cfg.steps // 10)), cfg.steps - 1]:
        print(f"  {step:4d}  {reference[step]:10.5f}  {fp8[step]:10.5f}  {fp8[step] - reference[step]:+10.5f}")
