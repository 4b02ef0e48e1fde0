"""Module 07, part 2 - FSDP's communication and memory arithmetic, before running anything.

A block holds P + 2M values (its seven matrices, P, and its two norm weights of M each: the
FlatLayout's numel), of b bytes each, sharded over the d ranks of the data group (padded to a
multiple of d):

  payload per collective  = ceil((P + 2M) / d) b   one rank's shard, all-gathers and reduce-scatters alike
  per block and microbatch: an all-gather in the forward, another in the backward, a reduce-scatter
                            of its gradient: 3 collectives, 3 payloads
  sent per collective     = (d - 1) payloads       the ring algorithm: a rank passes on d - 1 shards
  buffers                 = 2 full blocks (d ceil((P + 2M) / d) b each: one in use, one being gathered)
                          + 2 shard-sized communication buffers (one payload each)

A block that is still in a buffer when it is needed again (same layer, weights unchanged since it
was gathered) is reused without a collective: `kept` such blocks at each turn between a forward
and a backward save `kept` all-gathers per turn. Our double buffer keeps the last two layers, so
kept = min(2, L); PyTorch's FSDP Notes (its worked example of buffer sizes) count with kept = 0.

The embedding, the LM head (V M each) and the final norm (M) are replicated: their gradients are
summed by one all-reduce of (2 V M + M) b per step, 2 (d - 1) / d of it sent. Between steps a rank
keeps its L shards and the replicated weights, as many gradients, and AdamW's two moments of each.

`fsdp_traffic` returns all of it as a course/costs.py `StepCost` over the axis d, with the
signature of every cost formula of the course: (cfg, sizes, dtype, ...), sizes a mesh's axis sizes
(here only d = sizes["d"] matters; an axis left out has size 1).
"""
import torch

from course.costs import StepCost
from .m06_llama_block import LlamaConfig


def block_matrix_params(cfg: LlamaConfig) -> int:
    """P: the values of one block's seven matrices (wq, wk, wv, wo, w_gate, w_up, w_down) (given)."""
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return 2 * q * cfg.dim + 2 * kv * cfg.dim + 3 * cfg.ffn_dim * cfg.dim


def fsdp_traffic(cfg: LlamaConfig, sizes: dict[str, int], dtype: torch.dtype, n_microbatches: int = 1,
                 kept: int = 0) -> StepCost:
    """The collectives, the bytes one rank sends and the bytes it keeps in one optimizer step of FSDP
    over the d = sizes["d"] ranks, for module 06's Llama of `cfg` with weights in `dtype`.

    `n_microbatches` forward+backward passes per optimizer step (gradient accumulation); `kept` blocks
    reused from the buffers at each forward/backward turn (see the module docstring).
    """
    d, b, L, M = sizes.get("d", 1), dtype.itemsize, cfg.n_layers, cfg.dim
    if not 0 <= kept <= min(2, L):
        raise ValueError(f"kept must be between 0 and min(2, L) = {min(2, L)}, got {kept}")
    block = block_matrix_params(cfg) + 2 * M     # P + 2M: one block's values, FlatLayout's numel
    replicated = 2 * cfg.vocab_size * M + M      # the embedding, the LM head and the final norm
    all_reduce = StepCost(sent={("d", "all_reduce"): 2 * (d - 1) * replicated * b / d},
                          calls={("d", "all_reduce"): 1})  # the replicated gradients, once per step
    # >>> TODO(m07): one optimizer step's all-gathers and reduce-scatters, the buffers, and the state kept
    # Return all_reduce + a StepCost of the blocks over the axis "d": calls[("d", op)] the number of all-gathers
    #   and reduce-scatters in one step, sent[("d", op)] the bytes one rank sends for them, and memory: "buffers"
    #   (the two full-block buffers and the two communication buffers), "parameters" (the L shards and the
    #   replicated weights), "gradients" (as many) and "optimizer" (AdamW's two moments of each), in bytes.
    # Maths: a payload is one rank's shard, padded like FlatLayout's; every pass gathers every block, except the
    #   `kept` blocks still in the buffers at a turn; every block's gradient is reduce-scattered once per
    #   microbatch; a collective over d ranks sends d - 1 payloads; a full buffer holds d shards.
    # Pitfall: counting the turns: a step alternates forward, backward, forward, ..., backward, and the turns are
    #   the boundaries between consecutive passes. The tests check PyTorch's FSDP Notes' worked example (kept 0),
    #   counts written out by hand for kept 1 and 2, several microbatches, a payload that needs padding, and the
    #   log and the tensors of a real step.
    # Hint 1: count the passes (two per microbatch) and the turns between them (one fewer than the passes); each
    #         turn saves `kept` all-gathers.
    # Hint 2: payload = ceil(block / d) b (integer ceiling); turns = 2m - 1; all-gathers = 2 L m - kept turns;
    #         reduce-scatters = L m; sent = calls (d - 1) payload; buffers 2 d payloads + 2 payloads; parameters
    #         (L payloads + replicated b), gradients as many, optimizer twice that.
    # Hint 3: shard = ceil(block / d);  payload = shard b;  turns, all_gathers, reduce_scatters as above
    #         calls = {("d", "all_gather"): all_gathers, ("d", "reduce_scatter"): reduce_scatters}
    #         sent = each of calls times (d - 1) payload;  owned = (L shard + replicated) b
    #         memory = buffers 2 d payload + 2 payload, parameters owned, gradients owned, optimizer 2 owned
    #         return all_reduce + StepCost(sent, calls, memory)
    shard = -(-block // d)
    payload = shard * b
    turns = 2 * n_microbatches - 1
    all_gathers = 2 * L * n_microbatches - kept * turns
    reduce_scatters = L * n_microbatches
    calls = {("d", "all_gather"): all_gathers, ("d", "reduce_scatter"): reduce_scatters}
    sent = {key: n * (d - 1) * payload for key, n in calls.items()}
    owned = (L * shard + replicated) * b
    memory = {"buffers": 2 * d * payload + 2 * payload, "parameters": owned, "gradients": owned, "optimizer": 2 * owned}
    return all_reduce + StepCost(sent, calls, memory)
    # <<<
