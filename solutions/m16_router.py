"""Module 16, part 1 - the router: which k of the E experts each token goes to, with what weight,
and the two ways of keeping the experts' loads even.

For one token n (a row of the MoE layer's input, width M), with the router's weight W_r (E, M):

    u = n W_r^T                     the router's logits, one per expert (in compute_dtype: float32 at least)
    σ = softmax(u)  or  sigmoid(u)  the scores (Mixtral and Qwen3 take the softmax, DeepSeek-V3 the sigmoid)
    chosen = top-k of σ + ρ         the k experts with the highest biased scores (ρ: the balancing bias, below)
    w_i = σ_i / Σ_{j chosen} σ_j    for each chosen i: the combine weights, normalised *after* the top-k

The bias ρ (one value per expert) only decides *which* experts are chosen; the weights are the
unbiased scores. The layer's output for the token is Σ_i w_i expert_i(n), so the router gets its
gradient through the weights w (and, with the auxiliary loss, through σ directly).

Load balancing. A router left alone sends most tokens to a few experts. Two remedies:

  auxiliary loss (DeepSeek-V3's per-sequence form): for each sequence of T tokens,
      φ_j = E / (k T) · (tokens of the sequence that chose expert j)      (1 where every expert gets its share)
      π_j = (1 / T) Σ_t σ'_{t,j}   with σ' = σ / Σ_j σ_j (each token's scores normalised over all E)
      L_seq = λ Σ_j φ_j π_j
    φ is a count (no gradient); the gradient reaches the router through π. Per sequence, so it does
    not depend on how a batch is cut into microbatches or ranks: the loss of a batch is a sum of its
    sequences' losses. With context parallelism a sequence's tokens are on c ranks: the two sums over
    its tokens are all-reduced over c before φ and π are formed.
  auxiliary-loss-free bias (DeepSeek-V3): after each optimizer step, every expert's load (the tokens
    the router sent it in the step, over the whole global batch: summed over every data rank) is
    compared with the even share, and ρ_j moves by a fixed step γ so that the next step's loads are a
    little more even. No gradient at all.

Shapes: n is (N, M), the N tokens of one rank's microbatch, sequence after sequence (T rows each).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from course.mesh import Group
from .m06_llama_ops import compute_dtype

SCORES = ("softmax", "sigmoid")
BALANCE = ("aux", "bias", "none")


@dataclass(frozen=True)
class MoEConfig:
    """The mixture-of-experts feed-forward: E experts, top-k routing, capacity and balancing."""
    n_experts: int = 8                      # E
    top_k: int = 2                          # k, experts per token
    expert_dim: int = 32                    # F, each expert's SwiGLU width (the shared expert's too)
    shared_expert: bool = False             # one more SwiGLU that every token goes through, weight 1
    score: str = "softmax"                  # "softmax" or "sigmoid"
    capacity_factor: float | None = None    # f; None: dropless (every routed token is computed)
    balance: str = "aux"                    # "aux" (the loss), "bias" (auxiliary-loss-free) or "none"
    aux_coef: float = 0.01                  # λ, the auxiliary loss's coefficient
    bias_rate: float = 0.001                # γ, the bias's step per optimizer step

    def __post_init__(self):
        if self.n_experts < 1 or self.expert_dim < 1:
            raise ValueError(f"n_experts and expert_dim must be positive, got {self.n_experts} and {self.expert_dim}")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top-k {self.top_k} must be between 1 and the number of experts E={self.n_experts}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"the capacity factor must be positive (or None: dropless), got {self.capacity_factor}")
        if self.score not in SCORES:
            raise ValueError(f"unknown router score {self.score!r}: one of {', '.join(SCORES)}")
        if self.balance not in BALANCE:
            raise ValueError(f"unknown balancing method {self.balance!r}: one of {', '.join(BALANCE)}")

    def capacity(self, n_tokens: int) -> int | None:
        """κ, the most slots one source's N tokens may fill in one expert: ceil(f k N / E), or None
        when dropless. Applied per source rank and microbatch, as production dispatchers do."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * self.top_k * n_tokens / self.n_experts)


