"""Module 13 costs: the bytes one rank sends per step and the bytes it keeps, as formulas, against one
step of the reference 2-D model on the meshes 1x1, 1x4, 2x2 and 4x1 (sent bytes counted by
course/collectives.py, kept bytes read off the tensors each rank holds), and against a worked example
counted by hand. The model measured is the reference, so these tests grade the formulas alone.
"""
import dataclasses

import pytest
import torch

from course.impl import load, reference
from course.launch import run_ranks

costs = load("m13_costs")
model_2d = reference("m13_llama_2d")  # the model measured: trusted code, not graded here
axes = reference("m13_named_axes")
# Padded to 50 on t = 2 and 52 on t = 4: on 2x2 the padding shows in the weights' traffic, whose
# matrix term (d-1)/(d t) vanishes on 1x4.
CFG = dataclasses.replace(model_2d.CONFIG, vocab_size=49)
BATCH = 8
MESHES = [(1, 1), (1, 4), (2, 2), (4, 1)]


def part_of(label: str, op: str) -> str:
    """Which part of the formula a collective of the reference model belongs to, by what it moved."""
    if op == "all_reduce":  # the cross-entropy's three over t, and the loss's over d
        return "loss"
    if "B/d" in label:
        return "stream"
    return "weights" if op == "all_gather" else "gradients"


def _one_step(d, t, dtype):
    mesh = axes.init_mesh(d, t)
    model, _ = model_2d.train(CFG, 1, mesh, BATCH, dtype=dtype)
    sent = {part: 0.0 for part in ("weights", "gradients", "stream", "loss")}
    for c in mesh.log:
        sent[part_of(c.label, c.op)] += c.sent_bytes
    params = model.parameters()
    # The optimizer is not returned by train: its state is rebuilt here by one more step of our own.
    optimizer = torch.optim.AdamW(params, lr=0.0)
    optimizer.step()
    moments = sum(optimizer.state[p][m].nbytes for p in params for m in ("exp_avg", "exp_avg_sq"))
    return sent, sum(p.nbytes for p in params), sum(p.grad.nbytes for p in params), moments


CASES = [(d, t, torch.float32) for d, t in MESHES] + [(2, 2, torch.float64)]  # float64 once: 8 bytes a value


@pytest.mark.exercises("step_traffic", "state_bytes")
@pytest.mark.parametrize("d, t, dtype", CASES, ids=[f"{d}x{t}-{str(dt)[6:]}" for d, t, dt in CASES])
def test_the_formulas_equal_what_a_step_sends_and_keeps(d, t, dtype):
    traffic, kept = costs.step_traffic(CFG, BATCH, d, t, dtype), costs.state_bytes(CFG, d, t, dtype)
    for rank, (sent, params, grads, moments) in enumerate(run_ranks(_one_step, d * t, d, t, dtype, timeout=60)):
        formula = dataclasses.asdict(traffic)
        wrong = {part: (sent[part], formula[part]) for part in sent if sent[part] != formula[part]}
        assert not wrong, (f"mesh {d}x{t}, rank {rank}: bytes sent per step (measured, formula) by part: {wrong}; "
                           f"the module docstring lists each part's collectives")
        got = (kept.parameters, kept.gradients, kept.optimizer)
        assert got == (params, grads, moments), \
            (f"mesh {d}x{t}, rank {rank}: (parameters, gradients, AdamW moments) bytes: formula {got}, the rank "
             f"holds {(params, grads, moments)} (every weight is split over d and t; the vocabulary is padded)")


@pytest.mark.exercises("step_traffic", "state_bytes")
def test_a_worked_example_counted_by_hand():
    # The module's model (vocabulary 256, L = 2, M = 32, F = 48, 4 key/value heads of 4 x 2 query heads of
    # D = 4) on 2x2 in float32, a batch of 8 x 16 tokens: N = 4 x 16 = 64 tokens a rank, b = s = 4.
    # A block's matrices: P = 2 (32 x 32) + 2 (16 x 32) + 3 (48 x 32) = 7,680 values.
    #   weights:   (d-1)/(dt) b = 1 byte a value: 2 L P + 3 V M = 30,720 + 24,576; norms (dt-1)/(dt) M b = 96
    #              bytes each, 2 (2L + 1) = 10 of them: 56,256 bytes
    #   gradients: L P + 2 V M = 15,360 + 16,384, and 5 norms x 96: 32,224 bytes
    #   stream:    (8L + 4) (t-1)/t N M b = 20 x 4,096 = 81,920 bytes
    #   loss:      3 x 2 (t-1)/t N s + 2 (d-1)/d s = 768 + 4 = 772 bytes
    # Kept: (L (P + 2M) + 2 V M + M) / (dt) = (15,488 + 16,384 + 32) / 4 = 7,976 values, 31,904 bytes each
    # for weights and gradients, 63,808 for AdamW's two moments.
    traffic = costs.step_traffic(model_2d.CONFIG, 8, 2, 2, torch.float32)
    got = (traffic.weights, traffic.gradients, traffic.stream, traffic.loss)
    assert got == (56_256, 32_224, 81_920, 772), f"(weights, gradients, stream, loss) = {got} bytes"
    kept = costs.state_bytes(model_2d.CONFIG, 2, 2, torch.float32)
    assert (kept.parameters, kept.gradients, kept.optimizer) == (31_904, 31_904, 63_808), f"kept: {kept}"
    # The same in bfloat16: b = 2 halves every part but the loss, whose statistics stay in float32 (s = 4).
    traffic = costs.step_traffic(model_2d.CONFIG, 8, 2, 2, torch.bfloat16)
    got = (traffic.weights, traffic.gradients, traffic.stream, traffic.loss)
    assert got == (28_128, 16_112, 40_960, 772), \
        f"bfloat16: (weights, gradients, stream, loss) = {got} bytes (the loss statistics are in compute_dtype)"
