"""Module 14's planted bugs (data parallelism, ZeRO-1 and ZeRO-2), read by `python -m course.mutants`:
each is a plausible wrong version of code in a solution block of solutions/`file`, which some graded
test of tests/test_14_*.py must fail. `find` occurs exactly once in its file; `replace` is put in
its place; `teaches` is what the mistake is and why it is wrong."""
from course.mutants import Plant

BUCKETS, DP, STEP, ZERO, COSTS = ("m14_buckets.py", "m14_data_parallel.py", "m14_train_step.py", "m14_zero.py",
                                  "m14_costs.py")


PLANTS = [
    # --- the bucket assignment -----------------------------------------------------------------------
    Plant(BUCKETS, "    return sorted(closed, key=min, reverse=True)\n", "    return sorted(closed, key=min)\n",
          "buckets not reversed: bucket 0 then holds the first layers, whose gradients come last, so nothing "
          "can be sent until the backward is over"),
    Plant(BUCKETS, "        if size >= cap_bytes:\n", "        if size > cap_bytes:\n",
          "a bucket that reaches the cap exactly must close (PyTorch closes at >= C)"),
    Plant(BUCKETS, """        indices, size = open_buckets.get(p.dtype, ([], 0))
        indices, size = indices + [i], size + p.numel() * p.element_size()
        open_buckets[p.dtype] = (indices, size)
        if size >= cap_bytes:
            closed.append(indices)
            del open_buckets[p.dtype]""", """        indices, size = open_buckets.get("any", ([], 0))
        indices, size = indices + [i], size + p.numel() * p.element_size()
        open_buckets["any"] = (indices, size)
        if size >= cap_bytes:
            closed.append(indices)
            del open_buckets["any"]""",
          "one open bucket for every dtype: a bucket is one flat buffer of one dtype"),
    Plant(BUCKETS, "    return sorted(closed, key=min, reverse=True)\n", "    return sorted(closed, key=max, reverse=True)\n",
          "buckets ordered by their last parameter: with two dtypes a bucket that opened earlier can close later "
          "(PyTorch orders by the first)"),
    Plant(BUCKETS, "    closed += [indices for indices, _ in open_buckets.values()]\n", "",
          "the buckets still open at the end forgotten: their gradients are never summed"),
    Plant(BUCKETS, """    for i, p in enumerate(params):
        indices, size = open_buckets.get(p.dtype, ([], 0))
        indices, size = indices + [i], size + p.numel() * p.element_size()
        open_buckets[p.dtype] = (indices, size)
        if size >= cap_bytes:
            closed.append(indices)
            del open_buckets[p.dtype]""", """    for i, p in enumerate(params):
        indices, size = open_buckets.get(p.dtype, ([], 0))
        if indices and size + p.numel() * p.element_size() > cap_bytes:
            closed.append(indices)
            indices, size = [], 0
        open_buckets[p.dtype] = (indices + [i], size + p.numel() * p.element_size())""",
          "closing a bucket before it would overshoot: PyTorch adds the tensor first, so a bucket's last tensor "
          "may overshoot the cap"),
    # --- the broadcast -------------------------------------------------------------------------------------
    Plant(DP, "            if group.index != 0:\n", "            if torch.distributed.get_rank() != 0:\n",
          "the job's rank 0 instead of the group's first member: on the d axis of a d x t mesh the group (1, 3) "
          "has no rank 0, and every member zeroes its weights"),
    Plant(DP, "            if group.index != 0:\n", "            if group.index == 0:\n",
          "the first member zeroes its weights and the others keep theirs: the sum is everyone else's"),
    Plant(DP, "            if group.index != 0:\n                t.zero_()\n", "",
          "no zeros from the other members: the sum is d times the weights (each replica a different start)"),
    # --- ready, launch, finish ---------------------------------------------------------------------------------
    Plant(DP, """        bucket.pending.remove(i)
        while self.next_bucket < len(self.buckets) and not self.buckets[self.next_bucket].pending:
            self.launch(self.buckets[self.next_bucket])
            self.next_bucket += 1""", """        bucket.pending.remove(i)
        if not bucket.pending:
            self.launch(bucket)
            self.next_bucket += 1""",
          "each bucket sent as soon as it is complete, in whatever order: ranks whose gradients arrive in another "
          "order issue the buckets in another order (DDP launches strictly in bucket order)"),
    Plant(DP, """        bucket.pending.remove(i)
        while self.next_bucket < len(self.buckets) and not self.buckets[self.next_bucket].pending:
            self.launch(self.buckets[self.next_bucket])
            self.next_bucket += 1""", """        bucket.pending.remove(i)
        if bucket.index == self.next_bucket:
            self.launch(bucket)
            self.next_bucket += 1""",
          "a bucket sent with its first gradient rather than its last: its sum misses the gradients still to come"),
    Plant(DP, """        while self.next_bucket < len(self.buckets) and not self.buckets[self.next_bucket].pending:
            self.launch(self.buckets[self.next_bucket])
            self.next_bucket += 1""", """        if all(not b.pending for b in self.buckets):
            for b in self.buckets:
                self.launch(b)""",
          "every bucket sent once the whole backward is over: right sums, no overlap (the first bucket must leave "
          "before the first layer's backward)"),
    Plant(DP, "        for bucket in self.buckets:\n            self.complete(bucket)\n            bucket.arm()\n",
          "        for bucket in self.buckets:\n            bucket.arm()\n",
          "buckets never waited for: the optimizer reads gradients whose sums may not have arrived"),
    Plant(DP, "        for bucket in self.buckets:\n            self.complete(bucket)\n            bucket.arm()\n",
          "        for bucket in self.buckets:\n            self.complete(bucket)\n",
          "buckets not re-armed: the next backward finds no gradient pending"),
    Plant(DP, "            bucket.arm()\n        self.next_bucket = 0\n", "            bucket.arm()\n",
          "the next bucket to send not reset: from the second step on no bucket is ever sent"),
    Plant(DP, """        if missing:
            raise RuntimeError(f"no gradient arrived for {', '.join(missing)} in this backward (unused by the forward?): "
                               f"every replicated parameter needs one in every backward; freeze it "
                               f"(requires_grad_(False)) or leave it out of the model")
""", "",
          "an unused parameter passed over in silence: its bucket (and every one after it) is never summed"),
    # --- the step: micro-steps, module 06's hand-over ------------------------------------------------------------
    Plant(STEP, """            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=IGNORE_INDEX,
                                   reduction="sum")
            loss.backward()
        if sync:
            ddp.finish()
        loss_sum += loss.detach()
    n_tokens = int(count.wait())  # the sums over ranks have arrived: now the step's mean
    for gradient in ddp.gradients():
        gradient.div_(n_tokens)
""", """            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=IGNORE_INDEX)
            (loss / (n_microbatches * ddp.group.size)).backward()
            loss = loss * (y != IGNORE_INDEX).sum()
        if sync:
            ddp.finish()
        loss_sum += loss.detach()
    n_tokens = int(count.wait())
""",
          "the per-microbatch mean over m d: a token of a half-padded microbatch then weighs twice a token of a "
          "full one"),
    Plant(STEP, "            loss.backward()\n        if sync:\n",
          "            (loss / int(count.wait())).backward()\n        if sync:\n",
          "the loss divided twice: by the count in the backward, and the gradients again once it has arrived (N "
          "times too small; the count is also waited for before the backward)"),
    Plant(STEP, """    n_tokens = int(count.wait())  # the sums over ranks have arrived: now the step's mean
    for gradient in ddp.gradients():
        gradient.div_(n_tokens)
""", """    for gradient in ddp.gradients():
        gradient.div_(count.result)
    n_tokens = int(count.wait())
""",
          "the gradients divided before the count arrived: what the count's tensor holds before its wait() is "
          "whatever the network has delivered so far"),
    Plant(STEP, """\n    n_tokens = int(count.wait())  # the sums over ranks have arrived: now the step's mean
    for gradient in ddp.gradients():""", """\n    n_tokens = int(count.result)
    for gradient in ddp.gradients():""",
          "the count's collective never waited for: its tensor is read before the sum has arrived"),
    Plant(STEP, "    for i, (x, y) in enumerate(zip(inputs.chunk(n_microbatches), targets.chunk(n_microbatches), strict",
          "    n_tokens = int(count.wait())\n"
          "    for i, (x, y) in enumerate(zip(inputs.chunk(n_microbatches), targets.chunk(n_microbatches), strict",
          "the count waited for before the first forward: right numbers, but the step blocks on it with nothing "
          "to hide it behind"),
    Plant(STEP, """        if sync:
            ddp.finish()
        loss_sum += loss.detach()
    n_tokens = int(count.wait())  # the sums over ranks have arrived: now the step's mean
    for gradient in ddp.gradients():
        gradient.div_(n_tokens)
""", """        loss_sum += loss.detach()
        if sync:
            for gradient in ddp.gradients():
                gradient.div_(int(count.wait()))
            ddp.finish()
    n_tokens = int(count.wait())
""",
          "the gradients divided before finish(): the buckets' sums land afterwards and overwrite the division"),
    Plant(STEP, "strict=True)):\n        sync = i == n_microbatches - 1 or ddp.syncs_every_microstep\n",
          "strict=True)):\n        sync = i == 0 or ddp.syncs_every_microstep\n",
          "the sync on the first micro-step: the later micro-steps' gradients are never summed over ranks"),
    Plant(STEP, "strict=True)):\n        sync = i == n_microbatches - 1 or ddp.syncs_every_microstep\n", "strict=True)):\n        sync = True\n",
          "every micro-step sends: the buckets already summed are summed again with the next micro-step's"),
    Plant(STEP, "strict=True)):\n        sync = i == n_microbatches - 1 or ddp.syncs_every_microstep\n",
          "strict=True)):\n        sync = i == n_microbatches - 1\n",
          "ZeRO-2 under no_sync: it keeps only a shard of the gradients, so it must send every micro-step"),
    Plant(STEP, "        if sync:\n            ddp.finish()\n        loss_sum += loss.detach()",
          "        ddp.finish()\n        loss_sum += loss.detach()",
          "finish() after a micro-step that sent nothing: no gradient was marked, so it reports them all missing"),
    Plant(STEP, "    loss_sum = torch.zeros((), dtype=torch.float64)  # float64 whatever the model's dtype",
          "    loss_sum = torch.zeros(())  # float64 whatever the model's dtype",
          "the loss sum in the default dtype (float32): past 2^24 it keeps only even whole numbers, so the step's "
          "logged loss rounds where the contract says float64", new=True),
    Plant(STEP, "        loss_sum += loss.detach()\n    n_tokens = int(count.wait())",
          "        loss_sum = loss_sum + loss.detach().float()\n    n_tokens = int(count.wait())",
          "each micro-step's loss added in the model's dtype: the running sum becomes float32 and rounds past 2^24",
          new=True),
    # --- module 06's Llama: what forward_backward divides by, and the count ----------------------------------
    Plant(STEP, "loss, grads = self.forward_backward(tok, tgt, 1)  # summed;",
          "loss, grads = self.forward_backward(tok, tgt)  # summed;",
          "module 06's default n_tokens, the microbatch's own count: a mean per microbatch, then divided by the "
          "step's count again"),
    Plant(STEP, "loss, grads = self.forward_backward(tok, tgt, 1)  # summed;",
          "loss, grads = self.forward_backward(tok, tgt, int(count.wait()))  # summed;",
          "the loss divided twice: forward_backward already divides by the count it is given, and the gradients are "
          "divided again once it has arrived (the count is also waited for before the backward)"),
    Plant(STEP, "        n_tokens = int(count.wait())  # the sums over ranks have arrived: now the step's mean\n"
                "        for gradient in self.ddp.gradients():",
          "        count.wait()\n        n_tokens = int((targets != IGNORE_INDEX).sum())\n"
          "        for gradient in self.ddp.gradients():",
          "this rank's count instead of the step's: every rank's gradient d times too big"),
    Plant(STEP, "        n_tokens = int(count.wait())  # the sums over ranks have arrived: now the step's mean\n"
                "        for gradient in self.ddp.gradients():",
          "        n_tokens = int(count.result)\n        for gradient in self.ddp.gradients():",
          "module 06's Llama reading the count's tensor without waiting: the sum has not arrived"),
    Plant(STEP, """                for weight, grad in ((self.embedding, grads.embedding), (self.final_norm, grads.final_norm),
                                     (self.lm_head, grads.lm_head)):
                    self.ddp.ready(weight, grad)
""", "",
          "the gradients forward_backward returns at the end (embedding, final norm, LM head) never handed to the "
          "buckets: their bucket is never sent"),
    Plant(STEP, "            sync = i == n_microbatches - 1\n            with contextlib.nullcontext() if sync else self.ddp",
          "            sync = True\n            with contextlib.nullcontext() if sync else self.ddp",
          "module 06's Llama sending on every micro-step: the buckets already summed are summed again with the next "
          "micro-step's"),
    # --- ZeRO --------------------------------------------------------------------------------------------------
    Plant(ZERO, "    size = padded_numel // d\n    return slice(index * size, (index + 1) * size)\n",
          "    size = padded_numel // d\n    return slice((index + 1) % d * size, ((index + 1) % d + 1) * size)\n",
          "the optimizer shard off by one rank: each rank updates its neighbour's slice and all-gathers it into "
          "its own place"),
    Plant(ZERO, "        if self.stage == 1:\n            return super().launch(bucket)\n",
          "        if self.stage == 0:\n            return super().launch(bucket)\n",
          "a reduce-scatter where ZeRO-1 needs an all-reduce: ZeRO-1 keeps the whole summed gradient on every rank"),
    Plant(ZERO, "        if bucket.index > 0:\n            self.complete(self.buckets[bucket.index - 1])\n", "",
          "ZeRO-2 with every bucket in flight at once: each keeps its whole gradient alive until waited for, which "
          "is the memory ZeRO-2 exists to drop"),
    Plant(ZERO, """        if bucket.index > 0:
            self.complete(self.buckets[bucket.index - 1])
        bucket.received = torch.empty(bucket.padded_numel // self.group.size, dtype=bucket.grads.dtype,
                                      device=bucket.grads.device)
        bucket.work = self.group.collectives.reduce_scatter(bucket.received, bucket.grads,
                                                            label=f"bucket {bucket.index}", async_op=True)""",
          """        bucket.received = torch.empty(bucket.padded_numel // self.group.size, dtype=bucket.grads.dtype,
                                      device=bucket.grads.device)
        bucket.work = self.group.collectives.reduce_scatter(bucket.received, bucket.grads,
                                                            label=f"bucket {bucket.index}", async_op=True)
        if bucket.index > 0:
            self.complete(self.buckets[bucket.index - 1])""",
          "the previous bucket completed after the next one is sent: two whole buckets in flight, not one"),
    Plant(ZERO, "        if bucket.index > 0:\n            self.complete(self.buckets[bucket.index - 1])\n",
          "        if bucket.index > 1:\n            self.complete(self.buckets[bucket.index - 2])\n",
          "ZeRO-2 completing the bucket sent two before: two whole buckets in flight at every launch, not one"),
    Plant(ZERO, "        bucket.received = torch.empty(bucket.padded_numel // self.group.size, dtype=bucket.grads.dtype,\n"
                "                                      device=bucket.grads.device)\n",
          "        bucket.received = self.grad_shards[bucket.index]\n",
          "received straight into the gradient shard: land() adds it to itself, and micro-steps overwrite each other"),
    Plant(ZERO, "        self.group.collectives.all_reduce(squares, label=\"grad norm\")\n        norm = squares.sqrt()\n",
          "        norm = squares.sqrt()\n",
          "each rank clips by the norm of its own shards: every rank scales by a different factor"),
    Plant(ZERO, "        norm = squares.sqrt()\n", "        norm = squares\n",
          "the sum of squares taken for the norm: the norm is its square root"),
    Plant(ZERO, "        factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0)\n",
          "        factor = max_norm / (norm + 1e-6)\n",
          "clipping that also scales up: a norm below max_norm must be left alone"),
    Plant(ZERO, "            self.grad_shard(k).mul_(factor.to(self.grad_shard(k).dtype))\n        return norm\n",
          "            self.grad_shard(k).mul_(factor.to(self.grad_shard(k).dtype))\n        return norm * factor\n",
          "the norm after clipping returned: clip_grad_norm_ returns the norm the gradients had before it"),
    Plant(ZERO, "            squares += (self.grad_shard(k).double() ** 2).sum()\n",
          "            squares += (self.grad_shard(k) ** 2).sum()\n",
          "the squares summed in the gradients' dtype: float32 shards give a norm good to about 1e-7, where the "
          "contract says float64 whatever the gradients' dtype", new=True),
    Plant(ZERO, "        squares = torch.zeros((), dtype=torch.float64)\n",
          "        squares = torch.zeros((), dtype=self.grad_shard(0).dtype)\n",
          "the sum of squares kept in the gradients' dtype: float32 for float32 gradients, and the norm returned "
          "is float32 where the contract says a float64 0-d tensor", new=True),
    Plant(ZERO, """        works = [self.group.collectives.all_gather(self.weights[k], shard, label=f"weights {k}", async_op=True)
                 for k, shard in enumerate(self.shards)]
        for work in works:
            work.wait()""", "",
          "no all-gather: each rank has updated only its shard, the rest of its weights stay old"),
    Plant(ZERO, "        for work in works:\n            work.wait()\n", "",
          "the all-gathers never waited for: the next forward may read weights that have not arrived"),
    Plant(ZERO, "        for k, shard in enumerate(self.shards):\n            shard.grad = self.grad_shard(k)\n", "",
          "the shards' gradients never attached: AdamW skips a tensor whose .grad is None"),
    # --- the formulas ------------------------------------------------------------------------------------------
    Plant(COSTS, "    ring = 2 * (d - 1) / d\n", "    ring = (d - 1) / d\n",
          "an all-reduce sends twice a reduce-scatter's bytes: it is a reduce-scatter and an all-gather"),
    Plant(COSTS, """        sent[(axis, "reduce_scatter")] = n_microbatches * (d - 1) / d * values * b
        calls[(axis, "reduce_scatter")] = n_microbatches * n_buckets""", """        sent[(axis, "reduce_scatter")] = (d - 1) / d * values * b
        calls[(axis, "reduce_scatter")] = n_buckets""",
          "ZeRO-2 reduce-scatters every micro-step, not once a step"),
    Plant(COSTS, "    n_buckets, values = len(bucket_numels), sum(padded_numels(bucket_numels, d, stage))\n",
          "    n_buckets, values = len(bucket_numels), sum(bucket_numels)\n",
          "the padding forgotten: under ZeRO each bucket is padded to a multiple of d, and the padding is sent"),
    Plant(COSTS, "    statistics = 2 + (1 if clip and stage > 0 else 0)\n", "    statistics = 2 + (1 if clip else 0)\n",
          "a norm all-reduce counted for DDP: every rank holds every gradient, so it clips without sending"),
    Plant(COSTS, "\"optimizer\": 2 * (values if stage == 0 else shard) * b})", "\"optimizer\": 2 * values * b})",
          "AdamW's state counted whole under ZeRO: each rank keeps the moments of its shard only"),
    Plant(COSTS, "\"gradients\": (shard if stage == 2 else values) * b,",
          "\"gradients\": (shard if stage >= 1 else values) * b,",
          "ZeRO-1's gradients counted as a shard: it all-reduces, so every rank keeps them whole"),
    Plant("m14_zero.py", "    size = padded_numel // d\n    return slice(index * size, (index + 1) * size)\n",
          "    return slice(index, padded_numel, d)\n",
          "the shard dealt out in turn (every d-th value) instead of one block: the reduce-scatter delivers a block, "
          "so the optimizer steps on values whose gradients went to other members (a learner run)", new=True),
]
