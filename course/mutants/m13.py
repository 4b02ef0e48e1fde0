"""Module 13's planted bugs (2-D sharding in named axes): see course/mutants/__init__.py."""
from course.mutants import Plant

AXES, LLAMA, COSTS = "m13_named_axes.py", "m13_llama_2d.py", "m13_costs.py"
PLANTS = [
    Plant(COSTS, "    block, top = P + 2 * M, 2 * V * M + M",
          "    block, top = P + 2 * M, 2 * cfg.vocab_size * M + M",
          "step_traffic with the unpadded vocabulary: the embedding and LM head are padded to split over t"),
    Plant(COSTS, "    unit_d = (d - 1) / (d * t) * b", "    unit_d = (d * t - 1) / (d * t) * b",
          "a unit's all-gather counted over the whole mesh: its block is 1/(dt) of it, but it is gathered over d only"),
    Plant(COSTS, "    norms = 2 * L + 1\n", "    norms = 2 * L\n",
          "the final norm forgotten: 2L + 1 norm weights are gathered and reduced in a step"),
    Plant(COSTS, """            ("t", "all_reduce"): 3 * 2 * (t - 1) / t * N * s,
            ("d", "all_reduce"): 2 * (d - 1) / d * s}""",
          """            ("t", "all_reduce"): 3 * 2 * (t - 1) / t * N * s}""",
          "the loss's sum over d forgotten: a one-value all-reduce, but traffic all the same"),
    Plant(COSTS, '"optimizer": 2 * values * b}', '"optimizer": values * b}',
          "AdamW keeps two moments per value (exp_avg and exp_avg_sq), not one"),
    Plant(COSTS, "    return StepCost({key: m * value for key, value in sent.items()}, {key: m * n for key, n in calls.items()})",
          "    return StepCost(sent, calls)",
          "one microbatch's traffic for the step: train_step runs every microbatch's collectives, m times a step"),
    Plant(COSTS, "values = (L * (block_matrix_params(cfg) + 2 * M) + 2 * V * M + M) // (d * t)",
          "values = (L * block_matrix_params(cfg) + 2 * V * M) // (d * t)",
          "the norm weights left out of the state: they are sharded over the mesh like the matrices"),
    Plant(AXES, "    for axis in reversed(move.axes):\n", "    for axis in move.axes:\n",
          "the all-gather over the outer axis first: for M/t/d the d blocks of one M/t block must be joined first"),
    Plant(AXES, "    for axis in move.axes:\n        shape = list(block.shape)\n        shape[move.dim] //=",
          "    for axis in reversed(move.axes):\n        shape = list(block.shape)\n        shape[move.dim] //=",
          "the reduce-scatter over the inner axis first: blocks land in the wrong place of M/t/d"),
    Plant(AXES, "    total = x.tensor.clone()\n", "    total = x.tensor\n",
          "the all-reduce sums in place into its input: the caller's unreduced tensor is changed under it"),
    Plant(AXES, "unreduced = frozenset(axis for dim in contracted for axis in dim.axes)", "unreduced = frozenset()",
          "a contraction over a sharded dimension said to be reduced: it is a partial sum until it is reduced"),
    Plant(LLAMA, 'first=self.mesh.index["t"] * rows', 'first=self.mesh.index["d"] * rows',
          "the embedding's rows offset by the d index: the vocabulary is split over t, the wrong axis of the mesh"),
    Plant(LLAMA, """        dn2 = (einsum_unreduced("B/d T F/t, F/t M -> B/d T M", dg, w.w_gate)
               + einsum_unreduced("B/d T F/t, F/t M -> B/d T M", du, w.w_up))""",
          """        dn2 = einsum_unreduced("B/d T F/t, F/t M -> B/d T M", dg, w.w_gate)""",
          "n2 feeds the gate and the up projection: its gradient is the sum of both paths"),
    Plant(LLAMA, '[dxg, d_ln1], "dx, d ln1"))\n        return dh + dxg\n', '[dxg, d_ln1], "dx, d ln1"))\n        return dxg\n',
          "the attention half's backward drops the residual: dx is dh plus the gradient through the norm"),
    Plant(LLAMA, 'top.lm_head)\n        d_head = einsum_unreduced("B/d T V/t, B/d T M -> V/t M", dlogits, nf)\n',
          'top.lm_head)\n        d_head = einsum_unreduced("B/d T V/t, B/d T M -> V/t M", dlogits, nf)\n'
          '        d_head.tensor.mul_(1 / self.mesh.sizes["d"])\n',
          "the head's gradient averaged over d: the loss is already a mean over all tokens, so the sum is right"),
    Plant(LLAMA, '[h, w.ln2], "h, ln2"', '[h, w.ln1], "h, ln2"',
          "the FFN half's norm with ln1, the attention half's weight: equal (ones) at the start, apart after a step"),
    Plant(LLAMA, "        return x + a\n", "        return a\n",
          "the attention half returns its output without the residual: h is x plus attention"),
    Plant(LLAMA, '        q = local("B/d T K/t Q D -> B/d T K/t Q D", rope_forward, q, cos=rope.cos_q, sin=rope.sin_q)\n', "",
          "RoPE on k only: q and k must both be rotated, or the scores no longer depend on relative position"),
    Plant(LLAMA, '        s = local("B/d T F/t, B/d T F/t -> B/d T F/t", swiglu_forward, g, u)\n        f = ',
          '        s = local("B/d T F/t, B/d T F/t -> B/d T F/t", swiglu_forward, u, g)\n        f = ',
          "SwiGLU's inputs swapped: the gate goes through SiLU, the up projection does not"),
    Plant(LLAMA, "        return h + f\n", "        return f\n",
          "the FFN half returns its output without the residual: y is h plus the FFN"),
    # The grouped collectives: copy-in, copy-out, the wait (issue 34.1).
    Plant(AXES, "        offset += n\n", "        offset += n * len(pending.rows)\n",
          "finish's offset counted over every row: a tensor's piece starts at the same place of each row, after the "
          "pieces of the tensors before it in that row only"),
    Plant(AXES, "        n = prod(shape)\n        pieces = [row[offset:offset + n].view(shape) for row in pending.rows]\n",
          "        n = prod(shape)\n        pieces = [row[offset:offset + n].view(shape) for row in pending.rows.flip(0)]\n",
          "finish joins the ranks' pieces in reverse: row j is rank j's block, the j-th along the tensor's dimension"),
    Plant(AXES, "    pending.work.wait()\n", "",
          "finish reads the rows without waiting for the collective: they hold its result only once it is waited for"),
    Plant(AXES, "        results.append(Sharded(torch.cat(pieces, dim=dim), spec, pending.mesh))\n",
          "        results.append(Sharded(torch.cat(pieces, dim=-1), spec, pending.mesh))\n",
          "finish joins every tensor's pieces along its last dimension: each is split over d along its own dimension "
          "(M/d is the first of wo's, the last of wq's)"),
    Plant(AXES, "    return InFlight(work, rows, [tuple(x.tensor.shape) for x in xs], [m.dim for m in moves], rights, mesh)",
          "    return InFlight(work, rows, [tuple(x.tensor.shape) for x in xs], [moves[0].dim] * len(xs), rights, mesh)",
          "start_all_gather gives the group one dimension, the first arrow's: each tensor is joined along its own"),
    Plant(AXES, "    blocks = [x.tensor.chunk(group.size, dim=move.dim) for x, move in zip(xs, moves)]\n",
          "    blocks = [x.tensor.chunk(group.size, dim=0) for x, move in zip(xs, moves)]\n",
          "start_reduce_scatter cuts every gradient along its first dimension: wq's gradient is split over d along M, "
          "its last"),
    Plant(AXES, "    rows = torch.cat([torch.stack(b).reshape(group.size, -1) for b in blocks], dim=1)\n",
          "    rows = torch.cat([x.tensor.reshape(group.size, -1) for x in xs], dim=1)\n",
          "start_reduce_scatter cuts each gradient flat, as module 07's flat buffer: row j is then its j-th slice of "
          "values, its block j only when the block is along the first dimension"),
    Plant(LLAMA, """        top_pending, pending = self.start_gather(self.top(), "top"), self.start_gather(self.blocks[0], "block 0")
        top = TopWeights(*finish(top_pending))
        x = self.embed(top, tokens, saved)
        for layer in range(L):
            current = pending
            if layer + 1 < L:
                pending = self.start_gather(self.blocks[layer + 1], f"block {layer + 1}")
            w = BlockWeights(*finish(current))
""", """        top = TopWeights(*finish(self.start_gather(self.top(), "top")))
        x = self.embed(top, tokens, saved)
        for layer in range(L):
            w = BlockWeights(*finish(self.start_gather(self.blocks[layer], f"block {layer}")))
""", "the next block not prefetched: each block's gather waited for as soon as it starts, nothing computes meanwhile"),
    Plant(LLAMA, "        dx, d_final_norm, d_lm_head = self.loss_backward(top, saved)\n",
          '        top = TopWeights(*finish(self.start_gather(self.top(), "top")))\n'
          "        dx, d_final_norm, d_lm_head = self.loss_backward(top, saved)\n",
          "the LM head (the top unit) gathered a second time for the loss's backward: it is kept since the embedding"),
    Plant(LLAMA, """            current = pending
            if layer > 0:
                pending = self.start_gather(self.blocks[layer - 1], f"block {layer - 1}")
            w, grads = BlockWeights(*finish(current)), {}
            dh = self.ffn_half_backward(w, dx, stores[layer], grads)
            dx = self.attention_half_backward(w, dh, stores[layer], grads)
""", """            w, grads = BlockWeights(*finish(pending)), {}
            dh = self.ffn_half_backward(w, dx, stores[layer], grads)
            dx = self.attention_half_backward(w, dh, stores[layer], grads)
            if layer > 0:
                pending = self.start_gather(self.blocks[layer - 1], f"block {layer - 1}")
""", "the backward's next gather started after the block's backward: it travels while nothing computes"),
    Plant(LLAMA, '            scatters[layer] = self.start_scatter(BlockWeights(**grads), f"block {layer}")\n',
          '            scatters[layer] = self.start_scatter(BlockWeights(**grads), f"block {layer}")\n'
          "            scatters[layer].work.wait()\n",
          "each block's reduce-scatter waited for at once: it could travel while the earlier blocks compute"),
    Plant(LLAMA, '        hg, ln2 = finish(start_all_gather(["B/d T M/t -> B/d T M", "M/t -> M"], [h, w.ln2], "h, ln2"))\n',
          '        hg = all_gather("B/d T M/t -> B/d T M", h)\n        ln2 = all_gather("M/t -> M", w.ln2)\n',
          "the stream and the norm weight gathered over t in two collectives: they cross the same axis at the same "
          "point, one collective carries both"),
    # Issue 37's learner run of 13 (blame): a gradient's wrong spec fails in the top unit's reduce-scatter, later;
    # the check where it is produced names the function that made it.
    Plant(LLAMA, '\n        dxf, d_norm = local("B/d T M {U_t}, B/d T M, B/d T, M -> B/d T M {U_t}, M {U_d,t}", '
                 'rmsnorm_backward,\n                            dn, store["xf"], store["rf"], norm)\n'
                 '        dx, d_norm = finish(start_reduce_scatter(["B/d T M {U_t} -> B/d T M/t", "M {U_d,t} -> M/t {U_d}"],',
          '\n        dxf, d_norm = local("B/d T M {U_t}, B/d T M, B/d T, M -> B/d T M {U_t}, M {U_t}", '
          'rmsnorm_backward,\n                            dn, store["xf"], store["rf"], norm)\n'
          '        dx, d_norm = finish(start_reduce_scatter(["B/d T M {U_t} -> B/d T M/t", "M {U_t} -> M/t"],',
          "the final norm's gradient declared unreduced over t only: it is a sum over this rank's rows too, so it is "
          "unreduced over d as well, which the top unit's reduce-scatter sums", new=True),
    Plant(LLAMA, '\n        return einsum_unreduced("B/d T V/t, B/d T M -> V/t M", store["onehot"], dxg)\n',
          '\n        return all_reduce("V/t M {U_d} -> V/t M", einsum_unreduced("B/d T V/t, B/d T M -> V/t M", '
          'store["onehot"], dxg))\n',
          "the embedding's gradient summed over d in embed_backward: the top unit's reduce-scatter sums it over d, "
          "so it must leave unreduced over d", new=True),
]
