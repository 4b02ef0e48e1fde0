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
        # >>> TODO(m06): the linear layer's forward product
        # x is (tokens, in_features) and w is (out_features, in_features), stored like nn.Linear's weight.
        # Return y of shape (tokens, out_features) with y[t, o] = sum over i of x[t, i] * w[o, i]: each output
        # feature is the dot product of a token's row with one *row* of w.
        # Pitfall: multiplying by w as it is stored pairs the wrong axes: a shape error when in != out, silently
        # wrong numbers when they are equal. The tests use unequal sizes and compare with F.linear in float64.
        # Hint 1: a matrix product pairs rows of its left operand with *columns* of its right one; make w's rows
        #         the columns.
        # Hint 2: the @ operator, and the transpose of a 2-D tensor (.t() or .T), which is a free view.
        # Hint 3: return x times (w transposed): one line, nothing to save (prepare has already saved x).
        return x @ w.t()
        # <<<

    def backward(self, dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor):
        """Gradients (dx, dw) of y = x @ w.T, given dy = dL/dy of shape (tokens, out_features)."""
        # >>> TODO(m06): the linear layer's backward: the gradients of its input and of its weight
        # dy = dL/dy is (tokens, out_features); x is the saved input (tokens, in_features); w is (out, in).
        # Return (dx, dw): dx has x's shape, dw has w's shape. From y[t, o] = sum_i x[t, i] w[o, i]:
        #     dL/dx[t, i] = sum over o of dy[t, o] w[o, i]        dL/dw[o, i] = sum over t of dy[t, o] x[t, i]
        # dw adds up the contributions of every token: a sum, not a mean (the loss has already averaged).
        # Pitfall: the shapes pin down which operand is transposed in each product: check them before the values.
        # The tests compare both gradients with autograd in float64 and run gradcheck through your backward.
        # Hint 1: both sums are matrix products of dy with one of the forward's operands; the summed index (o, then
        #         t) is the inner dimension of the product.
        # Hint 2: in matrix form dx = dy W and dW = dy^T x (the chapter's table); @ and .t() are all you need.
        # Hint 3: dx is (tokens, out) @ (out, in); dw is (out, tokens) @ (tokens, in); return them as a pair, dx
        #         first.
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
    """n = x * r * weight with r = 1 / sqrt(mean(x^2) + eps) over the last dimension.

    Returns (n, r): n in x's dtype, r (one value per token) in compute_dtype(x.dtype), float32 at
    least. The backward needs x and r: saving r instead of recomputing it is cheap and spares a
    reduction over dim.
    """
    # >>> TODO(m06): RMSNorm forward: the normalized, weighted x and each token's reciprocal RMS
    # Contract: the docstring's maths, over the last dimension of x (..., dim), with weight (dim,). Return
    # (n, r): n has x's shape and dtype; r holds one value per token, shape x.shape[:-1], in compute_dtype(x.dtype).
    # Precision: a bf16 x is squared, averaged and scaled in float32 (compute_dtype), else the mean of squares
    # loses digits; only n goes back to x's dtype. The bf16 test checks the dtype of everything you return.
    # Pitfall: r has one axis fewer than x, so it does not broadcast against a row as it stands: a shape error,
    # or a silent broadcast along the wrong axis when two sizes happen to match.
    # Hint 1: promote x, reduce each row to one statistic, then scale: every row by its own r, every feature
    #         by its own weight; cast the result back.
    # Hint 2: .to(compute_dtype(...)), .pow(2).mean(dim=-1), torch.rsqrt (1 / sqrt), .unsqueeze(-1) so r
    #         broadcasts over the row, and the weight cast to the compute dtype too.
    # Hint 3: xf = x in the compute dtype
    #         r  = rsqrt(row mean of xf squared + eps)                      shape x.shape[:-1]
    #         n  = (xf * r with a trailing axis * weight in xf's dtype), cast to x's dtype; return both
    xf = x.to(compute_dtype(x.dtype))
    r = torch.rsqrt(xf.pow(2).mean(dim=-1) + eps)
    n = (xf * r.unsqueeze(-1) * weight.to(xf.dtype)).to(x.dtype)
    return n, r
    # <<<


