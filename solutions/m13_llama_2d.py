"""Module 13, part 3 - module 06's Llama over a d x t mesh: FSDP over d, Megatron over t, every line
of the forward and the backward written in named axes, beside its equation in the chapter.

Every weight is split over both mesh axes, as the table says (weights are stored (out, in) like
nn.Linear's, with the head dimensions unflattened: wq (K Q D, M) is K Q D M, query head k Q + q
reading key/value head k):

    embedding, lm_head   V/t M/d       the vocabulary (padded to a multiple of t) over t, M over d
    wq                   K/t Q D M/d   key/value heads over t, with their Q query heads each
    wk, wv               K/t D M/d
    wo                   M/d K/t Q D
    w_gate, w_up         F/t M/d       FFN units over t
    w_down               M/d F/t
    ln1, ln2, final_norm M/t/d         every weight on exactly one rank

and the residual stream between the blocks is x[B/d T M/t]: the rows of the batch over d, the
model width over t.

Over d it is FSDP's, by units: a block's nine weights are one unit, and the embedding, the final
norm and the LM head another (`TopWeights`, "the top"). A unit's weights travel together: one
grouped all-gather over d (m13_named_axes's start_all_gather and finish) makes every weight of a
block whole over d before the block runs, one more before its backward, and one grouped
reduce-scatter returns all of its gradients (contractions over B/d, so unreduced over d) to their
blocks. The top is gathered once a step: the embedding uses it first, the loss and its backward
last. Each gather is started a unit ahead, so it travels while the unit before it computes.

Inside a unit it is Megatron's, over t: each half all-gathers the stream over t before its norm,
contracts over a dimension split over t at the end (o, down) and reduce-scatters over t back into
the stream. The backward of an all-gather is a reduce-scatter over the same axis, and the backward
of a reduce-scatter an all-gather, so the backward has the same collectives as the forward,
conjugated. The halves receive their block's weights whole over d (`K/t Q D M`, `M/t`, ...) and
return its gradients unreduced over d (`K/t Q D M {U_d}`, `M/t {U_d}`, ...).

The mesh is course/mesh.py's, with the axes d and t (either may have size 1): `Llama2D(cfg,
mesh)`, and module 12's loss runs on `mesh.group("t")`, the rank's tensor group. Every rank builds
module 06's whole model from the seed and keeps its blocks (`shard`), draws the same global batch
and keeps its rows: the sharded model starts where a single process does. The local ops are module
06's; the vocabulary padding and the vocabulary-parallel cross-entropy are module 12's. Module 06's
`fit` trains it: `fit(Llama2D(cfg, mesh), steps)`.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from course.mesh import Mesh
from course.splits import check_splits
from .m06_llama_block import ActivationStore, BlockWeights, LlamaConfig
from .m06_llama_model import LlamaGrads, LlamaModel, microbatches, real_tokens
from .m06_llama_ops import (ATTENTION_CHUNK, attention_backward, attention_forward, rmsnorm_backward,
                            rmsnorm_forward, rope_backward, rope_forward, rope_tables, swiglu_backward,
                            swiglu_forward)
from .m12_vocab_parallel import padded_rows, padded_vocab_size, vocab_parallel_cross_entropy
from .m13_named_axes import (InFlight, all_gather, all_reduce, einsum_unreduced, finish, reduce_scatter,
                             start_all_gather, start_reduce_scatter)
from .m13_specs import Dim, Sharded, Spec, check_matches, local, parse_spec, shard

# The module's model: 8 query heads in 4 groups (K = 4 key/value heads, so t can be 1, 2 or 4), dim 32
# (the norms' M/t/d needs d t | 32), FFN 48. Module 06's vocabulary of 256 bytes.
CONFIG = LlamaConfig(dim=32, n_heads=8, n_kv_heads=4, head_dim=4, ffn_dim=48, n_layers=2, max_seq_len=16)

TOP_SPECS = {"embedding": "V/t M/d", "final_norm": "M/t/d", "lm_head": "V/t M/d"}
BLOCK_SPECS = {"ln1": "M/t/d", "wq": "K/t Q D M/d", "wk": "K/t D M/d", "wv": "K/t D M/d", "wo": "M/d K/t Q D",
               "ln2": "M/t/d", "w_gate": "F/t M/d", "w_up": "F/t M/d", "w_down": "M/d F/t"}


@dataclass
class TopWeights:
    """The weights outside the blocks, FSDP's unit at the top of the model: the embedding, the final
    norm and the LM head (Sharded). Also used for their gradients."""
    embedding: object
    final_norm: object
    lm_head: object

    def tensors(self) -> list:
        return [getattr(self, f.name) for f in fields(self)]


def whole_over_d(spec: Spec) -> Spec:
    """A weight's spec once gathered over d: 'K/t Q D M/d' -> 'K/t Q D M', 'M/t/d' -> 'M/t' (given)."""
    return Spec(tuple(Dim(dim.name, tuple(a for a in dim.axes if a != "d")) for dim in spec.dims), spec.unreduced)


def gather_arrows(unit) -> list[str]:
    """Each weight's arrow in its unit's all-gather over d: 'K/t Q D M/d -> K/t Q D M', ... (given)."""
    return [f"{w.spec} -> {whole_over_d(w.spec)}" for w in unit.tensors()]


def scatter_arrows(grads) -> list[str]:
    """Each gradient's arrow in its unit's reduce-scatter over d, onto its weight's block (given):
    'K/t Q D M {U_d} -> K/t Q D M/d', 'M/t {U_d} -> M/t/d', ..."""
    specs = TOP_SPECS if isinstance(grads, TopWeights) else BLOCK_SPECS
    return [f"{g.spec} -> {specs[f.name]}" for f, g in zip(fields(grads), grads.tensors())]