def check_expert_split(moe: MoEConfig, e: int):
    """One line for experts that e ranks cannot share evenly (given)."""
    if moe.n_experts % e:
        raise ValueError(f"E={moe.n_experts} experts cannot be split over e={e} ranks: e must divide E")


@dataclass
class Routing:
    """The router's decision for N tokens."""
    scores: torch.Tensor    # σ (N, E), compute dtype
    experts: torch.Tensor   # (N, k) int64: the chosen experts, best first
    weights: torch.Tensor   # w (N, k), compute dtype: the chosen scores normalised over the k


def route(n: torch.Tensor, w_router: torch.Tensor, bias: torch.Tensor | None, moe: MoEConfig) -> Routing:
    """Scores, the top-k choice (biased by `bias` if given) and the combine weights of tokens n (N, M)."""
    # >>> TODO(m16): the router's forward: the scores, each token's k experts and their combine weights
    # Contract: n is (N, M), w_router (E, M), bias (E,) or None (no bias). Return Routing(scores, experts, weights):
    #   σ (N, E) in compute_dtype(n.dtype) (float32 for bf16 tokens), the k chosen experts (N, k) best first (as
    #   torch.topk orders them), and their weights w (N, k) in the same dtype, which sum to 1 over each token's k.
    #   The tests compare with the maths in float64 (softmax and sigmoid, with a bias that changes the choice) and
    #   check the dtypes with bf16 tokens.
    # Maths: the module docstring defines u, σ, the choice and w.
    # Question: which quantity decides the choice, which one makes the weights, and what does each see of the bias?
    # Pitfalls: what do weights normalised over all E, then cut to k, sum to? Which dtype does the bias arrive in?
    # Hint 1: the chapter's "The layer" tells the choice apart from the weights: which of the two may the bias touch,
    #         and over which experts does a token's normalisation run?
    # Hint 2: u = n W_r^T in compute dtype; σ = softmax(u) over E or sigmoid(u); chosen = the top k of σ + ρ;
    #         w_i = σ_i / Σ_{j chosen} σ_j (the unbiased scores).
    # Hint 3: dtype = compute_dtype(n.dtype);  u = n.to(dtype) @ w_router.to(dtype).t()
    #         scores = torch.softmax(u, dim=-1) or torch.sigmoid(u)
    #         experts = torch.topk(scores + bias.to(dtype) (or scores alone), k, dim=-1).indices
    #         chosen = scores.gather(1, experts);  return Routing(scores, experts, chosen / chosen.sum(-1, keepdim=True))
    dtype = compute_dtype(n.dtype)
    logits = n.to(dtype) @ w_router.to(dtype).t()
    scores = torch.softmax(logits, dim=-1) if moe.score == "softmax" else torch.sigmoid(logits)
    experts = torch.topk(scores if bias is None else scores + bias.to(dtype), moe.top_k, dim=-1).indices
    chosen = scores.gather(1, experts)
    return Routing(scores, experts, chosen / chosen.sum(-1, keepdim=True))
    # <<<


