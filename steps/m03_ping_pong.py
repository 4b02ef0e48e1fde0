# Generated from solutions/m03_ping_pong.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 03`. (skeleton eb427886b74b)
"""Module 03 - ping-pong.

Two ranks bounce one tensor back and forth. Rank 0 serves; whoever receives the ball adds 1 and
returns it. After n round trips rank 0 holds x + 2n and rank 1 holds x + 2n - 1, which checks that
every message arrived, in order, intact.

Timing the same exchange measures the link: a round trip of an n-byte message costs about
2 * (latency + n / bandwidth). Small messages show the latency, large ones the bandwidth.
"""
import statistics
import time

import torch

from .m02_comms import PipelineComms


def ping_pong(comms: PipelineComms, x: torch.Tensor, round_trips: int) -> torch.Tensor:
    """Bounce `x` between ranks 0 and 1 `round_trips` times; return the last tensor this rank held.

    Rank 0 sends first. The receiver of each message adds 1 to it before sending it back.
    """
    # TODO(m03): rank 0 sends then receives; rank 1 receives then sends; +1 on every receipt
    # Hint: rank 0 is the first stage (send_forward / recv_backward), rank 1 the last
    #       (recv_forward / send_backward); x.shape and x.dtype size the receive buffers.
    # Hint: rank 1 must return what it last *received* plus 1 (the ball it sent back).
    raise NotImplementedError('TODO(m03): rank 0 sends then receives; rank 1 receives then sends; +1 on every receipt')


def time_round_trip(comms: PipelineComms, numel: int, repeats: int = 20, warmup: int = 3) -> float:
    """Median seconds per round trip of a float32 tensor of `numel` elements (on both ranks).

    The first `warmup` round trips are not timed: they pay for connection set-up and first-touch
    memory, which are not what we want to measure.
    """
    # TODO(m03): run warmup + repeats round trips; time each timed one; return the median
    # Hint: one round trip is ping_pong(comms, ball, 1); time it with time.perf_counter().
    # Hint: statistics.median of the per-round-trip times resists the odd slow one.
    raise NotImplementedError('TODO(m03): run warmup + repeats round trips; time each timed one; return the median')

