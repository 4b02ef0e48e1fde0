"""course/fused_attention.py keeps module 06's attention contract: checked against autograd on
course/reference_attention.py's float64 attention."""
import pytest
import torch

from course.fused_attention import FusedAttention
from course.gpu_check import needs_gpu, run_cuda_check
from course.reference_attention import whole_attention


def inputs(dtype, device="cpu", B=2, T=19, heads=4, kv_heads=2, D=8):
    g = torch.Generator().manual_seed(0)
    make = lambda h: torch.randn(B, T, h, D, generator=g, dtype=torch.float64).to(device, dtype).requires_grad_()
    return make(heads), make(kv_heads), make(kv_heads)


def compare(dtype, device, atol):
    q, k, v = inputs(dtype, device)
    o, lse = FusedAttention().forward(q.detach(), k.detach(), v.detach())
    do = torch.randn_like(o)
    dq, dk, dv = FusedAttention().backward(do, q.detach(), k.detach(), v.detach(), o, lse)
    o_ref, lse_ref, *grads = whole_attention(q, k, v, do)
    B, T, heads, _ = q.shape
    torch.testing.assert_close(o.double(), o_ref, atol=atol, rtol=0)
    torch.testing.assert_close(lse.double().reshape(B, heads, T), lse_ref, atol=atol, rtol=0)
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), grads):
        torch.testing.assert_close(got.double(), ref, atol=atol, rtol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("dtype, atol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_fused_attention_matches_autograd_on_cpu(dtype, atol):
    compare(dtype, "cpu", atol)


def cuda_check():
    compare(torch.bfloat16, "cuda", atol=0.05)  # bf16 inputs and outputs: 8 mantissa bits


@needs_gpu
def test_fused_attention_matches_autograd_on_cuda():
    run_cuda_check(__file__, "cuda_check")
