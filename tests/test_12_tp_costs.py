"""Module 12 costs: the traffic formula against a hand count and against the collectives a real
training step issues (module 12's reference model, logged by course/collectives.py and read by
course/costs.py's measured_cost), and the activation formula, name by name, against what the
reference block's store really keeps (and, summed, against the stores of a real step)."""
import dataclasses

import pytest
import torch

from course.costs import StepCost, measured_activations, measured_cost
from course.impl import load, reference
from course.launch import run_ranks
from course.mesh import world_group

costs = load("m12_tp_costs")
ref_model, ref_block = reference("m12_tp_model"), reference("m12_tp_block")
m06 = reference("m06_llama_block")
m06_model = reference("m06_llama_model")

CFG = m06.LlamaConfig(dim=32, n_heads=8, n_kv_heads=4, head_dim=4, ffn_dim=24, n_layers=2, max_seq_len=16)


@pytest.mark.exercises("tp_traffic")
@pytest.mark.parametrize("sequence_parallel, calls, sent", [
    # L = 2 blocks, a batch of 8 x 16 tokens in 2 microbatches of N = 64 tokens, float32, t = 4.
    # One stream activation A = 64 * 32 * 4 = 8,192 bytes; one loss statistic all-reduce 64 * 4 = 256.
    # Replicated: 4L + 2 = 10 all-reduces of A a microbatch, 20 a step; each sends 2 * 3/4 * A =
    # 12,288 bytes: 245,760; the loss: 6 all-reduces of 256 bytes, 2 * 3/4 * 256 = 384 each: 2,304.
    (False, {"all_reduce": 26}, {"all_reduce": 245_760 + 2_304}),
    # Sequence-parallel: 6L + 3 = 15 all-gathers and 4L + 2 = 10 reduce-scatters of A a microbatch,
    # 50 a step, each sending 3/4 * A = 6,144 bytes; the loss as before, 2,304; and one all-reduce of
    # the 2L + 1 = 5 norm weights' gradients, 5 * 32 * 4 = 640 bytes: 2 * 3/4 * 640 = 960.
    (True, {"all_reduce": 7, "all_gather": 30, "reduce_scatter": 20},
     {"all_reduce": 2_304 + 960, "all_gather": 30 * 6_144, "reduce_scatter": 20 * 6_144}),
], ids=["replicated", "sequence-parallel"])
def test_the_traffic_formula_matches_a_hand_count(sequence_parallel, calls, sent):
    got = costs.tp_traffic(CFG, {"t": 4}, 8, torch.float32, n_microbatches=2, sequence_parallel=sequence_parallel)
    want = StepCost({("t", op): n for op, n in sent.items()}, {("t", op): n for op, n in calls.items()})
    assert got == want, f"one step on t = 4: formula {got}, counted by hand {want}"


def differences(measured: StepCost, formula: StepCost, owners: dict[str, str]) -> str:
    """Where the reference model's log and stores (given code) and the learner's formula differ, each
    part named with the function of the learner's that gives it (owners: part -> function)."""
    parts = []
    for part in ("calls", "sent", "memory"):
        got, want = getattr(formula, part), getattr(measured, part)
        keys = sorted(set(got) | set(want), key=str)
        wrong = {key: (got.get(key), want.get(key)) for key in keys if got.get(key) != want.get(key)}
        if wrong:
            parts.append(f"{part} (your {owners[part]}, measured): {wrong}")
    return "; ".join(parts)


def _one_step(sequence_parallel, n_microbatches):
    tp = world_group("t")
    model = ref_model.TPLlama(CFG, tp, dtype=torch.float32, sequence_parallel=sequence_parallel)
    tokens = torch.zeros(8 // n_microbatches, CFG.max_seq_len, dtype=torch.long)
    kept = measured_activations(model, tokens, tokens)  # one microbatch; train_step zeroes its gradients
    tp.collectives.log.clear()
    m06_model.fit(model, 1, batch=8, n_microbatches=n_microbatches)
    return measured_cost(tp.collectives.log, {"activations": kept})


# Name by name first: one wrong activation then shows by its name, before the whole step's totals.
@pytest.mark.exercises("tp_activations_by_name")
@pytest.mark.parametrize("world_size, sequence_parallel, dtype", [(2, True, torch.bfloat16), (4, False, torch.float32),
                                                                  (4, True, torch.float64)],
                         ids=["t2-sequence-parallel-bf16", "t4-replicated-float32", "t4-sequence-parallel-float64"])
def test_the_activation_formula_is_what_the_block_keeps(world_size, sequence_parallel, dtype):
    # Name by name against the reference block's store on rank 0 (a swap of two sizes would leave
    # the total unchanged).
    def kept():
        tp = world_group("t")
        w = ref_block.shard_block_weights(m06.init_block_weights(CFG, torch.Generator().manual_seed(0), dtype), CFG, tp)
        x = torch.randn(3, 8, CFG.dim).to(dtype)
        store = m06.ActivationStore()
        ref_block.TPBlock(CFG, tp, sequence_parallel).forward(
            w, x.chunk(tp.size, dim=1)[tp.index].clone() if sequence_parallel else x, store)
        return {name: t.untyped_storage().nbytes() for name, t in store.tensors.items()}
    saved = run_ranks(kept, world_size, timeout=30)[0]
    got = costs.tp_activations_by_name(dataclasses.replace(CFG, max_seq_len=8), {"t": world_size}, 3, dtype,
                                       sequence_parallel=sequence_parallel)
    wrong = {name: (got.get(name), saved.get(name)) for name in set(got) | set(saved) if got.get(name) != saved.get(name)}
    assert not wrong, f"(formula, kept) bytes where they differ: {wrong}"


@pytest.mark.exercises("tp_traffic", "tp_activations_by_name")
@pytest.mark.parametrize("world_size, sequence_parallel, n_microbatches", [(2, True, 2), (4, False, 1)])
def test_the_formulas_equal_the_log_and_the_stores_of_a_real_step(world_size, sequence_parallel, n_microbatches):
    # The reference model (trusted code: this grades the formulas alone): the calls and the bytes of one step's
    # collectives (course/costs.py's measured_cost of its log), and what its blocks' stores hold after one
    # microbatch's forward, against tp_traffic + tp_activation_bytes.
    measured = run_ranks(_one_step, world_size, sequence_parallel, n_microbatches, timeout=30)[0]
    args = (CFG, {"t": world_size}, 8, torch.float32, n_microbatches, sequence_parallel)
    formula = costs.tp_traffic(*args) + costs.tp_activation_bytes(*args)
    assert measured == formula, (f"one step of the reference model (given code) on t = {world_size} against the "
                                 f"formulas, where they differ: " + differences(measured, formula, {
                                     "calls": "tp_traffic", "sent": "tp_traffic", "memory": "tp_activations_by_name"}))
