"""Module 14 replicas on forked ranks: the broadcast, the buckets sent during the backward, and the
trained weights against one process on the whole batch.

References: module 00's MLP trained in one process on the whole batch with autograd and PyTorch's
AdamW; module 06's `train` (trusted reference code) for its Llama, whose hand-written backward hands
each block's gradients over through on_block_grads; the send order written out by hand.

Collectives arrive late here (course/late_collectives.py): an asynchronous collective reads its
input when it is started and delivers only in wait(), its output holding NaN until then. So a
bucket sent before its last gradient misses that gradient, and a result read before it was waited
for is NaN: both are wrong every time, not only when the network happens to be slow.

Tolerance. d ranks sum their gradients over their own rows and then over ranks; one process sums
over all rows at once: the same numbers added in another order, so they differ by rounding, not
bit for bit. In float64 (measured, torch 2.13 CPU, d = 2 and 4, 3 AdamW steps): the MLP's weights
within 6e-17 of one process, module 06's Llama's within 1.4e-14 (losses within 9e-16). We allow
1e-12. In float32 the same reordering moves the MLP's weights by up to 1e-7 after 3 steps (measured
3e-8 on 2 ranks, 9.7e-8 on 4: AdamW's update of a weight whose gradient is near zero amplifies the
rounding of that gradient); we allow 1e-6. An average taken twice or not at all
is off by a factor of d: AdamW's m / sqrt(v) hides most of a constant factor, but not from 1e-12.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from course.dataset import load_text, random_batch
from course.impl import load, reference
from course.late_collectives import check_count_in_flight, check_waited, late_group, token_counts
from course.launch import run_ranks

dp = load("m14_data_parallel")
ts = load("m14_train_step")
m00 = reference("m00_monolith")
m06 = reference("m06_llama_model")
LlamaConfig = reference("m06_llama_block").LlamaConfig

f64, f32 = torch.float64, torch.float32
MLP = m00.MLPConfig(hidden=16, layers=6, batch=8)  # 13,328 bytes of float64 parameters
LR, STEPS, TOLERANCE = 1e-2, 3, 1e-12
CAP = 5000  # 3 buckets of the MLP: layers 5, 4 and the head; layers 4 .. 2; layers 2 .. 0


# --- the MLP: replicas against one process ------------------------------------------------------

def mlp_batch(step: int, dtype=f64):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(MLP.batch, MLP.hidden, generator=g).to(dtype), torch.randint(0, MLP.classes, (MLP.batch,), generator=g)


def one_process(model, steps=STEPS, dtype=f64, batch=mlp_batch):
    """The weights after every step of AdamW on the whole batch, in one process (autograd)."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    after = []
    for step in range(steps):
        x, y = batch(step, dtype)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        after.append([p.detach().clone() for p in model.parameters()])
    return after


def first_gradients(model, dtype=f64, batch=mlp_batch) -> list[torch.Tensor]:
    """The gradients of the first step's mean loss on the whole batch, in one process (autograd)."""
    x, y = batch(0, dtype)
    F.cross_entropy(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def keep_first_gradients(ddp, params) -> list[torch.Tensor]:
    """A list that gets each of `params`' .grad as the first optimizer step (ddp.step) reads them."""
    first, step_of = [], ddp.step

    def step(optimizer, max_norm=None):
        if not first:
            first.extend(p.grad.clone() for p in params)
        return step_of(optimizer, max_norm)
    ddp.step = step
    return first


def _replicas(dtype, mesh=None):
    group = late_group(mesh)
    model = m00.build_model(MLP).to(dtype)
    with torch.no_grad():  # replicas that start apart: the first member's weights must reach every rank
        for p in model.parameters():
            p.add_(group.index)
    ddp = dp.replicate(model, group, CAP)
    start = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=LR)
    grads = keep_first_gradients(ddp, list(model.parameters()))
    after, losses, sent = [], [], []  # sent: the buckets' labels each step
    for step in range(STEPS):
        del group.collectives.log[:]
        losses.append(ts.train_step(ddp, model, *mlp_batch(step, dtype), 1, optimizer))
        check_waited(group)
        check_rearmed(ddp, step)
        after.append([p.detach().clone() for p in model.parameters()])
        sent.append([r.label for r in group.collectives.log if r.label.startswith("bucket")])
    buffers = {b.grads.untyped_storage().data_ptr(): b for b in ddp.buckets}
    views = [name for name, p in model.named_parameters()
             if p.grad is None or p.grad.untyped_storage().data_ptr() not in buffers]
    return group.ranks, start, after, losses, views, grads, sent, len(ddp.buckets)


