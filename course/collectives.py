"""The collectives the sharded modules call, each one written down as it is issued (given code).

`Collectives` wraps torch.distributed's all-gather, reduce-scatter and all-reduce and appends one
`Collective` record per call, so a test or a benchmark can compare what was actually sent with the
formula (module 07's payload arithmetic). A record's `payload_bytes` is what one rank contributes:
its shard for an all-gather, the shard it receives for a reduce-scatter, the whole tensor for an
all-reduce.

Names: torch 2.13 renamed `all_gather_into_tensor` / `reduce_scatter_tensor` to
`all_gather_single` / `reduce_scatter_single` and warns on the old names; older releases (the GPU
machine has 2.11) may have only the old ones. Both take (output, input, ...), so we pick whichever
exists.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class Collective:
    op: str             # "all_gather", "reduce_scatter" or "all_reduce"
    payload_bytes: int  # what this rank contributes (see the module docstring)
    label: str          # what it was for, e.g. "block 3"


class Collectives:
    """all_gather / reduce_scatter / all_reduce over the default group, logged in `self.log`."""

    def __init__(self, group=None):
        self.group, self.log = group, []

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, label: str = "", async_op: bool = False):
        """output (world_size * n,) <- every rank's shard (n,), in rank order."""
        self.log.append(Collective("all_gather", shard.nbytes, label))
        return _all_gather_single(output, shard, group=self.group, async_op=async_op)

    def reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor, label: str = "", async_op: bool = False):
        """shard (n,) <- the sum over ranks of this rank's slice of full (world_size * n,)."""
        self.log.append(Collective("reduce_scatter", shard.nbytes, label))
        return _reduce_scatter_single(shard, full, dist.ReduceOp.SUM, group=self.group, async_op=async_op)

    def all_reduce(self, tensor: torch.Tensor, label: str = "", async_op: bool = False):
        """tensor <- its sum over ranks, in place."""
        self.log.append(Collective("all_reduce", tensor.nbytes, label))
        return dist.all_reduce(tensor, dist.ReduceOp.SUM, group=self.group, async_op=async_op)

    def counts(self, op: str) -> int:
        return sum(c.op == op for c in self.log)
