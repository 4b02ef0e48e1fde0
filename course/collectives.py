"""The collectives the parallel modules call, each one written down as it is issued (given code).

`Collectives` wraps torch.distributed's all-gather, reduce-scatter, all-reduce and all-to-all, and
the point-to-point send and receive, over one group of ranks (a `course.mesh.Group` hands one out),
and appends one `Collective` record per call, so a test or a benchmark can compare what was
actually sent with the formula (module 07's payload arithmetic, module 12's traffic, ...). Every
group of one mesh writes into the same log, in call order, each record naming its axis.

A record's `payload_bytes` is what one rank contributes: its shard for an all-gather, the shard it
receives for a reduce-scatter, the whole tensor for an all-reduce, its whole input for an
all-to-all, the message for a send or a receive. Its `sent_bytes` is what one rank sends over the
wire with the bandwidth-optimal (ring) algorithms: (n - 1) shards for an all-gather or a
reduce-scatter over n ranks, 2 (n - 1) / n of the tensor for an all-reduce (a reduce-scatter, then
an all-gather); for an all-to-all, the rows it sends to the other ranks (splits may be uneven), for
a send the message, for a receive nothing.

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
    op: str             # "all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send" or "recv"
    payload_bytes: int  # what this rank contributes (see the module docstring)
    label: str          # what it was for, e.g. "block 3"
    group_size: int = 1  # ranks taking part
    axis: str = "world"  # the group's name: a mesh axis ("d", "t", ...), several ("dc"), or "world"
    peer_bytes: int = 0  # all_to_all: the bytes of the rows that go to other ranks

    @property
    def sent_bytes(self) -> float:
        """Bytes this rank sends with the ring algorithm (see the module docstring)."""
        n = self.group_size
        if self.op == "all_reduce":
            return 2 * (n - 1) * self.payload_bytes / n
        if self.op == "all_to_all":
            return self.peer_bytes
        if self.op in ("send", "recv"):
            return self.payload_bytes if self.op == "send" else 0
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


def _check_blocks(op: str, label: str, role: str, whole: torch.Tensor, block: torch.Tensor, n: int, dim: int):
    """One line before anything is sent: `whole` must be the group's n blocks side by side along `dim`
    (sizes that do not fit make gloo abort the rank with a C++ shape check, or make a group of one
    broadcast silently)."""
    want = list(block.shape) or [1]   # a scalar's blocks lie along a dimension of their own
    want[dim] *= n
    if list(whole.shape) != want:
        raise ValueError(f"{op} {label!r} over {n} ranks along dim {dim}: its {role} is {tuple(whole.shape)}, but "
                         f"{n} blocks of {tuple(block.shape)} side by side along dim {dim} are {tuple(want)}")


class Collectives:
    """The collectives over one group of ranks, logged in `self.log`.

    `group` is torch.distributed's process group (None: the default group, every rank), `ranks`
    the global rank of each member in group order (default: read from the group), `axis` the name
    the log gives the group, and `log` the list to append to (shared by every group of a mesh).
    Point-to-point calls name their peer by its index in the group, not by its global rank.

    Over a group of one rank (a mesh axis of size 1) the result is this rank's own data: each call
    is still logged (it sends 0 bytes), but nothing goes through torch.distributed, whose call and
    wait cost about as much over one rank as over four (so a group of one needs no process group)."""

    def __init__(self, group=None, axis: str = "world", ranks: tuple[int, ...] | None = None,
                 log: list | None = None):
        if ranks is None:
            ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else \
                tuple(range(dist.get_world_size()))
        self.group, self.axis, self.ranks = group, axis, tuple(ranks)
        self.log = [] if log is None else log

    def size(self) -> int:
        return len(self.ranks)

    def _record(self, op: str, payload_bytes: int, label: str, peer_bytes: int = 0):
        self.log.append(Collective(op, payload_bytes, label, self.size(), self.axis, peer_bytes))

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, label: str = "", async_op: bool = False,
                   dim: int = 0):
        """output <- every rank's shard, in rank order, side by side along `dim` (the shard's size
        along `dim` times the group's size; the other dimensions the shard's)."""
        _check_blocks("all_gather", label, "output", output, shard, self.size(), dim)
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
        _check_blocks("reduce_scatter", label, "input", full, shard, self.size(), dim)
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

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int] | None = None,
                   input_splits: list[int] | None = None, label: str = "", async_op: bool = False):
        """output <- from every rank j, the rows of j's input meant for this rank, in group order.

        input's rows are cut into one block per member along dim 0 (input_splits[j] rows for member
        j; None: equal blocks) and output receives output_splits[j] rows from member j: torch's
        all_to_all_single, which takes uneven splits."""
        n, row_bytes = self.size(), input[0].nbytes if len(input) else 0
        splits = input_splits if input_splits is not None else [len(input) // n] * n
        index = self.ranks.index(dist.get_rank()) if n > 1 else 0
        self._record("all_to_all", input.nbytes, label, (sum(splits) - splits[index]) * row_bytes)
        if n == 1:
            output.copy_(input)
            return _Done() if async_op else None
        return dist.all_to_all_single(output, input, output_splits, input_splits, group=self.group,
                                      async_op=async_op)

    def send(self, tensor: torch.Tensor, to: int, label: str = "", tag: int = 0):
        """Send `tensor` to the group's member `to` (its index in the group); returns when it has left."""
        self._record("send", tensor.nbytes, label)
        dist.send(tensor.contiguous(), self.ranks[to], tag=tag)

    def isend(self, tensor: torch.Tensor, to: int, label: str = "", tag: int = 0):
        """Start sending `tensor` to member `to`; returns the work to wait on (keep it until then)."""
        self._record("send", tensor.nbytes, label)
        return dist.isend(tensor.contiguous(), self.ranks[to], tag=tag)

    def recv(self, buffer: torch.Tensor, src: int, label: str = "", tag: int = 0) -> torch.Tensor:
        """Receive into `buffer` (its shape and dtype must be the message's) from member `src`."""
        self._record("recv", buffer.nbytes, label)
        dist.recv(buffer, self.ranks[src], tag=tag)
        return buffer

    def irecv(self, buffer: torch.Tensor, src: int, label: str = "", tag: int = 0):
        """Start receiving into `buffer` from member `src`; returns the work to wait on."""
        self._record("recv", buffer.nbytes, label)
        return dist.irecv(buffer, self.ranks[src], tag=tag)

    def counts(self, op: str) -> int:
        return sum(c.op == op for c in self.log)
