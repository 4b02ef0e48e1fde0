"""Module 15 costs: the traffic formula against a hand count, and against the collectives one real
training step of the reference model issues (course/collectives.py's log, read by course/costs.py);
Ulysses as DeepSpeed runs it (the adjoint backward) against DeepSpeed's scheme built here by autograd
(an all-to-all whose backward is the same exchange the other way, deepspeed/sequence/layer.py), whose
gradients the test checks against whole attention first (float64, within 1e-12)."""
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from course.costs import StepCost, measured_cost
from course.impl import load, reference
from course.launch import run_ranks
from course.mesh import init_mesh

costs = load("m15_costs")
ref_model = reference("m15_cp_model")
ulysses = reference("m15_ulysses")   # trusted re-shardings for the DeepSpeed-Ulysses built below
LlamaConfig = reference("m06_llama_block").LlamaConfig

CFG = LlamaConfig(dim=16, n_heads=4, n_kv_heads=2, head_dim=4, ffn_dim=32, n_layers=2, max_seq_len=16)


# Once a step over the d c ranks: the gradients, Psi = 2 * 256 * 16 + 2 * 2,336 + 16 = 12,880 values accumulated in
# float32 (s = 4 bytes, whatever the values' dtype), and the loss (4 bytes): 2 all-reduces of 51,524 bytes, each
# sending 2 (dc - 1)/dc of it: 77,286 bytes over d c = 4 ranks, 51,524 over 2.
DC_SENT = {4: 77_286, 2: 51_524}


@pytest.mark.exercises("cp_traffic")
@pytest.mark.parametrize("variant, dtype, c, d, c_entries", [
    # L = 2 blocks, a global batch of 8 x 16 tokens in m = 2 microbatches, float32, c = 4, d = 1: a rank's
    # microbatch is 4 sequences of 4 tokens, N = 16; one key/value block KV = 2 * 16 * 2 * 4 * 4 = 1,024
    # bytes, its float32 gradient accumulator the same. Per block and microbatch, times m L = 4:
    # ring: 3 + 3 block sends and 4 accumulator sends: 10 calls, 6 * 1,024 + 4 * 1,024 = 10,240 bytes.
    ("ring", "float32", 4, 1, {"send": (40, 40_960)}),
    ("zigzag", "float32", 4, 1, {"send": (40, 40_960)}),
    # all-gather: 2 all-gathers of KV, each sending 3 shards (6,144), and a reduce-scatter sending 3 (3,072).
    ("allgather", "float32", 4, 1, {"all_gather": (8, 24_576), "reduce_scatter": (4, 12_288)}),
    # Ulysses: K = 2 < c = 4, each key/value head copied twice (K' = 4). q, o, do, dq: 16 * 4 * 4 * 4 = 1,024;
    # k, v, dk, dv with K' heads: 1,024; lse 16 * 4 * 4 = 256, with delta 512. Forward 1,024 + 2,048 + 1,024
    # + 256 = 4,352, backward 512 + 1,024 + 2,048 + 1,024 + 1,024 + 2,048 = 7,680; 3/4 of it leaves the rank:
    # 9,024 per block, 13 all-to-alls.
    ("ulysses", "float32", 4, 1, {"all_to_all": (52, 36_096)}),
    # bf16 (b = 2), statistics and accumulators still s = 4 bytes: KV = 512, its gradients' shard 1,024.
    # all-gather: 2 * 3 * 512 = 3,072 gathered, 3 * 1,024 = 3,072 reduce-scattered, per block.
    ("allgather", "bfloat16", 4, 1, {"all_gather": (8, 12_288), "reduce_scatter": (4, 12_288)}),
    # Ulysses: q, o, do, dq, k, v, dk, dv halve (512 each), the lse (256) and lse with delta (512) do not:
    # forward 512 + 1,024 + 512 + 256 = 2,304, backward 512 + 512 + 1,024 + 512 + 512 + 1,024 = 4,096; 3/4 of
    # 6,400 = 4,800 per block.
    ("ulysses", "bfloat16", 4, 1, {"all_to_all": (52, 19_200)}),
    # c = 1, d = 2: a group of one still logs its collectives (0 bytes), so the all-gather's and Ulysses' calls
    # count; the ring has no neighbour and sends nothing (a microbatch of 8 / (2 * 2) = 2 sequences).
    ("ring", "float32", 1, 2, {}),
    ("allgather", "float32", 1, 2, {"all_gather": (8, 0), "reduce_scatter": (4, 0)}),
    ("ulysses", "float32", 1, 2, {"all_to_all": (52, 0)}),
], ids=["ring", "zigzag", "allgather", "ulysses", "allgather-bf16", "ulysses-bf16", "ring-c1-d2", "allgather-c1-d2",
        "ulysses-c1-d2"])
