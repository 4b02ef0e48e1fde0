# Generated from solutions/m07_payload.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 07`. (skeleton c36a5dda8d5e)
"""Module 07, part 2 - FSDP's communication and memory arithmetic, before running anything.

A block holds P + 2M values (its seven matrices, P, and its two norm weights of M each: the
FlatLayout's numel), the outer weights 2 V M + M (the embedding and the LM head, V M each, and the
final norm), of b bytes each, each group sharded over the d ranks of the data group as FlatLayout
cuts it. What one optimizer step costs follows from what the code does, counted by the log's rule:

  the passes   a step runs a forward and a backward over the L blocks for each of its microbatches;
               every pass asks the weight source for every block, and the source all-gathers a block
               unless its buffer still holds it, current (m07_sharded_weights); every backward
               reduce-scatters each block's gradient (m07_fsdp)
  the outer    each microbatch gathers the outer weights whole before its forward, keeps them to the
               end of its backward, then reduce-scatters their gradients (m07_fsdp's accumulate)
  the turns    between two consecutive passes: `kept` is how many blocks are still in the buffers,
               current, at a turn (our double buffer: min(2, L); PyTorch's FSDP Notes, whose worked
               example of buffer sizes the tests check, count with kept = 0)
  the log      course/collectives.py records each collective's payload (for an all-gather or a
               reduce-scatter: one rank's shard) and what one rank sends with the ring algorithm:
               n - 1 payloads over n ranks; for an all-reduce, 2 (n - 1) / n of the tensor
  the buffers  the full-size buffers ShardedWeights gathers blocks into (those a step allocates: block l
               goes to buffer l % 2), the whole outer weights
               during a microbatch, and the Notes' two shard-sized communication buffers (a block's)
               a collective sends from and receives into

Between steps a rank keeps its shards (the L blocks' and the outer weights'), as many gradients, and
AdamW's two moments of each: nothing whole (the buffers live only inside a step).

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
    d, b, L, M, m = sizes.get("d", 1), dtype.itemsize, cfg.n_layers, cfg.dim, n_microbatches
    if not 0 <= kept <= min(2, L):
        raise ValueError(f"kept must be between 0 and min(2, L) = {min(2, L)}, got {kept}")
    block = block_matrix_params(cfg) + 2 * M     # P + 2M: one block's values, FlatLayout's numel
    outer = 2 * cfg.vocab_size * M + M           # the embedding, the LM head and the final norm: one more group
    # TODO(m07): one optimizer step's all-gathers and reduce-scatters, the buffers, and the state kept
    # Contract: return a StepCost over the axis "d": calls[("d", op)] the number of all-gathers and reduce-scatters in
    #   one step, sent[("d", op)] the bytes one rank sends for them, and memory: "buffers" (the full-size buffers, the
    #   whole outer weights and the communication buffers), "parameters" (the L block shards and the outer weights'
    #   shard), "gradients" (as many) and "optimizer" (AdamW's state of each), in bytes. The tests check PyTorch's FSDP
    #   Notes' worked example (kept 0, the outer group's part counted by hand beside it), counts written out by hand for
    #   kept 1 and 2, several microbatches, and the log and the tensors of a real step, with groups that need padding.
    # The question: from what the code does (the module docstring) and the log's rule, how many collectives does a step
    #   of n_microbatches issue for each group, of which payload, and how big is each buffer?
    # Pitfalls: is a payload the block's values over d, or a padded shard? Do the two groups' collectives carry payloads
    #   of one size? Which turns between passes can reuse a kept block, and how many turns are there?
    raise NotImplementedError("TODO(m07): one optimizer step's all-gathers and reduce-scatters, the buffers, and the state kept")
