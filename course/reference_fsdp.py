"""PyTorch's own FSDP (FSDP2, `fully_shard`) on the nn.Module reference Llama (given): the
independent implementation module 07 is compared with, in its tests and its benchmark."""
from __future__ import annotations

import torch

from course.reference_llama import ReferenceLlama


def fully_shard_api():
    """FSDP2's entry point: public in torch.distributed.fsdp since 2.6, earlier under _composable."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


class LossModule(torch.nn.Module):
    """FSDP2 gathers a root's weights in the root's forward hook, so the loss must be the forward."""

    def __init__(self, llama: ReferenceLlama):
        super().__init__()
        self.llama = llama

    def forward(self, tokens, targets):
        return self.llama.loss(tokens, targets)


def fsdp2_llama(model) -> LossModule:
    """The nn.Module reference with module 06 `model`'s weights, fully_shard-ed per block and at the root."""
    fully_shard = fully_shard_api()
    llama = ReferenceLlama(model.cfg, dtype=model.embedding.dtype)
    with torch.no_grad():
        for name in ("embedding", "final_norm", "lm_head"):
            getattr(llama, name).copy_(getattr(model, name))
    for block, weights in zip(llama.blocks, model.blocks):
        block.load(weights)
        fully_shard(block)
    root = LossModule(llama)
    fully_shard(root)
    return root
