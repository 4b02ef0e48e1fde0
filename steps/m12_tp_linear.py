# Generated from solutions/m12_tp_linear.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 12`. (skeleton 1a7f2bcc21e7)
"""Module 12, part 1 - tensor-parallel linears: Megatron's column and row split, and the two
conjugate operators that connect them to the residual stream.

t ranks (one tensor-parallel group, a `course.mesh.Group`: `tp.index` = i_t, `tp.size` = t,
`tp.collectives`) share every linear layer y = x W^T, W (out, in):

  column-parallel   the rank at place i_t keeps block i_t of W's rows (a slice of the output
                    features) and computes its slice of y from the whole input x. No sum is
                    needed; the input must be whole.
  row-parallel      the rank at place i_t keeps block i_t of W's columns (a slice of the input
                    features) and multiplies its slice of x: a partial product, and y is the sum
                    of the t partials.

Column then row (q, k, v then o; gate, up then down) needs nothing in between: the column output's
slice is exactly the row input's slice. Two operators connect such a pair to the residual stream,
each the other's *conjugate* (its forward is the other's backward):

  enter (Megatron's f)   before the column-parallel linears   forward identity,   backward all-reduce
  leave (Megatron's g)   after the row-parallel linear        forward all-reduce, backward identity

With sequence parallelism the residual stream between the pairs is not replicated but split along
the sequence, and each all-reduce becomes one of its two halves (all-reduce = reduce-scatter, then
all-gather):

  enter (f)   forward all-gather along the sequence       backward reduce-scatter along the sequence
  leave (g)   forward reduce-scatter along the sequence   backward all-gather along the sequence

The column-parallel backward is where communication can hide behind compute (Megatron-LM's linear
"with gradient accumulation and async communication"): the input gradient's collective is started,
without waiting, *before* the weight-gradient GEMM, which does not need its result, and waited for
after it. With sequence parallelism the backward also gathers the input again (the forward kept
only this rank's sequence shard), started before the input-gradient GEMM, which does not need it
either.

Weight gradients are added into `main_grad` accumulators inside the GEMM (torch.addmm with
out=main_grad): over m microbatches each gradient is summed in main_grad's precision (float32 for
bf16 weights), never rounded to the weights' dtype on the way (Megatron's gradient-accumulation
fusion).

Every collective goes through `tp.collectives` (course/collectives.py), which logs it. Shapes: the
residual stream is (B, T, dim) on every rank, or (B, T / t, dim) with sequence parallelism.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from course.mesh import Group
from .m06_llama_ops import compute_dtype

SEQUENCE_DIM = 1  # (batch, sequence, features): sequence parallelism splits dimension 1


@dataclass
class InFlight:
    """A collective started without waiting (async_op=True), and the tensor it fills in."""
    result: torch.Tensor
    work: object = None  # what the collective returned; None: nothing to wait for

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.result


# ---------------------------------------------------------------------------------------------
# The conjugate operators
# ---------------------------------------------------------------------------------------------
def enter_tp_forward(x: torch.Tensor, tp: Group, sequence_parallel: bool, label: str = "",
                     async_op: bool = False) -> InFlight:
    """f's forward: the whole input of the column-parallel linears, (B, T, dim), from the residual
    stream x. Without sequence parallelism x is already whole (identity); with it, x is this rank's
    (B, T / t, dim) shard and the ranks' shards are gathered in rank order."""
    # TODO(m12): f forward: identity, or an all-gather along the sequence
    # Contract: return an InFlight whose wait() gives the whole (B, T, dim) input. With async_op=True the
    #   collective is only started (the column-parallel backward gathers while it computes).
    # Pitfalls: rank i_t's shard is sequence positions [i_t T/t, (i_t+1) T/t): gather along SEQUENCE_DIM, not the
    #   batch. Gather into a new tensor, never into x.
    raise NotImplementedError('TODO(m12): f forward: identity, or an all-gather along the sequence')


