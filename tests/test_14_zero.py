"""Module 14 ZeRO-1 and ZeRO-2 on forked ranks: the trained weights against one process (with and
without clipping by global norm), then what each rank keeps and sends against the formulas: two
checks that share one run of the ranks per configuration.

References: module 00's MLP trained in one process on the whole batch with autograd, PyTorch's
AdamW and torch.nn.utils.clip_grad_norm_ (its norms too); ZeRO-0's (DDP's) summed gradients, for
ZeRO-1's whole gradients and ZeRO-2's shards; the tensors each rank really holds (the storages
behind its parameters and gradients, AdamW's state); the collectives log (course/costs.py's
measured_cost). Collectives arrive late (course/late_collectives.py: a result is there only once
waited for), and each records which others of its kind were still in flight when it started.

Tolerance. ZeRO changes where AdamW runs, not its arithmetic (it is elementwise): the weights equal
the replicated run's but for the order of the gradient sums and, with clipping, of the norm's sum of
squares. Measured (torch 2.13 CPU, d = 2 and 4, 1 and 2 micro-steps, 3 steps): within 4.4e-16 of
one process. We allow 1e-12. Bytes and counts must be equal to the formulas (floats: sums of
(d - 1) / d terms, equal to 1e-12 relative).
"""
import math

import pytest
import torch
import torch.nn.functional as F

from course.costs import measured_cost
from course.impl import load, reference
from course.late_collectives import check_waited, late_group  # collectives that deliver only at wait()
from course.launch import RankFailed, RankTimeout, run_ranks

dp = load("m14_data_parallel")
ts = load("m14_train_step")
zero = load("m14_zero")
costs = load("m14_costs")
m00 = reference("m00_monolith")

f64 = torch.float64
MLP = m00.MLPConfig(hidden=16, layers=6, batch=8)
LR, STEPS, TOLERANCE = 1e-2, 3, 1e-12
MAX_NORM = 0.2  # the gradient norms are about 0.76, 0.11 and 0.28: clipping acts on steps 0 and 2, not 1 (checked)


def mlp_batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(MLP.batch, MLP.hidden, generator=g).to(f64), torch.randint(0, MLP.classes, (MLP.batch,), generator=g)


def one_process(max_norm):
    """The weights after STEPS steps on the whole batch, and every step's gradient norm before clipping."""
    model = m00.build_model(MLP).to(f64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    norms = []
    for step in range(STEPS):
        optimizer.zero_grad()
        F.cross_entropy(model(mlp_batch(step)[0]), mlp_batch(step)[1]).backward()
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()], norms


def bytes_of_storages(tensors) -> int:
    """The bytes of the distinct memory blocks behind `tensors` (a view counts its whole buffer, once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}
    return sum(storages.values())


def flat_bucket(bucket, grads: dict[str, torch.Tensor]) -> torch.Tensor:
    """`grads` (by parameter name) laid out as the bucket's padded flat buffer."""
    flat = torch.zeros(bucket.padded_numel, dtype=f64)
    for name, start in zip(bucket.names, bucket.offsets):
        flat[start:start + grads[name].numel()] = grads[name].reshape(-1)
    return flat


