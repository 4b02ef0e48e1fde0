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


def test_timer_runs_warmup_plus_timed_round_trips():
    results = run_ranks(_time, 2, 1000, 7, 2, timeout=20)
    for rank, (seconds, sent) in enumerate(results):
        assert sent == 2 + 7, f"rank {rank} sent {sent} messages, expected warmup + repeats = 9"
        assert 0 < seconds < 1, f"rank {rank}: {seconds} s per round trip is not a plausible median"
