"""Benchmark 03: round-trip time between two ranks versus message size, and the alpha-beta model.

A message of `bytes` bytes costs about t = α + bytes / β one way: α is the fixed latency
(software stack, synchronisation), β the bandwidth. We fit both to the measurements by least
squares and print the model's prediction beside every measurement, so you can see where the
model holds (and where it does not, e.g. when a message no longer fits in a cache).
"""
import argparse

from course.bench import report, require_positive
from course.impl import load
from course.launch import run_ranks

SIZES = [1 << k for k in range(0, 23, 2)]  # float32 elements: 4 B .. 16 MiB


def measure(sizes, repeats):
    """On each of 2 ranks: the median seconds per round trip for each size (float32 elements), with
    the selected implementation (`main.py bench 03 --impl`, or COURSE_IMPL in the notebook)."""
    m02, m03 = load("m02_comms"), load("m03_ping_pong")
    comms = m02.PipelineComms()  # both ranks of the job: a pipeline of two stages
    return [m03.time_round_trip(comms, numel, repeats=repeats) for numel in sizes]


def fit_alpha_beta(nbytes: list[float], one_way: list[float]) -> tuple[float, float]:
    """Fit t = α + bytes / β minimising *relative* error (weights 1/t^2), so the small messages
    set alpha and the large ones beta; returns (alpha seconds, beta bytes per second)."""
    w = [1 / t ** 2 for t in one_way]
    sw, sx, st = sum(w), sum(wi * x for wi, x in zip(w, nbytes)), sum(wi * t for wi, t in zip(w, one_way))
    sxx = sum(wi * x * x for wi, x in zip(w, nbytes))
    sxt = sum(wi * x * t for wi, x, t in zip(w, nbytes, one_way))
    slope = (sw * sxt - sx * st) / (sw * sxx - sx * sx)
    return (st - slope * sx) / sw, 1.0 / slope


def main(argv):
    parser = argparse.ArgumentParser(prog="main.py bench 03", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    require_positive(parser, args, "repeats")
    seconds = run_ranks(measure, 2, SIZES, args.repeats, timeout=300)[0]
    nbytes = [4 * s for s in SIZES]
    one_way = [t / 2 for t in seconds]
    alpha, beta = fit_alpha_beta(nbytes, one_way)
    rows = [{"bytes": b, "one_way_us": t * 1e6, "model_us": (alpha + b / beta) * 1e6,
             "measured/model": t / (alpha + b / beta), "bandwidth_GB/s": b / t / 1e9}
            for b, t in zip(nbytes, one_way)]
    report("bench-03", "Ping-pong between 2 gloo ranks: measured one-way time vs alpha-beta model",
           rows, notes=f"fit: alpha = {alpha * 1e6:.1f} us latency, beta = {beta / 1e9:.2f} GB/s "
                       f"(median of {args.repeats} round trips per size, halved)")
