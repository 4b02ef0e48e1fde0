"""Module 03 - ping-pong.

Two ranks bounce one tensor back and forth. Rank 0 serves; whoever receives the ball adds 1 and
returns it. After `round_trips` round trips rank 0 holds x + 2 round_trips and rank 1 one less,
which checks that every message arrived, in order, intact.

Timing the same exchange measures the link: a round trip of a message of `bytes` bytes costs about
2 (α + bytes / β), α the latency and β the bandwidth. Small messages show the latency, large ones
the bandwidth.
"""
import statistics
import time

import torch

from .m02_comms import PipelineComms


def ping_pong(comms: PipelineComms, x: torch.Tensor, round_trips: int) -> torch.Tensor:
    """Bounce `x` between the two stages of the pipeline `round_trips` times; return the last tensor
    this rank held.

    The first stage (rank 0, in the default group) sends first. The receiver of each message adds 1
    to it before sending it back.
    """
    # >>> TODO(m03): bounce the ball for the given number of round trips, each receiver adding 1
    # Contract: runs on both ranks at once, with the same x and round_trips; comms is the first or
    # the last stage's PipelineComms (comms.pp.index 0 or 1; "rank 0" and "rank 1" below). One
    # round trip is one message each way, so each rank sends exactly round_trips messages. The ball
    # keeps x's shape and dtype. Returns the last ball this rank held: on rank 0 the one it
    # received last (x + 2 round_trips), on rank 1 the one it sent back last (x + 2 round_trips - 1).
    # The invariant: every hop adds exactly 1, so the value counts the messages delivered; a
    # message lost, repeated or taken out of order shows in the count.
    # Pitfalls: both ranks starting with a receive (or both with a send that waits for its
    # receiver) wait for each other: the grader stops them at its timeout and names the line each
    # rank is stuck on. A receive buffer of the comms' default dtype instead of the ball's: the
    # grader bounces a float64 ball, and a buffer of another byte size makes gloo abort the
    # receiving rank ("died without a result", SIGABRT). Adding 1 before sending, or returning
    # on rank 1 what it received rather than what it sent back, is off by one: the grader prints
    # what each rank holds. An extra message: the grader counts every rank's sends.
    # Hint 1: Rank 0 serves: each round it sends the ball and waits for it to come back. Rank 1
    #         mirrors it: each round it waits for the ball and sends it back. Whoever receives
    #         adds 1 at once, so the ball a rank holds is always the latest count.
    # Hint 2: the pipeline verbs: first stage send_forward then recv_backward, last stage
    #         recv_forward then send_backward; receives are sized with x.shape and x.dtype;
    #         comms.pp.index says which side this is (0: the first stage).
    # Hint 3: ball <- x
    #         repeat round_trips times:
    #             first stage: send ball forward; ball <- (receive backward, x's shape and dtype) + 1
    #             last stage: ball <- (receive forward, x's shape and dtype) + 1; send ball backward
    #         return ball
    ball = x
    for _ in range(round_trips):
        if comms.pp.index == 0:
            comms.send_forward(ball)
            ball = comms.recv_backward(x.shape, x.dtype) + 1
        else:
            ball = comms.recv_forward(x.shape, x.dtype) + 1
            comms.send_backward(ball)
    return ball
    # <<<


def time_round_trip(comms: PipelineComms, numel: int, repeats: int = 20, warmup: int = 3) -> float:
    """Median seconds per round trip of a float32 tensor of `numel` elements (on both ranks).

    The first `warmup` round trips are not timed: they pay for connection set-up and first-touch
    memory, which are not what we want to measure.
    """
    # >>> TODO(m03): time single round trips of a numel-element ball and return their median
    # Contract: runs on both ranks at once, with the same arguments. Plays warmup + repeats round
    # trips of a float32 ball of numel elements on comms.device; the first `warmup` are not
    # timed; each of the next `repeats` is timed on its own; returns the median of those
    # durations, in seconds (a float). Each rank therefore sends warmup + repeats messages.
    # Why the median: a round trip takes 2 * (latency + bytes / bandwidth) plus noise that only
    # ever adds time (the scheduler, another process); the median of single round trips ignores
    # the odd slow one, where a mean (or the total divided by repeats) absorbs it.
    # Pitfalls: both ranks must play the same number of round trips, or one waits forever for the
    # other. The grader counts the messages (warmup + repeats) and replaces the module's clock
    # (the `time` module imported above: read the clock through it) with a scripted one whose
    # round trips take known durations: it expects exactly the median of the timed ones, not
    # their mean, their sum, or a median over rounds that include warm-ups.
    # Hint 1: Play the warm-up rounds untimed; then, one round trip at a time, read the clock
    #         before and after and keep the difference; return the middle value of those.
    # Hint 2: ping_pong with round_trips=1 is one round trip; time.perf_counter() reads the clock;
    #         statistics.median(list); torch.zeros(numel, device=comms.device) is a ball.
    # Hint 3: ball <- float32 zeros of numel elements on comms.device
    #         warmup times: one round trip
    #         repeats times: start <- clock; one round trip; append clock - start
    #         return the median of what was appended
    ball = torch.zeros(numel, device=comms.device)
    for _ in range(warmup):
        ping_pong(comms, ball, 1)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        ping_pong(comms, ball, 1)
        times.append(time.perf_counter() - start)
    return statistics.median(times)
    # <<<

