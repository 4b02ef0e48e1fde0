"""Module 10 - recompute: keep fewer activations in the forward, recompute them in the backward.

The activation store of module 06 keeps, for every layer, everything the block's backward reads:
about a dozen tensors of (B, T, dim) or (B, T, ffn_dim) each. Across all layers this is often the
largest item in GPU memory. A recompute option names the activations a store does *not* keep;
`RecomputeBlock.backward` first rebuilds them from those it kept, by running the same forward ops
again, then runs the unchanged backward of module 06. The ops are the same and run in the same
order, so the gradients are the same bit for bit; the price is the extra forward work.

The options follow those of llm.q, a CUDA/C++ LLM trainer:

    none       keep everything
    swiglu     drop s = silu(g) u                         recompute: one elementwise op
    norms      drop the RMSNorm outputs n1, n2, r1, r2    recompute: two norms
    ffn        drop n2, r2, g, u, s                       recompute: norm, gate and up matmuls, SwiGLU
    attention  drop n1, r1, q, k, v, o, lse               recompute: norm, q/k/v matmuls, RoPE, attention
    block      keep only the block input x                recompute: the whole block but the down matmul

With module 09's FP8Matmul the linear inputs n1, n2 and s are kept as e4m3 with their abs-maxes.
The abs-maxes (4 bytes each) are kept whatever the option, so the recompute quantizes with the
forward's scales and skips the abs-max pass (an exact recompute would find the same ones).
"""
import torch

from .m06_llama_block import ActivationStore, BlockWeights, LlamaBlock, LlamaConfig
from .m06_llama_model import LlamaModel
from .m06_llama_ops import compute_dtype, linear_forward, rmsnorm_forward, swiglu_forward
from .m09_fp8_matmul import abs_max_name

ACTIVATIONS = frozenset({"x", "n1", "r1", "q", "k", "v", "o", "lse", "h", "n2", "r2", "g", "u", "s"})
DROPPED = {
    "none": frozenset(),
    "swiglu": frozenset({"s"}),
    "norms": frozenset({"n1", "r1", "n2", "r2"}),
    "ffn": frozenset({"n2", "r2", "g", "u", "s"}),
    "attention": frozenset({"n1", "r1", "q", "k", "v", "o", "lse"}),
    "block": ACTIVATIONS - {"x"},
}
OPTIONS = tuple(DROPPED)
LINEAR_INPUTS = ("n1", "n2", "s")  # what the block hands to matmul.prepare
ABS_MAXES = frozenset(abs_max_name(name) for name in LINEAR_INPUTS)  # saved by FP8Matmul only; always kept


def check_option(option: str):
    if option not in DROPPED:
        raise ValueError(f"unknown recompute option {option!r}; choose one of {', '.join(OPTIONS)}")


