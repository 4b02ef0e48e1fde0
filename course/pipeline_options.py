"""The options of the pipeline runs and benchmarks, checked before any rank starts (given code).

`python main.py run 05`, `run 11`, `bench 05` and `bench 11` take the same kinds of options (the
pipeline ranks, p = --nproc; the microbatches, m = --microbatches; a schedule; the emulated
device's time per layer; where to write the trace). The runs declare the shared ones with
`add_run_options` and write their trace with `write_trace`. Each check here raises a ValueError with
one line that says what would work; a demo's `check_args` and a benchmark's argument check call the
same ones. They read the
reference's given code (`course.impl.reference`), never the learner's: a learner's unfinished
TODO must not stop a bad option from being refused, nor a good one from being run.
"""
from __future__ import annotations

import os

from course import RESULTS
from course.arguments import check_count, check_number
from course.impl import reference


def model_config():
    """The MLP every pipeline module trains (module 00's defaults)."""
    return reference("m00_monolith").MLPConfig()


def check_microbatches(n_microbatches: int, batch: int | None = None):
    """m must be at least 1 and divide the batch: every microbatch has the same rows (a receiving rank
    sizes its buffer from them). `batch`: run 11's --batch (else the model's, which run 05 keeps)."""
    check_count(n_microbatches, "--microbatches")
    other = "" if batch is None else f", or a --batch that {n_microbatches} divides"
    batch = model_config().batch if batch is None else check_count(batch, "--batch")
    if batch % n_microbatches:
        raise ValueError(f"a batch of {batch} cannot be split into {n_microbatches} equal microbatches; "
                         f"use --microbatches that divides {batch}{other}")


def check_one_stage_per_rank(world_size: int):
    """Modules 04 and 05: p ranks, one stage each, so p must cut the layers evenly."""
    try:
        reference("m04_sharded").check_stages(model_config(), world_size)
    except ValueError as exc:
        raise ValueError(f"--nproc {world_size}, one stage per rank: {exc}") from None


def check_schedule(name: str, world_size: int, n_microbatches: int, stages_per_rank: int = 2):
    """Module 11: the schedule's own refusal (check_arguments: e.g. zbv needs m >= 2p - 1), then the
    model's: its p v stages must cut the layers evenly."""
    generators = reference("m11_generators")
    generators.check_arguments(name, world_size, n_microbatches, stages_per_rank)
    per_rank = generators.stages_per_rank_of(name, stages_per_rank)
    try:
        reference("m04_sharded").check_stages(model_config(), world_size * per_rank)
    except ValueError as exc:
        raise ValueError(f"{name} on {world_size} ranks, {per_rank} stage(s) each: {exc}") from None


def check_emulation(steps: int, emulate_ms: float):
    check_count(steps, "--steps")
    check_number(emulate_ms, "--emulate-ms", low=0)  # nan and inf would overflow the emulated device's sleeps


def add_run_options(parser, emulate_ms: float, emulate_help: str, trace: str):
    """The options `run 05` and `run 11` share: --microbatches (or torch's --chunks), --steps,
    --emulate-ms (default `emulate_ms`, what it emulates said by `emulate_help`) and --trace (default
    results/`trace`)."""
    parser.add_argument("--microbatches", "--chunks", type=int, default=8,
                        help="microbatches per step, m (default 8; --chunks is torch's name for it)")
    parser.add_argument("--steps", type=int, default=5, help="training steps (default 5; the monolith's run is 50)")
    parser.add_argument("--emulate-ms", type=float, default=emulate_ms,
                        help=f"emulated device: {emulate_help}; 0: CPU only")
    parser.add_argument("--trace", default=str(RESULTS / trace),
                        help="write PREFIX.json (Chrome trace) and PREFIX.png (timeline)")


def write_trace(profiles: list[dict], prefix: str, title: str):
    """PREFIX.json, the Chrome trace of every rank's profile, and PREFIX.png, the timeline of the last
    step (titled `title`); says where they are."""
    from course.plotting import plot_timeline  # matplotlib: only when a picture is asked for
    from course.trace import chrome_trace

    os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
    chrome_trace(profiles, prefix + ".json")
    plot_timeline(profiles, prefix + ".png", step=-1, title=title)
    print(f"trace: {prefix}.json (open in ui.perfetto.dev), timeline: {prefix}.png")
