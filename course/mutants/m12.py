"""Module 12's planted bugs (tensor and sequence parallelism): see course/mutants/__init__.py."""
from course.mutants import Plant

LINEAR, BLOCK, VOCAB, MODEL, COSTS = ("m12_tp_linear.py", "m12_tp_block.py", "m12_vocab_parallel.py",
                                      "m12_tp_model.py", "m12_tp_costs.py")
PLANTS = [
    Plant(VOCAB, """    z = z.masked_fill(padding, float("-inf"))
    top = z.max(dim=-1).values""", """    top = z.max(dim=-1).values
    z = z.masked_fill(padding, float("-inf"))""",
          "the max taken before the padding is masked: a large padding logit becomes the max, exp underflows to 0"),
    Plant(VOCAB, "return loss, (dlogits * (grad_scale / n_tokens)).to(logits.dtype)",
          "return loss, dlogits * (grad_scale / n_tokens)",
          "the logits' gradient handed back in float32: bf16 logits need a bf16 gradient (the GEMMs after it)"),
    Plant(VOCAB, "return loss, (dlogits * (grad_scale / n_tokens)).to(logits.dtype)",
          "return loss, (dlogits / n_tokens).to(logits.dtype)",
          "the microbatch's grad_scale forgotten: accumulated microbatches give M times the batch's gradient"),
    Plant(VOCAB, '    tp.collectives.all_reduce(target_logit, "loss target")\n', "",
          "the target logit not summed over the group: only the rank owning the target knows it, the others use 0"),
    Plant(VOCAB, "padding = torch.arange(start, start + per_rank, device=logits.device) >= vocab_size",
          "padding = torch.arange(start, start + per_rank, device=logits.device) > vocab_size",
          "off by one at the padding: the first padded row (index vocab_size) takes part in the softmax"),
    Plant(VOCAB, "    multiple = divisible_by * tp_size\n", "    multiple = divisible_by\n",
          "the vocabulary padded to divisible_by only: it must split into tp_size equal shards of that multiple"),
    Plant(VOCAB, "grad_rows.index_add_(0, local[mine], dx[mine].to(grad_rows.dtype))",
          "grad_rows[local[mine]] += dx[mine].to(grad_rows.dtype)",
          "indexed += on repeated tokens: the gradient of a token seen twice is written once, not added"),
    Plant(VOCAB, "    mine = (local >= 0) & (local < per_rank)\n    looked_up", "    mine = (local >= 0) & (local <= per_rank)\n    looked_up",
          "off by one at the shard's end: the first token of the next rank's rows is looked up here too"),
    Plant(BLOCK, "wo=block(w.wo, 1)", "wo=block(w.wo, 0)",
          "wo split by output rows: a row-parallel linear splits its input columns (a square wo hides the shape)"),
    Plant(BLOCK, "    if not tp.sequence_parallel or not norm_grads:\n        return\n",
          "    if not norm_grads:\n        return\n",
          "norm gradients summed without sequence parallelism: every rank already has the whole one, so t times it"),
    Plant(LINEAR, """    reducing = enter_tp_backward(dx, tp, label, async_op=True)
    for dy, main_grad in zip(dys, main_grads, strict=True):
        accumulate_weight_grad(main_grad, dy, x_whole, fused)
    return reducing.wait()""", """    dx = enter_tp_backward(dx, tp, label).wait()
    for dy, main_grad in zip(dys, main_grads, strict=True):
        accumulate_weight_grad(main_grad, dy, x_whole, fused)
    return dx""",
          "the input gradient's collective waited for before the weight GEMMs: nothing overlaps the communication"),
    Plant(LINEAR, "    accumulate_weight_grad(main_grad, dy_whole, x, fused)\n", "    accumulate_weight_grad(main_grad, dy, x, fused)\n",
          "the row-parallel weight gradient from the local dy: with sequence parallelism it needs the gathered one"),
    Plant(MODEL, "            p.grad = g.to(p.dtype)\n", "            p.grad = g\n",
          ".grad handed over in the float32 accumulator's dtype: a bf16 parameter needs a bf16 gradient"),
    Plant(MODEL, "        for g in self.grads.tensors():\n            g.zero_()\n", "",
          "the gradient accumulators never zeroed: each step adds to the previous steps' gradients"),
    Plant(MODEL, "            stores[layer].clear()\n", "",
          "the stores not cleared in the backward: every layer's activations live until the next step"),
    Plant(MODEL, "self.grads.final_norm.add_(d_final_norm)", "self.grads.final_norm.copy_(d_final_norm)",
          "the final norm's gradient overwritten per microbatch, not accumulated"),
    Plant(COSTS, "    share = (t - 1) / t\n", "    share = 1 / t\n",
          "a ring collective sends (t-1)/t of the data per rank, not 1/t"),
    Plant(COSTS, '"lse": heads * stat', '"lse": cfg.n_heads * stat',
          "lse counted for every head: a rank keeps it for its own n_heads / t heads only"),
]
