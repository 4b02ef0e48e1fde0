"""Module 12 block: module 06's block split over t ranks (heads, FFN width, and the sequence with
sequence parallelism) against module 06's single-process block (the trusted reference): output,
input gradient and every weight gradient; what the store keeps; the collectives one block issues.

Tolerance, as (largest |difference|) / (largest |expected|) of each tensor. float64: the ranks sum
partial products in another order than one process does: measured up to 1.0e-15 (dwk, t = 4,
torch 2.13 CPU); we allow 1e-12. float32: the same reorderings at float32's unit roundoff 6e-8,
through the block's chain of sums: measured up to 4.3e-7 (t in {2, 4}); we allow 1e-5. A collective
in the wrong place is off by a factor t or 1/t, or by a whole term, far beyond either.
"""
import pytest
import torch

from course.catalog import MODULES
from course.collectives import Collectives
from course.hints import module_todos
from course.impl import load, reference
from course.launch import run_ranks
from course.mesh import Group, world_group
from course.splits import check_splits

block12 = load("m12_tp_block")
m06 = reference("m06_llama_block")  # the single-process block: trusted code, not graded here
m06_ops = reference("m06_llama_ops")   # module 06's plain matmul policy (module 09's seam)

f64 = torch.float64
CFG = m06.LlamaConfig(dim=32, n_heads=8, n_kv_heads=4, head_dim=4, ffn_dim=24, rope_theta=1000.0, max_seq_len=16)
B, T = 2, 12
ROWS, COLUMNS = ("wq", "wk", "wv", "w_gate", "w_up"), ("wo", "w_down")  # column- and row-parallel weights


