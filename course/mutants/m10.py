"""Module 10's planted bugs (recompute): see course/mutants/__init__.py."""
from course.mutants import Plant

F = "m10_recompute.py"
PLANTS = [
    Plant(F, '"lse": cfg.n_heads * stat', '"lse": stat',
          "one log-sum-exp per token, not one per token and head: attention keeps one for every head"),
    Plant(F, '"k": kv * act, "v": kv * act', '"k": q * act, "v": q * act',
          "k and v sized by the query heads: with grouped-query attention they have n_kv_heads, fewer"),
    Plant(F, '"r1": stat, "q"', '"r1": act, "q"',
          "r1 counted in the activations' dtype: the statistics are kept in float32 for bf16"),
    Plant(F, "return ActivationStore(keep=(ACTIVATIONS - DROPPED[self.option]) | ABS_MAXES)",
          "return ActivationStore(keep=ACTIVATIONS - DROPPED[self.option])",
          "the FP8 abs-maxes not kept: the recompute finds them again instead of quantizing with the forward's"),
    Plant(F, "        elif missing & {\"n1\", \"r1\"}:", "        if missing & {\"n1\", \"r1\"}:",
          "the first norm rerun after the whole attention half already rebuilt it: forward work done twice"),
    Plant(F, 'if missing & {"q", "k", "v", "o", "lse"}:', 'if missing & {"n1", "r1", "q", "k", "v", "o", "lse"}:',
          "the whole attention half rerun when only its norm was dropped: more recompute than the option needs"),
    Plant(F, "n2, r2 = rmsnorm_forward(fresh[\"h\"], w.ln2, cfg.norm_eps)", "n2, r2 = rmsnorm_forward(fresh[\"h\"], w.ln1, cfg.norm_eps)",
          "the second norm recomputed with the first norm's weight: the wrong one of two similar weights"),
    Plant(F, 'mm.prepare(swiglu_forward(fresh["g"], fresh["u"]), fresh, "s")',
          'fresh.save("s", swiglu_forward(fresh["g"], fresh["u"]))',
          "s saved without the matmul's prepare: with FP8 the recomputed s is not the quantized one the forward kept"),
    Plant(F, "self.ffn_half(w, x, fresh[\"o\"], fresh)", "self.ffn_half(w, x, store[\"o\"], fresh)",
          "the FFN half rerun from the store's o: when attention was dropped too, o is only in the fresh store"),
]
