"""Module 06, part 2 - the transformer block: a forward sequence and its backward in reverse.

A Llama block is two pre-norm residual sublayers on the stream x (chapter 06, "The block"):

    h = x + Attention(RMSNorm(x; ln1))        causal grouped-query attention, RoPE on q and k, o projection
    y = h + FFN(RMSNorm(h; ln2))              SwiGLU of the gate and up projections, down projection

`LlamaBlock.forward(w, x, store)` runs them with the ops of m06_llama_ops and saves what their
backwards need in `store`; `LlamaBlock.backward(w, dy, store)` runs the backwards in reverse and
returns (dx, grads). The block holds no weights: they are passed in, so a weight source can
gather them just in time (modules 07, 08). Its linears all go through `self.matmul` (module 09),
and the store decides what is kept (module 10).
"""
from dataclasses import dataclass, fields

import torch

from .m06_llama_ops import (ATTENTION_CHUNK, ChunkedAttention, Matmul, linear_backward,
                            linear_forward, residual_rmsnorm_backward, residual_rmsnorm_forward,
                            rmsnorm_backward, rmsnorm_forward, rope_backward, rope_forward, rope_tables,
                            swiglu_backward, swiglu_forward)


@dataclass(frozen=True)
class LlamaConfig:
    dim: int = 64            # width of the residual stream
    n_heads: int = 4         # query heads
    n_kv_heads: int = 2      # key/value heads (grouped-query attention: n_heads is a multiple)
    head_dim: int = 16       # n_heads * head_dim == dim
    ffn_dim: int = 176       # hidden width of the SwiGLU feed-forward
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    vocab_size: int = 256    # bytes
    n_layers: int = 2
    max_seq_len: int = 64

    def __post_init__(self):
        for name in ("dim", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "vocab_size", "n_layers", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"LlamaConfig.{name} must be a positive integer, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}: "
                             "each key/value head must serve the same number of query heads")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even: RoPE rotates pairs of dimensions")
        if self.n_heads * self.head_dim != self.dim:
            raise ValueError(f"n_heads * head_dim = {self.n_heads} * {self.head_dim} = "
                             f"{self.n_heads * self.head_dim} must equal dim={self.dim}")
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise ValueError(f"rope_theta and norm_eps must be positive, got {self.rope_theta} and {self.norm_eps}")

    def check_seq_len(self, seq_len: int):
        if not 1 <= seq_len <= self.max_seq_len:
            raise ValueError(f"sequence length {seq_len} is outside 1..max_seq_len={self.max_seq_len}")


@dataclass
class BlockWeights:
    """One block's weights (linears are (out, in) like nn.Linear). Also used for their gradients."""
    ln1: torch.Tensor     # (dim,)
    wq: torch.Tensor      # (n_heads * head_dim, dim)
    wk: torch.Tensor      # (n_kv_heads * head_dim, dim)
    wv: torch.Tensor      # (n_kv_heads * head_dim, dim)
    wo: torch.Tensor      # (dim, n_heads * head_dim)
    ln2: torch.Tensor     # (dim,)
    w_gate: torch.Tensor  # (ffn_dim, dim)
    w_up: torch.Tensor    # (ffn_dim, dim)
    w_down: torch.Tensor  # (dim, ffn_dim)

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self)]


def init_block_weights(cfg: LlamaConfig, generator: torch.Generator, dtype=torch.float32) -> BlockWeights:
    """Norm weights at 1, linears drawn from N(0, 1/in_features) so activations keep their scale."""
    def linear(out_features, in_features):
        return (torch.randn(out_features, in_features, generator=generator, dtype=torch.float64)
                / in_features ** 0.5).to(dtype)
    kv = cfg.n_kv_heads * cfg.head_dim
    return BlockWeights(ln1=torch.ones(cfg.dim, dtype=dtype), wq=linear(cfg.dim, cfg.dim), wk=linear(kv, cfg.dim),
                        wv=linear(kv, cfg.dim), wo=linear(cfg.dim, cfg.dim), ln2=torch.ones(cfg.dim, dtype=dtype),
                        w_gate=linear(cfg.ffn_dim, cfg.dim), w_up=linear(cfg.ffn_dim, cfg.dim),
                        w_down=linear(cfg.dim, cfg.ffn_dim))


