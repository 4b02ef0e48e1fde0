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
    Plant(F, "\n        elif missing & {\"n1\", \"r1\"}:", "\n        if missing & {\"n1\", \"r1\"}:",
          "the first norm rerun after the whole attention half already rebuilt it: forward work done twice"),
    Plant(F, "\n        if missing & {\"q\", \"k\", \"v\", \"o\", \"lse\"}:", "\n        if missing & {\"n1\", \"r1\", \"q\", \"k\", \"v\", \"o\", \"lse\"}:",
          "the whole attention half rerun when only its norm was dropped: more recompute than the option needs"),
    Plant(F, "n2, r2 = rmsnorm_forward(fresh[\"h\"], w.ln2, cfg.norm_eps)", "n2, r2 = rmsnorm_forward(fresh[\"h\"], w.ln1, cfg.norm_eps)",
          "the second norm recomputed with the first norm's weight: the wrong one of two similar weights"),
    Plant(F, 'mm.prepare(swiglu_forward(fresh["g"], fresh["u"]), fresh, "s")',
          'fresh.save("s", swiglu_forward(fresh["g"], fresh["u"]))',
          "s saved without the matmul's prepare: with FP8 the recomputed s is not the quantized one the forward kept"),
    Plant(F, "\n            self.ffn_half(w, x, fresh[\"o\"], fresh)", "\n            self.ffn_half(w, x, store[\"o\"], fresh)",
          "the FFN half rerun from the store's o: when attention was dropped too, o is only in the fresh store"),
    # Issue 36's rewrite (new_store, a set expression its contract stated, is given now) and issue 37's blame.
    Plant(F, '"s": ffn * act}', '"s": dim * act}',
          "s sized as the block's output (dim): it is SwiGLU's output, ffn_dim wide, the down projection's input",
          new=True),
    Plant(F, "            mm.prepare(n1, fresh, \"n1\")\n", "            fresh.save(\"n1\", n1)\n",
          "the recomputed n1 saved without the policy's prepare: with FP8 it is not the e4m3 input the forward kept",
          new=True),
    Plant(F, "        if \"h\" in missing:\n", "        if missing & {\"h\", \"n2\", \"r2\", \"g\", \"u\"}:\n",
          "the whole FFN half rerun when h was kept: the o projection is forward work the option does not need",
          new=True),
]
