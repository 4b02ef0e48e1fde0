"""Module 02 - communication primitives.

Every pipeline stage talks to two neighbours: it receives activations from the previous rank and
sends its own to the next one (forward), then receives gradients from the next rank and sends
gradients to the previous one (backward). This file wraps torch.distributed's point-to-point calls
in exactly those four verbs, plus non-blocking sends for the schedules of module 05.

A receive needs a buffer of the right shape, dtype and device before the data arrives: the
sender's tensor is not transferred with its metadata, only its bytes.
"""
import os
from datetime import timedelta

import torch
import torch.distributed as dist


def init_distributed(timeout_s: float = 120.0, backend: str | None = None):
    """Join the process group described by torchrun's environment; return (rank, world_size, device).

    If a group already exists (course.launch creates one for its forked ranks) it is reused. The
    backend is `backend` if given (a module whose tensors live in CPU memory asks for "gloo"), else
    chosen from the machine. The device follows the backend: gloo works on CPU tensors, nccl on
    this rank's GPU.
    """
    # >>> TODO(m02): read RANK, WORLD_SIZE, LOCAL_RANK; join the group if needed; pick the device
    # Hint: torchrun sets RANK, WORLD_SIZE and LOCAL_RANK as environment variables (strings).
    # Hint: if not dist.is_initialized(): dist.init_process_group(backend, rank=..., world_size=...,
    #           timeout=timedelta(seconds=timeout_s)) with the backend asked for, else "nccl" if every
    #           local rank (LOCAL_WORLD_SIZE of them) can have a GPU of its own, else "gloo".
    # Hint: then look at dist.get_backend(): nccl -> torch.device("cuda", local_rank) (and
    #       torch.cuda.set_device it); gloo -> torch.device("cpu").
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        # nccl needs a GPU of its own for every rank on this machine; otherwise use gloo on CPU.
        gpus_for_everyone = torch.cuda.is_available() and \
            torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        backend = backend or ("nccl" if gpus_for_everyone else "gloo")
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    return rank, world_size, device
    # <<<


class PipelineComms:
    """Point-to-point messages between neighbouring pipeline stages.

    `prev` and `next` are the neighbouring ranks, or None at the ends of the pipeline.
    """

    def __init__(self, rank: int, world_size: int, device=torch.device("cpu"), dtype=torch.float32):
        self.rank, self.world_size = rank, world_size
        self.device, self.dtype = torch.device(device), dtype
        # >>> TODO(m02): set self.prev and self.next (None where there is no neighbour)
        self.prev = rank - 1 if rank > 0 else None
        self.next = rank + 1 if rank < world_size - 1 else None
        # <<<

    # Forward: activations flow from rank r to rank r + 1.
    def send_forward(self, tensor: torch.Tensor):
        # >>> TODO(m02): send `tensor` to the next rank (blocking)
        # Hint: dist.send(tensor, dst). Send a contiguous tensor: the bytes are sent as they lie.
        # Hint: self._peer("next", "send_forward") gives dst, or a clear error on the last rank.
        dist.send(tensor.contiguous(), self._peer("next", "send_forward"))
        # <<<

    def recv_forward(self, shape, dtype=None) -> torch.Tensor:
        # >>> TODO(m02): allocate a buffer (shape, dtype or self.dtype, self.device), fill it from prev
        # Hint: torch.empty(...) then dist.recv(buffer, src); return the buffer.
        # Hint: src = self._peer("prev", "recv_forward"): on the first rank it raises the clear error.
        buffer = torch.empty(shape, dtype=dtype or self.dtype, device=self.device)
        dist.recv(buffer, self._peer("prev", "recv_forward"))
        return buffer
        # <<<

    # Backward: gradients flow from rank r + 1 back to rank r.
    def send_backward(self, tensor: torch.Tensor):
        # >>> TODO(m02): send the gradient `tensor` to the previous rank (blocking)
        # Hint: as send_forward, with self._peer("prev", "send_backward").
        dist.send(tensor.contiguous(), self._peer("prev", "send_backward"))
        # <<<

    def recv_backward(self, shape, dtype=None) -> torch.Tensor:
        # >>> TODO(m02): allocate a buffer and fill it with the gradient from the next rank
        # Hint: as recv_forward, with self._peer("next", "recv_backward").
        buffer = torch.empty(shape, dtype=dtype or self.dtype, device=self.device)
        dist.recv(buffer, self._peer("next", "recv_backward"))
        return buffer
        # <<<

    # Non-blocking sends return a Work handle: call .wait() on it before the tensor is reused or
    # freed, and before the process exits. Schedules that both send and receive in one step need
    # them: two neighbours that both block in send wait for each other forever.
    def isend_forward(self, tensor: torch.Tensor):
        # >>> TODO(m02): start sending `tensor` to the next rank; return the handle from dist.isend
        # Hint: dist.isend(contiguous tensor, self._peer("next", "isend_forward")).
        return dist.isend(tensor.contiguous(), self._peer("next", "isend_forward"))
        # <<<

    def isend_backward(self, tensor: torch.Tensor):
        # >>> TODO(m02): start sending the gradient `tensor` to the previous rank; return the handle
        # Hint: as isend_forward, with self._peer("prev", "isend_backward").
        return dist.isend(tensor.contiguous(), self._peer("prev", "isend_backward"))
        # <<<

    def _peer(self, side: str, verb: str) -> int:
        """The rank on `side` ("prev" or "next"), or a clear error if this rank has none there."""
        peer = getattr(self, side)
        if peer is None:
            end = "first" if side == "prev" else "last"
            raise RuntimeError(f"rank {self.rank} is the {end} stage: it has no {side} rank to {verb} with")
        return peer

