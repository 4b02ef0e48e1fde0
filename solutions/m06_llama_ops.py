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
        return x @ w.t()  # w is stored (out, in): its transpose pairs each token's row with each row of w

    def backward(self, dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor):
        """Gradients (dx, dw) of y = x @ w.T, given dy = dL/dy of shape (tokens, out_features)."""
        # >>> TODO(m06): the linear layer's backward: the gradients of its input and of its weight
        # Contract: dy = dL/dy is (tokens, out_features), x the saved input (tokens, in_features), w the weight
        #   (out_features, in_features), and the forward was y = x @ w.T. Return (dx, dw): dx = dL/dx in x's shape and
        #   dw = dL/dw in w's shape, every token's contribution counted in dw (the loss has already divided by the
        #   token count). The tests use in != out, compare with autograd in float64 and run gradcheck through it.
        # Question: each gradient is a product of dy with one of the forward's operands: which, and in which order?
        # Pitfalls: with in == out, would a product that pairs the wrong axes still run without a shape error?
        # Hint 1: the chapter's "Backward by index" works y = x A out one element at a time: which entries of y does
        #         x[t, i] reach here, and which does w[o, i]? Which index does each gradient sum over?
        # Hint 2: dx[t, i] = Σ_o dy[t, o] w[o, i] and dw[o, i] = Σ_t dy[t, o] x[t, i]; in matrices, dx = dy W and
        #         dW = dyᵀ x.
        # Hint 3: return dy @ w, dy.t() @ x
        return dy @ w, dy.t() @ x
        # <<<


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
    """RMSNorm over the last dimension: (n, r), r > 0 one factor per token, n = (x scaled by its
    token's r) weighted by `weight` feature by feature, where r is the factor for which
    mean_j (x_j r)^2 + eps r^2 = 1 (so x r has root mean square 1, up to eps).

    n is in x's dtype, r in compute_dtype(x.dtype), float32 at least. The backward needs x and r:
    saving r instead of recomputing it is cheap and spares a reduction over dim.
    """
    # >>> TODO(m06): RMSNorm forward: the normalized, weighted x and each token's reciprocal RMS
    # Contract: x is (..., dim), weight (dim,). Return (n, r) as the docstring defines them, over the last dimension:
    #   n has x's shape and dtype; r holds one value per token, shape x.shape[:-1], in compute_dtype(x.dtype). The
    #   tests compare both with PyTorch's F.rms_norm in float64, and for a bf16 x every value of n must be within one
    #   bf16 rounding of the float64 result.
    # Question: which r solves the docstring's condition, in which dtype must it and n be computed so that a bf16 x
    #   loses nothing but one last rounding, and how does a per-token r reach every feature of its row?
    # Pitfalls: r has one axis fewer than x: what does x * r broadcast against when two sizes happen to be equal?
    #   How many times is n rounded to x's dtype on its way out?
    # Hint 1: the condition has r on both sides: can you gather the terms in r² and solve? Which of the values here
    #         are statistics, and what does the chapter's "Precision" section say of them? What shape must r have to
    #         multiply a whole row?
    # Hint 2: with x_f = x converted to compute_dtype(x.dtype): r = (mean_j x_f[..., j]² + eps)^(-1/2) per token, and
    #         n = x_f r weight (weight converted too), rounded once to x's dtype; r gets a trailing axis of size 1.
    # Hint 3: xf = x.to(compute_dtype(x.dtype))
    #         r = torch.rsqrt(xf.pow(2).mean(-1) + eps)
    #         n = (xf * r.unsqueeze(-1) * weight.to(xf.dtype)).to(x.dtype)
    #         return n, r
    xf = x.to(compute_dtype(x.dtype))
    r = torch.rsqrt(xf.pow(2).mean(dim=-1) + eps)
    n = (xf * r.unsqueeze(-1) * weight.to(xf.dtype)).to(x.dtype)
    return n, r
    # <<<