def route_backward(d_weights: torch.Tensor, d_scores: torch.Tensor | None, n: torch.Tensor, w_router: torch.Tensor,
                   routing: Routing, moe: MoEConfig):
    """(dn, dw_router) from the gradient of the combine weights (N, k) and, if not None, a gradient
    reaching the scores directly (N, E) (the auxiliary loss's)."""
    # >>> TODO(m16): the router's backward: through the weights' normalisation, the top-k and the scores
    # Contract: d_weights (N, k) is dL/dw for the chosen experts (compute dtype); d_scores (N, E) or None is a
    #   gradient of σ from elsewhere (the auxiliary loss). Return (dn, dw_router): dn in n's shape and dtype,
    #   dw_router in w_router's shape and dtype, computed in routing's dtype (float32 for bf16 tokens). The tests
    #   compare with autograd in float64 (softmax and sigmoid, with and without d_scores) on a routing of their own,
    #   and bf16 tokens with float64 on the same inputs.
    # Maths: w = the chosen σ divided by S, their sum over the k; the top-k is a selection, with no gradient of its own.
    # Question: what gradient does each of the E scores get from d_weights, and where does d_scores join it?
    # Pitfalls: does S depend on one chosen score or on all k of them? Which scores does the selection leave without a
    #   gradient? Does the softmax's backward mix the E scores, and the sigmoid's? Before or after the score function's
    #   backward does d_scores join?
    # Hint 1: the chapter's "The router's backward" differentiates a vector divided by its length; here a vector is
    #         divided by its sum: what changes in the term that every entry shares? Then: what does a selection pass
    #         back, and what do the score function and the linear layer?
    # Hint 2: dσ_i = (dw_i - Σ_j dw_j w_j) / S for the chosen i, 0 for the others, plus d_scores;
    #         softmax: du = σ (dσ - Σ_j dσ_j σ_j); sigmoid: du = dσ σ (1 - σ); dn = du W_r, dW_r = du^T n.
    # Hint 3: total = scores.gather(1, experts).sum(-1, keepdim=True)
    #         d_chosen = (d_weights - (d_weights * weights).sum(-1, keepdim=True)) / total
    #         d_all = torch.zeros_like(scores).scatter_add_(1, experts, d_chosen), plus d_scores if given
    #         softmax: du = scores * (d_all - (d_all * scores).sum(-1, keepdim=True));  sigmoid: du = d_all * scores * (1 - scores)
    #         return (du @ w_router.to(dtype)).to(n.dtype), (du.t() @ n.to(dtype)).to(w_router.dtype)
    scores, weights = routing.scores, routing.weights
    total = scores.gather(1, routing.experts).sum(-1, keepdim=True)
    d_chosen = (d_weights - (d_weights * weights).sum(-1, keepdim=True)) / total
    d_scores_all = torch.zeros_like(scores).scatter_add_(1, routing.experts, d_chosen)
    if d_scores is not None:
        d_scores_all = d_scores_all + d_scores
    if moe.score == "softmax":
        d_logits = scores * (d_scores_all - (d_scores_all * scores).sum(-1, keepdim=True))
    else:
        d_logits = d_scores_all * scores * (1 - scores)
    dn = d_logits @ w_router.to(scores.dtype)
    return dn.to(n.dtype), (d_logits.t() @ n.to(scores.dtype)).to(w_router.dtype)
    # <<<