def test_the_traffic_formula_matches_a_hand_count(variant, dtype, c, d, c_entries):
    expected = StepCost({**{("c", op): size for op, (_, size) in c_entries.items()},
                         ("dc", "all_reduce"): DC_SENT[c * d]},
                        {**{("c", op): n for op, (n, _) in c_entries.items()}, ("dc", "all_reduce"): 2})
    got = costs.cp_traffic(CFG, 8, 16, getattr(torch, dtype), c, variant, d=d, n_microbatches=2)
    assert got == expected, (f"{variant}, {dtype}, c={c}, d={d}: formula sent {got.sent}, calls {got.calls}; hand "
                             f"count {expected.sent}, {expected.calls} (statistics and accumulators are s = 4 bytes a "
                             f"value; a group of one still logs its calls)")


@pytest.mark.exercises("cp_traffic")
def test_the_rings_accumulators_travel_in_float32():
    # bf16, as above otherwise: a block is 512 bytes, its accumulator (float32 statistics) 1,024: per block
    # 6 * 512 + 4 * 1,024 = 7,168, times 4. The gradients are accumulated in float32 too: 77,286 as above.
    expected = StepCost({("c", "send"): 28_672, ("dc", "all_reduce"): 77_286},
                        {("c", "send"): 40, ("dc", "all_reduce"): 2})
    got = costs.cp_traffic(CFG, 8, 16, torch.bfloat16, 4, "ring", d=1, n_microbatches=2)
    assert got == expected, (f"ring, bf16: formula sent {got.sent}, calls {got.calls}; expected {expected.sent}, "
                             f"{expected.calls}: the blocks are b = 2 bytes a value, the accumulators are s = 4 "
                             f"bytes a value")


def _one_step_each(variants):
    mesh = init_mesh({"d": 1, "c": dist.get_world_size()})
    logs = {}
    for variant in variants:
        model = ref_model.CPLlama(CFG, mesh, variant, dtype=torch.float32)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tokens = torch.randint(0, CFG.vocab_size, (4, CFG.max_seq_len), generator=torch.Generator().manual_seed(0))
        start = len(mesh.log)
        model.train_step(tokens, tokens, 2, optimizer)
        logs[variant] = mesh.log[start:]
    return logs


@functools.cache
def real_steps():
    return run_ranks(_one_step_each, 2, ref_model.VARIANTS, timeout=60)


@pytest.mark.exercises("cp_traffic")
@pytest.mark.parametrize("variant", list(ref_model.VARIANTS))
def test_the_traffic_formula_equals_the_collectives_of_a_real_step(variant):
    formula = costs.cp_traffic(CFG, 4, CFG.max_seq_len, torch.float32, 2, variant, n_microbatches=2)
    for rank, logs in enumerate(real_steps()):
        measured = measured_cost(logs[variant])
        assert measured == formula, (f"rank {rank}, {variant}, c=2: logged sent {measured.sent}, calls "
                                     f"{measured.calls}; formula {formula.sent}, {formula.calls}")


# --- DeepSpeed-Ulysses: the backward is the adjoint of the forward's all-to-alls -----------------------

@pytest.mark.exercises("cp_traffic")
def test_deepspeeds_ulysses_backward_sends_what_its_forward_sent():
    # As the Ulysses hand count above (L = 2, m = 2, c = 4, K = 2 copied twice, float32): q, k, v and o forward,
    # 4 * 1,024 bytes, no lse; backward their adjoints do, dq, dk, dv, the same 4 * 1,024. 3/4 of 8,192 leaves
    # the rank: 6,144 per block, 8 all-to-alls.
    expected = StepCost({("c", "all_to_all"): 4 * 6_144, ("dc", "all_reduce"): DC_SENT[4]},
                        {("c", "all_to_all"): 4 * 8, ("dc", "all_reduce"): 2})
    got = costs.cp_traffic(CFG, 8, 16, torch.float32, 4, "ulysses", d=1, n_microbatches=2, adjoint=True)
    assert got == expected, (f"DeepSpeed's Ulysses, c=4: formula sent {got.sent}, calls {got.calls}; hand count "
                             f"{expected.sent}, {expected.calls} (its backward is its forward's four all-to-alls run "
                             f"backwards: do, dq, dk, dv; no lse, nothing re-sent)")


