"""Module 12 costs: the traffic formula against a hand count and against the collectives a real
training step issues (module 12's reference model, logged by course/collectives.py), and the
activation formula, name by name, against what the reference block's store really keeps."""
import pytest
import torch
import torch.distributed as dist

from course.collectives import Collectives
from course.impl import load, reference
from course.launch import run_ranks

costs = load("m12_tp_costs")
ref_model, ref_block, ref_linear = (reference(f"m12_{stem}") for stem in ("tp_model", "tp_block", "tp_linear"))
m06 = reference("m06_llama_block")

CFG = m06.LlamaConfig(dim=32, n_heads=8, n_kv_heads=4, head_dim=4, ffn_dim=24, n_layers=2, max_seq_len=16)


@pytest.mark.exercises("tp_traffic")
@pytest.mark.parametrize("sequence_parallel, counts, sent", [
    # L = 2 blocks, a batch of 8 x 16 tokens in 2 microbatches of N = 64 tokens, float32, t = 4.
    # One stream activation A = 64 * 32 * 4 = 8,192 bytes; one loss statistic all-reduce 64 * 4 = 256.
    # Replicated: 4L + 2 = 10 all-reduces of A a microbatch, 20 a step; each sends 2 * 3/4 * A =
    # 12,288 bytes: 245,760; the loss: 6 all-reduces of 256 bytes, 2 * 3/4 * 256 = 384 each: 2,304.
    (False, (20, 0, 0, 6, 0), 245_760 + 2_304),
    # Sequence-parallel: 6L + 3 = 15 all-gathers and 4L + 2 = 10 reduce-scatters of A a microbatch,
    # 50 a step, each sending 3/4 * A = 6,144 bytes: 307,200; the loss as before, 2,304; and one
    # all-reduce of the 2L + 1 = 5 norm weights' gradients, 5 * 32 * 4 = 640 bytes: 2 * 3/4 * 640 = 960.
    (True, (0, 30, 20, 6, 1), 307_200 + 2_304 + 960),
], ids=["replicated", "sequence-parallel"])
def test_the_traffic_formula_matches_a_hand_count(sequence_parallel, counts, sent):
    t = costs.tp_traffic(CFG, 8, 16, torch.float32, 4, sequence_parallel, n_microbatches=2)
    got = (t.stream_all_reduces, t.stream_all_gathers, t.stream_reduce_scatters, t.loss_all_reduces, t.norm_all_reduces)
    assert got == counts, f"(all-reduces, all-gathers, reduce-scatters, loss all-reduces, norm all-reduces) = {got}, expected {counts}"
    assert t.sent_bytes == sent, f"bytes sent per rank per step: {t.sent_bytes}, expected {sent}"


def _one_step(sequence_parallel, n_microbatches):
    collectives = Collectives()
    tp = ref_linear.TPGroup(dist.get_rank(), dist.get_world_size(), collectives, sequence_parallel)
    ref_model.train(CFG, 1, tp, batch=8, n_microbatches=n_microbatches, dtype=torch.float32)
    return collectives.log


@pytest.mark.exercises("tp_traffic")
@pytest.mark.parametrize("world_size, sequence_parallel, n_microbatches", [(2, True, 2), (4, False, 1)])
def test_the_traffic_formula_equals_the_collectives_of_a_real_step(world_size, sequence_parallel, n_microbatches):
    log = run_ranks(_one_step, world_size, sequence_parallel, n_microbatches, timeout=30)[0]
    t = costs.tp_traffic(CFG, 8, CFG.max_seq_len, torch.float32, world_size, sequence_parallel, n_microbatches)
    stream = 8 // n_microbatches * CFG.max_seq_len * CFG.dim * 4
    measured = {op: sum(c.op == op and c.payload_bytes in (stream, stream // world_size) for c in log)
                for op in ("all_reduce", "all_gather", "reduce_scatter")}
    formula = {"all_reduce": t.stream_all_reduces, "all_gather": t.stream_all_gathers,
               "reduce_scatter": t.stream_reduce_scatters}
    assert measured == formula, f"stream collectives in one step: logged {measured}, formula {formula}"
    sent = sum(c.sent_bytes for c in log)
    assert sent == t.sent_bytes, f"bytes sent per rank in one step: logged {sent}, formula {t.sent_bytes}"


@pytest.mark.exercises("tp_activation_bytes")
@pytest.mark.parametrize("world_size, sequence_parallel, dtype", [(2, True, torch.bfloat16), (4, False, torch.float32),
                                                                  (4, True, torch.float64)],
                         ids=["t2-sequence-parallel-bf16", "t4-replicated-float32", "t4-sequence-parallel-float64"])
def test_the_activation_formula_is_what_the_block_keeps(world_size, sequence_parallel, dtype):
    # Name by name against the reference block's store on rank 0 (a swap of two sizes would leave
    # the total unchanged).
    def kept():
        tp = ref_linear.TPGroup(dist.get_rank(), dist.get_world_size(), Collectives(), sequence_parallel)
        w = ref_block.shard_block_weights(m06.init_block_weights(CFG, torch.Generator().manual_seed(0), dtype), CFG,
                                          tp.rank, tp.size)
        x = torch.randn(3, 8, CFG.dim).to(dtype)
        store = m06.ActivationStore()
        ref_block.TPBlock(CFG, tp).forward(w, x.chunk(tp.size, dim=1)[tp.rank].clone() if sequence_parallel else x, store)
        return {name: t.untyped_storage().nbytes() for name, t in store.tensors.items()}
    saved = run_ranks(kept, world_size, timeout=30)[0]
    got = costs.tp_activation_bytes(CFG, 3, 8, dtype, world_size, sequence_parallel)
    wrong = {name: (got.get(name), saved.get(name)) for name in set(got) | set(saved) if got.get(name) != saved.get(name)}
    assert not wrong, f"(formula, kept) bytes where they differ: {wrong}"
