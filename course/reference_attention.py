"""The attention every attention test and benchmark checks against (given): causal grouped-query
attention written with PyTorch's own `scaled_dot_product_attention` and `logsumexp`, differentiated
by autograd. Independent of the course's attentions (module 06's chunked one, module 15's rings, the
fused kernels of course/fused_attention.py), which must equal it: in float64 to rounding, in bf16 to
the tolerance each test states.

Shapes are module 06's: q (B, Tq, H, D), k and v (B, Tk, K, D) with K dividing H (key/value head j
serves the query heads j H/K .. (j + 1) H/K - 1), the output (B, Tq, H D) and each query's
log-sum-exp of its visible scores (B, H, Tq), the statistic a chunked or distributed attention
merges its pieces with. Used by tests/test_06_llama_ops.py, tests/attention_checks.py (module 15's
ring and all-gather tests), tests/test_15_ulysses.py, tests/test_course_fused_attention.py and
course/bench/m15.py.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def reference_attention(q, k, v, q_positions=None, k_positions=None):
    """(output, lse) of q against k and v, key j visible to query i iff k_positions[j] <= q_positions[i]
    (default: positions 0, 1, ... of both, plain causal attention), in the inputs' dtype and device;
    autograd differentiates both."""
    if q_positions is None:
        q_positions = torch.arange(q.shape[1], device=q.device)
    if k_positions is None:
        k_positions = torch.arange(k.shape[1], device=q.device)
    visible = k_positions.to(q.device).unsqueeze(0) <= q_positions.to(q.device).unsqueeze(1)
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=visible)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    lse = torch.logsumexp(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return o.transpose(1, 2).flatten(2), lse


def whole_attention(q, k, v, do):
    """float64 causal attention on the whole sequence: o (B, T, H D), lse (B, H, T), and dq, dk, dv by
    autograd for the output gradient `do` (B, T, H D). The inputs are cast to float64, not rounded: pass
    them already rounded to compare a lower precision's arithmetic alone."""
    q, k, v = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    o, lse = reference_attention(q, k, v)
    o.backward(do.double())
    return o.detach(), lse.detach(), q.grad, k.grad, v.grad
