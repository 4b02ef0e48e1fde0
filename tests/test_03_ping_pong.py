"""Module 03: the ball must come back incremented once per hop, and the timer must really time."""
import statistics

import pytest
import torch
import torch.distributed as dist

from course.impl import load, reference
from course.launch import run_ranks
from course.mesh import group_of

m03 = load("m03_ping_pong")
ReferenceComms = reference("m02_comms").PipelineComms  # grade this module, not module 02


class CountingComms(ReferenceComms):
    """Reference comms that count the messages this rank sends."""

    sent = 0

    def send_forward(self, tensor):
        self.sent += 1
        super().send_forward(tensor)

    def send_backward(self, tensor):
        self.sent += 1
        super().send_backward(tensor)


def _start():
    # float64 (not the comms' float32) and two dimensions: the receive buffers must take both from the ball
    return torch.arange(6, dtype=torch.float64).reshape(2, 3)


def _play(round_trips, members=None):
    """One ping-pong on every rank of 2 (members None), or between the two `members` of 3 ranks, in
    that order (the third rank waits)."""
    if members is not None and dist.get_rank() not in members:
        return None, 0
    comms = CountingComms() if members is None else CountingComms(group_of("p", members.index(dist.get_rank()), members))
    ball = m03.ping_pong(comms, _start(), round_trips)
    return ball, comms.sent


@pytest.mark.exercises("ping_pong")
@pytest.mark.parametrize("round_trips, members", [(1, None), (5, None), (3, (2, 1))],
                         ids=["1 round trip", "5 round trips", "3 round trips, pipeline of ranks (2, 1)"])
def test_each_hop_adds_one(round_trips, members):
    # With members (2, 1), rank 2 is the pipeline's first stage (comms.pp.index 0) and serves.
    results = run_ranks(_play, 3 if members else 2, round_trips, members, timeout=20)
    (ball0, sent0), (ball1, sent1) = [results[r] for r in members] if members else results
    start = _start()
    names = [f"rank {r} (stage {k} of the pipeline {members})" for k, r in enumerate(members)] if members \
        else ["rank 0", "rank 1"]
    for stage, ball, hops in [(0, ball0, 2 * round_trips), (1, ball1, 2 * round_trips - 1)]:
        expected = start + hops
        assert isinstance(ball, torch.Tensor) and ball.shape == expected.shape and ball.dtype == expected.dtype, \
            (f"your ping_pong on {names[stage]} returned {ball!r}, expected a {tuple(expected.shape)} {expected.dtype} ball like the one "
             "served: size the receives with the ball's own shape and dtype")
        assert torch.equal(ball, expected), \
            (f"your ping_pong: {names[stage]} holds {ball.tolist()} after {round_trips} round trips, expected {expected.tolist()} "
             f"(x + {hops}: every hop adds 1, and the {'first' if stage == 0 else 'last'} stage returns the last ball "
             f"it {'received' if stage == 0 else 'sent back'}; the first stage, comms.pp.index 0, serves)")
    assert sent0 == sent1 == round_trips, \
        f"your ping_pong sent messages: {names[0]} {sent0}, {names[1]} {sent1}, expected {round_trips} each"


def _time(numel, repeats, warmup):
    comms = CountingComms()
    seconds = m03.time_round_trip(comms, numel, repeats=repeats, warmup=warmup)
    return seconds, comms.sent


@pytest.mark.exercises("time_round_trip", "ping_pong")
def test_timer_runs_warmup_plus_timed_round_trips():
    results = run_ranks(_time, 2, 1000, 7, 2, timeout=20)
    for rank, (seconds, sent) in enumerate(results):
        assert sent == 2 + 7, \
            (f"rank {rank}: your time_round_trip(comms, 1000, repeats=7, warmup=2) sent {sent} messages, expected "
             "warmup + repeats = 9 (one per round trip)")
        assert 0 < seconds < 1, f"rank {rank}: {seconds} s per round trip from your time_round_trip is not a plausible median"


class ScriptedClock:
    """A stand-in for the time module whose perf_counter() moves only when the comms tick it, once
    per round trip: round trip i takes exactly durations[i] seconds, however often the clock is read."""

    def __init__(self, durations):
        self.now, self.durations = 1000.0, list(durations)

    def perf_counter(self):
        return self.now

    time = monotonic = perf_counter  # whichever clock the timer reads

    def perf_counter_ns(self):
        return round(self.now * 1e9)

    time_ns = monotonic_ns = perf_counter_ns

    def tick(self):
        assert self.durations, "more round trips than warmup + repeats"
        self.now += self.durations.pop(0)


