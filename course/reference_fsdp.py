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


def fsdp2_unsharded_bytes(root: torch.nn.Module) -> int:
    """Bytes of FSDP2's unsharded (gathered) parameters still allocated under `root`: 0 between steps,
    since FSDP2 frees them after the backward (it resizes their storage to 0). Read from FSDP2's own
    records of its parameters (private attributes: an older or newer release without them counts 0)."""
    total = 0
    for module in root.modules():
        state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
        group = getattr(state, "_fsdp_param_group", None)
        for param in getattr(group, "fsdp_params", ()):
            unsharded = getattr(param, "_unsharded_param", None)
            total += unsharded.untyped_storage().nbytes() if unsharded is not None else 0
    return total
