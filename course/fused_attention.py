"""Causal grouped-query attention on PyTorch's fused flash-attention kernels, with the same
contract as module 06's hand-written `attention_forward` / `attention_backward`.

Module 06 writes attention out in chunks of queries so you can see every step; a fused kernel does
the same maths (including saving only the log-sum-exp of each query's scores) without ever writing
a score block to memory, which is what makes it fast on a GPU. `LlamaBlock(cfg, attention=FusedAttention())`
swaps it in; nothing else in the block changes. Given code: `python main.py bench 10 --attention
fused` uses it, so the hand-written block can be compared with autograd +
`F.scaled_dot_product_attention` on equal terms. (Checked against autograd on CPU, and on CUDA by
the GPU test in tests/test_course_fused_attention.py, which passed on an H200 with torch 2.11.)

The kernels take (batch, heads, time, head_dim) and equal numbers of query and key/value heads, so
key/value heads are repeated for their group of query heads, and their gradients summed back.
"""
import torch


class FusedAttention:
    """forward(q, k, v) -> (o, lse) and backward(do, q, k, v, o, lse) -> (dq, dk, dv), shaped as in
    module 06: q (B, T, heads, D), k and v (B, T, kv_heads, D), o (B, T, heads * D),
    lse (B, kv_heads, group, T) float32."""

    def forward(self, q, k, v):
        B, T, heads, D = q.shape
        kv_heads = k.shape[2]
        qh, kh, vh = _heads_first(q), _heads_first(_repeat_kv(k, heads)), _heads_first(_repeat_kv(v, heads))
        if q.is_cuda:
            outputs = torch.ops.aten._scaled_dot_product_flash_attention(qh, kh, vh, 0.0, True, False, scale=D ** -0.5)
            o, lse = outputs[0], outputs[1]
        else:
            o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qh, kh, vh, 0.0, True, scale=D ** -0.5)
        # lse comes back in float32, or float64 for float64 inputs: module 06's compute dtype.
        return o.transpose(1, 2).reshape(B, T, heads * D), lse.reshape(B, kv_heads, heads // kv_heads, T)

    def backward(self, do, q, k, v, o, lse):
        B, T, heads, D = q.shape
        kv_heads = k.shape[2]
        qh, kh, vh = _heads_first(q), _heads_first(_repeat_kv(k, heads)), _heads_first(_repeat_kv(v, heads))
        do_h, o_h = _heads_first(do.reshape(B, T, heads, D)), _heads_first(o.reshape(B, T, heads, D))
        lse_h = lse.reshape(B, heads, T)
        if q.is_cuda:
            # No dropout, so the random-number state the kernel would replay is never read.
            seed = torch.zeros(2, dtype=torch.uint64, device=q.device)
            offset = torch.zeros((), dtype=torch.uint64, device=q.device)
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                do_h, qh, kh, vh, o_h, lse_h, None, None, T, T, 0.0, True, seed, offset, scale=D ** -0.5)
        else:
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                do_h, qh, kh, vh, o_h, lse_h, 0.0, True, scale=D ** -0.5)
        group = heads // kv_heads
        return (dq.transpose(1, 2),
                dk.transpose(1, 2).unflatten(2, (kv_heads, group)).sum(3),
                dv.transpose(1, 2).unflatten(2, (kv_heads, group)).sum(3))


def _repeat_kv(t, heads):
    """(B, T, kv_heads, D) -> (B, T, heads, D): query head h uses key/value head h // group."""
    return t.repeat_interleave(heads // t.shape[2], dim=2)


def _heads_first(t):
    return t.transpose(1, 2).contiguous()
