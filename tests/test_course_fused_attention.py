"""course/fused_attention.py keeps module 06's attention contract: checked against autograd."""
import math

import pytest
import torch

from course.fused_attention import FusedAttention
from course.gpu_check import needs_gpu, run_cuda_check


def reference_attention(q, k, v):
    """Plain causal grouped-query attention with autograd: o (B, T, heads * D) and lse."""
    B, T, heads, D = q.shape
    group = heads // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    o = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), v)
    return o.reshape(B, T, heads * D), torch.logsumexp(scores, dim=-1)


def inputs(dtype, device="cpu", B=2, T=19, heads=4, kv_heads=2, D=8):
    g = torch.Generator().manual_seed(0)
    make = lambda h: torch.randn(B, T, h, D, generator=g, dtype=torch.float64).to(device, dtype).requires_grad_()
    return make(heads), make(kv_heads), make(kv_heads)


def compare(dtype, device, atol):
    q, k, v = inputs(dtype, device)
    o, lse = FusedAttention().forward(q.detach(), k.detach(), v.detach())
    do = torch.randn_like(o)
    dq, dk, dv = FusedAttention().backward(do, q.detach(), k.detach(), v.detach(), o, lse)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    o_ref, lse_ref = reference_attention(q64, k64, v64)
    o_ref.backward(do.double())
    B, T, heads, _ = q.shape
    torch.testing.assert_close(o.double(), o_ref.detach(), atol=atol, rtol=0)
    torch.testing.assert_close(lse.double().reshape(B, heads, T), lse_ref.detach(), atol=atol, rtol=0)
    for name, got, ref in (("dq", dq, q64), ("dk", dk, k64), ("dv", dv, v64)):
        torch.testing.assert_close(got.double(), ref.grad, atol=atol, rtol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("dtype, atol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_fused_attention_matches_autograd_on_cpu(dtype, atol):
    compare(dtype, "cpu", atol)


def cuda_check():
    compare(torch.bfloat16, "cuda", atol=0.05)  # bf16 inputs and outputs: 8 mantissa bits


@needs_gpu
def test_fused_attention_matches_autograd_on_cuda():
    run_cuda_check(__file__, "cuda_check")
