"""Module 16 costs: the bytes one rank sends per step and the bytes it keeps, as formulas, against one
step of the reference MoE Llama on 1 rank and on 4 ranks with the experts over e = 2 (two
microbatches, a capacity, a shared expert) and e = 4 (sent bytes counted by course/collectives.py,
kept bytes read off the tensors each rank holds), and against a worked example counted by hand. The
model measured is the reference, so these tests grade the formulas alone."""
import dataclasses

import pytest
import torch

from course.costs import measured_cost
from course.impl import load, reference
from course.launch import run_ranks
from course.mesh import init_mesh

costs = load("m16_costs")
trusted = reference("m16_moe_model")   # the model measured: trusted code, not graded here
f64 = torch.float64
MOE = dataclasses.replace(trusted.MOE, capacity_factor=1.0, shared_expert=True)
MESHES = [({"d": 4, "e": 2}, 2, torch.float32), ({"d": 4, "e": 4}, 1, f64)]


def held(model, optimizer_state):
    params = model.parameters()
    return {"parameters": sum(p.nbytes for p in params), "gradients": sum(p.grad.nbytes for p in params),
            "optimizer": optimizer_state(params), "buffers": sum(b.nbytes for b in model.biases())}


def adamw_bytes(params):
    optimizer = torch.optim.AdamW(params, lr=0.0)   # the state train builds, rebuilt by one more step of our own
    optimizer.step()
    return sum(optimizer.state[p][m].nbytes for p in params for m in ("exp_avg", "exp_avg_sq"))


def _one_step(sizes, n_microbatches, dtype):
    mesh = init_mesh(sizes) if sizes else trusted.one_rank_mesh()
    model, _ = trusted.train(trusted.CONFIG, MOE, 1, mesh, 8, n_microbatches, dtype=dtype)
    return measured_cost(mesh.log), model.layer.records, mesh.group("e").index, held(model, adamw_bytes)


@pytest.mark.exercises("step_cost", "state_bytes")
@pytest.mark.parametrize("sizes, n_microbatches, dtype", [({}, 2, torch.float32), *MESHES],
                         ids=["one rank", "d=4 e=2 m=2 float32", "d=4 e=4 float64"])
def test_the_formulas_equal_what_a_step_sends_and_keeps(sizes, n_microbatches, dtype):
    world = sizes.get("d", 1)
    results = [_one_step(sizes, n_microbatches, dtype)] if world == 1 else \
        run_ranks(_one_step, world, sizes, n_microbatches, dtype, timeout=60)
    for rank, (measured, records, index, memory) in enumerate(results):
        formula = costs.step_cost(trusted.CONFIG, MOE, sizes, index, records, dtype)
        assert formula.sent == measured.sent and formula.calls == measured.calls, \
            (f"your step_cost, {sizes or 'one rank'}, rank {rank}: (axis, collective) -> bytes: formula {formula.sent}, measured "
             f"{measured.sent}; calls: formula {formula.calls}, measured {measured.calls}")
        kept = costs.state_bytes(trusted.CONFIG, MOE, sizes.get("e", 1), dtype).memory
        assert kept == memory, \
            f"your state_bytes, {sizes or 'one rank'}, rank {rank}: bytes kept: formula {kept}, the rank holds {memory}"


@pytest.mark.exercises("step_cost", "state_bytes")
def test_a_worked_example_counted_by_hand():
    # The module's model (V = 256, M = 32, L = 2, H = 4 heads and K = 2 of D = 8; E = 8 experts of F = 32,
    # top-2, no shared expert) on d = 4 ranks, e = 2 (so ed = 2), float32 (b = 4), one record (one layer's
    # forward) on member 0, whose experts are 0..3:
    #   sent = (3, 1, 0, 2, 4, 0, 1, 1): 12 rows, 6 to its own experts, S_out = 6
    #   received = ((3, 1, 0, 2), (2, 2, 1, 0)): 11 rows, 6 from itself, S_in = 5
    #   all-to-alls: (e - 1) E / e 8 = 32 bytes of counts + 2 (6 + 5) 32 4 = 2,816 bytes of rows: 2,848; 5 calls
    #   Ψ_dense = 2 V M + M + L (2 H D M + 2 K D M + 2 M + E M) = 16,416 + 2 (2,048 + 1,024 + 64 + 256) = 23,200
    #   over dc = 4: 2 (3/4) 23,200 4 = 139,200, plus the statistics 2 (3/4) (3 + L E) 8 = 228: 139,428; 2 calls
    #   experts over ed = 2: 2 (1/2) L (E/e) 3 F M 4 = 24,576 4 = 98,304; 1 call
    # Kept: 23,200 + 24,576 = 47,776 values: 191,104 bytes of parameters, as many of gradients, twice for AdamW;
    # the biases L E 4 = 64 bytes.
    record = dataclasses.make_dataclass("Record", ["sent", "received"])(
        torch.tensor([3, 1, 0, 2, 4, 0, 1, 1]), torch.tensor([[3, 1, 0, 2], [2, 2, 1, 0]]))
    moe = trusted.MOE
    cost = costs.step_cost(trusted.CONFIG, moe, {"d": 4, "e": 2}, 0, [record], torch.float32)
    assert cost.sent == {("e", "all_to_all"): 2_848, ("dc", "all_reduce"): 139_428, ("ed", "all_reduce"): 98_304}, \
        f"your step_cost, the worked example: bytes sent {cost.sent}"
    assert cost.calls == {("e", "all_to_all"): 5, ("dc", "all_reduce"): 2, ("ed", "all_reduce"): 1}, \
        f"your step_cost, the worked example: calls {cost.calls}"
    kept = costs.state_bytes(trusted.CONFIG, moe, 2, torch.float32).memory
    assert kept == {"parameters": 191_104, "gradients": 191_104, "optimizer": 382_208, "buffers": 64}, f"your state_bytes, the worked example: kept {kept}"
