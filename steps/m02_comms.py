# Generated from solutions/m02_comms.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 02`. (skeleton a3c190031636)
"""Module 02 - communication primitives.

Every pipeline stage talks to two neighbours: it receives activations from the previous stage and
sends its own to the next one (forward), then receives gradients from the next stage and sends
gradients to the previous one (backward). This file wraps torch.distributed's point-to-point calls
in exactly those four verbs, plus non-blocking sends for the schedules of module 05.

The stages are the members of a group of ranks (course/mesh.py's `Group`): by default every rank
of the job, in rank order, but it may be one axis of a bigger mesh, whose members are not
consecutive ranks. A stage's neighbours are the group's previous and next members.

A receive needs a buffer of the right shape, dtype and device before the data arrives: the
sender's tensor is not transferred with its metadata, only its bytes.
"""
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from course.mesh import Group, world_group


def init_distributed(timeout_s: float = 120.0, backend: str | None = None):
    """Join the process group described by torchrun's environment; return (rank, world_size, device).

    If a group already exists (course.launch creates one for its forked ranks) it is reused. The
    backend is `backend` if given (a module whose tensors live in CPU memory asks for "gloo"), else
    chosen from the machine. The device follows the backend: gloo works on CPU tensors, nccl on
    this rank's GPU.
    """
    # TODO(m02): join the process group (or reuse an existing one) and return this rank's identity and device
    # Contract: returns (rank, world_size, device): two ints and a torch.device. Who this rank is
    # comes from the environment torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE;
    # see docs/02-comms.md); LOCAL_RANK and LOCAL_WORLD_SIZE may be missing (then 0 and 1).
    # Afterwards a default process group exists, created at most once: course.launch's forked
    # ranks arrive with one already, torchrun's processes without.
    # The choice: a group created here uses `backend` if the caller named one, else nccl when every
    # rank on this machine can have a GPU of its own (at least LOCAL_WORLD_SIZE GPUs), else gloo;
    # pass timeout_s on, so a hung collective ends with an error. The device follows the backend
    # the group really uses, whoever created it: nccl works on this rank's GPU on this machine
    # (numbered by its local rank, and made the current CUDA device), gloo on the CPU.
    # Pitfalls: environment values are strings, and the grader compares the returned rank and
    # world size with ints. Creating a second default group raises an error from torch. The
    # GPU index is the local rank, not the global one: the grader plays rank 3 of 4, the second
    # rank on a 2-GPU machine, and expects cuda:1. A GPU is not enough for nccl: one GPU for two
    # local ranks must give gloo. A backend asked for wins: gloo asked for on a GPU machine gives
    # the CPU and no CUDA device is set.
    raise NotImplementedError("TODO(m02): join the process group (or reuse an existing one) and return this rank's identity and device")


