"""Shared by module 15's ring and all-gather tests (not a test file itself): the float64 reference on
the whole sequence (course/reference_attention.py's), one process's bf16 attention, the bf16
tolerance both tests state, and a probe that records which queries and keys each call of module 06's
attention gets, so that a block taken from the wrong rank or scored at the wrong positions is named
before any number is compared."""
import inspect

import torch

from course.impl import reference
from course.reference_attention import whole_attention

m06_ops = reference("m06_llama_ops")  # one process's attention: trusted code, not graded here
BF16 = torch.bfloat16
NAMES = ("o", "lse", "dq", "dk", "dv")


def one_process_bf16(q, k, v, do):
    """Module 06's attention on the whole sequence in one process, in bf16: o, lse (B, H, T), dq, dk, dv."""
    q, k, v, do = (t.to(BF16) for t in (q, k, v, do))
    o, lse = m06_ops.attention_forward(q, k, v, 3)
    batch, n, heads, _ = q.shape
    return (o, lse.reshape(batch, heads, n), *m06_ops.attention_backward(do, q, k, v, o, lse, 3))


def beyond_bf16_rounding(got, inputs, which):
    """bf16 results (`which` of NAMES) whose error against float64 exceeds one process's bf16 error by
    more than two bf16 roundings of the largest value (the tolerance both tests' docstrings state)."""
    exact = whole_attention(*(t.to(BF16) for t in inputs))  # the same rounded inputs, in float64
    alone = one_process_bf16(*inputs)
    wrong = []
    for i in which:
        scale = exact[i].abs().max()
        error, error_alone = ((x.double() - exact[i]).abs().max() / scale for x in (got[i], alone[i]))
        if got[i].dtype != BF16 or not error <= error_alone + 2 ** -7:
            wrong.append(f"{NAMES[i]}: {got[i].dtype}, error {error.item():.1e}, one process {error_alone.item():.1e}")
    return wrong


class AttentionProbe:
    """Wraps `module.<name>` (module 06's attention_forward or attention_backward, as the module under test
    calls it) in this rank, recording each call's (q_offset, queries, k_offset, keys, lse)."""

    def __init__(self, module, name: str):
        self.module, self.name, self.calls = module, name, []
        self.inner = getattr(module, name)
        signature = inspect.signature(getattr(m06_ops, name))

        def recording(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            a = bound.arguments
            self.calls.append((int(a["q_offset"]), a["q"], int(a["k_offset"]), a["k"], a.get("lse")))
            return self.inner(*args, **kwargs)
        setattr(module, name, recording)

    def restore(self):
        setattr(self.module, self.name, self.inner)


def where_from(got: torch.Tensor, whole: torch.Tensor) -> str:
    """'positions a..b' if `got` (B, n, heads, D) is a run of `whole` (B, T, heads, D), else 'no run of positions'."""
    n = got.shape[1]
    for start in range(whole.shape[1] - n + 1):
        if torch.equal(got, whole[:, start:start + n]):
            return f"positions {start}..{start + n - 1}"
    return "no run of the sequence's positions"


def wrong_calls(calls, q, k, layout, me, owners, who: str, what: str) -> list[str]:
    """What is wrong with rank `me`'s recorded calls of `what` (attention_forward or attention_backward):
    queries or keys that are not those of the positions their offsets say, and (query piece, key piece)
    pairs scored that the mask hides entirely, twice, or not at all, against the pieces of the ranks in
    `owners` (None: not checked). q and k are the whole sequence in position order, in the calls' dtype."""
    wrong, seen = [], []
    for q_offset, got_q, k_offset, got_k, _ in calls:
        nq, nk = got_q.shape[1], got_k.shape[1]
        if not torch.equal(got_q, q[:, q_offset:q_offset + nq]):
            wrong.append(f"{who} called {what} with q_offset={q_offset}, but the queries it passed are those of "
                         f"{where_from(got_q, q)}: an offset is the first query's position in the whole sequence")
        elif not torch.equal(got_k, k[:, k_offset:k_offset + nk]):
            wrong.append(f"{who} called {what} with k_offset={k_offset}, but the keys it passed are those of "
                         f"{where_from(got_k, k)}: is the block in hand the one you think, and its offset its "
                         f"first key's position?")
        seen.append((q_offset, nq, k_offset, nk))
        if wrong:
            return wrong
    if owners is None:
        return wrong
    mine = [(start, rows.stop - rows.start) for start, rows in layout.local_pieces(me)]
    theirs = [(start, rows.stop - rows.start) for owner in owners for start, rows in layout.local_pieces(owner)]
    expected = sorted((qs, nq, ks, nk) for qs, nq in mine for ks, nk in theirs if ks < qs + nq)
    for pair in sorted(set(seen)):
        (qs, nq, ks, nk), count = pair, seen.count(pair)
        if ks >= qs + nq:
            wrong.append(f"{who} scored queries {qs}..{qs + nq - 1} against keys {ks}..{ks + nk - 1}: every key "
                         f"comes after every query, a pair the mask hides entirely (no scores are computed for it)")
        elif count > 1:
            wrong.append(f"{who} scored queries {qs}..{qs + nq - 1} against keys {ks}..{ks + nk - 1} {count} times")
    missing = [pair for pair in expected if pair not in seen]
    if missing and not wrong:
        qs, nq, ks, nk = missing[0]
        wrong.append(f"{who} never scored queries {qs}..{qs + nq - 1} against keys {ks}..{ks + nk - 1}, which the "
                     f"first of them sees ({len(missing)} such pairs missing)")
    return wrong
