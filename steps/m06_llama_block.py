# Generated from solutions/m06_llama_block.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 06`. (skeleton b4f8fc24a68a)
"""Module 06, part 2 - the transformer block: a forward sequence and its backward in reverse.

    x -> RMSNorm(ln1) -> q, k, v projections -> RoPE(q, k) -> causal GQA attention -> o projection
      -> h = x + attention out, RMSNorm(ln2) -> gate, up projections -> SwiGLU -> down projection
      -> y = h + FFN out

`LlamaBlock.forward(w, x, store)` runs the ops of m06_llama_ops in that order and saves what their
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
        # TODO(m06): the attention half's forward, saving exactly what its backward reads
        # x is (B, T, dim); w holds the block's weights; cos and sin (above) are the RoPE tables for this length.
        # Return o, attention's output (B, T, n_heads * head_dim), before the o projection. The ops, in order:
        # RMSNorm with ln1, the q, k and v projections, RoPE on q and k, causal attention.
        # Afterwards the store holds 'x', 'n1', 'r1', 'q' and 'k' (after RoPE), 'v', 'o' and 'lse', and nothing
        # else of this half: the test compares the store's names with the list the backward reads.
        # The matmul seam: the norm's output goes through the policy's prepare once, under the name 'n1' (prepare
        # saves it); q, k and v all multiply what prepare returned (module 09's FP8 policy quantizes it there).
        # Shapes: a projection gives (B, T, heads * head_dim); RoPE and attention want a head axis: (B, T, n_heads,
        # head_dim) for q, n_kv_heads for k and v.
        # Pitfalls: RoPE rotates q and k, never v. Attention goes through self.attention (chunked, or the fused
        # kernel), not attention_forward directly. Every linear goes through linear_forward with self.matmul: the
        # grader counts the policy's calls (7 forward, 7 backward per block) and compares with an nn.Module block.
        raise NotImplementedError("TODO(m06): the attention half's forward, saving exactly what its backward reads")

    def ffn_half(self, w: BlockWeights, x: torch.Tensor, o: torch.Tensor, store: ActivationStore):
        """(block input x, attention output o) -> (h, s): the residual stream after attention and
        the SwiGLU output (prepared for the down projection). o is not prepared: attention's backward
        needs it as it is, so the o projection takes o itself (an FP8 policy converts it when it multiplies)."""
        cfg, mm = self.cfg, self.matmul
        # TODO(m06): the FFN half's forward up to SwiGLU, saving what its backward reads
        # x is the block input and o attention's output (B, T, n_heads * head_dim). Return (h, s): h = x plus the o
        # projection of o (the residual stream after attention), and s, SwiGLU of the gate and up projections of
        # RMSNorm(h) with ln2, as the policy's prepare returned it (the down projection multiplies it).
        # Afterwards the store holds 'h', 'n2', 'r2', 'g', 'u' and 's'; 'n2' and 's' get there through prepare.
        # Pitfall: o is not prepared (attention's backward needs it as it is): the o projection multiplies o itself.
        # Pitfall: gate and up read one prepared n2; preparing it twice would quantize twice in module 09.
        raise NotImplementedError("TODO(m06): the FFN half's forward up to SwiGLU, saving what its backward reads")

    def forward(self, w: BlockWeights, x: torch.Tensor, store: ActivationStore) -> torch.Tensor:
        """y = block(x) for x of shape (B, T, dim); fills `store` for the backward."""
        o = self.attention_half(w, x, store)
        h, s = self.ffn_half(w, x, o, store)
        # The last residual add saves nothing: its backward passes dy through to both sides.
        return h + linear_forward(s, w.w_down, self.matmul)

    def backward(self, w: BlockWeights, dy: torch.Tensor, store: ActivationStore):
        """(dx, grads) given dy = dL/dy, from what the forward saved; grads is a BlockWeights."""
        mm = self.matmul
        B, T, _ = dy.shape
        cos, sin = self.rope(T, dy.dtype, dy.device)
        # TODO(m06): the FFN half's backward, from dy back to the residual stream's gradient dh
        # The forward was y = h + down(s), s = SwiGLU(g, u), g and u the gate and up projections of n2 = norm(h).
        # Produce dh (the gradient of h, (B, T, dim)) and the weight gradients d_down, d_gate, d_up and d_ln2, by
        # these names: the attention half's TODO below uses them. Read the saved tensors from the store.
        # Maths: dy reaches h twice, along the residual and through the FFN; gate and up both read n2, so the two
        # gradients of n2 add up before the norm's backward.
        # Pitfalls: undo the ops in reverse order, each backward with the inputs its forward saw (the prepared 's'
        # and 'n2', not recomputed ones). Every linear backward goes through linear_backward with self.matmul (the
        # grader counts the policy's calls). The residual's dy must reach dh exactly once.
        raise NotImplementedError("TODO(m06): the FFN half's backward, from dy back to the residual stream's gradient dh")
        # TODO(m06): the attention half's backward, and the block's gradients
        # dh (from the FFN half) reaches x directly (the residual) and through the attention half: o projection,
        # attention, RoPE, the q, k and v projections, the ln1 norm. Return (dx, grads): dx = dL/dx (B, T, dim) with
        # both paths summed, grads a BlockWeights of all nine weight gradients (d_ln2, d_gate, d_up, d_down above).
        # Maths: q, k and v all read n1, so their three gradients of n1 add up before the norm's backward; RoPE's
        # backward undoes the rotation of q and k (v was not rotated).
        # Shapes: attention's backward returns dq (B, T, n_heads, head_dim) and dk, dv with n_kv_heads, maybe not
        # contiguous; the projections' backward wants (B, T, heads * head_dim): flatten the head axis with reshape
        # (view fails on a non-contiguous tensor).
        # Pitfalls: attention's backward goes through self.attention with the saved q, k, v, o and lse; the grader
        # compares all nine gradients and dx with an nn.Module Llama block (grouped, multi-head and one kv head).
        raise NotImplementedError("TODO(m06): the attention half's backward, and the block's gradients")
