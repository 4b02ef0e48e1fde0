"""Module 14, part 1 - gradient buckets: which gradients travel together, and where they live.

Data parallelism sums every gradient over the d ranks of the data axis. One all-reduce per
parameter pays a collective's fixed cost (α, module 03) hundreds of times a step; one all-reduce
of everything can only start once the whole backward is over. PyTorch's DDP groups the gradients
into buckets of about C bytes (`bucket_cap_mb`) and all-reduces each bucket as soon as all of its
gradients exist, while the backward computes the next ones.

Which parameters share a bucket is decided once, before training, from the parameters alone, the
way DDP's constructor decides it (with PyTorch's `_compute_bucket_assignment_by_size`). A bucket is
one flat buffer, so it never mixes dtypes; it is filled with parameters in registration order
until it holds C bytes or more (its last tensor may overshoot C). All ranks compute the same
assignment from the same model, so they agree on what bucket k is. The order of the list is the
order in which the buckets will be sent, and a bucket can only be sent once the backward has
produced all of its gradients.

A bucket owns one flat gradient buffer; each parameter's gradient is a view into it, so autograd
accumulates straight into the buffer the collective sends and nothing is copied (DDP's
`gradient_as_bucket_view=True`). ZeRO (m14_zero) pads each buffer with zeros to a multiple of d, so
that it cuts into d equal shards.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


def assign_buckets(params: list[torch.Tensor], cap_bytes: int) -> list[list[int]]:
    """The buckets, in the order they are sent: each a list of indices into `params` (in
    registration order within the bucket). `cap_bytes` is C (see the module docstring)."""
    if cap_bytes <= 0:
        raise ValueError(f"the bucket cap must be a positive number of bytes, got {cap_bytes}")
    # >>> TODO(m14): group the parameters into buckets of about cap_bytes, as DDP does, in the order they are sent
    # Contract: params are in registration order (a model registers its layers in forward order). Return a list of
    #   buckets, each a list of indices into params, ascending, every index in exactly one bucket. Afterwards:
    #   - a bucket holds one dtype;
    #   - taken one dtype at a time, in registration order, that dtype's parameters fall into consecutive runs, one
    #     a bucket; every run but the dtype's last holds cap_bytes or more, and would hold less without its last
    #     parameter;
    #   - the buckets are ordered by the index of their first parameter, in the direction that puts first the bucket
    #     the backward completes first (bucket 0 is sent first).
    #   The tests compare with PyTorch's own assignment, as DDP's constructor orders it, for caps that give 1, 2, 3,
    #   7 and 14 buckets of module 00's MLP, a cap met exactly, and parameters of two dtypes written out by hand.
    # Question: which parameters' gradients does a backward produce first, and so which bucket can leave first?
    # Maths: a parameter's bytes are numel * element_size.
    # Pitfalls: does the parameter that brings a run to cap_bytes or more belong to that run or to the next? And
    #   one that brings it exactly to cap_bytes? What becomes of the runs still open when the walk ends? With two
    #   dtypes interleaved, can a bucket that opened earlier close later?
    # Hint 1: the chapter's "Overlap" and "Buckets": in what order does the backward hand over a model's gradients,
    #         and what does a walk in registration order need to remember for each dtype?
    # Hint 2: per dtype, a run closes at the first parameter at which Σ numel·element_size ≥ C; the runs open at the
    #         end close too; then the buckets sorted by first index, descending (the registration order reversed):
    #         the backward fills the last layers' bucket first.
    # Hint 3: buckets = [];  open = {}                    # dtype -> (indices, bytes) of its open bucket
    #         for i, p in enumerate(params): add i and its bytes to open[p.dtype]; if its bytes >= cap: move its
    #             indices to buckets and remove it from open
    #         buckets += the indices of the open ones
    #         return sorted(buckets, key=min, reverse=True)
    closed, open_buckets = [], {}
    for i, p in enumerate(params):
        indices, size = open_buckets.get(p.dtype, ([], 0))
        indices, size = indices + [i], size + p.numel() * p.element_size()
        open_buckets[p.dtype] = (indices, size)
        if size >= cap_bytes:
            closed.append(indices)
            del open_buckets[p.dtype]
    closed += [indices for indices, _ in open_buckets.values()]
    return sorted(closed, key=min, reverse=True)
    # <<<

@dataclass
class Bucket:
    """One bucket: its parameters and one flat gradient buffer that their gradients are views into."""
    index: int                    # its place in the order buckets are sent (0 first)
    params: list[torch.Tensor]    # its parameters, in registration order
    names: list[str]              # their names, for error messages
    offsets: list[int]            # where each parameter's gradient starts in the buffer
    numel: int                    # values of its parameters (without padding)
    padded_numel: int             # numel rounded up to a multiple of pad_to (ZeRO: d equal shards)
    grads: torch.Tensor | None = None  # the flat buffer, padded_numel values (None until allocated)
    views: list[torch.Tensor] = field(default_factory=list)  # each parameter's gradient: a view into `grads`
    pending: set[int] = field(default_factory=set)  # positions whose gradient has not arrived in this backward
    work: object = None           # its collective in flight, if any
    received: torch.Tensor | None = None  # ZeRO-2: this rank's shard of the sum, once the collective is done

    def allocate(self):
        """A zeroed flat buffer (the padding stays zero: no gradient is ever added there), and each
        parameter's gradient as a view into it, in the parameter's shape."""
        first = self.params[0]
        self.grads = torch.zeros(self.padded_numel, dtype=first.dtype, device=first.device)
        self.views = [self.grads[start:start + p.numel()].view_as(p) for p, start in zip(self.params, self.offsets)]

    def free(self):
        """Drop the flat buffer (ZeRO-2, once the bucket has been sent)."""
        self.grads, self.views = None, []

    def view(self, position: int) -> torch.Tensor:
        """The gradient of its parameter at `position` (a view into the flat buffer)."""
        return self.views[position]

    def arm(self):
        """Before a backward that sends: every parameter's gradient is still to come."""
        self.pending = set(range(len(self.params)))


def make_bucket(index: int, named_params: list[tuple[str, torch.Tensor]], pad_to: int = 1) -> Bucket:
    """A bucket of these parameters (one dtype), laid end to end in their order, padded to a
    multiple of `pad_to` values; its buffer is not allocated yet."""
    names, params = [n for n, _ in named_params], [p for _, p in named_params]
    if len({p.dtype for p in params}) != 1:
        raise ValueError(f"bucket {index} mixes dtypes {sorted(str(p.dtype) for p in params)}: one flat buffer, one dtype")
    offsets, numel = [], 0
    for p in params:
        offsets.append(numel)
        numel += p.numel()
    padded = -(-numel // pad_to) * pad_to  # the smallest multiple of pad_to that holds them all
    bucket = Bucket(index, params, names, offsets, numel, padded)
    bucket.arm()
    return bucket