class PipelineComms:
    """Point-to-point messages between neighbouring stages of one pipeline.

    `pp` is the pipeline's group (default: every rank of the job, in rank order): its members, in
    group order, are the pipeline's stages, and this rank is the one at pp.index. `prev` and `next`
    are the global ranks of the neighbouring stages, or None at the ends of the pipeline.
    """

    def __init__(self, pp: Group | None = None, device=torch.device("cpu"), dtype=torch.float32):
        self.pp = pp if pp is not None else world_group()
        self.rank = self.pp.ranks[self.pp.index]  # this rank's global rank, for messages and errors
        self.device, self.dtype = torch.device(device), dtype
        # TODO(m02): record this stage's two neighbours (their global ranks), or None at either end
        # Contract: self.prev is the global rank of the stage before this one (it sends activations
        # here), self.next the global rank of the stage after it (this one sends activations
        # there). The stages are the members of self.pp in group order: this rank is member
        # self.pp.index of self.pp.size, and self.pp.ranks lists every member's global rank in that
        # order (e.g. (0, 2) for one pipeline of a 4-rank job, (1, 3) for the other). torch.distributed
        # addresses messages by global rank. Where there is no such stage, the value is None: _peer
        # (given, below) turns that None into a clear error instead of a message to nowhere.
        # Pitfalls: a place in the group is not a rank: the member before this one is at place
        # pp.index - 1, whose rank is whatever pp.ranks says, and self.rank - 1 is usually not in
        # the pipeline at all (the grader runs pipelines of ranks (0, 2) and (1, 3)). The ends: the first member has no prev, the
        # last no next, and a group of one has neither; an off-by-one there points the last stage
        # at a member that does not exist. The grader checks both neighbours of every member for
        # groups of 1, 2 and 4 ranks, consecutive and not.
        raise NotImplementedError("TODO(m02): record this stage's two neighbours (their global ranks), or None at either end")

    # Forward: activations flow from each stage to the next one (self.next).
    def send_forward(self, tensor: torch.Tensor):
        self._check_sendable(tensor, "send_forward")
        # TODO(m02): send an activation to the next stage, blocking
        # Contract: the values of `tensor` reach the next stage's matching recv_forward; nothing is
        # returned. Only the bytes travel (no shape, no dtype): the receiver's buffer gives them
        # meaning. Blocking: this may return once the bytes are handed over, or only when the
        # receiver has taken them (backend and size decide), so correct callers rely on neither.
        # On the last stage, which has no next, raise _peer's clear error before any message.
        # Pitfalls: a non-contiguous tensor (a transposed view, a strided slice) does not hold its
        # values in logical order in memory; gloo refuses it ("input tensor has to be contiguous"),
        # and the grader sends a transposed tensor. Sending to self.next directly: on the last
        # rank that is None, and the grader expects "rank 1 is the last stage: ..." from _peer.
        raise NotImplementedError('TODO(m02): send an activation to the next stage, blocking')

    def recv_forward(self, shape, dtype=None) -> torch.Tensor:
        # TODO(m02): receive an activation from the previous stage into a new buffer and return it
        # Contract: returns a new tensor of `shape`, of dtype `dtype` (or this comms' self.dtype when
        # dtype is None), on self.device, holding the values the previous stage sent with
        # send_forward (or isend_forward). Blocking: it returns only when they have arrived.
        # The receiver decides the meaning of the bytes: the buffer must have the sender's shape
        # and dtype. On the first stage, which has no prev, raise _peer's clear error before any
        # message: a receive from "no rank" would accept a message from any rank.
        # Pitfalls: a buffer of the wrong dtype holds the wrong number of bytes, and gloo aborts the
        # receiving rank (the grader says it "died without a result", killed by SIGABRT); where
        # the sizes happen to match, the bytes are read as nonsense values. The grader sends
        # float64, and float16 to a float16 comms that receives with no dtype given. A buffer on
        # the wrong device: nccl cannot fill a CPU tensor.
        raise NotImplementedError('TODO(m02): receive an activation from the previous stage into a new buffer and return it')

    # Backward: gradients flow from each stage back to the one before it (self.prev).
    def send_backward(self, tensor: torch.Tensor):
        self._check_sendable(tensor, "send_backward")
        # TODO(m02): send a gradient back to the previous stage, blocking
        # Contract: the mirror image of send_forward: the values of `tensor` (the gradient of the
        # loss with respect to this stage's input) reach the previous stage's recv_backward. On the
        # first rank, which has no prev, raise _peer's clear error ("rank 0 is the first stage").
        # Pitfalls: the same as send_forward's (a non-contiguous gradient, a peer taken from the
        # wrong side): a gradient sent forward instead goes to a rank that is not waiting for it,
        # and the grader's relay then times out or delivers another rank's values.
        raise NotImplementedError('TODO(m02): send a gradient back to the previous stage, blocking')

    def recv_backward(self, shape, dtype=None) -> torch.Tensor:
        # TODO(m02): receive a gradient from the next stage into a new buffer and return it
        # Contract: the mirror image of recv_forward: a new tensor of `shape`, of `dtype` or the
        # comms' default, on self.device, filled with what the next stage sent with send_backward
        # (or isend_backward). On the last stage, which has no next, raise _peer's clear error.
        # Pitfalls: as recv_forward's: the dtype (the grader relays float64), the device, and the
        # side: a receive from the wrong neighbour waits for a message that never comes (the
        # grader's timeout names the rank and the line) or takes one meant for another verb.
        raise NotImplementedError('TODO(m02): receive a gradient from the next stage into a new buffer and return it')

    # Non-blocking sends return a Work handle: call .wait() on it before the tensor is reused or
    # freed, and before the process exits. Schedules that both send and receive in one step need
    # them: two neighbours that both block in send wait for each other forever.
    def isend_forward(self, tensor: torch.Tensor):
        self._check_sendable(tensor, "isend_forward")
        # TODO(m02): start sending an activation to the next stage, and return its handle
        # Contract: returns at once with the work handle of a send that goes on in the background
        # (an object with .wait()); the caller keeps it and waits on it before the tensor is
        # changed or freed, and before the process moves on for good. The receiver is the next
        # rank's ordinary recv_forward. On the last stage, raise _peer's clear error.
        # Pitfalls: returning nothing (or using a blocking send, which returns None) leaves the
        # caller no way to wait: the grader's exchange in both directions fails on "'NoneType'
        # object has no attribute 'wait'". A handle the caller drops is as bad: on gloo such a send
        # is usually lost, and the peer hangs in recv. The bytes must be contiguous here too: the
        # grader sends a transposed tensor this way.
        raise NotImplementedError('TODO(m02): start sending an activation to the next stage, and return its handle')

    def isend_backward(self, tensor: torch.Tensor):
        self._check_sendable(tensor, "isend_backward")
        # TODO(m02): start sending a gradient back to the previous stage, and return its handle
        # Contract: the mirror image of isend_forward: returns the work handle at once; the values
        # reach the previous stage's recv_backward; on the first stage, raise _peer's clear error.
        # Pitfalls: as isend_forward's: a dropped handle (on gloo the send is usually lost and the
        # peer hangs in recv_backward; the timeout report shows only that recv), a blocking send,
        # the wrong side.
        raise NotImplementedError('TODO(m02): start sending a gradient back to the previous stage, and return its handle')

    def _check_sendable(self, tensor, verb: str):
        """A clear error for what cannot be sent, instead of one from deep inside torch.distributed."""
        if not isinstance(tensor, torch.Tensor):
            hint = (" (a gradient that was never computed? A received activation must be a leaf that requires "
                    "grad, .requires_grad_(), for backward to fill its .grad)" if tensor is None else "")
            raise TypeError(f"rank {self.rank}: {verb} got {type(tensor).__name__}, not a tensor{hint}")

    def _peer(self, side: str, verb: str) -> int:
        """The global rank on `side` ("prev" or "next"), or a clear error if this stage has none there."""
        peer = getattr(self, side)
        if peer is None:
            end = "first" if side == "prev" else "last"
            raise RuntimeError(f"rank {self.rank} is the {end} stage: it has no {side} rank to {verb} with")
        return peer

