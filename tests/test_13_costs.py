"""Module 13 costs: the calls, the bytes one rank sends per step and the bytes it keeps, as formulas,
against one step of the reference 2-D model on the meshes 1x1, 1x4, 2x2 and 4x1, and on 2x2 in 2
microbatches (calls and sent bytes logged by course/collectives.py and read by course/costs.py's
measured_cost, kept bytes read off the tensors each rank holds), and against a worked example counted
by hand. The model measured is the reference, so these tests grade the formulas alone.
"""
import dataclasses

import pytest
import torch

from course.costs import StepCost, measured_cost
from course.impl import load, reference
from course.launch import run_ranks
from course.mesh import init_mesh

costs = load("m13_costs")
model_2d = reference("m13_llama_2d")  # the model measured: trusted code, not graded here
m06 = reference("m06_llama_model")    # its fit
# Padded to 50 on t = 2 and 52 on t = 4: on 2x2 the padding shows in the weights' traffic, whose
# matrix term (d-1)/(d t) vanishes on 1x4.
CFG = dataclasses.replace(model_2d.CONFIG, vocab_size=49)
BATCH = 8
MESHES = [(1, 1), (1, 4), (2, 2), (4, 1)]


def _one_step(d, t, dtype, m):
    mesh = init_mesh({"d": d, "t": t})
    model = model_2d.Llama2D(CFG, mesh, dtype=dtype)
    # One step in m microbatches, in module 06's fit (its train_step); the optimizer is not returned, so its
    # state is rebuilt by one more step of our own (lr 0) to be measured.
    m06.fit(model, 1, BATCH, n_microbatches=m)
    log = list(mesh.log)
    params = model.parameters()
    optimizer = torch.optim.AdamW(params, lr=0.0)
    optimizer.step()
    moments = sum(optimizer.state[p][m].nbytes for p in params for m in ("exp_avg", "exp_avg_sq"))
    return measured_cost(log, {"parameters": sum(p.nbytes for p in params),
                               "gradients": sum(p.grad.nbytes for p in params), "optimizer": moments})


# float64 once: 8 bytes a value; 2 microbatches once: a step's train_step runs each microbatch's collectives.
CASES = [(d, t, torch.float32, 1) for d, t in MESHES] + [(2, 2, torch.float64, 1), (2, 2, torch.float32, 2)]


@pytest.mark.exercises("step_traffic", "state_bytes")
@pytest.mark.parametrize("d, t, dtype, m", CASES, ids=[f"{d}x{t}-{str(dt)[6:]}-m{m}" for d, t, dt, m in CASES])
def test_the_formulas_equal_what_a_step_sends_and_keeps(d, t, dtype, m):
    sizes = {"d": d, "t": t}
    formula = costs.step_traffic(CFG, sizes, BATCH, dtype, m) + costs.state_bytes(CFG, sizes, dtype)
    where = f"mesh {d}x{t}, a step in {m} microbatch{'es' if m > 1 else ''}"
    for rank, measured in enumerate(run_ranks(_one_step, d * t, d, t, dtype, m, timeout=60)):
        wrong = {key: (measured.sent.get(key, 0), formula.sent.get(key, 0)) for key in {*measured.sent, *formula.sent}
                 if measured.sent.get(key, 0) != formula.sent.get(key, 0)}
        assert not wrong, (f"{where}, rank {rank}: bytes sent per step by (axis, collective), (measured on the "
                           f"reference model, given code; your step_traffic), where they differ: {wrong}")
        calls = {key: (measured.calls.get(key, 0), formula.calls.get(key, 0)) for key in {*measured.calls, *formula.calls}
                 if measured.calls.get(key, 0) != formula.calls.get(key, 0)}
        assert not calls, \
            (f"{where}, rank {rank}: collectives per step by (axis, collective), (measured on the reference "
             f"model, given code; your step_traffic), where they differ: {calls} (every call counts, also on an axis "
             f"of size 1)")
        assert measured.memory == formula.memory, \
            (f"{where}, rank {rank}: (parameters, gradients, AdamW moments) bytes: the reference model's rank "
             f"holds {measured.memory}, your state_bytes gives {formula.memory}")


