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
slice is exactly the row input's slice. Two operators connect such a pair to the residual stream:

  enter (Megatron's f)   before the column-parallel linears: their input must be whole
  leave (Megatron's g)   after the row-parallel linear: the stream needs the sum of the partials

The two are *conjugates*, as a broadcast and a reduce are (docs/12-tensor-parallel.md works the
principle on those two): g's forward and backward are given below, each running the f operator
that does the same work. With sequence parallelism the residual stream between the pairs is not
replicated but split along the sequence (each rank its T / t positions). What f does, forward and
backward, in either layout, follows from the layouts it connects: yours.

The column-parallel backward is where communication can hide behind compute (Megatron-LM's linear
"with gradient accumulation and async communication"): a collective started without waiting
travels while a GEMM that does not need its result computes. Which GEMM hides which collective
follows from what each needs (the chapter works it out without sequence parallelism).

Weight gradients are added into `main_grad` accumulators inside the GEMM (a GEMM whose output is
the accumulator itself): over m microbatches each gradient is summed in main_grad's precision
(float32 for bf16 weights), never rounded to the weights' dtype on the way (Megatron's
gradient-accumulation fusion).

Every collective goes through `tp.collectives` (course/collectives.py), which logs it. Shapes: the
residual stream is (B, T, dim) on every rank, or (B, T / t, dim) with sequence parallelism.

The products themselves go through module 06's seam for module 09: every linear takes an optional
`matmul` policy. None (the default) is the plain high-precision product above (`@`, and the fused
weight-gradient GEMM); a policy such as module 09's FP8Matmul multiplies with its own forward and
backward instead (linear_forward, linear_backward), on this rank's slices: its per-tensor scales are
then per slice (a column block of W, the rank's rows of x), not over the whole weight.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from course.mesh import Group
from .m06_llama_ops import Matmul, compute_dtype, linear_backward, linear_forward

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
    stream x: (B, T, dim) on every rank, or with sequence parallelism this rank's (B, T / t, dim)
    positions [i_t T/t, (i_t + 1) T/t)."""
    # >>> TODO(m12): f's forward: the column-parallel linears' whole input, from the residual stream
    # Contract: return an InFlight whose wait() gives the whole (B, T, dim) input, the same on every rank. With
    #   async_op=True any collective is only started (the column-parallel backward runs it behind a GEMM). Never
    #   write into x: a new tensor holds what the others send. The tests compare a column-then-row pair with the
    #   whole linears and count the collectives in the log.
    # The question: in each layout of the residual stream, what is missing from x, and what brings it?
    # Pitfalls: which dimension is the sequence? Does anything need to travel when the stream is whole already?
    # Hint 1: what does the residual stream hold on each rank with and without sequence parallelism, and what do
    #       the column-parallel linears need (docs/12, "The two conjugate operators" and "Sequence parallelism")?
    # Hint 2: without sequence parallelism, nothing: x is whole on every rank. With it, the t ranks' (B, T/t, dim)
    #       blocks side by side along the sequence, in group order: an all-gather along SEQUENCE_DIM.
    # Hint 3: if not sequence_parallel: return InFlight(x)
    #       full = x.new_empty(B, t * T_local, dim)
    #       return InFlight(full, tp.collectives.all_gather(full, x, label, async_op=async_op, dim=SEQUENCE_DIM))
    if not sequence_parallel:
        return InFlight(x)
    batch, local_len, dim = x.shape
    full = x.new_empty(batch, local_len * tp.size, dim)
    return InFlight(full, tp.collectives.all_gather(full, x, label, async_op=async_op, dim=SEQUENCE_DIM))
    # <<<


def enter_tp_backward(dx: torch.Tensor, tp: Group, sequence_parallel: bool, label: str = "",
                      async_op: bool = False) -> InFlight:
    """f's backward: each rank's dx (B, T, dim) is its partial of the input's gradient (its slice of the
    output features contributed only its part); the gradient of the residual stream is their sum, in
    the stream's layout: whole on every rank, or with sequence parallelism only this rank's
    (B, T / t, dim) positions of it."""
    # >>> TODO(m12): f's backward: the residual stream's gradient, summed over the group
    # Contract: an InFlight whose wait() gives the sum over the group of the ranks' dx, in the residual stream's
    #   layout. With async_op=True any collective is only started: the caller computes the weight gradients
    #   meanwhile.
    # The question: which collective gives every rank the sum it needs, and only what it needs, in each layout?
    # Pitfalls: what shape does the result have with sequence parallelism, cut along which dimension? Is it a
    #   sum or a mean?
    # Hint 1: docs/12 works a broadcast's backward ("The two conjugate operators"): f hands x to t ranks' linears
    #       as a broadcast hands a tensor to t ranks, so what is x's gradient, and which part of it does a rank keep
    #       when the stream is split along the sequence?
    # Hint 2: without sequence parallelism, the whole sum on every rank: an all-reduce of dx; with it, only this
    #       rank's T/t positions of the sum: a reduce-scatter along SEQUENCE_DIM into a new (B, T/t, dim) tensor.
    # Hint 3: if not sequence_parallel: return InFlight(dx, tp.collectives.all_reduce(dx, label, async_op=async_op))
    #       shard = dx.new_empty(B, T // t, dim)
    #       return InFlight(shard, tp.collectives.reduce_scatter(shard, dx, label, async_op=async_op, dim=SEQUENCE_DIM))
    if not sequence_parallel:
        return InFlight(dx, tp.collectives.all_reduce(dx, label, async_op=async_op))
    batch, seq_len, dim = dx.shape
    shard = dx.new_empty(batch, seq_len // tp.size, dim)
    return InFlight(shard, tp.collectives.reduce_scatter(shard, dx, label, async_op=async_op, dim=SEQUENCE_DIM))
    # <<<


def leave_tp_forward(y: torch.Tensor, tp: Group, sequence_parallel: bool, label: str = "") -> torch.Tensor:
    """g's forward (given): y (B, T, dim) is this rank's partial product of a row-parallel linear; the
    residual stream needs the sum over ranks, in its layout: whole on every rank, or this rank's
    positions. y may be summed into in place: the callers pass a fresh product."""
    # g is f's conjugate: its forward does what f's backward does (the group's sum, in the stream's layout),
    # so it runs your enter_tp_backward and waits at once (nothing runs beside it here).
    return enter_tp_backward(y, tp, sequence_parallel, label).wait()


def leave_tp_backward(dy: torch.Tensor, tp: Group, sequence_parallel: bool, label: str = "") -> torch.Tensor:
    """g's backward (given): the gradient each rank's partial product receives, from dy, the gradient of
    g's output in the residual stream's layout; every rank's row-parallel linear needs it for all T
    positions."""
    # g is f's conjugate: its backward does what f's forward does. The derivative of a sum with respect to
    # each of its terms is the identity, so every rank's partial receives dy itself, at every position.
    return enter_tp_forward(dy, tp, sequence_parallel, label).wait()


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
    """main_grad (out, in) += the gradient of W for y = x W^T, summed over the tokens (given).

    dy is (..., out) and x (..., in), with the same leading (token) dimensions. `fused` (the default)
    adds inside the GEMM, in main_grad's precision; fused=False is the path it replaces, kept to
    compare: the GEMM returns a new tensor in the inputs' dtype (for bf16, one more rounding of the
    whole microbatch's gradient) and a second kernel adds it.
    """
    dy, x = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
    if not fused:
        main_grad.add_(dy.t() @ x)  # a new (out, in) tensor in the inputs' dtype, then a second kernel
        return
    addmm_into(main_grad, dy.t(), x)  # dW = dy^T x, (out, tokens) times (tokens, in), summed into main_grad


def product(x: torch.Tensor, w: torch.Tensor, matmul: Matmul | None = None) -> torch.Tensor:
    """x W^T over x's last dimension (given): `@`, or the policy's forward (module 09's FP8) when one is given."""
    return x @ w.t() if matmul is None else linear_forward(x, w, matmul)


def policy_gradients(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, main_grad: torch.Tensor,
                     matmul: Matmul) -> torch.Tensor:
    """The backward of y = x W^T through a policy (given): its backward gives dx = dy W and dW = dy^T x
    together; dW is a new tensor, added into main_grad (no fused GEMM); returns dx."""
    dx, dw = linear_backward(dy, x, w, matmul)
    main_grad.add_(dw.reshape(main_grad.shape))
    return dx


# ---------------------------------------------------------------------------------------------
# Column- and row-parallel linears
# ---------------------------------------------------------------------------------------------
def column_parallel_forward(x: torch.Tensor, weights: list[torch.Tensor], tp: Group, sequence_parallel: bool,
                            label: str = "", matmul: Matmul | None = None):
    """The column-parallel linears that read the same input (q, k, v; or gate, up), each weight W_i
    (out_i / t, dim) being this rank's rows. x is in the residual stream's layout; returns their
    outputs on this rank, one per weight."""
    # >>> TODO(m12): column-parallel forward: every weight's slice of y from one whole input
    # Contract: returns one tensor per weight, (B, T, out_i / t): every position of the sequence, in either layout
    #   of x. The t ranks' outputs of a weight, side by side along the features, are the whole linear's output for
    #   the whole input (the tests compare with the unsplit linears). Whatever must travel, travels once for all
    #   the weights (the tests count the collectives); every product honours `matmul` (module 09's seam, tested).
    # The question: what does every weight's product need that x may not hold, and how often must it be fetched?
    # Pitfalls: with sequence parallelism, how many positions does x hold, and how many must each output have?
    #   Would fetching it once per weight change the outputs, or only the log?
    # Hint 1: which operator hands the column-parallel linears their whole input (docs/12, "The two conjugate
    #       operators")?
    # Hint 2: x_whole = f(x), once, waited for before the first product; then y_i = x_whole W_iᵀ for each weight,
    #       through the policy's product (the given `product`).
    # Hint 3: x_whole = enter_tp_forward(x, tp, sequence_parallel, label).wait()
    #       return [product(x_whole, w, matmul) for w in weights]
    x_whole = enter_tp_forward(x, tp, sequence_parallel, label).wait()
    return [product(x_whole, w, matmul) for w in weights]
    # <<<


def column_parallel_backward(dys: list[torch.Tensor], x: torch.Tensor, weights: list[torch.Tensor],
                             main_grads: list[torch.Tensor], tp: Group, sequence_parallel: bool,
                             label: str = "", fused: bool = True, matmul: Matmul | None = None) -> torch.Tensor:
    """Backward of column_parallel_forward: adds dy_i^T x_whole into main_grads[i] and returns the
    gradient of x, summed over the ranks, in the residual stream's layout.

    x is what the forward was given, as the block saved it: this rank's sequence shard with sequence
    parallelism, so the whole input is gathered again here instead of being kept since the forward.
    The order of the work is what hides communication behind compute: every collective in flight
    while a GEMM that does not need it computes (docs/12-tensor-parallel.md derives the order without
    sequence parallelism).
    """
    if matmul is not None:
        return policy_column_backward(dys, x, weights, main_grads, tp, sequence_parallel, label, matmul)
    # >>> TODO(m12): column-parallel backward: the input-gradient collective in flight behind the weight-gradient GEMMs
    # Contract: every main_grads[i] (out_i / t, dim) grows by dy_i^T x_whole (summed over all B T tokens, through
    #   accumulate_weight_grad with `fused`); the returned dx is the sum over ranks of Σ_i dy_i W_i, whole (B, T, dim)
    #   or this rank's (B, T / t, dim). Each collective is started (async_op=True) as soon as what it sends exists
    #   and waited for only just before something needs its result; the GEMMs that need neither run in between.
    #   The tests read the order of the calls (the collectives, their waits and every matrix product).
    # The question: with and without sequence parallelism, which GEMMs need which collective's result, and so
    #   where does each collective start and where is it waited for?
    # Pitfalls: waiting for a collective right after starting it is correct: does it hide anything? Keeping the
    #   gathered x from the forward instead of gathering again costs t times the memory (the store's size is
    #   tested): what must be gathered again, and by whom?
    # Hint 1: docs/12, "The backward that hides its collective", places dx's collective without sequence
    #       parallelism: by the same rule, what can run while x's re-gather travels, and what must wait for it?
    # Hint 2: the order: start the all-gather of x (f's forward, async) -> the input-gradient GEMMs Σ_i dy_i W_i
    #       (they need no x) -> wait for x, start dx's collective (f's backward, async) -> the weight-gradient
    #       GEMMs dy_iᵀ x_whole -> wait for dx and return it. Without sequence parallelism the first and the third
    #       steps' gather is an InFlight that is ready at once.
    # Hint 3: gathering = enter_tp_forward(x, tp, sequence_parallel, label, async_op=True)
    #       dx = sum(dy @ w for dy, w in zip(dys, weights))
    #       x_whole = gathering.wait()
    #       reducing = enter_tp_backward(dx, tp, sequence_parallel, label, async_op=True)
    #       for dy, main_grad in zip(dys, main_grads): accumulate_weight_grad(main_grad, dy, x_whole, fused)
    #       return reducing.wait()
    gathering = enter_tp_forward(x, tp, sequence_parallel, label, async_op=True)
    dx = sum(dy @ w for dy, w in zip(dys, weights, strict=True))
    x_whole = gathering.wait()
    reducing = enter_tp_backward(dx, tp, sequence_parallel, label, async_op=True)
    for dy, main_grad in zip(dys, main_grads, strict=True):
        accumulate_weight_grad(main_grad, dy, x_whole, fused)
    return reducing.wait()
    # <<<


def policy_column_backward(dys, x, weights, main_grads, tp: Group, sequence_parallel: bool, label: str,
                           matmul: Matmul) -> torch.Tensor:
    """column_parallel_backward through a policy (given). A policy's backward computes dx and dW together,
    from the whole input, so there is no weight-gradient GEMM left to hide dx's collective behind: the
    collectives run one after the other (module 09's FP8 is a GPU feature; on CPU it is emulated)."""
    x_whole = enter_tp_forward(x, tp, sequence_parallel, label).wait()
    dx = sum(policy_gradients(dy, x_whole, w, main_grad, matmul)
             for dy, w, main_grad in zip(dys, weights, main_grads, strict=True))
    return enter_tp_backward(dx, tp, sequence_parallel, label).wait()


def row_parallel_forward(x: torch.Tensor, w: torch.Tensor, tp: Group, sequence_parallel: bool,
                         label: str = "", matmul: Matmul | None = None) -> torch.Tensor:
    """y = g(x W^T): x (B, T, in / t) is this rank's slice of the input features (a column-parallel
    output), w (dim, in / t) its columns of the weight. Returns y in the residual stream's layout."""
    # Given: this rank's partial product, then g's forward (your leave_tp_forward) sums it over the group.
    return leave_tp_forward(product(x, w, matmul), tp, sequence_parallel, label)


def row_parallel_backward(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, main_grad: torch.Tensor,
                          tp: Group, sequence_parallel: bool, label: str = "", fused: bool = True,
                          matmul: Matmul | None = None) -> torch.Tensor:
    """Backward of row_parallel_forward: adds this rank's weight gradient into main_grad (dim, in / t)
    and returns the gradient of x (B, T, in / t), this rank's slice of the input features."""
    # >>> TODO(m12): row-parallel backward: the two GEMMs, and what they need of dy
    # Contract: main_grad (dim, in / t) grows by this microbatch's gradient of this rank's w: the t ranks' main_grads,
    #   side by side along the columns, grow by the whole layer's weight gradient, summed over all B T tokens (`fused`
    #   as accumulate_weight_grad takes it). Returns the gradient of this rank's x, (B, T, in / t) at every position:
    #   the whole layer's input gradient, this rank's features of it. With a policy (matmul not None) the policy's
    #   backward computes both (module 09's seam, tested). The tests compare with autograd on the whole weights.
    # The question: what does each of the two gradients need of dy, and where does this rank get it?
    # Pitfalls: with sequence parallelism dy holds this rank's T/t positions only: are they enough for either
    #   gradient? Is the returned gradient a partial that still needs a sum over the ranks? Which of the two
    #   products of dy and x has main_grad's shape (a square weight hides a transposed one)?
    # Hint 1: which operator's backward comes first in a row-parallel linear's backward, and what does it hand every
    #       rank (docs/12, "The two conjugate operators", and the given leave_tp_backward above)?
    # Hint 2: dy_whole = g's backward of dy; then main_grad += dy_wholeᵀ x and dx = dy_whole W, on this rank's slices,
    #       final as they are (no sum over ranks); with a policy, policy_gradients does both and returns dx.
    # Hint 3: dy_whole = leave_tp_backward(dy, tp, sequence_parallel, label)
    #       if matmul is not None: return policy_gradients(dy_whole, x, w, main_grad, matmul)
    #       accumulate_weight_grad(main_grad, dy_whole, x, fused); return dy_whole @ w
    dy_whole = leave_tp_backward(dy, tp, sequence_parallel, label)
    if matmul is not None:
        return policy_gradients(dy_whole, x, w, main_grad, matmul)
    accumulate_weight_grad(main_grad, dy_whole, x, fused)
    return dy_whole @ w
    # <<<


def grad_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the main_grad accumulators for weights of `dtype`: float32 at least."""
    return compute_dtype(dtype)