class ClockedComms:
    """One side of a ping-pong without a peer: each round trip advances the clock by its scripted
    duration (rank 0 sends once per round trip, rank 1 receives once), and every receive returns a ball."""

    def __init__(self, rank, clock, device):
        self.pp, self.rank, self.device, self.clock = group_of("p", rank, (0, 1)), rank, torch.device(device), clock
        self.prev, self.next = (None, 1) if rank == 0 else (0, None)
        self.sent, self.received = [], []  # what went out (shape, dtype, device), what was asked for (shape, dtype)

    def send_forward(self, tensor):
        self.sent.append((tuple(tensor.shape), tensor.dtype, tensor.device.type))
        self.clock.tick()

    def recv_backward(self, shape, dtype=None):
        self.received.append((tuple(shape), dtype or torch.float32))
        return torch.zeros(shape, dtype=dtype or torch.float32, device=self.device)

    def recv_forward(self, shape, dtype=None):
        self.received.append((tuple(shape), dtype or torch.float32))
        self.clock.tick()
        return torch.zeros(shape, dtype=dtype or torch.float32, device=self.device)

    def send_backward(self, tensor):
        self.sent.append((tuple(tensor.shape), tensor.dtype, tensor.device.type))


# Slow warm-ups, then timed round trips whose median differs from their mean, their sum, the median
# with the warm-ups timed too and the median of the first `repeats` round trips. Seven timed: median
# 1.0 (mean 3.98, sum 27.875, with warm-ups 2.0, first seven 8.0). Six timed, an even count like the
# default repeats=20: the median is the mean of the two middle values, 1.5, not the lower (1.0) or
# the upper (2.0) one. Powers of two: every difference of clock readings is exact.
TIMER_CASES = [([64.0, 32.0], [0.5, 8.0, 0.25, 1.0, 16.0, 0.125, 2.0], 1.0),
               ([64.0], [0.5, 8.0, 0.25, 1.0, 16.0, 2.0], 1.5)]


@pytest.mark.exercises("time_round_trip", "ping_pong")
@pytest.mark.parametrize("warmups, timed, median", TIMER_CASES, ids=["7 timed", "6 timed"])
@pytest.mark.parametrize("rank", [0, 1])
def test_timer_returns_the_median_of_the_timed_round_trips(rank, warmups, timed, median, monkeypatch):
    clock = ScriptedClock(warmups + timed)
    monkeypatch.setattr(m03, "time", clock)  # the module reads time.perf_counter through its global `time`
    # The comms' device is "meta" (shape and dtype, no data), a stand-in for a GPU: a ball left on
    # the CPU shows as "cpu" in what rank 0 sends.
    comms = ClockedComms(rank, clock, "meta")
    seconds = m03.time_round_trip(comms, 10, repeats=len(timed), warmup=len(warmups))
    total = len(warmups) + len(timed)
    assert not clock.durations, \
        f"your time_round_trip left {len(clock.durations)} of the {total} round trips (warmup + repeats) unplayed"
    balls = set(comms.sent) | {(shape, dtype, "meta") for shape, dtype in comms.received}
    assert balls == {((10,), torch.float32, "meta")}, \
        (f"rank {rank}: your time_round_trip(comms, numel=10) bounced balls of (shape, dtype, device) {sorted(balls, key=str)}, "
         "expected a float32 ball of 10 elements on comms.device, ((10,), torch.float32, 'meta')")
    assert seconds == median, \
        (f"rank {rank}: your time_round_trip returned {seconds}; the median of the timed round trips "
         f"{sorted(timed)} is {median} (warm-ups excluded; with an even count, the mean of the two middle values)" +
         _what_it_looks_like(seconds, warmups, timed))


def _what_it_looks_like(seconds, warmups, timed):
    """What a wrong result equals, if it equals a likely mistake's."""
    guesses = {"their mean": statistics.mean(timed), "their sum": sum(timed), "half the median": statistics.median(timed) / 2,
               "the lower of the two middle values": statistics.median_low(timed),
               "the upper of the two middle values": statistics.median_high(timed),
               "the median with the warm-ups timed too": statistics.median(warmups + timed),
               "the median of the first rounds, warm-ups included": statistics.median((warmups + timed)[:len(timed)])}
    named = [name for name, value in guesses.items() if value == seconds]
    return f"; {seconds} is {' and '.join(named)}" if named else ""
