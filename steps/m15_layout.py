# Generated from solutions/m15_layout.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 15`. (skeleton 00c144793a71)
"""Module 15, part 1 - how one sequence is cut over the c ranks of the context axis.

Context parallelism gives each of the c ranks of the context group T/c positions of every sequence:
their queries, keys and values, their residual stream, their loss. Attention is the only op of a
Llama block that mixes positions, so it is the only op that talks (m15_ring_attention,
m15_allgather_kv, m15_ulysses); every other op runs on the rank's own tokens as if they were a
shorter sequence, except RoPE, which rotates each token by its position in the *whole* sequence.

Two layouts of the positions:

    contiguous   rank i holds [i T/c, (i+1) T/c)
    zigzag       the sequence cut into 2c chunks of T/(2c); rank i holds two of them (head-tail)

Under the causal mask the query at position p attends to p + 1 keys, so with the contiguous layout
the last rank has about 2c - 1 times the first rank's work, and every rank waits for the last.
The zig-zag layout gives each rank two chunks chosen so that every rank has the same work.

A rank's *pieces* are the runs of consecutive positions it holds, in its own order: its local
tokens are piece after piece. Attention needs positions (RoPE, the causal mask); everything else
only needs the tokens, in any order, as long as every rank agrees on the layout.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

LAYOUTS = ("contiguous", "zigzag")


def check_layout(kind: str, seq_len: int, c: int):
    """One line for a layout that cannot cut this sequence (given)."""
    if kind not in LAYOUTS:
        raise ValueError(f"unknown layout {kind!r}: a sequence is cut {' or '.join(LAYOUTS)}")
    if c < 1:
        raise ValueError(f"the context-parallel size c must be at least 1, got {c}")
    pieces = c if kind == "contiguous" else 2 * c
    if seq_len % pieces:
        raise ValueError(f"the {kind} layout cuts the sequence into {'c' if kind == 'contiguous' else '2c'} = "
                         f"{pieces} equal pieces: sequence length {seq_len} is not divisible by {pieces}")


def contiguous_pieces(seq_len: int, c: int, index: int) -> list[tuple[int, int]]:
    """Rank `index` of c holds one run of T/c positions: [(first position, length)] (given)."""
    length = seq_len // c
    return [(index * length, length)]


def zigzag_pieces(seq_len: int, c: int, index: int) -> list[tuple[int, int]]:
    """The two runs of positions rank `index` of c holds under head-tail load balancing, in its own
    order: [(first position, length), (first position, length)]."""
    # TODO(m15): the two chunks a rank holds under zig-zag load balancing
    # Contract: cut the T positions into 2c chunks of T/(2c) consecutive positions; rank `index` holds two of them,
    #   the earlier one first, and its first is chunk `index`. Return [(first position, length)] for the two. Across
    #   the ranks every chunk is held exactly once, and every rank has the same number of (query, key) pairs that
    #   the causal mask keeps. The tests count those pairs per rank for c = 1, 2, 3, 4 and 8, and compare the
    #   ranks' positions, rank after rank, with PyTorch's own load balancer.
    # Maths: a query at position p sees p + 1 keys; a chunk's work is the sum of that over its positions.
    # Question: which second chunk gives rank `index` exactly as much work as every other rank?
    # Pitfalls: does your rule hold every chunk once for an odd c too? Does rank c - 1's second chunk exist?
    raise NotImplementedError('TODO(m15): the two chunks a rank holds under zig-zag load balancing')


@dataclass(frozen=True)
class SequenceLayout:
    """Which positions of a sequence of `seq_len` each of the `size` ranks of a context group holds."""
    kind: str      # "contiguous" or "zigzag"
    seq_len: int   # T, the whole sequence
    size: int      # c

    def __post_init__(self):
        check_layout(self.kind, self.seq_len, self.size)

    def pieces(self, index: int) -> list[tuple[int, int]]:
        """Rank `index`'s runs of positions, [(first position, length)], in its local order."""
        split = contiguous_pieces if self.kind == "contiguous" else zigzag_pieces
        return split(self.seq_len, self.size, index)

    def local_pieces(self, index: int) -> list[tuple[int, slice]]:
        """Rank `index`'s pieces as (first position, the slice of its local tokens that holds them)."""
        pieces, row = [], 0
        for start, length in self.pieces(index):
            pieces.append((start, slice(row, row + length)))
            row += length
        return pieces

    def positions(self, index: int) -> torch.Tensor:
        """The position of each of rank `index`'s local tokens, (T/c,) int64."""
        return torch.cat([torch.arange(start, start + length) for start, length in self.pieces(index)])

    def order(self) -> torch.Tensor:
        """The positions of rank 0's tokens, then rank 1's, ...: the sequence as the ranks hold it, one
        rank's tokens after another's."""
        return torch.cat([self.positions(index) for index in range(self.size)])

    def shard(self, x: torch.Tensor, index: int, dim: int = 1) -> torch.Tensor:
        """Rank `index`'s tokens of a whole sequence x (positions along `dim`), in its local order."""
        return x.index_select(dim, self.positions(index))

    def unshard(self, shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """The whole sequence, in position order, from every rank's shard (in rank order)."""
        return torch.cat(shards, dim).index_select(dim, self.order().argsort())


def unmasked_pairs(layout: SequenceLayout, index: int) -> int:
    """The causal work of rank `index`: its (query, key) pairs that the mask keeps, sum over its
    positions p of p + 1 (given: the benchmark's formula for the per-rank imbalance)."""
    return sum(length * start + length * (length + 1) // 2 for start, length in layout.pieces(index))
