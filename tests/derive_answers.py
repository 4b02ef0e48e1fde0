"""Answers that a TODO asks the learner to derive, and the levels of help that may first state them
(issue 26: passing means deriving; issue 36: the rule, docs/maintainers.md "Writing a TODO"). Read by
tests/test_course_derive.py.

FORBIDDEN[module][key] lists the answers of the TODOs that `key` names: a function as `python main.py
hint` names it ("tp_traffic", "Llama2D.embed", or a method's short name), which covers every TODO it
holds, or one TODO's exact title without its tag ("the counts' all-to-all, ..."). Each answer is
  - a string: a recipe or formula (the steps in order, the output's formula, the trick's name, the
    learner's own case worked out). The skeleton, the chapter and hint level 1 of every TODO of the
    module may not state it; hint 2 (the maths) or 3 may;
  - code("..."): a code fragment a solution line would hold (an API call with its arguments, an
    expression in the code's names, a spec string typed as is). Hint 2 may not state it either: only
    hint 3 (pseudo-code or code) may;
  - a tuple ("...", "...") or code("...", "..."): one answer in several wordings; each is looked for
    where the answer may not be, and the hints must give one of them.
Every answer must be given by its own TODO's hint levels, at its level or above (a string: hint 2 or
3; code: hint 3): the learner can always get it by asking. The check compares lower-case text with all
whitespace, backticks, table bars and comment marks taken out, so "2Lm - kept (2m - 1)" also catches
"2 L m-kept(2m-1)" in a table cell or a wrapped comment. A chapter may derive the method on a smaller
or neighbouring case (chapter 13 works out the attention half's specs; chapter 07 the shards of 10
values on 4 ranks).

Module 11: the interleaved order's k-th forward and backward and its warm-up (chapter 11 derives
1F1B's order from arrival times and asks for the loop), DualPipeV's rounds per phase (chapter 11
derives ZB-V's phases, the neighbouring case), the executor's calls (the chapter's table of actions
says what each kind needs and who waits for it).

`python tests/test_course_derive.py` prints, per module, how many TODOs have answers listed here.
"""


class Code(tuple):
    """An answer that is code: its wordings. Only hint level 3 may state it."""


def code(*wordings: str) -> Code:
    return Code(wordings)


# Issue 36.2 rewrites every module's TODOs and hints to the rule. Until a module's rewrite lands, the
# checks of its hint levels are expected to fail (pytest's strict xfail): when a module passes them,
# take it out of the set (its tests fail while it is still listed, to say so).
HINT_LEAKS_UNTIL_REWRITE = {"07", "11", "12", "13"}  # hint 1 states an answer, or hint 2 code
ANSWERS_NOT_IN_HINTS_UNTIL_REWRITE = {"07", "11", "12", "13", "14", "15", "17", "18"}  # no hint level gives an answer at its level