def _stages(mesh, n_microbatches, max_norm, cap):
    group = late_group(mesh)
    results, summed = {}, {}  # summed: ZeRO-0's gradients at the first optimizer step, by name
    for stage in (0, 1, 2):
        model = m00.build_model(MLP).to(f64)
        ddp = (dp.replicate(model, group, cap) if stage == 0 else
               dp.replicate(model, group, cap, zero.ZeroDataParallel, stage=stage))
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=LR)
        whole, shards, norms = [], [], []  # at the first step: each .grad, ZeRO-2's gradient shards; every clip
        step_of = ddp.step

        def step(optimizer, max_norm=None, step_of=step_of, whole=whole, shards=shards, model=model, ddp=ddp):
            if not whole:
                whole.extend(None if p.grad is None else p.grad.clone() for p in model.parameters())
                shards.extend(g.clone() for g in getattr(ddp, "grad_shards", []))
            return step_of(optimizer, max_norm)
        ddp.step = step
        if stage > 0:
            clip_of = ddp.clip_grad_norm_

            def clip(max_norm, clip_of=clip_of, norms=norms, ddp=ddp):
                def squares():  # of this rank's shards
                    return sum((ddp.grad_shard(k).double() ** 2).sum().item() for k in range(len(ddp.buckets)))
                before = squares()
                norm = clip_of(max_norm)
                norms.append((float(norm), math.sqrt(squares() / before)))  # the norm it returned, the factor applied
                return norm
            ddp.clip_grad_norm_ = clip
        del group.collectives.pending_at_start[:]
        for s in range(STEPS):
            del group.collectives.log[:]
            ts.train_step(ddp, model, *mlp_batch(s), n_microbatches, optimizer, max_norm)
            check_waited(group)
        if stage == 0:
            summed = {name: g for (name, _), g in zip(model.named_parameters(), whole)}
        grads = [p.grad for p in model.parameters()] + [b.grads for b in ddp.buckets] + list(getattr(ddp, "grad_shards", []))
        size = [b.padded_numel // group.size for b in ddp.buckets]
        results[stage] = {
            "weights": [p.detach().clone() for p in model.parameters()], "whole grads": whole, "norms": norms,
            # ZeRO-2: this rank's gradient shards against slice `index` of ZeRO-0's summed buckets
            "shard gaps": [(g - flat_bucket(b, summed)[group.index * n:(group.index + 1) * n]).abs().max().item()
                           for g, b, n in zip(shards, ddp.buckets, size)],
            "in flight": [(label, others) for op, label, others in group.collectives.pending_at_start
                          if op == "reduce_scatter" and others],
            "sent": measured_cost(group.collectives.log),  # the last step's collectives
            "kept": {"parameters": bytes_of_storages(model.parameters()), "gradients": bytes_of_storages(grads),
                     "optimizer": sum(state[k].nbytes for state in optimizer.state.values()
                                      for k in ("exp_avg", "exp_avg_sq"))},
            "numels": [b.numel for b in ddp.buckets], "d": group.size, "axis": group.axis, "index": group.index,
            # where this rank's optimizer shards (views into the buckets' weights) start, and how long they are
            "shards": [] if stage == 0 else [(s.storage_offset() - w.storage_offset(), s.numel(), w.numel(),
                                              s.stride(0)) for s, w in zip(ddp.parameters(), ddp.weights)]}
    return results


# name: (mesh, ranks, micro-steps, max_norm, bucket cap). Cap 5000 bytes: 3 buckets of the MLP; 3000: 4 buckets
# (layers 5 .. head, 3 .. 5, 1 .. 3, 0 .. 1).
CONFIGS = {"2-ranks": (None, 2, 1, None, 5000),
           "4-ranks-2-microbatches-clipped-4-buckets": (None, 4, 2, MAX_NORM, 3000),
           "mesh-d2-t2-clipped": ({"d": 2, "t": 2}, 4, 2, MAX_NORM, 5000)}
_runs = {}


def stages(config: str) -> list[dict]:
    """Every rank's results for one configuration: one run of the ranks, shared by the two checks below."""
    if config not in _runs:
        mesh, world_size, n_microbatches, max_norm, cap = CONFIGS[config]
        try:
            _runs[config] = run_ranks(_stages, world_size, mesh, n_microbatches, max_norm, cap, timeout=90)
        except (RankFailed, RankTimeout) as error:  # the second check reports it too, without running it again
            _runs[config] = error
    if isinstance(_runs[config], Exception):
        raise _runs[config]
    return _runs[config]


@pytest.mark.exercises("ZeroDataParallel.launch",
                        "ZeroDataParallel.step",
                        "ZeroDataParallel.clip_grad_norm_",
                        "shard_range",
                        "DataParallel.ready",
                        "DataParallel.finish",
                        "train_step")
@pytest.mark.parametrize("config", CONFIGS)
def test_zero_1_and_2_train_as_one_process_with_one_bucket_in_flight(config):
    _, _, n_microbatches, max_norm, _ = CONFIGS[config]
    expected, norms = one_process(max_norm)
    if max_norm is not None:
        assert min(norms) < max_norm < max(norms), \
            f"the test's clipping must act on some steps and not others: gradient norms {norms}, max_norm {max_norm}"
    for rank, results in enumerate(stages(config)):
        if config.endswith("4-buckets"):
            assert len(results[0]["numels"]) >= 4, f"this configuration needs 4 buckets at least, got {results[0]['numels']}"
        for stage, r in results.items():
            where = f"rank {rank}, ZeRO-{stage}, m={n_microbatches}{', clipped' if max_norm else ''}"
            gap = max((a - b).abs().max().item() for a, b in zip(r["weights"], expected, strict=True))
            if stage == 0:  # plain data parallelism: none of ZeRO's code runs
                assert gap <= TOLERANCE, (f"{where}: the weights after {STEPS} steps differ by {gap:.2e} from one "
                                          f"process (tolerance {TOLERANCE:g}): DDP's path, your ready, your finish "
                                          f"or your train_step (test_14_data_parallel.py says more)")
                continue
            for k, (start, numel, padded, stride) in enumerate(r["shards"]):
                n = padded // r["d"]
                assert (start, numel, stride) == (r["index"] * n, n, 1), (
                    f"{where}: this rank's optimizer updates {numel} values of bucket {k}'s {padded} weights, from "
                    f"value {start} on, every {stride}; the reduce-scatter delivers member {r['index']} of {r['d']} "
                    f"(its group index) "
                    f"the gradient of values {r['index'] * n} .. {(r['index'] + 1) * n - 1}, and the all-gather puts "
                    f"its shard back there: your shard_range")
            if stage == 1:
                gap_grads = max((a - b).abs().max().item() for a, b in zip(r["whole grads"], results[0]["whole grads"]))
                assert gap_grads <= TOLERANCE, (
                    f"{where}: every parameter's .grad must hold the whole gradient summed over ranks, as DDP's does "
                    f"(differs by {gap_grads:.2e}): ZeroDataParallel.launch all-reduces at stage 1")
            if stage == 2:
                assert all(g is None for g in r["whole grads"]), \
                    f"{where}: ZeRO-2 keeps no parameter's whole gradient (.grad must be None after ready)"
                worst_shard = max(r["shard gaps"], default=0.0)
                assert worst_shard <= TOLERANCE, (
                    f"{where}: this rank's summed gradient shards (bucket by bucket, at the first step) differ by "
                    f"{worst_shard:.2e} from its slice of the gradients summed over ranks: ZeroDataParallel.launch "
                    f"reduce-scatters each bucket into a new bucket.received, which land() adds to the shard")
                for label, others in r["in flight"]:
                    assert not others, (
                        f"{where}: when {label}'s reduce-scatter started, {', '.join(others)}'s was still in flight: "
                        f"each keeps its whole bucket alive until waited for, and ZeRO-2 allows one bucket in flight at "
                        f"most. Your ZeroDataParallel.launch: when it starts a bucket, which bucket's collective "
                        f"may still be running, and what must happen to it first?")
            if max_norm is not None and r["norms"]:  # ZeroDataParallel.step called clip_grad_norm_: once a step
                got = [norm for norm, _ in r["norms"]]
                assert len(got) == STEPS and all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(got, norms)), (
                    f"{where}: your clip_grad_norm_ returned the norms {got}, one process's are {norms} (the norm of "
                    f"the whole gradient, which no rank holds whole: what can a rank compute from its shards alone, and what "
                    f"must the group combine?)")
                factors = [min(1.0, max_norm / (norm + 1e-6)) for norm in norms]
                applied = [factor for _, factor in r["norms"]]
                assert all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(applied, factors)), (
                    f"{where}: your clip_grad_norm_ scaled this rank's shards by {applied}, expected "
                    f"min(1, max_norm / (norm + 1e-6)) = {factors}")
            assert gap <= TOLERANCE, (
                f"{where}: the weights after {STEPS} steps differ by {gap:.2e} from one process (tolerance "
                f"{TOLERANCE:g}), yet the gradients were summed right: ZeroDataParallel.step (each shard's gradient "
                f"attached, AdamW, every bucket all-gathered and waited for), or your shard_range")


