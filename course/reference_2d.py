"""PyTorch's own 2-D stack on the nn.Module reference Llama (given): DTensor's `parallelize_module`
over the t axis of a d x t device mesh (module 12's Megatron plan, course/reference_tp.py), then
FSDP2's `fully_shard` over its d axis (course/reference_fsdp.py), per block and at the root: the
independent implementation module 13 is compared with, in its tests and its benchmark.

The device mesh is `init_device_mesh("cpu", (d, t))`, with rank = i_d * t + i_t as in module 13.
Each rank feeds its d-rank's rows of the global batch (the t ranks of a row see the same rows);
the loss is computed under `loss_parallel()` on logits left split over the vocabulary, and FSDP2
averages the gradients over d.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course.reference_fsdp import fully_shard_api
from course.reference_llama import ModularLlama
from course.reference_tp import tp_plan


def fsdp_tp_llama(model, d: int, t: int):
    """(the parallelized nn.Module Llama with module 06 `model`'s weights, its device mesh)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (d, t), mesh_dim_names=("d", "t"))
    llama = ModularLlama(model.cfg, dtype=model.embedding.dtype).load(model)
    root_plan, block_plan = tp_plan(sequence_parallel=False)
    for block in llama.blocks:
        parallelize_module(block, mesh["t"], block_plan)
    parallelize_module(llama, mesh["t"], root_plan)
    fully_shard = fully_shard_api()
    for block in llama.blocks:
        fully_shard(block, mesh=mesh["d"])
    fully_shard(llama, mesh=mesh["d"])
    return llama, mesh


def rows_of_this_rank(tokens: torch.Tensor, mesh) -> torch.Tensor:
    """The rows B/d of a global batch that this rank's d index feeds."""
    d, i_d = mesh["d"].size(), mesh["d"].get_local_rank()
    return tokens.chunk(d)[i_d]


def loss_and_backward(llama, mesh, tokens: torch.Tensor, targets: torch.Tensor) -> float:
    """The mean loss over the global batch (every rank gets it), after the backward of this rank's share."""
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        logits = llama(rows_of_this_rank(tokens, mesh))
        loss = F.cross_entropy(logits.flatten(0, 1), rows_of_this_rank(targets, mesh).reshape(-1))
        loss.backward()
    mean = (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach().clone()
    dist.all_reduce(mean, group=mesh["d"].get_group())  # the loss is not part of the training's traffic
    return mean.item() / mesh["d"].size()


def local_bytes(tensors) -> int:
    """Bytes this rank holds of some parameters, gradients or optimizer state (DTensors: the local part)."""
    return sum((t.to_local() if hasattr(t, "to_local") else t).nbytes for t in tensors)