def rmsnorm_backward(dn: torch.Tensor, x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor):
    """(dx, dweight) for rmsnorm_forward, from the saved x and r."""
    # >>> TODO(m06): RMSNorm backward: the gradients of x and of the norm's weight
    # dn = dL/dn has x's shape; x and r are what the forward saved; weight is (dim,). Return (dx, dweight): dx in
    # x's shape and dtype, dweight in weight's shape and dtype. Compute in r's dtype (float32 at least).
    # Maths, per row: with xhat = x r (the normalized row) and g = dn * weight (the gradient reaching xhat),
    # dweight collects dn * xhat over every token, and dx is r times g minus a correction along xhat: r depends
    # on the whole row, and scaling a row barely changes its normalized values (the chapter's table has it).
    # Pitfall: dropping the correction would be right only if r were a constant; autograd and gradcheck catch it.
    # Pitfall: dweight sums over all leading axes (batch and time alike), not over one of them.
    # Hint 1: differentiate n = xhat * weight, then xhat = x * r(x); r's dependence on the row adds a correction
    #         shared by the row, proportional to xhat.
    # Hint 2: dx = r (g - xhat * mean(g * xhat)), the mean over the last axis with keepdim=True so it broadcasts;
    #         dweight: flatten (dn * xhat) to (tokens, dim) with reshape(-1, dim) and sum over axis 0.
    # Hint 3: promote x and dn to r's dtype; xhat = x * r (trailing axis); g = dn * weight (promoted)
    #         dx = r (trailing axis) * (g - xhat * row mean of g * xhat)
    #         dweight = (dn * xhat) as (tokens, dim), summed over tokens
    #         return dx cast to x's dtype, dweight cast to weight's dtype
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
    """(d_residual, dweight): h feeds both the rest of the residual stream (gradient dh) and the
    norm (gradient dn), so its gradient is their sum; x and a both receive it unchanged."""
    # >>> TODO(m06): the backward of the residual add followed by RMSNorm
    # h = x + a feeds two consumers: the rest of the residual stream (its gradient dh arrives here) and the norm
    # (its gradient dn). Return (d_residual, dweight): d_residual = dL/dh, which is also dL/dx and dL/da (an add
    # hands its gradient unchanged to both inputs), and dweight, the norm weight's gradient.
    # Pitfall: forgetting one of h's two consumers; the test checks the gradients of x, of a and of the weight
    # against autograd, with a dh and a dn that are both nonzero.
    # Hint 1: a tensor that feeds two ops receives the sum of the gradients coming back from both.
    # Hint 2: your rmsnorm_backward gives h's gradient through the norm (the norm's input was h, with the saved r).
    # Hint 3: (h's gradient through the norm, dweight) = the norm's backward of dn at h, r and weight;
    #         return dh plus that gradient, and dweight
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
    # >>> TODO(m06): RoPE forward: rotate each pair of head dimensions by its position's angle
    # x is (B, T, heads, head_dim); cos and sin are (T, 1, head_dim // 2) from rope_tables: they broadcast over
    # the batch and the heads. Return a tensor of x's shape and dtype.
    # The pairs are (x1[i], x2[i]) with x1 the first half of the head dimension and x2 the second half. Each pair
    # is a point in the plane, turned by its angle t: multiplied by the rotation matrix [[cos t, -sin t],
    # [sin t, cos t]].
    # Pitfall: pairing neighbours (0, 1), (2, 3) is the other RoPE convention: still a rotation, so your forward
    # and backward agree with each other, but the test against the reference rope (a complex rotation) fails.
    # Hint 1: cut the head dimension into its two halves, rotate each (first-half, second-half) pair, and join
    #         the two rotated halves again in the same order.
    # Hint 2: x.chunk(2, dim=-1) gives the halves (views); torch.cat(..., dim=-1) joins them; cos and sin
    #         broadcast as they are.
    # Hint 3: x1, x2 = the halves of x
    #         first  = x1 cos - x2 sin
    #         second = x1 sin + x2 cos
    #         return first and second concatenated on the last axis
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    # <<<


