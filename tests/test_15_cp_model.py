"""Module 15 model: module 06's Llama trained with context parallelism against module 06's single
process (the trusted reference): RoPE at each rank's positions (given code); on a d x c = 2 x 2 mesh,
one step on a batch padded unevenly (IGNORE_INDEX targets: every rank's microbatches hold different
numbers of real tokens) gives the loss and every gradient of one process on the same global batch, and
of a pure data-parallel run (d = 4); one bf16 step sums its gradients in float32; c = 2 for each
variant, trained by module 06's `fit`, reproduces the single-process loss curve.

Tolerance. float64 throughout. The ranks add the same terms in another order (attention merged over
blocks, gradients summed over d c ranks): measured within 8.9e-16 on the losses of 3 steps and
1.4e-15 relative on one step's gradients (torch 2.13 CPU); we allow 1e-12. A loss normalised by each
rank's own token count is d c = 4 times too large, one averaged over the pieces off by 1.6e-2 here; a
zig-zag rank rotated by positions 0..T/c - 1 changes the first loss already by ~1e-3.
bf16: module 06's attention and matmuls round to bf16, so one bf16 step is a few percent of the
largest value from float64 (one process in bf16: measured up to 3.4e-2; the 2 x 2 step up to 1.2e-2
more, its pieces rounded once more before the float32 sums): we allow one process's bf16 error plus
2^-5 per gradient, and 1e-3 on the loss (float32 sums: measured 2.3e-5). What the contract says of the
sums' dtype is read off the log: 4 bytes a value.
"""
import functools

import pytest
import torch
import torch.distributed as dist

from course.impl import load, reference
from course.launch import run_ranks
from course.mesh import Group, init_mesh
from course.collectives import Collectives

cp_model = load("m15_cp_model")
layout = load("m15_layout")
m06 = reference("m06_llama_model")  # the single-process model: trusted code, not graded here
m06_ops = reference("m06_llama_ops")
LlamaConfig = reference("m06_llama_block").LlamaConfig

f64 = torch.float64
CFG = LlamaConfig(dim=16, n_heads=4, n_kv_heads=2, head_dim=4, ffn_dim=32, n_layers=2, max_seq_len=16)
VARIANTS = ("ring", "zigzag", "allgather", "ulysses")
STEPS, BATCH, LR = 3, 4, 3e-3


@pytest.mark.given
@pytest.mark.parametrize("kind", ["contiguous", "zigzag"])
def test_rope_tables_rotate_each_token_by_its_position_in_the_whole_sequence(kind):
    # A context group of c = 4 seen from each member (no messages are sent to build the tables).
    c, n = 4, 4
    cos, sin = m06_ops.rope_tables(c * n, CFG.head_dim, CFG.rope_theta, f64)
    for index in range(c):
        group = Group("c", index, tuple(range(c)), Collectives(None, "c", tuple(range(c))))
        block = cp_model.CPBlock(CFG, group, kind, attention=None)
        got_cos, got_sin = block.rope(n, f64, "cpu")
        positions = layout.SequenceLayout(kind, c * n, c).positions(index)
        assert torch.equal(got_cos, cos[positions]) and torch.equal(got_sin, sin[positions]), \
            (f"context rank {index} of {c}, {kind}: RoPE tables are not those of its positions {positions.tolist()} "
             f"in the whole sequence")


class KeepGrads:
    """An optimizer that only keeps the gradients it was given (the step's result, before any update)."""

    def __init__(self, params):
        self.params = params

    def step(self):
        self.grads = [p.grad.clone() for p in self.params]


def _one_step(sizes, tokens, targets):
    mesh = init_mesh(sizes)
    model = cp_model.CPLlama(CFG, mesh, "zigzag", seed=5, dtype=f64, chunk=3)
    optimizer = KeepGrads(model.parameters())
    loss = model.train_step(tokens, targets, 2, optimizer)
    return loss, optimizer.grads


MESHES = {"d x c = 2 x 2": {"d": 2, "c": 2}, "d = 4": {"d": 4, "c": 1}}


def padded_batch():
    """A global batch of 8 sequences of 16 whose targets are about 30 % padding (IGNORE_INDEX), scattered, so
    that every rank's microbatches hold different numbers of real tokens."""
    g = torch.Generator().manual_seed(4)
    tokens, targets = (torch.randint(0, CFG.vocab_size, (8, CFG.max_seq_len), generator=g) for _ in range(2))
    targets[torch.rand(targets.shape, generator=g) < 0.3] = m06.IGNORE_INDEX
    return tokens, targets