def check_rearmed(ddp, step: int):
    """On the rank, before the next step's backward: the buckets and next_bucket as a new DataParallel has them
    (every position pending, sending starts at bucket 0), which finish's contract promises."""
    left = [(b.index, sorted(b.pending)) for b in ddp.buckets if sorted(b.pending) != list(range(len(b.params)))]
    assert not left and ddp.next_bucket == 0, (
        f"after step {step}: your DataParallel.finish left " + (f"bucket {left[0][0]} with positions {left[0][1]} "
        f"pending of {len(ddp.buckets[left[0][0]].params)}" if left else f"next_bucket at {ddp.next_bucket}") +
        ": the next backward's ready() finds the buckets as this backward left them. What did this backward use "
        "up that a new DataParallel starts with?")


def worst(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max((a - b).abs().max().item() for a, b in zip(got, want, strict=True))


COUNTED = ("are the gradients your train_step leaves to the optimizer those of the step's mean over the real tokens "
           "of every rank (the given global_token_count counts them)? or an average taken twice: the given launch sums, "
           "it does not divide by d")
TWICE = ("the loss is right, so the count is: an average taken twice? the given launch sums, it does not divide by d; "
         "or are the gradients your train_step leaves to the optimizer not those of the step's mean?")


def factor_of(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """The factor c that makes c * want closest to got (least squares over every value)."""
    return (sum((g * w).sum() for g, w in zip(got, want)) / sum((w * w).sum() for w in want)).item()


def gradient_message(where: str, got, want, n_tokens: int, d: int, who: str) -> str:
    """Why the gradients the optimizer reads are not the step's, from the factor between them; `who` is the
    step's code (your train_step, your DataParallelLlama.train_step)."""
    c, gap = factor_of(got, want), worst(got, want)
    said = f"{where}: the gradients the first optimizer step reads differ by {gap:.2e} from one process's"
    if abs(c) < 1e-6:
        return (f"{said}, about {c:.1e} times them: {who} scaled them by a count read before its wait() (a "
                f"collective here delivers only at wait(); a count not yet arrived reads as a huge negative number)")
    for factor, why in ((n_tokens, f"scaled before finish() landed the buckets' sums (they overwrite what {who} did "
                                   f"to the buffers), or not scaled at all"),
                        (1 / n_tokens, f"scaled by the count twice ({who})"),
                        (1 / d, "an average taken twice: the given launch sums, it does not divide by d"),
                        (d, f"each rank's own count, not the step's (the given global_token_count sums over the group)")):
        if d > 1 or factor not in (d, 1 / d):
            if math.isclose(c, factor, rel_tol=1e-6):
                return f"{said}: {c:g} times them, {why}"
    return f"{said} (about {c:.4g} times them): your ready, launch or finish, or {who}"


def beyond(what: str, gap: float, tolerance: float = TOLERANCE, factor: str = COUNTED) -> str:
    """The message of a gap beyond the tolerance; one of 1e-9 .. 1e-2 (AdamW's m / sqrt(v) shrinks a constant
    factor's effect on the weights to about that) names the likely culprits of a constant factor, `factor`."""
    hint = (f" (a gap of 1e-8 .. 1e-3 is not rounding: a gradient off by a constant factor: {factor})"
            if 1e-9 < gap < 1e-2 else "")
    return f"{what} differs by {gap:.2e} from one process on the whole batch, tolerance {tolerance:g}{hint}"


# The likeliest culprits first (assign_buckets has its own tests); a message that knows one names it.
REPLICAS = ("DataParallel.ready", "DataParallel.finish", "train_step",
            "broadcast_from_first", "assign_buckets")


@pytest.mark.exercises(*REPLICAS)
@pytest.mark.parametrize("mesh, world_size", [(None, 1), (None, 2), (None, 4), ({"d": 2, "t": 2}, 4)],
                         ids=["1", "2", "4", "mesh-d2-t2"])
def test_replicas_equal_one_process_on_the_whole_batch(mesh, world_size):
    expected = one_process(m00.build_model(MLP).to(f64))
    initial = list(m00.build_model(MLP).to(f64).parameters())
    with torch.no_grad():
        first_loss = F.cross_entropy(m00.build_model(MLP).to(f64)(mlp_batch(0)[0]), mlp_batch(0)[1]).item()
    grads = first_gradients(m00.build_model(MLP).to(f64))
    for rank, (ranks, start, after, losses, views, got, sent, n_buckets) in enumerate(
            run_ranks(_replicas, world_size, f64, mesh, timeout=60)):
        where = f"rank {rank}" + (f" (its d group is ranks {ranks}, first member rank {ranks[0]})" if mesh else "")
        assert all(torch.equal(a, b) for a, b in zip(start, initial)), \
            (f"{where}: the replicas must start from the group's first member's weights, not their own, nor those "
             f"of the job's rank 0 (your broadcast_from_first)")
        assert not views, f"{where}: {views[0]}.grad is not a view into its bucket's buffer"
        ratio = losses[0] / first_loss
        assert abs(ratio - 1) < 1e-6 or math.isclose(losses[0], first_loss, rel_tol=1e-12), \
            (f"{where}: your train_step: the first step's loss is {losses[0]}, one "
             f"process's {first_loss}, {ratio:.4g} times it: the summed token losses of every rank (train_step's "
             f"loss_sum) over the count of real tokens of every rank (global_token_count's)")
        assert math.isclose(losses[0], first_loss, rel_tol=1e-12), \
            (f"{where}: your train_step: the first step's loss is {losses[0]}, one process's {first_loss} (relative "
             f"error {abs(ratio - 1):.1e}, tolerance 1e-12; float32 rounds at about 6e-8): is loss_sum a float64 sum "
             f"of float64 losses whatever the model's dtype?")
        assert worst(got, grads) <= TOLERANCE, gradient_message(where, got, grads, MLP.batch,
                                                                world_size // (2 if mesh else 1), "your train_step")
        for step, labels in enumerate(sent):
            assert labels == [f"bucket {k}" for k in range(n_buckets)], (
                f"{where}: step {step} sent {labels}: every bucket once a step, in order (your ready sends them; "
                f"your finish leaves every bucket armed and the next one to send at 0 for the next step)")
        for step, (got, want) in enumerate(zip(after, expected)):
            gap = worst(got, want)
            assert gap <= TOLERANCE, beyond(f"{where}: the weights after step {step}", gap, factor=TWICE)


@pytest.mark.exercises(*REPLICAS)
def test_float32_replicas_agree_to_float32_rounding():
    expected = one_process(m00.build_model(MLP).to(f32), dtype=f32)
    for rank, (_, _, after, *_) in enumerate(run_ranks(_replicas, 2, f32, timeout=60)):
        gap = worst(after[-1], expected[-1])
        assert gap <= 1e-6, beyond(f"rank {rank}: float32 weights after {STEPS} steps", gap, 1e-6)


# --- when each bucket is sent ---------------------------------------------------------------------

def _send_positions(caps):
    group = late_group()
    results = []
    for cap in caps:
        model = m00.build_model(MLP).to(f64)
        before = {}  # parameter name -> collectives issued before its gradient was final (this hook runs first)
        for name, p in model.named_parameters():
            p.register_post_accumulate_grad_hook(lambda p, name=name: before.__setitem__(name, len(group.collectives.log)))
        ddp = dp.replicate(model, group, cap)
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=LR)
        del group.collectives.log[:]
        ts.train_step(ddp, model, *mlp_batch(0), 1, optimizer)
        check_waited(group)
        sent = [(record.label, i) for i, record in enumerate(group.collectives.log) if record.label.startswith("bucket")]
        results.append(([b.names for b in ddp.buckets], before, sent))
    return results


@pytest.mark.exercises("DataParallel.ready", "DataParallel.finish", "train_step",
                        "broadcast_from_first", "assign_buckets")
def test_each_bucket_is_sent_once_in_order_as_soon_as_its_last_gradient_is_ready():
    caps = {1 << 20: 1, 7000: 2, CAP: 3}
    for rank, per_cap in enumerate(run_ranks(_send_positions, 2, list(caps), timeout=60)):
        for (cap, n_buckets), (names, before, sent) in zip(caps.items(), per_cap):
            where = f"rank {rank}, cap {cap} ({len(names)} buckets)"
            assert len(names) == n_buckets, f"{where}: expected {n_buckets} buckets"
            assert [label for label, _ in sent] == [f"bucket {k}" for k in range(n_buckets)], \
                f"{where}: buckets sent {[label for label, _ in sent]}; each once, in bucket order (your ready)"
            previous = -1
            for k, (bucket, (_, position)) in enumerate(zip(names, sent)):
                last = max(before[name] for name in bucket)  # collectives issued before its last gradient
                earliest = max(last, previous + 1)
                assert position >= last, (f"{where}: bucket {k} was sent before the gradient of "
                                          f"{max(bucket, key=before.get)} was ready: its sum misses that gradient "
                                          f"(your ready)")
                assert position == earliest, (f"{where}: bucket {k} was sent as collective {position}, but it could "
                                              f"go as collective {earliest}: your ready sends it as soon as its last "
                                              f"gradient is in and bucket {k - 1} has gone")
                previous = position
            if n_buckets > 1:
                assert sent[0][1] < before["layers.0.weight"], \
                    f"{where}: the first bucket must be on its way before the first layer's backward has run (your ready)"


def _ready_by_hand(orders):
    """Plain tensors, the gradients handed over by hand (as module 06's backward does), in another order on
    each rank. Sizes 5, 3, 4, 6, 2 values of float64 at a cap of 64 bytes: buckets [4], [2, 3], [0, 1]."""
    group = late_group()
    named = [(f"t{i}", torch.zeros(n, dtype=f64)) for i, n in enumerate([5, 3, 4, 6, 2])]
    ddp = dp.DataParallel(named, group, 64)
    del group.collectives.log[:]
    sent_after = []  # collectives issued after each ready call
    for i in orders[group.index]:
        ddp.ready(named[i][1], torch.full_like(named[i][1], (group.index + 1) * (i + 1)))
        sent_after.append(len(group.collectives.log))
    ddp.finish()
    check_waited(group)
    labels = [record.label for record in group.collectives.log]
    grads = [p.grad.clone() for _, p in named]
    ddp.ready(named[4][1], torch.ones(2))  # bucket 0 leaves again ...
    try:
        ddp.ready(named[4][1], torch.ones(2))  # ... and the same gradient again is the caller's bug
        twice = None
    except RuntimeError as exc:
        twice = str(exc)
    return labels, sent_after, grads, twice


@pytest.mark.exercises("DataParallel.ready", "DataParallel.finish", "assign_buckets")
def test_buckets_leave_in_bucket_order_whatever_order_the_gradients_arrive_in():
    # Rank 0's gradients arrive first to last (bucket 2 complete first: it must wait for buckets 0 and 1),
    # rank 1's last to first (each bucket leaves as soon as it is complete).
    orders = [[0, 1, 2, 3, 4], [4, 3, 2, 1, 0]]
    expected_sent_after = [[0, 0, 0, 0, 3], [1, 1, 2, 2, 3]]
    for rank, (labels, sent_after, grads, twice) in enumerate(run_ranks(_ready_by_hand, 2, orders, timeout=60)):
        assert labels == ["bucket 0", "bucket 1", "bucket 2"], \
            f"rank {rank} sent {labels}: your ready sends strictly in bucket order"
        assert sent_after == expected_sent_after[rank], (
            f"rank {rank}, gradients in the order {orders[rank]}: collectives issued after each call of your ready "
            f"{sent_after}, expected {expected_sent_after[rank]}")
        for i, g in enumerate(grads):
            assert torch.equal(g, torch.full_like(g, 3.0 * (i + 1))), \
                (f"rank {rank}: t{i}'s gradient is {g.tolist()}, the sum over ranks is {3.0 * (i + 1)} everywhere "
                 f"(your launch sums the bucket's buffer in place, your finish waits for it)")
        assert twice is not None and "t4" in twice, \
            (f"rank {rank}: your ready, called twice for t4 in one backward, must raise a RuntimeError naming it, "
             f"got {twice!r}")


# --- tied, frozen and unused parameters -----------------------------------------------------------

class UsesLayer1Twice(m00.MonolithMLP):
    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = F.relu(layer(x))
            if i == 1:
                x = F.relu(layer(x))  # the same weights again: one parameter, two contributions to its gradient
        return self.head(x)


class SkipsLayer2(m00.MonolithMLP):
    def forward(self, x):
        for i, layer in enumerate(self.layers):
            if i != 2:
                x = F.relu(layer(x))
        return self.head(x)


def build(cls, freeze_first=False):
    torch.manual_seed(MLP.seed)
    model = cls(MLP).to(f64)
    if freeze_first:
        model.layers[0].requires_grad_(False)
    return model


def _edge_cases():
    group = late_group()
    results = {}
    for case, cls, freeze in (("tied", UsesLayer1Twice, False), ("frozen", m00.MonolithMLP, True)):
        model = build(cls, freeze)
        ddp = dp.replicate(model, group, CAP)
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=LR)
        for step in range(STEPS):
            ts.train_step(ddp, model, *mlp_batch(step), 1, optimizer)
        results[case] = [p.detach().clone() for p in model.parameters()]
    model = build(SkipsLayer2)
    ddp = dp.replicate(model, group, CAP)
    try:
        ts.train_step(ddp, model, *mlp_batch(0), 1, torch.optim.AdamW(ddp.parameters(), lr=LR))
        results["unused"] = None
    except RuntimeError as exc:
        results["unused"] = str(exc)
    return results


@pytest.mark.exercises("DataParallel.ready", "DataParallel.finish", "train_step",
                        "broadcast_from_first", "assign_buckets")
def test_tied_and_frozen_weights_train_as_one_process_and_an_unused_one_is_named():
    expected = {"tied": one_process(build(UsesLayer1Twice))[-1], "frozen": one_process(build(m00.MonolithMLP, True))[-1]}
    for rank, results in enumerate(run_ranks(_edge_cases, 2, timeout=60)):
        for case in ("tied", "frozen"):
            gap = worst(results[case], expected[case])
            assert gap <= TOLERANCE, beyond(f"rank {rank}, a {case} weight: the weights after {STEPS} steps", gap)
        message = results["unused"]
        assert message is not None, \
            f"rank {rank}: layer 2 gets no gradient, yet the step went through (your finish must refuse it)"
        assert "layers.2.weight" in message and "layers.2.bias" in message and "\n" not in message, \
            (f"rank {rank}: your finish's error must name layers.2.weight and layers.2.bias, on one line; "
             f"got {message!r}")
        assert "requires_grad" in message, \
            f"rank {rank}: your finish's error must say the fix (requires_grad_): {message!r}"


# --- module 06's Llama: gradients handed over block by block --------------------------------------

CFG = LlamaConfig(dim=32, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=48, n_layers=4, max_seq_len=16)
BATCH = 8
BLOCK_CAP = 60_000  # a block is 7,744 float64 values (61,952 bytes): about one bucket per block
LLAMA_COUNTED = ("are the gradients your DataParallelLlama.train_step leaves to the optimizer those of the step's "
                 "mean (what does module 06's forward_backward divide by)? or an average taken twice: your launch "
                 "sums, it does not divide by d")


def check_handed_over(model):
    """On the rank: when train_step calls finish(), every parameter's gradient has reached ready() in this backward
    (the embedding's, final norm's and LM head's come back from forward_backward, not through on_block_grads)."""
    ready, finish, seen = model.ddp.ready, model.ddp.finish, set()

    def recorded_ready(param, grad=None):
        seen.add(id(param))
        return ready(param, grad)

    def checked_finish():
        names = ["embedding", "final_norm", "lm_head"]
        missing = [name for name, weight in zip(names, (model.embedding, model.final_norm, model.lm_head))
                   if id(weight) not in seen]
        assert not missing, (f"your DataParallelLlama.train_step called finish() before {', '.join(missing)}'s "
                             f"gradient reached the buckets: forward_backward returns them, and only ready() hands "
                             f"a gradient to its bucket")
        seen.clear()
        return finish()
    model.ddp.ready, model.ddp.finish = recorded_ready, checked_finish


def _llama(mesh_sizes, n_microbatches):
    group = late_group(mesh_sizes)
    model = ts.DataParallelLlama(CFG, group, BLOCK_CAP, seed=0, dtype=f64)
    handed_over = {}  # block -> collectives issued before its gradients were handed over (first step, last micro-step)
    original = model.on_block_grads

    def recorded(layer, grads):
        if not losses:
            handed_over[layer] = len(group.collectives.log)
        original(layer, grads)
    model.on_block_grads = recorded
    check_handed_over(model)
    optimizer = torch.optim.AdamW(model.ddp.parameters(), lr=3e-3, weight_decay=0.0)
    grads = keep_first_gradients(model.ddp, model.parameters())
    losses, data, generator = [], load_text(), torch.Generator().manual_seed(0)
    del group.collectives.log[:], group.collectives.waited_at[:]
    for _ in range(STEPS):
        tokens, targets = random_batch(data, BATCH, CFG.max_seq_len, generator)
        losses.append(model.train_step(tokens, targets, n_microbatches, optimizer))
        check_waited(group)
    log = group.collectives.log
    first_bucket = next(i for i, r in enumerate(log) if r.label == "bucket 0")
    buckets = [i for i, record in enumerate(log) if record.label.startswith("bucket")]
    return (group.ranks, losses, [t.clone() for t in model.parameters()], handed_over, first_bucket,
            len(model.ddp.buckets), buckets, token_counts(group), grads)


@pytest.mark.exercises("DataParallelLlama.train_step",
                        "DataParallel.ready",
                        "DataParallel.finish",
                        "broadcast_from_first",
                        "assign_buckets")
@pytest.mark.parametrize("mesh, world_size, n_microbatches", [(None, 2, 2), ({"d": 2, "t": 2}, 4, 1)],
                         ids=["2-ranks-2-microbatches", "mesh-d2-t2"])
def test_module_06_llama_hands_each_block_to_the_buckets(mesh, world_size, n_microbatches):
    reference_model, reference_losses = m06.train(CFG, STEPS, BATCH, lr=3e-3, dtype=f64)
    expected = reference_model.parameters()
    tokens, targets = random_batch(load_text(), BATCH, CFG.max_seq_len, torch.Generator().manual_seed(0))
    _, first = m06.LlamaModel(CFG, 0, f64).forward_backward(tokens, targets)  # the first step's gradients
    first = first.tensors()
    for rank, (ranks, losses, weights, handed_over, first_bucket, n_buckets, buckets, counts, grads) in enumerate(
            run_ranks(_llama, world_size, mesh, n_microbatches, timeout=90)):
        if mesh:
            assert ranks == (rank % 2, rank % 2 + 2), f"rank {rank}: its d group is {ranks}"
        assert n_buckets > CFG.n_layers, f"expected a bucket per block at least, got {n_buckets}"
        gap = max(abs(a - b) for a, b in zip(losses, reference_losses))
        assert gap <= TOLERANCE, (f"rank {rank}: your DataParallelLlama.train_step's losses {losses} differ by "
                                  f"{gap:.2e} from module 06's in one process {reference_losses}: its loss_sum holds "
                                  f"this rank's summed token losses, n_tokens the step's count (what did you pass "
                                  f"forward_backward as its divisor, and what does its loss hold then?)")
        assert worst(grads, first) <= TOLERANCE, gradient_message(
            f"rank {rank}", grads, first, int((targets != m06.IGNORE_INDEX).sum()), 2,
            "your DataParallelLlama.train_step")
        gap = worst(weights, expected)
        assert gap <= TOLERANCE, beyond(f"rank {rank}: the weights after {STEPS} steps", gap, factor=LLAMA_COUNTED)
        assert first_bucket < handed_over[0], (
            f"rank {rank}: bucket 0 was sent as collective {first_bucket}, after block 0's gradients were handed over "
            f"(collective {handed_over[0]}): block 3's bucket should leave while blocks 2 .. 0 compute (your ready)")
        check_count_in_flight(f"rank {rank}", counts, buckets, n_buckets, "your DataParallelLlama.train_step")


# --- bad input: one line, before any process starts (given code) ----------------------------------

@pytest.mark.given
@pytest.mark.parametrize("options, message", [
    (["--bucket-mb", "0"], "--bucket-mb must be a positive number of MiB, got 0"),
    (["--bucket-mb", "-1"], "--bucket-mb must be a positive number of MiB, got -1"),
    (["--bucket-mb", "nan"], "--bucket-mb must be a positive number of MiB, got nan"),
    (["--bucket-mb", "inf"], "--bucket-mb must be a finite number of MiB, got inf"),
    (["--bucket-mb", "1e-9"], "--bucket-mb 1e-09 is under one byte"),
    (["--zero", "3"], "--zero must be a ZeRO stage, 0, 1 or 2, got 3"),
    (["--nproc", "3"], "--batch 8 must be divisible by d = --nproc 3"),
    (["--microbatches", "0"], "--microbatches and --layers must be at least 1"),
    (["--microbatches", "3"], "do not split into --microbatches 3 equal microbatches"),
])
def test_bad_run_options_give_one_line_before_any_rank_starts(options, message, capsys, monkeypatch):
    import main
    monkeypatch.setattr("course.launch.run_ranks", lambda *a, **k: pytest.fail("ranks started before the check"))
    with pytest.raises(SystemExit) as exit_:
        main.parse(["run", "14", *options])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and "Traceback" not in err, err


@pytest.mark.given
@pytest.mark.parametrize("options, message", [
    (["--cap-kib", "inf"], "argument --cap-kib: invalid int value: 'inf'"),  # caps are whole KiB: >= 1 byte, finite
    (["--cap-kib", "0"], "--cap-kib must be at least 1, got 0"),
    (["--caps-kib", "1", "1e-9"], "argument --caps-kib: invalid int value: '1e-9'"),
    (["--caps-kib", "0"], "--caps-kib values must be at least 1, got [0]"),
    (["--speed-caps-kib", "inf"], "argument --speed-caps-kib: invalid int value: 'inf'"),
    (["--emulate-ms", "nan"], "--emulate-ms must be at least 0, got nan"),
    (["--emulate-ms", "inf"], "--emulate-ms must be a finite number of ms, got inf"),
])
def test_bad_bench_options_give_one_line_before_any_rank_starts(options, message, capsys, monkeypatch):
    from course.bench import m14 as bench
    monkeypatch.setattr(bench, "run_ranks", lambda *a, **k: pytest.fail("ranks started before the check"))
    with pytest.raises(SystemExit) as exit_:
        bench.main(options)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err.splitlines()[-1] and "Traceback" not in err, err


@pytest.mark.given
def test_bad_cap_and_stage_are_refused_by_the_given_checks():
    with pytest.raises(ValueError, match="bucket cap must be a positive number of bytes, got 0"):
        reference("m14_buckets").assign_buckets([torch.zeros(3)], 0)
    with pytest.raises(ValueError, match="ZeRO stage 1 or 2, got 3"):
        reference("m14_zero").ZeroDataParallel([], None, 1, stage=3)
