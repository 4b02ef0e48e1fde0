# Generated from solutions/m12_vocab_parallel.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 12`. (skeleton c1f637c9010f)
"""Module 12, part 3 - the vocabulary split over t ranks: embedding rows, LM-head rows, and a
cross-entropy that never gathers the logits.

The vocabulary V is padded up to V', a multiple of t (times Megatron's `divisible_by`, for
efficient GEMM shapes), and the rank at place i_t of the group keeps rows [i_t V'/t, (i_t + 1) V'/t)
of the embedding and of the LM head. The padding rows are zeros and stand for no token: no input is
ever one of them, and the loss masks their logits out, so they never take probability, never win
the max, and never receive a gradient.

Embedding: each rank looks up the tokens that fall in its rows and writes zeros for the others;
the sum over ranks is the embedding, so leaving the TP region (m12_tp_linear's g) finishes the
lookup.

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
    """V': the vocabulary V rounded up to a multiple of divisible_by * t (Megatron pads to 128 t)."""
    # TODO(m12): round vocab_size up to a multiple of divisible_by * t
    # Contract: the smallest multiple of divisible_by * t that is at least vocab_size (an int).
    # Pitfalls: a vocabulary that is already a multiple stays as it is. Integers only: no floats.
    raise NotImplementedError('TODO(m12): round vocab_size up to a multiple of divisible_by * t')


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
    # TODO(m12): vocabulary-parallel embedding: look up the tokens this rank owns, zeros elsewhere, leave
    # Contract: the sum over ranks of what each rank looks up is the whole table's lookup; leaving the TP
    #   region (leave_tp_forward, label "embedding") does that sum in the residual stream's layout.
    # Pitfalls: a token this rank does not own must give zeros, not row (token - start) clamped or wrapped
    #   around; an index out of range raises (or, worse, reads another row).
    raise NotImplementedError('TODO(m12): vocabulary-parallel embedding: look up the tokens this rank owns, zeros elsewhere, leave')


def embedding_backward(dx: torch.Tensor, tokens: torch.Tensor, grad_rows: torch.Tensor, tp: Group,
                       sequence_parallel: bool):
    """Adds the embedding's gradient into grad_rows (V'/t, dim), this rank's rows: each token's dx goes
    to its row if this rank owns it. dx is in the residual stream's layout."""
    # TODO(m12): vocabulary-parallel embedding backward: leave's backward, then add dx into the owned rows
    # Contract: grad_rows[local row of token v] grows by the sum of dx over every position holding v, for the
    #   tokens v this rank owns; the other rows are untouched. Nothing is returned (the tokens need no gradient).
    # Pitfalls: with sequence parallelism dx holds only this rank's positions, but its rows receive gradient
    #   from tokens at every position: leave's backward gives every position's. A token seen twice adds twice
    #   (index_add_, not indexing).
    raise NotImplementedError("TODO(m12): vocabulary-parallel embedding backward: leave's backward, then add dx into the owned rows")


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
    # TODO(m12): the cross-entropy from this rank's columns: three reductions over the group, no logits gathered
    # Contract: three all-reduces of N values each, labelled "loss ..." ("loss max" for the largest logit): no
    #   rank ever holds another rank's logits. The loss equals F.cross_entropy(reduction="sum", ignore_index=-100) on
    #   the gathered, unpadded logits, divided by n_tokens; dlogits is the gradient of that loss (module 06's),
    #   this rank's columns. Write the loss and the gradient in terms of the three reduced quantities.
    # Pitfalls: padding columns must not count, whatever they hold. exp overflows in float32 for logits above
    #   about 88 (the tests use logits of several hundred). A rank that does not own a token's target column
    #   must still take part in every all-reduce, with a value that leaves the result right; an ignored target
    #   (-100) is owned by no rank, and its row adds nothing (loss or gradient).
    raise NotImplementedError("TODO(m12): the cross-entropy from this rank's columns: three reductions over the group, no logits gathered")