def rmsnorm_backward(dn: torch.Tensor, x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor):
    """(dx, dweight) for rmsnorm_forward, from the saved x and r."""
    # >>> TODO(m06): RMSNorm backward: the gradients of x and of the norm's weight
    # Contract: dn = dL/dn has x's shape; x and r are what the forward saved; weight is (dim,). Return (dx, dweight):
    #   dx in x's shape and dtype, dweight in weight's shape and dtype, computed in r's dtype (float32 at least) and
    #   rounded once at the end. The tests compare with autograd in float64, run gradcheck through your backward
    #   and bound the bf16 error.
    # Maths: n = x̂ ⊙ weight with x̂ = x r, and r, the positive root of mean_j (x_j r)² + eps r² = 1, is a function
    #   of the whole row.
    # Question: r changes when any x_j of its row changes: what does that add to dx, beyond r times the gradient
    #   that reaches x̂?
    # Pitfalls: would your dx still be right if r depended on x? Does dweight sum over every leading axis, or
    #   over one of them?
    # Hint 1: the chapter's "A normalisation's backward" differentiates x / ||x||: what do the mean, eps and the
    #         weight change in that derivation? Start from the gradient that reaches x̂, g = dn ⊙ weight.
    # Hint 2: r = (mean_j x_j² + eps)^(-1/2), so ∂r/∂x_j = -r³ x_j / dim, and per row dx = r (g - x̂ mean(g ⊙ x̂)),
    #         the mean over the row; and dweight = Σ over every token of dn ⊙ x̂.
    # Hint 3: xf = x.to(r.dtype);  xhat = xf * r.unsqueeze(-1);  dnf = dn.to(r.dtype);  g = dnf * weight.to(r.dtype)
    #         dx = r[..., None] * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    #         dweight = (dnf * xhat).reshape(-1, x.shape[-1]).sum(dim=0)
    #         return dx.to(x.dtype), dweight.to(weight.dtype)
    xf = x.to(r.dtype)
    xhat = xf * r.unsqueeze(-1)
    dnf = dn.to(r.dtype)
    g = dnf * weight.to(r.dtype)
    dx = r.unsqueeze(-1) * (g - xhat * (g * xhat).mean(dim=-1, keepdim=True))
    dweight = (dnf * xhat).reshape(-1, x.shape[-1]).sum(dim=0)
    return dx.to(x.dtype), dweight.to(weight.dtype)
    # <<<


def residual_rmsnorm_forward(x: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, eps: float):
    """h = x + a (the residual add), then RMSNorm of h. Returns (h, n, r); the backward needs h, r."""
    h = x + a
    n, r = rmsnorm_forward(h, weight, eps)
    return h, n, r


def residual_rmsnorm_backward(dh: torch.Tensor, dn: torch.Tensor, h: torch.Tensor, r: torch.Tensor,
                              weight: torch.Tensor):
    """(d_residual, dweight) for residual_rmsnorm_forward: d_residual is the gradient of x (and of a),
    given dh, the gradient of h from the rest of the residual stream, and dn, that of the norm's output."""
    # >>> TODO(m06): the backward of the residual add followed by RMSNorm
    # Contract: the forward was h = x + a, then (n, r) = RMSNorm(h); dh = dL/dh is the gradient that arrives from
    #   the rest of the residual stream, dn = dL/dn the one that arrives through the norm's output. Return
    #   (d_residual, dweight): d_residual = dL/dx, which the test also compares with dL/da, and dweight = dL/dweight,
    #   against autograd with a dh and a dn that are both nonzero.
    # Question: along how many paths does h reach the loss, and what does the add do to the gradient of its sum?
    # Pitfalls: is dh the whole gradient of h?
    # Hint 1: the chapter's "One tensor, several readers" works out a tensor that two ops read: which two read h?
    # Hint 2: dL/dh (whole) = dh + (the norm's backward of dn at h), and an add passes its output's gradient to each
    #         input unchanged: dL/dx = dL/da = dL/dh.
    # Hint 3: dh_norm, dweight = rmsnorm_backward(dn, h, r, weight)
    #         return dh + dh_norm, dweight
    dh_norm, dweight = rmsnorm_backward(dn, h, r, weight)
    return dh + dh_norm, dweight
    # <<<