class ActivationStore:
    """The activations one block saves in its forward for its backward, by name. A value is a
    tensor, or a tuple of tensors (module 09 keeps an FP8 tensor with its scale).

    `keep` is the set of names to keep (None: all of them). A name that is not kept is dropped at
    once, so its memory is freed when the forward moves on; module 10's backward recomputes it and
    puts it back with `restore` before the normal backward reads it.
    """

    def __init__(self, keep: frozenset | None = None):
        self.keep, self.tensors = keep, {}

    def save(self, name: str, tensor: torch.Tensor):
        if self.keep is None or name in self.keep:
            self.tensors[name] = tensor

    def restore(self, name: str, tensor: torch.Tensor):
        self.tensors[name] = tensor

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise KeyError(f"activation {name!r} was not kept by this store; recompute it before the backward")
        return self.tensors[name]

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def clear(self):
        self.tensors.clear()

    def nbytes(self) -> int:
        """Bytes of memory the store holds alive: each distinct storage once, whole (a small view
        of a big tensor keeps all of it alive)."""
        tensors = [t for value in self.tensors.values() for t in (value if isinstance(value, tuple) else (value,))]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        return sum(storages.values())


class LlamaBlock:
    """The block's computation, without its weights: forward and backward over an activation store."""

    def __init__(self, cfg: LlamaConfig, matmul: Matmul | None = None, attention_chunk: int = ATTENTION_CHUNK,
                 attention=None):
        self.cfg, self.matmul = cfg, matmul or Matmul()
        self.attention = attention or ChunkedAttention(attention_chunk)  # forward / backward pair
        self._rope = {}

    def new_store(self) -> ActivationStore:
        """An empty store for one layer's activations (module 10 overrides what it keeps)."""
        return ActivationStore()

    def rope(self, seq_len: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin tables for this sequence length, built once per dtype and device."""
        key = (seq_len, dtype, str(device))
        if key not in self._rope:
            self._rope[key] = rope_tables(seq_len, self.cfg.head_dim, self.cfg.rope_theta, dtype, device)
        return self._rope[key]

    def attention_half(self, w: BlockWeights, x: torch.Tensor, store: ActivationStore) -> torch.Tensor:
        """x -> attention output (B, T, heads * head_dim), before the o projection."""
        cfg, mm = self.cfg, self.matmul
        B, T, _ = x.shape
        cos, sin = self.rope(T, x.dtype, x.device)
        # >>> TODO(m06): the attention half's forward, saving exactly what its backward reads
        # Contract: x is (B, T, dim), w the block's weights, cos and sin (above) RoPE's tables for this length. Return
        #   o, attention's output (B, T, n_heads * head_dim) before the o projection, as the module docstring
        #   defines it. Afterwards the store holds 'x', 'n1', 'r1', 'q', 'k', 'v', 'o' and 'lse' (q, k and v as
        #   attention read them) and nothing else of this half. Every linear goes through linear_forward with
        #   self.matmul and attention through self.attention (chunked, or the fused kernel): the tests count the
        #   calls and compare o with an nn.Module Llama block's.
        # The matmul seam: q, k and v read one input. The policy's prepare sees it once, under the name 'n1' (prepare
        #   saves it there), and the three projections multiply what prepare returned (module 09 quantizes it there).
        # Question: which tensors will this half's backward read, in which shapes, and which op makes each?
        # Pitfalls: which of q, k and v does RoPE turn? A projection gives (B, T, heads * head_dim): how many heads
        #   do q, k and v each have? Which saved names does prepare save, and which are yours to save?
        # Hint 1: the chapter's "The block: a chain and its reverse" tables GPT-2's MLP sublayer: can you draw the same
        #         table for this half? rmsnorm_backward, rope_backward and self.attention.backward name by their
        #         arguments what each backward reads.
        # Hint 2: (n1, r1) = RMSNorm(x; ln1); q = RoPE(n1 W_qᵀ) with n_heads heads, k = RoPE(n1 W_kᵀ) and v = n1 W_vᵀ
        #         with n_kv_heads; (o, lse) = attention(q, k, v); the store: x, n1 (by prepare), r1, q, k, v, o, lse.
        # Hint 3: n1, r1 = rmsnorm_forward(x, w.ln1, cfg.norm_eps);  n1 = mm.prepare(n1, store, "n1")
        #         q = rope_forward(linear_forward(n1, w.wq, mm).view(B, T, cfg.n_heads, cfg.head_dim), cos, sin)
        #         k = the same with w.wk and cfg.n_kv_heads;  v = linear_forward(n1, w.wv, mm).view(...), no RoPE
        #         o, lse = self.attention.forward(q, k, v)
        #         store.save each of x, r1, q, k, v, o, lse under its name;  return o
        n1, r1 = rmsnorm_forward(x, w.ln1, cfg.norm_eps)
        n1 = mm.prepare(n1, store, "n1")
        q = rope_forward(linear_forward(n1, w.wq, mm).view(B, T, cfg.n_heads, cfg.head_dim), cos, sin)
        k = rope_forward(linear_forward(n1, w.wk, mm).view(B, T, cfg.n_kv_heads, cfg.head_dim), cos, sin)
        v = linear_forward(n1, w.wv, mm).view(B, T, cfg.n_kv_heads, cfg.head_dim)
        o, lse = self.attention.forward(q, k, v)
        for name, tensor in (("x", x), ("r1", r1), ("q", q), ("k", k), ("v", v), ("o", o), ("lse", lse)):
            store.save(name, tensor)
        return o
        # <<<

    def ffn_half(self, w: BlockWeights, x: torch.Tensor, o: torch.Tensor, store: ActivationStore):
        """(block input x, attention output o) -> (h, s): the residual stream after attention and
        the SwiGLU output (prepared for the down projection). o is not prepared: attention's backward
        needs it as it is, so the o projection takes o itself (an FP8 policy converts it when it multiplies)."""
        cfg, mm = self.cfg, self.matmul
        # >>> TODO(m06): the FFN half's forward up to SwiGLU, saving what its backward reads
        # Contract: x is the block input and o attention's output (B, T, n_heads * head_dim). Return (h, s): h, the
        #   residual stream after attention (B, T, dim), and s, SwiGLU's output (B, T, ffn_dim) as the policy's prepare
        #   returned it (the down projection, given in forward, multiplies it), as the module docstring defines
        #   them. Afterwards the store holds 'h', 'n2', 'r2', 'g', 'u' and 's' and nothing else of this half; 'n2' and
        #   's' get there through mm.prepare (gate and up read one n2). Every linear goes through linear_forward with
        #   self.matmul (the tests count the calls, and which of them multiply a prepared input).
        # Question: which tensors will this half's backward read, and which of them are linear inputs the policy
        #   must see once?
        # Pitfalls: o is kept as it is for attention's backward: is it prepared? How many times is n2 prepared when
        #   two linears read it (module 09 would quantize it each time)?
        # Hint 1: the chapter's "The block: a chain and its reverse" tables GPT-2's MLP sublayer: what does the same
        #         table give for this half? The residual add and the second norm are one op here.
        # Hint 2: h = x + o W_oᵀ and (n2, r2) = RMSNorm(h; ln2); g = n2 W_gateᵀ, u = n2 W_upᵀ; s = SwiGLU(g, u); the
        #         store: h, n2 (by prepare), r2, g, u, s (by prepare).
        # Hint 3: h, n2, r2 = residual_rmsnorm_forward(x, linear_forward(o, w.wo, mm), w.ln2, cfg.norm_eps)
        #         n2 = mm.prepare(n2, store, "n2")
        #         g, u = linear_forward(n2, w.w_gate, mm), linear_forward(n2, w.w_up, mm)
        #         s = mm.prepare(swiglu_forward(g, u), store, "s")
        #         store.save each of h, r2, g, u under its name;  return h, s
        h, n2, r2 = residual_rmsnorm_forward(x, linear_forward(o, w.wo, mm), w.ln2, cfg.norm_eps)
        n2 = mm.prepare(n2, store, "n2")
        g, u = linear_forward(n2, w.w_gate, mm), linear_forward(n2, w.w_up, mm)
        s = mm.prepare(swiglu_forward(g, u), store, "s")
        for name, tensor in (("h", h), ("r2", r2), ("g", g), ("u", u)):
            store.save(name, tensor)
        return h, s
        # <<<

    def forward(self, w: BlockWeights, x: torch.Tensor, store: ActivationStore) -> torch.Tensor:
        """y = block(x) for x of shape (B, T, dim); fills `store` for the backward."""
        o = self.attention_half(w, x, store)
        h, s = self.ffn_half(w, x, o, store)
        # The last residual add keeps nothing for the backward, and the down projection's input s is kept above.
        return h + linear_forward(s, w.w_down, self.matmul)

    def backward(self, w: BlockWeights, dy: torch.Tensor, store: ActivationStore):
        """(dx, grads) given dy = dL/dy, from what the forward saved; grads is a BlockWeights."""
        mm = self.matmul
        B, T, _ = dy.shape
        cos, sin = self.rope(T, dy.dtype, dy.device)
        # >>> TODO(m06): the FFN half's backward, from dy back to the residual stream's gradient dh
        # Contract: dy = dL/dy is (B, T, dim) for the forward y = h + s W_downᵀ and ffn_half's chain. Produce, by these
        #   names (the attention half's TODO below reads them): dh = dL/dh (B, T, dim), the whole gradient of h, and
        #   the weight gradients d_down, d_gate, d_up and d_ln2. Read saved tensors from the store (store["s"]), the
        #   ones the forward used; every linear's backward goes through linear_backward with self.matmul (the tests
        #   count the policy's calls, and compare these gradients and dh with an nn.Module block's).
        # Question: along which paths does dy reach h, and where do two gradients of one tensor meet?
        # Pitfalls: which ops read n2, and what does that make its gradient? Does dy reach dh along the residual
        #   once, twice, or not at all? A linear's input rebuilt here rather than read from the store: is it the
        #   tensor the forward's matmul multiplied (what did mm.prepare hand it)?
        # Hint 1: the chapter's "One tensor, several readers", applied to the FFN's chain read from its end: which
        #         tensors does more than one op read? residual_rmsnorm_backward takes both gradients of h.
        # Hint 2: ds = dy W_down, d_down = dyᵀ s; (dg, du) = SwiGLU's backward; dn2 = dg W_gate + du W_up;
        #         (dh, d_ln2) = residual + norm backward of (dy, dn2).
        # Hint 3: ds, d_down = linear_backward(dy, store["s"], w.w_down, mm)
        #         dg, du = swiglu_backward(ds, store["g"], store["u"])
        #         dn2_gate, d_gate = linear_backward(dg, store["n2"], w.w_gate, mm);  dn2_up, d_up = the same with du, w_up
        #         dh, d_ln2 = residual_rmsnorm_backward(dy, dn2_gate + dn2_up, store["h"], store["r2"], w.ln2)
        ds, d_down = linear_backward(dy, store["s"], w.w_down, mm)
        dg, du = swiglu_backward(ds, store["g"], store["u"])
        dn2_gate, d_gate = linear_backward(dg, store["n2"], w.w_gate, mm)
        dn2_up, d_up = linear_backward(du, store["n2"], w.w_up, mm)
        dh, d_ln2 = residual_rmsnorm_backward(dy, dn2_gate + dn2_up, store["h"], store["r2"], w.ln2)
        # <<<
        # >>> TODO(m06): the attention half's backward, and the block's gradients
        # Contract: dh (from the FFN half above) is dL/dh for h = x + o W_oᵀ and attention_half's chain. Return
        #   (dx, grads): dx = dL/dx (B, T, dim), and grads, a BlockWeights of all nine weight gradients (d_ln2, d_gate,
        #   d_up and d_down from above). Attention's backward goes through self.attention with the saved q, k, v, o and
        #   lse; every linear's backward through linear_backward with self.matmul. The tests compare dx and every
        #   gradient with an nn.Module Llama block's (grouped, multi-head and one kv head).
        # Shapes: attention's backward returns dq (B, T, n_heads, head_dim) and dk, dv with n_kv_heads, possibly not
        #   contiguous; a projection's backward wants (B, T, heads * head_dim).
        # Question: which op's backward undoes each step of the attention half, and where do gradients of one tensor
        #   meet on the way back to x?
        # Pitfalls: which of dq, dk and dv went through RoPE? Which ops read n1? Along how many paths does x reach the
        #   loss? Will .view do on a tensor that is not contiguous?
        # Hint 1: the chapter's "One tensor, several readers" again: which tensors of this half have several readers,
        #         counting the residual?
        # Hint 2: do = dh W_o, d_wo = dhᵀ o; (dq, dk, dv) = attention's backward; RoPE's backward on dq and dk;
        #         dn1 = dq W_q + dk W_k + dv W_v (flattened heads); (dx_norm, d_ln1) = the ln1 norm's backward of dn1;
        #         dx is dh plus the norm's gradient of x.
        # Hint 3: do, d_wo = linear_backward(dh, store["o"], w.wo, mm)
        #         dq, dk, dv = self.attention.backward(do, store["q"], store["k"], store["v"], store["o"], store["lse"])
        #         dq, dk = rope_backward(dq, cos, sin), rope_backward(dk, cos, sin)
        #         dn1_q, d_wq = linear_backward(dq.reshape(B, T, -1), store["n1"], w.wq, mm);  the same for k and v
        #         dx_norm, d_ln1 = rmsnorm_backward(dn1_q + dn1_k + dn1_v, store["x"], store["r1"], w.ln1)
        #         return dh + dx_norm, BlockWeights(ln1=d_ln1, wq=d_wq, ..., w_down=d_down)
        do, d_wo = linear_backward(dh, store["o"], w.wo, mm)
        dq, dk, dv = self.attention.backward(do, store["q"], store["k"], store["v"], store["o"], store["lse"])
        dq, dk = rope_backward(dq, cos, sin), rope_backward(dk, cos, sin)
        dn1_q, d_wq = linear_backward(dq.reshape(B, T, -1), store["n1"], w.wq, mm)
        dn1_k, d_wk = linear_backward(dk.reshape(B, T, -1), store["n1"], w.wk, mm)
        dn1_v, d_wv = linear_backward(dv.reshape(B, T, -1), store["n1"], w.wv, mm)
        dx_norm, d_ln1 = rmsnorm_backward(dn1_q + dn1_k + dn1_v, store["x"], store["r1"], w.ln1)
        grads = BlockWeights(ln1=d_ln1, wq=d_wq, wk=d_wk, wv=d_wv, wo=d_wo, ln2=d_ln2,
                             w_gate=d_gate, w_up=d_up, w_down=d_down)
        return dh + dx_norm, grads
        # <<<
