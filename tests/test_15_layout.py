"""Module 15 layout: the zig-zag split holds every position once, follows the 2c chunks, gives every
rank the same number of unmasked (query, key) pairs (counted here from a causal mask, independently
of the code), and is the permutation PyTorch's own head-tail load balancer makes."""
import pytest
import torch

from course.impl import load

layout = load("m15_layout")


def unmasked_pairs_counted(positions: torch.Tensor, seq_len: int) -> int:
    """The pairs the causal mask of a whole sequence keeps in the rows of these query positions."""
    keeps = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    return int(keeps[positions].sum())


@pytest.mark.exercises("zigzag_pieces")
@pytest.mark.parametrize("c", [1, 2, 3, 4, 8])
def test_zigzag_holds_every_position_once_in_its_chunks_and_balances_the_causal_work(c):
    T = 2 * c * 3  # chunks of 3 positions
    split = layout.SequenceLayout("zigzag", T, c)
    held = torch.cat([split.positions(i) for i in range(c)])
    assert sorted(held.tolist()) == list(range(T)), \
        f"c={c}: the ranks hold positions {held.tolist()}, not 0..{T - 1} once"
    for i in range(c):
        pieces = split.pieces(i)
        assert pieces[0] == (3 * i, 3) and len(pieces) == 2 and pieces[1][1] == 3, \
            f"c={c}, rank {i}: pieces {pieces}; expected chunk {i} first ([(first position, length)], 2c chunks of 3)"
    work = [unmasked_pairs_counted(split.positions(i), T) for i in range(c)]
    assert len(set(work)) == 1, f"c={c}: unmasked (query, key) pairs per rank {work}: the work is not balanced"
    # The contiguous layout, for contrast (given code): the last rank's work is 2c - 1 times the first's, or so.
    contiguous = [unmasked_pairs_counted(layout.SequenceLayout("contiguous", T, c).positions(i), T) for i in range(c)]
    assert c == 1 or contiguous[-1] > contiguous[0]


def head_tail_indices(seq_len: int, c: int):
    """PyTorch's head-tail load balancer's permutation (private API: None where this torch lacks it)."""
    try:
        from torch.distributed.tensor.experimental._attention import _HeadTailLoadBalancer
        return _HeadTailLoadBalancer(seq_len, c, "cpu")._generate_indices()[0].long()
    except (ImportError, AttributeError, TypeError):
        return None


@pytest.mark.exercises("zigzag_pieces")
@pytest.mark.parametrize("c, seq_len", [(1, 4), (2, 8), (4, 16), (4, 32)])
def test_zigzag_order_is_pytorchs_head_tail_load_balancing(c, seq_len):
    # layout.order(): rank 0's positions, then rank 1's, ... is the permutation PyTorch's
    # context_parallel applies to a sequence before sharding it (torch.distributed.tensor.experimental).
    ours = layout.SequenceLayout("zigzag", seq_len, c).order()
    theirs = head_tail_indices(seq_len, c)
    if theirs is None:
        pytest.skip("this torch has no _HeadTailLoadBalancer._generate_indices (private API): comparison skipped")
    assert torch.equal(ours, theirs), f"c={c}, T={seq_len}: our order {ours.tolist()}, PyTorch's {theirs.tolist()}"


@pytest.mark.given
@pytest.mark.parametrize("kind, seq_len, c, message", [
    ("zigzag", 12, 4, "2c = 8 equal pieces: sequence length 12 is not divisible by 8"),
    ("contiguous", 10, 4, "c = 4 equal pieces: sequence length 10"),
    ("striped", 8, 2, "unknown layout 'striped'"),
    ("contiguous", 8, 0, "at least 1"),
])
def test_a_layout_that_cannot_cut_the_sequence_is_refused_in_one_line(kind, seq_len, c, message):
    with pytest.raises(ValueError, match=message) as refused:
        layout.check_layout(kind, seq_len, c)
    assert "\n" not in str(refused.value)


@pytest.mark.given
def test_shard_and_unshard_are_inverse_and_local_pieces_index_the_local_tokens():
    x = torch.arange(2 * 16).reshape(2, 16)
    for kind in layout.LAYOUTS:
        split = layout.SequenceLayout(kind, 16, 4)
        shards = [split.shard(x, i) for i in range(4)]
        assert torch.equal(split.unshard(shards), x)
        for i, shard in enumerate(shards):
            for start, rows in split.local_pieces(i):
                assert torch.equal(shard[:, rows], x[:, start:start + rows.stop - rows.start])
        assert [layout.unmasked_pairs(split, i) for i in range(4)] == \
            [unmasked_pairs_counted(split.positions(i), 16) for i in range(4)]
