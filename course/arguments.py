"""What a command accepts as a count, a number or a folder (given): the bounds, stated once, and the
checks that main.py, `plan`, the demos' check_args, course.mutants and course.skeleton share.

Each check raises ValueError with one line naming the option, what it may be and what it got; the
command turns it into its usage error (exit code 2) before any process starts. A bound is there to
refuse a typo before it costs anything: --nproc 100000 would fork 100,000 processes, a timeout of inf
or 1e300 seconds overflows the timers, a width of 1e300 overflows torch's 64-bit sizes, a seed of
10**30 torch's generator, and nan passes every `x <= 0` test.
"""
from __future__ import annotations

import os
import tempfile

# Ranks forked on this machine (`run --nproc`, a mesh's product; course.mutants' --jobs): more than any
# demo needs (module 17's 8 by default) and than a workstation's cores. A larger machine raises it:
# COURSE_MAX_NPROC=256 python main.py run 16 --nproc 128.
MAX_NPROC = 64
MAX_NPROC_VARIABLE = "COURSE_MAX_NPROC"
# `plan --gpus`: 2**20 GPUs, beyond any cluster built; the planner's search over their divisors takes seconds.
MAX_GPUS = 2**20
# A size or a count (a model's width, layers, heads, vocabulary; a batch, a sequence, steps, microbatches):
# the product of two still fits torch's 64-bit sizes, and it is far beyond any model planned here
# (Llama 3 405B: width 16384, a vocabulary of 128256).
MAX_SIZE = 2**24
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes a 64-bit seed
# A positive real option (a learning rate, GFLOP/s, GB and GB/s, a capacity factor; each in its own unit):
# outside this range it is a typo, and 1e-300 or 1e300 overflows a sleep or an integer.
MIN_POSITIVE, MAX_POSITIVE = 1e-9, 1e9
MAX_TIMEOUT_S = 86400.0  # a day: a longer timeout is a typo (inf, 1e300) and overflows the timers


def max_nproc() -> int:
    """MAX_NPROC, or the COURSE_MAX_NPROC environment variable's value."""
    value = os.environ.get(MAX_NPROC_VARIABLE, str(MAX_NPROC))
    try:
        return check_count(int(value), MAX_NPROC_VARIABLE, 1, MAX_SIZE)
    except ValueError:
        raise ValueError(f"{MAX_NPROC_VARIABLE}={value!r}: expected a whole number of ranks, at least 1") from None


def check_count(value, option: str, low: int = 1, high: int = MAX_SIZE) -> int:
    """A whole number from `low` to `high` (an int, or a float such as 4096.0 from 'dim=4096')."""
    shown = f"{value:g}" if isinstance(value, float) else str(value)
    if not (isinstance(value, int) or (isinstance(value, float) and value.is_integer())):  # 1.5, inf, nan
        raise ValueError(f"{option} must be a whole number from {low:,} to {high:,}, got {shown}")
    if value < low:
        raise ValueError(f"{option} must be at least {low:,}, got {shown}")
    if value > high:
        raise ValueError(f"{option} must be at most {high:,}, got {shown}")
    return int(value)


def check_counts(args, *names: str, low: int = 1, high: int = MAX_SIZE):
    """check_count for each of `args`' attributes `names` (seq_len is the option --seq-len)."""
    for name in names:
        check_count(getattr(args, name), "--" + name.replace("_", "-"), low, high)


def check_number(value: float, option: str, low: float = MIN_POSITIVE, high: float = MAX_POSITIVE) -> float:
    """A real number from `low` to `high` (never nan or inf)."""
    if not low <= value <= high:  # false for nan
        raise ValueError(f"{option} must be a number from {low:g} to {high:g}, got {value:g}")
    return value


def check_timeout(timeout: float, option: str = "a timeout"):
    """A positive number of seconds, at most MAX_TIMEOUT_S."""
    if not 0 < timeout <= MAX_TIMEOUT_S:
        raise ValueError(f"{option} must be a positive number of seconds, at most {MAX_TIMEOUT_S:g} (a day), "
                         f"got {timeout:g}")


def cannot_write_in(folder) -> str | None:
    """Why files cannot be written in `folder` (made as needed), or None if they can. Tried in its nearest
    folder that exists, which is left as it was: nothing is created for a run that may be refused."""
    folder = os.path.abspath(folder)
    existing = folder
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{existing} is a file"
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:  # no permission, a read-only disk
        return exc.strerror or str(exc)
    return None


def check_folder_writable(folder, option: str):
    """One line unless files can be written in `folder` (given as `option`)."""
    why = cannot_write_in(folder)
    if why:
        raise ValueError(f"{option} {folder}: cannot write there ({why})")