@pytest.mark.exercises("traffic",
                        "state",
                        "ZeroDataParallel.launch",
                        "ZeroDataParallel.step",
                        "train_step")
@pytest.mark.parametrize("config", CONFIGS)
def test_zero_bytes_sent_and_kept_equal_the_formulas(config):
    _, _, n_microbatches, max_norm, _ = CONFIGS[config]
    for rank, results in enumerate(stages(config)):
        for stage, r in results.items():
            where = f"rank {rank}, ZeRO-{stage}, m={n_microbatches}{', clipped' if max_norm else ''}"
            kept = costs.state(r["numels"], 8, r["d"], stage).memory
            for what in ("parameters", "gradients", "optimizer"):
                got, want = r["kept"][what], kept.get(what, 0)
                assert got == want, (f"{where}: keeps {got:,} bytes of {what}, your state says {want:,} (the tensors "
                                     f"a rank holds, with buckets of {r['numels']} values)")
            got = r["sent"]
            want = costs.traffic(r["numels"], 8, r["d"], stage, n_microbatches, max_norm is not None, r["axis"])
            same = got.calls == want.calls and all(
                math.isclose(got.sent.get(key, 0), want.sent.get(key, 0), rel_tol=1e-12)
                for key in set(got.sent) | set(want.sent))
            assert same, (f"{where}: a step sends {got.sent} in {got.calls} collectives, your traffic says "
                          f"{want.sent} in {want.calls} (buckets of {r['numels']} values)")