def real_tokens_per_piece(targets, sizes):
    """The real tokens of each (data rank, context rank, microbatch) of 2, in the model's zig-zag layout."""
    d, c = sizes["d"], sizes["c"]
    rows = targets.shape[0] // d
    split = layout.SequenceLayout("zigzag", targets.shape[1], c)
    return [int((split.shard(piece, i_c) != m06.IGNORE_INDEX).sum())
            for i_d in range(d) for i_c in range(c) for piece in targets[i_d * rows:(i_d + 1) * rows].chunk(2)]


@functools.cache
def one_step():
    tokens, targets = padded_batch()
    results = {name: run_ranks(_one_step, 4, sizes, tokens, targets, timeout=60) for name, sizes in MESHES.items()}
    return tokens, targets, results


@pytest.mark.exercises("CPLlama.train_step", "RingAttention.forward", "RingAttention.backward")
def test_2x2_data_and_context_equals_one_process_and_pure_data_parallelism():
    # One step on a global batch of 8 sequences of 16 in 2 microbatches, with padding scattered so that every
    # piece (rank and microbatch) has its own number of real tokens: every rank's loss and gradients (after
    # the sum over the 4 ranks) equal the single process's mean loss over the batch's real tokens and its
    # gradients, and the pure data-parallel run's (d = 4, c = 1) on the same batch.
    tokens, targets, results = one_step()
    expected_loss, expected = m06.LlamaModel(CFG, 5, f64).forward_backward(tokens, targets)
    fields = ("ln1", "wq", "wk", "wv", "wo", "ln2", "w_gate", "w_up", "w_down")
    names = ["embedding", *(f"layer {i} {f}" for i in range(CFG.n_layers) for f in fields), "final_norm", "lm_head"]
    for mesh, per_rank in results.items():
        pieces = real_tokens_per_piece(targets, MESHES[mesh])
        assert len(set(pieces)) > 1, f"the test's batch: every piece has the same real tokens {pieces}"
        why = (f" (the pieces, rank by rank and microbatch by microbatch, hold {pieces} of the "
               f"{m06.real_tokens(targets)} real tokens: the loss is the mean over all of them)")
        for rank, (loss, grads) in enumerate(per_rank):
            ratio = loss / expected_loss.item()
            assert abs(loss - expected_loss.item()) <= 1e-12, \
                (f"{mesh}, rank {rank}: your CPLlama.train_step's loss {loss} vs one process's "
                 f"{expected_loss.item()}: {ratio:.2f} times it{why}")
            wrong = [f"{name}: {((g - e).abs().max() / e.abs().max()).item():.1e}"
                     for name, g, e in zip(names, grads, expected.tensors(), strict=True)
                     if not (g - e).abs().max() <= 1e-12 * e.abs().max()]
            assert not wrong, (f"{mesh}, rank {rank}: your CPLlama.train_step's gradients are off by more than 1e-12 "
                               f"relative (the loss is right: are they summed over every rank of d x c?): "
                               + "; ".join(wrong))
    pure_dp = results["d = 4"][0][0]
    assert abs(results["d x c = 2 x 2"][0][0] - pure_dp) <= 1e-12, "2 x 2 and pure data parallelism disagree"


def _bf16_step(tokens, targets):
    mesh = init_mesh({"d": 2, "c": 2})
    model = cp_model.CPLlama(CFG, mesh, "zigzag", seed=5, dtype=torch.bfloat16, chunk=3)
    optimizer = KeepGrads(model.parameters())
    loss = model.train_step(tokens, targets, 2, optimizer)
    return loss, optimizer.grads, [(c.label, c.payload_bytes) for c in mesh.log if c.op == "all_reduce"]