# ---------------------------------------------------------------------------------------------
# Rotary position embedding
# ---------------------------------------------------------------------------------------------
def rope_tables(seq_len: int, head_dim: int, theta: float, dtype=torch.float32, device="cpu"):
    """cos and sin of the rotation angles, each (seq_len, 1, head_dim // 2), for positions 0 .. seq_len - 1.

    Position t rotates the pair (x[i], x[i + head_dim/2]) by the angle t * theta^(-2i/head_dim).
    The middle axis of size 1 broadcasts over the heads of a (B, T, heads, head_dim) tensor.
    """
    return rope_tables_at(torch.arange(seq_len), head_dim, theta, dtype, device)


def rope_tables_at(positions: torch.Tensor, head_dim: int, theta: float, dtype=torch.float32, device="cpu"):
    """rope_tables for the given positions, in their order: a rank that holds a slice of the sequence
    (module 15's context parallelism) rotates its tokens by where they sit in the whole sequence."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(positions.to(torch.float64), inv_freq)
    return (angles.cos().unsqueeze(1).to(dtype=dtype, device=device),
            angles.sin().unsqueeze(1).to(dtype=dtype, device=device))


def rope_forward(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x1, x2) = (first half, second half) of the head dimension by its angle."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def rope_backward(dy: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """dL/dx for rope_forward, given dy = dL/d(output): the tables are all it needs, no saved input."""
    # >>> TODO(m06): RoPE backward: the gradient through a rotation
    # Contract: dy = dL/d(output) of rope_forward, shape (B, T, heads, head_dim); cos and sin as rope_forward takes
    #   them. Return dL/dx, of dy's shape and dtype, from dy, cos and sin alone (nothing was saved). The tests compare
    #   with autograd through a complex rotation and check rope_backward(rope_forward(x)) == x.
    # Question: rope_forward is, for each pair (x1[i], x2[i]), a fixed 2 x 2 matrix times the pair: which matrix
    #   carries the gradient back, and what is it for a rotation?
    # Pitfalls: of cos and sin, which is even in the angle and which odd?
    # Hint 1: the chapter's "Linear maps go back through their transpose" works it for a shear: what is the
    #         transpose of the rotation rope_forward applies?
    # Hint 2: for y = R(θ) x, dx = R(θ)ᵀ dy and R(θ)ᵀ = R(-θ): dx1 = dy1 cos θ + dy2 sin θ, dx2 = -dy1 sin θ +
    #         dy2 cos θ.
    # Hint 3: dy1, dy2 = dy.chunk(2, dim=-1)
    #         return torch.cat((dy1 * cos + dy2 * sin, dy2 * cos - dy1 * sin), dim=-1)
    dy1, dy2 = dy.chunk(2, dim=-1)
    return torch.cat((dy1 * cos + dy2 * sin, -dy1 * sin + dy2 * cos), dim=-1)
    # <<<


# ---------------------------------------------------------------------------------------------
# Causal grouped-query attention
# ---------------------------------------------------------------------------------------------
ATTENTION_CHUNK = 256  # queries per chunk: the score matrix is (chunk, keys), never (T, T)


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, T, heads, D) -> (B, kv_heads, group, T, D): query head h uses key/value head h // group."""
    return q.transpose(1, 2).unflatten(1, (kv_heads, -1))


def _causal_scores(q_chunk, k, start: int, scale: float, k_start: int = 0) -> torch.Tensor:
    """Scores of the queries at positions start..start+len against the keys of k that may precede
    them: k's keys sit at positions k_start, k_start + 1, ...; those up to the last query's position
    (at most all of k) are scored, future keys masked to -inf. The scores' last axis is the number of
    keys scored: the first that many rows of k and v take part (with k_start = 0: keys 0..start+len)."""
    stop = start + q_chunk.shape[-2]
    seen = min(k.shape[-2], stop - k_start)
    scores = (q_chunk @ k[..., :seen, :].transpose(-1, -2)).to(compute_dtype(q_chunk.dtype))
    key_positions = torch.arange(k_start, k_start + seen, device=k.device)
    future = key_positions > torch.arange(start, stop, device=k.device).unsqueeze(1)
    # In place: the score block is the largest temporary of attention; no need for a second copy.
    return scores.mul_(scale).masked_fill_(future, float("-inf"))


