"""Module 19 detection: stragglers named from 8 to 16 ranks' step times (where the mean and the median of the
ranks differ), the heartbeat's timeout from measured step times (warm-up and save steps among them), and a
real hang: on 4 forked ranks training module 17's model, rank 3 stops in the middle of the run and every other
rank's heartbeat expires within the timeout it chose from its own measured steps.

The reference for the timing test is the clock: each survivor's expiry comes after the hang began and within
its timeout plus one step and a second of the machine's scheduling (2 cores shared by 4 ranks and other jobs).
"""
import dataclasses
import time

import pytest
import torch
import torch.distributed as dist

from course.chars import load_chars
from course.impl import load, reference
from course.launch import run_ranks
from course.mesh import init_mesh

detect = load("m19_detect")
trainer, given = reference("m17_trainer"), reference("m17_composition")
given_detect = reference("m19_detect")   # Heartbeat: given code

TEXT = load_chars()
CFG = dataclasses.replace(given.CONFIG, vocab_size=TEXT.vocab_size)


def steady(ranks: int, steps: int, seed: int = 0) -> torch.Tensor:
    """Healthy step times near 1 s: +-5 % of noise."""
    return 1 + 0.1 * (torch.rand(ranks, steps, generator=torch.Generator().manual_seed(seed)) - 0.5)


@pytest.mark.exercises("stragglers")
def test_two_slow_ranks_of_eight_are_both_named():
    times = steady(8, 9)
    times[2] *= 1.6
    times[5] *= 1.6   # the mean of the ranks is 1.15: neither is 1.5 times that
    got = detect.stragglers(times, 1.5)
    assert got == [2, 5], f"ranks 2 and 5 take 1.6 s a step, the 6 others 1 s (factor 1.5): your stragglers {got}"


@pytest.mark.exercises("stragglers")
def test_one_long_pause_makes_no_straggler():
    times = steady(12, 9, seed=1)
    times[7, 4] = 20.0   # one step of rank 7 paused (a collection, a save): its mean step is 3.1 s
    got = detect.stragglers(times, 1.5)
    assert got == [], f"12 ranks at 1 s a step, rank 7 once 20 s (factor 1.5): your stragglers {got}, want none"


@pytest.mark.exercises("stragglers")
def test_a_fast_rank_makes_no_straggler_of_the_others():
    times = steady(10, 9, seed=4)
    times[0] *= 0.5   # rank 0 has less to do (the last stage without the LM head, say): the others are not slow
    got = detect.stragglers(times, 1.5)
    assert got == [], f"10 ranks at 1 s a step, rank 0 at 0.5 s (factor 1.5): your stragglers {got}, want none"


@pytest.mark.exercises("stragglers")
def test_a_slower_straggler_is_still_the_only_one():
    for slowdown in (2.0, 4.0, 50.0):
        times = steady(16, 7, seed=2)
        times[11] *= slowdown
        got = detect.stragglers(times, 1.5)
        assert got == [11], f"16 ranks, rank 11 {slowdown} times slower (factor 1.5): your stragglers {got}"
    got = detect.stragglers(steady(16, 7, seed=3), 1.2)
    assert got == [], f"16 healthy ranks (+-5 %), factor 1.2: your stragglers {got}"


@pytest.mark.exercises("step_timeout")
def test_the_timeout_follows_the_usual_step_not_its_outliers():
    healthy = [0.5, 0.52, 0.48, 0.51, 0.49, 0.5, 0.53, 0.47]
    measured = [6.0] + healthy + [1.5]   # a warm-up step, then healthy ones and one that saved a checkpoint
    got = detect.step_timeout(measured, 4.0)
    assert 4 * min(healthy) <= got <= 4 * max(healthy), (
        f"steps of about 0.5 s, a warm-up of 6 s and a save of 1.5 s among them, slack 4: your step_timeout "
        f"{got:.3f} s; 4 times the usual step is {4 * min(healthy):.2f} to {4 * max(healthy):.2f} s")
    scaled = detect.step_timeout([10 * t for t in measured], 4.0)
    assert scaled == pytest.approx(10 * got), f"steps 10 times longer: timeout {scaled:.3f} s, was {got:.3f} s"
    tiny = detect.step_timeout([0.01] * 5, 4.0)
    assert tiny == detect.MIN_TIMEOUT_S, (f"steps of 10 ms, slack 4: your step_timeout {tiny} s; never below "
                                         f"MIN_TIMEOUT_S ({detect.MIN_TIMEOUT_S} s)")


def _hang_rank_3(hang_at: int, steps: int, slack: float):
    """Train module 17's model (p = 2, t = 2) with a heartbeat after every step; after 4 steps, its timeout from
    their times (the learner's step_timeout); rank 3 then stops at step hang_at, silent with its connections
    open, until every other rank's heartbeat has expired, and leaves: its connections close, and each rank
that then fails leaves too, as the processes would under torchrun. Returns (what,
    when, timeout, the longest step): ("expired", ...) where the heartbeat expired, ("hung", ...) on rank 3."""
    mesh = init_mesh(given.full_sizes({"p": 2, "t": 2}))
    model = trainer.ComposedLlama(CFG, mesh, 2, "1f1b", dtype=torch.float64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    expired = []
    heartbeat = given_detect.Heartbeat(60.0, on_expiry=lambda late, where: expired.append(time.time()))
    times, timeout = [], None
    try:
        for step in range(steps):
            tokens = torch.randint(0, CFG.vocab_size, (8, CFG.max_seq_len + 1), generator=generator)
            if step == 4:
                heartbeat.timeout = timeout = detect.step_timeout(times, slack)
                longest = torch.tensor([timeout])
                dist.all_reduce(longest, op=dist.ReduceOp.MAX)
            if step == hang_at and dist.get_rank() == 3:
                began = time.time()
                time.sleep(min(20.0, longest.item() + 2 * max(times) + 1))
                dist.destroy_process_group()
                return ("hung", began, timeout, max(times))
            began = time.perf_counter()
            try:
                model.train_step(tokens[:, :-1], tokens[:, 1:], 2, optimizer)
            except RuntimeError:   # a peer left: leave too (closing this rank's connections), as a process would
                dist.destroy_process_group()
                break
            times.append(time.perf_counter() - began)
            heartbeat.beat()
    finally:
        heartbeat.stop()
    return ("expired" if expired else "no expiry", expired[0] if expired else None, timeout, max(times))


@pytest.mark.exercises("step_timeout")
def test_a_hung_rank_surfaces_on_every_other_rank_within_the_timeout():
    results = run_ranks(_hang_rank_3, 4, 6, 12, 10.0, timeout=90)
    kind, hung_at, *_ = results[3]
    assert kind == "hung", results
    for rank, (kind, when, timeout, step) in enumerate(results[:3]):
        assert kind == "expired", (f"rank 3 stopped at step 6 and stayed silent; rank {rank}'s heartbeat never "
                                   f"expired (its timeout: your step_timeout gave {timeout:.1f} s from steps of at "
                                   f"most {step:.3f} s)")
        late = when - hung_at
        assert 0 < late <= timeout + step + 1.0, (
            f"rank {rank}'s heartbeat expired {late:.2f} s after rank 3 stopped; its timeout (your step_timeout) "
            f"was {timeout:.2f} s, a step {step:.3f} s")
