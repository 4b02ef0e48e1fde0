# Generated from solutions/m13_costs.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 13`. (skeleton 2f30db48530f)
"""Module 13, part 3 - what the 2-D model costs, read off its equations: bytes sent and bytes kept.

Notation: d x t ranks; L blocks; M = dim, F = ffn_dim, K key/value heads, H query heads, D head_dim;
V' the vocabulary padded to a multiple of t; b bytes a value (the weights' and activations' dtype),
s bytes a statistic (compute_dtype: float32 at least); a global batch of B sequences of T tokens,
so N = (B/d) T tokens on each rank. One block's matrices hold P = 2 H D M + 2 K D M + 3 F M values.

Bytes sent. With the ring algorithms (course/collectives.py's `sent_bytes`), one rank sends, for an
all-gather or a reduce-scatter over n ranks, (n - 1) times its block; for an all-reduce of S bytes,
2 (n - 1) / n S. Reading the equations of one step:

  weights, all-gathered over d     each block's 7 matrices twice (forward, backward), the embedding
                                   once (its backward needs no table), the LM head twice; a block of
                                   a matrix of W values is W / (d t):  (d - 1) / (d t) b (2 L P + 3 V' M)
  norm weights, gathered over d    each of the 2 L + 1 norms in the forward and in the backward; M/t/d
    then t                         -> M/t over d sends (d - 1) M / (d t) b, M/t -> M over t sends
                                   (t - 1) M / t b: (d t - 1) M / (d t) b each, 2 (2 L + 1) times
  gradients, reduce-scattered      each matrix once: (d - 1) / (d t) b (L P + 2 V' M); each norm once,
                                   over t then d: (d t - 1) M / (d t) b, 2 L + 1 times
  the residual stream over t       A = N M b; every all-gather and reduce-scatter of the stream sends
                                   (t - 1) / t A: 2 per half-block in each direction (4 L + 4 L), one
                                   at the embedding and one at the final norm in each direction: 8 L + 4
  the loss                         3 all-reduces of N statistics over t: 3 x 2 (t - 1) / t N s;
                                   1 all-reduce of the loss over d: 2 (d - 1) / d s

Bytes kept. Every weight is split over both axes, so one rank keeps 1 / (d t) of every one:
(L (P + 2 M) + 2 V' M + M) / (d t) values, and as many gradients, and AdamW's two moments of each
(its scalar step counters aside): 4 copies in all. The activations a block keeps for its backward
are split over d (the rows), but only some over t: the gathered stream and the norms' outputs are
[B/d T M] on every rank of a t group (`block_activation_bytes`, given).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .m06_llama_block import LlamaConfig
from .m06_llama_ops import compute_dtype
from .m12_vocab_parallel import padded_vocab_size


@dataclass(frozen=True)
class StepTraffic:
    """Bytes one rank sends in one training step, by what they carry."""
    weights: float    # the all-gathers of the weights (norms included)
    gradients: float  # the reduce-scatters of the gradients (norms included)
    stream: float     # the all-gathers and reduce-scatters of the residual stream over t
    loss: float       # the cross-entropy's all-reduces over t and the loss's over d

    @property
    def sent_bytes(self) -> float:
        return self.weights + self.gradients + self.stream + self.loss


@dataclass(frozen=True)
class StateBytes:
    """Bytes one rank keeps between steps."""
    parameters: int
    gradients: int
    optimizer: int    # AdamW's exp_avg and exp_avg_sq

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer


def block_matrix_params(cfg: LlamaConfig) -> int:
    """P: the values of one block's seven matrices (wq, wk, wv, wo, w_gate, w_up, w_down)."""
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return 2 * q * cfg.dim + 2 * kv * cfg.dim + 3 * cfg.ffn_dim * cfg.dim


