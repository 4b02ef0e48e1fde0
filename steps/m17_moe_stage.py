# Generated from solutions/m17_moe_stage.py by `python -m course.skeleton`. Given code: nothing
# to fill in here; read it, then run it with `python main.py run 17`. (skeleton dcf54ce9a385)
"""Module 17, part 4 - a pipeline stage of module 16's MoE Llama: experts over e, the rest FSDP over d.

Each block is module 16's MoEBlock: module 06's block with a zero FFN (attention, both norms), then
the MoE layer on n2 with this rank's E/e experts, tokens sent to their expert's member of the
expert group `groups.experts` and back by all-to-all. The stage holds, per block:

    the dense part (module 06's BlockWeights, zero FFN)   module 07's flat layout cut over fsdp, gathered
                                                         once a step, reduce-scattered once (as LlamaStage)
    the router (and the shared expert, if any)           a copy on every rank: gradient over groups.replicas
    this rank's E/e experts                              gradient over groups.expert_data (module 16's "ed")

The experts take whole tokens (module 16 routes each token on its rank), so this stage runs with
t = 1 and c = 1; check_moe_mesh says so before any rank starts. The loss is the mean cross-entropy
of the step's real tokens (every share divided by the step's divisor, as LlamaStage) plus module
16's auxiliary loss, each sequence's weighted 1/B; the reported loss is the cross-entropy, as module
16 reports it.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from .m06_llama_block import ActivationStore, LlamaConfig
from .m16_expert_parallel import local_experts
from .m16_moe_layer import MoEBlock, MoEBlockWeights, MoEWeights
from .m16_router import MoEConfig
from .m17_composition import Groups
from .m17_stage import LlamaStage


def check_moe_mesh(sizes: dict[str, int], moe: MoEConfig, recompute: bool = False, fp8: bool = False):
    """One line for a mesh (or an option) the MoE stage cannot run with (given)."""
    if fp8:
        raise ValueError("the MoE model runs in high precision (module 16's experts take no matmul policy); "
                         "drop --fp8 or --experts")
    if recompute:
        raise ValueError("the MoE model runs without recompute (its forward's routing records would count twice); "
                         "drop --recompute or --experts")
    if sizes.get("t", 1) > 1 or sizes.get("c", 1) > 1:
        raise ValueError(f"the MoE model runs with t=1 and c=1 (module 16's experts take whole tokens on their rank); "
                         f"got t={sizes.get('t', 1)}, c={sizes.get('c', 1)}: put those ranks on d or p")
    if moe.balance == "bias":
        raise ValueError("the composed MoE model balances with the auxiliary loss (--balance aux) or not at all "
                         "(none); module 16's bias update is not composed here")


class MoEStage(LlamaStage):
    """Stage `stage` of module 16's MoE Llama `whole` (a MoELlama on one process: every expert)."""

    def __init__(self, cfg: LlamaConfig, groups: Groups, stage: int, n_stages: int, whole, moe: MoEConfig,
                 attention_chunk: int = 256):
        self.moe = moe
        dense = SimpleNamespace(embedding=whole.embedding, final_norm=whole.final_norm, lm_head=whole.lm_head,
                                blocks=[b.dense for b in whole.blocks])
        super().__init__(cfg, groups, stage, n_stages, dense, "ring", attention_chunk)
        self.mine = mine = local_experts(moe.n_experts, groups.experts)  # the experts' numbers (checkpoints)
        self.moe_weights = []
        for layer in self.layers:
            w = whole.blocks[layer].moe
            self.moe_weights.append(MoEWeights(w.router.clone(), w.bias.clone(), w.experts.slice(mine),
                                               None if w.shared is None else w.shared.slice(range(1))))
        for layer, w in zip(self.layers, self.moe_weights, strict=True):  # copies on every rank: summed over replicas
            self.replicated[f"block {layer} router"] = w.router
            for name, t in zip(("gate", "up", "down"), w.shared.tensors() if w.shared is not None else ()):
                self.replicated[f"block {layer} shared {name}"] = t
        self.replicated_grads = {name: torch.zeros_like(w, dtype=self.grad_dtype) for name, w in self.replicated.items()}
        self.experts = [t for w in self.moe_weights for t in w.experts.tensors()]
        self.expert_grads = [torch.zeros_like(t, dtype=self.grad_dtype) for t in self.experts]

    def make_block(self, attention_chunk: int):
        return MoEBlock(self.cfg, self.moe, self.groups.experts)

    def new_store(self) -> ActivationStore:
        return ActivationStore() if self.training else ActivationStore(keep=frozenset(("n2", "h", "r2")))

    def begin_step(self, n_tokens: int, n_sequences: int):
        super().begin_step(n_tokens, n_sequences)
        self.block.moe_layer.aux_weight = 1.0 / n_sequences  # module 16: each sequence's auxiliary loss counts 1/B
        self.block.moe_layer.records.clear()

    def block_forward(self, i: int, x: torch.Tensor, store: ActivationStore) -> torch.Tensor:
        return self.block.forward(MoEBlockWeights(self.weights[i], self.moe_weights[i]), x, store)

    def block_backward(self, i: int, dy: torch.Tensor, store: ActivationStore) -> torch.Tensor:
        """Module 16's block backward returns its gradients: added here into the stage's accumulators."""
        layer = self.layers[i]
        dx, grads = self.block.backward(MoEBlockWeights(self.weights[i], self.moe_weights[i]), dy, store)
        for acc, g in zip(self.block_grads[i].tensors(), grads.dense.tensors(), strict=True):
            acc.add_(g)
        self.replicated_grads[f"block {layer} router"].add_(grads.moe.router)
        for name, g in zip(("gate", "up", "down"), grads.moe.shared.tensors() if grads.moe.shared is not None else ()):
            self.replicated_grads[f"block {layer} shared {name}"].add_(g)
        per_block = len(grads.moe.experts.tensors())
        for acc, g in zip(self.expert_grads[i * per_block:(i + 1) * per_block], grads.moe.experts.tensors(),
                          strict=True):
            acc.add_(g)
        return dx
