# Generated from solutions/m14_zero.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 14`. (skeleton c17f79eaf5af)
"""Module 14, part 4 - ZeRO-1 and ZeRO-2: replicas that split the optimizer's work and state.

Plain data parallelism keeps, on every one of the d ranks, the parameters, the gradients and
AdamW's two moments of every parameter: 4 Ψ b bytes per rank for Ψ parameters of b bytes, and all
d ranks run the same AdamW step on the same numbers. ZeRO (Rajbhandari et al., 2020) cuts that
redundancy by sharding:

    ZeRO-1   the optimizer state. The gradients are all-reduced as before (every rank holds the
             whole sum), but member i updates only its shard of the parameters with AdamW, so it
             keeps the moments of its shard only; then the updated shards are all-gathered.
    ZeRO-2   the gradients too. Each bucket is reduce-scattered instead of all-reduced: member i
             receives only the sum of its shard, and the whole bucket is freed once it is sent.
    ZeRO-3   the parameters too: module 07 (FSDP), the next step of the same staircase.

The shards: each bucket's buffer is padded to a multiple of d values (m14_buckets) and cut into d
equal slices; member i owns slice i of every bucket. The parameters themselves become views into
one flat buffer per bucket (`weights`), laid out like the bucket's gradients, so the all-gather of
the updated slices writes the new weights straight into the parameters (DeepSpeed does the same:
`param.data = a view of the flat buffer`). AdamW is elementwise, so updating each slice on its
owner is the same arithmetic as updating everything everywhere: ZeRO changes where the work is
done, not its result.

Gradient clipping needs the norm of the whole gradient; each rank holds only its shard (ZeRO-2) or
updates only its shard (ZeRO-1): each sums the squares of its shards and one all-reduce adds the
partial sums.

With gradient accumulation (m micro-steps), ZeRO-1 sends on the last micro-step, like DDP. ZeRO-2
reduce-scatters every micro-step (as DeepSpeed's ZeRO-2 does): holding the whole gradients until
the last micro-step would keep the Ψ b bytes that ZeRO-2 exists to drop, so it pays m times the
reduce-scatters instead.
"""
from __future__ import annotations

import torch

from course.mesh import Group
from .m14_buckets import Bucket
from .m14_data_parallel import DataParallel


def shard_range(padded_numel: int, d: int, index: int) -> slice:
    """The values of a padded flat buffer that member `index` of a group of `d` owns."""
    # TODO(m14): member index's slice of a buffer padded to a multiple of d
    # Contract: padded_numel is a multiple of d; return the slice (a Python slice) of member `index`'s values: the
    #   index-th of d equal consecutive pieces. The same slice is what the collectives give member `index`: a
    #   reduce-scatter's shard and an all-gather's place, in group order.
    # Pitfalls: the group index, not the global rank (on a d x t mesh the d groups are ranks (0, 2) and (1, 3)); a
    #   piece off by one member updates a neighbour's slice and all-gathers it into the wrong place.
    raise NotImplementedError("TODO(m14): member index's slice of a buffer padded to a multiple of d")