def block_activation_bytes(cfg: LlamaConfig, batch: int, d: int, t: int, dtype: torch.dtype = torch.float32) -> int:
    """Bytes one block's forward keeps for its backward on one rank (given), by the specs of its store:
    xg, n1, hg, n2 [B/d T M]; r1, r2 [B/d T] (statistics); q, o [B/d T K/t Q D]; k, v [B/d T K/t D];
    lse [B/d K/t Q T] (statistics); g, u, s [B/d T F/t]."""
    b, s = dtype.itemsize, compute_dtype(dtype).itemsize
    N, kv_heads = batch // d * cfg.max_seq_len, cfg.n_kv_heads // t
    q_per_kv = cfg.n_heads // cfg.n_kv_heads
    values = (4 * cfg.dim + 2 * kv_heads * q_per_kv * cfg.head_dim + 2 * kv_heads * cfg.head_dim
              + 3 * cfg.ffn_dim // t)
    return N * (values * b + (2 + kv_heads * q_per_kv) * s)


def step_traffic(cfg: LlamaConfig, batch: int, d: int, t: int, dtype: torch.dtype = torch.float32) -> StepTraffic:
    """What one rank sends in one step of m13_llama_2d on a d x t mesh, a global batch of `batch`
    sequences of cfg.max_seq_len tokens, weights and activations in `dtype`."""
    b, s = dtype.itemsize, compute_dtype(dtype).itemsize
    L, M, P = cfg.n_layers, cfg.dim, block_matrix_params(cfg)
    V = padded_vocab_size(cfg.vocab_size, t)
    N = batch // d * cfg.max_seq_len  # tokens on one rank
    # TODO(m13): the bytes one rank sends in a step, by the four parts of the module docstring
    # Contract: return a StepTraffic of its four parts (weights, gradients, stream, loss), each the bytes this
    #   rank sends per step with the ring algorithms, exactly what course/collectives.py's sent_bytes adds up
    #   for the model's log (the tests compare on the meshes 1x1, 1x4, 2x2 and 4x1, to the byte).
    # Maths: the module docstring reads each part off the equations: which tensor each collective moves, how big
    #   this rank's block of it is, how many ranks its group has, and how many times a step moves it.
    # Pitfalls: a block of a matrix split over both axes is W / (d t), but its all-gather runs over d only; the
    #   norms' gathers and scatters cross both axes, one after the other; the embedding is gathered once, the LM
    #   head twice; the loss statistics are in compute_dtype (s bytes), the rest in dtype (b bytes). On a mesh
    #   axis of size 1 nothing is sent. Floats are fine: the tests compare sums of (n - 1) / n terms.
    raise NotImplementedError('TODO(m13): the bytes one rank sends in a step, by the four parts of the module docstring')


def state_bytes(cfg: LlamaConfig, d: int, t: int, dtype: torch.dtype = torch.float32) -> StateBytes:
    """What one rank keeps between steps: its blocks of the weights, their gradients, AdamW's moments."""
    b, L, M = dtype.itemsize, cfg.n_layers, cfg.dim
    V = padded_vocab_size(cfg.vocab_size, t)
    # TODO(m13): the bytes of parameters, gradients and optimizer state one rank keeps
    # Contract: return StateBytes(parameters, gradients, optimizer) in bytes (integers): the tests compare them
    #   with the tensors a rank of the 2-D model really holds after a step (its weights' blocks, its gradients'
    #   blocks, AdamW's exp_avg and exp_avg_sq), on four meshes.
    # Maths: every weight (the L blocks' matrices and norms, the padded embedding and LM head, the final norm) is
    #   split over both axes: a rank keeps 1 / (d t) of it. Gradients have the weights' specs; AdamW keeps two
    #   moments of each weight, in the weight's dtype.
    # Pitfalls: the vocabulary is the padded one (V'); the norms count too; integer bytes: the mesh divides every
    #   size, so divide the total by d t exactly.
    raise NotImplementedError('TODO(m13): the bytes of parameters, gradients and optimizer state one rank keeps')