def enter_tp_backward(dx: torch.Tensor, tp: Group, sequence_parallel: bool, label: str = "",
                      async_op: bool = False) -> InFlight:
    """f's backward: each rank's dx (B, T, dim) is its partial of the input's gradient (its slice of the
    output features contributed only its part); the gradient of the residual stream is their sum, whole
    on every rank, or with sequence parallelism only this rank's (B, T / t, dim) shard of it."""
    # TODO(m12): f backward: all-reduce, or reduce-scatter along the sequence
    # Contract: an InFlight whose wait() gives the summed gradient in the residual stream's layout. With
    #   async_op=True the collective is only started: the caller computes the weight gradients meanwhile.
    # Pitfalls: an all-reduce with sequence parallelism gives every rank the whole sum (wrong shape for the
    #   sharded stream); a reduce-scatter along dim 0 cuts the batch, not the sequence. No 1/t: it is a sum.
    raise NotImplementedError('TODO(m12): f backward: all-reduce, or reduce-scatter along the sequence')


def leave_tp_forward(y: torch.Tensor, tp: Group, sequence_parallel: bool, label: str = "") -> torch.Tensor:
    """g's forward: y (B, T, dim) is this rank's partial product of a row-parallel linear; the residual
    stream needs the sum over ranks: whole on every rank, or this rank's sequence shard of it."""
    # TODO(m12): g forward: all-reduce, or reduce-scatter along the sequence
    # Contract: returns the sum over the group of the ranks' y, (B, T, dim) on every rank, or with sequence
    #   parallelism this rank's positions of it, (B, T / t, dim). Summing into y in place is fine: the callers
    #   pass a fresh product.
    # Pitfalls: this is f's backward collective, in the forward; the same shapes and the same sum.
    raise NotImplementedError('TODO(m12): g forward: all-reduce, or reduce-scatter along the sequence')


def leave_tp_backward(dy: torch.Tensor, tp: Group, sequence_parallel: bool, label: str = "") -> torch.Tensor:
    """g's backward: the gradient of the residual stream, whole (identity), or gathered from the
    ranks' sequence shards; every rank's row-parallel linear needs all of it."""
    # TODO(m12): g backward: identity, or an all-gather along the sequence
    # Contract: returns the whole (B, T, dim) gradient of g's output: dy itself without sequence parallelism;
    #   with it, the ranks' (B, T / t, dim) shards of dy gathered in rank order along the sequence.
    # The maths: y = sum of the partials, so d y / d partial_r is the identity: every rank's partial gets dy.
    # Pitfalls: an all-reduce here would add the t identical copies of the gradient: t times too big.
    raise NotImplementedError('TODO(m12): g backward: identity, or an all-gather along the sequence')


# ---------------------------------------------------------------------------------------------
# Weight gradients, accumulated inside the GEMM
# ---------------------------------------------------------------------------------------------
def addmm_into(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor):
    """acc += a @ b in one GEMM that writes acc itself, summing in acc's dtype (given).

    bf16 a and b with a float32 acc: on CUDA the GEMM reads bf16 and accumulates into float32
    (`out_dtype`, torch 2.8 on); CPU has no such kernel, so a and b are widened first: the same
    products (a bf16 times a bf16 is exact in float32) and the same float32 sums.
    """
    if a.dtype != acc.dtype and acc.is_cuda:
        try:
            return torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
        except (TypeError, RuntimeError, NotImplementedError):  # a torch without the mixed-dtype GEMM
            pass
    return torch.addmm(acc, a.to(acc.dtype), b.to(acc.dtype), out=acc)


def accumulate_weight_grad(main_grad: torch.Tensor, dy: torch.Tensor, x: torch.Tensor, fused: bool = True):
    """main_grad (out, in) += dy^T x, the weight gradient of y = x W^T summed over the tokens.

    dy is (..., out) and x (..., in), with the same leading (token) dimensions. `fused` (the default)
    adds inside the GEMM, in main_grad's precision; fused=False is the path it replaces, kept to
    compare: the GEMM returns a new tensor in the inputs' dtype (for bf16, one more rounding of the
    whole microbatch's gradient) and a second kernel adds it.
    """
    dy, x = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
    if not fused:
        main_grad.add_(dy.t() @ x)
        return
    # TODO(m12): add dy^T x into main_grad inside the GEMM
    # Contract: main_grad is updated in place (same tensor, same storage), summed in main_grad's dtype even
    #   when dy and x are bf16; nothing of the gradient's size is allocated in the inputs' dtype.
    # Pitfalls: main_grad += dy.t() @ x rounds each microbatch's gradient to bf16 first (the unfused path
    #   above); after m microbatches the sum is off by about m bf16 roundings instead of float32 ones.
    raise NotImplementedError('TODO(m12): add dy^T x into main_grad inside the GEMM')


