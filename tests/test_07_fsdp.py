"""Module 07: FSDP against single-process training, the payload formulas, and PyTorch's FSDP2.

References: module 06's Llama trained in one process on the whole global batch (trusted reference
code), the FSDP notes' worked example, the call order written out below, and fully_shard.

Tolerance. The sharded run computes each gradient as a sum over ranks (and micro-steps) of partial
sums, one process sums over the whole batch at once: the same numbers added in a different order,
so they differ by rounding. In float64, a gradient differs by ~1e-16 relative; AdamW's update
lr * m / (sqrt(v) + eps) turns that into weight differences of ~1e-16 absolute per step. Measured
after 4 steps (torch 2.13 CPU; worst of 2 and 4 ranks, with and without accumulation): losses
within 8.9e-16, block weights within 4.6e-16, the embedding, final norm and LM head within 2.2e-16.
We allow 1e-12.
A wrong gradient *scale* is the subtle mistake: AdamW's update m / sqrt(v) barely changes when every
gradient is multiplied by the same constant, so a missing 1/N or 1/n_microbatches moves the losses by
only ~1e-7..1e-6 (measured) - small to the eye, yet 10^5 times the tolerance. The messages say so.
Where no sum is reordered the result must be exact: the weights gathered before training are the
single-process weights bit for bit. 3 ranks make the shards need padding (7,744 parameters a block,
16,480 in the embedding, final norm and LM head: the vocabulary has one id more than the 256 bytes the
text uses, so that they need padding too).
"""
import dataclasses
import time

import pytest
import torch
import torch.distributed as dist

from course.collectives import Collectives
from course.compare import assert_all_close
from course.costs import StepCost, measured_cost
from course.impl import load, reference
from course.launch import RankFailed, run_ranks
from course.dataset import load_text, random_batch
from course.mesh import world_group
from course.reference_fsdp import fsdp2_llama

m07 = load("m07_fsdp")
flat_shards = load("m07_flat_shards")
payload = load("m07_payload")
m06 = reference("m06_llama_model")  # the single-process reference: trusted code, not graded here
LlamaConfig = reference("m06_llama_block").LlamaConfig

f64 = torch.float64
# V = 257: one id no byte of the text uses (it only gets zero gradients), so that the embedding, final norm and
# LM head (2 V M + M = 16,480 values) need padding over 3 ranks, as a block (7,744) does.
CFG = LlamaConfig(dim=32, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=48, n_layers=4, max_seq_len=16,
                  vocab_size=257)
BATCH, STEPS, LR = 8, 4, 3e-3
TOLERANCE = 1e-12

# What each check exercises, in order of blame: the likeliest culprit first. A check that runs the
# whole step grades every TODO, but the flat layout and the weight source have checks of their own
# that run before it, so the TODOs only a whole step exercises come first. A failure message that can
# tell names the function instead ("your FSDPLlama.train_step"): the scorecard points there.
LAYOUT = ("FlatLayout.views", "FlatLayout.__init__")
GATHERING = ("FSDPLlama.__init__", "ShardedWeights.gather", "ShardedWeights.get", *LAYOUT)
OUTER = ("FSDPLlama.gather_outer", "FSDPLlama.reduce_scatter_outer")
TRAINING = ("FSDPLlama.train_step", *OUTER,
            "FSDPLlama.finish_reduce_scatter", "FSDPLlama.reduce_scatter_grad", "FSDPLlama.backward_blocks",
            "ShardedWeights.gather", "ShardedWeights.get", "FSDPLlama.__init__", *LAYOUT)
ORDER = ("FSDPLlama.backward_blocks", "ShardedWeights.gather", "ShardedWeights.get",
         "FSDPLlama.reduce_scatter_grad", "FSDPLlama.finish_reduce_scatter", *OUTER, "FSDPLlama.train_step",
         "FSDPLlama.__init__", *LAYOUT)
COUNTS = ("ShardedWeights.gather", "FSDPLlama.backward_blocks",
          "FSDPLlama.reduce_scatter_grad", *OUTER, "ShardedWeights.get",
          "FSDPLlama.finish_reduce_scatter", "FSDPLlama.train_step", "FSDPLlama.__init__",
          *LAYOUT)
MEMORY = ("FSDPLlama.__init__", "ShardedWeights.get", "ShardedWeights.gather",
          "FSDPLlama.backward_blocks", "FSDPLlama.reduce_scatter_grad", "FSDPLlama.finish_reduce_scatter",
          *OUTER, "FSDPLlama.train_step", *LAYOUT)
MISUSE = ("ShardedWeights.get", "ShardedWeights.gather", "FSDPLlama.__init__", *LAYOUT)


def flat(block) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in block.tensors()])


def flat_outer(model) -> torch.Tensor:
    """The embedding, final norm and LM head of a model (or of its LlamaGrads), end to end in that order."""
    return torch.cat([model.embedding.reshape(-1), model.final_norm.reshape(-1), model.lm_head.reshape(-1)])


def outer_pieces(values: torch.Tensor) -> dict:
    """The embedding, final norm and LM head, cut by this test's own reading of their flat layout (padding
    dropped): V M, M and V M values, in order."""
    V, M = CFG.vocab_size, CFG.dim
    embedding, final_norm, lm_head = values[:2 * V * M + M].split([V * M, M, V * M])
    return {"embedding": embedding.view(V, M), "final_norm": final_norm, "lm_head": lm_head.view(V, M)}


def single_process_training(steps, batch=BATCH, dtype=f64):
    return m06.train(CFG, steps, batch, lr=LR, dtype=dtype)


def data_group(collectives=None):
    """Every rank of the job as module 07's data group (its collectives replaced by the test's, if given)."""
    group = world_group("d")
    return dataclasses.replace(group, collectives=collectives) if collectives is not None else group


# --- the flat layout and the arithmetic (one process) -----------------------------------------

@pytest.mark.exercises("FlatLayout.__init__", "FlatLayout.views")
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
def test_flat_layout_pads_to_equal_shards_and_views_into_the_buffer(world_size):
    block = m06.LlamaModel(CFG, 0).blocks[0]
    g = torch.Generator().manual_seed(1)
    for norm in (block.ln1, block.ln2):  # two tensors of ones, of one shape, could trade places unseen
        norm.add_(0.1 * torch.randn(norm.shape, generator=g))
    layout = flat_shards.FlatLayout(block, world_size)
    n = sum(t.numel() for t in block.tensors())
    sizes = {"shard_numel": layout.shard_numel, "padded_numel": layout.padded_numel}
    assert all(type(v) is int for v in sizes.values()), \
        (f"your FlatLayout.__init__ over {world_size} ranks: {sizes}: both sizes must be Python ints (a tensor's "
         f"size cannot be a float; use integer division //, not /)")
    assert layout.numel == n and layout.padded_numel % world_size == 0 and 0 <= layout.padded_numel - n < world_size, \
        (f"{n} parameters over {world_size} ranks: your FlatLayout.__init__ padded them to {layout.padded_numel} "
         f"(shard_numel {layout.shard_numel}): equal shards, covering every parameter, less than one more each")
    buffer = layout.flatten(block)
    expected = torch.cat([flat(block), torch.zeros(layout.padded_numel - n)])
    assert torch.equal(buffer, expected), \
        "FlatLayout.flatten (given) must lay the tensors end to end in BlockWeights order, zero padding after them"
    views = layout.views(buffer)
    for name, got, want in zip(flat_shards.NAMES, views.tensors(), block.tensors()):
        assert torch.equal(got, want), f"your FlatLayout.views: {name} differs from the block's {name}"
        assert got.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr(), \
            f"your FlatLayout.views: {name} is a copy, not a view into the buffer"
    shards = [layout.shard(buffer, r) for r in range(world_size)]
    assert torch.equal(torch.cat(shards), buffer) and len({s.numel() for s in shards}) == 1, \
        ("FlatLayout.shard (given): the shards of ranks 0, 1, ... must be equal slices that concatenate to the buffer "
         "(your FlatLayout.__init__'s shard_numel and padded_numel)")
    for r, s in enumerate(shards):
        assert s.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr() \
            and s.data_ptr() == buffer.data_ptr() + r * layout.shard_numel * buffer.element_size(), \
            (f"FlatLayout.shard (given): shard {r} is a copy, not a view: its elements must be the buffer's own, "
             f"from r * shard_numel on")