class _SeqAllToAll(torch.autograd.Function):
    """DeepSpeed's _SeqAllToAll (deepspeed/sequence/layer.py): an all-to-all whose backward is the same exchange
    with the scattered and gathered axes swapped. Built here on module 15's two re-shardings."""

    @staticmethod
    def forward(ctx, x, group, to_heads, label):
        ctx.group, ctx.to_heads, ctx.label = group, to_heads, label
        return (ulysses.sequence_to_heads if to_heads else ulysses.heads_to_sequence)(x, group, label)

    @staticmethod
    def backward(ctx, grad):
        back = ulysses.heads_to_sequence if ctx.to_heads else ulysses.sequence_to_heads
        return back(grad.contiguous(), ctx.group, "d" + ctx.label), None, None, None


def _deepspeed_ulysses(heads, kv_heads):
    """One block's attention of DeepSpeed-Ulysses by autograd on c ranks (B = 2, T = 16, D = 4, float64): what its
    all-to-alls logged, and whether its gradients are whole attention's."""
    group = init_mesh({"c": dist.get_world_size()}).group("c")
    c, (B, T, D) = group.size, (2, 16, 4)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, T, h, D, generator=g, dtype=torch.float64, requires_grad=True)
               for h in (heads, kv_heads, kv_heads))
    do = torch.randn(B, T, heads, D, generator=g, dtype=torch.float64)
    rows = slice(group.index * T // c, (group.index + 1) * T // c)   # this rank's positions, contiguous
    copies = ulysses.kv_copies(kv_heads, c)
    mine = [x[:, rows].detach().requires_grad_(True) for x in (q, k, v)]
    start = len(group.collectives.log)
    qh, kh, vh = (_SeqAllToAll.apply(x, group, True, name) for x, name in
                  zip((mine[0], mine[1].repeat_interleave(copies, 2), mine[2].repeat_interleave(copies, 2)), "qkv"))
    oh = F.scaled_dot_product_attention(qh.transpose(1, 2), kh.transpose(1, 2), vh.transpose(1, 2), is_causal=True,
                                        enable_gqa=True).transpose(1, 2)
    o = _SeqAllToAll.apply(oh.contiguous(), group, False, "o")
    o.backward(do[:, rows])
    logged = [(r.op, r.label, r.sent_bytes) for r in group.collectives.log[start:]]
    whole = F.scaled_dot_product_attention(q.transpose(1, 2), k.repeat_interleave(heads // kv_heads, 2).transpose(1, 2),
                                           v.repeat_interleave(heads // kv_heads, 2).transpose(1, 2), is_causal=True)
    whole.transpose(1, 2).backward(do)
    exact = all(torch.allclose(x.grad, full.grad[:, rows], atol=1e-12) for x, full in zip(mine, (q, k, v)))
    return logged, exact


@pytest.mark.exercises("cp_traffic")
def test_the_adjoint_formula_equals_deepspeeds_ulysses_run_by_autograd():
    # H = 4 query heads, K = 2 key/value heads copied twice on c = 4 ranks: one block, one microbatch of B = 2
    # sequences of 16 positions, float64; the formula asked for that step on one block (L = 1), float64
    cfg = LlamaConfig(dim=16, n_heads=4, n_kv_heads=2, head_dim=4, ffn_dim=32, n_layers=1, max_seq_len=16)
    formula = costs.cp_traffic(cfg, 2, 16, torch.float64, 4, "ulysses", n_microbatches=1, adjoint=True)
    for rank, (logged, exact) in enumerate(run_ranks(_deepspeed_ulysses, 4, 4, 2, timeout=60)):
        assert exact, f"rank {rank}: the test's DeepSpeed-Ulysses does not give whole attention's gradients"
        sent = sum(b for op, _, b in logged if op == "all_to_all")
        calls = sum(op == "all_to_all" for op, _, _ in logged)
        assert (sent, calls) == (formula.sent_bytes("c", "all_to_all"), formula.n_calls("c", "all_to_all")), (
            f"rank {rank}: DeepSpeed's Ulysses by autograd sent {sent} bytes in {calls} all-to-alls "
            f"({[label for _, label, _ in logged]}); the adjoint formula says "
            f"{formula.sent_bytes('c', 'all_to_all')} in {formula.n_calls('c', 'all_to_all')}")