def _check_offsets(q_offset: int, k_offset: int):
    """A block of keys that starts after the first query leaves that query nothing to attend to
    (its softmax would be 0/0): a caller skips blocks of keys wholly in the queries' future, and
    cuts blocks so that none starts in the middle of the queries."""
    if k_offset > q_offset:
        raise ValueError(f"keys start at position {k_offset}, after the first query's position {q_offset}: "
                         f"that query would see no key (skip blocks of keys that lie in the queries' future)")


def attention_delta(do: torch.Tensor, o: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """delta = rowsum(do * o) for each query and head, (B, kv_heads, group, T) in compute_dtype, from
    do and o of shape (B, T, heads * head_dim): the softmax backward's rowsum(p * dp), computed from
    the output instead of p. When a query's keys come in blocks (module 15's ring), o is the merged
    output of all of them, so delta is computed once, not per block."""
    B, T = do.shape[:2]
    dtype = compute_dtype(do.dtype)
    products = (do.to(dtype) * o.to(dtype)).reshape(B, T, heads, -1)
    return _grouped(products, kv_heads).sum(-1)


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int = ATTENTION_CHUNK,
                      q_offset: int = 0, k_offset: int = 0):
    """Causal softmax(q k^T / sqrt(D)) v, with kv_heads <= heads (grouped-query attention).

    q is (B, T, heads, D), k and v are (B, T, kv_heads, D). Returns (o, lse): o is
    (B, T, heads * D) in q's dtype, ready for the output projection, and lse, shaped
    (B, kv_heads, group, T) in compute_dtype (float32 at least), is the log-sum-exp of each
    query's scores, log of the sum of exp(score) over the keys it sees. Saving lse (one number per
    query and head) instead of the (T, T) probabilities lets the backward rebuild them exactly.
    Queries are processed `chunk` at a time, so only a (chunk, T) block of scores ever exists.

    Positions: query i sits at position q_offset + i and key j at k_offset + j; a query sees the keys
    at its position and before. By default both start at 0: one whole sequence. Module 15 passes a
    block of a longer sequence (k then has its own length, and k_offset <= q_offset): the result is
    that block's share of attention, merged with the other blocks' by their lse.
    """
    B, T, heads, D = q.shape
    kv_heads = k.shape[2]
    _check_offsets(q_offset, k_offset)
    qg, kg, vg = _grouped(q, kv_heads), _grouped(k, kv_heads), _grouped(v, kv_heads)
    outputs, lses = [], []
    for start in range(0, T, chunk):
        # >>> TODO(m06): causal attention for one chunk of queries: its output and its log-sum-exp
        # Contract: qg, kg, vg are (B, kv_heads, group, T, D), time on axis -2 (k's and v's group axis has size 1 and
        #   broadcasts over the query heads that share them). This iteration covers the queries start .. start + chunk
        #   (fewer in the last chunk): append to `outputs` their output (B, kv_heads, group, rows, D) in v's dtype, and
        #   to `lses` their log-sum-exp (B, kv_heads, group, rows) in the scores' dtype (float32 at least), both as the
        #   docstring defines them. Nothing of size T x T is ever made.
        # Given: _causal_scores (above) scores a chunk of queries against the keys that may precede them, multiplied
        #   by the factor you pass, future keys at -inf; it takes the chunk's first query position (q_offset + start)
        #   and k's first key position (k_offset), and its last axis says how many keys it scored.
        # Question: with a row's log-sum-exp in hand, how do you turn its scores into its softmax in one pass, and
        #   which rows of v do those probabilities weigh?
        # Pitfalls: does a chunk's block of scores cover all of k, or only the keys up to its last query? Would a
        #   max-and-divide softmax leave the backward what it needs? The tests use chunks that do not divide T, and
        #   grouped heads, against F.scaled_dot_product_attention.
        # Hint 1: the chapter's "Attention without the T x T matrix": what is exp of a score minus its row's
        #         log-sum-exp? And how many keys does this chunk's block of scores hold?
        # Hint 2: s = q kᵀ / √D over the keys the query may see; lse = log Σ_j exp(s_j) per query; p = exp(s - lse) is
        #         the softmax (it sums to 1 over those keys); the output is p v, with v cut to those same keys.
        # Hint 3: stop = min(start + chunk, T)
        #         scores = _causal_scores(qg[..., start:stop, :], kg, q_offset + start, 1 / math.sqrt(D), k_offset)
        #         lse = torch.logsumexp(scores, dim=-1)
        #         probs = torch.exp(scores - lse.unsqueeze(-1)).to(v.dtype)
        #         outputs.append(probs @ vg[..., :scores.shape[-1], :]);  lses.append(lse)
        stop = min(start + chunk, T)
        scores = _causal_scores(qg[..., start:stop, :], kg, q_offset + start, 1.0 / math.sqrt(D), k_offset)
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse.unsqueeze(-1)).to(v.dtype)
        outputs.append(probs @ vg[..., :scores.shape[-1], :])
        lses.append(lse)
        # <<<
    o = torch.cat(outputs, dim=-2)  # (B, kv_heads, group, T, D)
    return o.flatten(1, 2).transpose(1, 2).reshape(B, T, heads * D), torch.cat(lses, dim=-1)