@pytest.mark.exercises("FlatLayout.views", "FlatLayout.__init__")
def test_the_embedding_final_norm_and_lm_head_are_one_more_flat_group():
    # The same layout with another template: OuterWeights, laid out embedding, final norm, LM head; views of
    # the template's class. 16,480 values over 3 ranks: 3 shards of 5,494, 2 zeros of padding; over 5: none.
    model = m06.LlamaModel(CFG, 0)
    model.final_norm.add_(0.1 * torch.randn(CFG.dim, generator=torch.Generator().manual_seed(2)))
    outer = flat_shards.OuterWeights(model.embedding, model.final_norm, model.lm_head)
    for world_size in (3, 5):
        layout = flat_shards.FlatLayout(outer, world_size)
        buffer = layout.flatten(outer)
        expected = torch.cat([flat_outer(model), torch.zeros(layout.padded_numel - layout.numel)])
        assert layout.numel == 16_480 and torch.equal(buffer, expected), \
            ("FlatLayout.flatten (given) of an OuterWeights must lay the embedding, the final norm and the LM head end to "
             "end, in that order, zero padding after them")
        views = layout.views(buffer)
        assert type(views) is flat_shards.OuterWeights, \
            (f"your FlatLayout.views of an OuterWeights layout returned a {type(views).__name__}: views are of the "
             f"template's class (self.kind), whichever group it is")
        for name, got in zip(("embedding", "final_norm", "lm_head"), views.tensors()):
            want = getattr(model, name)
            assert torch.equal(got, want) and got.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr(), \
                f"your FlatLayout.views: the outer weights' {name} must be a view into the buffer, equal to the model's"
        assert torch.equal(torch.cat([layout.shard(buffer, r) for r in range(world_size)]), buffer), \
            "FlatLayout.shard (given): the outer weights' shards must concatenate to their buffer (your FlatLayout.__init__'s sizes)"


# PyTorch's FSDP Notes' worked example: blocks of 1.6B parameters in fp32 over 8 GPUs. This Llama block
# holds exactly that many values: P + 2M = 12,800 (2 * 12,800 + 2 * 256 + 3 * 32,962) + 2 * 12,800 =
# 1,600,000,000 (dim 12,800: 100 query heads and 2 key/value heads of 128; FFN 32,962).
NOTES_CFG = LlamaConfig(dim=12_800, n_heads=100, n_kv_heads=2, head_dim=128, ffn_dim=32_962, n_layers=10)
# A block whose values need padding: P + 2M = 6 (2 * 6 + 2 * 2 + 3 * 7) + 2 * 6 = 234 values, over 4
# ranks 4 shards of ceil(234 / 4) = 59 (2 of them padding). Its embedding, final norm and LM head: 2 * 256 * 6
# + 6 = 3,078 values, over 4 ranks 4 shards of 770 (2 of them padding).
PADDED_CFG = LlamaConfig(dim=6, n_heads=3, n_kv_heads=1, head_dim=2, ffn_dim=7, n_layers=3)
# The Notes' model has no embedding; ours has (V = 256): 2 * 256 * 12,800 + 12,800 = 6,566,400 values, over 8
# ranks 820,800 of 4 bytes a shard, 3,283,200 bytes, gathered and reduce-scattered once in a one-microbatch step.
NOTES_OUTER_SHARD = 3_283_200


@pytest.mark.exercises("fsdp_traffic")
def test_payload_reproduces_the_fsdp_notes_worked_example():
    # 10 blocks of 1.6B parameters, fp32, 8 ranks, no block kept between passes: the Notes give a payload of
    # 0.8 GB per collective, 30 collectives (3 per block), 24 GB of payloads per step, and buffers of 12.8 GB
    # (2 full blocks) + 1.6 GB (2 shards) = 14.4 GB. With the ring algorithm a rank sends 7 payloads per
    # collective: 30 * 7 * 0.8 GB. Beside them the outer weights' one all-gather and one reduce-scatter, counted
    # by hand above, and their whole copy among the buffers (8 shards).
    cost = payload.fsdp_traffic(NOTES_CFG, {"d": 8}, torch.float32)
    calls = (cost.n_calls("d", "all_gather") - 1, cost.n_calls("d", "reduce_scatter") - 1)
    assert calls == (20, 10), (f"(all-gathers, reduce-scatters) of the blocks per step: {calls} (your count less the "
                               f"outer weights' one each); the Notes count 2 x 10 and 10")
    blocks_sent = (cost.sent_bytes("d", "all_gather") - 7 * NOTES_OUTER_SHARD,
                   cost.sent_bytes("d", "reduce_scatter") - 7 * NOTES_OUTER_SHARD)
    per_call = blocks_sent[0] / (7 * calls[0]), blocks_sent[1] / (7 * calls[1])
    assert per_call == (800_000_000, 800_000_000), \
        (f"payload per block collective (the blocks' bytes sent / (d - 1) / calls): {per_call}; the Notes give 0.8 GB "
         f"(the outer weights' collectives send 7 x {NOTES_OUTER_SHARD:,} bytes each)")
    assert sum(calls) * per_call[0] == 24_000_000_000
    assert cost.memory.get("buffers") == 14_400_000_000 + 8 * NOTES_OUTER_SHARD, \
        (f"buffers: {cost.memory.get('buffers')} bytes; the Notes give 12.8 GB + 1.6 GB = 14.4 GB for the blocks, and "
         f"the outer weights whole add 8 x {NOTES_OUTER_SHARD:,}")


@pytest.mark.exercises("fsdp_traffic")
@pytest.mark.parametrize("blocks, n_microbatches, kept, all_gathers", [
    (3, 1, 2, 4), (3, 3, 2, 8), (1, 2, 1, 1), (3, 2, 0, 12), (10, 1, 0, 20)])
def test_payload_counts_reused_blocks_and_n_microbatches(blocks, n_microbatches, kept, all_gathers):
    # Written out: micro-step 1 gathers every block forward and all but `kept` backward; each later
    # micro-step's forward starts with the `kept` blocks the last backward left in the buffers. The outer
    # weights: one all-gather and one reduce-scatter a micro-step, of 770-value shards.
    cfg = dataclasses.replace(PADDED_CFG, n_layers=blocks)
    cost = payload.fsdp_traffic(cfg, {"d": 4}, torch.bfloat16, n_microbatches, kept)
    got = (cost.n_calls("d", "all_gather"), cost.n_calls("d", "reduce_scatter"))
    want = (all_gathers + n_microbatches, (blocks + 1) * n_microbatches)
    assert got == want, \
        (f"L = {blocks} blocks, m = {n_microbatches} microbatches, kept = {kept}: (all-gathers, reduce-scatters) "
         f"= {got}, expected {want}: the blocks' {(all_gathers, blocks * n_microbatches)} and the outer weights' "
         f"one each a microbatch")
    sent = (cost.sent_bytes("d", "all_gather"), cost.sent_bytes("d", "reduce_scatter"))
    outer = n_microbatches * 3 * 770 * 2
    want = (all_gathers * 3 * 59 * 2 + outer, blocks * n_microbatches * 3 * 59 * 2 + outer)
    assert sent == want, (f"bytes sent (all-gathers, reduce-scatters) = {sent}, expected {want}: 234 values over 4 "
                          f"ranks pad to 4 x 59, the outer weights' 3,078 to 4 x 770, and each collective sends 3 "
                          f"of the 4 shards")


