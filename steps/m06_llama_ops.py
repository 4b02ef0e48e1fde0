# Generated from solutions/m06_llama_ops.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 06`. (skeleton 91cbb52ae823)
"""Module 06, part 1 - the operations of a Llama block, each with an explicit backward.

Every op is a pair of plain functions: `*_forward` returns its output and the few tensors its
backward needs, and `*_backward` turns the gradient of the output into gradients of the inputs
(and of the op's weight, if it has one). Nothing here uses autograd: the block (m06_llama_block)
calls these pairs in order, keeps what the backwards need in an activation store, and later
modules decide where the weights come from (07, 08), which matmul runs (09) and what is kept
rather than recomputed (10).

Shapes: tokens are (batch B, time T); the residual stream is (B, T, dim); queries are
(B, T, heads, head_dim) and keys/values (B, T, kv_heads, head_dim).
"""
import math

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Statistics (RMS, softmax) are computed in float32 at least, even for bf16 activations."""
    return torch.promote_types(dtype, torch.float32)


# ---------------------------------------------------------------------------------------------
# Linear layers go through one matmul policy
# ---------------------------------------------------------------------------------------------
class Matmul:
    """The matrix product behind every linear layer of the block: y = x @ w.T.

    `x` is (tokens, in_features), `w` is (out_features, in_features) like nn.Linear's weight.
    This is the seam module 09 uses. The block first hands each linear input to `prepare`, which
    saves what the backward will need in the store and returns what forward multiplies; linears
    that read the same input (q, k and v; gate and up) share one prepared input. Here that is x
    itself. Module 09's FP8 policy subclasses Matmul: its `prepare` quantizes x once (the store
    keeps 1 byte a value) and its `forward` and `backward` multiply FP8 operands.
    """

    def prepare(self, x: torch.Tensor, store, name: str) -> torch.Tensor:
        """x as this policy's forward and backward take it, saved in `store` under `name`."""
        store.save(name, x)
        return x

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # TODO(m06): the linear layer's forward product, y = x w^T
        raise NotImplementedError("TODO(m06): the linear layer's forward product, y = x w^T")

    def backward(self, dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor):
        """Gradients (dx, dw) of y = x @ w.T, given dy = dL/dy of shape (tokens, out_features)."""
        # TODO(m06): dx = dy w and dw = dy^T x (a sum over the tokens)
        raise NotImplementedError('TODO(m06): dx = dy w and dw = dy^T x (a sum over the tokens)')


def linear_forward(x: torch.Tensor, w: torch.Tensor, matmul: Matmul) -> torch.Tensor:
    """y = x @ w.T over the last dimension of x (any leading shape); its backward needs x.

    x is a tensor, or what `matmul.prepare` made of one (anything with shape and reshape)."""
    return matmul.forward(x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[0])


def linear_backward(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, matmul: Matmul):
    """(dx, dw) for linear_forward; the leading dimensions are flattened into one token axis."""
    dx, dw = matmul.backward(dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1]), w)
    return dx.reshape(x.shape), dw


# ---------------------------------------------------------------------------------------------
# RMSNorm, and RMSNorm fused with the residual add
# ---------------------------------------------------------------------------------------------
def rmsnorm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float):
    """n = x * r * weight with r = 1 / sqrt(mean(x^2) + eps) over the last dimension.

    Returns (n, r): n in x's dtype, r (one value per token) in compute_dtype(x.dtype), float32 at
    least. The backward needs x and r: saving r instead of recomputing it is cheap and spares a
    reduction over dim.
    """
    # TODO(m06): RMSNorm forward; return (n, r) with r of shape x.shape[:-1]
    # Hint: compute in compute_dtype(x.dtype), keep r in it, and cast n back to x.dtype.
    raise NotImplementedError('TODO(m06): RMSNorm forward; return (n, r) with r of shape x.shape[:-1]')


def rmsnorm_backward(dn: torch.Tensor, x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor):
    """(dx, dweight) for rmsnorm_forward, from the saved x and r."""
    # TODO(m06): RMSNorm backward
    # Hint: with xhat = x r and g = dn * weight:  dweight = sum over tokens of dn * xhat,
    #       dx = r * (g - xhat * mean(g * xhat)) over the last dimension. Compute in r's dtype;
    #       return dx in x's dtype and dweight in weight's dtype.
    raise NotImplementedError('TODO(m06): RMSNorm backward')