class ZeroDataParallel(DataParallel):
    """Data parallelism over `group` with AdamW's state sharded (stage 1), and the gradients too
    (stage 2). Its optimizer updates `parameters()`: this rank's shard of each bucket's weights."""

    def __init__(self, named_params: list[tuple[str, torch.Tensor]], group: Group, bucket_cap_bytes: int,
                 stage: int):
        if stage not in (1, 2):
            raise ValueError(f"a sharded optimizer is ZeRO stage 1 or 2, got {stage} (stage 0 is DataParallel)")
        self.stage = stage
        super().__init__(named_params, group, bucket_cap_bytes, pad_to=group.size)
        # The weights, one flat padded buffer per bucket; each parameter becomes a view into it.
        self.weights = []
        for bucket in self.buckets:
            flat = torch.zeros(bucket.padded_numel, dtype=bucket.params[0].dtype, device=bucket.params[0].device)
            for p, start in zip(bucket.params, bucket.offsets):
                flat[start:start + p.numel()] = p.detach().reshape(-1)
                p.data = flat[start:start + p.numel()].view_as(p)
            self.weights.append(flat)
        self.ranges = [shard_range(b.padded_numel, group.size, group.index) for b in self.buckets]
        self.shards = [flat[r] for flat, r in zip(self.weights, self.ranges)]  # views: updating them updates the weights
        # ZeRO-2: the sum of this rank's shard of each bucket's gradients, accumulated over micro-steps
        self.grad_shards = [torch.zeros_like(s) for s in self.shards] if stage == 2 else []

    @property
    def syncs_every_microstep(self) -> bool:
        return self.stage == 2

    def attach_gradients(self):
        """ZeRO-1: DDP's buckets, gradients as views. ZeRO-2: a bucket's buffer exists only from its first
        gradient of a backward until it has been sent (ready allocates it, land frees it)."""
        if self.stage == 1:
            super().attach_gradients()

    def parameters(self) -> list[torch.Tensor]:
        """What this rank's optimizer updates: its shard of every bucket's weights."""
        return self.shards

    def gradients(self) -> list[torch.Tensor]:
        """ZeRO-1: the whole summed buckets, as DDP's. ZeRO-2: this rank's summed shards (it keeps no more)."""
        return super().gradients() if self.stage == 1 else self.grad_shards

    def zero_grad(self):
        super().zero_grad()
        for g in self.grad_shards:
            g.zero_()

    def no_sync(self):
        if self.stage == 2:
            raise RuntimeError("ZeRO-2 keeps only its shard of the gradients, so it reduce-scatters on every "
                               "micro-step: it has no no_sync() (your train_step must sync every micro-step "
                               "when ddp.syncs_every_microstep)")
        return super().no_sync()

    def ready(self, param: torch.Tensor, grad: torch.Tensor | None = None):
        if self.stage == 2:
            bucket, _ = self.where[id(param)]
            if bucket.grads is None:
                bucket.allocate()
            if grad is None:  # autograd's own .grad: copied into the bucket (by ready), then dropped
                grad, param.grad = param.grad, None
        super().ready(param, grad)

    def launch(self, bucket: Bucket):
        """ZeRO-1: DDP's all-reduce. ZeRO-2: a reduce-scatter, each member receiving the sum of its shard."""
        # TODO(m14): ZeRO-1 all-reduces the bucket; ZeRO-2 reduce-scatters it, one bucket in flight at a time
        # Contract: stage 1 sends exactly as DataParallel does (every rank keeps the whole summed gradient: the test
        #   checks each parameter's .grad and the bytes). Stage 2: first complete the bucket sent before this one
        #   (self.complete; bucket.index - 1, if any), so that at most one bucket's whole gradient is in flight; then
        #   start, asynchronously, a reduce-scatter of bucket.grads into a new tensor bucket.received of one shard
        #   (padded_numel / d values), labelled "bucket <index>", and keep the work in bucket.work. land() (below)
        #   adds bucket.received to this rank's gradient shard once it is done. The tests check each rank's summed
        #   gradient shards, and that when each reduce-scatter starts no other bucket's is still in flight (with 3
        #   and 4 buckets).
        # Maths: the reduce-scatter gives member i the sum over ranks of slice i of the buffer: shard_range's slice.
        # Pitfalls: a reduce-scatter for stage 1 too (the update is right, but ZeRO-1 promises every rank the whole
        #   gradient, and the bytes differ from the formula); receiving into the gradient shard itself (a second
        #   micro-step would overwrite the first: land adds).
        raise NotImplementedError('TODO(m14): ZeRO-1 all-reduces the bucket; ZeRO-2 reduce-scatters it, one bucket in flight at a time')

    def land(self, bucket: Bucket):
        """ZeRO-2: add the received shard to this rank's gradient shard; free the whole bucket."""
        if self.stage == 2:
            self.grad_shards[bucket.index].add_(bucket.received)
            bucket.received = None
            bucket.free()

    def grad_shard(self, k: int) -> torch.Tensor:
        """The summed gradient of this rank's shard of bucket k: a slice of the whole (ZeRO-1), or its own (ZeRO-2)."""
        return self.buckets[k].grads[self.ranges[k]] if self.stage == 1 else self.grad_shards[k]

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the gradients so that their global norm is at most max_norm (as torch.nn.utils.clip_grad_norm_:
        by min(1, max_norm / (norm + 1e-6))); returns the norm before clipping."""
        # TODO(m14): the global norm from every rank's shards, then scale this rank's shards
        # Contract: the norm of the whole gradient (every parameter, all ranks' shards together), computed from this
        #   rank's gradient shards (self.grad_shard(k) for every bucket) and one collective; then multiply this rank's
        #   shards by min(1, max_norm / (norm + 1e-6)), PyTorch's clip_grad_norm_ rule, in place. Return the norm.
        #   The test compares the norm it returns and the trained weights with one process that clips with
        #   torch.nn.utils.clip_grad_norm_.
        # Maths: norm^2 = sum over ranks of (sum over its shards of g^2): the padding is zero, and every value belongs
        #   to exactly one rank's shard.
        # Pitfalls: this rank's norm alone (each rank clips by a different factor); summing norms instead of squares;
        #   a collective other than the all-reduce (every rank needs the total). Sum the squares in float64.
        raise NotImplementedError("TODO(m14): the global norm from every rank's shards, then scale this rank's shards")

    def step(self, optimizer: torch.optim.Optimizer, max_norm: float | None = None):
        """`optimizer` (built on self.parameters(): this rank's shards) updates this rank's shards; then
        every rank gets every shard back."""
        # TODO(m14): the sharded step: gradients of the shards, clipping, AdamW on the shards, all-gather
        # Contract: give each shard (self.shards[k]) its summed gradient (self.grad_shard(k)) as .grad; clip if
        #   max_norm is not None; step the optimizer (it updates the shards, views into self.weights[k]); then
        #   all-gather every bucket's weights from the members' shards, in place, one all-gather per bucket
        #   ("weights <k>"), and wait for them before returning: afterwards every parameter holds its new value on
        #   every rank. The tests compare with one process after several steps on 2 and 4 ranks, with and without
        #   clipping, and count the bytes.
        # Maths: the all-gather's input is this rank's slice of the output, which it already holds: member i's
        #   slice lands at shard_range(.., i), exactly where it is.
        # Pitfalls: stepping before the gradients are attached (AdamW skips a parameter whose .grad is None);
        #   forgetting the all-gather (each rank's other shards stay at their old values).
        raise NotImplementedError('TODO(m14): the sharded step: gradients of the shards, clipping, AdamW on the shards, all-gather')