FORBIDDEN = {
    "01": {
        # Chapter 01 works the cut on a toy function (u = 2w, loss = u^2) and the random stream on two tensors.
        "PartTwo.__init__": [
            ("its layers, then its head", "layers first and its head last", "head created last", "the head last"),
            code("cfg.layers - cfg.layers // 2"),
        ],
        "train_step": [
            ("seeded with the received leaf's .grad", "seeded with received", "received tensor's .grad",
             "backward from hidden"),
            code("hidden.backward(received.grad)", ".backward(received.grad)"),
            code("hidden.detach().requires_grad_()", "detach().requires_grad_()"),
        ],
    },
    "02": {
        # Chapter 02 works the neighbours on the pipeline of ranks (1, 3, 5), the bytes on a (2, 3) view.
        "PipelineComms.__init__": [
            code("self.pp.ranks[index - 1]", "ranks[index - 1]", "ranks[pp.index - 1]", "ranks[self.pp.index - 1]"),
            code("self.pp.ranks[index + 1]", "ranks[index + 1]", "ranks[pp.index + 1]", "ranks[self.pp.index + 1]"),
            code("index < size - 1", "index < self.pp.size - 1"),
        ],
        "init_distributed": [
            code('dist.get_backend() == "nccl"', "get_backend() =="),
            code('os.environ.get("LOCAL_RANK", "0")'),
        ],
        "start_send": [code("dist.isend(tensor.contiguous()", "isend(tensor.contiguous()"), code("tensor.contiguous()")],
        "receive": [code("dtype=dtype or self.dtype", "dtype or self.dtype"),
                    code("torch.empty(shape, dtype=dtype or self.dtype, device=self.device)")],
    },
    "03": {
        # Chapter 03 states the game's rules and works the bookkeeping on a ring of three ranks.
        "ping_pong": [
            ("a send forward, then a receive backward", "send_forward then recv_backward", "send forward, then receive backward"),
            ("a receive forward (+1), then a send backward", "recv_forward then send_backward"),
            code("comms.recv_backward(x.shape, x.dtype) + 1", "recv_backward(x.shape, x.dtype)"),
            code("comms.recv_forward(x.shape, x.dtype) + 1", "recv_forward(x.shape, x.dtype)"),
        ],
        "time_round_trip": [code("statistics.median(times)"), code("ping_pong(comms, ball, 1)")],
    },
    "04": {
        # Chapter 04 draws 6 layers on 3 stages and a relay of 9 layers on 3 ranks; chapter 01 teaches the stream.
        "layer_range": [("[s L/S, (s + 1) L/S)", "r·L/p to (r+1)·L/p", "r L/p to"),
                        code("range(stage * per_stage, (stage + 1) * per_stage)", "stage * per_stage")],
        "ShardedMLP.__init__": [
            ("keeps only its own", "keep only its own", "keeping only this rank's", "replays the monolith's construction",
             "replay the monolith's construction", "create all 16 layers in order"),
            code("for index in range(cfg.layers)"),
        ],
        "sharded_forward": [
            code("comms.recv_forward((x.shape[0], model.hidden))", "(x.shape[0], model.hidden)"),
        ],
    },
    "05": {
        # Chapter 05 works the share on 4 rows in 2 microbatches and 1F1B's warm-up on p = 3, m = 5.
        "forward_step": [
            ("loss_i / m", "divided by m", "divided by n_microbatches", "(1/m) Σ_i loss_i", "Σ_i loss_i / m"),
            code("stage.loss(out, y_mb) / n_microbatches", "/ n_microbatches"),
            code(".requires_grad_()"),
        ],
        "backward_step": [code("out.backward(comms.recv_backward(out.shape))", "recv_backward(out.shape)"),
                          code("comms.isend_backward(inp.grad)", "isend_backward(inp.grad)")],
        "gpipe": [code("sum(out.detach() for _, out in saved)")],
        "one_f_one_b": [
            ("p - r - 1", "p − r − 1", "min(p - r - 1, m)"),
            code("comms.pp.size - comms.pp.index - 1", "pp.size - comms.pp.index - 1", "size - index - 1"),
            code("in_flight.pop(0)", ".pop(0)"),
        ],
    },
    "06": {
        # The backwards, derived: chapter 06 works each idea on a case that is no TODO's (y = x A by index, a shear's
        # transpose, the l2 normalisation, the sigmoid gate, the softmax's Jacobian, the logistic loss, a weight
        # source with three buffers, GPT-2's MLP sublayer as a chain of what each backward reads); the forwards that
        # are definitions (linear, RoPE, SwiGLU) are given; RMSNorm's r is defined by a condition to solve.
        "Matmul.backward": [
            ("dx = dy W", "dx = dy w"), ("dW = dyᵀ x", "dW = dy^T x", "dw = dy.T x"), code("dy @ w"), code("dy.t() @ x"),
        ],
        "rmsnorm_forward": [
            ("r = 1 / sqrt(mean(x^2) + eps)", "+ eps)^(-1/2)", "+ \\epsilon\\right)^{-1/2}", "x * r * weight with r"),
            code("r.unsqueeze(-1)", "r[..., None]"), code("xf.pow(2).mean"),
        ],
        "rmsnorm_backward": [
            ("g - x̂ mean(g ⊙ x̂)", "g - xhat * mean(g * xhat)", "g - x̂ mean(g x̂)"), code("(g * xhat).mean("),
        ],
        "residual_rmsnorm_backward": [
            code("return dh + dh_norm", "dh + rmsnorm_backward("),
        ],
        "rope_backward": [
            ("R(θ)ᵀ = R(-θ)", "R(-θ)", "the opposite angle", "the inverse rotation", "rotation by -"),
            ("dx1 = dy1 cos θ + dy2 sin θ", "dy1 cos + dy2 sin"), code("dy1 * cos + dy2 * sin"),
        ],
        "attention_forward": [
            ("p = exp(s - lse)", "exp(s - lse)", "exp(scores - lse"), code("torch.logsumexp(scores, dim=-1)"),
            code("vg[..., :scores.shape[-1], :]"),
        ],
        "attention_backward": [
            ("ds = p ⊙ (dp - delta)", "p * (dp - delta)", "p ⊙ (dp - δ)", "p (dp - delta)"),
            ("dq = ds k / √D", "dq = ds k / sqrt(D)"), code("dk[..., :seen, :] +="), code("dprobs - delta["),
        ],
        "swiglu_backward": [
            ("σ(g) (1 + g (1 - σ(g)))", "sig * (1 + g * (1 - sig))", "1 + g (1 - σ(g))"), code("ds * g * sig"),
        ],
        "LlamaBlock.attention_half": [
            ("RMSNorm, the q/k/v projections, RoPE, attention", "x n1 r1 q k v o lse",
             "(n1, r1) = RMSNorm(x; ln1); q = RoPE(n1 W_qᵀ)"),
        ],
        "LlamaBlock.ffn_half": [
            ("residual add + RMSNorm, gate and up projections and SwiGLU", "h n2 r2 g u s",
             "h = x + o W_oᵀ and (n2, r2) = RMSNorm(h; ln2)"),
            code('mm.prepare(swiglu_forward(g, u), store, "s")'),
        ],
        "LlamaBlock.backward": [
            ("dn2 = dg W_gate + du W_up",), ("dx is dh plus the norm's gradient of x",), code("dn2_gate + dn2_up"),
            code("dn1_q + dn1_k + dn1_v"), code("dh + dx_norm"),
        ],
        "chunked_cross_entropy": [
            ("softmax(z) - onehot(y)", "softmax - onehot", "softmax(logits) - onehot"), code("dlogits @ w_head"),
            code("dlogits.t() @ x_chunk"),
        ],
        "LlamaModel.forward_blocks": [
            ("gather(0) before the loop", "gather 0 before the loop"), code("self.weights.gather(layer + 1)"),
        ],
        "LlamaModel.backward_blocks": [
            ("gather(L - 1) before the loop", "gather the last layer before the loop"),
            code("self.weights.gather(layer - 1)"), code("self.on_block_grads(layer, grads[layer])"),
        ],
    },
    "07": {
        # The shards of 10 values on 4 ranks are the learner's case; chapter 07 cuts 12 values on 3.
        "FlatLayout.shard": [
            "[r * s, (r + 1) * s)", code("r * shard_numel"), code("(r + 1) * shard_numel"), code("rank * shard_numel"),
            code("rank * self.shard_numel"), "rank 2 6-8", "rank 3 element 9", "rank 3 keeps 9",
        ],
        "FlatLayout.__init__": [
            "s = ceil((P + 2M) / d)", code("ceil(numel / world_size)"), code("-(-numel // world_size)"), code("math.ceil"),
            "rounded up", "round up", "ceiling division", "so each holds 3", "the buffer is 12 long",
            "2 zeros of padding",
        ],
        "fsdp_traffic": [
            "2Lm - kept (2m - 1)", "2 L m - kept", "kept (2m - 1)", code("kept * (2 * m - 1)"), "2m - 1 turns",
            "turns = 2m - 1", "Lm reduce-scatters", "3 collectives, 3 payloads", "3 per block",
            "collectives x (d - 1) x payload", "2 x d x ceil", "2 d payloads + 2 payloads",
            "d ceil((P + 2M) / d) b", "(L shard + replicated) b", "(L shard + outer_shard) b",
            "(2 d shard + d outer_shard + 2 shard) b", "(outer_shard, m, m)", "the outer's m each",
            "m all-gathers of the outer", "2 L m - kept turns + m",
        ],
        "FSDPLlama.gather_outer": [
            "outer_layout.views(whole)", "all-gather self.outer_shard into whole",
        ],
        "FSDPLlama.reduce_scatter_outer": [
            "outer_layout.flatten(OuterWeights(grads", "flattened by the outer layout", "outer_grad += received",
        ],
        "ShardedWeights.gather": [
            code("buf.layer == layer and buf.version == self.version"), "record in buf the layer and version",
            "buf.pending is what get() must wait for", "if it already holds this layer at the current version",
            "finds layer l in its buffer at the current version sends nothing",
        ],
        "ShardedWeights.get": [
            "mark the buffer IN_USE; afterwards nothing is pending", code("buf.pending.wait()"), code("buf.pending = None"),
            code("buf.state = IN_USE"), "leave the buffer IN_USE", "wait for it, then clear it", "state IN_USE;",
        ],
        "ShardedWeights.release": [
            "only the state changes", "keep the layer and version it remembers",
            "state becomes FREE, and nothing else changes", "resetting layer or version here",
        ],
    },
    "08": {
        # Who records each event on which stream, and who waits for it: chapter 08 works the two events of another
        # resource (a gradient bucket all-reduced on a communication stream) and states no rule to transcribe.
        "HostWeights.__init__": [
            ("in pinned (page-locked) host memory",), ("a side stream of its own",),
            code("runtime.pin(self.layout.flatten(b))"), code("self.copy_stream = runtime.new_stream()"),
        ],
        "HostWeights.gather": [
            ("wait for buf.released", "waits for buf.released", "wait for `released`"),
            ("record buf.ready", "records buf.ready", "record `ready`"),
            code("self.copy_stream.wait_event(buf.released)"), code("buf.ready.record(self.copy_stream)"),
        ],
        "HostWeights.get": [
            ("the compute stream waits for buf.ready", "wait for `ready`", "compute stream wait for buf.ready"),
            code("self.compute_stream.wait_event(buf.ready)"),
        ],
        "HostWeights.release": [
            ("record buf.released on the compute stream", "records `released` on the compute stream"),
            ("the stream that does the work it stands for", "recorded on the stream that does the work"),
            code("buf.released.record(self.compute_stream)"),
        ],
        "HostWeights.invalidate": [
            ("the host waits for the copy stream", "synchronize the copy stream"), code("self.copy_stream.synchronize()"),
            code("self.version += 1"),
        ],
    },
    "09": {
        # The scale, the strides and the operands: chapter 09 works symmetric int8's scale (127 / amax), the
        # layouts of attention's two products (q k^T, p v) and a delayed scale's abs-max (the bytes follow the abs-max
        # handed to quantize); the weight cache's version check is given.
        "quantize": [
            ("FP8_MAX / amax", "FP8_MAX[dtype] / amax"), ("scale = 1 / factor", "the factor's inverse"),
            code("amax.new_tensor(FP8_MAX[dtype]) / amax"), code(".clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype)"),
        ],
        "check_scaled_mm_operands": [
            ("row-major: stride 1 along dimension 1",), code("a.stride(1) != 1"), code("b.stride(0) != 1"),
        ],
        "FP8Matmul.prepare": [
            ("the store's, if it has one", "looks for one in the store first", "if the store already holds that abs-max"),
            code("store[key] if key in store else abs_max(x)", "store[amax_name] if amax_name in store else abs_max(x)"),
            code("x.numel() // x.shape[-1]"),
        ],
        "FP8Matmul.forward": [
            code("self.weights.row_major(w).t()"),
        ],
        "FP8Matmul.backward": [
            code("self.quantize(dy, E5M2)"), code("self.weights.column_major(w)"), code("row_major(dy_fp8.t())"),
            code("column_major(x_fp8)"),
        ],
    },
    "10": {
        # The widths and the reruns: chapter 10 counts a GPT-2 style MLP block's saved bytes and works out which of
        # its ops a dropped tensor needs again; new_store (a set expression its contract stated) is given.
        "activation_bytes": [
            ("k, v: K D", "k and v: K D"), ("lse: H statistics", "lse: H s"), ("r1, r2: one statistic",),
            code('"lse": cfg.n_heads * stat', "lse=cfg.n_heads * stat"), code('"k": kv * act', "k=kv * act"),
        ],
        "RecomputeBlock.recompute": [
            ("only attention_half makes q, k, v, o and lse",), ("only ffn_half makes h",),
            code('if missing & {"q", "k", "v", "o", "lse"}', 'missing & {"q", "k", "v", "o", "lse"}'),
            code('self.ffn_half(w, x, fresh["o"], fresh)'),
        ],
    },
    "11": {
        "interleaved": [
            code("(k // (g * v)) * g + k % g"), "(k // (g*v)) g", "k // (g v)", code("(k // g) % v"), code("(k // p) % v"),
            code("v - 1 - (k // g) % v"), code("(k // (p * v)) * p + k % p"), "(v-1)g + 2(p-r-1)", "(v-1)·g + 2(p-r-1)",
            code("(v - 1) * g + 2 * (p - r - 1)"), "(v-1)p + 2(p-r-1)", "(v-1)·p + 2(p-r-1)", code("(v - 1) * p + 2 * (p - r - 1)"),
            code("(v - 1) * g + 2 * (world_size - r - 1)"), "(v-1)·p + 2(p-1) + 1", "(v-1)·g + (p-r-1)",
            "(v-1)g + (p-r-1)", code("(v - 1) * g + (p - r - 1)"), "(v-1)·g + p stage activations",
            "2(p-r-1) forwards", "each later rank counted twice", "2 per later rank",
        ],
        "dualpipev": [
            "2(p-r-1) times F(down)", "r+1 times: F(down), F(up)", "p-r-1 times: I(up)", "m-2p+r+1",
            "m - 2p + r + 1", "p-r-1 times: B(up), F(up), B(down)", "r+1 times (k = 0..r)", "(r+1)//2",
            "p-r-1 times: the oldest queued W, I(down)", "r+1 times: the oldest queued W", "2(r+1) backwards",
        ],
        "run_action": [
            code('comms.recv("act", action.stage, m'), code('comms.recv("grad", action.stage, m'), code('"act", action.stage + 1'),
            code('"grad", action.stage - 1'), '"act" message of stage action.stage + 1',
            '"grad" message of stage action.stage - 1', code("stage.forward(input, m, ys[m], n_microbatches)"),
            code("stage.forward(inp, m, ys[m], n_microbatches)"), "the output of stage s is \"act\" of s + 1",
            "stage s's output is the \"act\" of stage s+1", "send the input's gradient to the stage before",
            "send the output to the next stage",
        ],
    },
    "12": {
        # The conjugate operators: which collective each runs, forward and backward, with and without
        # sequence parallelism (chapter 12 derives f's backward without it).
        "enter_tp_forward": [
            "identity, or an all-gather along the sequence", "forward all-gather along the sequence",
            "f (enter), sequence-parallel | all-gather", "f (enter) | before the column-parallel linears | identity",
            "forward identity, backward all-reduce",
        ],
        "enter_tp_backward": [
            "all-reduce, or reduce-scatter along the sequence", "backward reduce-scatter along the sequence",
            "all-gather along the sequence | reduce-scatter along the sequence",
        ],
        "leave_tp_forward": [
            "g forward: all-reduce", "forward reduce-scatter along the sequence",
            "g (leave), sequence-parallel | reduce-scatter", "| all-reduce: sum the partials | identity",
            "forward all-reduce, backward identity",
        ],
        "leave_tp_backward": [
            "identity, or an all-gather along the sequence", "backward all-gather along the sequence",
            "reduce-scatter along the sequence | all-gather along the sequence", "every rank's partial gets dy",
            "every rank's partial receives dy itself", "an all-reduce here would add the t identical copies",
            "in g's backward (the gradient does)",
        ],
        "column_parallel_backward": [
            "start gathering x (sequence parallelism)", "start the all-gather of x (sequence parallelism)",
            "wait for x; start dx's", "wait for dx, return it", "x travels during the next line",
            "re-gather of x, behind the input-gradient GEMMs", "x's re-gather behind the input-gradient GEMMs",
        ],
        "accumulate_weight_grad": [
            code("addmm(main_grad, dyᵀ, x, out=main_grad)"), code("addmm(main_grad, dy"), code("addmm_into(main_grad, dy"),
            code("torch.addmm with out=main_grad"),
        ],
        "vocab_parallel_cross_entropy": [
            "log Z + z_max - z_y", "exp(z - z_max) / Z", "exp(z_v - z_max) / Z", "sum exp(z - z_max)",
            "Σ exp(z_v - z_max)", "the target's logit, from its owner", "the target's logit, from the rank owning it",
            "(sum; the others give 0)", "contributes 0 here",
        ],
        "tp_traffic": [
            "4L + 2", "6L + 3", "8L + 4", "10L + 5", "2L + 1 all-reduces (blocks, LM head input)",
            "2 per block backward", "4L + 2 all-gathers",
        ],
    },
    "13": {
        # The spec strings of every line but the attention half's forward, which chapter 13 works out; the units'
        # schedule (the chapter prefetches a stack of layers' forward, the step's order of units is the TODO's);
        # the copy-in and copy-out of the grouped collectives (the chapter packs a 1-D case by hand).
        "Llama2D.embed": [
            code("B/d T V/t, V/t M -> B/d T M"), code("B/d T -> B/d T V/t"),
        ],
        "Llama2D.ffn_half": [
            code("B/d T M, F/t M -> B/d T F/t"), code("B/d T F/t, B/d T F/t -> B/d T F/t"), code("B/d T F/t, M F/t -> B/d T M"),
            code("[h, w.ln2]"), "[h, LN2] gathered over t",
        ],
        "Llama2D.loss_forward": [
            code("B/d T M, V/t M -> B/d T V/t"), code('"{U_d} ->"'), code("'{U_d} ->'"), code("[x, top.final_norm]"),
        ],
        "Llama2D.loss_backward": [
            code("B/d T V/t, V/t M -> B/d T M"), code("B/d T V/t, B/d T M -> V/t M"), code("M {U_d,t} -> M/t {U_d}"),
            code("B/d T M {U_t}, B/d T M, B/d T, M -> B/d T M {U_t}, M {U_d,t}"), code("[dxf, d_norm]"),
        ],
        "Llama2D.ffn_half_backward": [
            code("B/d T M, M F/t -> B/d T F/t"), code("B/d T M, B/d T F/t -> M F/t"), code("B/d T F/t, B/d T M -> F/t M"),
            code("B/d T F/t, F/t M -> B/d T M"), code("B/d T F/t, B/d T F/t, B/d T F/t -> B/d T F/t, B/d T F/t"),
            code("[dy, w.ln2]"), code("[dhg, d_ln2]"),
        ],
        "Llama2D.attention_half_backward": [
            code("B/d T M, M K/t Q D -> B/d T K/t Q D"), code("B/d T M, B/d T K/t Q D -> M K/t Q D"),
            code("B/d T K/t Q D, K/t Q D M -> B/d T M"), code("B/d T K/t D, K/t D M -> B/d T M"),
            code("B/d T K/t Q D, B/d T M -> K/t Q D M"), code("B/d T K/t D, B/d T M -> K/t D M"), code("[dh, w.ln1]"),
            code("[dxg, d_ln1]"),
        ],
        "Llama2D.embed_backward": [
            code("B/d T V/t, B/d T M -> V/t M"),
        ],
        "Llama2D.forward_backward": [
            code("start_gather(self.blocks[layer + 1]"), code("start_gather(self.blocks[layer - 1]"), code("self.start_gather(self.blocks[-1]"),
            "blocks 0 .. L-1, (top: loss, kept), blocks L-1 .. 0", "unit k + 1's gather is started before unit k's",
        ],
        "start_all_gather": [
            code("torch.cat([x.tensor.reshape(-1) for x in xs])"), code("row.new_empty(n"), "row = its blocks flattened, end to end",
        ],
        "start_reduce_scatter": [
            code("x.tensor.chunk(n, dim=move.dim)"), code("torch.stack(b).reshape(n, -1)"), "row j = every tensor's block j",
        ],
        "finish": [
            code("row[offset:offset + n]"), code("torch.cat(pieces, dim=dim)"), code("pending.work.wait()"),
            "o_i = sum of numel before i",
        ],
        "step_traffic": [
            "4L + 3", "4L + 2", "2L + 1 gathers", "L + 1 reduce-scatters", "2 L block + top", "L block + top",
            "unit_d (2 L block", "(d - 1) u b / (d t)", "6 (t-1)/t N s", "(2L+1) (t-1)/t M b", "8 (t-1)/t A a block",
        ],
        "state_bytes": [
            "L (P + 2M) + 2 V' M + M", "(L (P + 2 M) + 2 V' M + M) // (d t)", "twice as many AdamW moments",
            "AdamW keeps two moments", "AdamW's two moments", "exp_avg and exp_avg_sq", "a quarter of the model",
            "2 values b", code("2 * values * b"),
        ],
    },
    "14": {
        # Chapter 14 works the count in flight on a weighted regression (divide by W once it and the buckets'
        # sums have arrived); the learner's token count is the case left to derive.
        "train_step": [
            "loss / count", "(loss / count).backward()", "gradient.div_(", "div_(n_tokens)", "div_(count",
            "divide the gradients by the count", "divides the gradients by the count", "gradients by n_tokens",
            "n_tokens = int(count.wait())", "divide every tensor of ddp.gradients()",
        ],
        "DataParallelLlama.train_step": [
            "forward_backward(tok, tgt, 1)", "n_tokens = 1", "n_tokens=1", "n_tokens of 1", "self.forward_backward(tok, tgt, 1)",
        ],
    },
    "15": {
        # DeepSpeed-Ulysses' backward: chapter 15 states the principle (an all-to-all's adjoint is the reverse
        # all-to-all, as large) and the totals for Llama 3 8B; which all-to-alls and their bytes are the TODO's.
        "cp_traffic": [
            "do, dq, dk, dv", "dO, dQ, dK, dV", "2 * (2 * q + 2 * k)", "2 (2q + 2k)", "2(2q+2k)", "8 all-to-alls",
            "eight all-to-alls", "(8, (c - 1)", "what the forward sent, once more", "the forward's four all-to-alls",
        ],
    },
    "17": {
        # Which group each message runs over, the loss's divisor, which gradient is summed over which axis,
        # the checkpoint's placements, the FSDP bytes and the save's order: the chapter works out pp and tp on
        # rank 5, gradient accumulation on one process, the sums on d alone and t alone, and wq's placement.
        "compose_groups": [
            code('fsdp=mesh.group("d", "c")'), code('replicas=mesh.group("d", "c")'), "fsdp | d x c", "replicas | d x c",
            "FSDP partners are {5, 7}", "FSDP over d x c", 'FSDP over "dc"', "cut over the d c ranks",
        ],
        "LlamaStage.__init__": [
            "first over t, the way the block computes", "then the slice is laid out flat",
            "FlatLayout over d c", "1/(d c) of 1/t", "outer_layout and outer_shard from outer, as for a slice",
        ],
        "ComposedLlama.train_step": [
            "divided by N_real", "divides its sum by N_real", "N_real, counted once", "counted once on the whole",
            "real_tokens of the global targets", "real_tokens(targets) on the whole global batch",
            "the real tokens of the whole step",
        ],
        "ComposedLlama.finish_gradients": [
            "summed over t, in one all-reduce", "so its shard is partial over t too", "all-reduce over t of their",
            "all-reduce over t, and over dc", "over groups.replicas, in one", "stage.expert_grads over groups.expert_data",
            "all-reduce over ed", "each normed T/t positions", "and one for the norms",
            "the final norm's part of the reduce-scattered shard is then summed over t",
            "(stage.outer_grad, stage.outer_norms) for every stage",
        ],
        "to_dtensor": [
            "wo, w_down (M, in) Shard(1)", "Shard(1): columns", "ln2, final_norm (M,) Replicate",
            "(V, M), unpadded Shard(0)", "Shard(0), unpadded", "the module docstring's table",
        ],
        "fsdp_traffic": [
            "(n - 1) P_t'/n b", "(n - 1) P_t'/n s", "n_blocks (n - 1) shard", "The module docstring has the formulas",
        ],
        "save": [
            code("every rank: dcp.save(state, storage_writer=... into partial); wait; rank 0 renames"),
        ],
    },
    "19": {
        # The statistics (chapter 19 shows a robust summary on nine timings of a matrix product), the data
        # position (a playlist shuffled every time it ends), the staging wait (a renderer's copy of the world),
        # Young's balance (the economic order quantity) and Daly's series (x + eps x^2 = 1).
        "step_timeout": [
            ("slack x the median", "slack * the median", "the median step time", "median of the steps",
             "median of the measured"),
            code("quantile(0.5)", "statistics.median(step_times)", "median(step_times)"),
        ],
        "stragglers": [
            ("the median of per_rank", "median of per_rank", "median over the ranks", "median of the ranks",
             "median of each rank", "median over its steps", "median of its steps"),
            code("quantile(0.5, dim=1)", "median(dim=1)", "per_rank.quantile"),
        ],
        "ShuffledSequences.state": [
            ("the epoch and the position in it", "the epoch and the position", "epoch and position in it",
             "the epoch and its position"),
            code('"epoch": torch.tensor(self.epoch)'),
        ],
        "ShuffledSequences.restore": [
            ("draws the orders of epochs 0, 1, ..., e", "draws epoch + 1 orders", "draws epoch + 1", "epoch + 1 orders", "draw_order() once for every epoch"),
            code("range(epoch + 1)"),
        ],
        "AsyncCheckpointer.save": [
            ("a future can run a function of yours when it completes", "self.wait() first"),
            code("add_done_callback(lambda", "written.add_done_callback"),
        ],
        "AsyncCheckpointer.before_update": [
            ("the update may run once the copy is complete", "wait for the copy, not for the write",
             "only the copy must be waited for"),
            code("staged.result()"),
        ],
        "training_state": [
            ("the sampler's state (a dict of tensors) under names of its own", "the sampler's state, under names of its own"),
            code('f"data.{'),
        ],
        "train": [
            code("[0.0] * start", "sampler.restore({"),
        ],
        "expected_goodput": [
            ("τ_mtbf exp(τ_restart / τ_mtbf) (exp((τ_interval + τ_save) / τ_mtbf) - 1)", "exp(restart_cost / mtbf)",
             "e^{R/M}", "exp(R/M)", "e^(R/M)", "exp(τ_restart/τ_mtbf)", "M e^{R/M}"),
            code("math.expm1(segment / mtbf)"),
        ],
        "young_interval": [
            ("sqrt(2 τ_save τ_mtbf)", "√(2δM)", "sqrt(2δM)", "√(2 δ M)", "sqrt(2 δ M)", "√(2 τ_save τ_mtbf)",
             "√(2 T_s T_f)", "sqrt(2 T_s T_f)", "√(2 T_s/λ)", "τ / (2 τ_mtbf)", "half an interval on average"),
            code("sqrt(2 * save_cost * mtbf)"),
        ],
        "daly_interval": [
            ("sqrt(ξ)/3 + ξ/9", "√ξ/3", "ξ/9", "1 + (1/3)", "(1/9)", "sqrt(ξ)/3", "√(δ/2M)", "sqrt(δ/(2M))", "δ/(2M)",
             "it cannot move the maximum"),
            code("sqrt(xi) / 3", "xi / 9"),
        ],
    },
    "18": {
        # ZeRO-2 once a step from module 14's pieces; the roofline of one GEMM from its shape (chapter 18 works out
        # a matrix-vector product); what of the weights' traffic hides (the docstring's table gives the windows).
        "data_cost": [
            "ZeRO-1's state", "ZeRO-1's gradients", "zero_state(buckets, b, size, 1)", "zero_traffic(buckets, b, size, 2, 1",
            "micro_steps, kept = (1, 1)", "the traffic of one micro-step", "module 14's ZeRO-2 with m = 1",
        ],
        "gemm_time": [
            "2 rows inner cols", "2 * rows * inner * cols", "rows inner + inner cols", "rows * inner + inner * cols",
            "2 m n k", "2mnk", "(mk + kn + mn)", "m k + k n + m n", "(rows + cols) inner + rows cols",
        ],
        "step_time": [
            "τ - min(hidden τ, w)", "min(hidden * seconds", "min(time_model.hidden", "tau - min(0.8 tau",
            "seconds - min(", "- min(hidden",
        ],
    },
}