def inputs(dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    weights = m06.init_block_weights(CFG, g, dtype)
    weights.ln1 = weights.ln1 + 0.1 * torch.randn(CFG.dim, generator=g).to(dtype)  # norms away from 1
    weights.ln2 = weights.ln2 + 0.1 * torch.randn(CFG.dim, generator=g).to(dtype)
    x, dy = torch.randn(B, T, CFG.dim, generator=g).to(dtype), torch.randn(B, T, CFG.dim, generator=g).to(dtype)
    return weights, x, dy


def _tp_block(sequence_parallel, weights, x, dy, more=()):
    """One microbatch (x, dy) through the split block, then each of `more`, all accumulating into the same
    gradients: y, dx and the store are the last microbatch's, the gradients and the log all of theirs."""
    tp = world_group("t")
    rank, t = tp.index, tp.size
    # This rank's positions as a tensor of their own (a view would keep the whole x's storage alive).
    mine = (lambda a: a.chunk(t, dim=1)[rank].contiguous()) if sequence_parallel else (lambda a: a)
    w = block12.shard_block_weights(weights, CFG, tp)
    block, grads = block12.TPBlock(CFG, tp, sequence_parallel, attention_chunk=5), block12.zero_grads(w)
    for x, dy in [(x, dy), *more]:
        store = m06.ActivationStore()
        y = block.forward(w, mine(x), store)
        saved = {name: (tuple(v.shape), v.untyped_storage().nbytes()) for name, v in store.tensors.items()}
        o = store.tensors["o"].clone() if "o" in store.tensors else None
        dx = block.backward(w, mine(dy), store, grads)
    block12.sum_norm_grads([grads.ln1, grads.ln2], tp, sequence_parallel)
    return y, dx, grads, saved, [(c.op, c.payload_bytes) for c in tp.collectives.log], o


def single_process(weights, x, dy):
    """Module 06's y, dx, gradients and attention output o (every head)."""
    block, store = m06.LlamaBlock(CFG, attention_chunk=5), m06.ActivationStore()
    y = block.forward(weights, x, store)
    o = store["o"].clone()
    dx, grads = block.backward(weights, dy, store)
    return y, dx, grads, o


def relative_errors(results, expected, sequence_parallel):
    """(name, worst |difference| / worst |expected|) for the attention output o (this rank's heads, joined), y,
    dx and every weight gradient, the ranks' pieces joined."""
    y_ref, dx_ref, grads_ref, o_ref = expected
    joined = (lambda parts: torch.cat(parts, dim=1)) if sequence_parallel else (lambda parts: parts[0])
    got = {"o": torch.cat([r[5].reshape(*r[5].shape[:2], -1) for r in results], dim=-1)
           if all(r[5] is not None for r in results) else torch.full_like(o_ref, float("nan")),
           "y": joined([r[0] for r in results]), "dx": joined([r[1] for r in results])}
    for name in ROWS + COLUMNS + ("ln1", "ln2"):
        parts = [getattr(r[2], name) for r in results]
        got[f"d{name}"] = parts[0] if name.startswith("ln") else torch.cat(parts, dim=1 if name in COLUMNS else 0)
    want = {"o": o_ref.reshape(*o_ref.shape[:2], -1), "y": y_ref, "dx": dx_ref,
            **{f"d{name}": getattr(grads_ref, name) for name in ROWS + COLUMNS + ("ln1", "ln2")}}
    errors = []
    for name in want:
        a, b = got[name].double(), want[name].double()
        factor = ((a * b).sum() / (b * b).sum()).item()  # how many times the reference it is, where it is a multiple
        errors.append((name, ((a - b).abs().max() / b.abs().max()).item(), factor))
    return errors


@pytest.mark.exercises("shard_block_weights")
@pytest.mark.parametrize("t", [2, 4])
def test_each_shard_is_a_contiguous_copy_of_this_ranks_block(t):
    # Column-parallel weights keep block i_t of their rows, row-parallel ones block i_t of their columns, the
    # norms all of it (the definition, docs/12). A slice of the whole weight has the right numbers but keeps the
    # whole weight's storage alive (a row block is even contiguous): every rank would hold the whole block. The
    # docstring asks for copies.
    weights = inputs(f64)[0]
    whole = {tensor.untyped_storage().data_ptr() for tensor in weights.tensors()}
    names = ("ln1", "wq", "wk", "wv", "wo", "ln2", "w_gate", "w_up", "w_down")
    for rank in range(t):
        members = tuple(range(t))  # rank's place in a group of t, without processes: the shards are local
        w = block12.shard_block_weights(weights, CFG, Group("t", rank, members, Collectives(None, "t", members)))
        for name, shard, full in zip(names, w.tensors(), weights.tensors()):
            want = full if name.startswith("ln") else full.chunk(t, dim=1 if name in COLUMNS else 0)[rank]
            cut = "whole" if name.startswith("ln") else "block of its columns" if name in COLUMNS else "block of its rows"
            assert shard.shape == want.shape and torch.equal(shard, want), \
                (f"your shard_block_weights: t={t}, rank {rank}: {name} is {tuple(shard.shape)}, expected "
                 f"{tuple(want.shape)}, this rank's {cut} of the whole {tuple(full.shape)}"
                 + ("" if shard.shape != want.shape else ": same shape, other values"))
            storage, size = shard.untyped_storage(), shard.numel() * shard.element_size()
            where = f"t={t}, rank {rank}: {name} {tuple(shard.shape)}"
            assert storage.data_ptr() not in whole, \
                (f"{where} shares its storage with the whole block's weights (a slice, or the tensor itself): every "
                 "rank would keep the whole block alive; keep a copy (.clone())")
            assert shard.is_contiguous() and storage.nbytes() == size, \
                (f"{where}: contiguous {shard.is_contiguous()}, its storage holds {storage.nbytes()} bytes for its "
                 f"{size}: keep a contiguous copy of exactly this rank's block")


def _title(function: str, word: str) -> str:
    """The title of `function`'s TODO about `word` ("attention", "FFN"): TPBlock.forward and backward hold two each."""
    return next(b.title for b in module_todos(MODULES["12"]) if b.function == function and word in b.title)


# The half each tensor is computed in, as its TODO's title (a message quoting titles is sent to the first TODO it
# quotes, in the module's order: a wrong forward half makes everything after it wrong too).
HALVES = {"o": _title("TPBlock.forward", "attention"), "y": _title("TPBlock.forward", "FFN"),
          **{f"d{name}": _title("TPBlock.backward", "FFN") for name in ("w_gate", "w_up", "w_down")},
          **{f"d{name}": _title("TPBlock.backward", "attention") for name in ("wq", "wk", "wv", "wo", "x")}}


def hint(name: str, sequence_parallel: bool, factor: float, t: int) -> str:
    """Which of the learner's TODOs computes `name`: the first wrong one in the order computed. A norm's gradient
    t (or 1/t) times the reference's is summed over the group once too often (or never): sum_norm_grads."""
    if name in ("dln1", "dln2"):
        if t > 1 and min(abs(factor - t), abs(factor - 1 / t)) < 1e-6:
            return (f" ({factor:.2f} times: with sequence parallelism each rank's norm gradients cover its positions "
                    "only, and your sum_norm_grads sums them over the group" if sequence_parallel else
                    f" ({factor:.2f} times: without sequence parallelism every rank's norm gradients are already "
                    "whole, and your sum_norm_grads leaves them as they are")
        half = _title("TPBlock.backward", "attention" if name == "dln1" else "FFN")
        return f" (your TPBlock.backward, {half}: its norm's gradient is added into grads)"
    if name in ("o", "y"):
        return f" (your TPBlock.forward, {HALVES[name]}, on the slices of your shard_block_weights)"
    return f" (your TPBlock.backward, {HALVES[name]})"


def described(wrong: list[tuple[str, float, float]], sequence_parallel: bool, t: int) -> str:
    """'dln1: 1.0e+00; dln2: 1.0e+00 (hint)': each wrong tensor's error, and each different hint once,
    after the last tensor it is about."""
    notes = [hint(name, sequence_parallel, factor, t) for name, _, factor in wrong]
    return "; ".join(f"{name}: {error:.1e}" + ("" if i + 1 < len(wrong) and notes[i + 1] == notes[i] else notes[i])
                     for i, (name, error, _) in enumerate(wrong))


# The block's checks grade its TODOs first; the linears of m12_tp_linear have checks of their own.
LINEARS = ("column_parallel_forward", "column_parallel_backward", "row_parallel_backward",
           "enter_tp_forward", "enter_tp_backward")
BLOCK = ("TPBlock.forward", "TPBlock.backward", "sum_norm_grads", "shard_block_weights", *LINEARS)


@pytest.mark.exercises(*BLOCK)
@pytest.mark.parametrize("world_size, sequence_parallel", [(1, False), (2, False), (4, False), (1, True), (2, True),
                                                           (4, True)])
def test_the_block_equals_module_06s_block(world_size, sequence_parallel):
    weights, x, dy = inputs(f64)
    results = run_ranks(_tp_block, world_size, sequence_parallel, weights, x, dy, timeout=30)
    errors = relative_errors(results, single_process(weights, x, dy), sequence_parallel)
    wrong = [error for error in errors if not error[1] <= 1e-12]
    assert not wrong, (f"t={world_size}, sequence parallel {sequence_parallel}: relative error above 1e-12 "
                       f"(first in the order computed): {described(wrong, sequence_parallel, world_size)}")


@pytest.mark.exercises("TPBlock.backward", "sum_norm_grads", "TPBlock.forward", "shard_block_weights", *LINEARS)
def test_two_microbatches_accumulate_into_the_same_gradients():
    # The backward adds into the main_grad accumulators: after two microbatches they hold the sum of
    # both microbatches' gradients (and the norms' partial sums, summed over the ranks once, at the end).
    # A gradient assigned instead of added (or the accumulator replaced) keeps only the last one.
    weights, x, dy = inputs(f64)
    _, x2, dy2 = inputs(f64, seed=2)
    results = run_ranks(_tp_block, 2, True, weights, x, dy, [(x2, dy2)], timeout=30)
    _, _, first, _ = single_process(weights, x, dy)
    y, dx, second, o = single_process(weights, x2, dy2)
    both = m06.BlockWeights(*(a + b for a, b in zip(first.tensors(), second.tensors())))
    errors = relative_errors(results, (y, dx, both, o), True)
    wrong = [error for error in errors if not error[1] <= 1e-12]
    assert not wrong, ("t=2 with sequence parallelism, two microbatches into the same gradients: relative error "
                       "above 1e-12 against the sum of module 06's two gradients (add into grads, never assign: "
                       "microbatches accumulate): " + described(wrong, True, 2))


@pytest.mark.exercises(*BLOCK)
def test_the_block_in_float32_is_within_rounding_of_module_06s():
    weights, x, dy = inputs(torch.float32)
    results = run_ranks(_tp_block, 4, True, weights, x, dy, timeout=30)
    errors = relative_errors(results, single_process(weights, x, dy), True)
    wrong = [error for error in errors if not error[1] <= 1e-5]
    assert not wrong, f"t=4 with sequence parallelism, float32: relative error above 1e-5: {described(wrong, True, 4)}"


@pytest.mark.exercises("TPBlock.forward", "shard_block_weights", "TPBlock.backward", "sum_norm_grads", *LINEARS)
def test_the_store_keeps_sequence_shards_and_this_ranks_heads():
    # With sequence parallelism, x, n1, r1, h, n2 and r2 are kept for this rank's T/t positions
    # only (the backward gathers n1 and n2 again); the rest for every position but this rank's heads
    # (H/t of q, K/t of k and v) or FFN units (F/t). Counted by hand from the equations.
    t, act, stat = 2, 8, 8
    H, K, D, F = CFG.n_heads // t, CFG.n_kv_heads // t, CFG.head_dim, CFG.ffn_dim // t
    expected = {"x": (B, T // t, CFG.dim), "n1": (B, T // t, CFG.dim), "r1": (B, T // t), "h": (B, T // t, CFG.dim),
                "n2": (B, T // t, CFG.dim), "r2": (B, T // t), "q": (B, T, H, D), "k": (B, T, K, D), "v": (B, T, K, D),
                "o": (B, T, H * D), "g": (B, T, F), "u": (B, T, F), "s": (B, T, F)}
    weights, x, dy = inputs(f64)
    saved = run_ranks(_tp_block, t, True, weights, x, dy, timeout=30)[1][3]
    assert set(saved) == set(expected) | {"lse"}, f"your TPBlock.forward's store holds {sorted(saved)}; expected module 06's names"
    for name, shape in expected.items():
        numel = torch.Size(shape).numel()
        got_shape, got_bytes = saved[name]
        assert got_bytes == numel * (stat if name.startswith("r") else act), \
            (f"{name}: your TPBlock.forward's store keeps {got_bytes} bytes (shape {got_shape}), expected {numel * act} for {shape}"
             + (": keep this rank's shard and gather it again in the backward" if name in ("n1", "n2") else ""))
    assert saved["lse"][1] == B * T * H * stat, f"lse: {saved['lse']}, expected one value per position and local head"


@pytest.mark.exercises("TPBlock.forward", "TPBlock.backward", "sum_norm_grads", *LINEARS, "shard_block_weights")
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["replicated", "sequence-parallel"])
def test_one_block_issues_the_hand_counted_collectives(sequence_parallel):
    # One (B, T, dim) activation A is 2 * 12 * 32 * 8 = 6,144 bytes; its shard on 2 ranks 3,072.
    # Without sequence parallelism: the o and down projections' outputs are all-reduced in the
    # forward, the q/k/v and gate/up input gradients in the backward. With it, those become
    # reduce-scatters / all-gathers, the backward also all-gathers the row-parallel linears'
    # output gradients and the column-parallel linears' inputs again, and the two norm weights'
    # gradients (2 * 32 * 8 = 512 bytes) are summed in one all-reduce.
    A, shard = B * T * CFG.dim * 8, B * T * CFG.dim * 8 // 2
    if sequence_parallel:
        forward = [("all_gather", shard), ("reduce_scatter", shard)] * 2
        backward = [("all_gather", shard), ("all_gather", shard), ("reduce_scatter", shard)] * 2
        expected = forward + backward + [("all_reduce", 2 * CFG.dim * 8)]
    else:
        expected = [("all_reduce", A)] * 4
    weights, x, dy = inputs(f64)
    log = run_ranks(_tp_block, 2, sequence_parallel, weights, x, dy, timeout=30)[0][4]
    norms = ("all_reduce", 2 * CFG.dim * 8)
    culprit = ("your sum_norm_grads decides whether the norms' gradients are summed"
               if [c for c in log if c != norms] == [c for c in expected if c != norms] else
               "your TPBlock.forward and TPBlock.backward choose which linears and operators run")
    assert log == expected, f"collectives (op, payload bytes) in order: got {log}, expected {expected} ({culprit})"


@pytest.mark.given
@pytest.mark.parametrize("t, seq_len, message", [
    (3, None, r"t=3 does not divide n_heads H=8, n_kv_heads K=4: .* t in \{1, 2, 4\} would work"),
    (8, None, r"t=8 does not divide n_kv_heads K=4: t must divide H, K, F; t in \{1, 2, 4\}"),
    (4, 10, r"t=4 does not divide sequence length T=10: .* t in \{1, 2\} would work"),
    (0, None, "at least 1"),
])
def test_a_t_that_does_not_divide_is_refused_in_one_line(t, seq_len, message):
    # course/splits.py's one check of what each axis splits (module 12: H, K, F and, with sequence
    # parallelism, T over t), as the demo and the benchmark call it before any rank starts.
    with pytest.raises(ValueError, match=message) as refused:
        check_splits(CFG, {"t": t}, seq_len=seq_len, sequence_parallel=seq_len is not None)
    assert "\n" not in str(refused.value)


class CountingMatmul(m06_ops.Matmul):
    """Module 06's plain policy, counting its products: what module 09's seam sees of the block, by weight (each
    product's w is one of this rank's shards, known by its storage)."""

    def __init__(self, shards: dict[int, str]):
        self.shards, self.calls = shards, {"forward": 0, "backward": 0}
        self.seen: set[tuple[str, str]] = set()

    def _count(self, kind, w):
        self.calls[kind] += 1
        self.seen.add((self.shards.get(w.untyped_storage().data_ptr(), "another tensor"), kind))

    def forward(self, x, w):
        self._count("forward", w)
        return super().forward(x, w)

    def backward(self, dy, x, w):
        self._count("backward", w)
        return super().backward(dy, x, w)


def _block_with_policy(sequence_parallel, weights, x, dy):
    tp = world_group("t")
    mine = (lambda a: a.chunk(tp.size, dim=1)[tp.index].contiguous()) if sequence_parallel else (lambda a: a)
    w = block12.shard_block_weights(weights, CFG, tp)
    names = ("ln1", "wq", "wk", "wv", "wo", "ln2", "w_gate", "w_up", "w_down")
    policy = CountingMatmul({t.untyped_storage().data_ptr(): name for name, t in zip(names, w.tensors())})
    block = block12.TPBlock(CFG, tp, sequence_parallel, attention_chunk=5, matmul=policy)
    grads, store = block12.zero_grads(w), m06.ActivationStore()
    y = block.forward(w, mine(x), store)
    o = store.tensors["o"].clone() if "o" in store.tensors else None
    dx = block.backward(w, mine(dy), store, grads)
    block12.sum_norm_grads([grads.ln1, grads.ln2], tp, sequence_parallel)
    return y, dx, grads, None, None, o, policy.calls, policy.seen


# Which TODO multiplies each weight, forward and backward (the FFN half's forward starts with o's projection).
POLICY_TODOS = {**{(name, "forward"): ("TPBlock.forward", "attention") for name in ("wq", "wk", "wv")},
                **{(name, "forward"): ("TPBlock.forward", "FFN") for name in ("wo", "w_gate", "w_up", "w_down")},
                **{(name, "backward"): ("TPBlock.backward", "FFN") for name in ("w_gate", "w_up", "w_down")},
                **{(name, "backward"): ("TPBlock.backward", "attention") for name in ("wq", "wk", "wv", "wo")}}
# row_parallel_forward is given (it passes its matmul on): the block's call is to blame when wo and w_down skip it.
LINEAR_OF = {("forward", True): "column_parallel_forward",
             ("backward", True): "column_parallel_backward", ("backward", False): "row_parallel_backward"}


def policy_culprit(seen: set) -> str:
    """The products the policy never saw, and who skips them: one of the linears' functions when it skips
    every weight of its kind, else the TODO of the block's half that calls the linear without mm."""
    missing = sorted(key for key in POLICY_TODOS if key not in seen)
    for (kind, column), function in LINEAR_OF.items():
        kind_missing = [name for name, k in missing if k == kind and (name not in COLUMNS) == column]
        if len(kind_missing) == (5 if column else 2) and all(k == kind and (n not in COLUMNS) == column for n, k in missing):
            return f"no {kind} product of {', '.join(kind_missing)} went through it: your {function} ignores its matmul"
    todos = dict.fromkeys(_title(*POLICY_TODOS[key]) for key in missing)
    return (f"no product of {', '.join(f'{name} ({kind})' for name, kind in missing)} went through it: every linear "
            f"takes the block's policy mm ({'; '.join(todos)})")


@pytest.mark.exercises("TPBlock.forward", "TPBlock.backward", *LINEARS)
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_every_linear_goes_through_the_blocks_matmul_policy(sequence_parallel):
    # Module 09's seam: TPBlock(..., matmul=policy) multiplies through the policy, 7 forward and 7 backward
    # products a block (module 06's count), on this rank's slices; with module 06's plain policy the results
    # are module 06's block's, within the float64 tolerance above (the policy's dW is added, not fused).
    weights, x, dy = inputs(f64)
    results = run_ranks(_block_with_policy, 2, sequence_parallel, weights, x, dy, timeout=30)
    for rank, result in enumerate(results):
        assert result[6] == {"forward": 7, "backward": 7}, \
            (f"rank {rank}: the policy saw {result[6]} products, module 06's block 7 and 7: {policy_culprit(result[7])}")
    errors = relative_errors(results, single_process(weights, x, dy), sequence_parallel)
    wrong = [error for error in errors if not error[1] <= 1e-12]
    assert not wrong, "with a matmul policy, relative error above 1e-12: " + described(wrong, sequence_parallel, 2)
