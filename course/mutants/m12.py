"""Module 12's planted bugs (tensor and sequence parallelism): see course/mutants/__init__.py."""
from course.mutants import Plant

LINEAR, BLOCK, VOCAB, MODEL, COSTS = ("m12_tp_linear.py", "m12_tp_block.py", "m12_vocab_parallel.py",
                                      "m12_tp_model.py", "m12_tp_costs.py")
PLANTS = [
    Plant(VOCAB, """    z = z.masked_fill(padding, float("-inf"))
    z_max = z.max(dim=-1).values""", """    z_max = z.max(dim=-1).values
    z = z.masked_fill(padding, float("-inf"))""",
          "the max taken before the padding is masked: a large padding logit becomes the max, exp underflows to 0"),
    Plant(VOCAB, "return loss, (dlogits.masked_fill(~real.unsqueeze(-1), 0) / n_tokens).to(logits.dtype)",
          "return loss, dlogits.masked_fill(~real.unsqueeze(-1), 0) / n_tokens",
          "the logits' gradient handed back in float32: bf16 logits need a bf16 gradient (the GEMMs after it)"),
    Plant(VOCAB, "    if n_tokens is None:\n        n_tokens = real_tokens(targets)\n    rows, per_rank",
          "    n_tokens = real_tokens(targets)\n    rows, per_rank",
          "the n_tokens passed in ignored: each microbatch divides by its own real tokens, M times the batch's gradient"),
    Plant(VOCAB, '    tp.collectives.all_reduce(z_y, "loss target")\n', "",
          "the target logit not summed over the group: only the rank owning the target knows it, the others use 0"),
    Plant(VOCAB, "padding = torch.arange(start, start + per_rank, device=logits.device) >= vocab_size",
          "padding = torch.arange(start, start + per_rank, device=logits.device) > vocab_size",
          "off by one at the padding: the first padded row (index vocab_size) takes part in the softmax"),
    Plant(VOCAB, "\n    grad_rows.index_add_(0, local[mine], dx[mine].to(grad_rows.dtype))",
          "\n    grad_rows[local[mine]] += dx[mine].to(grad_rows.dtype)",
          "indexed += on repeated tokens: the gradient of a token seen twice is written once, not added"),
    Plant(VOCAB, "    mine = (local >= 0) & (local < per_rank)\n    looked_up", "    mine = (local >= 0) & (local <= per_rank)\n    looked_up",
          "off by one at the shard's end: the first token of the next rank's rows is looked up here too"),
    Plant(BLOCK, "wo=block(w.wo, 1), ln2", "wo=block(w.wo, 0), ln2",
          "wo split by output rows: a row-parallel linear splits its input columns (a square wo hides the shape)"),
    Plant(BLOCK, "    if not sequence_parallel or not norm_grads:\n        return\n",
          "    if not norm_grads:\n        return\n",
          "norm gradients summed without sequence parallelism: every rank already has the whole one, so t times it"),
    Plant(LINEAR, """    reducing = enter_tp_backward(dx, tp, sequence_parallel, label, async_op=True)
    for dy, main_grad in zip(dys, main_grads, strict=True):
        accumulate_weight_grad(main_grad, dy, x_whole, fused)
    return reducing.wait()""", """    dx = enter_tp_backward(dx, tp, sequence_parallel, label).wait()
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
    Plant(BLOCK, "return weight.chunk(tp.size, dim=dim)[tp.index].clone(memory_format=torch.contiguous_format)",
          "return weight.chunk(tp.size, dim=dim)[tp.index].contiguous()",
          ".contiguous() instead of a copy: a row block is already contiguous, so it stays a view of the whole weight"),
    Plant(BLOCK, "return weight.chunk(tp.size, dim=dim)[tp.index].clone(memory_format=torch.contiguous_format)",
          "return weight.chunk(tp.size, dim=dim)[tp.index]",
          "the slice kept as a view: the whole weight stays alive behind it, and a column slice is not contiguous"),
    Plant(BLOCK, "(ln1=w.ln1.clone(), wq", "(ln1=w.ln1, wq",
          "ln1 shared with the whole block instead of copied: the sharded model's norm weight is the whole model's"),
    Plant(BLOCK, "\n        grads.ln2.add_(d_ln2)", "\n        grads.ln2.copy_(d_ln2)",
          "ln2's gradient overwritten, not accumulated: only the last microbatch's survives"),
    Plant(BLOCK, "\n        grads.ln1.add_(d_ln1)", "\n        grads.ln1 = d_ln1",
          "ln1's gradient rebinds the field instead of adding into the accumulator: the model's main_grad never sees it"),
    Plant(MODEL, "dx, d_final_norm = rmsnorm_backward(dn, x, r, self.final_norm)",
          "dx, d_final_norm = rmsnorm_backward(dn, x, r, torch.ones_like(self.final_norm))",
          "the final norm's backward with a weight of ones: right only until the first step changes the weight"),
    Plant(VOCAB, "\n    loss = torch.where(real, torch.log(sum_exp) + z_max - z_y, 0).sum() / n_tokens",
          "\n    loss = (torch.log(sum_exp) + z_max - z_y).sum() / n_tokens",
          "the ignored targets' rows add their log-sum-exp to the loss: an IGNORE_INDEX target is no token"),
    Plant(VOCAB, "return loss, (dlogits.masked_fill(~real.unsqueeze(-1), 0) / n_tokens).to(logits.dtype)",
          "return loss, (dlogits / n_tokens).to(logits.dtype)",
          "the ignored targets' rows keep the softmax as their gradient: an ignored row gets none"),
    # issue 26 (helper b): the pair's pieces, each named by the TODO that computes it
    Plant(LINEAR, """    if not sequence_parallel:
        return InFlight(x)""", """    if not sequence_parallel:
        return InFlight(x, tp.collectives.all_reduce(x, label, async_op=async_op))""",
          "f's forward all-reduces x without sequence parallelism: x is whole on every rank already, so t times x"),
    Plant(LINEAR, "    return enter_tp_forward(dy, tp, sequence_parallel, label).wait()",
          "    return enter_tp_backward(dy, tp, sequence_parallel, label).wait()",
          "g's backward as g's forward (a sum, not f's forward): dy is the same on every rank, it needs no sum"),
    Plant(LINEAR, "    x_whole = enter_tp_forward(x, tp, sequence_parallel, label).wait()\n    return",
          "    x_whole = x\n    return",
          "the column-parallel forward on the rank's own positions: with sequence parallelism its input must be gathered"),
    Plant(LINEAR, "    return dy_whole @ w\n", "    return dy @ w\n",
          "the row-parallel dx from the rank's own positions of dy: with sequence parallelism it needs every position"),
    Plant(MODEL, """            loss += self.forward_backward(tok, tgt, n_tokens).item()
        sum_norm_grads(self.norm_grads(), self.tp, self.sequence_parallel)""",
          """            loss += self.forward_backward(tok, tgt, n_tokens).item()
            sum_norm_grads(self.norm_grads(), self.tp, self.sequence_parallel)""",
          "the norms' gradients summed after every microbatch: the first microbatch's partial sums are summed t times"),
    Plant(BLOCK, 'row_parallel_forward(s, w.w_down, tp, sp, "ffn out", mm)', 'row_parallel_forward(s, w.w_down, tp, sp, "ffn out")',
          "the down projection's forward left out of the block's matmul policy: FP8 (module 17's --fp8) skips one linear"),
    Plant(BLOCK, 'ds = row_parallel_backward(dy, store["s"], w.w_down, grads.w_down, tp, sp, "ffn out", fused, mm)\n',
          'ds = row_parallel_backward(dy, store["s"], w.w_down, grads.w_down, tp, sp, "ffn out", fused)\n',
          "the down projection's backward left out of the block's matmul policy"),
    Plant(LINEAR, """    if matmul is not None:
        return policy_gradients(dy_whole, x, w, main_grad, matmul)
    accumulate_weight_grad""", "    accumulate_weight_grad",
          "the row-parallel backward ignores the policy: FP8's backward never runs for wo and w_down"),
    Plant(LINEAR, "        return policy_gradients(dy_whole, x, w, main_grad, matmul)",
          "        return policy_gradients(dy, x, w, main_grad, matmul)",
          "the policy's backward from this rank's positions of dy: with sequence parallelism it needs them all"),
]