def activation_bytes(cfg: LlamaConfig, batch: int, seq_len: int, dtype: torch.dtype) -> dict[str, int]:
    """Bytes of each activation one block saves, by name, for a (batch, seq_len) input of `dtype`.

    The per-token statistics r1, r2 and lse are kept in compute_dtype(dtype) (float32 for bf16).
    """
    act = torch.tensor([], dtype=dtype).element_size()
    stat = torch.tensor([], dtype=compute_dtype(dtype)).element_size()
    tokens = batch * seq_len
    # >>> TODO(m10): the bytes of every activation one block saves, by name
    # Return a dict with one entry per name in ACTIVATIONS: the bytes that activation takes for `tokens` tokens
    # (batch * seq_len), with activations `act` bytes a value and the per-token statistics (r1, r2 and lse)
    # `stat` bytes a value (compute_dtype: float32 for bf16 activations).
    # Derive each entry from the shape the block saves that tensor in (module 06's attention_half and ffn_half;
    # the chapter's first table): per token, the number of values along its other axes, times its element size.
    # Pitfalls the tests catch (they compare every entry with the bytes module 06's block really saves, in
    # float32 and in bf16, where act != stat): k and v have the kv heads' width, not the query heads'; o is
    # attention's output before the o projection; lse holds one statistic per query head, r1 and r2 one per
    # token. A swap of two sizes (q and k, say) leaves the totals unchanged but fails the by-name check.
    # Hint 1: six widths cover all fourteen names: the residual width, the query width, the key/value width, the
    #         FFN width, one statistic per token, one per query head.
    # Hint 2: cfg.dim, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_dim, 1 and
    #         cfg.n_heads; act for the activations, stat for r1, r2 and lse.
    # Hint 3: per_token = {each name: its width times act (or stat, for r1, r2, lse)}
    #         return {each name: tokens times its per-token bytes}
    dim, q, kv, ffn = cfg.dim, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_dim
    per_token = {"x": dim * act, "n1": dim * act, "r1": stat, "q": q * act, "k": kv * act, "v": kv * act,
                 "o": q * act, "lse": cfg.n_heads * stat, "h": dim * act, "n2": dim * act, "r2": stat,
                 "g": ffn * act, "u": ffn * act, "s": ffn * act}
    return {name: tokens * size for name, size in per_token.items()}
    # <<<


def kept_bytes(cfg: LlamaConfig, batch: int, seq_len: int, dtype: torch.dtype, option: str,
               fp8: bool = False) -> int:
    """Activation bytes one layer's store keeps with this recompute option (the formula).

    fp8: the block runs FP8Matmul(min_dim=0) (module 09): n1, n2 and s are kept as e4m3, one byte
    a value plus a float32 scale, and the three float32 abs-maxes are kept always.
    """
    check_option(option)
    sizes = activation_bytes(cfg, batch, seq_len, dtype)
    if fp8:
        width = {"n1": cfg.dim, "n2": cfg.dim, "s": cfg.ffn_dim}
        sizes.update({name: batch * seq_len * width[name] + 4 for name in LINEAR_INPUTS})
    always = 4 * len(ABS_MAXES) if fp8 else 0
    return always + sum(size for name, size in sizes.items() if name not in DROPPED[option])


