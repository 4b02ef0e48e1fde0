"""Shared by module 15's ring and all-gather tests (not a test file itself): the float64 reference on
the whole sequence (course/reference_attention.py's), one process's bf16 attention, and the bf16
tolerance both tests state."""
import torch

from course.impl import reference
from course.reference_attention import whole_attention

m06_ops = reference("m06_llama_ops")  # one process's attention: trusted code, not graded here
BF16 = torch.bfloat16
NAMES = ("o", "lse", "dq", "dk", "dv")


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