def check_mesh_fits(cfg: LlamaConfig, sizes: dict[str, int], batch: int | None = None, n_microbatches: int = 1):
    """Refuse, in one line, a mesh this model cannot run on (given): an axis other than d and t, or
    sizes that do not divide what they split: course/splits.py's check (heads, key/value heads and F
    over t; the batch over d and the microbatches), plus this model's own M/t/d (its norm weights).
    The vocabulary is padded instead (module 12)."""
    other = [f"{axis}={size}" for axis, size in sizes.items() if axis not in ("d", "t") and size > 1]
    if other:
        raise ValueError(f"module 13's model runs on a d x t mesh; this mesh also has {', '.join(other)}")
    check_splits(cfg, sizes, batch, n_microbatches, also=[("dim M (the norms' M/t/d)", cfg.dim, ("t", "d"))])


def named_weight(cfg: LlamaConfig, name: str, weight: torch.Tensor) -> torch.Tensor:
    """Module 06's weight (out, in) with its head dimensions unflattened, as BLOCK_SPECS names them (a view)."""
    K, Q, D, M = cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim, cfg.dim
    shapes = {"wq": (K, Q, D, M), "wk": (K, D, M), "wv": (K, D, M), "wo": (M, K, Q, D)}
    return weight.view(shapes[name]) if name in shapes else weight


# ---------------------------------------------------------------------------------------------
# Local ops on the unflattened heads, and the vocabulary (given)
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rope:
    """Module 06's RoPE tables: cos, sin (T, 1, D/2) for k (B, T, K, D), cos_q, sin_q (T, 1, 1, D/2) for q."""
    cos: torch.Tensor
    sin: torch.Tensor
    cos_q: torch.Tensor
    sin_q: torch.Tensor


def grouped_attention_forward(q, k, v, chunk: int = ATTENTION_CHUNK):
    """Module 06's attention on q (B, T, K, Q, D), k and v (B, T, K, D): returns o (B, T, K, Q, D) and
    lse (B, K, Q, T). Query head (k, q) is module 06's head k Q + q."""
    o, lse = attention_forward(q.flatten(2, 3), k, v, chunk)
    return o.view(q.shape), lse


def grouped_attention_backward(do, q, k, v, o, lse, chunk: int = ATTENTION_CHUNK):
    """Module 06's attention backward in the same layout: (dq (B, T, K, Q, D), dk, dv (B, T, K, D))."""
    dq, dk, dv = attention_backward(do.flatten(2, 3), q.flatten(2, 3), k, v, o.flatten(2, 3), lse, chunk)
    return dq.reshape(q.shape), dk, dv


def vocab_one_hot(tokens: torch.Tensor, first: int, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, T) -> (B, T, rows): 1 where a token is vocabulary entry first + j, this rank's rows, else 0."""
    return ((tokens - first).unsqueeze(-1) == torch.arange(rows, device=tokens.device)).to(dtype)