def attention_backward(do: torch.Tensor, q, k, v, o, lse, chunk: int = ATTENTION_CHUNK, q_offset: int = 0,
                       k_offset: int = 0, delta: torch.Tensor | None = None):
    """(dq, dk, dv) for attention_forward, given do = dL/do, recomputing each chunk's probabilities
    from the scores and lse instead of keeping them. Key/value heads shared by a group of query heads
    receive the sum of the group's gradients.

    For one block of keys of a longer sequence (module 15), pass the positions as in the forward,
    and the *merged* lse and delta of all the blocks (delta from attention_delta of the merged
    output; o is then not read): the probabilities rebuilt from the merged lse are then this block's
    share of the full softmax.
    """
    B, T, heads, D = q.shape
    kv_heads = k.shape[2]
    _check_offsets(q_offset, k_offset)
    scale = 1.0 / math.sqrt(D)
    qg, kg, vg = _grouped(q, kv_heads), _grouped(k, kv_heads), _grouped(v, kv_heads)
    dog = _grouped(do.reshape(B, T, heads, D), kv_heads)
    if delta is None:
        delta = attention_delta(do, o, heads, kv_heads)
    dqs = []
    # dk and dv are accumulated over the chunks, per query head of the group, in float32 at least.
    dk = torch.zeros(qg.shape[:3] + (k.shape[1], D), dtype=lse.dtype, device=q.device)
    dv = torch.zeros_like(dk)
    for start in range(0, T, chunk):
        # >>> TODO(m06): attention backward for one chunk of queries: its dq, its share of dk and dv
        # Contract: for the queries start .. start + chunk (fewer in the last chunk): append the chunk's dq,
        #   (B, kv_heads, group, rows, D) in q's dtype, to `dqs`, and add the chunk's contributions into the float32
        #   accumulators dk and dv, (B, kv_heads, group, keys, D), at the rows of the keys this chunk scored (after the
        #   loop the given code sums them over each group of query heads). Positions as in the forward: q_offset +
        #   start for the chunk's first query, k_offset for k's first key.
        # Maths: the forward's s = q kᵀ / √D (masked as _causal_scores masks it), p = softmax(s) per query, o = p v.
        #   lse (the forward's) and delta = rowsum(do ⊙ o) (attention_delta's) hold one number per query, time on
        #   their last axis; delta also equals rowsum(p ⊙ dp) with dp = dL/dp.
        # Question: how does the chunk's do travel back through o = p v, through the softmax and through the scaled
        #   product q kᵀ, and which of the results are complete after one chunk?
        # Pitfalls: where does the factor 1/√D come back in the chain, and where not? Does a chunk's share of dk
        #   replace the earlier chunks' or add to it? Where the forward masked a score, what is p, and does the
        #   backward need a mask of its own? The tests use chunks smaller than T and grouped heads.
        # Hint 1: the chapter's "The softmax's backward" contracts the Jacobian of a softmax with a gradient: which
        #         terms give ds here, and which sums does delta already hold? The rest are linear layers' backwards.
        # Hint 2: p = exp(s - lse); dv += pᵀ do; dp = do vᵀ; ds = p ⊙ (dp - delta); dq = ds k / √D; dk += dsᵀ q / √D.
        #         p, dp and ds stay in lse's dtype; p and ds are cast to q's dtype before they multiply q, k, v or do.
        # Hint 3: stop = min(start + chunk, T);  q_chunk, do_chunk = qg[..., start:stop, :], dog[..., start:stop, :]
        #         probs = torch.exp(_causal_scores(q_chunk, kg, q_offset + start, scale, k_offset)
        #                           - lse[..., start:stop].unsqueeze(-1));  seen = probs.shape[-1]
        #         dv[..., :seen, :] += probs.to(v.dtype).transpose(-1, -2) @ do_chunk
        #         dprobs = (do_chunk @ vg[..., :seen, :].transpose(-1, -2)).to(probs.dtype)
        #         dscores = (probs * (dprobs - delta[..., start:stop, None]) * scale).to(q.dtype)
        #         dqs.append(dscores @ kg[..., :seen, :]);  dk[..., :seen, :] += dscores.transpose(-1, -2) @ q_chunk
        stop = min(start + chunk, T)
        q_chunk, do_chunk = qg[..., start:stop, :], dog[..., start:stop, :]
        probs = torch.exp(_causal_scores(q_chunk, kg, q_offset + start, scale, k_offset)
                          - lse[..., start:stop].unsqueeze(-1))
        seen = probs.shape[-1]
        dv[..., :seen, :] += probs.to(v.dtype).transpose(-1, -2) @ do_chunk
        dprobs = (do_chunk @ vg[..., :seen, :].transpose(-1, -2)).to(probs.dtype)
        dscores = (probs * (dprobs - delta[..., start:stop].unsqueeze(-1)) * scale).to(q.dtype)
        dqs.append(dscores @ kg[..., :seen, :])
        dk[..., :seen, :] += dscores.transpose(-1, -2) @ q_chunk
        # <<<
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
    return g * torch.sigmoid(g) * u