@pytest.mark.exercises("CPLlama.train_step")
def test_a_bf16_step_sums_its_gradients_in_float32():
    # The same padded batch on d x c = 2 x 2 in bf16: the gradients added up over the microbatches and summed over
    # "dc" in float32 (the all-reduce's payload, 4 bytes a value), handed to the optimizer in bf16, within one
    # process's bf16 error plus 2^-5 of float64 (module docstring).
    tokens, targets = padded_batch()
    results = run_ranks(_bf16_step, 4, tokens, targets, timeout=60)
    weights = m06.LlamaModel(CFG, 5, torch.bfloat16)
    exact = m06.LlamaModel(CFG, 5, f64)
    for t, rounded in zip(exact.parameters(), weights.parameters(), strict=True):
        t.data.copy_(rounded.double())   # the bf16 model's own weights, in float64
    expected_loss, expected = exact.forward_backward(tokens, targets)
    alone = weights.forward_backward(tokens, targets)[1].tensors()
    values = sum(p.numel() for p in exact.parameters())
    for rank, (loss, grads, sums) in enumerate(results):
        assert sums == [("gradients", 4 * values), ("loss", 4)], \
            (f"rank {rank}, bf16: your CPLlama.train_step's all-reduces (label, payload bytes) {sums}; expected the "
             f"gradients' {values} values and the loss in float32, 4 bytes each ({4 * values} and 4 bytes): added up "
             f"in compute_dtype, not in the weights' bf16")
        assert all(g.dtype == torch.bfloat16 for g in grads), \
            f"rank {rank}, bf16: your CPLlama.train_step handed the optimizer {grads[0].dtype} gradients; expected bf16"
        assert abs(loss - expected_loss.item()) <= 1e-3 * abs(expected_loss.item()), \
            f"rank {rank}, bf16: your CPLlama.train_step's loss {loss} vs one process's {expected_loss.item()} (float64)"
        for i, (g, e, one) in enumerate(zip(grads, expected.tensors(), alone, strict=True)):
            error = ((g.double() - e).abs().max() / e.abs().max()).item()
            error_alone = ((one.double() - e).abs().max() / e.abs().max()).item()
            assert error <= error_alone + 2 ** -5, \
                (f"rank {rank}, bf16: your CPLlama.train_step's gradient of parameter {i} is {error:.1e} from float64 "
                 f"(relative to its largest value), one process in bf16 {error_alone:.1e}; allowed 2^-5 more")


def _train_each_variant():
    mesh = init_mesh({"d": 1, "c": dist.get_world_size()})
    return {variant: m06.fit(cp_model.CPLlama(CFG, mesh, variant, dtype=f64, chunk=3), STEPS, BATCH, LR)[1]
            for variant in VARIANTS}


@functools.cache
def trained():
    return run_ranks(_train_each_variant, 2, timeout=90)


@pytest.mark.exercises("CPLlama.train_step", "RingAttention.forward", "RingAttention.backward",
                       "AllGatherKVAttention.forward", "AllGatherKVAttention.backward", "UlyssesAttention.forward",
                       "UlyssesAttention.backward")
@pytest.mark.parametrize("variant", VARIANTS)
def test_training_with_c_2_reproduces_the_single_process_loss_curve(variant):
    _, expected = m06.train(CFG, STEPS, BATCH, lr=LR, dtype=f64)
    for rank, per_variant in enumerate(trained()):
        losses = per_variant[variant]
        worst = max(abs(a - b) for a, b in zip(losses, expected, strict=True))
        assert worst <= 1e-12, \
            f"rank {rank}, {variant}, c=2: losses {losses} vs single-process {expected}: off by {worst:.1e}"


@pytest.mark.given
@pytest.mark.parametrize("variant, c, seq_len, d, batch, message", [
    ("striped", 2, 16, 1, None, "unknown variant 'striped'"),
    ("zigzag", 4, 12, 1, None, "not divisible by 8"),
    ("ulysses", 3, 12, 1, None, "c=3 must divide the query heads H=4"),
    ("ring", 2, 16, 3, 8, "batch of 8 sequences is not divisible by d=3"),
])
def test_what_the_model_cannot_run_is_refused_in_one_line(variant, c, seq_len, d, batch, message):
    with pytest.raises(ValueError, match=message) as refused:
        cp_model.check_cp(CFG, variant, c, seq_len, d, batch)
    assert "\n" not in str(refused.value)


@pytest.mark.given
@pytest.mark.parametrize("argv, message, not_named", [
    (["run", "15", "--nproc", "2", "--timeline", "{tmp}/missing/x"], "--timeline {tmp}/missing/x: there is no folder",
     None),
    (["bench", "15", "--tokens", "12"], "--tokens 12 must be divisible by 8", "--error-tokens"),
    (["bench", "15", "--error-tokens", "24"], "--error-tokens 24 must be divisible by 16", "--tokens"),
], ids=["timeline-folder", "tokens", "error-tokens"])
def test_bad_run_and_bench_options_are_refused_in_one_line(argv, message, not_named, tmp_path, capsys):
    import main
    with pytest.raises(SystemExit) as exit_:
        main.main([arg.format(tmp=tmp_path) for arg in argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message.format(tmp=tmp_path) in err and "Traceback" not in err, err
    assert not_named is None or f" {not_named} " not in err, f"the message names an option that is fine: {err}"
    assert not (tmp_path / "missing").exists(), "the run created the missing folder instead of refusing it"
