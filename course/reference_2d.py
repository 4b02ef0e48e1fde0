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
from torch.utils._python_dispatch import TorchDispatchMode

from course.collectives import Collective
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


class TorchCollectiveLog(TorchDispatchMode):
    """Writes down every collective PyTorch issues inside `with` as a course.collectives.Collective,
    so torch's bytes are counted by the same ring formulas as ours. FSDP2 calls c10d's ops; DTensor
    calls the functional ones (_c10d_functional), with the group given by size or by name. An op of
    either namespace not understood here goes to `unknown`: a count that misses one is not shown.

    A mode sees an op before any tensor subclass does, and is switched off while it runs the op. So
    an op on DTensors is handed back (NotImplemented): DTensor then runs it with this mode still on,
    and the collectives its op handlers issue inside come through here too (loss_parallel's
    cross-entropy all-reduces its max, its sum of exponentials and the target logits that way)."""

    _IGNORED = {"wait_tensor", "_wrap_tensor_autograd"}  # bookkeeping, nothing sent
    # c10d's ops by name: (what they do, the position of the payload: a tensor or a list whose first
    # tensor counts, the position of the process group)
    _C10D = {"_allgather_base_": ("all_gather", 1, 2), "allgather_": ("all_gather", 1, 2),
             "_reduce_scatter_base_": ("reduce_scatter", 0, 2), "reduce_scatter_": ("reduce_scatter", 0, 2),
             "allreduce_": ("all_reduce", 0, 1)}

    def __init__(self):
        super().__init__()
        self.log, self.unknown = [], set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor run the op: what it issues comes back here, plain tensors
        namespace, name = func.namespace, func.__name__.split(".")[0]
        if namespace in ("c10d", "_c10d_functional") and name not in self._IGNORED:
            try:
                self.log.append(self._record(namespace, name, args))
            except (KeyError, IndexError, AttributeError, RuntimeError):
                self.unknown.add(f"{namespace}.{name}")
        return func(*args, **(kwargs or {}))

    @classmethod
    def _record(cls, namespace, name, args) -> Collective:
        if namespace == "c10d":
            op, payload_at, group_at = cls._C10D[name]
            payload = args[payload_at][0] if isinstance(args[payload_at], list) else args[payload_at]
            group = dist.ProcessGroup.unbox(args[group_at])  # the dispatcher hands it over as a ScriptObject
            return Collective(op, payload.nbytes, "torch", group.size())
        if name == "all_gather_into_tensor":  # (input, group size, group name)
            return Collective("all_gather", args[0].nbytes, "torch", args[1])
        if name == "reduce_scatter_tensor":  # (input, reduce op, group size, group name)
            return Collective("reduce_scatter", args[0].nbytes // args[2], "torch", args[2])
        if name in ("all_reduce", "all_reduce_"):  # (input, reduce op, group name)
            from torch.distributed.distributed_c10d import _resolve_process_group  # private: guarded by the caller
            return Collective("all_reduce", args[0].nbytes, "torch", _resolve_process_group(args[2]).size())
        raise KeyError(name)