@pytest.mark.exercises("fsdp_traffic")
def test_buffers_and_state_count_the_padding():
    # PADDED_CFG in bf16 over 4 ranks: a block's shard holds 59 values (118 bytes), a full buffer 4 of them. The
    # embedding, LM head and final norm hold 3,078 values, a shard of them 770 (1,540 bytes), whole 4 of them. A
    # rank owns its 3 block shards and its outer shard: (3 * 59 + 770) * 2 = 1,894 bytes, as many gradients,
    # AdamW's two moments. Nothing is all-reduced.
    cost = payload.fsdp_traffic(PADDED_CFG, {"d": 4}, torch.bfloat16)
    got = {what: cost.memory.get(what) for what in ("buffers", "parameters", "gradients", "optimizer")}
    want = {"buffers": 2 * 4 * 118 + 4 * 1_540 + 2 * 118, "parameters": 1_894, "gradients": 1_894,
            "optimizer": 3_788}
    assert got == want, (f"memory {got}, expected {want} bytes: a full buffer holds every rank's padded shard, the "
                         f"outer weights whole every rank's shard of them, a communication buffer one block shard, "
                         f"and a rank keeps its shards: the blocks' and the outer weights'")
    assert cost.n_calls("d", "all_reduce") == 0, "no weight is replicated: nothing is all-reduced"


@pytest.mark.exercises("fsdp_traffic")
def test_one_block_needs_one_full_buffer():
    # One block: block l goes to buffer l % 2, so a step only ever fills buffer 0 (ShardedWeights allocates a buffer at
    # its first gather). PADDED_CFG's block (59 values a shard over 4 ranks) and outer weights (770), bf16.
    cost = payload.fsdp_traffic(dataclasses.replace(PADDED_CFG, n_layers=1), {"d": 4}, torch.bfloat16)
    want = 1 * 4 * 118 + 4 * 1_540 + 2 * 118
    assert cost.memory.get("buffers") == want, (
        f"buffers: {cost.memory.get('buffers')} bytes with one block, expected {want}: how many of the two full-size "
        "buffers does a step with a single block ever fill?")


