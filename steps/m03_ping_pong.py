# Generated from solutions/m03_ping_pong.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 03`. (skeleton 6012d070d206)
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
    # TODO(m03): bounce the ball for the given number of round trips, each receiver adding 1
    # Contract: runs on both ranks at once, with the same x and round_trips; comms is the first or
    # the last stage's PipelineComms (comms.pp.index 0 or 1; "rank 0" and "rank 1" below). One
    # round trip is one message each way, so each rank sends exactly round_trips messages, with
    # the pipeline's verbs. The ball keeps x's shape and dtype. Returns the last ball this rank
    # held: on rank 0 the one it received last, x + 2 round_trips; on rank 1 the one it sent back
    # last, x + 2 round_trips - 1.
    # The invariant: every hop adds exactly 1, so the value counts the messages delivered; a
    # message lost, repeated or taken out of order shows in the count.
    # The question: which verbs does each rank call, in which order, so that every call has its
    # partner on the other rank at the same moment of the game?
    # Pitfalls: what happens when both ranks start by waiting for the other (the grader stops
    # them at its timeout and names the line each is stuck on)? Which shape and dtype does a
    # receive of the ball need (the grader bounces a float64 ball of 2 x 3)? On which side of a
    # send must the + 1 be for rank 1 to end one below rank 0?
    raise NotImplementedError('TODO(m03): bounce the ball for the given number of round trips, each receiver adding 1')


def time_round_trip(comms: PipelineComms, numel: int, repeats: int = 20, warmup: int = 3) -> float:
    """Median seconds per round trip of a float32 tensor of `numel` elements (on both ranks).

    The first `warmup` round trips are not timed: they pay for connection set-up and first-touch
    memory, which are not what we want to measure.
    """
    # TODO(m03): time single round trips of a numel-element ball and return their median
    # Contract: runs on both ranks at once, with the same arguments. Plays warmup + repeats round
    # trips of a float32 ball of numel elements on comms.device; the first `warmup` are not
    # timed, each of the next `repeats` is timed on its own, and the result is the median of
    # those durations, in seconds (a float). Each rank therefore sends warmup + repeats messages.
    # The grader replaces the module's clock (the `time` module imported above: read the clock
    # through it) with a scripted one whose round trips take known durations.
    # The question: why single round trips and their median, rather than one long timed loop?
    # Pitfalls: what happens if the two ranks do not play the same number of round trips? With
    # an even number of timed round trips, which value is the median? Does the first round trip
    # of a fresh connection measure the link?
    raise NotImplementedError('TODO(m03): time single round trips of a numel-element ball and return their median')