def residual_rmsnorm_forward(x: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, eps: float):
    """h = x + a (the residual add), then RMSNorm of h. Returns (h, n, r); the backward needs h, r."""
    h = x + a
    n, r = rmsnorm_forward(h, weight, eps)
    return h, n, r


def residual_rmsnorm_backward(dh: torch.Tensor, dn: torch.Tensor, h: torch.Tensor, r: torch.Tensor,
                              weight: torch.Tensor):
    """(d_residual, dweight): h feeds both the rest of the residual stream (gradient dh) and the
    norm (gradient dn), so its gradient is their sum; x and a both receive it unchanged."""
    # TODO(m06): the fused residual-add + RMSNorm backward
    raise NotImplementedError('TODO(m06): the fused residual-add + RMSNorm backward')


# ---------------------------------------------------------------------------------------------
# Rotary position embedding
# ---------------------------------------------------------------------------------------------
def rope_tables(seq_len: int, head_dim: int, theta: float, dtype=torch.float32, device="cpu"):
    """cos and sin of the rotation angles, each (seq_len, 1, head_dim // 2).

    Position t rotates the pair (x[i], x[i + head_dim/2]) by the angle t * theta^(-2i/head_dim).
    The middle axis of size 1 broadcasts over the heads of a (B, T, heads, head_dim) tensor.
    """
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    return (angles.cos().unsqueeze(1).to(dtype=dtype, device=device),
            angles.sin().unsqueeze(1).to(dtype=dtype, device=device))


def rope_forward(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x1, x2) = (first half, second half) of the head dimension by its angle."""
    # TODO(m06): RoPE forward on x of shape (B, T, heads, head_dim)
    # Hint: out1 = x1 cos - x2 sin,  out2 = x1 sin + x2 cos.
    raise NotImplementedError('TODO(m06): RoPE forward on x of shape (B, T, heads, head_dim)')


def rope_backward(dy: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """A rotation is orthogonal, so its backward is the inverse rotation (angle -t): no saved input."""
    # TODO(m06): RoPE backward: rotate dy by the opposite angles
    raise NotImplementedError('TODO(m06): RoPE backward: rotate dy by the opposite angles')


# ---------------------------------------------------------------------------------------------
# Causal grouped-query attention
# ---------------------------------------------------------------------------------------------
ATTENTION_CHUNK = 256  # queries per chunk: the score matrix is (chunk, keys), never (T, T)


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, T, heads, D) -> (B, kv_heads, group, T, D): query head h uses key/value head h // group."""
    return q.transpose(1, 2).unflatten(1, (kv_heads, -1))


def _causal_scores(q_chunk, k, start: int, scale: float) -> torch.Tensor:
    """Scores of queries start..start+len against keys 0..start+len, future keys masked to -inf."""
    stop = start + q_chunk.shape[-2]
    scores = (q_chunk @ k[..., :stop, :].transpose(-1, -2)).to(compute_dtype(q_chunk.dtype))
    future = torch.arange(stop, device=k.device) > torch.arange(start, stop, device=k.device).unsqueeze(1)
    # In place: the score block is the largest temporary of attention; no need for a second copy.
    return scores.mul_(scale).masked_fill_(future, float("-inf"))


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int = ATTENTION_CHUNK):
    """Causal softmax(q k^T / sqrt(D)) v, with kv_heads <= heads (grouped-query attention).

    q is (B, T, heads, D), k and v are (B, T, kv_heads, D). Returns (o, lse): o is
    (B, T, heads * D) in q's dtype, ready for the output projection, and lse, shaped
    (B, kv_heads, group, T) in compute_dtype (float32 at least), is the log-sum-exp of each
    query's scores. Saving lse (one number per query and head) instead of the (T, T)
    probabilities lets the backward rebuild them exactly: p = exp(s - lse).
    Queries are processed `chunk` at a time, so only a (chunk, T) block of scores ever exists.
    """
    B, T, heads, D = q.shape
    kv_heads = k.shape[2]
    qg, kg, vg = _grouped(q, kv_heads), _grouped(k, kv_heads), _grouped(v, kv_heads)
    outputs, lses = [], []
    for start in range(0, T, chunk):
        # TODO(m06): attention for queries start..start+chunk: append their output and lse
        # Hint: qg, kg, vg are (B, kv_heads, group, T, D), time on axis -2 (k and v have a group of 1, which
        #       broadcasts). The last chunk may be shorter than `chunk`. No query of the chunk sees a key
        #       after its last query: _causal_scores returns the scores of exactly those keys, masked, and
        #       scaled by the scale you pass it (1/sqrt(D)).
        # Hint: lse is the log-sum-exp of each query's scores over the keys, kept in the scores' dtype; the
        #       probabilities p = exp(s - lse), cast to v's dtype, weight the values of those same keys.
        raise NotImplementedError('TODO(m06): attention for queries start..start+chunk: append their output and lse')
    o = torch.cat(outputs, dim=-2)  # (B, kv_heads, group, T, D)
    return o.flatten(1, 2).transpose(1, 2).reshape(B, T, heads * D), torch.cat(lses, dim=-1)


