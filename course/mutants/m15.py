"""Module 15's planted bugs (read by `python -m course.mutants`): each is a plausible wrong version of
one line of solutions/, which some graded test of tests/test_15_*.py must fail. `find` occurs exactly
once in `file`; `replace` is put in its place; `teaches` is what the test that catches it teaches."""
from course.mutants import Plant

PLANTS = [
    # --- layout ----------------------------------------------------------------------------------
    Plant(file="m15_layout.py",
     find= "return [(index * length, length), ((2 * c - 1 - index) * length, length)]",
     replace= "return [(index * length, length), ((c + index) * length, length)]",
     teaches= "the partner chunk must mirror the first (2c-1-i): chunk c+i gives the late ranks all the work"),
    Plant(file="m15_layout.py",
     find= "return [(index * length, length), ((2 * c - 1 - index) * length, length)]",
     replace= "return [(2 * index * length, length), ((2 * index + 1) * length, length)]",
     teaches= "two neighbouring chunks are the contiguous layout again: no balance"),
    # --- the merge -------------------------------------------------------------------------------
    Plant(file="m15_ring_attention.py",
     find= "    return (o * torch.exp(lse - merged).unsqueeze(-1) + o_block * torch.exp(lse_block - merged).unsqueeze(-1),\n"
             "            merged)",
     replace= "    return o + o_block, merged",
     teaches= "merge without the lse correction: each partial is normalised over its own keys only"),
    Plant(file="m15_ring_attention.py",
     find= "    return (o * torch.exp(lse - merged).unsqueeze(-1) + o_block * torch.exp(lse_block - merged).unsqueeze(-1),\n"
             "            merged)",
     replace= "    return torch.where(torch.isinf(lse).unsqueeze(-1), o_block, (o + o_block) / 2), merged",
     teaches= "averaging the partials weighs a block of 1 key like a block of 100"),
    Plant(file="m15_ring_attention.py",
     find= "    merged = top + torch.log(torch.exp(lse - top) + torch.exp(lse_block - top))",
     replace= "    merged = torch.log(torch.exp(lse) + torch.exp(lse_block))",
     teaches= "exp of an lse overflows float32 once scores reach ~88: subtract the running maximum"),
    # --- the ring's forward ------------------------------------------------------------------------
    Plant(file="m15_ring_attention.py",
     find= "                    o_b, lse_b = attention_forward(q[:, q_rows], kv[0][:, k_rows], kv[1][:, k_rows], self.chunk,\n"
             "                                                   q_start, k_start)",
     replace= "                    o_b, lse_b = attention_forward(q[:, q_rows], kv[0][:, k_rows], kv[1][:, k_rows], self.chunk,\n"
                "                                                   q_start, q_start)",
     teaches= "a block masked with the wrong offset: every block treated as the diagonal one"),
    Plant(file="m15_ring_attention.py",
     find= "                    o_b, lse_b = attention_forward(q[:, q_rows], kv[0][:, k_rows], kv[1][:, k_rows], self.chunk,\n"
             "                                                   q_start, k_start)",
     replace= "                    o_b, lse_b = attention_forward(q[:, q_rows], kv[0][:, k_rows], kv[1][:, k_rows], self.chunk,\n"
                "                                                   q_rows.start, k_rows.start)",
     teaches= "offsets are positions in the whole sequence, not rows of the rank's local tokens"),
    Plant(file="m15_ring_attention.py",
     find= "                send = group.collectives.isend(kv, (me + 1) % c, label=\"kv\", tag=KV_TAG)\n"
             "            for q_start, q_rows in layout.local_pieces(me):\n"
             "                for k_start, k_rows in layout.local_pieces(owner):\n"
             "                    if k_start >= q_start + (q_rows.stop - q_rows.start):\n"
             "                        continue  # every key",
     replace= "                send = group.collectives.isend(kv, (me - 1) % c, label=\"kv\", tag=KV_TAG)\n"
                "            for q_start, q_rows in layout.local_pieces(me):\n"
                "                for k_start, k_rows in layout.local_pieces(owner):\n"
                "                    if k_start >= q_start + (q_rows.stop - q_rows.start):\n"
                "                        continue  # every key",
     teaches= "a ring sending the wrong direction: the block in hand is no longer rank (me - s)'s"),
    Plant(file="m15_ring_attention.py",
     find= "                    if k_start >= q_start + (q_rows.stop - q_rows.start):\n"
             "                        continue  # every key of this piece",
     replace= "                    if k_start >= q_start:\n"
                "                        continue  # every key of this piece",
     teaches= "the diagonal block is partly visible: skip only blocks wholly in the future"),
    Plant(file="m15_ring_attention.py",
     find= "lse_b)\n            if not last:\n                recv.wait()\n                send.wait()\n                kv = incoming\n",
     replace= "lse_b)\n            if not last:\n                recv.wait()\n                send.wait()\n",
     teaches= "the received block must become the block in hand"),
    # --- the ring's backward -----------------------------------------------------------------------
    Plant(file="m15_ring_attention.py",
     find= "        if c > 1:  # after c steps, this rank's own block's accumulator, complete\n"
             "            arriving[0].wait()\n            acc = arriving[1]",
     replace= "        if c > 1:  # after c steps, this rank's own block's accumulator, complete\n"
                "            arriving[0].wait()",
     teaches= "the backward accumulators not returned to their owner: the last one held is another rank's block"),
    Plant(file="m15_ring_attention.py",
     find= "                arriving[0].wait()\n                acc += arriving[1]",
     replace= "                arriving[0].wait()",
     teaches= "an accumulator must carry what the earlier holders added: a fresh one per rank loses it"),
    Plant(file="m15_ring_attention.py",
     find= "                    dq[:, q_rows] += dq_b",
     replace= "                    dq[:, q_rows] = dq_b",
     teaches= "dq sums over every block of keys"),
    Plant(file="m15_ring_attention.py",
     find= "                                                          kv[1][:, k_rows], None, lse[..., q_rows], self.chunk,",
     replace= "                                                          kv[1][:, k_rows], None, attention_forward(\n"
                "                q[:, q_rows], kv[0][:, k_rows], kv[1][:, k_rows], self.chunk, q_start, k_start)[1], "
                "self.chunk,",
     teaches= "each block's backward rebuilds its share of the one softmax: the merged lse, not the block's own"),
    # --- all-gather KV -----------------------------------------------------------------------------
    Plant(file="m15_allgather_kv.py",
     find= "        return gathered.index_select(2, layout.order().argsort().to(k.device))",
     replace= "        return gathered",
     teaches= "the gathered keys are in the ranks' order, not in position order (zig-zag)"),
    Plant(file="m15_allgather_kv.py",
     find= "        in_ranks_order = dkv.index_select(2, layout.order().to(k.device))",
     replace= "        in_ranks_order = dkv",
     teaches= "the reduce-scatter hands out blocks in the ranks' order: lay the gradients out that way first"),
    Plant(file="m15_allgather_kv.py",
     find= "            o, lse = attention_forward(q[:, rows], kv[0], kv[1], self.chunk, q_start, 0)",
     replace= "            o, lse = attention_forward(q[:, rows], kv[0], kv[1], self.chunk, rows.start, 0)",
     teaches= "a zig-zag rank's second piece sits far down the sequence: its offset is its position"),
    # --- Ulysses -----------------------------------------------------------------------------------
    Plant(file="m15_ulysses.py",
     find= "    blocks = x.reshape(B, n, c, h // c, D).permute(2, 0, 1, 3, 4).contiguous()",
     replace= "    blocks = x.reshape(B, c, n // c, h, D).permute(1, 0, 2, 3, 4).contiguous()",
     teaches= "Ulysses' all-to-all with split and concat dims swapped: cut the heads, not the positions"),
    Plant(file="m15_ulysses.py",
     find= "    return received.permute(1, 0, 2, 3, 4).reshape(B, c * n, h // c, D)",
     replace= "    return received.permute(1, 2, 0, 3, 4).reshape(B, c * n, h // c, D)",
     teaches= "what arrives from rank j is rank j's positions: lay the blocks along time, rank after rank"),
    Plant(file="m15_ulysses.py",
     find= "    return received.permute(1, 2, 0, 3, 4).reshape(B, T // c, c * hc, D)",
     replace= "    return received.permute(1, 2, 3, 0, 4).reshape(B, T // c, c * hc, D)",
     teaches= "heads come back in rank order: rank j's block is heads j h/c .. (j+1) h/c, not interleaved"),
    Plant(file="m15_ulysses.py",
     find= "        kh = self.to_heads(k.repeat_interleave(copies, dim=2), order, \"k\")\n"
             "        vh = self.to_heads(v.repeat_interleave(copies, dim=2), order, \"v\")\n"
             "        o_h, lse_h",
     replace= "        kh = self.to_heads(k.repeat(1, 1, copies, 1), order, \"k\")\n"
                "        vh = self.to_heads(v.repeat(1, 1, copies, 1), order, \"v\")\n"
                "        o_h, lse_h",
     teaches= "copies of a key/value head must sit next to each other, so each rank gets the one its queries read"),
    # --- the model ---------------------------------------------------------------------------------
    Plant(file="m15_cp_model.py",
     find= "            self._rope[key] = rope_tables_at(layout.positions(self.group.index), self.cfg.head_dim,",
     replace= "            self._rope[key] = rope_tables_at(self.group.index * seq_len + torch.arange(seq_len), self.cfg.head_dim,",
     teaches= "zig-zag positions not following the chunks: RoPE must rotate by the layout's positions"),
    Plant(file="m15_cp_model.py",
     find= "        n_tokens = real_tokens(targets)  # of the whole global batch",
     replace= "        n_tokens = real_tokens(self.share(targets))  # of the whole global batch",
     teaches= "a loss averaged over the local tokens only: summed over d c ranks it is d c times too large"),
    Plant(file="m15_cp_model.py",
     find= "        dc.collectives.all_reduce(loss, label=\"loss\")",
     replace= "        pass",
     teaches= "the loss of one rank is its share of the global mean: sum it over d c"),
    Plant(file="m15_cp_model.py",
     find= "        sum_over_data_and_context(acc, dc)",
     replace= "        sum_over_data_and_context(acc, self.mesh.group(\"d\"))",
     teaches= "context ranks hold different tokens: their weight gradients are partial sums too"),
    # --- costs -------------------------------------------------------------------------------------
    Plant(file="m15_costs.py",
     find= "        per_block = {\"send\": (3 * c - 2, 2 * (c - 1) * kv + c * dkv) if c > 1 else (0, 0)}",
     replace= "        per_block = {\"send\": (3 * c - 2, 2 * (c - 1) * kv + (c - 1) * dkv) if c > 1 else (0, 0)}",
     teaches= "each accumulator makes one more hop than its block: home"),
    Plant(file="m15_costs.py",
     find= "        per_block = {\"all_to_all\": (13, (c - 1) * (forward + backward) / c)}",
     replace= "        per_block = {\"all_to_all\": (13, forward + backward)}",
     teaches= "an all-to-all keeps 1/c of its input at home"),
    # --- learner run: bf16 accumulators and lse, the order of a ring step's messages ----------------
    Plant(file="m15_ring_attention.py",
     find= "                buffer = torch.empty(kv.shape, dtype=lse.dtype, device=kv.device)\n"
             "                receive = group.collectives.irecv(buffer, (me - 1) % c, label=\"dkv\", tag=DKV_TAG)\n"
             "            acc = torch.zeros(kv.shape, dtype=lse.dtype, device=kv.device)",
     replace= "                buffer = torch.empty_like(kv)\n"
                "                receive = group.collectives.irecv(buffer, (me - 1) % c, label=\"dkv\", tag=DKV_TAG)\n"
                "            acc = torch.zeros_like(kv)",
     teaches= "the ring's dk, dv accumulators in the values' dtype: every hop rounds a bf16 running sum again"),
    Plant(file="m15_allgather_kv.py",
     find= "        dkv = torch.zeros(kv.shape, dtype=lse.dtype, device=kv.device)\n"
             "        dqs = []\n"
             "        for q_start, rows in layout.local_pieces(me):\n"
             "            dq, dk, dv = attention_backward(do[:, rows], q[:, rows], kv[0], kv[1], None, lse[..., rows], self.chunk,\n"
             "                                            q_start, 0, delta[..., rows])\n"
             "            dqs.append(dq)\n"
             "            dkv[0] += dk\n"
             "            dkv[1] += dv\n"
             "        mine = torch.empty((2, *k.shape), dtype=lse.dtype, device=k.device)\n",
     replace= "        dkv = torch.zeros_like(kv)\n"
                "        dqs = []\n"
                "        for q_start, rows in layout.local_pieces(me):\n"
                "            dq, dk, dv = attention_backward(do[:, rows], q[:, rows], kv[0], kv[1], None, lse[..., rows], self.chunk,\n"
                "                                            q_start, 0, delta[..., rows])\n"
                "            dqs.append(dq)\n"
                "            dkv[0] += dk\n"
                "            dkv[1] += dv\n"
                "        mine = torch.empty((2, *k.shape), dtype=k.dtype, device=k.device)\n",
     teaches= "the all-gather's dk, dv summed in the values' dtype: bf16 sums over the pieces and the ranks"),
    Plant(file="m15_allgather_kv.py",
     find= "        mine = torch.empty((2, *k.shape), dtype=lse.dtype, device=k.device)",
     replace= "        mine = torch.empty((2, *k.shape), dtype=k.dtype, device=k.device)\n"
                "        dkv = dkv.to(k.dtype)",
     teaches= "the gradients reduce-scattered in the values' dtype: the sum over the ranks rounds in bf16"),
    Plant(file="m15_ring_attention.py",
     find= "grouped_output(o_b, kv_heads, D).to(dtype), lse_b)",
     replace= "grouped_output(o_b, kv_heads, D).to(dtype), lse_b.to(q.dtype))",
     teaches= "an lse rounded to bf16 moves every softmax weight exp(s - lse) by up to 1 %: it stays float32"),
    Plant(file="m15_ring_attention.py",
     find= "                recv = group.collectives.irecv(incoming, (me - 1) % c, label=\"kv\", tag=KV_TAG)\n"
             "                send = group.collectives.isend(kv, (me + 1) % c, label=\"kv\", tag=KV_TAG)\n"
             "            for q_start",
     replace= "                send = group.collectives.isend(kv, (me + 1) % c, label=\"kv\", tag=KV_TAG)\n"
                "                recv = group.collectives.irecv(incoming, (me - 1) % c, label=\"kv\", tag=KV_TAG)\n"
                "            for q_start",
     teaches= "post the receive before the send: gloo moves a message only once its receive is posted"),
    Plant(file="m15_ring_attention.py",
     find= "                recv = group.collectives.irecv(incoming, (me - 1) % c, label=\"kv\", tag=KV_TAG)\n"
             "                send = group.collectives.isend(kv, (me + 1) % c, label=\"kv\", tag=KV_TAG)\n"
             "            if c > 1:",
     replace= "                send = group.collectives.isend(kv, (me + 1) % c, label=\"kv\", tag=KV_TAG)\n"
                "                recv = group.collectives.irecv(incoming, (me - 1) % c, label=\"kv\", tag=KV_TAG)\n"
                "            if c > 1:",
     teaches= "the backward's blocks too: post the receive before the send"),
    # --- learner run: Ulysses' lse with several key/value heads a rank ---------------------------------
    Plant(file="m15_ulysses.py",
     find= "lse = self.to_sequence(lse_h.reshape(B, heads // c, T)",
     replace= "lse = self.to_sequence(lse_h.transpose(1, 2).reshape(B, heads // c, T)",
     teaches= "a rank's lse heads are (key/value head, group), in that order: visible once a rank has 2 kv heads"),
    Plant(file="m15_ulysses.py",
     find= "stats_h[..., i].transpose(1, 2).reshape(B, k_heads, -1, T)",
     replace= "stats_h[..., i].transpose(1, 2).reshape(B, -1, k_heads, T).transpose(1, 2)",
     teaches= "the backward regroups a rank's heads as (key/value head, group), like the forward's lse"),
    # --- learner run: costs at c = 1 and in bf16 -------------------------------------------------------
    Plant(file="m15_costs.py",
     find= "        per_block = {\"all_gather\": (2, 2 * (c - 1) * kv), \"reduce_scatter\": (1, (c - 1) * dkv)}",
     replace= "        per_block = {\"all_gather\": (2 if c > 1 else 0, 2 * (c - 1) * kv),\n"
                "                     \"reduce_scatter\": (1 if c > 1 else 0, (c - 1) * dkv)}",
     teaches= "a group of one still logs its collectives: the all-gather's calls count at c = 1"),
    Plant(file="m15_costs.py",
     find= "        per_block = {\"all_to_all\": (13, (c - 1) * (forward + backward) / c)}",
     replace= "        per_block = {\"all_to_all\": (13 if c > 1 else 0, (c - 1) * (forward + backward) / c)}",
     teaches= "a group of one still logs its collectives: Ulysses' all-to-alls count at c = 1"),
    Plant(file="m15_costs.py",
     find= "\"reduce_scatter\": (1, (c - 1) * dkv)}",
     replace= "\"reduce_scatter\": (1, (c - 1) * kv)}",
     teaches= "the all-gather's gradients are reduce-scattered in the statistics' dtype, s bytes a value"),
    # --- DeepSpeed-Ulysses' adjoint backward (issue 35) ----------------------------------------------
    Plant(file="m15_costs.py",
     find= "            per_block = {\"all_to_all\": (8, (c - 1) * 2 * (2 * q + 2 * k) / c)}",
     replace= "            per_block = {\"all_to_all\": (11, (c - 1) * (2 * (2 * q + 2 * k) + q + 2 * k) / c)}",
     teaches= "DeepSpeed's backward runs the forward's all-to-alls backwards: it re-sends none of q, k, v"),
    Plant(file="m15_costs.py",
     find= "            per_block = {\"all_to_all\": (8, (c - 1) * 2 * (2 * q + 2 * k) / c)}",
     replace= "            per_block = {\"all_to_all\": (10, (c - 1) * (2 * (2 * q + 2 * k) + 3 * tokens * H * s) / c)}",
     teaches= "DeepSpeed's attention keeps its head-sharded lse for its backward: no statistics travel"),
    # --- learner run: the loss of padded batches -------------------------------------------------------
    Plant(file="m15_cp_model.py",
     find= "            part, grads = self.forward_backward(tok_m, tgt_m, n_tokens)",
     replace= "            part, grads = self.forward_backward(tok_m, tgt_m, real_tokens(tgt_m) * n_microbatches * dc.size)",
     teaches= "averaging the pieces' means is the step's mean only while every piece has as many real tokens"),
    Plant(file="m15_cp_model.py",
     find= "        n_tokens = real_tokens(targets)  # of the whole global batch",
     replace= "        n_tokens = targets.numel()  # of the whole global batch",
     teaches= "padding (IGNORE_INDEX) is no token: divide by the real tokens, not the batch's size"),
]