def _one_real_step(n_microbatches):
    """One step of the reference FSDP model: its log, and the bytes of what it keeps between steps."""
    group = data_group()
    model = reference("m07_fsdp").FSDPLlama(CFG, group, dtype=f64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    tokens, targets = random_batch(load_text(), BATCH, CFG.max_seq_len, torch.Generator().manual_seed(0))
    model.train_step(tokens, targets, n_microbatches, optimizer)
    moments = sum(optimizer.state[p][m].nbytes for p in model.parameters() for m in ("exp_avg", "exp_avg_sq"))
    return measured_cost(group.collectives.log, {"parameters": sum(p.nbytes for p in model.parameters()),
                                                 "gradients": sum(g.nbytes for g in model.grads()),
                                                 "optimizer": moments})


@pytest.mark.exercises("fsdp_traffic")
@pytest.mark.parametrize("world_size, n_microbatches", [(3, 1), (4, 2)])
def test_the_formula_equals_the_log_and_the_tensors_of_a_real_step(world_size, n_microbatches):
    # The reference model (trusted code: this grades the formula alone), one step on d ranks: the calls and the
    # bytes its collectives send (course/costs.py's measured_cost of its log) and the weights, gradients and
    # AdamW moments a rank keeps. 3 ranks pad the shards. The buffers are the formula's alone (the notes'
    # communication buffers live only inside a step).
    measured = run_ranks(_one_real_step, world_size, n_microbatches, timeout=60)[0]
    formula = payload.fsdp_traffic(CFG, {"d": world_size}, f64, n_microbatches, kept=min(2, CFG.n_layers))
    without_buffers = StepCost(formula.sent, formula.calls, {k: v for k, v in formula.memory.items() if k != "buffers"})
    assert measured == without_buffers, (f"{world_size} ranks, {n_microbatches} microbatch(es), kept = 2: the "
                                         f"reference model (given code) logged and kept {measured}; your fsdp_traffic "
                                         f"gives {without_buffers}")


# --- one step, piece by piece: each TODO's result against the single process --------------------

def padded_shard(values: torch.Tensor, d: int, r: int) -> torch.Tensor:
    """Rank r's slice of `values` (one block's, flat) cut into d equal pieces, zero-padded: written out
    here, not taken from the FlatLayout under test."""
    size = (values.numel() + d - 1) // d
    return torch.cat([values, values.new_zeros(size * d - values.numel())])[r * size:(r + 1) * size]


def off(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """How `got` differs from `want` (None: within the tolerance)."""
    if got.isnan().any():
        return "NaN"
    if torch.count_nonzero(got) == 0 and torch.count_nonzero(want) > 0:
        return "all zero"
    worst = (got - want).abs().max().item()
    return f"off by {worst:.2e}" if worst > TOLERANCE else None


def common_factor(pairs) -> float | None:
    """The factor c != 1 with got = c * want for every (got, want), if there is one (a scale error)."""
    got, want = (torch.cat([t.reshape(-1) for t in ts]) for ts in zip(*pairs))
    c = (got @ want / (want @ want)).item()
    fits = (got - c * want).abs().max() <= 1e-9 * want.abs().max()
    return c if fits and abs(c - 1) > 1e-6 else None


def times(factor: float, it: str = "it") -> str:
    """A scale error in words: "1/3 of it" for a factor of 1/3, "2 times it" otherwise."""
    inverse = round(1 / factor)
    return f"1/{inverse} of {it}" if inverse > 1 and abs(factor * inverse - 1) < 1e-6 else f"{factor:.3g} times {it}"


def _one_step_piece_by_piece(n_microbatches):
    """One optimizer step driven by the test, one TODO's piece at a time, each result compared with
    module 06's single process on the same weights and batch. Returns what differed, each with the number
    of the piece that found it (every rank makes every call whatever it finds, so no rank leaves its peers
    waiting, and a piece that fails on one rank may make a later one fail on another: the parent reports
    the earliest piece's first)."""
    d, r = dist.get_world_size(), dist.get_rank()
    found, piece = [], 0

    def note(line):
        found.append((piece, line))
    model = m07.FSDPLlama(CFG, data_group(RecordingCollectives([])), dtype=f64)  # results arrive on wait()
    single = m06.LlamaModel(CFG, 0, f64)
    for layer, block in enumerate(single.blocks):  # right after __init__, before any gather
        if (how := off(model.shards[layer], padded_shard(flat(block), d, r))) is not None:
            whose = next((k for k in range(d) if off(model.shards[layer], padded_shard(flat(block), d, k)) is None),
                         None)
            note(f"rank {r}: block {layer}'s shard after FSDPLlama(...) is {how}" +
                 (f" (it is rank {whose}'s slice)" if whose is not None else "") +
                 ": your FSDPLlama.__init__ keeps this rank's (self.dp.index's) slice of each block's padded flat "
                 "buffer")
            break
    if (how := off(model.outer_shard, padded_shard(flat_outer(single), d, r))) is not None:
        whose = next((k for k in range(d) if off(model.outer_shard, padded_shard(flat_outer(single), d, k)) is None),
                     None)
        note(f"rank {r}: the outer weights' shard after FSDPLlama(...) is {how}" +
             (f" (it is rank {whose}'s slice)" if whose is not None else "") +
             ": your FSDPLlama.__init__ keeps this rank's slice of the padded flat buffer of the embedding, final "
             "norm and LM head (self.outer_layout)")
    piece += 1
    model.gather_outer()
    for name in ("embedding", "final_norm", "lm_head"):
        got = getattr(model, name)
        if got is None or (how := off(got, getattr(single, name))) is not None or not torch.equal(got, getattr(single, name)):
            note(f"rank {r}: the {name} after gather_outer() is " + ("None" if got is None else how or "not bit for bit "
                 "the single process's") + ": your FSDPLlama.gather_outer all-gathers every rank's shard of the outer "
                 "weights and sets the three as views of the whole buffer")
            break
    else:
        if len({getattr(model, name).untyped_storage().data_ptr() for name in ("embedding", "final_norm", "lm_head")}) != 1:
            note(f"rank {r}: after gather_outer() the embedding, final norm and LM head are not views of one buffer: "
                 f"your FSDPLlama.gather_outer hands them out as views of the whole buffer it gathered into")
    model.embedding = model.final_norm = model.lm_head = None
    piece += 1
    source = model.weights
    for layer, block in enumerate(single.blocks):
        buf = source.buffer_for(layer)
        for call in (source.gather, source.get, source.release):
            got = call(layer)
            if (buf.layer, buf.version) != (layer, source.version):  # what GatherBuffer's docstring asks
                note(f"rank {r}: after {call.__name__}({layer}) its buffer says it holds layer {buf.layer} "
                     f"at version {buf.version}, not layer {layer} at {source.version} (GatherBuffer's "
                     f"docstring): your ShardedWeights.{call.__name__} leaves its fields wrong")
            if call == source.get and (how := off(flat(got), flat(block))) is not None:
                note(f"rank {r}: block {layer} as get({layer}) handed it out is {how}: " + (
                    "your ShardedWeights.get must wait for the all-gather before handing out its buffer"
                    if how == "NaN" else
                    "your ShardedWeights.gather all-gathers every rank's shard of the layer into its buffer"))
    piece += 1
    last = CFG.n_layers - 1
    for when, expected in (("again before any step", 0), ("after invalidate()", 1)):
        if expected:
            source.invalidate()
        sent = len(source.collectives.log)
        source.gather(last)
        source.get(last)
        source.release(last)
        if len(source.collectives.log) - sent != expected:
            note(f"rank {r}: gather({last}) {when} sent {len(source.collectives.log) - sent} all-gathers, "
                 f"not {expected}: your ShardedWeights.gather " + (
                     "all-gathers again when the optimizer may have changed the shards (the version)"
                     if expected else "reuses a buffer that holds the layer at the current version"))
    piece += 1
    # The microbatches of this rank's rows, each divided by the whole batch's real tokens (train_step's part).
    tokens, targets = random_batch(load_text(), d * 4, CFG.max_seq_len, torch.Generator().manual_seed(0))
    n_tokens, mine = m06.real_tokens(targets), slice(r * 4, (r + 1) * 4)
    for tok, tgt in m06.microbatches(tokens[mine], targets[mine], n_microbatches):
        model.accumulate(tok, tgt, n_tokens)
    whole_loss, whole = single.forward_backward(tokens, targets, n_tokens)
    whole_loss = whole_loss.item()
    _, rows = single.forward_backward(tokens[mine], targets[mine], n_tokens)
    wrong = {layer: how for layer, block in enumerate(whole.blocks)
             if (how := off(model.grad_shards[layer], padded_shard(flat(block), d, r))) is not None}
    if wrong:
        first, how = next(iter(wrong.items()))
        factor = common_factor([(model.grad_shards[layer], padded_shard(flat(block), d, r))
                                for layer, block in enumerate(whole.blocks)])
        # Each microbatch's slice (rank r's of the sum over ranks): two mistakes leave a shard that is made of them
        per_rank = tokens.shape[0] // d // n_microbatches
        slices = []
        for i in range(n_microbatches):
            rows_i = [q * 4 + i * per_rank + j for q in range(d) for j in range(per_rank)]
            _, part = single.forward_backward(tokens[rows_i], targets[rows_i], n_tokens)
            slices.append([padded_shard(flat(block), d, r) for block in part.blocks])
        want_of = {layer: padded_shard(flat(block), d, r) for layer, block in enumerate(whole.blocks)}
        overwritten = all(off(model.grad_shards[layer], 2 * slices[-1][layer]) is None for layer in wrong)
        added_twice = list(wrong) == [0] and off(model.grad_shards[0], want_of[0] + slices[0][0]) is None
        culprit = (
            f"every one is {times(factor)}, a scale: the microbatches' losses are already divided by the global "
            f"batch's tokens, so your FSDPLlama.finish_reduce_scatter adds each slice as it is received"
            if factor else
            "each is twice the last microbatch's slice, the earlier ones lost: your FSDPLlama.reduce_scatter_grad "
            "lets the reduce-scatter write over the sum the shard holds (where does the received slice land?)"
            if overwritten and n_microbatches > 1 else
            "block 0's is the sum plus microbatch 0's slice once more: your FSDPLlama.finish_reduce_scatter settled "
            "that reduce-scatter twice (once settled, what must it forget?)" if added_twice else
            "your FSDPLlama.finish_reduce_scatter adds the slice only after the work's wait()" if how == "NaN" else
            "the last reduce-scatter (layer 0's) never finished: your FSDPLlama.backward_blocks finishes the one "
            "still in flight after the loop" if list(wrong) == [0] else
            "your FSDPLlama.reduce_scatter_grad finishes the one in flight before starting the next"
            if any(how == "all zero" for layer, how in wrong.items() if layer > 0) else
            "your FSDPLlama.finish_reduce_scatter adds each microbatch's slice to the shard's gradient; your "
            "FSDPLlama.reduce_scatter_grad flattens the gradient as the weights were")
        note(f"rank {r}: the gradient shards of blocks {sorted(wrong)} after {n_microbatches} microbatches "
             f"(block {first}'s is {how}; the whole batch's gradient, rank r's slice): {culprit}")
    piece += 1
    want = padded_shard(flat_outer(whole), d, r)
    if (how := off(model.outer_grad, want)) is not None:
        mine_only = padded_shard(flat_outer(rows), d, r)
        factor = common_factor([(model.outer_grad, want)])
        note(f"rank {r}: the outer weights' gradient shard after {n_microbatches} microbatches is {how} from the "
             f"whole batch's (rank r's slice)" + (
                 f": it is {times(factor)}, a scale: each microbatch's loss is already divided by the global batch's "
                 f"tokens, so your FSDPLlama.reduce_scatter_outer adds the sum over ranks as it is" if factor else
                 ": it is this rank's rows' alone: your FSDPLlama.reduce_scatter_outer sums them over the data group"
                 if off(model.outer_grad, mine_only) is None else
                 ": your FSDPLlama.reduce_scatter_outer adds each microbatch's slice of the sum over ranks, the "
                 "gradients laid out as the weights are (self.outer_layout)"))
    piece += 1
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    version = source.version
    model.optimizer_step(optimizer)
    if source.version == version:
        note(f"rank {r}: FSDPLlama.optimizer_step (given) did not invalidate() the weight source after the "
             f"step: the blocks left in its buffers are the old weights")
    piece += 1
    # The single process's step on the same gradients, then the blocks as gather() now hands them out.
    for p, g in zip(single.parameters(), whole.tensors()):
        p.grad = g
    torch.optim.AdamW(single.parameters(), lr=LR, weight_decay=0.0).step()
    for layer, block in enumerate(single.blocks):
        source.gather(layer)
        got = flat(source.get(layer))
        source.release(layer)
        if (how := off(got, flat(block))) is not None:
            note(f"rank {r}: block {layer} gathered after the step is {how} from the single process's: "
                 + ("your ShardedWeights.gather sent nothing: it reused a copy from before the step"
                    if off(got, flat(m06.LlamaModel(CFG, 0, f64).blocks[layer])) is None else
                    "FSDPLlama.optimizer_step (given) gives the optimizer each gradient as .grad of its "
                    "parameter (parameters() and grads() in one order)"))
            break
    model.gather_outer()
    if (how := off(flat_outer(model), flat_outer(single))) is not None:
        note(f"rank {r}: the outer weights gathered after the step are {how} from the single process's: "
             f"FSDPLlama.optimizer_step (given) gives the optimizer each gradient as .grad of its parameter (outer_shard's "
             f"is outer_grad)")
    model.embedding = model.final_norm = model.lm_head = None
    piece += 1
    # Last, train_step itself on a fresh model, twice on the same batch with lr 0 (the weights stay): after
    # each step its gradients are those of the whole batch.
    fresh = m07.FSDPLlama(CFG, data_group(), dtype=f64)
    no_update = torch.optim.SGD(fresh.parameters(), lr=0.0)

    def fresh_pairs():  # (got, want) for each of its gradients
        return [*zip(fresh.grad_shards, (padded_shard(flat(b), d, r) for b in whole.blocks)),
                (fresh.outer_grad, padded_shard(flat_outer(whole), d, r))]
    loss = fresh.train_step(tokens, targets, n_microbatches, no_update)
    pairs = fresh_pairs()
    first_step_right = all(off(got, want) is None for got, want in pairs)
    if not first_step_right:
        factor = common_factor(pairs)
        note(f"rank {r}: after your FSDPLlama.train_step the gradients differ from the whole batch's" + (
            f": every one is {times(factor)}, so each microbatch's loss must be divided by the real tokens "
            f"of the whole global batch" if factor else
            ": it takes rows [i_d B/d, (i_d + 1) B/d), zeroes the accumulators and accumulates every microbatch"))
    if abs(loss - whole_loss) > TOLERANCE:
        note(f"rank {r}: your FSDPLlama.train_step returned the loss {loss}, not the whole batch's mean "
             f"{whole_loss}: the sum over the group of its microbatches' parts")
    fresh.train_step(tokens, targets, n_microbatches, no_update)
    if first_step_right and any(off(got, want) is not None for got, want in fresh_pairs()):
        note(f"rank {r}: the gradients after a second train_step on the same batch and weights are not the whole "
             f"batch's, as they were after the first: accumulators not zeroed between steps: your "
             f"FSDPLlama.train_step zeroes every tensor of grads() before its microbatches")
    return found


@pytest.mark.exercises(*TRAINING)
def test_one_step_piece_by_piece_matches_the_single_process():
    # 3 ranks (the shards need padding), 2 microbatches (the gradients must add up). Each piece's result
    # is compared with the single process as soon as it exists, so the message names the piece.
    per_rank = run_ranks(_one_step_piece_by_piece, 3, 2, timeout=60)
    # The earliest piece's differences first (sorted is stable: ranks in order within a piece).
    found = [line for _, line in sorted((f for lines in per_rank for f in lines), key=lambda f: f[0])]
    assert not found, found[0] + (f" ({len(found) - 1} more differences after it)" if found[1:] else "")


# --- training on 2 and 4 ranks ----------------------------------------------------------------

def _train(steps, n_microbatches, batch):
    model, losses = m06.fit(m07.FSDPLlama(CFG, data_group(), dtype=f64), steps, batch, LR,
                            n_microbatches=n_microbatches)
    return losses, model.shards, model.outer_shard


def beyond_tolerance(what: str, worst: float, culprit: str) -> str:
    """The message for a training gap: a gap of 1e-8..1e-5 is a constant factor on every gradient (AdamW
    barely notices one), which only the normaliser of your train_step produces; larger ones name `culprit`."""
    hint = (" (a gap of 1e-8..1e-5 is not rounding: every gradient is off by the same factor; does your "
            "FSDPLlama.train_step divide each microbatch's loss by the real tokens of the whole global batch?)"
            if worst < 1e-5 else f" ({culprit})")
    return f"{what} differs by {worst:.2e} from single-process training, tolerance {TOLERANCE:g}{hint}"


@pytest.mark.exercises(*TRAINING)
@pytest.mark.parametrize("world_size, n_microbatches, batch", [(2, 1, 8), (2, 2, 8), (3, 1, 12), (4, 1, 8), (4, 2, 8)])
def test_training_matches_single_process_training(world_size, n_microbatches, batch):
    results = run_ranks(_train, world_size, STEPS, n_microbatches, batch, timeout=60)
    reference_model, reference_losses = single_process_training(STEPS, batch)
    # The weights first: each names the TODOs that feed it; the loss depends on every one of them.
    for layer, block in enumerate(reference_model.blocks):
        gathered = torch.cat([shards[layer] for _, shards, _ in results])
        n = flat(block).numel()
        worst = (gathered[:n] - flat(block)).abs().max().item()
        assert worst <= TOLERANCE, beyond_tolerance(
            f"block {layer} after {STEPS} steps", worst, "the blocks' gradients come from your "
            "FSDPLlama.reduce_scatter_grad and FSDPLlama.finish_reduce_scatter, the stale copies from your "
            "ShardedWeights.gather")
        assert not gathered[n:].any(), f"block {layer}: the padding must stay zero"
    outer = torch.cat([outer_shard for _, _, outer_shard in results])
    for name, got in outer_pieces(outer).items():
        worst = (got - getattr(reference_model, name)).abs().max().item()
        assert worst <= TOLERANCE, beyond_tolerance(
            f"the {name} (its ranks' shards end to end)", worst, "the outer weights' gradients are summed over ranks "
            "into each shard by your FSDPLlama.reduce_scatter_outer, from the weights your FSDPLlama.gather_outer "
            "gathered")
    assert not outer[CFG.vocab_size * CFG.dim * 2 + CFG.dim:].any(), "the outer weights' padding must stay zero"
    for rank, (losses, _, _) in enumerate(results):
        worst = max(abs(a - b) for a, b in zip(losses, reference_losses))
        assert len(losses) == STEPS and worst <= TOLERANCE, \
            beyond_tolerance(f"rank {rank}: the loss ({losses} vs {reference_losses})", worst,
                             "the weights after training match, so look at what your FSDPLlama.train_step returns: "
                             "the sum over the group of its microbatches' parts")


def _gather_every_block():
    model = m07.FSDPLlama(CFG, data_group(), dtype=f64)
    blocks = []
    for layer in range(CFG.n_layers):
        model.weights.gather(layer)
        blocks.append(flat(model.weights.get(layer)).clone())
        model.weights.release(layer)
    return blocks


@pytest.mark.exercises(*GATHERING)
def test_gathered_weights_are_the_single_process_weights_bit_for_bit():
    expected = [flat(b) for b in m06.LlamaModel(CFG, 0, f64).blocks]
    for rank, blocks in enumerate(run_ranks(_gather_every_block, 2, timeout=30)):
        for layer, (got, want) in enumerate(zip(blocks, expected)):
            assert torch.equal(got, want), f"rank {rank}, block {layer}: gathered weights differ from the model's"


# --- the order of calls, the buffers and the collectives --------------------------------------

class RecordingCollectives(Collectives):
    """Collectives that also write each call into a shared event list, and keep the reduce-scatters'
    works to check, at the end of each step, that each was waited for and at most one was in flight.

    Results arrive late, as they may on a GPU: an all-gather's or reduce-scatter's output holds NaN
    until its work is waited for, so code that reads it before wait() computes with NaN."""

    def __init__(self, events):
        super().__init__()
        self.events, self.in_flight, self.most_in_flight = events, [], 0

    def all_gather(self, output, shard, label="", async_op=False):
        layer = layer_of(label)
        self.events.append(("all_gather", layer))
        if layer == "outer":  # needed at once: blocking, or waited for at once (the wait not logged)
            return self.outer(super().all_gather, output, shard, label, async_op)
        assert async_op, (f"{label}: a blocking all-gather; gather() must start it with async_op=True and "
                          f"return, so the next block's gather overlaps this block's compute")
        received = torch.empty_like(output)
        return DeliveredOnWait(super().all_gather(received, shard, label, async_op), received, output,
                               self.events, "all_gather", layer)

    @staticmethod
    def outer(collective, output, data, label, async_op):
        """The outer weights' collective: its result in `output` at once if blocking, else on wait()."""
        received = torch.empty_like(output)
        work = collective(received, data, label, async_op)
        if not async_op:
            output.copy_(received)
            return None
        return DeliveredOnWait(work, received, output, None, "", "outer")

    def reduce_scatter(self, shard, full, label="", async_op=False):
        layer = layer_of(label)
        self.events.append(("reduce_scatter", layer))
        if layer == "outer":
            return self.outer(super().reduce_scatter, shard, full, label, async_op)
        assert async_op, (f"{label}: a blocking reduce-scatter; start it with async_op=True so it travels "
                          f"while the next block's backward computes, and wait for it later")
        received = torch.empty_like(shard)
        work = DeliveredOnWait(super().reduce_scatter(received, full, label, async_op), received, shard,
                               self.events, "reduce_scatter", layer)
        self.in_flight.append(work)
        self.most_in_flight = max(self.most_in_flight, len(self.never_waited()))
        return work

    def never_waited(self) -> list[int]:
        return [w.layer for w in self.in_flight if not w.waited]

    def check_step(self):
        """After a step: every reduce-scatter waited for, and never two in flight at once."""
        lost = self.never_waited()
        assert not lost, (f"the reduce-scatter of block {lost[0]} was never waited for: its sum over ranks may not "
                          f"have arrived when it was added to the gradient shard (wait for the work first)")
        assert self.most_in_flight <= 1, (
            f"{self.most_in_flight} gradient reduce-scatters were in flight at once: each keeps a whole block's "
            f"gradient alive until it is waited for, so leaving them in flight keeps up to one full gradient per "
            f"block, what sharding set out to avoid. Finish the one in flight before starting the next: at most "
            f"one in flight, at most two whole gradients alive")


class DeliveredOnWait:
    """A collective's work whose result reaches `output` only in wait(), which is written into the
    event list, if there is one (once: later waits are no-ops). Until then `output` holds NaN."""

    def __init__(self, work, received, output, events, op, layer):
        self.work, self.received, self.output = work, received, output
        self.events, self.op, self.layer, self.waited = events, op, layer, False
        output.fill_(float("nan"))

    def wait(self):
        if not self.waited:
            if self.events is not None:
                self.events.append((f"wait {self.op}", self.layer))
            self.waited = True
            self.work.wait()
            self.output.copy_(self.received)
        return True


def layer_of(label: str) -> int | str:
    """The layer a collective's label names ("block 3" -> 3), as the hints ask; "outer" for the outer weights'."""
    if label == "outer":
        return label
    words = label.split()
    assert words and words[-1].isdigit(), \
        f'a block\'s collective needs label=f"block {{layer}}", the outer weights\' label="outer"; got label={label!r}'
    return int(words[-1])


def _record_steps(steps, n_microbatches):
    events = []
    collectives = RecordingCollectives(events)
    model = m07.FSDPLlama(CFG, data_group(collectives), dtype=f64)
    source, storages, handed_out = model.weights, [{}], {}  # storages: one dict per step
    for name in ("gather", "get", "release"):
        method = getattr(source, name)

        def recorded(layer, method=method, name=name):
            events.append((name, layer))
            result = method(layer)
            if name == "get":  # which memory holds the whole block we were handed
                storage = result.wq.untyped_storage()
                storages[-1][storage.data_ptr()] = storage.nbytes()
                handed_out[id(result)] = layer
            return result
        setattr(source, name, recorded)
    backward_stores = []  # (layer, store) of every block backward so far

    def check_cleared():  # a store whose backward ran must be empty (its activations freed)
        kept = [layer for layer, store in backward_stores if store.tensors]
        if kept:
            events.append(("store not cleared", kept[0]))
            backward_stores.clear()
    for name in ("forward", "backward"):  # the block's compute, in the same log
        def computed(w, *args, run=getattr(model.block, name), name=name):
            events.append((name, handed_out.get(id(w))))
            if name == "backward":
                check_cleared()
                backward_stores.append((handed_out.get(id(w)), args[1]))
            return run(w, *args)
        setattr(model.block, name, computed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    data, generator = load_text(), torch.Generator().manual_seed(0)
    losses, whole_between_steps = [], []
    for _ in range(steps):
        tokens, targets = random_batch(data, BATCH, CFG.max_seq_len, generator)
        losses.append(model.train_step(tokens, targets, n_microbatches, optimizer))
        check_cleared()
        collectives.check_step()
        events.append(("step", None))
        storages.append({})
        whole_between_steps.append(sum(b.flat is not None for b in source.buffers) + (model.embedding is not None))
    # Bytes of the memory the shards live in: a shard that is a view of a whole group keeps it alive.
    shard_storage = (sum(t.untyped_storage().nbytes() for t in model.shards),
                     model.outer_shard.untyped_storage().nbytes(), model.outer_layout.shard_numel * 8)
    return (events, storages[:-1], collectives.log, model.layout.padded_numel, model.blocks, shard_storage, losses,
            whole_between_steps)


def culprit_of(differing: list[tuple], previous: tuple | None) -> str:
    """Which of the learner's functions issues the events where the recorded order first differs
    (`differing`: the recorded event there, then the expected one; `previous`: the recorded one before)."""
    kinds = {kind for kind, _ in differing}
    if previous and previous[0] == "reduce_scatter" and differing[0] == ("wait reduce_scatter", previous[1]):
        return ("a reduce-scatter waited for right after its own start: your FSDPLlama.reduce_scatter_grad must "
                "start it (async_op=True) and return without waiting, so it travels while the next block's "
                "backward computes; the next call finishes it")
    outer = [kind for kind, layer in differing if layer == "outer"]
    if outer:
        return (("the outer weights' all-gather: one before each microbatch's forward, from your FSDPLlama.gather_outer"
                 if outer[0] == "all_gather" else "the outer weights' gradients: one reduce-scatter after each "
                 "microbatch's backward, nothing else, from your FSDPLlama.reduce_scatter_outer"))
    if kinds & {"wait all_gather"}:
        return "look at your ShardedWeights.get (it waits) and ShardedWeights.gather (it must not)"
    if differing[0][0] == "all_gather":
        return ("an all-gather of a block its buffer may still hold, current: your ShardedWeights.gather must reuse "
                "it")
    if kinds & {"all_gather"}:
        return ("an all-gather skipped: your ShardedWeights.gather reused a buffer whose contents are not this "
                "layer's current weights")
    if kinds & {"reduce_scatter", "wait reduce_scatter"}:
        return ("the gradients' reduce-scatters: your FSDPLlama.backward_blocks starts one after each release, "
                "FSDPLlama.reduce_scatter_grad and FSDPLlama.finish_reduce_scatter wait")
    if kinds & {"step"}:
        return "the step's end: your FSDPLlama.train_step"
    return "the order of the backward loop: your FSDPLlama.backward_blocks"


def expected_events(layers, n_microbatches, steps):
    """The protocol's calls written out, with an all-gather after each gather() unless the layer is
    still in its buffer (buffer l % 2) since this optimizer step began, and its wait in get(); around
    each microbatch the outer weights' all-gather and reduce-scatter."""
    events = []
    for _ in range(steps):
        resident, in_flight = {}, set()  # buffer -> layer it holds, forgotten at every optimizer step

        def gather(layer):
            events.append(("gather", layer))
            if resident.get(layer % 2) != layer:
                events.append(("all_gather", layer))
                resident[layer % 2] = layer
                in_flight.add(layer)

        def get(layer):  # waits for the all-gather that gather(layer) started, if it started one
            events.append(("get", layer))
            if layer in in_flight:
                events.append(("wait all_gather", layer))
                in_flight.discard(layer)
        for _ in range(n_microbatches):
            events.append(("all_gather", "outer"))
            gather(0)
            for layer in range(layers):
                if layer + 1 < layers:
                    gather(layer + 1)
                get(layer)
                events += [("forward", layer), ("release", layer)]
            gather(layers - 1)
            for layer in reversed(range(layers)):
                if layer > 0:
                    gather(layer - 1)  # the next all-gather goes out before this layer's reduce-scatter
                get(layer)
                events += [("backward", layer), ("release", layer)]
                if layer < layers - 1:  # at most one reduce-scatter in flight: the previous one ends first
                    events.append(("wait reduce_scatter", layer + 1))
                events.append(("reduce_scatter", layer))
            events.append(("wait reduce_scatter", 0))  # none left in flight when the backward returns
            events.append(("reduce_scatter", "outer"))
        events.append(("step", None))
    return events


@pytest.mark.exercises(*ORDER)
@pytest.mark.parametrize("n_microbatches", [1, 2])
def test_calls_and_collectives_come_in_the_expected_order(n_microbatches):
    results = run_ranks(_record_steps, 2, 2, n_microbatches, timeout=30)
    events = results[0][0]
    kept = next((layer for event, layer in events if event == "store not cleared"), None)
    assert kept is None, \
        (f"your FSDPLlama.backward_blocks: layer {kept}'s activation store still held its tensors after its backward (seen at the next block's "
         f"backward or the step's end): clear each layer's store right after its block's backward, as module "
         f"06's loop does, so the activations of the layers already done are freed during the backward")
    expected = expected_events(CFG.n_layers, n_microbatches, 2)
    first = next((i for i, (a, b) in enumerate(zip(events, expected)) if a != b), min(len(events), len(expected)))
    waits = {event for event in events[first:first + 4] + expected[first:first + 4] if event[0] == "wait all_gather"}
    previous = events[first - 1] if first else None
    hint = (" (get(l) waits for the all-gather gather(l) started, if any; gather() itself must not wait, or "
            "the transfer of the next block no longer overlaps this block's compute)") if waits else ""
    assert events == expected, (f"first difference at event {first}: got {events[first:first + 4]}, "
                                f"expected {expected[first:first + 4]}{hint}; "
                                f"{culprit_of(events[first:first + 1] + expected[first:first + 1], previous)}")
    losses = [loss for result in results for loss in result[-1]]
    assert all(loss == loss for loss in losses), \
        (f"losses {losses}: NaN, read from a collective's output before its wait() (here a result arrives "
         f"only when its work is waited for, as it may on a GPU): your ShardedWeights.get must wait for the "
         f"all-gather before handing out the block, your FSDPLlama.finish_reduce_scatter for the reduce-scatter "
         f"before adding its slice to the gradient shard")


@pytest.mark.exercises(*MEMORY)
def test_at_most_two_whole_blocks_exist_and_none_between_steps():
    _, storages, _, padded, blocks, shard_bytes, _, whole = run_ranks(_record_steps, 2, 2, 2, timeout=30)[0]
    for step, handed_out in enumerate(storages):
        assert len(handed_out) <= 2, (f"step {step}: your ShardedWeights.get handed out blocks in {len(handed_out)} "
                                      f"different buffers; double buffering uses 2")
        assert set(handed_out.values()) == {padded * 8}, \
            (f"your ShardedWeights.get: each buffer must be exactly one padded block ({padded * 8} bytes), got "
             f"{sorted(set(handed_out.values()))}")
    blocks_bytes, outer_bytes, outer_shard = shard_bytes
    assert not blocks and blocks_bytes == CFG.n_layers * padded // 2 * 8, \
        (f"your FSDPLlama.__init__: the model must keep only its shards: {len(blocks)} full blocks, and its shards' "
         f"memory is {blocks_bytes} bytes, not {CFG.n_layers * padded // 2 * 8} (is each shard a clone, not a view of "
         f"a full block?)")
    assert outer_bytes == outer_shard, \
        (f"your FSDPLlama.__init__: the memory behind outer_shard is {outer_bytes} bytes, not one shard's "
         f"{outer_shard} (a clone, not a view of the whole outer weights)")
    assert whole == [0, 0], (f"whole copies (gather buffers, outer weights) still allocated after each step: {whole}; "
                             f"between steps a rank keeps only its shards")


# Counted by hand for CFG, in float64 (8 bytes). A block: wq, wo 32x32; wk, wv 16x32; w_gate, w_up
# 48x32; w_down 32x48; ln1, ln2 32 each: 2 * 1024 + 2 * 512 + 3 * 1536 + 64 = 7,744 parameters, so
# one shard (the payload of a block's collective) is 7,744 / N parameters: 3,872 on 2 ranks, 1,936 on 4.
# All-gathers per step: each of the 4 blocks forward and backward in every micro-step, less the 2
# blocks still in the double buffer at each turn between passes (2 * n_microbatches - 1 turns a step):
# 2 * 4 * 1 - 2 * 1 = 6 for one micro-step, 2 * 4 * 2 - 2 * 3 = 10 for two. Reduce-scatters: one a
# block and micro-step, 4 and 8. The outer weights: 2 * 257 * 32 + 32 = 16,480 parameters, shards of
# 8,240 on 2 ranks and 4,120 on 4, one all-gather and one reduce-scatter a micro-step.
@pytest.mark.exercises(*COUNTS)
@pytest.mark.parametrize("world_size, n_microbatches, all_gathers, reduce_scatters, payload_bytes, outer_bytes", [
    (2, 1, 6, 4, 3872 * 8, 8240 * 8), (4, 2, 10, 8, 1936 * 8, 4120 * 8)])
def test_collectives_per_step_are_the_hand_counted_ones(world_size, n_microbatches, all_gathers, reduce_scatters,
                                                         payload_bytes, outer_bytes):
    steps = 2
    log = run_ranks(_record_steps, world_size, steps, n_microbatches, timeout=30)[0][2]
    blocks = [c for c in log if c.label != "outer"]
    outer = {op: sum(c.op == op for c in log if c.label == "outer") / steps for op in ("all_gather", "reduce_scatter")}
    counts = {op: sum(c.op == op for c in blocks) / steps for op in ("all_gather", "reduce_scatter", "all_reduce")}
    assert counts["all_gather"] == all_gathers, \
        (f"the blocks' collectives per step: {counts}; expected {all_gathers} all-gathers: your ShardedWeights.gather "
         f"sends one unless the layer is in its buffer and current")
    assert counts["reduce_scatter"] == reduce_scatters, \
        (f"the blocks' collectives per step: {counts}; expected {reduce_scatters} reduce-scatters, one a block and "
         f"microbatch: your FSDPLlama.backward_blocks and FSDPLlama.reduce_scatter_grad")
    assert counts["all_reduce"] == 0 and outer == {"all_gather": n_microbatches, "reduce_scatter": n_microbatches}, \
        (f"the outer weights' collectives per step: {outer}, and {counts['all_reduce']} all-reduces; expected one "
         f"all-gather (your FSDPLlama.gather_outer) and one reduce-scatter (your FSDPLlama.reduce_scatter_outer) a "
         f"microbatch, nothing else")
    sizes = {c.payload_bytes for c in blocks}
    assert sizes == {payload_bytes}, (f"payloads {sorted(sizes)} bytes; expected one shard, {payload_bytes} bytes "
                                      f"(your FSDPLlama.__init__'s shards, your FlatLayout.__init__'s sizes)")
    outer_sizes = {c.payload_bytes for c in log if c.label == "outer"}
    assert outer_sizes == {outer_bytes}, (f"the outer weights' payloads {sorted(outer_sizes)} bytes; expected one "
                                          f"shard, {outer_bytes} bytes (your FSDPLlama.__init__'s outer_shard)")


# --- misuse fails at once ---------------------------------------------------------------------

def _misuse(mistake):
    source = m07.FSDPLlama(CFG, data_group()).weights
    if mistake == "forgotten release":
        source.gather(0), source.get(0), source.gather(1), source.get(1)
        source.gather(2)  # buffer 0 still holds layer 0, in use
    elif mistake == "get without gather":
        source.gather(0), source.get(0), source.release(0)
        source.get(1)
    elif mistake == "release of the wrong block":
        source.gather(0), source.get(0)
        source.release(1)


@pytest.mark.exercises(*MISUSE)
@pytest.mark.parametrize("mistake, message", [("forgotten release", "release(0)"),
                                              ("get without gather", "get(1) without a gather(1)"),
                                              ("release of the wrong block", "release(1) but layer 1 is not in use")],
                         ids=["a-busy-buffer", "an-unrequested-block", "a-block-not-in-use"])
def test_misuse_raises_a_clear_error_instead_of_hanging(mistake, message):
    began = time.monotonic()
    with pytest.raises(RankFailed) as failure:
        run_ranks(_misuse, 2, mistake, timeout=20)
    first_line = str(failure.value).splitlines()[0]
    assert "RuntimeError" in first_line and message in first_line, f"{mistake}: expected an error naming {message!r}, got: {first_line}"
    assert time.monotonic() - began < 10, "the error took too long: a rank waited for its peer"


# --- PyTorch's FSDP2 on the nn.Module reference -----------------------------------------------

def mean_over_ranks(value: float) -> float:
    total = torch.tensor([value], dtype=f64)
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def _train_fsdp2(steps):
    root = fsdp2_llama(m06.LlamaModel(CFG, 0, f64))  # fully_shard per block and at the root
    optimizer = torch.optim.AdamW(root.parameters(), lr=LR, weight_decay=0.0)
    data, generator = load_text(), torch.Generator().manual_seed(0)
    rank, rows = dist.get_rank(), BATCH // dist.get_world_size()
    losses = []
    for _ in range(steps):
        tokens, targets = random_batch(data, BATCH, CFG.max_seq_len, generator)
        loss = root(tokens[rank * rows:(rank + 1) * rows], targets[rank * rows:(rank + 1) * rows])
        loss.backward()  # FSDP2 averages the gradient over ranks
        optimizer.step()
        optimizer.zero_grad()
        losses.append(mean_over_ranks(loss.item()))  # each rank's loss is the mean of its rows
    ours, _ = _train(steps, 1, BATCH)[:2]
    return losses, ours


@pytest.mark.exercises(*TRAINING)
def test_losses_match_pytorch_fsdp2():
    fsdp2, ours = run_ranks(_train_fsdp2, 2, STEPS, timeout=60)[0]
    worst = max(abs(a - b) for a, b in zip(fsdp2, ours))
    # FSDP2 runs the nn.Module reference (PyTorch's attention kernel, RoPE as complex numbers): the
    # same maths, possibly rounded differently. Measured on torch 2.13 CPU: losses within 1.8e-15 over 4
    # steps (the same before and after issue 20); we allow 1e-10 rather than demand what another release
    # need not keep.
    assert worst <= 1e-10, f"FSDP2 losses {fsdp2}, ours {ours}: max difference {worst:.2e}"


def _first_step_gradients_ours_and_fsdp2():
    """On this rank: the first step's gradients, whole, of our FSDP and of FSDP2, by name."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    tokens, targets = random_batch(load_text(), BATCH, CFG.max_seq_len, torch.Generator().manual_seed(0))
    rows = BATCH // world_size
    mine = slice(rank * rows, (rank + 1) * rows)
    model = m07.FSDPLlama(CFG, data_group(), dtype=f64)
    model.train_step(tokens, targets, 1, torch.optim.SGD(model.parameters(), lr=0.0))  # grads, no update
    root = fsdp2_llama(m06.LlamaModel(CFG, 0, f64))
    root(tokens[mine], targets[mine]).backward()
    named = []
    for layer, (shard, block) in enumerate(zip(model.grad_shards, root.llama.blocks)):
        whole = torch.empty(model.layout.padded_numel, dtype=f64)
        Collectives().all_gather(whole, shard)
        ours = model.layout.views(whole)
        named += [(f"block {layer} d{name}", getattr(ours, name), grad.full_tensor())
                  for name, grad in block.grads().items()]
    whole = torch.empty(model.outer_layout.padded_numel, dtype=f64)
    Collectives().all_gather(whole, model.outer_grad)
    for name, ours in outer_pieces(whole).items():
        named.append((f"d{name}", ours, getattr(root.llama, name).grad.full_tensor()))
    return named


@pytest.mark.exercises(*TRAINING)
def test_first_step_gradients_match_pytorch_fsdp2():
    # Every gradient after the first step, ours (reduce-scattered shards, gathered whole here) against
    # FSDP2's (sharded DTensors, made whole), float64: the same maths summed in another order, and
    # FSDP2 runs PyTorch's attention kernel; measured within 1e-15 relative, we allow 1e-12.
    named = run_ranks(_first_step_gradients_ours_and_fsdp2, 2, timeout=60)[0]
    assert_all_close(named, rtol=1e-12, atol=1e-14)


def _gradients_of_one_forward_backward():
    model = m07.FSDPLlama(CFG, data_group(), dtype=f64)
    tokens, targets = random_batch(load_text(), 2, CFG.max_seq_len, torch.Generator().manual_seed(dist.get_rank()))
    model.gather_outer()  # module 06's forward_backward reads the outer weights whole
    _, grads = model.forward_backward(tokens, targets)
    tensors = grads.tensors()
    return len(tensors), [t is s for t, s in zip(tensors[1:1 + CFG.n_layers], model.grad_shards)]


@pytest.mark.exercises("FSDPLlama.backward_blocks", "FSDPLlama.finish_reduce_scatter",
                        "FSDPLlama.reduce_scatter_grad", "FSDPLlama.gather_outer", *GATHERING)
def test_forward_backward_hands_back_the_gradient_shards():
    # Module 06's contract for later callers: forward_backward returns LlamaGrads, whose blocks are
    # here this rank's gradient shards (no whole per-layer gradient outlives the backward).
    count, are_shards = run_ranks(_gradients_of_one_forward_backward, 2, timeout=30)[0]
    assert count == CFG.n_layers + 3 and all(are_shards), \
        (f"LlamaGrads.tensors() gave {count} tensors, its blocks being the gradient shards: {are_shards}; "
         f"backward_blocks must return (dx, self.grad_shards)")
