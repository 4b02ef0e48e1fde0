"""Module 03's planted bugs (ping-pong): see course/mutants/__init__.py."""
from course.mutants import Plant

F = "m03_ping_pong.py"
PLANTS = [
    Plant(F, "ball = comms.recv_forward(x.shape, x.dtype) + 1", "ball = comms.recv_forward(x.shape, x.dtype)",
          "rank 1 returns the ball without adding 1: the count no longer proves every message arrived"),
    Plant(F, "ball = comms.recv_backward(x.shape, x.dtype) + 1", "ball = comms.recv_backward(x.shape, x.dtype)",
          "rank 0 does not add 1 to what it receives: each receiver must, or rank 0 ends with x + n"),
    Plant(F, "ball = comms.recv_forward(x.shape, x.dtype) + 1", "ball = comms.recv_forward(x.shape) + 1",
          "the receive buffer takes the comms' default dtype, not the ball's: a float64 ball arrives garbled"),
    Plant(F, "    for _ in range(warmup):\n        ping_pong(comms, ball, 1)\n", "",
          "no warm-up: the first round trips pay for connection set-up and first-touch memory, not the link"),
    Plant(F, "\n    return statistics.median(times)", "\n    return statistics.mean(times)",
          "the mean, not the median: one round trip slowed by a busy CPU drags the latency measured"),
    Plant(F, "\n    return statistics.median(times)", "\n    return statistics.median_low(times)",
          "median_low: for an even number of repeats the median is the mean of the middle two, not the lower"),
    Plant(F, "ball = torch.zeros(numel, device=comms.device)", "ball = torch.zeros(numel // 4, device=comms.device)",
          "numel read as bytes: a ball of a quarter of the elements asked for, so the bandwidth fit is off"),
    Plant(F, """        start = time.perf_counter()
        ping_pong(comms, ball, 1)
        times.append(time.perf_counter() - start)""",
          """        start = time.perf_counter()
        ping_pong(comms, ball, 1)
        times.append((time.perf_counter() - start) / 2)""",
          "half a round trip returned as if one-way: the contract is seconds per round trip"),
    Plant(F, "            ball = comms.recv_forward(x.shape, x.dtype) + 1\n            comms.send_backward(ball)\n",
          "            ball = comms.recv_forward(x.shape, x.dtype)\n            comms.send_backward(ball + 1)\n",
          "rank 1 adds 1 as it sends, not on receipt: it returns a ball one below the last it sent back", new=True),
    Plant(F, "ball = torch.zeros(numel, device=comms.device)", "ball = torch.zeros(numel)",
          "the ball made on the CPU whatever the comms' device: on a GPU rank the round trips go through host memory",
          new=True),
]
