"""Module 19 data position: a ShuffledSequences restored in a fresh reader from `state()` returns exactly the
batches the original returns, from any cut (every step of several epochs, an epoch's end included), in a
state whose size does not grow with the data. The reference is the original reader itself, run on: a
different batch anywhere is a repeated or skipped sequence."""
import pytest
import torch

from course.impl import load

data = load("m19_data")

N, T, B, SEED = 10, 3, 3, 5   # 10 windows of 4 tokens, 3 a batch: every epoch ends inside a batch


def reader(n=N, batch=B, seed=SEED):
    return data.ShuffledSequences(torch.arange(n * (T + 1)), T, batch, seed)


def window_ids(tokens: torch.Tensor) -> list[int]:
    return (tokens[:, 0] // (T + 1)).tolist()   # window k starts at token k (T + 1)


@pytest.mark.exercises("ShuffledSequences.state", "ShuffledSequences.restore")
@pytest.mark.parametrize("cut", range(0, 15))
def test_a_restored_reader_returns_the_same_batches(cut):
    original = reader()
    for _ in range(cut):
        original.next_batch()
    state = original.state()
    fresh = reader()
    fresh.restore(state)
    for k in range(12):   # about 4 epochs more
        want, got = window_ids(original.next_batch()[0]), window_ids(fresh.next_batch()[0])
        assert got == want, (f"cut after {cut} batches ({N} windows, {B} a batch: epoch ends at every "
                             f"{N / B:.2f} batches), batch {k} after the restore: windows {got}, the uninterrupted "
                             f"reader's {want} (a window repeated or skipped): {culprit(cut)}")


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def culprit(cut: int) -> str:
    """Which half a failed round trip blames: a state that tells every position of the reader apart (two readers
    at one position give equal states, the next position another) leaves the restore at fault."""
    def at(batches):
        r = reader()
        for _ in range(batches):
            r.next_batch()
        return r.state()
    if same(at(cut), at(cut)) and not same(at(cut), at(cut + 1)):
        return ("your ShuffledSequences.restore does not put a fresh reader where the saved one was (the state "
                "it was given tells this position from the next one)")
    return ("your ShuffledSequences.state gives the same state at two positions (or two states at one): it does "
            "not say where the reader is")


@pytest.mark.exercises("ShuffledSequences.restore", "ShuffledSequences.state")
def test_restore_replaces_a_used_readers_position():
    original = reader()
    for _ in range(5):
        original.next_batch()
    used = reader()
    for _ in range(8):
        used.next_batch()
    used.restore(original.state())
    assert window_ids(used.next_batch()[0]) == window_ids(original.next_batch()[0])


@pytest.mark.exercises("ShuffledSequences.state")
def test_the_state_has_one_shape_and_a_size_that_does_not_grow_with_the_data():
    def size(state):
        return sum(t.numel() * t.element_size() for t in state.values())

    small, large = reader(n=100), reader(n=100_000)
    shapes = {name: tuple(t.shape) for name, t in small.state().items()}
    for _ in range(40):   # across epoch ends: module 17's load fills tensors of the saved shapes in place
        small.next_batch()
    assert {name: tuple(t.shape) for name, t in small.state().items()} == shapes, "the state's shapes changed"
    assert all(isinstance(t, torch.Tensor) for t in small.state().values())
    assert size(large.state()) == size(small.state()), (
        f"the state of 100 windows takes {size(small.state())} bytes, of 100,000 windows {size(large.state())}: "
        f"a corpus of billions of sequences cannot keep its order in a checkpoint")


@pytest.mark.given
def test_every_window_is_read_once_an_epoch():
    sampler = reader(batch=5)
    ids = [i for _ in range(4) for i in window_ids(sampler.next_batch()[0])]   # 20 windows: 2 epochs
    assert sorted(ids[:N]) == list(range(N)) and sorted(ids[N:]) == list(range(N)) and ids[:N] != ids[N:]
    tokens, targets = reader().next_batch()
    assert torch.equal(tokens[:, 1:], targets[:, :-1]) and tokens.shape == (B, T)
