"""PyTorch's own tensor parallelism (DTensor's `parallelize_module`) on the nn.Module reference Llama
(given): the independent implementation module 12 is compared with, in its tests and benchmark.

The plan is Megatron's, written in DTensor's styles: ColwiseParallel for q, k, v, gate, up and
the LM head, RowwiseParallel for o, down and the embedding (its rows are the vocabulary), and,
with sequence parallelism, SequenceParallel for the norms, the residual stream as Shard(1) between
the blocks' halves, and PrepareModuleInput to all-gather it before attention and the FFN. The loss
is computed under `loss_parallel()`, on logits left sharded over the vocabulary.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from course.reference_llama import ModularLlama


def tp_plan(sequence_parallel: bool) -> tuple[dict, dict]:
    """(the root's plan, every block's plan) for parallelize_module."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    stream = Shard(1) if sequence_parallel else Replicate()  # the residual stream between the halves
    root = {"embedding": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
            "lm_head": ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False)}
    block = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
             "attention.wo": RowwiseParallel(output_layouts=stream),
             "ffn.w_gate": ColwiseParallel(), "ffn.w_up": ColwiseParallel(),
             "ffn.w_down": RowwiseParallel(output_layouts=stream)}
    if sequence_parallel:
        root["final_norm"] = SequenceParallel()
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        block.update({"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
                      "attention": gather, "ffn": gather})
    return root, block


def dtensor_llama(model, sequence_parallel: bool = False) -> ModularLlama:
    """The nn.Module reference with module 06 `model`'s weights, tensor-parallel over the default
    group's ranks (all of them: a 1-D mesh)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    llama = ModularLlama(model.cfg, dtype=model.embedding.dtype).load(model)
    root_plan, block_plan = tp_plan(sequence_parallel)
    for block in llama.blocks:
        parallelize_module(block, mesh, block_plan)
    return parallelize_module(llama, mesh, root_plan)


def dtensor_loss(llama: ModularLlama, tokens: torch.Tensor, targets: torch.Tensor, backward: bool = True):
    """Mean cross-entropy of the parallelized model, computed on vocabulary-sharded logits (and its
    backward, inside the same loss_parallel context, as PyTorch requires). Returns the loss as a float."""
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        logits = llama(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.reshape(-1))
        if backward:
            loss.backward()
    return loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item()
