"""Module 14 against PyTorch's own: DistributedDataParallel with the same bucket cap (with and without
gradient accumulation under its no_sync), and ZeroRedundancyOptimizer (AdamW's state sharded over
the ranks, parameters broadcast back by their owners) against our ZeRO-1. Each comparison trains
both on the same forked gloo ranks, module 00's MLP in float64, for a few steps.

Tolerance. DDP averages each bucket (it divides by d before summing: exact for d = 2), we sum
gradients of losses already divided by the global batch; ZeroRedundancyOptimizer runs AdamW on
whole parameters, we on flat shards (elementwise, the same arithmetic). Measured (torch 2.13 CPU,
d = 2): identical weights after 3 steps, bit for bit. We allow 1e-12 all the same: over 2 ranks a
sum is a + b whatever the buffer, but over more, gloo's ring adds each value in an order that
depends on where it sits in its buffer, and DDP's buckets (rebuilt after its first step, in the
order the gradients arrived) are not laid out like ours.
"""
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

with warnings.catch_warnings():  # torch.distributed.optim imports TorchScript, which torch 2.13 deprecates
    warnings.simplefilter("ignore", DeprecationWarning)
    from torch.distributed.optim import ZeroRedundancyOptimizer

from course.impl import load, reference
from course.launch import run_ranks
from course.mesh import world_group

dp = load("m14_data_parallel")
ts = load("m14_train_step")
zero = load("m14_zero")
m00 = reference("m00_monolith")

f64 = torch.float64
MLP = m00.MLPConfig(hidden=16, layers=6, batch=8)
LR, STEPS, TOLERANCE, CAP = 1e-2, 3, 1e-12, 5000


def mlp_batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(MLP.batch, MLP.hidden, generator=g).to(f64), torch.randint(0, MLP.classes, (MLP.batch,), generator=g)


def train_pytorch(model, optimizer, n_microbatches):
    """PyTorch's way: this rank's rows, each micro-step's mean loss over m, no_sync() around every micro-step's
    forward and backward but the last; DDP averages over ranks."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    rows = MLP.batch // world_size
    for step in range(STEPS):
        x, y = (t[rank * rows:(rank + 1) * rows] for t in mlp_batch(step))
        optimizer.zero_grad()
        for i, (xi, yi) in enumerate(zip(x.chunk(n_microbatches), y.chunk(n_microbatches))):
            with model.no_sync() if i < n_microbatches - 1 else torch.enable_grad():
                (F.cross_entropy(model(xi), yi) / n_microbatches).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def train_ours(stage, n_microbatches):
    model = m00.build_model(MLP).to(f64)
    kind = {} if stage == 0 else {"kind": zero.ZeroDataParallel, "stage": stage}
    ddp = dp.replicate(model, world_group(), CAP, **kind)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=LR)
    for step in range(STEPS):
        ts.train_step(ddp, model, *mlp_batch(step), n_microbatches, optimizer)
    return [p.detach().clone() for p in model.parameters()]


def _against_ddp():
    results = {}
    for n_microbatches in (1, 2):
        theirs = DistributedDataParallel(m00.build_model(MLP).to(f64), bucket_cap_mb=CAP / 2 ** 20)
        results[n_microbatches] = (train_ours(0, n_microbatches),
                                   train_pytorch(theirs, torch.optim.AdamW(theirs.parameters(), lr=LR), n_microbatches))
    return results


def _against_zero_redundancy_optimizer():
    theirs = DistributedDataParallel(m00.build_model(MLP).to(f64), bucket_cap_mb=CAP / 2 ** 20)
    optimizer = ZeroRedundancyOptimizer(theirs.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
    return train_ours(1, 1), train_pytorch(theirs, optimizer, 1)


def gap(ours, theirs) -> float:
    return max((a - b).abs().max().item() for a, b in zip(ours, theirs, strict=True))


@pytest.mark.exercises("DataParallel.ready", "DataParallel.finish", "assign_buckets",
                        "broadcast_from_first", "train_step")
def test_same_weights_as_distributed_data_parallel():
    for rank, results in enumerate(run_ranks(_against_ddp, 2, timeout=60)):
        for n_microbatches, (ours, theirs) in results.items():
            worst = gap(ours, theirs)
            assert worst <= TOLERANCE, (f"rank {rank}, {n_microbatches} micro-step(s): the weights after {STEPS} steps "
                                        f"differ from DistributedDataParallel's by {worst:.2e} (tolerance {TOLERANCE:g})")


@pytest.mark.exercises("shard_range", "ZeroDataParallel.launch", "ZeroDataParallel.step", "DataParallel.ready",
                        "DataParallel.finish", "train_step")
def test_zero_1_same_weights_as_zero_redundancy_optimizer():
    for rank, (ours, theirs) in enumerate(run_ranks(_against_zero_redundancy_optimizer, 2, timeout=60)):
        worst = gap(ours, theirs)
        assert worst <= TOLERANCE, (f"rank {rank}: ZeRO-1's weights after {STEPS} steps differ from "
                                    f"ZeroRedundancyOptimizer's by {worst:.2e} (tolerance {TOLERANCE:g})")
