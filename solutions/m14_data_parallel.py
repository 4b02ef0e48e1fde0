"""Module 14, part 2 - replicas: every rank holds the whole model, and the gradients are summed
bucket by bucket while the backward is still running (PyTorch's DDP, written out).

    start        the first member's parameters are copied to every member (broadcast_from_first)
    backward     each time a gradient is final, `ready(param)`; once every gradient of bucket k has
                 arrived and buckets 0 .. k-1 have been sent, bucket k's all-reduce starts,
                 asynchronously, and the backward goes on computing earlier layers meanwhile
    finish()     after the backward: wait for every bucket; now every rank holds the sum over ranks
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
    # >>> TODO(m14): copy the first member's tensors to every member of the group
    # Contract: afterwards every member holds, in each tensor, the values the member with group.index == 0 held;
    #   in place (the tensors may be a model's parameters). The test starts the ranks from different weights, on
    #   2 and 4 ranks and on the d axis of a d x t mesh, where the first member is not global rank 0.
    # Maths: group.collectives has no broadcast, but it has a sum: if every other member contributes zeros, the
    #   sum over the members is the first member's values, exactly (x + 0 = x).
    # Pitfalls: "rank 0" is the group's first member, not the job's rank 0 (on the mesh {"d": 2, "t": 2} the d
    #   groups are ranks (0, 2) and (1, 3)); a parameter that requires grad cannot be changed in place while
    #   autograd records.
    # Hint 1: under torch.no_grad(): on members other than the first, zero each tensor; then sum each over the group.
    # Hint 2: group.index; tensor.zero_(); group.collectives.all_reduce(tensor, label=...) sums in place.
    # Hint 3: with torch.no_grad(): for each tensor t: if group.index != 0: t.zero_();  all-reduce t over the group
    with torch.no_grad():
        for t in tensors:
            if group.index != 0:
                t.zero_()
            group.collectives.all_reduce(t, label="broadcast")
    # <<<


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
        # >>> TODO(m14): mark this gradient ready; send every complete bucket, strictly in bucket order
        # Contract: bucket.pending holds the positions (in bucket.params) whose gradient has not arrived in this
        #   backward; self.next_bucket is the first bucket not sent yet. Take position i out of its bucket's
        #   pending set, then send (self.launch) every bucket that can go now: buckets leave in order 0, 1, 2, ...,
        #   each once all its gradients are in, and as soon as that is so. The test records, for every gradient,
        #   how many collectives had been issued before it was ready, and checks that each bucket is sent after its
        #   last gradient and no later than the first moment it may go (buckets of 1, 2 and 3 in the MLP; ready
        #   calls in different orders on different ranks).
        # Maths: bucket k may go once its pending set is empty and buckets 0 .. k-1 have gone: when the last gradient
        #   of bucket k arrives, k and every complete bucket after it leave in a row; a complete bucket waits for
        #   the incomplete one before it.
        # Pitfalls: sending the bucket this gradient belongs to, whatever the others (ranks whose gradients arrive in
        #   another order then issue the buckets in another order: gloo adds up the wrong buffers or hangs); sending
        #   before a bucket's last gradient (its sum misses the rest); a gradient marked twice in one backward is a
        #   bug of the caller: say so (RuntimeError naming bucket.names[i]).
        # Hint 1: remove i from the pending set; then, while the next bucket exists and has nothing pending, launch it
        #         and move on to the one after.
        # Hint 2: set.remove raises KeyError for an absent element: check `i in bucket.pending` first for a clear
        #         error; self.buckets[self.next_bucket].pending is empty when complete.
        # Hint 3: if i not in bucket.pending: raise RuntimeError naming the parameter
        #         remove i from bucket.pending
        #         while next_bucket < number of buckets and that bucket's pending set is empty:
        #             launch it;  next_bucket += 1
        if i not in bucket.pending:
            raise RuntimeError(f"{bucket.names[i]}'s gradient was marked ready twice in one backward")
        bucket.pending.remove(i)
        while self.next_bucket < len(self.buckets) and not self.buckets[self.next_bucket].pending:
            self.launch(self.buckets[self.next_bucket])
            self.next_bucket += 1
        # <<<

    def launch(self, bucket: Bucket):
        """Start summing the bucket's gradients over the group, without waiting."""
        # >>> TODO(m14): start the bucket's all-reduce without waiting, and keep its work
        # Contract: start summing bucket.grads (the flat buffer, in place) over the group asynchronously, labelled
        #   "bucket <index>", and keep what the collective returns in bucket.work: finish() waits on it. The test
        #   delivers an asynchronous collective's result only at wait(), so a collective that is never waited for
        #   leaves the gradients unsummed.
        # Maths: the sum over ranks, not the mean: turning the buckets' sums into the gradient of the step's mean
        #   loss is train_step's business, once they have arrived (m14_train_step).
        # Pitfalls: async_op=False blocks the backward until the bucket has crossed the network (no overlap, and the
        #   test checks async_op); dividing by the group size here (then the step's gradient is d times too small).
        # Hint 1: one call of the group's collectives.
        # Hint 2: self.group.collectives.all_reduce(tensor, label=..., async_op=True) returns the work.
        # Hint 3: bucket.work = all-reduce of bucket.grads, labelled f"bucket {bucket.index}", async_op=True
        bucket.work = self.group.collectives.all_reduce(bucket.grads, label=f"bucket {bucket.index}", async_op=True)
        # <<<

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
        # >>> TODO(m14): after the backward: refuse gradients that never came, wait for every bucket, re-arm
        # Contract: when this returns, every bucket has been sent and completed (self.complete, in bucket order),
        #   every bucket is armed again for the next backward (Bucket.arm) and self.next_bucket is 0. If a
        #   parameter's gradient never arrived in this backward (a parameter the forward did not use: its bucket,
        #   and every bucket after it, was never sent), raise a RuntimeError, on one line, that names every such
        #   parameter and the fix: freeze it (requires_grad_(False)) or leave it out of the model (PyTorch's DDP
        #   offers find_unused_parameters=True instead). The test checks the names and "requires_grad" are in the
        #   message; all ranks raise it, none waits forever for a bucket that will never be sent.
        # Pitfalls: waiting for a bucket that was never launched (its work is None: it would not hang here, but the
        #   gradients would be unsummed); re-arming before checking what is missing; forgetting next_bucket; a bucket
        #   not re-armed makes the next backward's `ready` report the gradient as marked twice.
        # Hint 1: collect the names of the pending positions of every bucket; raise if there are any; otherwise
        #         complete each bucket, then arm each and reset the counter.
        # Hint 2: bucket.names[i] for i in sorted(bucket.pending); ", ".join(...).
        # Hint 3: missing = names of pending positions over all buckets;  if missing: raise RuntimeError(one line)
        #         for each bucket: self.complete(bucket);  bucket.arm()
        #         next_bucket = 0
        missing = [bucket.names[i] for bucket in self.buckets for i in sorted(bucket.pending)]
        if missing:
            raise RuntimeError(f"no gradient arrived for {', '.join(missing)} in this backward (unused by the forward?): "
                               f"every replicated parameter needs one in every backward; freeze it "
                               f"(requires_grad_(False)) or leave it out of the model")
        for bucket in self.buckets:
            self.complete(bucket)
            bucket.arm()
        self.next_bucket = 0
        # <<<

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