def sequence_aux_loss(scores: torch.Tensor, experts: torch.Tensor, seq_len: int, moe: MoEConfig,
                      context: Group | None = None):
    """DeepSeek-V3's per-sequence balance loss. scores σ (N, E) and experts (N, k) of N = S seq_len
    tokens, S sequences of seq_len tokens each, one after the other. Returns (losses, d_scores): each
    sequence's L_seq (S,), and the gradient of their sum with respect to σ (N, E).

    `context` is the group of ranks that hold the other parts of the same sequences (context
    parallelism: each rank holds seq_len of the sequence's c seq_len tokens), or None."""
    # >>> TODO(m16): the per-sequence auxiliary loss and its gradient
    # Contract: return (losses, d_scores): losses (S,) holds each sequence's L_seq (λ is moe.aux_coef), d_scores (N, E)
    #   the gradient of losses.sum() with respect to scores, both in scores' dtype. With a context group, whatever the
    #   ranks must share travels as one tensor, (S, 2E), in one all-reduce through context.collectives labelled
    #   "aux loss statistics" (the test reads the log). The tests compare with autograd, 1 sequence worked by hand,
    #   and sequences split over 2 ranks with whole ones.
    # Maths: the module docstring defines φ, π, σ' and L_seq; T is the sequence's whole length (seq_len times the
    #   context group's size); φ is a count: no gradient flows through it.
    # Question: what gradient does L_seq send to one token's σ, and what must a rank that holds part of a sequence
    #   learn from the others before it can form φ and π?
    # Pitfalls: over which tokens do the counts and the means run: the sequence's, or all the N a rank holds (the tests
    #   compare 1, 2 and 4 ranks, with and without microbatches)? For a sigmoid, is σ' the same as σ? What is T when
    #   a sequence is on c ranks?
    # Hint 1: the chapter's "Load balancing" works L_seq of a small sequence by hand: holding φ fixed, what is
    #         dL_seq/dσ'_{t,j}, and how does it go back through σ' = σ / Σσ (the router's backward did a normalisation
    #         by a sum)? Which two per-sequence sums does that need?
    # Hint 2: dL_seq/dσ'_{t,j} = λ φ_j / T for every token t of the sequence; dσ = (dσ' - Σ_j dσ'_j σ'_j) / Σ_j σ_j,
    #         per token; the counts and the sums of σ' per sequence are (S, E) each, and those are what c ranks add up.
    # Hint 3: S = N // seq_len;  T = seq_len times the context's size (1 without one)
    #         normalised = σ / σ's row sums;  chose = torch.zeros_like(σ).scatter_(1, experts, 1.0)
    #         stats = torch.cat([chose.view(S, seq_len, E).sum(1), normalised.view(S, seq_len, E).sum(1)], dim=1)
    #         all-reduce stats over the context, if any;  counts, sums = stats.split(E, dim=1)
    #         φ = E / (k T) counts;  π = sums / T;  losses = λ (φ π).sum(-1)
    #         d_norm = (λ φ / T).repeat_interleave(seq_len, dim=0);  d_scores = (d_norm - (d_norm * normalised).sum(-1, keepdim=True)) / row sums
    n_tokens, n_experts = scores.shape
    n_sequences = n_tokens // seq_len
    length = seq_len * (context.size if context is not None else 1)
    row_sums = scores.sum(-1, keepdim=True)
    normalised = scores / row_sums
    chose = torch.zeros_like(scores).scatter_(1, experts, 1.0)
    stats = torch.cat([chose.view(n_sequences, seq_len, n_experts).sum(1),
                       normalised.view(n_sequences, seq_len, n_experts).sum(1)], dim=1)
    if context is not None:
        context.collectives.all_reduce(stats, label="aux loss statistics")
    counts, sums = stats.split(n_experts, dim=1)
    share = n_experts / (moe.top_k * length) * counts   # φ (S, E)
    mean_scores = sums / length                          # π (S, E)
    losses = moe.aux_coef * (share * mean_scores).sum(-1)
    d_normalised = (moe.aux_coef * share / length).repeat_interleave(seq_len, dim=0)
    d_scores = (d_normalised - (d_normalised * normalised).sum(-1, keepdim=True)) / row_sums
    return losses, d_scores
    # <<<


def update_biases(biases: list[torch.Tensor], loads: torch.Tensor, moe: MoEConfig):
    """The auxiliary-loss-free update, after an optimizer step: biases[l] (E,) is layer l's ρ, updated
    in place; loads (L, E) the tokens each layer's router sent each expert in the step, over the whole
    global batch (summed over every data rank by the caller)."""
    # >>> TODO(m16): the auxiliary-loss-free bias update
    # Contract: afterwards every biases[l] is the same tensor, each expert's entry moved by the chapter's fixed step γ
    #   (moe.bias_rate) or not at all, so that the experts this step crowded are a little less likely to be chosen next
    #   step and those it left idle a little more; an expert that got exactly its even share of the layer's load keeps
    #   its bias. Nothing is returned. The test checks two layers' biases by value and that the tensors are the same.
    # Maths: loads (L, E) counts slots; every token sends k of them.
    # Question: crowded against what, and which way must a bias move to make its expert less likely to be chosen?
    # Pitfalls: does `bias = ...` change the tensor the model holds? Whose loads are they: one rank's, or the whole
    #   global batch's (the caller sums them)?
    # Hint 1: the chapter's "Load balancing" says what the bias is for: by how much, and in which direction, should an
    #         expert's bias move after a step in which it was crowded?
    # Hint 2: ρ_j ← ρ_j + γ sign(share - load_j), with share = (Σ_j load_j) / E per layer.
    # Hint 3: error = loads.sum(-1, keepdim=True) / E - loads
    #         for each layer's bias and error row: bias.add_(γ * torch.sign(row).to(bias.dtype))
    error = loads.sum(-1, keepdim=True) / moe.n_experts - loads
    for bias, layer_error in zip(biases, error, strict=True):
        bias.add_(moe.bias_rate * torch.sign(layer_error).to(bias.dtype))
    # <<<