def attention_backward(do: torch.Tensor, q, k, v, o, lse, chunk: int = ATTENTION_CHUNK):
    """(dq, dk, dv) for attention_forward, recomputing each chunk's probabilities from lse.

    With p = softmax(s) and dp = do v^T, the softmax backward is ds = p * (dp - delta), where
    delta = rowsum(do * o) (= rowsum(p * dp)) for each query. Key/value heads shared by a group of
    query heads receive the sum of the group's gradients.
    """
    B, T, heads, D = q.shape
    kv_heads = k.shape[2]
    scale = 1.0 / math.sqrt(D)
    qg, kg, vg = _grouped(q, kv_heads), _grouped(k, kv_heads), _grouped(v, kv_heads)
    dog = _grouped(do.reshape(B, T, heads, D), kv_heads)
    delta = (dog.to(lse.dtype) * _grouped(o.reshape(B, T, heads, D), kv_heads).to(lse.dtype)).sum(-1)
    dqs = []
    # dk and dv are accumulated over the chunks, per query head of the group, in float32 at least.
    dk = torch.zeros(qg.shape[:3] + (T, D), dtype=lse.dtype, device=q.device)
    dv = torch.zeros_like(dk)
    for start in range(0, T, chunk):
        # TODO(m06): backward of one query chunk: append its dq, accumulate dk and dv
        # Hint: the docstring's equations (the chapter has all of them), one query chunk at a time: the
        #       chunk's rows of q and do (time is axis -2) and of lse and delta (time is their last axis; one
        #       number per query, so they broadcast over the keys), against the keys the forward's chunk saw.
        #       Rebuild p from the saved lse exactly as the forward did. Mind where `scale` enters.
        # Hint: the chunk's dq is complete: append it. dk and dv get a contribution from every chunk whose
        #       queries see their keys: add it into those key rows of the accumulators.
        # Hint: p, dp and ds are in lse's dtype; cast p and ds to q's dtype before they multiply q, k, v or do.
        raise NotImplementedError('TODO(m06): backward of one query chunk: append its dq, accumulate dk and dv')
    dq = torch.cat(dqs, dim=-2).flatten(1, 2).transpose(1, 2)
    # Sum over the group of query heads that shared each key/value head.
    dk = dk.sum(2).transpose(1, 2).to(k.dtype)
    dv = dv.sum(2).transpose(1, 2).to(v.dtype)
    return dq, dk, dv


class ChunkedAttention:
    """The attention above, as the block calls it: forward -> (o, lse), backward -> (dq, dk, dv).

    course/fused_attention.py has the same two methods on PyTorch's fused flash-attention kernels,
    for speed on a GPU: `LlamaBlock(cfg, attention=FusedAttention())`.
    """

    def __init__(self, chunk: int = ATTENTION_CHUNK):
        self.chunk = chunk

    def forward(self, q, k, v):
        return attention_forward(q, k, v, self.chunk)

    def backward(self, do, q, k, v, o, lse):
        return attention_backward(do, q, k, v, o, lse, self.chunk)


# ---------------------------------------------------------------------------------------------
# SwiGLU
# ---------------------------------------------------------------------------------------------
def swiglu_forward(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """s = silu(g) * u, with silu(g) = g * sigmoid(g); the backward needs g and u."""
    # TODO(m06): SwiGLU forward
    raise NotImplementedError('TODO(m06): SwiGLU forward')


def swiglu_backward(ds: torch.Tensor, g: torch.Tensor, u: torch.Tensor):
    """(dg, du) for swiglu_forward."""
    # TODO(m06): SwiGLU backward
    # Hint: d silu(g)/dg = sigmoid(g) * (1 + g * (1 - sigmoid(g))).
    raise NotImplementedError('TODO(m06): SwiGLU backward')
