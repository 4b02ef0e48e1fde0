"""An independent mixture of experts written the straightforward way: autograd, a loop over the
experts, a loop over the slots for the capacity (module 16's tests compare the hand-written layer
and the expert-parallel model against it).

It shares nothing with solutions/m16_* but the maths and the weights' names: the router W_r (E, M),
the experts' gate, up (E, F, M) and down (E, M, F), an optional shared expert (1, F, M) / (1, M, F).
`ReferenceMoELlama` is module 06's Llama with this layer in place of the SwiGLU, on PyTorch's
attention (course/reference_llama.py's RoPE and RMSNorm): one process, the whole batch at once.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from course.reference_llama import rms_norm, rope


def swiglu(x, gate, up, down):
    return (F.silu(x @ gate.t()) * (x @ up.t())) @ down.t()


def capacity_mask(experts: torch.Tensor, n_experts: int, capacity_factor: float | None, groups) -> torch.Tensor:
    """kept (N, k): within each group of rows (a source: (start, stop)), expert j keeps the first
    ceil(f k N_group / E) of the slots that chose it, in token order then choice order."""
    n_tokens, top_k = experts.shape
    kept = torch.ones(n_tokens, top_k, dtype=torch.bool)
    if capacity_factor is None:
        return kept
    for start, stop in groups:
        limit = math.ceil(capacity_factor * top_k * (stop - start) / n_experts)
        taken = [0] * n_experts
        for token in range(start, stop):
            for choice in range(top_k):
                j = int(experts[token, choice])
                kept[token, choice] = taken[j] < limit
                taken[j] += 1
    return kept


def moe_ffn(n, w: dict, moe, seq_len: int, groups, bias=None):
    """The MoE feed-forward of n (N, M) (no residual): returns (out (N, M), per-sequence aux losses (S,),
    experts (N, k), kept (N, k)). `w` holds router, gate, up, down and (or None) shared_gate, shared_up,
    shared_down; `bias` (E,) moves the choice only."""
    logits = n @ w["router"].t()
    scores = torch.softmax(logits, -1) if moe.score == "softmax" else torch.sigmoid(logits)
    choice_scores = scores.detach() + (bias if bias is not None else 0)
    experts = torch.topk(choice_scores, moe.top_k, dim=-1).indices
    chosen = scores.gather(1, experts)
    weights = chosen / chosen.sum(-1, keepdim=True)
    kept = capacity_mask(experts, moe.n_experts, moe.capacity_factor, groups)
    out = torch.zeros_like(n)
    for j in range(moe.n_experts):
        token, choice = torch.nonzero((experts == j) & kept, as_tuple=True)
        expert_out = swiglu(n[token], w["gate"][j], w["up"][j], w["down"][j])
        out = out.index_add(0, token, weights[token, choice].unsqueeze(-1) * expert_out)
    if w.get("shared_gate") is not None:
        out = out + swiglu(n, w["shared_gate"][0], w["shared_up"][0], w["shared_down"][0])
    # DeepSeek-V3's sequence-wise balance loss, one sequence at a time.
    normalised = scores / scores.sum(-1, keepdim=True)
    losses = []
    for start in range(0, len(n), seq_len):
        rows = slice(start, start + seq_len)
        counts = torch.stack([(experts[rows] == j).any(-1).sum() for j in range(moe.n_experts)]).to(n.dtype)
        share = moe.n_experts / (moe.top_k * seq_len) * counts
        losses.append(moe.aux_coef * (share * normalised[rows].mean(0)).sum())
    return out, torch.stack(losses), experts, kept


BLOCK_NAMES = ("ln1", "wq", "wk", "wv", "wo", "ln2", "router", "gate", "up", "down",
               "shared_gate", "shared_up", "shared_down")


class ReferenceMoELlama:
    """Module 06's Llama with MoE blocks, in one process, with autograd. `weights` is a dict of leaf
    tensors: embedding, final_norm, lm_head, and for each layer l the BLOCK_NAMES as f"{l}.{name}"
    (the shared expert's absent without one); `biases` one (E,) tensor per layer."""

    def __init__(self, cfg, moe, weights: dict, biases: list[torch.Tensor]):
        self.cfg, self.moe, self.weights, self.biases = cfg, moe, weights, biases

    def block(self, l: int, x, groups):
        cfg, w = self.cfg, {name: self.weights.get(f"{l}.{name}") for name in BLOCK_NAMES}
        B, T, M = x.shape
        n = rms_norm(x, w["ln1"], cfg.norm_eps)
        q = rope((n @ w["wq"].t()).view(B, T, cfg.n_heads, cfg.head_dim), cfg.rope_theta)
        k = rope((n @ w["wk"].t()).view(B, T, cfg.n_kv_heads, cfg.head_dim), cfg.rope_theta)
        v = (n @ w["wv"].t()).view(B, T, cfg.n_kv_heads, cfg.head_dim)
        group = cfg.n_heads // cfg.n_kv_heads
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        h = x + o.transpose(1, 2).reshape(B, T, -1) @ w["wo"].t()
        n2 = rms_norm(h, w["ln2"], cfg.norm_eps).reshape(-1, M)
        bias = self.biases[l] if self.moe.balance == "bias" else None
        out, losses, experts, kept = moe_ffn(n2, w, self.moe, T, groups, bias)
        return h + out.view(B, T, M), losses, experts, kept

    def loss(self, tokens, targets, n_groups: int = 1):
        """(loss, cross-entropy, aux, loads (L, E), dropped slots) of the whole batch: the mean
        cross-entropy plus (1/B) Σ over sequences and layers of L_seq (with the auxiliary loss). The
        capacity applies per group: the batch's rows cut into n_groups equal sources."""
        B, T = tokens.shape
        rows = B * T // n_groups
        groups = [(g * rows, (g + 1) * rows) for g in range(n_groups)]
        x = self.weights["embedding"][tokens]
        aux, loads, dropped = 0.0, [], 0
        for l in range(self.cfg.n_layers):
            x, losses, experts, kept = self.block(l, x, groups)
            aux = aux + losses.sum() / B
            loads.append(torch.bincount(experts.reshape(-1), minlength=self.moe.n_experts))
            dropped += int((~kept).sum())
        logits = rms_norm(x, self.weights["final_norm"], self.cfg.norm_eps) @ self.weights["lm_head"].t()
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        total = ce + aux if self.moe.balance == "aux" else ce
        return total, ce, aux, torch.stack(loads), dropped

    def update_biases(self, loads: torch.Tensor):
        """DeepSeek-V3's auxiliary-loss-free step: ρ_j += γ sign(mean load - load_j), per layer."""
        dtype = self.biases[0].dtype
        for bias, layer_loads in zip(self.biases, loads.to(dtype), strict=True):
            bias += self.moe.bias_rate * torch.sign(layer_loads.mean() - layer_loads)

    @classmethod
    def of(cls, model):
        """A copy of a one-rank m16_moe_model.MoELlama (every expert), as leaf tensors that require grad."""
        weights = {"embedding": model.embedding, "final_norm": model.final_norm, "lm_head": model.lm_head}
        for l, block in enumerate(model.blocks):
            dense, moe = block.dense, block.moe
            weights.update({f"{l}.{name}": getattr(dense, name) for name in ("ln1", "wq", "wk", "wv", "wo", "ln2")})
            weights.update({f"{l}.router": moe.router, f"{l}.gate": moe.experts.gate, f"{l}.up": moe.experts.up,
                            f"{l}.down": moe.experts.down})
            if moe.shared is not None:
                weights.update({f"{l}.shared_gate": moe.shared.gate, f"{l}.shared_up": moe.shared.up,
                                f"{l}.shared_down": moe.shared.down})
        weights = {name: t.detach().clone().requires_grad_(True) for name, t in weights.items()}
        return cls(model.cfg, model.moe, weights, [block.moe.bias.clone() for block in model.blocks])
