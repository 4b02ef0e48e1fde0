"""Module 12, part 3 - the vocabulary split over t ranks: embedding rows, LM-head rows, and a
cross-entropy that never gathers the logits.

The vocabulary V is padded up to V', a multiple of t (times Megatron's `divisible_by`, for
efficient GEMM shapes), and the rank at place i_t of the group keeps rows [i_t V'/t, (i_t + 1) V'/t)
of the embedding and of the LM head. The padding rows are zeros and stand for no token: no input is
ever one of them, and the loss masks their logits out, so they never take probability, never win
the max, and never receive a gradient.

Embedding: each token's row is on one rank; every rank ends with the whole lookup in the residual
stream's layout (docs/12-tensor-parallel.md, "The vocabulary split too").

Cross-entropy: the LM head is a column-parallel linear, so each rank holds its V'/t columns of the
logits z. A token's loss, log(sum_v exp(z_v)) - z_y for its target y, and its gradient (module 06's
softmax - onehot) are built from sums and maxima over the vocabulary; a sum or a max over the
vocabulary is the sum or the max over the ranks of each rank's own, one all-reduce of N numbers for
N tokens. So the ranks never gather the (N, V) logits. docs/12-tensor-parallel.md works out the
first reduction, the largest logit; which others the loss needs, and the loss and each rank's
gradient columns in terms of them, are yours. As in module 06, a target equal to IGNORE_INDEX adds
no loss and gets no gradient, and the sum over the real targets is divided by the step's count of
real tokens (n_tokens).
"""
from __future__ import annotations

import torch

from course.mesh import Group
from .m06_llama_model import IGNORE_INDEX, real_tokens
from .m06_llama_ops import compute_dtype
from .m12_tp_linear import leave_tp_backward, leave_tp_forward