def swiglu_backward(ds: torch.Tensor, g: torch.Tensor, u: torch.Tensor):
    """(dg, du) for swiglu_forward."""
    # >>> TODO(m06): SwiGLU backward: the gradients of the gate and of the up projection
    # Contract: ds = dL/ds; g and u are the saved inputs of swiglu_forward (above: s = silu(g) u, silu(g) = g σ(g)).
    #   Return (dg, du), each of g's shape. The tests compare with autograd in float64 and run gradcheck.
    # Maths: σ(g) = 1 / (1 + e^(-g)) and σ'(g) = σ(g) (1 - σ(g)).
    # Question: what is silu's derivative, written with σ(g) so that the sigmoid is computed once?
    # Pitfalls: silu is itself a product of two functions of g: how many terms does its derivative have?
    # Hint 1: the chapter's "A gate's backward" works out the sigmoid gate σ(g) u: which factor is different here,
    #         and what does the product rule give for it?
    # Hint 2: du = ds silu(g) = ds g σ(g); dg = ds u silu'(g) with silu'(g) = σ(g) (1 + g (1 - σ(g))).
    # Hint 3: sig = torch.sigmoid(g)
    #         dg = ds * u * sig * (1 + g * (1 - sig));  du = ds * g * sig;  return dg, du
    sig = torch.sigmoid(g)
    return ds * u * sig * (1 + g * (1 - sig)), ds * g * sig
    # <<<
