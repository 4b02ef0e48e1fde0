"""Shared by module 16's tests (not a test file itself): the exchange check the layer and model tests
run, and a comparison that says how far off a tensor is, and by what factor when it is a multiple."""
import torch

from course.impl import load

check_exchange = load("m16_expert_parallel").check_exchange   # given code, in the learner's own file


def check_every_exchange(layer_module) -> None:
    """In this rank, wrap the learner's plan_exchange so that splits the ranks disagree on fail with
    check_exchange's message, instead of aborting gloo inside the rows' all-to-all."""
    plan = layer_module.plan_exchange

    def checked(counts, group):
        exchange = plan(counts, group)
        check_exchange(exchange, group)
        return exchange
    layer_module.plan_exchange = checked


def differs(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-12) -> str | None:
    """None when got equals want within rtol (of want's largest entry, and 1e-12 absolute); else what is
    off: the dtype or shape, the largest error against the largest entry, and, when got is close to a
    multiple c want (c not 1), the factor: a sum taken twice or a term left out reads as one."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"got {tuple(got.shape)} {got.dtype}, expected {tuple(want.shape)} {want.dtype}"
    got64, want64 = got.double(), want.double()
    scale = want64.abs().max().item()
    error = (got64 - want64).abs().max().item()
    if error <= rtol * max(scale, 1.0):
        return None
    text = f"largest error {error:.2e} where the largest entry is {scale:.2e}"
    norm = (want64 * want64).sum().item()
    if norm > 0:
        factor = (got64 * want64).sum().item() / norm
        if abs(factor - 1) > 1e-6 and (got64 - factor * want64).abs().max().item() <= 1e-9 * max(scale, 1e-300):
            return f"{factor:.3g} times the expected values ({text})"
    if not torch.isfinite(got64).all():
        return f"not finite at {torch.nonzero(~torch.isfinite(got64))[0].tolist()} ({text})"
    return text


def first_difference(got: torch.Tensor, want: torch.Tensor, around: int = 3) -> str:
    """Where two index lists part: 'from position 12 of 145: got [..], expected [..]' (a few entries before it
    and after), instead of both lists whole."""
    if got.shape != want.shape:
        return f"{got.numel()} entries, expected {want.numel()}"
    at = int((got != want).flatten().nonzero()[0])
    window = slice(max(at - around, 0), at + around + 1)
    return (f"from position {at} of {want.numel()}: got {got.flatten()[window].tolist()}, expected "
            f"{want.flatten()[window].tolist()} (positions {window.start}..{min(window.stop, want.numel()) - 1})")