def cross_entropy_over_t(logits: Sharded, targets: Sharded, vocab_size: int, n_tokens: int):
    """(loss, dlogits) from logits[B/d T V/t] and targets[B/d T], by module 12's vocabulary-parallel
    cross-entropy over t (three all-reduces of this rank's token count, no logits gathered).

    The loss is the mean over the n_tokens tokens of the *global* batch; this rank's rows hold only
    its share: loss[] {U_d} (summed over d, it is the loss). dlogits[B/d T V/t] is the gradient of the
    whole mean, so its scale is 1 / n_tokens, not 1 / this rank's tokens."""
    mesh = logits.mesh
    check_matches(parse_spec("B/d T V/t", mesh.sizes), logits, "cross_entropy_over_t, logits")
    check_matches(parse_spec("B/d T", mesh.sizes), targets, "cross_entropy_over_t, targets")
    flat = logits.tensor.reshape(-1, logits.tensor.shape[-1])
    loss, dlogits = vocab_parallel_cross_entropy(flat, targets.tensor.reshape(-1), vocab_size, mesh.group("t"),
                                                 n_tokens)
    return (Sharded(loss, Spec((), frozenset({"d"})), mesh), Sharded(dlogits.view_as(logits.tensor), logits.spec, mesh))


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------
class Llama2D:
    """This rank's blocks of module 06's Llama on a d x t mesh; forward and backward in named axes."""

    def __init__(self, cfg: LlamaConfig, mesh: Mesh, seed: int = 0, dtype=torch.float32,
                 attention_chunk: int = ATTENTION_CHUNK):
        check_mesh_fits(cfg, mesh.sizes)
        whole = LlamaModel(cfg, seed, dtype)  # every rank builds the same model, then keeps its blocks
        self.cfg, self.mesh, self.attention_chunk = cfg, mesh, attention_chunk
        self.padded_vocab = padded_vocab_size(cfg.vocab_size, mesh.sizes["t"])
        self.embedding = shard(TOP_SPECS["embedding"], padded_rows(whole.embedding, self.padded_vocab), mesh)
        self.blocks = [BlockWeights(**{name: shard(spec, named_weight(cfg, name, getattr(b, name)), mesh)
                                       for name, spec in BLOCK_SPECS.items()}) for b in whole.blocks]
        self.final_norm = shard(TOP_SPECS["final_norm"], whole.final_norm, mesh)
        self.lm_head = shard(TOP_SPECS["lm_head"], padded_rows(whole.lm_head, self.padded_vocab), mesh)
        self._rope = {}

    def weights(self) -> list[Sharded]:
        """Every weight this rank keeps, in the order of LlamaGrads.tensors()."""
        return [self.embedding, *(s for b in self.blocks for s in b.tensors()), self.final_norm, self.lm_head]

    def parameters(self) -> list[torch.Tensor]:
        """What this rank's optimizer updates: its block of every weight."""
        return [s.tensor for s in self.weights()]

    def top(self) -> TopWeights:
        """This rank's blocks of the weights outside the blocks: FSDP's top unit."""
        return TopWeights(self.embedding, self.final_norm, self.lm_head)

    def rope(self, seq_len: int, dtype: torch.dtype) -> Rope:
        if (seq_len, dtype) not in self._rope:
            cos, sin = rope_tables(seq_len, self.cfg.head_dim, self.cfg.rope_theta, dtype)
            self._rope[seq_len, dtype] = Rope(cos, sin, cos.unsqueeze(1), sin.unsqueeze(1))
        return self._rope[seq_len, dtype]

    # --- FSDP's units over d (given) ---------------------------------------------------------------
    def start_gather(self, unit: BlockWeights | TopWeights, label: str) -> InFlight:
        """Start the one all-gather over d of a unit's weights; finish() gives them whole over d, in a unit
        of the same kind: BlockWeights(*finish(pending))."""
        return start_all_gather(gather_arrows(unit), unit.tensors(), label)

    def start_scatter(self, grads: BlockWeights | TopWeights, label: str) -> InFlight:
        """Start the one reduce-scatter over d of a unit's gradients (whole over d and unreduced over d, as
        the backward computes them); finish() gives this rank's block of each, in its weight's spec."""
        return start_reduce_scatter(scatter_arrows(grads), grads.tensors(), label)

    # --- forward: a unit's weights arrive whole over d ----------------------------------------------
    def embed(self, top: TopWeights, tokens: Sharded, store: ActivationStore) -> Sharded:
        """tokens[B/d T] -> x[B/d T M/t], the residual stream; top: the top unit gathered over d."""
        rows = self.padded_vocab // self.mesh.sizes["t"]
        # >>> TODO(m13): the embedding: a one-hot over this rank's vocabulary rows, contracted with the gathered table
        # Contract: return x[B/d T M/t], the embedding of this rank's rows of tokens, this rank's block of M; save the
        #   one-hot, a Sharded [B/d T V/t], under 'onehot' (the backward reads it). top.embedding is the table
        #   already gathered over d (its unit's all-gather, forward_backward's): [V/t M].
        # Maths: a lookup is a product with a one-hot: x = onehot . E, a sum over the vocabulary, onehot the tokens
        #   that fall in this rank's vocabulary rows (vocab_one_hot, given: first row i_t * rows). Which collective
        #   brings that product to the stream's spec follows from the table's spec, the stream's and the chapter's
        #   rules.
        # Pitfalls: this rank's first vocabulary row is its position along t times rows (not its rank); the one-hot
        #   takes the weights' dtype (top.embedding.tensor.dtype). Every collective through the module's functions
        #   (the tests read the log).
        # Hint 1: which three lines of the chapter's notation make a lookup: what is local, what is left unreduced?
        # Hint 2: onehot[B_d, T, V_t] is local (its first row i_t V'/t); x[B_d, T, M]{U_t} = onehot . E[V_t, M], a sum
        #         over V_t; then ReduceScatter_t onto M_t.
        # Hint 3: onehot = local("B/d T -> B/d T V/t", vocab_one_hot, tokens, first=i_t * rows (self.mesh.index),
        #                        rows=rows, dtype=the table's dtype)
        #         x = einsum_unreduced with the spec "B/d T V/t, V/t M -> B/d T M" of onehot and top.embedding
        #         save onehot; return reduce_scatter("B/d T M {U_t} -> B/d T M/t", x)
        onehot = local("B/d T -> B/d T V/t", vocab_one_hot, tokens, first=self.mesh.index["t"] * rows, rows=rows,
                       dtype=top.embedding.tensor.dtype)
        x = einsum_unreduced("B/d T V/t, V/t M -> B/d T M", onehot, top.embedding)
        store.save("onehot", onehot)
        return reduce_scatter("B/d T M {U_t} -> B/d T M/t", x)
        # <<<

    def attention_half(self, w: BlockWeights, x: Sharded, store: ActivationStore) -> Sharded:
        """x[B/d T M/t] -> h[B/d T M/t] = x + attention(RMSNorm(x)), saving what the backward reads."""
        cfg, rope = self.cfg, self.rope(x.tensor.shape[1], x.tensor.dtype)
        # >>> TODO(m13): the attention half, line for line with the chapter's equations
        # Contract: return h[B/d T M/t] = x + the attention output; save in the store, under these names, the
        #   activations the backward reads, as Sharded values with these specs: 'xg' (x gathered over t), 'n1',
        #   'r1', 'q', 'k' (after RoPE), 'v', 'o', 'lse'. Specs: xg, n1 [B/d T M]; r1 [B/d T]; q, o [B/d T K/t Q D];
        #   k, v [B/d T K/t D]; lse [B/d K/t Q T]. w holds the block's weights already gathered over d (its unit's
        #   all-gather, forward_backward's): wq [K/t Q D M], ..., ln1 [M/t]. Two collectives over t, the calls the
        #   tests count against the formula.
        # The question: the chapter's attention table, in code: which operation says each line, on which tensors?
        # Maths: RMSNorm is module 06's rmsnorm_forward, RoPE its rope_forward (rope.cos_q/sin_q for q's five
        #   dimensions, rope.cos/sin for k's four), attention grouped_attention_forward (chunk self.attention_chunk):
        #   local ops, whose signatures state their specs.
        # Pitfalls: what may be added to the residual stream, and what does RoPE rotate?
        # Hint 1: which lines of the chapter's attention table move data over t, and which of them happen at the same
        #         point of the code?
        # Hint 2: the chapter's table: [x, LN1] gathered over t in one collective; n1 = RMSNorm(x) LN1; q, k, v = n1 .
        #         W_Q, W_K, W_V over M; RoPE on q, k; attention; a{U_t} = o . W_O over K_t Q D; ReduceScatter_t; x + a.
        # Hint 3: xg, ln1 = finish(start_all_gather(["B/d T M/t -> B/d T M", "M/t -> M"], [x, w.ln1], label))
        #         n1, r1 = local("B/d T M, M -> B/d T M, B/d T", rmsnorm_forward, xg, ln1, eps=cfg.norm_eps)
        #         q = einsum_unreduced("B/d T M, K/t Q D M -> B/d T K/t Q D", n1, w.wq); k, v the same with "K/t D"
        #         q, k = local RoPE of each;  o, lse = local grouped attention of q, k, v
        #         a = reduce_scatter("B/d T M {U_t} -> B/d T M/t", einsum_unreduced("B/d T K/t Q D, M K/t Q D ->
        #         B/d T M", o, w.wo));  save the eight names;  return x + a
        xg, ln1 = finish(start_all_gather(["B/d T M/t -> B/d T M", "M/t -> M"], [x, w.ln1], "x, ln1"))
        n1, r1 = local("B/d T M, M -> B/d T M, B/d T", rmsnorm_forward, xg, ln1, eps=cfg.norm_eps)
        q = einsum_unreduced("B/d T M, K/t Q D M -> B/d T K/t Q D", n1, w.wq)
        k = einsum_unreduced("B/d T M, K/t D M -> B/d T K/t D", n1, w.wk)
        v = einsum_unreduced("B/d T M, K/t D M -> B/d T K/t D", n1, w.wv)
        q = local("B/d T K/t Q D -> B/d T K/t Q D", rope_forward, q, cos=rope.cos_q, sin=rope.sin_q)
        k = local("B/d T K/t D -> B/d T K/t D", rope_forward, k, cos=rope.cos, sin=rope.sin)
        o, lse = local("B/d T K/t Q D, B/d T K/t D, B/d T K/t D -> B/d T K/t Q D, B/d K/t Q T",
                       grouped_attention_forward, q, k, v, chunk=self.attention_chunk)
        a = einsum_unreduced("B/d T K/t Q D, M K/t Q D -> B/d T M", o, w.wo)
        a = reduce_scatter("B/d T M {U_t} -> B/d T M/t", a)
        for name, value in (("xg", xg), ("n1", n1), ("r1", r1), ("q", q), ("k", k), ("v", v), ("o", o),
                            ("lse", lse)):
            store.save(name, value)
        return x + a
        # <<<

    def ffn_half(self, w: BlockWeights, h: Sharded, store: ActivationStore) -> Sharded:
        """h[B/d T M/t] -> y[B/d T M/t] = h + FFN(RMSNorm(h)), saving what the backward reads."""
        cfg = self.cfg
        # >>> TODO(m13): the FFN half in named axes: each line's collectives and specs
        # Contract: return y[B/d T M/t] = h + the FFN output; save, as Sharded values, 'hg' (h with all of M, the
        #   norm's input), 'n2', 'r2', 'g', 'u', 's'. Specs: hg, n2 [B/d T M]; r2 [B/d T]; g, u, s [B/d T F/t]. w holds
        #   the block's weights already gathered over d (BLOCK_SPECS without d: w_gate [F/t M], ln2 [M/t]). The tests
        #   count the collectives against the formula: as many as the attention half's.
        # The question: the attention half's rules, on the FFN: which line moves what over t, and where?
        # Maths (module 06's FFN half): n2, r2 = RMSNorm(h) with ln2; g = n2 W_gate^T and u = n2 W_up^T; s = SwiGLU(g,
        #   u) (module 06's swiglu_forward, a local op); y = h + s W_down^T.
        # Pitfalls: which of these products leaves a partial sum, and what may be added to the residual?
        # Hint 1: the attention half's pattern: what is gathered over t before the norm, and what is reduce-scattered
        #         over t before the residual add?
        # Hint 2: [h, LN2] gathered over t together; g, u[B_d, T, F_t] = n2 . W_gate, n2 . W_up over M (nothing
        #         unreduced); f[B_d, T, M]{U_t} = s . W_down over F_t; ReduceScatter_t; y = h + f.
        # Hint 3: hg, ln2 = finish(start_all_gather(["B/d T M/t -> B/d T M", "M/t -> M"], [h, w.ln2], label))
        #         n2, r2 = local RMSNorm of hg with ln2
        #         g, u = einsum_unreduced("B/d T M, F/t M -> B/d T F/t", n2, w.w_gate), ... w.w_up
        #         s = local("B/d T F/t, B/d T F/t -> B/d T F/t", swiglu_forward, g, u)
        #         f = reduce_scatter over t of einsum_unreduced("B/d T F/t, M F/t -> B/d T M", s, w.w_down)
        #         save the six names;  return h + f
        hg, ln2 = finish(start_all_gather(["B/d T M/t -> B/d T M", "M/t -> M"], [h, w.ln2], "h, ln2"))
        n2, r2 = local("B/d T M, M -> B/d T M, B/d T", rmsnorm_forward, hg, ln2, eps=cfg.norm_eps)
        g = einsum_unreduced("B/d T M, F/t M -> B/d T F/t", n2, w.w_gate)
        u = einsum_unreduced("B/d T M, F/t M -> B/d T F/t", n2, w.w_up)
        s = local("B/d T F/t, B/d T F/t -> B/d T F/t", swiglu_forward, g, u)
        f = einsum_unreduced("B/d T F/t, M F/t -> B/d T M", s, w.w_down)
        f = reduce_scatter("B/d T M {U_t} -> B/d T M/t", f)
        for name, value in (("hg", hg), ("n2", n2), ("r2", r2), ("g", g), ("u", u), ("s", s)):
            store.save(name, value)
        return h + f
        # <<<

    def loss_forward(self, top: TopWeights, x: Sharded, targets: Sharded, n_tokens: int,
                     store: ActivationStore) -> Sharded:
        """x[B/d T M/t] (the last block's output) -> the mean loss over the global batch's n_tokens
        tokens, the same on every rank (spec: a scalar); top: the top unit gathered over d. Saves what
        loss_backward reads."""
        cfg = self.cfg
        # >>> TODO(m13): the final norm, the LM head's logits, the vocabulary-parallel loss, its sum over d
        # Contract: return loss[], the mean cross-entropy over all n_tokens tokens of the global batch, the same on
        #   every rank. Save 'xf' (x with all of M, the final norm's input), 'nf', 'rf' (the norm's output and
        #   statistics) and 'dlogits' (cross_entropy_over_t computes the gradient with the loss). top holds the final
        #   norm and the LM head already gathered over d: [M/t] and [V/t M].
        # The question: from the stream's spec to the spec cross_entropy_over_t takes, and from its loss to one
        #   number on every rank: which collectives, over which axes?
        # Maths: nf, rf = RMSNorm(x) with the final norm; logits = nf LM_head^T, a sum over M; cross_entropy_over_t
        #   (given) takes logits [B/d T V/t] and returns this rank's rows' share of the mean, {U_d}.
        # Pitfalls: n_tokens is the global batch's token count (the caller passes it): what is the gradient of the
        #   mean over the global batch per token? What does a scalar's spec list?
        # Hint 1: which of the FFN half's first lines apply here, and what is left to sum at the end?
        # Hint 2: [x, LN_f] gathered over t together; nf = RMSNorm(x) LN_f; logits[B_d, T, V_t] = nf . LM_head over M;
        #         the loss{U_d} summed over d.
        # Hint 3: xf, norm = finish(start_all_gather([stream's arrow, "M/t -> M"], [x, top.final_norm], label))
        #         nf, rf = local RMSNorm of xf with norm
        #         logits = einsum_unreduced("B/d T M, V/t M -> B/d T V/t", nf, top.lm_head)
        #         loss, dlogits = cross_entropy_over_t(logits, targets, cfg.vocab_size, n_tokens)
        #         save xf, nf, rf, dlogits;  return all_reduce("{U_d} ->", loss)
        xf, norm = finish(start_all_gather(["B/d T M/t -> B/d T M", "M/t -> M"], [x, top.final_norm], "x, final_norm"))
        nf, rf = local("B/d T M, M -> B/d T M, B/d T", rmsnorm_forward, xf, norm, eps=cfg.norm_eps)
        logits = einsum_unreduced("B/d T M, V/t M -> B/d T V/t", nf, top.lm_head)
        loss, dlogits = cross_entropy_over_t(logits, targets, cfg.vocab_size, n_tokens)
        for name, value in (("xf", xf), ("nf", nf), ("rf", rf), ("dlogits", dlogits)):
            store.save(name, value)
        return all_reduce("{U_d} ->", loss)
        # <<<

    # --- backward --------------------------------------------------------------------------------
    def loss_backward(self, top: TopWeights, store: ActivationStore) -> tuple[Sharded, Sharded, Sharded]:
        """(dx[B/d T M/t], d final_norm[M/t {U_d}], d lm_head[V/t M {U_d}]) from what loss_forward saved and
        the top unit gathered over d (the forward's: not gathered again)."""
        # >>> TODO(m13): the backward of the LM head and the final norm
        # Contract: return (dx, d_final_norm, d_lm_head): the gradient of the last block's output in the stream's
        #   layout [B/d T M/t], and the two weights' gradients as their unit's reduce-scatter over d takes them: in the
        #   specs of the weights as top holds them (gathered over d), unreduced over d: [M/t {U_d}], [V/t M {U_d}].
        #   The top unit is the forward's (it is not gathered again).
        # The question: by the chapter's two rules of the backward, which collectives does each line need, and which
        #   of them happen at the same point of the code?
        # Maths (module 06's, from what loss_forward saved): dn = dlogits LM_head, a sum over the vocabulary;
        #   dLM_head = dlogits^T nf, a sum over the tokens; dxf, dfinal_norm = RMSNorm's backward (module 06's
        #   rmsnorm_backward, linear in dn) at xf, rf.
        # Pitfalls: the norm weight's gradient is a sum over the rows of the batch *and* linear in dn: over which
        #   axes is it a partial sum, and which of them is left to the unit? Is dx summed, or only sliced?
        # Hint 1: what is unreduced over t after the norm's backward, and must it travel in two collectives?
        # Hint 2: dn[B_d, T, M]{U_t} = dlogits . LM_head over V_t; dLM_head[V_t, M]{U_d} = dlogitsᵀ . nf over B_d, T;
        #         dxf{U_t}, dLN_f[M]{U_d,t} = RMSNorm's backward; [dxf, dLN_f] reduce-scattered over t together.
        # Hint 3: dn = einsum_unreduced("B/d T V/t, V/t M -> B/d T M", dlogits, top.lm_head)
        #         d_head = einsum_unreduced("B/d T V/t, B/d T M -> V/t M", dlogits, nf)
        #         dxf, d_norm = local("B/d T M {U_t}, B/d T M, B/d T, M -> B/d T M {U_t}, M {U_d,t}",
        #                             rmsnorm_backward, dn, xf, rf, the final norm gathered over t)
        #         dx, d_norm = finish(start_reduce_scatter(["B/d T M {U_t} -> B/d T M/t", "M {U_d,t} -> M/t {U_d}"],
        #                                                  [dxf, d_norm], label));  return dx, d_norm, d_head
        dlogits, nf = store["dlogits"], store["nf"]
        dn = einsum_unreduced("B/d T V/t, V/t M -> B/d T M", dlogits, top.lm_head)
        d_head = einsum_unreduced("B/d T V/t, B/d T M -> V/t M", dlogits, nf)
        norm = all_gather("M/t -> M", top.final_norm)
        dxf, d_norm = local("B/d T M {U_t}, B/d T M, B/d T, M -> B/d T M {U_t}, M {U_d,t}", rmsnorm_backward,
                            dn, store["xf"], store["rf"], norm)
        dx, d_norm = finish(start_reduce_scatter(["B/d T M {U_t} -> B/d T M/t", "M {U_d,t} -> M/t {U_d}"],
                                                 [dxf, d_norm], "dx, d final_norm"))
        return dx, d_norm, d_head
        # <<<

    def ffn_half_backward(self, w: BlockWeights, dy: Sharded, store: ActivationStore, grads: dict) -> Sharded:
        """dy[B/d T M/t] -> dh[B/d T M/t]; puts the gradients of w_down, w_gate, w_up and ln2 into grads."""
        # >>> TODO(m13): the FFN half's backward in named axes: the forward's collectives conjugated, each weight's gradient
        # Contract: return dh[B/d T M/t], the gradient of the half's input h; set grads["w_down"], grads["w_gate"],
        #   grads["w_up"], grads["ln2"], each as the block's reduce-scatter over d takes it: in the spec of its weight
        #   as w holds it (gathered over d: w_down [M F/t], ln2 [M/t]), unreduced over d. Read g, u, s, hg, n2, r2
        #   from the store. The tests count the collectives: one over t for each of the forward's.
        # The question: which collective is each of the forward's conjugated into, and what travels with it?
        # Maths (module 06's FFN backward, the forward in reverse): ds = dy W_down; dW_down = dy^T s over the tokens;
        #   dg, du = SwiGLU's backward (module 06's swiglu_backward, local); dn2 = dg W_gate + du W_up; dW_gate =
        #   dg^T n2 and dW_up = du^T n2; dhg, dln2 = RMSNorm's backward at hg, r2; dh = dy + dhg.
        # Pitfalls: how many times does the residual add dy? Over which axes is each weight's gradient still a
        #   partial sum, and which of them does the block's unit sum, once, for all nine?
        # Hint 1: reading the forward bottom to top, what does each all-gather become, each reduce-scatter, and each
        #         contraction with a weight?
        # Hint 2: [dy, LN2] gathered over t together; ds = dy . W_down over M; dW_down[M, F_t]{U_d} = dyᵀ . s over
        #         B_d, T; dn2{U_t} = dg . W_gate + du . W_up over F_t; dW_gate, dW_up{U_d} with n2; dhg{U_t},
        #         dLN2{U_d,t} = RMSNorm's backward; [dhg, dLN2] reduce-scattered over t together; dh = dy + dhg.
        # Hint 3: dyg, ln2 = finish(start_all_gather(["B/d T M/t -> B/d T M", "M/t -> M"], [dy, w.ln2], label))
        #         ds = einsum_unreduced("B/d T M, M F/t -> B/d T F/t", dyg, w.w_down)
        #         grads["w_down"] = einsum_unreduced("B/d T M, B/d T F/t -> M F/t", dyg, s)
        #         dg, du = local with the spec "B/d T F/t, B/d T F/t, B/d T F/t -> B/d T F/t, B/d T F/t",
        #                  swiglu_backward, ds, g, u
        #         dn2 = einsum_unreduced with "B/d T F/t, F/t M -> B/d T M" of (dg, w.w_gate), plus the same of
        #               (du, w.w_up)
        #         grads["w_gate"], grads["w_up"] = einsum_unreduced("B/d T F/t, B/d T M -> F/t M", dg or du, n2)
        #         dhg, d_ln2 = local norm backward of dn2 at hg, r2, ln2 ("... -> B/d T M {U_t}, M {U_d,t}")
        #         dhg, grads["ln2"] = finish(start_reduce_scatter([stream's arrow, "M {U_d,t} -> M/t {U_d}"],
        #                                                         [dhg, d_ln2], label))
        #         return dy + dhg
        g, u, s, n2 = store["g"], store["u"], store["s"], store["n2"]
        dyg, ln2 = finish(start_all_gather(["B/d T M/t -> B/d T M", "M/t -> M"], [dy, w.ln2], "dy, ln2"))
        ds = einsum_unreduced("B/d T M, M F/t -> B/d T F/t", dyg, w.w_down)
        grads["w_down"] = einsum_unreduced("B/d T M, B/d T F/t -> M F/t", dyg, s)
        dg, du = local("B/d T F/t, B/d T F/t, B/d T F/t -> B/d T F/t, B/d T F/t", swiglu_backward, ds, g, u)
        dn2 = (einsum_unreduced("B/d T F/t, F/t M -> B/d T M", dg, w.w_gate)
               + einsum_unreduced("B/d T F/t, F/t M -> B/d T M", du, w.w_up))
        grads["w_gate"] = einsum_unreduced("B/d T F/t, B/d T M -> F/t M", dg, n2)
        grads["w_up"] = einsum_unreduced("B/d T F/t, B/d T M -> F/t M", du, n2)
        dhg, d_ln2 = local("B/d T M {U_t}, B/d T M, B/d T, M -> B/d T M {U_t}, M {U_d,t}", rmsnorm_backward,
                           dn2, store["hg"], store["r2"], ln2)
        dhg, grads["ln2"] = finish(start_reduce_scatter(["B/d T M {U_t} -> B/d T M/t", "M {U_d,t} -> M/t {U_d}"],
                                                        [dhg, d_ln2], "dh, d ln2"))
        return dy + dhg
        # <<<

    def attention_half_backward(self, w: BlockWeights, dh: Sharded, store: ActivationStore, grads: dict) -> Sharded:
        """dh[B/d T M/t] -> dx[B/d T M/t]; puts the gradients of wo, wq, wk, wv and ln1 into grads."""
        rope = self.rope(dh.tensor.shape[1], dh.tensor.dtype)
        # >>> TODO(m13): the attention half's backward in named axes
        # Contract: return dx[B/d T M/t], the gradient of the block's input; set grads["wo"], grads["wq"],
        #   grads["wk"], grads["wv"], grads["ln1"], each as in the FFN half's backward (the spec of its weight as w
        #   holds it, unreduced over d). Read xg, n1, r1, q, k, v, o, lse from the store.
        # The question: the FFN half's backward, for attention: what changes, what does not?
        # Maths (module 06's attention backward, the forward in reverse): do = dh W_o; dW_o = dh^T o over the
        #   tokens; dq, dk, dv = attention's backward (grouped_attention_backward, local, chunk
        #   self.attention_chunk, from the saved q and k after RoPE, v, o and lse); RoPE's backward on dq and dk
        #   (rope_backward with the forward's tables), never on dv; dn1 = dq W_q + dk W_k + dv W_v; dW_q = dq^T n1,
        #   and so for k and v; dxg, dln1 = RMSNorm's backward at xg, r1; dx = dh + dxg.
        # Pitfalls: as in the FFN half's backward; which of the three gradients does RoPE's backward touch?
        # Hint 1: where does attention stand in for SwiGLU, and three projections for two?
        # Hint 2: [dh, LN1] gathered over t together; do = dh . W_O over M; dW_O[M, K_t, Q, D]{U_d} = dhᵀ . o;
        #         dn1{U_t} = dq . W_Q + dk . W_K + dv . W_V over K_t (Q) D; dW_Q{U_d} = dqᵀ . n1, and so for k and v;
        #         [dxg, dLN1] reduce-scattered over t together; dx = dh + dxg.
        # Hint 3: dhg, ln1 = finish(start_all_gather(["B/d T M/t -> B/d T M", "M/t -> M"], [dh, w.ln1], label))
        #         do = einsum_unreduced("B/d T M, M K/t Q D -> B/d T K/t Q D", dhg, w.wo)
        #         grads["wo"] = einsum_unreduced("B/d T M, B/d T K/t Q D -> M K/t Q D", dhg, o)
        #         dq, dk, dv = local(q's, k's, v's, o's and lse's specs -> dq's, dk's, dv's,
        #                            grouped_attention_backward, do, q, k, v, o, lse, chunk=self.attention_chunk)
        #         dq, dk = local rope_backward of each (cos=rope.cos_q, sin=rope.sin_q for dq)
        #         dn1 = the sum of einsum_unreduced with "B/d T K/t Q D, K/t Q D M -> B/d T M" of (dq, w.wq) and with
        #               "B/d T K/t D, K/t D M -> B/d T M" of (dk, w.wk) and of (dv, w.wv)
        #         grads["wq"] = einsum_unreduced("B/d T K/t Q D, B/d T M -> K/t Q D M", dq, n1); for wk and wv the
        #               spec "B/d T K/t D, B/d T M -> K/t D M"
        #         dxg, d_ln1 = local norm backward;  dxg, grads["ln1"] = finish(start_reduce_scatter([stream's arrow,
        #               "M {U_d,t} -> M/t {U_d}"], [dxg, d_ln1], label))
        #         return dh + dxg
        n1 = store["n1"]
        dhg, ln1 = finish(start_all_gather(["B/d T M/t -> B/d T M", "M/t -> M"], [dh, w.ln1], "dh, ln1"))
        do = einsum_unreduced("B/d T M, M K/t Q D -> B/d T K/t Q D", dhg, w.wo)
        grads["wo"] = einsum_unreduced("B/d T M, B/d T K/t Q D -> M K/t Q D", dhg, store["o"])
        dq, dk, dv = local("B/d T K/t Q D, B/d T K/t Q D, B/d T K/t D, B/d T K/t D, B/d T K/t Q D, B/d K/t Q T"
                           " -> B/d T K/t Q D, B/d T K/t D, B/d T K/t D", grouped_attention_backward,
                           do, store["q"], store["k"], store["v"], store["o"], store["lse"], chunk=self.attention_chunk)
        dq = local("B/d T K/t Q D -> B/d T K/t Q D", rope_backward, dq, cos=rope.cos_q, sin=rope.sin_q)
        dk = local("B/d T K/t D -> B/d T K/t D", rope_backward, dk, cos=rope.cos, sin=rope.sin)
        dn1 = (einsum_unreduced("B/d T K/t Q D, K/t Q D M -> B/d T M", dq, w.wq)
               + einsum_unreduced("B/d T K/t D, K/t D M -> B/d T M", dk, w.wk)
               + einsum_unreduced("B/d T K/t D, K/t D M -> B/d T M", dv, w.wv))
        grads["wq"] = einsum_unreduced("B/d T K/t Q D, B/d T M -> K/t Q D M", dq, n1)
        grads["wk"] = einsum_unreduced("B/d T K/t D, B/d T M -> K/t D M", dk, n1)
        grads["wv"] = einsum_unreduced("B/d T K/t D, B/d T M -> K/t D M", dv, n1)
        dxg, d_ln1 = local("B/d T M {U_t}, B/d T M, B/d T, M -> B/d T M {U_t}, M {U_d,t}", rmsnorm_backward,
                           dn1, store["xg"], store["r1"], ln1)
        dxg, grads["ln1"] = finish(start_reduce_scatter(["B/d T M {U_t} -> B/d T M/t", "M {U_d,t} -> M/t {U_d}"],
                                                        [dxg, d_ln1], "dx, d ln1"))
        return dh + dxg
        # <<<

    def embed_backward(self, dx: Sharded, store: ActivationStore) -> Sharded:
        """dx[B/d T M/t] (the gradient of the first block's input) -> d embedding[V/t M {U_d}], as the top
        unit's reduce-scatter over d takes it."""
        # >>> TODO(m13): the embedding's gradient, back to this rank's block of the table
        # Contract: return the embedding's gradient as the top unit's reduce-scatter takes it: [V/t M {U_d}], this
        #   rank's vocabulary rows, all of M, this rank's rows' share of the sum (the unit's collective sums over d).
        # Maths: the forward's product transposed: dE = onehot^T dx, a sum over the tokens (the saved one-hot, the
        #   gradient of the first block's input). Its collectives and specs follow from the chapter's two rules of the
        #   backward.
        # Pitfalls: the one-hot is [B/d T V/t] and dx is split over t: the product needs all of M on this rank; a token
        #   seen twice adds twice (the contraction does it).
        # Hint 1: which of the forward's collectives does the backward conjugate here, and which is left to the unit?
        # Hint 2: AllGather_t of dx (all of M on this rank), then dE[V_t, M]{U_d} = onehotᵀ . dx, a sum over B_d and
        #         T; the sum over d is the top unit's reduce-scatter.
        # Hint 3: dxg = all_gather("B/d T M/t -> B/d T M", dx)
        #         return einsum_unreduced with the spec "B/d T V/t, B/d T M -> V/t M" of store["onehot"] and dxg
        dxg = all_gather("B/d T M/t -> B/d T M", dx)
        return einsum_unreduced("B/d T V/t, B/d T M -> V/t M", store["onehot"], dxg)
        # <<<

    # --- one step ----------------------------------------------------------------------------------
    def forward_backward(self, tokens: torch.Tensor, targets: torch.Tensor, n_tokens: int | None = None):
        """(loss, LlamaGrads of Sharded) for the global batch tokens, targets (B, T): the same tensors on every
        rank, each keeping its rows B/d. The loss is summed over the real targets of the whole batch and divided
        by n_tokens (module 06's convention; default: their count); each gradient is this rank's block of its
        gradient, in its weight's spec."""
        self.cfg.check_seq_len(tokens.shape[1])
        mesh, n_tokens = self.mesh, real_tokens(targets) if n_tokens is None else n_tokens
        tokens, targets = shard("B/d T", tokens, mesh), shard("B/d T", targets, mesh)
        saved, stores, L = ActivationStore(), [ActivationStore() for _ in self.blocks], len(self.blocks)
        # >>> TODO(m13): the step's units over d: one gather per unit and pass, each started a unit ahead
        # Contract: return (loss.tensor, LlamaGrads(d_embedding, [a BlockWeights per block], d_final_norm, d_lm_head)),
        #   every gradient this rank's block in its weight's spec, as module 06 computes it. Over d the step issues
        #   grouped collectives only, one per unit and pass (self.start_gather, self.start_scatter, finish): the top
        #   unit (self.top()) is gathered once a step, each block twice (its forward and its backward: no whole block
        #   is kept between the passes), and every unit's gradients are reduce-scattered once.
        # Overlap, which the tests read off the collectives in flight: when a block's forward starts, the next block's
        #   gather is already on its way; when the loss starts, the last block's backward gather; when a block's
        #   backward starts, the gather of the block before it; a block's reduce-scatter is started as soon as its
        #   backward has its gradients, and left to travel while the earlier blocks compute.
        # The question: in what order does the step need its units, and what can travel while each one computes?
        # Pitfalls: what does a gather finished right after it starts overlap with? Does the loss's backward need
        #   the top unit gathered again? Is every collective started also finished (finish is where it is waited for)?
        # Hint 1: if every gather is started one unit ahead of its use and finished just before, where does each
        #         start, counting the loss as a unit?
        # Hint 2: the units in the order the step uses them: top, blocks 0 .. L-1, (top: loss, kept), blocks L-1 .. 0,
        #         (top: the embedding's backward, no weights). Unit k + 1's gather is started before unit k's is
        #         finished and unit k computes; the reduce-scatters are finished after the embedding's backward.
        # Hint 3: top_pending, pending = self.start_gather(self.top(), "top"), self.start_gather(block 0, ...)
        #         top = TopWeights(*finish(top_pending));  x = self.embed(top, tokens, saved)
        #         for each layer: current = pending;  if there is a next one: pending =
        #             self.start_gather(self.blocks[layer + 1], its label)
        #             w = BlockWeights(*finish(current));  x = the two halves with w
        #         pending = self.start_gather(self.blocks[-1], its label);  loss = self.loss_forward(top, ...)
        #         dx, d_norm, d_head = self.loss_backward(top, saved)
        #         for each layer from the last: current = pending;  if there is one before: pending =
        #             self.start_gather(self.blocks[layer - 1], its label)
        #             w = finish(current);  grads = {} filled by the two backward halves
        #             scatters[layer] = self.start_scatter(BlockWeights(**grads), ...);  clear its store
        #         d_emb = self.embed_backward(dx, saved)
        #         top_grads = TopWeights(*finish(self.start_scatter(TopWeights(d_emb, d_norm, d_head), "top")))
        #         return loss.tensor, LlamaGrads from top_grads and BlockWeights(*finish(s)) for each scatter
        top_pending, pending = self.start_gather(self.top(), "top"), self.start_gather(self.blocks[0], "block 0")
        top = TopWeights(*finish(top_pending))
        x = self.embed(top, tokens, saved)
        for layer in range(L):
            current = pending
            if layer + 1 < L:
                pending = self.start_gather(self.blocks[layer + 1], f"block {layer + 1}")
            w = BlockWeights(*finish(current))
            x = self.ffn_half(w, self.attention_half(w, x, stores[layer]), stores[layer])
        pending = self.start_gather(self.blocks[-1], f"block {L - 1}")
        loss = self.loss_forward(top, x, targets, n_tokens, saved)
        dx, d_final_norm, d_lm_head = self.loss_backward(top, saved)
        scatters = [None] * L
        for layer in reversed(range(L)):
            current = pending
            if layer > 0:
                pending = self.start_gather(self.blocks[layer - 1], f"block {layer - 1}")
            w, grads = BlockWeights(*finish(current)), {}
            dh = self.ffn_half_backward(w, dx, stores[layer], grads)
            dx = self.attention_half_backward(w, dh, stores[layer], grads)
            scatters[layer] = self.start_scatter(BlockWeights(**grads), f"block {layer}")
            stores[layer].clear()
        d_embedding = self.embed_backward(dx, saved)
        top_grads = TopWeights(*finish(self.start_scatter(TopWeights(d_embedding, d_final_norm, d_lm_head), "top")))
        block_grads = [BlockWeights(*finish(pending)) for pending in scatters]
        return loss.tensor, LlamaGrads(top_grads.embedding, block_grads, top_grads.final_norm, top_grads.lm_head)
        # <<<

    def train_step(self, tokens: torch.Tensor, targets: torch.Tensor, n_microbatches: int, optimizer) -> float:
        """One optimizer step on the global batch (the same on every rank), in n_microbatches whose
        gradients add up (every rank keeps its rows B/d of each); returns the step's mean loss."""
        check_mesh_fits(self.cfg, self.mesh.sizes, tokens.shape[0], n_microbatches)
        n_tokens = real_tokens(targets)  # every microbatch divides by the whole step's count
        loss, params = 0.0, self.parameters()
        for p in params:
            p.grad = None
        for tok, tgt in microbatches(tokens, targets, n_microbatches):
            part, grads = self.forward_backward(tok, tgt, n_tokens)
            loss += part.item()
            for p, g in zip(params, grads.tensors(), strict=True):
                p.grad = g.tensor if p.grad is None else p.grad.add_(g.tensor)
        optimizer.step()  # AdamW is elementwise: each rank updates its blocks as one process would
        return loss