def rope_backward(dy: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """A rotation is orthogonal, so its backward is the inverse rotation (angle -t): no saved input."""
    # >>> TODO(m06): RoPE backward: the gradient through a rotation
    # dy = dL/d(output) has x's shape; cos and sin as in the forward. Return dL/dx, of the same shape.
    # Maths: the forward multiplies each pair by a rotation matrix R(t); the gradient goes back through its
    # transpose, and for a rotation R(t)^T = R(-t), the rotation by the opposite angle. No saved input needed.
    # Check: the backward undoes the forward exactly, backward(forward(x)) == x; the test checks that too.
    # Pitfall: cos(-t) = cos t but sin(-t) = -sin t: only the sine terms change sign.
    # Hint 1: the same halves and the same pairing as the forward, with the angle negated.
    # Hint 2: your forward's formula with sin replaced by -sin (cos unchanged).
    # Hint 3: dy1, dy2 = the halves of dy
    #         first  = dy1 cos + dy2 sin
    #         second = dy2 cos - dy1 sin
    #         return them concatenated on the last axis
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
    query's scores. Saving lse (one number per query and head) instead of the (T, T)
    probabilities lets the backward rebuild them exactly: p = exp(s - lse).
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
        # qg, kg, vg are (B, kv_heads, group, T, D), time on axis -2 (k and v have a group axis of 1, which broadcasts
        # over the query heads that share them). This iteration handles the queries start .. start + chunk (the last
        # chunk may be shorter). Append to `outputs` the chunk's output (B, kv_heads, group, rows, D), in v's dtype,
        # and to `lses` its log-sum-exp (B, kv_heads, group, rows), in the scores' dtype (float32 at least).
        # Maths: s = q k^T / sqrt(D) against the keys the query may see (query i: keys 0..i); lse = log of the sum of
        # exp(s) over those keys; the softmax is p = exp(s - lse); the output weights the values of those keys by p.
        # Given: _causal_scores returns the chunk's scores, multiplied by the scale you pass, future keys at -inf; it
        # takes positions: the chunk's first query is at q_offset + start, k's first key at k_offset (module 15).
        # Pitfall: the scores cover the keys up to the chunk's last query, not all of k: p multiplies the same rows
        # of v (as many as the scores have columns; with zero offsets, keys 0 .. the chunk's last query).
        # Pitfall: a max-and-divide softmax is right too, but the backward needs lse itself, not just p.
        # The tests use chunks that do not divide T, and grouped heads, against F.scaled_dot_product_attention.
        # Hint 1: score the chunk once, reduce each query's row of scores to its log-sum-exp, turn the scores into
        #         probabilities with it, and use them to weight the values.
        # Hint 2: torch.logsumexp over the key axis (-1); torch.exp; lse.unsqueeze(-1) to broadcast over the keys;
        #         @ with vg cut to the keys scored (vg[..., :s.shape[-1], :]); p cast to v's dtype before it multiplies.
        # Hint 3: stop = start + chunk, at most T
        #         s    = the causal scores of qg's rows start:stop against kg, positions q_offset + start and
        #                k_offset, scale 1/sqrt(D)
        #         lse  = log-sum-exp of s over the keys;  p = exp(s - lse with a trailing axis), in v's dtype
        #         append p @ (vg's first s.shape[-1] time steps) to outputs, and lse to lses
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
    """(dq, dk, dv) for attention_forward, recomputing each chunk's probabilities from lse.

    With p = softmax(s) and dp = do v^T, the softmax backward is ds = p * (dp - delta), where
    delta = rowsum(do * o) (= rowsum(p * dp)) for each query. Key/value heads shared by a group of
    query heads receive the sum of the group's gradients.

    For one block of keys of a longer sequence (module 15), pass the positions as in the forward,
    and the *merged* lse and delta of all the blocks (delta from attention_delta of the merged
    output; o is then not read): p = exp(s - lse) is then this block's share of the full softmax.
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
        # For the queries start .. start + chunk (the last chunk may be shorter): append the chunk's dq,
        # (B, kv_heads, group, rows, D) in q's dtype, to `dqs`, and add the chunk's contributions into the float32
        # accumulators dk and dv, (B, kv_heads, group, keys, D), at the rows of the keys this chunk sees.
        # Maths: the docstring's equations (the chapter derives them), restricted to this chunk's rows of q, do, lse
        # and delta and to the keys the forward scored (positions as in the forward: q_offset + start, k_offset;
        # with zero offsets, keys 0 .. the chunk's last query). lse and delta hold one number per query (time on
        # their last axis), so they broadcast over the keys once given a trailing axis.
        # Invariants: p is rebuilt exactly as the forward made it (same scores, scale and mask); a chunk's dq is
        # complete when the chunk is done, while dk and dv sum over every chunk whose queries see those keys.
        # Pitfalls: the scale 1/sqrt(D) is inside s, so it comes back in the chain to q and to k (not to v):
        # without it dq and dk are off by exactly sqrt(D). Assigning dk or dv instead of adding keeps only the last
        # chunk's share (the tests use chunks smaller than T). Masked scores are -inf, so p is 0 there: no new mask.
        # Hint 1: walk the forward's chunk backwards: rebuild its probabilities, then push do back through
        #         "p times v" (giving dv and dp) and through the softmax (giving ds), and ds back through q k^T.
        # Hint 2: p = exp(_causal_scores(...) - lse); dv += p^T @ do; dp = do @ v^T; ds = p * (dp - delta) * scale;
        #         dq = ds @ k; dk += ds^T @ q. p, dp and ds stay in lse's dtype; cast p and ds to q's dtype before
        #         they multiply q, k, v or do.
        # Hint 3: stop = start + chunk, at most T;  q_c, do_c = the chunk's rows of qg and dog
        #         p  = exp(causal scores of q_c (with scale, positions) - the chunk's lse with a trailing axis)
        #         seen = p.shape[-1], the keys scored
        #         dv's first seen rows += (p in v's dtype, transposed) @ do_c
        #         dp = do_c @ (vg's first seen rows, transposed), in p's dtype
        #         ds = p * (dp - the chunk's delta with a trailing axis) * scale, in q's dtype
        #         append ds @ (kg's first seen rows) to dqs;  dk's first seen rows += ds transposed @ q_c
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
    # >>> TODO(m06): SwiGLU forward: the FFN's gated activation
    # g and u are the gate and up projections, of the same shape (..., ffn_dim). Return s of that shape: the
    # docstring's maths, elementwise. The backward will need only g and u, so nothing else is saved.
    # Pitfall: silu is the gate times its own sigmoid, not the sigmoid alone; the test compares with PyTorch's
    # silu in float64.
    # Hint 1: an elementwise product of three factors, two of which come from g.
    # Hint 2: torch.sigmoid. (F.silu would do, but writing silu out shows what the backward differentiates.)
    # Hint 3: return g times sigmoid(g) times u
    return g * torch.sigmoid(g) * u
    # <<<


def swiglu_backward(ds: torch.Tensor, g: torch.Tensor, u: torch.Tensor):
    """(dg, du) for swiglu_forward."""
    # >>> TODO(m06): SwiGLU backward: the gradients of the gate and of the up projection
    # ds = dL/ds; g and u are the saved inputs. Return (dg, du), each of g's shape.
    # Maths: s is a product of silu(g) and u, so du is ds times the other factor, and dg is ds times u times
    # silu's derivative, which you get from silu(g) = g sigmoid(g) and sigmoid' = sigmoid (1 - sigmoid).
    # Pitfall: the product rule gives silu' two terms; keeping only sigmoid(g) is wrong for every g != 0
    # (autograd and gradcheck both compare).
    # Hint 1: the product rule twice: once for silu(g) * u, once inside silu for g * sigmoid(g).
    # Hint 2: silu'(g) = sigmoid(g) (1 + g (1 - sigmoid(g))); compute the sigmoid once and reuse it.
    # Hint 3: sig = sigmoid of g
    #         dg  = ds * u * silu'(g), written with sig
    #         du  = ds * silu(g), written with sig; return (dg, du)
    sig = torch.sigmoid(g)
    return ds * u * sig * (1 + g * (1 - sig)), ds * g * sig
    # <<<
