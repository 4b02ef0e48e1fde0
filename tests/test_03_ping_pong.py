"""Module 03: the ball must come back incremented once per hop, and the timer must really time."""
import pytest
import torch
import torch.distributed as dist

from course.impl import load, reference
from course.launch import run_ranks

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


def _play(round_trips):
    comms = CountingComms(dist.get_rank(), 2)
    ball = m03.ping_pong(comms, torch.arange(6, dtype=torch.float64), round_trips)
    return ball, comms.sent


@pytest.mark.exercises("ping_pong")
@pytest.mark.parametrize("round_trips", [1, 5])
def test_each_hop_adds_one(round_trips):
    (ball0, sent0), (ball1, sent1) = run_ranks(_play, 2, round_trips, timeout=20)
    start = torch.arange(6, dtype=torch.float64)
    assert torch.equal(ball0, start + 2 * round_trips), f"rank 0 holds {ball0.tolist()}"
    assert torch.equal(ball1, start + 2 * round_trips - 1), f"rank 1 holds {ball1.tolist()}"
    assert sent0 == sent1 == round_trips, f"messages sent: rank 0 {sent0}, rank 1 {sent1}, expected {round_trips} each"


def _time(numel, repeats, warmup):
    comms = CountingComms(dist.get_rank(), 2)
    seconds = m03.time_round_trip(comms, numel, repeats=repeats, warmup=warmup)
    return seconds, comms.sent


@pytest.mark.exercises("ping_pong", "time_round_trip")
def test_timer_runs_warmup_plus_timed_round_trips():
    results = run_ranks(_time, 2, 1000, 7, 2, timeout=20)
    for rank, (seconds, sent) in enumerate(results):
        assert sent == 2 + 7, f"rank {rank} sent {sent} messages, expected warmup + repeats = 9"
        assert 0 < seconds < 1, f"rank {rank}: {seconds} s per round trip is not a plausible median"


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

    def __init__(self, rank, clock):
        self.rank, self.world_size, self.device, self.clock = rank, 2, torch.device("cpu"), clock
        self.prev, self.next = (None, 1) if rank == 0 else (0, None)

    def send_forward(self, tensor):
        self.clock.tick()

    def recv_backward(self, shape, dtype=None):
        return torch.zeros(shape, dtype=dtype or torch.float32)

    def recv_forward(self, shape, dtype=None):
        self.clock.tick()
        return torch.zeros(shape, dtype=dtype or torch.float32)

    def send_backward(self, tensor):
        pass


@pytest.mark.exercises("ping_pong", "time_round_trip")
@pytest.mark.parametrize("rank", [0, 1])
def test_timer_returns_the_median_of_the_timed_round_trips(rank, monkeypatch):
    # Two slow warm-ups, then seven timed round trips whose median (1.0) differs from their mean
    # (3.98), their sum (27.875), the median with the warm-ups timed too (2.0) and the median of the
    # first seven round trips (8.0). Powers of two: every difference of clock readings is exact.
    warmups, timed = [64.0, 32.0], [0.5, 8.0, 0.25, 1.0, 16.0, 0.125, 2.0]
    clock = ScriptedClock(warmups + timed)
    monkeypatch.setattr(m03, "time", clock)  # the module reads time.perf_counter through its global `time`
    seconds = m03.time_round_trip(ClockedComms(rank, clock), 10, repeats=7, warmup=2)
    assert not clock.durations, f"{len(clock.durations)} of the 9 round trips were not played"
    assert seconds == 1.0, \
        f"rank {rank}: got {seconds}; the median of the timed round trips {sorted(timed)} is 1.0 (warm-ups excluded)"