class RecomputeBlock(LlamaBlock):
    """A LlamaBlock whose stores drop the activations of a recompute option, and whose backward
    recomputes them first."""

    def __init__(self, cfg: LlamaConfig, option: str = "none", **block_args):
        check_option(option)
        super().__init__(cfg, **block_args)
        self.option = option

    def new_store(self) -> ActivationStore:
        # >>> TODO(m10): a store that keeps what this option does not drop, and the FP8 abs-maxes
        # Return an ActivationStore whose keep set (module 06's store saves only the names in it) is every name in
        # ACTIVATIONS that the option does not drop (its entry in DROPPED), plus ABS_MAXES: module 09's abs-maxes
        # (4 bytes each) are kept whatever the option, so a recompute quantizes with the forward's own.
        # Pitfalls the tests catch: the store's names and real bytes must equal kept_bytes for every option, FP8 or
        # not (the FP8 formula counts the abs-maxes); keep=None would keep everything.
        # Hint 1: set algebra on frozensets.
        # Hint 2: ActivationStore(keep=...); frozenset difference (-) and union (|).
        # Hint 3: return a store keeping (ACTIVATIONS without the option's dropped names) together with ABS_MAXES
        return ActivationStore(keep=(ACTIVATIONS - DROPPED[self.option]) | ABS_MAXES)
        # <<<

    def recompute(self, w: BlockWeights, store: ActivationStore):
        """Put back into `store` every activation the forward dropped, computed from what it kept
        by the forward's own ops in the forward's order (so the values are identical)."""
        missing = ACTIVATIONS - set(store.tensors)
        if not missing:
            return
        cfg, mm = self.cfg, self.matmul
        # Keeps everything; starts with what the store kept, so the recompute reads kept tensors and
        # kept abs-maxes from it (FP8Matmul.prepare then quantizes with the forward's abs-max).
        fresh = ActivationStore()
        fresh.tensors.update(store.tensors)
        # >>> TODO(m10): rebuild the dropped activations into `fresh`, earliest first, rerunning the least
        # missing (not empty) names what the forward dropped; fresh starts with everything the store kept, abs-maxes
        # included. Put every missing activation into fresh, computed by the forward's own ops, in the forward's
        # order, from what was kept or already recomputed, so the values are the forward's bit for bit (the given
        # lines after this block copy them into the store).
        # Which ops: only the attention half makes q, k, v, o and lse (it refills n1 and r1 too), and only the FFN
        # half makes h (and everything after it). Any other missing activation is one op away from what is kept or
        # recomputed: the ln1 norm of x (n1, r1), the ln2 norm of h (n2, r2), the gate and up linears (g, u),
        # SwiGLU (s). Linear inputs enter fresh as in the forward: n1, n2 and s go through the policy's prepare
        # under their names (with FP8 it finds the kept abs-max in fresh and quantizes with it).
        # Pitfalls the tests catch: rerunning more than needed (they count the rerun linears: ffn 2, attention 3,
        # block 6); other ops, inputs or order (restored tensors and gradients are compared with torch.equal, with
        # and without FP8 linears); reading a dropped input from `store` instead of from fresh.
        # Hint 1: two stages, each a choice: the attention stage (the whole half if any of its outputs is missing,
        #         else maybe just the norm), then the FFN stage (the whole half if h is missing, else the missing
        #         pieces one by one, in forward order).
        # Hint 2: self.attention_half(w, x, store) and self.ffn_half(w, x, o, store) save into the store you pass;
        #         rmsnorm_forward; linear_forward(input, weight, mm); swiglu_forward; mm.prepare(t, fresh, name);
        #         fresh.save(name, t); fresh[name]; set intersection (&) tests whether any of a group is missing.
        # Hint 3: x = the kept block input
        #         if any of q, k, v, o, lse is missing: the attention half into fresh
        #         elif n1 or r1 is missing: norm x with ln1; prepare n1 into fresh; save r1
        #         if h is missing: the FFN half into fresh (from x and fresh's o)
        #         else, each only if missing: n2, r2 (norm of fresh's h, prepare n2); g, u (fresh's n2 through gate
        #         and up); s (SwiGLU of fresh's g and u, prepared)
        x = store["x"]
        if missing & {"q", "k", "v", "o", "lse"}:
            self.attention_half(w, x, fresh)
        elif missing & {"n1", "r1"}:
            n1, r1 = rmsnorm_forward(x, w.ln1, cfg.norm_eps)
            mm.prepare(n1, fresh, "n1")
            fresh.save("r1", r1)
        if "h" in missing:
            self.ffn_half(w, x, fresh["o"], fresh)
        else:
            if missing & {"n2", "r2"}:
                n2, r2 = rmsnorm_forward(fresh["h"], w.ln2, cfg.norm_eps)
                mm.prepare(n2, fresh, "n2")
                fresh.save("r2", r2)
            if missing & {"g", "u"}:
                fresh.save("g", linear_forward(fresh["n2"], w.w_gate, mm))
                fresh.save("u", linear_forward(fresh["n2"], w.w_up, mm))
            if "s" in missing:
                mm.prepare(swiglu_forward(fresh["g"], fresh["u"]), fresh, "s")
        # <<<
        for name in missing:
            store.restore(name, fresh[name])

    def backward(self, w: BlockWeights, dy: torch.Tensor, store: ActivationStore):
        self.recompute(w, store)
        return super().backward(w, dy, store)


def measure_store_bytes(model: LlamaModel, tokens: torch.Tensor) -> int:
    """Bytes held by the first layer's store after a forward (what the formula predicts)."""
    stores = [model.block.new_store() for _ in range(model.cfg.n_layers)]
    model.forward_blocks(model.embedding[tokens], stores)
    return stores[0].nbytes()

