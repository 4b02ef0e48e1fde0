"""Compare many named tensors at once, for tests: report every mismatch, not just the first.

A wrong backward usually corrupts one gradient and everything computed after it. Listed in the
order the backward produces them, the first name in the report is where to look.

Compare curves (a loss per step) only once `first_not_finite` finds no nan or inf in them:
max(abs(a - b) ...) skips a nan unless it comes first, as every comparison with nan is False.
"""
import math

import torch


def assert_all_close(named: list[tuple[str, torch.Tensor, torch.Tensor]], rtol: float, atol: float) -> None:
    """named: (name, got, expected) triples, in the order the computation produces them."""
    wrong = []
    for name, got, expected in named:
        try:
            torch.testing.assert_close(got, expected, rtol=rtol, atol=atol)
        except AssertionError as exc:
            detail = next((line.strip() for line in str(exc).splitlines() if "Greatest absolute" in line),
                          str(exc).splitlines()[0])
            wrong.append(f"{name} ({detail})")
    if wrong:
        raise AssertionError(f"{len(wrong)} of {len(named)} differ, first to last in order: " + "; ".join(wrong))


def first_not_finite(got: list[float], expected: list[float]) -> str | None:
    """'step 3's loss is nan (expected 2.31)' for the first step where either curve is nan or inf;
    None when both are finite throughout."""
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        if not (math.isfinite(a) and math.isfinite(b)):
            return f"step {step}'s loss is {a:g} (expected {b:g})"
    return None
