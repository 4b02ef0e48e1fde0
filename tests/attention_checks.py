"""Shared by module 15's ring and all-gather tests (not a test file itself): the float64 reference on
the whole sequence, one process's bf16 attention, and the bf16 tolerance both tests state."""
import math

import torch
import torch.nn.functional as F

from course.impl import reference

m06_ops = reference("m06_llama_ops")  # one process's attention: trusted code, not graded here
BF16 = torch.bfloat16
NAMES = ("o", "lse", "dq", "dk", "dv")


def whole_attention(q, k, v, do):
    """float64 reference on the whole sequence: o (B, T, H D) and lse (B, H, T) from SDPA and a masked
    logsumexp, dq, dk, dv by autograd."""
    q, k, v, do = (t.double().detach().requires_grad_(True) for t in (q, k, v, do))
    group = q.shape[2] // k.shape[2]
    kr, vr = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), kr.transpose(1, 2), vr.transpose(1, 2), is_causal=True)
    o = o.transpose(1, 2).flatten(2)
    o.backward(do)
    n = q.shape[1]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kr) / math.sqrt(q.shape[-1])
    lse = torch.logsumexp(scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf")), dim=-1)
    return o.detach(), lse.detach(), q.grad, k.grad, v.grad


def one_process_bf16(q, k, v, do):
    """Module 06's attention on the whole sequence in one process, in bf16: o, lse (B, H, T), dq, dk, dv."""
    q, k, v, do = (t.to(BF16) for t in (q, k, v, do))
    o, lse = m06_ops.attention_forward(q, k, v, 3)
    batch, n, heads, _ = q.shape
    return (o, lse.reshape(batch, heads, n), *m06_ops.attention_backward(do, q, k, v, o, lse, 3))


def beyond_bf16_rounding(got, inputs, which):
    """bf16 results (`which` of NAMES) whose error against float64 exceeds one process's bf16 error by
    more than two bf16 roundings of the largest value (the tolerance both tests' docstrings state)."""
    exact = whole_attention(*(t.to(BF16) for t in inputs))  # the same rounded inputs, in float64
    alone = one_process_bf16(*inputs)
    wrong = []
    for i in which:
        scale = exact[i].abs().max()
        error, error_alone = ((x.double() - exact[i]).abs().max() / scale for x in (got[i], alone[i]))
        if got[i].dtype != BF16 or not error <= error_alone + 2 ** -7:
            wrong.append(f"{NAMES[i]}: {got[i].dtype}, error {error.item():.1e}, one process {error_alone.item():.1e}")
    return wrong