# --- the clipping norm in float64 whatever the gradients' dtype -------------------------------------------

def _float32_norms():
    group = late_group()
    results = {}
    for stage in (1, 2):
        model = m00.build_model(MLP).to(torch.float32)
        ddp = dp.replicate(model, group, 3000, zero.ZeroDataParallel, stage=stage)
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=LR)
        clip_of, seen = ddp.clip_grad_norm_, []

        def clip(max_norm, clip_of=clip_of, seen=seen, ddp=ddp):
            # this rank's squares, summed in float64 from the float32 shards it holds before clipping
            mine = sum((ddp.grad_shard(k).double() ** 2).sum().item() for k in range(len(ddp.buckets)))
            norm = clip_of(max_norm)
            seen.append((mine, float(norm), norm.dtype if isinstance(norm, torch.Tensor) else type(norm)))
            return norm
        ddp.clip_grad_norm_ = clip
        x, y = mlp_batch(0)
        ts.train_step(ddp, model, x.float(), y, 1, optimizer, MAX_NORM)
        check_waited(group)
        results[stage] = seen
    return results


@pytest.mark.exercises("ZeroDataParallel.clip_grad_norm_", "ZeroDataParallel.step")
def test_float32_gradients_clip_by_a_norm_summed_in_float64():
    # The reference: the float32 shards every rank holds, squared and summed in float64 (by rank, then over
    # ranks). A float64 sum of the same squares in another order differs by about 1e-16 relative; we allow
    # 1e-12. A float32 sum of squares (or float32 squares) rounds at about 1e-8 relative.
    runs = run_ranks(_float32_norms, 2, timeout=60)
    for stage in (1, 2):
        if not all(runs[rank][stage] for rank in range(2)):
            continue  # ZeroDataParallel.step never called clip_grad_norm_: the float64 tests say so
        expected = math.sqrt(sum(runs[rank][stage][0][0] for rank in range(2)))
        for rank in range(2):
            _, norm, dtype = runs[rank][stage][0]
            where = f"rank {rank}, ZeRO-{stage}, float32 gradients"
            assert math.isclose(norm, expected, rel_tol=1e-12), (
                f"{where}: your clip_grad_norm_ returned {norm!r}, the norm of every rank's float32 shards summed in "
                f"float64 is {expected!r} (relative error {abs(norm / expected - 1):.1e}, tolerance 1e-12): are the "
                f"squares and their sums float64 whatever the gradients' dtype?")
            assert dtype == torch.float64, (f"{where}: your clip_grad_norm_ returned a norm of {dtype}; the contract "
                                            f"asks for a float64 0-d tensor")
