# Generated from solutions/m14_data_parallel.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 14`. (skeleton 0009f1c7bd09)
"""Module 14, part 2 - replicas: every rank holds the whole model, and the gradients are summed
bucket by bucket while the backward is still running (PyTorch's DDP, written out).

    start        the first member's parameters are copied to every member (broadcast_from_first)
    backward     each time a gradient is final, `ready(param)`; a bucket whose gradients have all
                 arrived is sent (`launch`) without waiting for the network, and the backward goes
                 on computing earlier layers meanwhile
    finish()     after the backward: every bucket's sum over the ranks has arrived on every rank
    step         every rank runs the same optimizer step on the same summed gradients: the
                 replicas stay equal without ever sending a weight again

Who calls `ready`: for an autograd model (module 00's MLP, course/reference_llama.py's Llama),
a hook that autograd runs once a parameter's .grad is final (`replicate` registers one per
parameter); for module 06's hand-written backward, its `on_block_grads(layer, grads)`, which hands
over each block's gradients as soon as they exist (m14_train_step's `DataParallelLlama`).

Buckets are sent strictly in order: bucket k never before bucket k - 1, even when its gradients
are complete first. Collectives are matched by the order in which ranks issue them, so two ranks
that sent their buckets in different orders would add up different buckets (or wait forever).

The data axis is a `Group` (course/mesh.py): `world_group()` when every rank is a replica, or
`mesh.group("d")` when data parallelism is one axis of a larger mesh. Nothing here reads the world.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from course.mesh import Group
from .m14_buckets import Bucket, assign_buckets, make_bucket


def broadcast_from_first(tensors: list[torch.Tensor], group: Group):
    """Every member's `tensors` become those of the group's first member (group index 0), in place."""
    # TODO(m14): copy the first member's tensors to every member of the group
    # Contract: afterwards every member holds, in each tensor, exactly the values the member with group.index == 0
    #   held, in place (the tensors may be a model's parameters, which require grad). The group's collectives
    #   (group.collectives: all_reduce, reduce_scatter, all_gather; the chapter's table) have no broadcast. The tests
    #   start the ranks from different weights, on 2 and 4 ranks and on the d axis of a d x t mesh, where the first
    #   member is not global rank 0.
    # Question: with only these collectives, and no buffer beyond the tensors themselves, how does every member end
    #   with one member's values, exactly?
    # Pitfalls: which rank is the first member of the d group (1, 3)? Can a parameter that requires grad be changed in
    #   place while autograd records?
    raise NotImplementedError("TODO(m14): copy the first member's tensors to every member of the group")


class DataParallel:
    """Replicas of a model's parameters on the ranks of `group`, whose gradients are summed over the
    group bucket by bucket (buckets of about `bucket_cap_bytes`, C) as they become ready.

    `named_params` are (name, tensor) pairs in registration order; `pad_to` pads each bucket's
    buffer to a multiple of that many values (ZeRO uses d)."""

    syncs_every_microstep = False  # gradient accumulation sends only on the last micro-step (no_sync before)

    def __init__(self, named_params: list[tuple[str, torch.Tensor]], group: Group, bucket_cap_bytes: int,
                 pad_to: int = 1):
        self.group, self.bucket_cap_bytes = group, bucket_cap_bytes
        self.names = [name for name, _ in named_params]
        self.params = [p for _, p in named_params]
        broadcast_from_first(self.params, group)
        assignment = assign_buckets(self.params, bucket_cap_bytes)
        self.buckets: list[Bucket] = [make_bucket(k, [named_params[i] for i in indices], pad_to)
                                      for k, indices in enumerate(assignment)]
        self.where = {id(p): (bucket, i) for bucket in self.buckets for i, p in enumerate(bucket.params)}
        self.next_bucket = 0  # the first bucket not sent yet in this backward
        self.sync = True      # False inside no_sync(): gradients accumulate, nothing is sent
        self.attach_gradients()

    def attach_gradients(self):
        """Allocate every bucket's buffer and make each parameter's .grad its view into it."""
        for bucket in self.buckets:
            bucket.allocate()
            for i, p in enumerate(bucket.params):
                p.grad = bucket.view(i)

    def parameters(self) -> list[torch.Tensor]:
        """What this rank's optimizer updates: every parameter (each replica updates all of them)."""
        return self.params

    def gradients(self) -> list[torch.Tensor]:
        """The step's summed gradients as this rank keeps them, what `step` reads: every bucket's buffer
        (each parameter's .grad is a view into one)."""
        return [bucket.grads for bucket in self.buckets]

    def zero_grad(self):
        """Zero the gradients in place (they stay views into their buckets)."""
        for bucket in self.buckets:
            if bucket.grads is not None:
                bucket.grads.zero_()

    @contextlib.contextmanager
    def no_sync(self):
        """Inside: gradients are accumulated in their buckets, and nothing is sent (gradient accumulation)."""
        self.sync = False
        try:
            yield
        finally:
            self.sync = True

    def ready(self, param: torch.Tensor, grad: torch.Tensor | None = None):
        """`param`'s gradient for this backward is final. An autograd hook calls it with grad=None (autograd
        has already added it into param.grad, the bucket's view); a hand-written backward passes `grad`,
        which is added into the bucket here. Sends every bucket that is complete, in bucket order."""
        bucket, i = self.where[id(param)]
        if grad is not None:
            bucket.view(i).add_(grad)
        elif param.grad is None or param.grad.data_ptr() != bucket.view(i).data_ptr():
            raise RuntimeError(f"{bucket.names[i]}.grad is not its bucket's view: zero the gradients with "
                               f"DataParallel.zero_grad(), not the optimizer's zero_grad() (which sets them to None)")
        if not self.sync:
            return
        # TODO(m14): mark this gradient ready; send every complete bucket, strictly in bucket order
        # Contract: bucket.pending holds the positions (in bucket.params) whose gradient has not arrived in this backward;
        #   self.next_bucket is the first bucket not sent yet; self.launch(bucket) sends one. Over a backward that sends,
        #   whatever order the gradients arrive in on each rank, every bucket is launched exactly once, in the order
        #   0, 1, 2, ..., never before its last gradient has arrived, and in the first call after which it may go (its
        #   gradients all in, every earlier bucket launched). A gradient marked twice in one backward is the caller's
        #   bug: raise a RuntimeError naming bucket.names[i]. The tests record, for every gradient, how many collectives
        #   had been issued before it was ready (the MLP in 1, 2 and 3 buckets), and hand gradients over by hand in
        #   opposite orders on two ranks.
        # Question: when one gradient arrives, which buckets may leave now, and can there be more than one?
        # Pitfalls: if rank 0 completes bucket 2 first and rank 1 completes bucket 0 first, what do the two ranks' first
        #   collectives add up? What does a bucket sent before its last gradient sum? If bucket 1 is complete while
        #   bucket 0 still waits for a gradient, when does bucket 1 leave?
        raise NotImplementedError('TODO(m14): mark this gradient ready; send every complete bucket, strictly in bucket order')

    def launch(self, bucket: Bucket):
        """Start summing the bucket's gradients over the group, without waiting."""
        # Given (its contract would name the call): an all-reduce sums in place on every member; started with
        # async_op=True it returns at once, so the bucket travels while the backward computes earlier layers, and
        # complete() waits on the work kept here. The sum, not the mean: train_step divides once, by the count.
        bucket.work = self.group.collectives.all_reduce(bucket.grads, label=f"bucket {bucket.index}", async_op=True)

    def complete(self, bucket: Bucket):
        """Wait for the bucket's collective, if one is in flight, then land its result."""
        if bucket.work is not None:
            bucket.work.wait()
            bucket.work = None
            self.land(bucket)

    def land(self, bucket: Bucket):
        """What to do with a bucket once its collective is done: nothing here (the all-reduce summed in place)."""

    def finish(self):
        """After a backward that sends: wait until every bucket's sum has arrived, and get ready for the next."""
        # TODO(m14): after the backward: every bucket summed and ready for the next backward, or a clear error
        # Contract: called after a backward that sends. When it returns, every bucket's buffer holds its sum over the group
        #   (a collective delivers only at its wait(); the given complete() waits for a bucket's and lands it), and the
        #   buckets and self.next_bucket are in the state the next backward's ready() expects, the state a new DataParallel
        #   starts in (make_bucket, Bucket's methods, __init__). If a parameter's gradient never arrived in this backward
        #   (one the forward did not use: its bucket, and every bucket after it, was never sent), raise instead, before
        #   waiting for anything, a RuntimeError on one line that names every such parameter and the fix: freeze it
        #   (requires_grad_(False)) or leave it out of the model (PyTorch's DDP offers find_unused_parameters=True
        #   instead); every rank raises it, none waits for a bucket that was never sent. The tests train 3 steps (every
        #   bucket sent once a step, in order), and check the names and "requires_grad" in the message.
        # Question: what did this backward change that the next one must find as new, and how do you tell which gradients
        #   never came?
        # Pitfalls: what does complete() do with a bucket that was never launched (its work is None): are its gradients
        #   summed? What would the next backward's first ready() say of a bucket whose pending set is still empty? From
        #   which bucket would it start sending? Looked for after the buckets are reset, what would "never arrived" see?
        raise NotImplementedError('TODO(m14): after the backward: every bucket summed and ready for the next backward, or a clear error')

    def step(self, optimizer: torch.optim.Optimizer, max_norm: float | None = None):
        """The optimizer step, the same on every replica; with `max_norm`, the gradients are first clipped to
        that global norm (every rank holds all of them here, so the norm needs no collective)."""
        if max_norm is not None:
            nn.utils.clip_grad_norm_(self.params, max_norm)
        optimizer.step()


def replicate(module: nn.Module, group: Group, bucket_cap_bytes: int, kind=DataParallel, **kwargs):
    """`kind`(module's trainable parameters, group, C, **kwargs), with an autograd hook on every trainable
    parameter that calls `ready` once its .grad is final for this backward. Frozen parameters
    (requires_grad=False) get no gradient and no bucket; they and the buffers are copied from the first
    member too, so that every replica starts equal."""
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]  # a tied weight appears once
    frozen = [p for p in module.parameters() if not p.requires_grad]
    broadcast_from_first(frozen + list(module.buffers()), group)
    ddp = kind(named, group, bucket_cap_bytes, **kwargs)
    for _, p in named:
        # Runs once per backward, after autograd has added every use's contribution (a weight used twice
        # included) into p.grad: PyTorch >= 2.1.
        p.register_post_accumulate_grad_hook(ddp.ready)
    return ddp
