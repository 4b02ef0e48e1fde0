"""Module 16's planted bugs (mixture of experts, expert parallelism): see course/mutants/__init__.py."""
from course.mutants import Plant

ROUTER, DISPATCH, PARALLEL, LAYER, MODEL, COSTS = ("m16_router.py", "m16_dispatch.py", "m16_expert_parallel.py",
                                                   "m16_moe_layer.py", "m16_moe_model.py", "m16_costs.py")
# The two groups of sum_gradients' loop (its hint spells them too, so the loop's own text is quoted).
DENSE_SUM = 'for tensors, group, label in ((dense, mesh.group("d", "c"), "dense gradients"),'
EXPERT_SUM = '\n' + ' ' * 34 + '(experts, mesh.group("ed"), "expert gradients")):'
PLANTS = [
    # The list.
    Plant(ROUTER, "\n    return Routing(scores, experts, chosen / chosen.sum(-1, keepdim=True))",
          "\n    return Routing(scores, experts, chosen / scores.sum(-1, keepdim=True))",
          "scores normalised before the top-k (over all E): the k weights no longer sum to 1"),
    Plant(DISPATCH, "return h + (weights.to(h.dtype).unsqueeze(-1) * per_slot.view(n_tokens, top_k, -1)).sum(1)",
          "return h + per_slot.view(n_tokens, top_k, -1).sum(1)",
          "the combine not weighted: each expert's output counts fully, the router gets no gradient from it"),
    Plant(PARALLEL, "recv_splits = received.sum(1).tolist()", "recv_splits = counts.view(e, -1).sum(1).tolist()",
          "the receive sizes taken from this rank's own counts (the send side): uneven routing breaks the exchange"),
    Plant(PARALLEL, "    arrived = torch.empty_like(rows)\n    arrived[exchange.regroup] = rows\n",
          "    arrived = rows[exchange.regroup]\n",
          "the regroup applied again on the way back instead of inverted: rows come home to the wrong slots"),
    Plant(ROUTER, "    n_sequences = n_tokens // seq_len\n", "    n_sequences, seq_len = 1, n_tokens\n",
          "the auxiliary loss over the rank's local tokens, not per sequence: it depends on the layout"),
    Plant(ROUTER, "    chosen = scores.gather(1, experts)\n",
          "    chosen = (scores if bias is None else scores + bias.to(dtype)).gather(1, experts)\n",
          "the bias used in the combine weights: it is for the selection only"),
    Plant(DISPATCH, "return h + (weights.to(h.dtype).unsqueeze(-1) * per_slot.view(n_tokens, top_k, -1)).sum(1)",
          "return (h + (weights.to(h.dtype).unsqueeze(-1) * per_slot.view(n_tokens, top_k, -1)).sum(1)) "
          "* plan.kept.any(1, keepdim=True)",
          "a token whose every slot was dropped zeroed: the residual must carry it through unchanged"),
    # Groups.
    Plant(MODEL, EXPERT_SUM, EXPERT_SUM.replace('group("ed")', 'group("d", "c")'),
          "expert gradients summed over every data rank: ranks of other expert groups hold other experts"),
    Plant(MODEL, EXPERT_SUM, EXPERT_SUM.replace('group("ed")', 'group("e")'),
          "expert gradients summed over the expert group: its members hold different experts"),
    Plant(MODEL, DENSE_SUM, DENSE_SUM.replace('group("d", "c")', 'group("ed")'),
          "dense gradients summed over the expert-data group only: the ranks of the same expert group are missed"),
    Plant(MODEL, '\n        data.collectives.all_reduce(stats, label="step statistics")',
          '\n        self.mesh.group("e").collectives.all_reduce(stats, label="step statistics")',
          "the loads (and the loss) summed over the expert group only: the biases differ between expert groups"),
    # The router.
    Plant(ROUTER, "torch.topk(scores if bias is None else scores + bias.to(dtype), moe.top_k, dim=-1)",
          "torch.topk(scores, moe.top_k, dim=-1)",
          "the bias ignored in the selection: the auxiliary-loss-free balancing does nothing"),
    Plant(ROUTER, "\n    d_chosen = (d_weights - (d_weights * weights).sum(-1, keepdim=True)) / total",
          "\n    d_chosen = d_weights / total",
          "the normalisation's backward without its shared term: the sum S depends on every chosen score"),
    Plant(ROUTER, "d_logits = d_scores_all * scores * (1 - scores)", "d_logits = d_scores_all * scores",
          "the sigmoid's derivative taken as σ instead of σ (1 - σ)"),
    # The auxiliary loss and the bias.
    Plant(ROUTER, "share = n_experts / (moe.top_k * length) * counts", "share = counts / length",
          "the fraction φ without E / k: perfect balance no longer gives φ = 1, the loss is k/E of DeepSeek-V3's"),
    Plant(ROUTER, "d_scores = (d_normalised - (d_normalised * normalised).sum(-1, keepdim=True)) / row_sums",
          "d_scores = d_normalised", "the gradient stops at σ' = σ / Σσ: the normalisation has a backward too"),
    Plant(ROUTER, '        context.collectives.all_reduce(stats, label="aux loss statistics")\n',
          "        pass\n", "with context parallelism, a sequence's statistics not summed over its c parts"),
    Plant(ROUTER, "error = loads.sum(-1, keepdim=True) / moe.n_experts - loads",
          "error = loads - loads.sum(-1, keepdim=True) / moe.n_experts",
          "the bias moved with the load error instead of against it: overloaded experts get more tokens"),
    Plant(ROUTER, "bias.add_(moe.bias_rate * torch.sign(layer_error).to(bias.dtype))",
          "bias = bias + moe.bias_rate * torch.sign(layer_error).to(bias.dtype)",
          "the bias updated out of place: the model's biases never change"),
    # Capacity and combine.
    Plant(DISPATCH, "\n        kept = position < capacity", "\n        kept = position <= capacity",
          "off by one: an expert keeps G + 1 slots per source"),
    Plant(DISPATCH, "        kept = position < capacity\n",
          "        kept = torch.arange(flat.numel(), device=flat.device) // top_k < capacity\n",
          "a capacity counted in tokens, not per expert: the first G tokens keep every slot, the rest none"),
    Plant(DISPATCH, "\n    d_rows = dy_rows * weights.reshape(-1)[plan.slots].to(dy.dtype).unsqueeze(-1)",
          "\n    d_rows = dy_rows", "the rows' gradient without the combine weight"),
    # Expert parallelism.
    Plant(PARALLEL, "\n    return exchange_rows(arrived, exchange.recv_splits, exchange.send_splits, group, label)",
          "\n    return exchange_rows(arrived, exchange.send_splits, exchange.recv_splits, group, label)",
          "the way back with the splits of the way out: the rows do not fit what each member expects"),
    # The layer's backward.
    Plant(LAYER, "\n        dn = torch.zeros_like(n).index_add_(0, plan.tokens, d_rows)",
          "\n        dn = torch.zeros_like(n).index_copy_(0, plan.tokens, d_rows)",
          "a token routed to k experts keeps only one row's gradient (copy, not add)"),
    Plant(LAYER, 'd_scores = store["moe_d_scores"] if "moe_d_scores" in store else None', "d_scores = None",
          "the auxiliary loss's gradient left out of the router's backward"),
    Plant(LAYER, '\n        d_out = send_to_experts(d_back, exchange, group, "combine backward")',
          '\n        d_out = return_from_experts(d_back, exchange, group, "combine backward")',
          "the combine's adjoint taken as the combine itself: the gradient must go to the experts"),
    # Training.
    Plant(MODEL, "        n_tokens, rows = real_tokens(targets), n_sequences // data.size\n"
                 "        mine = slice(data.index * rows, (data.index + 1) * rows)\n",
          "        rows = n_sequences // data.size\n"
          "        mine = slice(data.index * rows, (data.index + 1) * rows)\n"
          "        n_tokens = real_tokens(targets[mine])\n",
          "the cross-entropy divided by this rank's real tokens, not the global batch's: d times the step's loss"),
    Plant(MODEL, "self.forward_backward(tok, tgt, n_tokens, 1.0 / n_sequences)",
          "self.forward_backward(tok, tgt, n_tokens, 1.0 / len(tok))",
          "each sequence's auxiliary loss weighted by the microbatch's own count: a local mean, d m times too big"),
    Plant(MODEL, "\n        loads = torch.stack([r.loads for r in records])", "\n        loads = torch.stack([r.sent for r in records])",
          "the loads counted after the capacity: the router's overload is hidden by the drops"),
    # Costs.
    Plant(COSTS, "rows_in = int(record.received.sum() - record.received[index].sum())",
          "rows_in = int(record.received.sum())",
          "the rows a rank sends its own experts counted as sent: they cross no wire"),
    Plant(COSTS, "exchange += (e - 1) * E // e * COUNT_BYTES + 2 * (rows_out + rows_in) * M * b",
          "exchange += (e - 1) * E // e * COUNT_BYTES + (rows_out + rows_in) * M * b",
          "the backward's two all-to-alls forgotten"),
    Plant(COSTS, "ring(dc, 3 + L * E, STAT_BYTES)", "ring(dc, 3 + L * E, b)",
          "the statistics counted in the model's dtype: they are float64"),
    Plant(COSTS, "\n    values = dense_values(cfg, moe) + L * E // e * 3 * moe.expert_dim * cfg.dim",
          "\n    values = dense_values(cfg, moe) + L * E * 3 * moe.expert_dim * cfg.dim",
          "every expert counted on every rank: a rank keeps E / e of them"),
    # A learner's run (issue: plants that survived or were reported badly).
    Plant(MODEL, ".view(n_microbatches, n_layers, n_experts).sum(0)",
          ".view(n_layers, n_microbatches, n_experts).sum(1)",
          "the records read layer by layer (loads[i // m]): they come microbatch by microbatch, so with m > 1 one "
          "layer gets another's loads"),
    Plant(MODEL, "sum(r.dropped for r in records)", "0",
          "the dropped slots never counted: the step reports none while the capacity drops tokens"),
    Plant(PARALLEL, "recv_splits, received, torch.argsort(labels, stable=True)", "recv_splits, received, torch.argsort(labels)",
          "an unstable sort for the regroup: one expert's rows from several members may come in any order (torch's "
          "CPU sort keeps equal keys in order only on a few rows)"),
    Plant(ROUTER, '        context.collectives.all_reduce(stats, label="aux loss statistics")\n',
          '        counts, sums = (part.contiguous() for part in stats.split(n_experts, dim=1))\n'
          '        context.collectives.all_reduce(counts, label="aux loss statistics")\n'
          '        context.collectives.all_reduce(sums, label="aux loss statistics")\n'
          '        stats = torch.cat([counts, sums], dim=1)\n',
          "the counts and the sums of σ' all-reduced in two calls: one tensor, one call"),
    Plant(ROUTER, 'context.collectives.all_reduce(stats, label="aux loss statistics")',
          'context.collectives.all_reduce(stats, label="aux")',
          "the context all-reduce under another label than the contract's: the log (and the costs) name it"),
    Plant(MODEL, "self.forward_backward(tok, tgt, n_tokens, 1.0 / n_sequences)",
          "self.forward_backward(tok, tgt, real_tokens(tgt) * data.size * n_microbatches, 1.0 / n_sequences)",
          "each microbatch divided by d m times its own real tokens (the mean's 1 / (d c m) share): the global count "
          "only when every microbatch has as many real tokens; padding makes them differ"),
    Plant(DISPATCH, "\n    slots = kept_slots[torch.argsort(flat[kept_slots], stable=True)]",
          "\n    slots = kept_slots[torch.argsort(flat[kept_slots])]",
          "an unstable sort for the expert-major order: one expert's slots may leave token order"),
    # Issue 37's rewrite (the pitfalls its TODOs now ask about).
    Plant(ROUTER, "        d_scores_all = d_scores_all + d_scores\n", "        pass\n",
          "the auxiliary loss's gradient of the scores dropped in the router's backward", new=True),
    Plant(ROUTER, "    length = seq_len * (context.size if context is not None else 1)\n", "    length = seq_len\n",
          "with context parallelism, T taken as this rank's part of the sequence, not its whole length", new=True),
    Plant(DISPATCH, "\n    per_slot[plan.slots] = rows\n", "\n    per_slot[:len(rows)] = rows\n",
          "the experts' rows left in the plan's order instead of put back at their slots", new=True),
    Plant(LAYER, "            dn = dn + d_shared\n", "",
          "the shared expert's gradient of n left out of dn (its weights' gradients kept)", new=True),
    Plant(COSTS, "(e - 1) * E // e * COUNT_BYTES + 2", "(e - 1) * E // e * b + 2",
          "the counts counted in the model's dtype: they are int64", new=True),
    Plant(MODEL, "self.forward_backward(tok, tgt, n_tokens, 1.0 / n_sequences)",
          "self.forward_backward(tok, tgt, n_tokens, 1.0 / rows)",
          "each sequence's auxiliary loss weighted by 1 / (this rank's sequences): d times too big", new=True),
    Plant(PARALLEL, "    labels = torch.arange(received.shape[1], device=counts.device).repeat(e)"
                    ".repeat_interleave(received.flatten())\n",
          "    labels = torch.arange(received.shape[1], device=counts.device).repeat_interleave(e)"
          ".repeat_interleave(received.flatten())\n",
          "the regroup's labels numbered member by member instead of expert by expert (wrong with E/e > 1)", new=True),
    Plant(MODEL, "update_biases(self.biases(), stats[3:].view(n_layers, n_experts), self.moe)",
          "update_biases(self.biases(), loads.to(torch.float64), self.moe)",
          "the biases moved by this rank's loads alone: the replicas' biases, and then their routing, drift apart "
          "(a learner run's plant)", new=True),
]