def padded_vocab_size(vocab_size: int, t: int, divisible_by: int = 1) -> int:
    """V': the vocabulary V rounded up to a multiple of divisible_by * t (Megatron pads to 128 t) (given)."""
    multiple = divisible_by * t
    return -(-vocab_size // multiple) * multiple


def padded_rows(weight: torch.Tensor, padded_vocab: int) -> torch.Tensor:
    """An embedding or LM head (V, dim) with zero rows up to padded_vocab: rows that stand for no token (given)."""
    return torch.cat([weight, weight.new_zeros(padded_vocab - weight.shape[0], weight.shape[1])])


def vocab_rows(weight: torch.Tensor, padded_vocab: int, tp: Group) -> torch.Tensor:
    """This rank's rows of an embedding or LM head (V, dim), padded with zero rows to padded_vocab:
    rows [i_t V'/t, (i_t + 1) V'/t), i_t = tp.index, a contiguous copy (given)."""
    per_rank = padded_vocab // tp.size
    return padded_rows(weight, padded_vocab)[tp.index * per_rank:(tp.index + 1) * per_rank].clone()


def embedding_forward(tokens: torch.Tensor, rows: torch.Tensor, tp: Group, sequence_parallel: bool) -> torch.Tensor:
    """The embedding of tokens (B, T) from this rank's rows (V'/t, dim) of the table, in the residual
    stream's layout: (B, T, dim), or (B, T / t, dim) with sequence parallelism."""
    # >>> TODO(m12): vocabulary-parallel embedding: the lookup from this rank's rows
    # Contract: returns the whole table's lookup of tokens in the residual stream's layout; rank i_t owns tokens
    #   [i_t V'/t, (i_t + 1) V'/t) (rows' row j is token i_t V'/t + j); one collective, labelled "embedding", and no
    #   row read outside rows. The tests compare it with a lookup of the whole table, with and without sequence
    #   parallelism.
    # The question: what does this rank contribute for a token it does not own, and how does it avoid reading
    #   out of its rows?
    # Pitfalls: a token this rank does not own: zeros, or a row clamped or wrapped around? An index out of range
    #   raises (or, worse, reads another row).
    # Hint 1: docs/12, "The vocabulary split too": which of a token's embedding rows does this rank hold, and
    #       what makes the sum over ranks come out as the lookup?
    # Hint 2: local index = token - i_t V'/t; owned when 0 <= local < V'/t; the owned rows looked up, zeros for the
    #       rest (a lookup at any valid row, then masked), then g's forward.
    # Hint 3: local = tokens - tp.index * rows.shape[0]; mine = (local >= 0) & (local < rows.shape[0])
    #       looked_up = rows[torch.where(mine, local, 0)] * mine.unsqueeze(-1)
    #       return leave_tp_forward(looked_up, tp, sequence_parallel, "embedding")
    per_rank = rows.shape[0]
    local = tokens - tp.index * per_rank
    mine = (local >= 0) & (local < per_rank)
    looked_up = rows[torch.where(mine, local, 0)] * mine.unsqueeze(-1).to(rows.dtype)
    return leave_tp_forward(looked_up, tp, sequence_parallel, "embedding")
    # <<<


def embedding_backward(dx: torch.Tensor, tokens: torch.Tensor, grad_rows: torch.Tensor, tp: Group,
                       sequence_parallel: bool):
    """Adds the embedding's gradient into grad_rows (V'/t, dim), this rank's rows: each token's dx goes
    to its row if this rank owns it. dx is in the residual stream's layout."""
    # >>> TODO(m12): vocabulary-parallel embedding backward: the gradient of this rank's rows
    # Contract: grad_rows[local row of token v] grows by the sum of dx over every position holding v, for the
    #   tokens v this rank owns; the other rows are untouched. Nothing is returned (the tokens need no gradient).
    # The question: which positions' gradients does this rank need for its rows, and how does a token seen
    #   twice add up?
    # Pitfalls: with sequence parallelism dx holds only this rank's positions: does a rank's row receive gradient
    #   from other positions too? Does indexed assignment add a repeated token twice?
    # Hint 1: the forward ended with g: what does g's backward hand every rank, and which rows then receive it?
    # Hint 2: dx_whole = g's backward of dx; for every owned position, its row (token - i_t V'/t) grows by its
    #       dx_whole row: an accumulating scatter (index_add), in grad_rows' dtype.
    # Hint 3: dx = leave_tp_backward(dx, tp, sequence_parallel, "embedding"); local, mine as in the forward
    #       grad_rows.index_add_(0, local[mine], dx[mine].to(grad_rows.dtype))
    dx = leave_tp_backward(dx, tp, sequence_parallel, "embedding")
    local = tokens - tp.index * grad_rows.shape[0]
    mine = (local >= 0) & (local < grad_rows.shape[0])
    grad_rows.index_add_(0, local[mine], dx[mine].to(grad_rows.dtype))
    # <<<


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, tp: Group,
                                 n_tokens: int | None = None):
    """Cross-entropy of N tokens from this rank's columns of the logits, summed over the real targets
    and divided by n_tokens (default: their count, module 06's real_tokens), and its gradient.

    logits: (N, V'/t), the columns of vocabulary entries [i_t V'/t, (i_t + 1) V'/t) (any float dtype;
    the statistics are computed in compute_dtype); entries >= vocab_size are padding. targets: (N,),
    in [0, vocab_size), or IGNORE_INDEX. Returns (loss, dlogits): the loss as a 0-d tensor in
    compute_dtype, the same on every rank; dlogits (N, V'/t) in logits' dtype, its gradient (0 in the
    padding columns and in the rows of ignored targets).
    """
    # >>> TODO(m12): the cross-entropy from this rank's columns: three reductions over the group, no logits gathered
    # Contract: three all-reduces of N values each, labelled "loss ..." ("loss max" for the largest logit): no
    #   rank ever holds another rank's logits. The loss equals F.cross_entropy(reduction="sum", ignore_index=-100) on
    #   the gathered, unpadded logits, divided by n_tokens; dlogits is the gradient of that loss (module 06's),
    #   this rank's columns. The tests fill the padding with logits that would win, use float32 logits of several
    #   hundred, and ignored targets.
    # The question: which two reductions besides the largest logit does the loss need, and what are the loss and
    #   this rank's gradient columns in terms of the three?
    # Maths: z, z_max, Z, z_y as docs/glossary.md defines them; a sum or max over the vocabulary is the sum or max
    #   over the ranks of each rank's own (docs/12, "Cross-entropy without the logits", works out z_max).
    # Pitfalls: can a padding column, whatever it holds, take probability or win the max? What does exp do in
    #   float32 above about 88? With what value does a rank that does not own a token's target column take part in
    #   the reduction that fetches it? An ignored target (-100) is owned by no rank: does its row add anything?
    # Hint 1: write one token's loss and its gradient with respect to one logit from the softmax's definition,
    #       shifted by z_max: which of the pieces are sums over the vocabulary, and which a single entry?
    # Hint 2: Z = Σ_v exp(z_v - z_max) (a sum over ranks of each rank's sum); z_y the target's logit, from its owner
    #       (the others give 0, and the all-reduce sums); loss per real token = log Z + z_max - z_y; the gradient
    #       of column v: (exp(z_v - z_max) / Z - [v = y]) / n_tokens, 0 in ignored rows; padding masked to -inf.
    # Hint 3: z = logits in compute_dtype, padding columns masked to -inf; z_max = z.max(-1).values
    #       tp.collectives.all_reduce(z_max, "loss max", op="max"); exps = torch.exp(z - z_max.unsqueeze(-1))
    #       sum_exp = exps.sum(-1); tp.collectives.all_reduce(sum_exp, "loss sum exp")
    #       z_y = z[row, local target] where this rank owns a real target, else 0; tp.collectives.all_reduce(z_y, "loss target")
    #       loss = torch.where(real, torch.log(sum_exp) + z_max - z_y, 0).sum() / n_tokens
    #       dlogits = exps / sum_exp.unsqueeze(-1), minus 1 at the owned targets, ignored rows zeroed, / n_tokens, in
    #       logits' dtype
    if n_tokens is None:
        n_tokens = real_tokens(targets)
    rows, per_rank = logits.shape
    start = tp.index * per_rank
    z = logits.to(compute_dtype(logits.dtype))
    padding = torch.arange(start, start + per_rank, device=logits.device) >= vocab_size
    z = z.masked_fill(padding, float("-inf"))
    z_max = z.max(dim=-1).values
    tp.collectives.all_reduce(z_max, "loss max", op="max")
    exps = torch.exp(z - z_max.unsqueeze(-1))
    sum_exp = exps.sum(dim=-1)
    tp.collectives.all_reduce(sum_exp, "loss sum exp")
    real = targets != IGNORE_INDEX
    local = targets - start
    mine = (local >= 0) & (local < per_rank) & real
    row = torch.arange(rows, device=logits.device)
    z_y = torch.where(mine, z[row, torch.where(mine, local, 0)], 0.0)
    tp.collectives.all_reduce(z_y, "loss target")
    loss = torch.where(real, torch.log(sum_exp) + z_max - z_y, 0).sum() / n_tokens
    dlogits = exps / sum_exp.unsqueeze(-1)
    dlogits[row[mine], local[mine]] -= 1
    return loss, (dlogits.masked_fill(~real.unsqueeze(-1), 0) / n_tokens).to(logits.dtype)
    # <<<
