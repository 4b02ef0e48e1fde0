"""The collectives the sharded modules call, each one written down as it is issued (given code).

`Collectives` wraps torch.distributed's all-gather, reduce-scatter and all-reduce and appends one
`Collective` record per call, so a test or a benchmark can compare what was actually sent with the
formula (module 07's payload arithmetic, module 12's traffic). A record's `payload_bytes` is what
one rank contributes: its shard for an all-gather, the shard it receives for a reduce-scatter, the
whole tensor for an all-reduce. Its `sent_bytes` is what one rank sends over the wire with the
bandwidth-optimal (ring) algorithms: (n - 1) shards for an all-gather or a reduce-scatter over n
ranks, and 2 (n - 1) / n of the tensor for an all-reduce (a reduce-scatter, then an all-gather).

All-gather and reduce-scatter work along any dimension (`dim`): module 12 shards activations along
the sequence, dimension 1 of (batch, seq, dim). The collective itself always moves contiguous
blocks in rank order, so along another dimension the wrapper cuts the full tensor into its rank
blocks first (reduce-scatter) or lays the received blocks side by side afterwards (all-gather; with
async_op=True, when the caller waits).

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
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


@dataclass(frozen=True)
class Collective:
    op: str             # "all_gather", "reduce_scatter" or "all_reduce"
    payload_bytes: int  # what this rank contributes (see the module docstring)
    label: str          # what it was for, e.g. "block 3"
    group_size: int = 1  # ranks taking part

    @property
    def sent_bytes(self) -> float:
        """Bytes this rank sends with the ring algorithm (see the module docstring)."""
        n = self.group_size
        if self.op == "all_reduce":
            return 2 * (n - 1) * self.payload_bytes / n
        return (n - 1) * self.payload_bytes


class _ThenLayOut:
    """The work of an all-gather along dim != 0: wait() also lays the received blocks out in place."""

    def __init__(self, work, lay_out):
        self.work, self.lay_out = work, lay_out

    def wait(self):
        if self.work is not None:
            self.work.wait()
            self.lay_out()
            self.work = None
        return True


class _Done:
    """The work of a collective over a group of one rank: complete as soon as it is issued."""

    def wait(self):
        return True


class Collectives:
    """all_gather / reduce_scatter / all_reduce over `group` (None: the default group), logged in `self.log`.

    Over a group of one rank (a mesh axis of size 1) the result is this rank's own data: each call
    is still logged (it sends 0 bytes), but nothing goes through torch.distributed, whose call and
    wait cost about as much over one rank as over four."""

    def __init__(self, group=None):
        self.group, self.log = group, []

    def size(self) -> int:
        return dist.get_world_size(self.group)

    def _record(self, op: str, payload_bytes: int, label: str):
        self.log.append(Collective(op, payload_bytes, label, self.size()))

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, label: str = "", async_op: bool = False,
                   dim: int = 0):
        """output <- every rank's shard, in rank order, side by side along `dim` (the shard's size
        along `dim` times the group's size; the other dimensions the shard's)."""
        self._record("all_gather", shard.nbytes, label)
        if self.size() == 1:
            output.copy_(shard)
            return _Done() if async_op else None
        if dim == 0:
            return _all_gather_single(output, shard, group=self.group, async_op=async_op)
        # gloo wants the blocks end to end along dim 0: (size * shard.shape[0], ...), one per rank.
        blocks = torch.empty((self.size() * shard.shape[0], *shard.shape[1:]), dtype=shard.dtype, device=shard.device)
        work = _all_gather_single(blocks, shard.contiguous(), group=self.group, async_op=async_op)

        def lay_out():
            torch.cat(blocks.chunk(self.size()), dim=dim, out=output)
        if not async_op:
            lay_out()
            return None
        return _ThenLayOut(work, lay_out)

    def reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor, label: str = "", async_op: bool = False,
                       dim: int = 0):
        """shard <- the sum over ranks of this rank's block of full along `dim` (full cut into
        group-size equal blocks along `dim`, rank r receiving block r)."""
        self._record("reduce_scatter", shard.nbytes, label)
        if self.size() == 1:
            shard.copy_(full)
            return _Done() if async_op else None
        if dim != 0:  # the rank blocks one after the other, as the collective moves them
            full = torch.cat(full.chunk(self.size(), dim=dim))
        return _reduce_scatter_single(shard, full, dist.ReduceOp.SUM, group=self.group, async_op=async_op)

    def all_reduce(self, tensor: torch.Tensor, label: str = "", async_op: bool = False, op: str = "sum"):
        """tensor <- its sum (op="sum") or elementwise maximum (op="max") over ranks, in place."""
        self._record("all_reduce", tensor.nbytes, label)
        if self.size() == 1:
            return _Done() if async_op else None
        return dist.all_reduce(tensor, _REDUCE_OPS[op], group=self.group, async_op=async_op)

    def counts(self, op: str) -> int:
        return sum(c.op == op for c in self.log)