@pytest.mark.exercises("step_traffic", "state_bytes")
def test_a_worked_example_counted_by_hand():
    # The module's model (vocabulary 256, L = 2, M = 32, F = 48, 4 key/value heads of 4 x 2 query heads of
    # D = 4) on 2x2 in float32, a batch of 8 x 16 tokens: N = 4 x 16 = 64 tokens a rank, b = s = 4.
    # A block's matrices: P = 2 (32 x 32) + 2 (16 x 32) + 3 (48 x 32) = 7,680 values; 2 L + 1 = 5 norms.
    # A unit gathered or reduce-scattered over d sends (d-1)/(dt) b = 1 byte a value of the unit: a block's unit
    # holds P + 2 M = 7,744 values, the top's 2 V M + M = 16,416. Over t, a norm weight's step sends (t-1) M/t b =
    # 64 bytes, a stream collective (t-1)/t N M b = 4,096.
    #   d all-gathers:     2 L blocks + the top = 30,976 + 16,416 = 47,392 bytes; 2L + 1 = 5 calls
    #   t all-gathers:     10 norm steps x 64 + 10 stream x 4,096 = 41,600 bytes; 11 calls (each half's stream
    #                      and norm weight together, in both passes; the final norm once more alone)
    #   d reduce-scatters: L blocks + the top = 15,488 + 16,416 = 31,904 bytes; L + 1 = 3 calls
    #   t reduce-scatters: 5 norm steps x 64 + 10 stream x 4,096 = 41,280 bytes; 10 calls
    #   t all-reduces:     3 x 2 (t-1)/t N s = 768 bytes; 3 calls.   d all-reduce: 2 (d-1)/d s = 4 bytes; 1 call
    # Kept: (L (P + 2M) + 2 V M + M) / (dt) = (15,488 + 16,384 + 32) / 4 = 7,976 values, 31,904 bytes each
    # for weights and gradients, 63,808 for AdamW's two moments.
    sizes = {"d": 2, "t": 2}
    calls = {("d", "all_gather"): 5, ("t", "all_gather"): 11, ("d", "reduce_scatter"): 3,
             ("t", "reduce_scatter"): 10, ("t", "all_reduce"): 3, ("d", "all_reduce"): 1}
    sent = {("d", "all_gather"): 47_392, ("t", "all_gather"): 41_600, ("d", "reduce_scatter"): 31_904,
            ("t", "reduce_scatter"): 41_280, ("t", "all_reduce"): 768, ("d", "all_reduce"): 4}
    traffic = costs.step_traffic(model_2d.CONFIG, sizes, 8, torch.float32)
    assert traffic == StepCost(sent, calls), \
        f"float32: your step_traffic gives {traffic}; counted by hand: {StepCost(sent, calls)}"
    kept = costs.state_bytes(model_2d.CONFIG, sizes, torch.float32).memory
    assert kept == {"parameters": 31_904, "gradients": 31_904, "optimizer": 63_808}, \
        f"your state_bytes gives {kept}; counted by hand: 31,904, 31,904 and 63,808 bytes"
    # The same in bfloat16: b = 2 halves every byte count but the loss's, whose statistics stay in float32 (s = 4).
    halved = {key: value if key[1] == "all_reduce" else value // 2 for key, value in sent.items()}
    traffic = costs.step_traffic(model_2d.CONFIG, sizes, 8, torch.bfloat16)
    assert traffic == StepCost(halved, calls), \
        (f"bfloat16: your step_traffic gives {traffic}; counted by hand: {StepCost(halved, calls)} (the loss "
         f"statistics are in compute_dtype)")