# ---------------------------------------------------------------------------------------------
# Column- and row-parallel linears
# ---------------------------------------------------------------------------------------------
def column_parallel_forward(x: torch.Tensor, weights: list[torch.Tensor], tp: Group, sequence_parallel: bool,
                            label: str = ""):
    """y_i = f(x) W_i^T for linears that read the same input (q, k, v; or gate, up), each weight
    W_i (out_i / t, dim) being this rank's rows. x is in the residual stream's layout; each y_i is
    (B, T, out_i / t), the whole sequence. Returns the list of y_i."""
    # TODO(m12): column-parallel forward: enter the TP region once, then one GEMM per weight
    # Contract: returns [y_i], y_i = x_whole W_i^T of shape (B, T, out_i / t), x_whole the whole (B, T, dim) input.
    # Pitfalls: gather once for all the weights that share x, not once per weight (the collectives are
    #   counted). Wait for it before multiplying.
    raise NotImplementedError('TODO(m12): column-parallel forward: enter the TP region once, then one GEMM per weight')


def column_parallel_backward(dys: list[torch.Tensor], x: torch.Tensor, weights: list[torch.Tensor],
                             main_grads: list[torch.Tensor], tp: Group, sequence_parallel: bool,
                             label: str = "", fused: bool = True) -> torch.Tensor:
    """Backward of column_parallel_forward: adds dy_i^T x_whole into main_grads[i] and returns the
    gradient of x, summed over the ranks, in the residual stream's layout.

    x is what the forward was given, as the block saved it: this rank's sequence shard with sequence
    parallelism, so the whole input is gathered again here instead of being kept since the forward.
    The order is what hides communication behind compute:

        start gathering x (sequence parallelism)     in flight during the input-gradient GEMMs
        input-gradient GEMMs: dx = sum_i dy_i W_i    this rank's partial
        wait for x; start dx's all-reduce / reduce-scatter (async)
        weight-gradient GEMMs: main_grad_i += dy_i^T x    in flight behind them
        wait for dx, return it
    """
    # TODO(m12): column-parallel backward: the input-gradient collective in flight behind the weight-gradient GEMMs
    # Contract: every main_grads[i] (out_i / t, dim) grows by dy_i^T x_whole (summed over all B T tokens); the
    #   returned dx is sum over ranks of sum_i dy_i W_i, whole (B, T, dim) or this rank's (B, T / t, dim).
    # Pitfalls: waiting for dx's collective before the weight-gradient GEMMs (or starting it after them) hides
    #   nothing: the tests read the order of calls. Keeping the gathered x from the forward instead of
    #   gathering again costs t times the memory (the store's size is tested).
    raise NotImplementedError('TODO(m12): column-parallel backward: the input-gradient collective in flight behind the weight-gradient GEMMs')


def row_parallel_forward(x: torch.Tensor, w: torch.Tensor, tp: Group, sequence_parallel: bool,
                         label: str = "") -> torch.Tensor:
    """y = g(x W^T): x (B, T, in / t) is this rank's slice of the input features (a column-parallel
    output), w (dim, in / t) its columns of the weight. Returns y in the residual stream's layout."""
    # TODO(m12): row-parallel forward: this rank's partial product, then leave the TP region
    # Contract: y is the sum over ranks of x_r W_r^T, in the residual stream's layout.
    # Pitfalls: the partial product alone is not y: every rank must leave through g.
    raise NotImplementedError("TODO(m12): row-parallel forward: this rank's partial product, then leave the TP region")


def row_parallel_backward(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, main_grad: torch.Tensor,
                          tp: Group, sequence_parallel: bool, label: str = "", fused: bool = True) -> torch.Tensor:
    """Backward of row_parallel_forward: adds dy_whole^T x into main_grad (dim, in / t) and returns
    dx (B, T, in / t), this rank's slice of the input features: nothing to sum over ranks."""
    # TODO(m12): row-parallel backward: leave's backward, then the two GEMMs
    # Contract: main_grad (dim, in / t) grows by dy_whole^T x, summed over all B T tokens; returns dx = dy_whole W,
    #   (B, T, in / t): this rank's slice of the input features, final as it is (no sum over ranks).
    # Pitfalls: both GEMMs need the whole sequence of dy: with sequence parallelism, gather it first.
    raise NotImplementedError("TODO(m12): row-parallel backward: leave's backward, then the two GEMMs")


def grad_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the main_grad accumulators for weights of `dtype`: float32 at least."""
    return compute_dtype(dtype)
