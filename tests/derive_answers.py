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

Module 11: the interleaved order's k-th forward and backward and its warm-up (chapter 11 derives 1F1B's
order, given code, from arrival times and asks for the loop), ZB-H1's and ZB-H2's warm-ups and W's held back,
ZB-V's and DualPipeV's rounds per phase (chapter 11 times ZB-V's phases for p = 3 only), the stage's halves and
the executor's calls (the chapter's table of actions says what each kind needs and who waits for it).

`python tests/test_course_derive.py` prints, per module, how many TODOs have answers listed here.
"""


class Code(tuple):
    """An answer that is code: its wordings. Only hint level 3 may state it."""


def code(*wordings: str) -> Code:
    return Code(wordings)


# Issue 36.2 rewrites every module's TODOs and hints to the rule. Until a module's rewrite lands, the
# checks of its hint levels are expected to fail (pytest's strict xfail): when a module passes them,
# take it out of the set (its tests fail while it is still listed, to say so).
HINT_LEAKS_UNTIL_REWRITE: set[str] = set()  # hint 1 states an answer, or hint 2 code
ANSWERS_NOT_IN_HINTS_UNTIL_REWRITE: set[str] = set()  # no hint level gives an answer at its level

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
        # Chapter 02 works the neighbours on the pipeline of ranks (1, 3, 5), the bytes on a (2, 3) view
        # and the meaning of 12 bytes of a (2, 3) float16 tensor.
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
    },
    "03": {
        # Chapter 03 states the game's rules and works the bookkeeping on a ring of three ranks, the
        # median of single timings on eight matrix products.
        "ping_pong": [
            ("a send forward, then a receive backward", "send_forward then recv_backward", "send forward, then receive backward"),
            ("a receive forward (+1), then a send backward", "recv_forward then send_backward"),
            code("comms.recv_backward(x.shape, x.dtype) + 1", "recv_backward(x.shape, x.dtype)"),
            code("comms.recv_forward(x.shape, x.dtype) + 1", "recv_forward(x.shape, x.dtype)"),
        ],
        "time_round_trip": [("timed on its own", "each round trip timed", "time each round trip", "times each of the next"),
                            code("statistics.median(times)"), code("ping_pong(comms, ball, 1)"),
                            code("time.perf_counter()", "perf_counter()")],
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
        # The shards of 10 values on 4 ranks are the learner's case; chapter 07 cuts 12 values on 3. The loss's divisor
        # (chapter 07 works gradient accumulation on one process), the step's counts (the Notes' forward, worked), the
        # weight source's reuse test (the turn worked with L = 4), the backward's order of calls.
        "FlatLayout.__init__": [
            ("s = ⌈numel / d⌉", "s = ceil((P + 2M) / d)", "rounded up", "round up", "ceiling division", "so each holds 3",
             "the buffer is 12 long", "2 zeros of padding"),
            code("-(-self.numel // world_size)", "ceil(numel / world_size)", "-(-numel // world_size)", "math.ceil"),
        ],
        "fsdp_traffic": [
            ("2Lm - kept (2m - 1)", "2 L m - kept", "kept (2m - 1)", "2m - 1 turns", "turns = 2m - 1", "3 collectives, 3 payloads",
             "3 per block", "2 L m - kept turns + m"),
            code("2 * L * m - kept * turns", "kept * (2 * m - 1)"),
            ("their reduce-scatters L m", "Lm reduce-scatters"),
            ("a collective sends (d - 1) payloads", "collectives x (d - 1) x payload"),
            ("(min(2, L) d shard + d outer_shard + 2 shard)", "2 x d x ceil", "2 d payloads + 2 payloads", "d ceil((P + 2M) / d) b"),
            ("(L shard + outer_shard) b", "(L shard + replicated) b"),
            ("the outer group's m each", "(outer_shard, m, m)", "the outer's m each", "m all-gathers of the outer"),
        ],
        "FSDPLlama.gather_outer": [
            ("outer_layout.views(whole)", "all-gather self.outer_shard into whole"),
        ],
        "FSDPLlama.reduce_scatter_outer": [
            ("outer_layout.flatten(OuterWeights(grads", "in the outer flat layout", "flattened by the outer layout"),
            ("outer_grad += slice i_d", "outer_grad += received"),
        ],
        "FSDPLlama.backward_blocks": [
            ("gather(l - 1) before layer l's gradient leaves", "the next gather before this layer's reduce-scatter"),
            code("self.reduce_scatter_grad(layer, grads)"),
        ],
        "FSDPLlama.reduce_scatter_grad": [
            code("self.layout.flatten(grads)"), code("reduce_scatter(received, full"),
        ],
        "FSDPLlama.finish_reduce_scatter": [
            ("grad_shard_l += received", "after the work's wait, grad_shard_l += received"),
            code("self.in_flight.work.wait()", "in_flight.work.wait()"),
        ],
        "FSDPLlama.train_step": [
            ("N_real, the real tokens of the whole global batch, counted once", "real tokens of the whole global batch",
             "divided by the real tokens of the whole", "the global batch's real tokens)"),
            code("n_tokens = real_tokens(targets)"),
        ],
        "ShardedWeights.gather": [
            code("buf.layer == layer and buf.version == self.version"),
            ("no transfer exactly when buf.layer = layer and buf.version = self.version",
             "record in buf the layer and version", "buf.pending is what get() must wait for",
             "if it already holds this layer at the current version",
             "finds layer l in its buffer at the current version sends nothing"),
        ],
        "ShardedWeights.get": [
            ("afterwards nothing is pending", "mark the buffer IN_USE; afterwards nothing is pending", "leave the buffer IN_USE",
             "wait for it, then clear it"),
            code("buf.pending.wait()"), code("buf.pending = None"), code("buf.state = IN_USE"),
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
        # The orders' index formulas and counts (chapter 11 derives 1F1B's warm-up, given code, from arrival times and
        # times ZB-V's phases for p = 3 only), the executor's messages (the chapter's table says who waits for what).
        "Action.parse": [
            code("TEXT.fullmatch(text.strip())"),
        ],
        "interleaved": [
            code("(k // (g * v)) * g + k % g", "(k // (p * v)) * p + k % p"), code("(k // g) % v", "(k // p) % v"),
            code("v - 1 - (k // g) % v"),
            ("⌊k / (g v)⌋ g + (k mod g)", "(k // (g*v)) g", "k // (g v)"),
            ("(v-1)·g + 2(p-r-1)", "(v-1)g + 2(p-r-1)", "(v-1)p + 2(p-r-1)", "(v-1)·p + 2(p-r-1)", "(v-1)·p + 2(p-1) + 1"),
            code("(v - 1) * g + 2 * (world_size - r - 1)", "(v - 1) * g + 2 * (p - r - 1)", "(v - 1) * p + 2 * (p - r - 1)"),
            ("w_r - w_(r+1) = 2", "2 per later rank", "each later rank counted twice", "2(p-r-1) forwards"),
            ("w_(p-1) = (v-1)·g", "every round-0 forward before its last stage's"),
        ],
        "zbh1": [
            ("holds back its first r W's", "defers its first r W's", "comes W(k - r) when k >= r", "lets r W's wait"),
            code("if k >= r:"),
        ],
        "zbh2": [
            ("2(p-r)-1 forwards run before it", "2(p-r)-1 of them", "first I can start at 2p-1-r", "first I starts at 2p-1-r"),
            ("w_r = min(2(p-r-1), m)", "warm-up w = min(2(p-r-1), m)"),
            code("min(2 * (p - r - 1), m)", "min(2 * (world_size - r - 1), n_microbatches)"),
            ("holds back its first 2r W's", "it holds back 2r W's", "a W when k >= 2r", "2r more units of work"),
            code("if k >= 2 * r"),
        ],
        "zbv": [
            ("2(p-r)-1 times F(down)", "2(p-r)-1 of them"), ("r times F(up), F(down)", "r turns of F(up), F(down)"),
            ("p-r times F(up), I(up), W(up)", "rank r runs p-r rounds"), ("r times I(down), I(up)",),
            ("p-r times I(down), W(down)", "down's last p-r I's"),
        ],
        "dualpipev": [
            ("1. 2(p-r-1); 2. r+1", "2(p-r-1) times F(down)", "r+1 times: F(down), F(up)"),
            ("3. p-r-1", "p-r-1 times: I(up)"), ("m-2p+r+1", "m - 2p + r + 1"),
            ("5. p-r-1", "p-r-1 times: B(up), F(up), B(down)"), ("6. r+1", "r+1 times (k = 0..r)"),
            ("⌊(r+1)/2⌋", "(r+1)//2"), ("2(r+1) backwards",),
            ("7. p-r-1; 8. r+1", "p-r-1 times: the oldest queued W, I(down)", "r+1 times: the oldest queued W"),
        ],
        "SplitStage.backward_input": [
            ("dz = dy where y > 0, else 0 (y the layer's output)", "the ReLU mask is the layer's output > 0"),
            code("torch.where(y_l > 0, dy, 0.0)", "torch.where(y > 0, dy, 0", "torch.where(outputs[index] > 0"),
        ],
        "SplitStage.backward_weight": [
            ("dW = dzᵀ x", "dW = dz^T x", "dW = dy^\\top x", "dW = dyᵀx", "dW = dyᵀ x"),
            ("db = Σ_rows dz", "\\sum_{\\text{rows}} dy", "db = Σ_rows dy"),
            code("dz.t() @ x"), code("dz.sum(0)"),
            code("param.grad = grad if param.grad is None", "if param.grad is None:"),
        ],
        "run_action": [
            code('comms.recv("act", action.stage, m'), code('comms.recv("grad", action.stage, m'),
            code('"act", action.stage + 1'), code('"grad", action.stage - 1'),
            ('"act" message of stage action.stage + 1', 'the output of stage s is "act" of s + 1',
             "stage s's output is the \"act\" of stage s+1", "send the output to the next stage"),
            ('"grad" message of stage action.stage - 1', "send the input's gradient to the stage before"),
            code("stage.forward(inp, m, ys[m], n_microbatches)", "stage.forward(input, m, ys[m], n_microbatches)"),
        ],
        "run_schedule": [
            code("wait_all(sends)"),
        ],
    },
    "12": {
        # f's operators, forward and backward, with and without sequence parallelism (chapter 12 works the conjugate
        # pair on a broadcast and a reduce; g's operators are given and run f's); the column-parallel forward's one
        # fetch and its products, the row-parallel backward's two GEMMs on the whole dy, a block's shards (their
        # ranges, a head's rows, the axis of each weight: the chapter works the heads on H = 6, K = 3, t = 3); the
        # overlap order with sequence parallelism (the chapter places dx's collective without it); the loss's other
        # two reductions and its formulas (the chapter works out z_max); the traffic counts (the chapter counts the
        # forward's all-reduces without sequence parallelism).
        "enter_tp_forward": [
            ("an all-gather along SEQUENCE_DIM", "identity, or an all-gather along the sequence",
             "forward all-gather along the sequence", "f (enter), sequence-parallel | all-gather",
             "forward identity, backward all-reduce", "f (enter) | before the column-parallel linears | identity"),
            ("without sequence parallelism, nothing: x is whole on every rank", "f's forward has nothing to do"),
            code("tp.collectives.all_gather(full, x, label, async_op=async_op, dim=SEQUENCE_DIM)"),
        ],
        "enter_tp_backward": [
            ("a reduce-scatter along SEQUENCE_DIM", "all-reduce, or reduce-scatter along the sequence",
             "backward reduce-scatter along the sequence", "all-gather along the sequence | reduce-scatter along the sequence"),
            ("the whole sum on every rank: an all-reduce", "the stream needs that sum, whole, on every rank",
             "partial gradients $dy_r W_r$"),
            code("tp.collectives.reduce_scatter(shard, dx, label, async_op=async_op, dim=SEQUENCE_DIM)",
                 "tp.collectives.all_reduce(dx, label, async_op=async_op)"),
        ],
        "column_parallel_forward": [
            ("y_i = x_whole W_iᵀ", "y_i = x_whole W_i^T", "y_i = f(x) W_i^T", "$y_r = x W_r^\\top$"),
            code("product(x_whole, w, matmul) for w in weights", "product(x_whole, w, matmul)"),
        ],
        "row_parallel_backward": [
            ("main_grad += dy_wholeᵀ x", "grows by dy_whole^T x", "adds dy_whole^T x", "dy_wholeᵀ x", "dy_whole^T x"),
            ("dx = dy_whole W",),
            code("leave_tp_backward(dy, tp, sequence_parallel, label)"),
            code("accumulate_weight_grad(main_grad, dy_whole, x, fused)"),
            code("policy_gradients(dy_whole, x, w, main_grad, matmul)"),
        ],
        "shard_block_weights": [
            ("query heads [i_t H/t, (i_t+1) H/t)", "query heads [r H/t, (r+1) H/t)"),
            ("key/value heads [i_t K/t, (i_t+1) K/t)", "key/value heads [r K/t, (r+1) K/t)"),
            ("units [i_t F/t, (i_t+1) F/t)", "hidden units [i_t F/t, (i_t+1) F/t)"),
            ("a head is head_dim consecutive rows",),
            ("wo (dim, H/t D)", "w_down (dim, F/t)"),
            ("block i_t of t equal blocks of rows", "the r-th block of out/t rows of W", "column-parallel (rows r)"),
            ("block i_t of t equal blocks of columns", "the r-th block of in/t columns of W", "row-parallel (columns r)"),
            code("chunk(tp.size, dim=dim)[tp.index]", "weight.chunk(tp.size"),
        ],
        "column_parallel_backward": [
            ("start the all-gather of x (f's forward, async) -> the input-gradient GEMMs",
             "start gathering x (sequence parallelism)", "start the all-gather of x (sequence parallelism)",
             "x's re-gather behind the input-gradient GEMMs", "re-gather of x, behind the input-gradient GEMMs",
             "x travels during the next line"),
            ("wait for x, start dx's collective (f's backward, async)", "wait for x; start dx's"),
            ("wait for dx and return it", "wait for dx, return it"),
            code("gathering = enter_tp_forward(x, tp, sequence_parallel, label, async_op=True)"),
        ],
        "vocab_parallel_cross_entropy": [
            ("log Z + z_max - z_y",), ("exp(z_v - z_max) / Z", "exp(z - z_max) / Z"),
            ("Z = Σ_v exp(z_v - z_max)", "sum exp(z - z_max)", "Σ exp(z_v - z_max)"),
            ("from its owner (the others give 0", "the target's logit, from its owner",
             "the target's logit, from the rank owning it", "(sum; the others give 0)", "contributes 0 here"),
            code('all_reduce(sum_exp, "loss sum exp")', 'all_reduce(z_y, "loss target")'),
        ],
        "embedding_forward": [
            ("owned when 0 <= local < V'/t",), code("rows[torch.where(mine, local, 0)]"),
            ("zeros for the rest", "writes zeros for the others", "zeros for the tokens it does not own"),
            code('leave_tp_forward(looked_up, tp, sequence_parallel, "embedding")', "leave_tp_forward(looked_up"),
        ],
        "embedding_backward": [
            code("grad_rows.index_add_(0, local[mine]"),
        ],
        "sum_norm_grads": [
            ("in one all-reduce", "all-reduces them once", "one all-reduce (a sum)"),
            ("one all-reduce (a sum) of all the tensors laid end to end in one flat buffer",
             "pack them into one flat tensor (torch.cat of the flattened tensors), all-reduce it, copy back"),
            code("torch.cat([g.reshape(-1) for g in norm_grads])"),
        ],
        "tp_traffic": [
            ("4L + 2 all-reduces of A",), ("6L + 3 all-gathers",), ("4L + 2 reduce-scatters",),
            ("8L + 4", "10L + 5", "4L + 2", "6L + 3"),
            ("2L + 1 in the backward", "2 per block backward", "2L + 1 all-reduces (blocks, LM head input)"),
            ("3 loss all-reduces of N s",),
        ],
        "tp_activations_by_name": [
            ("q, o (H/t) D values",), ("STREAM_NAMES kept for N/t tokens",),
        ],
    },
    "13": {
        # The spec strings of every line but the attention half's forward, which chapter 13 works out; the units'
        # schedule (the chapter prefetches a stack of layers' forward, the step's order of units is the TODO's);
        # the copy-in and copy-out of the grouped collectives (the chapter packs a 1-D case by hand); the order of a
        # two-axis gather and scatter; the costs (the chapter works the stream's term and wq's).
        "all_gather": [
            ("from the innermost axis to the outermost", "Gathering over d first joins the d blocks of one M/t block"),
            code("reversed(move.axes)"),
        ],
        "reduce_scatter": [
            ("from the outermost axis to the innermost", "Scatter over the outermost axis first"),
        ],
        "all_reduce": [
            code("x.tensor.clone()"),
        ],
        "einsum_unreduced": [
            code("frozenset(axis for dim in contracted for axis in dim.axes)"),
        ],
        "Llama2D.embed": [
            code("B/d T V/t, V/t M -> B/d T M"), code("B/d T -> B/d T V/t"),
        ],
        "Llama2D.ffn_half": [
            code("B/d T M, F/t M -> B/d T F/t"), code("B/d T F/t, B/d T F/t -> B/d T F/t"), code("B/d T F/t, M F/t -> B/d T M"),
            code("[h, w.ln2]"), "[h, LN2] gathered over t",
        ],
        "Llama2D.loss_forward": [
            code("B/d T M, V/t M -> B/d T V/t"), code('"{U_d} ->"', "'{U_d} ->'"), code("[x, top.final_norm]"),
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
            ("4L + 3", "4L + 2", "2L + 1 gathers"), ("L + 1 reduce-scatters",), ("unit_d (2 L block", "2 L block + top",
             "L block + top"), ("(d - 1) u b / (d t)",),
            ("3 all-reduces of N s", "6 (t-1)/t N s"), ("a norm weight (t - 1) M b / t", "(2L+1) (t-1)/t M b"),
            ("4L + 2 of them in each direction", "8 (t-1)/t A a block"),
        ],
        "state_bytes": [
            ("(L (P + 2 M) + 2 V' M + M) / (d t)", "L (P + 2M) + 2 V' M + M", "(L (P + 2 M) + 2 V' M + M) // (d t)"),
            ("optimizer 2 values b (AdamW's two moments)", "twice as many AdamW moments", "AdamW keeps two moments",
             "AdamW's two moments", "exp_avg and exp_avg_sq", "a quarter of the model", "2 values b"),
            code("2 * values * b"),
        ],
    },
    "14": {
        # Chapter 14 works the bucket cap on five tensors of one dtype (the order to send them left to derive), the
        # start with an all-gather's d copies, the count in flight on a weighted regression (divide by W once it and
        # the buckets' sums have arrived), a global mean over uneven slices for the clipping norm, the padding on two
        # buckets of 10 and 7 values; its ZeRO table says in words what each stage keeps and issues, not the bytes.
        # DDP's launch and global_token_count are given (their contracts would name the call).
        "assign_buckets": [
            ("then reverse", "reverse the list", "first index, descending", "descending order of their first",
             "the registration order reversed", "bucket 0 holds the last layers"),
            code("sorted(buckets, key=min, reverse=True)", "sorted(closed, key=min, reverse=True)", "key=min, reverse=True"),
        ],
        "broadcast_from_first": [
            ("contribute zeros", "contributes zeros", "x_0 + Σ_{i>0} 0", "x + 0 = x", "every other member zeroes"),
            code("if group.index != 0: t.zero_()", "t.zero_()"),
            code('group.collectives.all_reduce(t, label="broadcast")', "all_reduce(t,"),
        ],
        "DataParallel.ready": [
            ("a run of complete buckets", "k and every complete bucket after it", "every complete bucket after it"),
            code("while self.next_bucket < len(self.buckets)", "while self.next_bucket <"),
            code("self.next_bucket += 1"),
        ],
        "DataParallel.finish": [
            ("then armed again", "arm each and reset", "re-arm", "armed again, and the next bucket to send is 0"),
            code("self.complete(bucket);  bucket.arm()", "self.complete(bucket); bucket.arm()"),
            code("for i in sorted(bucket.pending)", "in sorted(bucket.pending)"),
        ],
        "train_step": [
            ("the summed gradients divided by N_real", "divide the gradients by the count",
             "divides the gradients by the count", "gradients by n_tokens", "divide every tensor of ddp.gradients()"),
            ("the summed (not averaged) token losses", "summed token losses, not their mean"),
            code('reduction="sum"'),
            code("gradient.div_(n_tokens)", "div_(n_tokens)", "div_(count", "g.div_(n"),
            code("n_tokens = int(count.wait())"),
        ],
        "DataParallelLlama.train_step": [
            ("with a divisor of 1", "a divisor of 1", "n_tokens = 1", "n_tokens=1", "n_tokens of 1"),
            code("self.forward_backward(tok, tgt, 1)", "forward_backward(tok, tgt, 1)"),
        ],
        "shard_range": [
            ("[i n, (i + 1) n)", "member i owns slice i", "the index-th of d equal consecutive pieces"),
            code("slice(index * size, (index + 1) * size)", "index * size"),
        ],
        "traffic": [
            ("2 (d-1)/d Ψ' b", "2 (d - 1) / d Ψ' b", "2 (d-1)/d Ψ b"),
            ("m (d-1)/d Ψ' b", "m (d - 1) / d Ψ' b"),
            ("in m G calls", "m G calls"),
            ("3 with clipping under ZeRO", "three with clipping under ZeRO"),
            code("2 + (1 if clip and stage > 0 else 0)"),
            code("if stage == 2: reduce_scatter", "n_microbatches * (d - 1) / d * values * b"),
        ],
        "state": [
            ("gradients Ψ' b (stages 0, 1) or Ψ' b / d (stage 2)", "Ψ' b / d", "(1 + 3/d) Ψ b"),
            ("2 Ψ' b / d", "(2 + 2/d) Ψ b"),
            code("2 (values if stage == 0 else shard)", "2 * (values if stage == 0 else shard)"),
            code("shard b if stage == 2 else values b", "(shard if stage == 2 else values) * b"),
        ],
        "ZeroDataParallel.launch": [
            ("complete bucket k − 1 first", "complete the previous bucket", "completes the bucket sent just before",
             "the previous bucket's reduce-scatter is completed"),
            ("an asynchronous reduce-scatter of the bucket's buffer", "reduce-scattered instead of all-reduced",
             "each bucket is reduce-scattered"),
            code("self.complete(self.buckets[bucket.index - 1])", "complete(self.buckets[bucket.index - 1])"),
            code("reduce_scatter(bucket.received, bucket.grads"),
        ],
        "ZeroDataParallel.clip_grad_norm_": [
            ("‖g‖² = Σ_r Σ_k ‖g_rk‖²", "each sums the squares of its shards", "sums the squares of its slices",
             "one all-reduce adds the partial sums", "norm^2 = sum over ranks"),
            code('all_reduce(squares, label="grad norm")'), code(".double() ** 2"),
        ],
        "ZeroDataParallel.step": [
            ("an asynchronous all-gather of this rank's shard into self.weights[k]", "an all-gather of the updated slices",
             "one all-gather per bucket shares the results", "then the updated shards are all-gathered"),
            code("shard.grad = self.grad_shard(k)"),
            code('all_gather(self.weights[k], shard, label=f"weights {k}", async_op=True)', "all_gather(self.weights[k]"),
        ],
    },
    "15": {
        # Chapter 15 works the zig-zag's staircase of work per chunk (the pairing is the TODO's), merges two means
        # and shifts an overflowing log-sum-exp (the lse merge is the TODO's), follows three ranks' blocks round a
        # ring (rank i's block at step s, the accumulators' hops and the count are the TODOs'), says that a gather
        # lays the ranks' tokens out in `order()` (which permutation undoes it is the TODO's) and splits a mean of
        # five numbers into pieces (the loss's divisor is the TODO's); DeepSpeed-Ulysses' backward: the principle
        # (an all-to-all's adjoint is the reverse all-to-all, as large) and Llama 3 8B's totals.
        "zigzag_pieces": [
            ("2c - 1 - i", "2c-1-i", "2c − 1 − i", "2c - 1 - index", "j + j' = 2c - 1", "j-th from the end",
             "j-th chunk from the start with the j-th from the end"),
            code("(2 * c - 1 - index) * h", "(2 * c - 1 - index) * length", "2 * c - 1 - index"),
        ],
        "merge_partials": [
            ("m + log(exp(lse_A - m) + exp(lse_B - m))", "m + log(exp(lse_A − m) + exp(lse_B − m))",
             "log(exp(lse_A) + exp(lse_B))", "log(exp(lse_1) + exp(lse_2))", "log(exp(lse) + exp(lse_block))"),
            ("o = exp(lse_A - lse) o_A + exp(lse_B - lse) o_B", "exp(lse_A − lse) o_A", "exp(lse_1 - lse) o_1",
             "exp(its lse - merged lse)"),
            code("torch.maximum(lse, lse_block)", "top + log(exp(lse - top) + exp(lse_block - top))",
                 "torch.exp(lse - merged)"),
        ],
        "RingAttention.forward": [
            ("the block of rank (i - s) mod c", "(i - s) mod c", "(i − s) mod c", "(me - s) % c"),
            ("receives the next from rank (i - 1) mod c", "receive of the next block from rank i − 1",
             "from rank i - 1 and", "to rank i + 1"),
            ("k_start >= q_start +",),
            code("(me - step) % c", "owner = (me - step)"), code("irecv(incoming, (me - 1) % c"),
        ],
        "RingAttention.backward": [
            ("c - 1 hops with the block and one more home", "c − 1 hops with the block, one home",
             "c accumulator sends per rank", "one more home", "one step behind"),
            code("sends.append((group.collectives.isend(acc", "acc += its buffer"),
        ],
        "AllGatherKVAttention.gather_kv": [
            ("the inverse permutation, order.argsort()", "index_select with its argsort"),
            code("gathered.index_select(2, layout.order().argsort())", "layout.order().argsort()"),
        ],
        "AllGatherKVAttention.forward": [
            ("offsets (q_start, 0)", "at offsets (q_start, 0)"),
            code("self.chunk, q_start, 0)"),
        ],
        "AllGatherKVAttention.backward": [
            ("the time axis in layout.order()", "in the ranks' order (layout.order()) first",
             "lay the gradients out in the ranks' order"),
            code("dkv.index_select(2, layout.order())", "full.index_select(2, layout.order())"),
        ],
        "sequence_to_heads": [
            ("cut the heads: view h as (c, h/c)", "cut along the *heads* and what arrives is laid side by side along *time*"),
            code("x.reshape(B, n, c, h // c, D).permute(2, 0, 1, 3, 4)", "permute(2, 0, 1, 3, 4)"),
        ],
        "heads_to_sequence": [
            ("cut time: view T as (c, T/c)",),
            code("x.reshape(B, c, T // c, hc, D).permute(1, 0, 2, 3, 4)", "received.permute(1, 2, 0, 3, 4)"),
        ],
        "UlyssesAttention.forward": [
            ("Copies of a key/value head sit next to each other", "each head repeated in place"),
            code("repeat_interleave(copies, dim=2)", "lse_h.reshape(B, heads // c, T).transpose(1, 2)",
                 "lse_h reshaped (B, heads // c, T)"),
        ],
        "UlyssesAttention.backward": [
            ("summed over the copies",),
            code("view(B, n, kv_heads, copies, D).sum(3)", "torch.stack((lse, delta), -1).reshape(B, heads, n, 2)"),
        ],
        "CPLlama.train_step": [
            ("every piece divides by that one count", "divided by the step's real tokens", "divides by that one global count",
             "its own sum divided by that same global count", "real_tokens(targets) of the whole global batch"),
            code("n_tokens = real_tokens(targets)", "forward_backward(tok_m, tgt_m, n_tokens)"),
        ],
        "cp_traffic": [
            ("(c - 1) KV + c dKV", "(c−1) KV + c dKV", "2(c - 1) + c sends", "3 c - 2", "3c - 2", "c sends of an accumulator",
             "c − 1 hops with its block"),
            ("13 all-to-alls", "5 forward, 8 backward"),
            ("8 all-to-alls of (c - 1)/c 2 (2 q + 2 k)", "do, dq, dk, dv backward", "do, dq, dk, dv", "dO, dQ, dK, dV",
             "2 * (2 * q + 2 * k)", "2 (2q + 2k)", "2(2q+2k)", "(8, (c - 1)",
             "what the forward sent, once more", "the forward's four all-to-alls"),
            code("(3 c - 2, 2 (c - 1) kv + c dkv)", "(3 * c - 2, 2 * (c - 1) * kv + c * dkv)"),
        ],
    },
    "16": {
        # Chapter 16 differentiates a vector divided by its length (the router's and the auxiliary loss's
        # normalisations divide by a sum), applies the capacity rule to 6 slots by hand, finds one regroup of
        # 4 rows by hand (the rule for any counts is the TODO's), states the adjoints of a permutation and of
        # an all-to-all (which exchange carries which gradient is the TODO's), finds the copies of one expert
        # on a 6-rank layout, splits a mean of five numbers, and counts one all-to-all's bytes.
        "route": [
            code("scores.gather(1, experts)", "chosen.sum(-1, keepdim=True)"),
        ],
        "route_backward": [
            ("(dw_i - Σ_j dw_j w_j) / S", "(d_weights_i - Σ_j d_weights_j w_j) / S", "d_weights / S minus",
             "dσ_l = (dσ'_l - Σ_i dσ'_i σ'_i) / Σσ"),
            ("du = σ (dσ - Σ_j dσ_j σ_j)", "σ (dσ - Σ dσ σ)"),
            code("(d_weights * weights).sum(-1, keepdim=True)", "scatter_add_(1, experts, d_chosen)"),
        ],
        "sequence_aux_loss": [
            ("λ φ_j / T", "λ φ / T", "dσ' = λ φ / T"),
            ("dσ = (dσ' - Σ_j dσ'_j σ'_j) / Σ_j σ_j", "(dσ' - rowsum(dσ' σ')) / Σσ"),
            code("repeat_interleave(seq_len, dim=0)", "moe.aux_coef * share / length"),
        ],
        "update_biases": [
            ("γ sign(share - load_j)", "γ sign(error)", "ρ_j += γ sign", "ρ_j ← ρ_j + γ sign"),
            code("torch.sign(", "loads.sum(-1, keepdim=True) / moe.n_experts - loads"),
        ],
        "plan_dispatch": [
            ("cumulative sum down the slots of one-hot rows", "one-hot of flat, cumulative sum",
             "a running count per expert gives each slot its position"),
            ("sort the kept slots by expert, stably", "sorted by expert, stably", "a sort by expert that keeps ties in place"),
            code("one_hot(flat, n_experts).cumsum(0)", "one_hot(flat, E).cumsum(0)", "stable=True"),
        ],
        "combine": [
            ("the rows written at their slots", "scatters each row to its slot", "with r(s) the row whose slot is s"),
            code("per_slot[plan.slots] = rows", "[plan.slots] = rows"),
        ],
        "combine_backward": [
            ("d row_r = w_{t,i} dy_t", "row of slot (t, i) gets w_{t,i} dy_t"),
            code("dy[plan.tokens]", "(dy_rows * rows).sum(-1)"),
        ],
        "plan_exchange": [
            ("sort by label, keeping ties in place", "sort the labels stably", "label every arriving row with its local expert"),
            ("what member s announced", "recv_splits[s] = Σ_j received[s, j]"),
            code("received.sum(1)", "repeat_interleave(received.flatten())", "torch.argsort(labels, stable=True)"),
        ],
        "return_from_experts": [
            ("inverse permutation (a scatter by the same index)", "scatter by the same permutation",
             "writing grouped at the positions π"),
            ("with the splits swapped", "sends recv_splits and receives send_splits"),
            code("arrived[exchange.regroup] = rows", "[exchange.regroup] = rows",
                 "exchange.recv_splits, exchange.send_splits"),
        ],
        "MoELayer.backward": [
            ("goes *to* the experts with `send_to_experts`", "the adjoint of return_from_experts is send_to_experts",
             "d rows go to the experts by the adjoint of the way home", "send_to_experts (the adjoint of the way back)"),
            code('send_to_experts(d_back, exchange, group, "combine backward")', "index_add_(0, plan.tokens, d_rows)"),
        ],
        "sum_gradients": [
            ("the experts' over the expert-data group", "experts' gradients over \"ed\"", "summed over \"ed\" only",
             "the experts' over the expert-data group, \"ed\""),
            code('mesh.group("ed")'),
        ],
        "MoELlama.train_step": [
            ("divides its summed cross-entropy by the real tokens of the whole global batch",
             "divided by the real tokens of the whole global batch"),
            ("records[mb L + l]", "view(m, L, E).sum(0)"),
            code("real_tokens(targets)", "forward_backward(tok, tgt, n_tokens, 1.0 / n_sequences)",
                 ".view(n_microbatches, n_layers, n_experts).sum(0)"),
        ],
        "step_cost": [
            ("2 (S_out + S_in) M b", "2(S_out+S_in)Mb"),
            ("(e - 1) E / e 8", "(e − 1) E / e · 8", "(e - 1) E / e · 8"),
            ("in 5 all-to-alls", "5 all-to-alls over", "5 calls"),
            ("of L (E/e) 3 F M b over ed", "L (E / e) 3 F M b over"),
            code("2 * (rows_out + rows_in) * M * b", "(e - 1) * E // e * 8"),
        ],
        "state_bytes": [
            ("values = Ψ_dense + L (E/e) 3 F M", "Ψ_dense + L (E/e) 3 F M", "Ψ_dense + L E/e 3 F M"),
            code("L * E // e * 3 * moe.expert_dim * cfg.dim"),
        ],
    },
    "17": {
        # Which group each message runs over, how a stage holds its weights, the collectives' calls, the loss's
        # divisor, which gradient is summed over which axis, the checkpoint's placements, the FSDP bytes, the save's
        # order and the checkpoint's cadence: the chapter works out pp and tp on rank 5, one linear split over t and
        # stored over d, gradient accumulation on one process, the sums on d alone and t alone, and wq's placement.
        "compose_groups": [
            code('fsdp=mesh.group("d", "c")'), code('replicas=mesh.group("d", "c")'),
            ("fsdp and replicas: i_d and i_c free", "fsdp | d x c", "replicas | d x c", "FSDP partners are {5, 7}",
             "FSDP over d x c", 'FSDP over "dc"', "cut over the d c ranks"),
        ],
        "LlamaStage.__init__": [
            ("first over t, the way the block computes", "then the slice is laid out flat", "FlatLayout over d c",
             "1/(d c) of 1/t"),
            code("FlatLayout(slices[0], fsdp.size)"), code("self.layout.shard(self.layout.flatten(s), fsdp.index)"),
        ],
        "LlamaStage.gather": [
            code("all_gather(full, shard", 'all_gather(full, shard, label="block 3", async_op=True)'),
            code("torch.zeros(self.layout.padded_numel, dtype=self.grad_dtype)"),
        ],
        "LlamaStage.gather_outer": [
            code("all_gather(self.outer_full, self.outer_shard"),
        ],
        "LlamaStage.reduce_scatter": [
            code("reduce_scatter(shard, full", 'reduce_scatter(shard, full, label="block 3", async_op=True)'),
        ],
        "LlamaStage.reduce_scatter_outer": [
            code("reduce_scatter(self.outer_grad, self.outer_full_grad"),
        ],
        "LlamaStage.forward": [
            code("embedding_forward(tokens, self.embedding, tp, True)"), code("column_parallel_forward(n, [self.lm_head]"),
        ],
        "LlamaStage.backward": [
            code("column_parallel_backward([saved.dlogits]"), code("embedding_backward(dh, saved.tokens"),
        ],
        "ComposedLlama.train_step": [
            ("N_real, counted once on the whole global batch", "divided by N_real", "divides its sum by N_real",
             "N_real, counted once", "counted once on the whole", "real_tokens of the global targets",
             "the real tokens of the whole step", "real_tokens(targets) on the whole global batch"),
            code("n_tokens = real_tokens(targets)"), code("stage.begin_step(n_tokens, tokens.shape[0])"),
        ],
        "ComposedLlama.finish_gradients": [
            ("summed over t, in one all-reduce", "so its shard is partial over t too", "all-reduce over t of their",
             "each normed T/t positions", "and one for the norms",
             "the final norm's part of the reduce-scattered shard is then summed over t"),
            ("A router or shared expert: Σ over d c (replicas)", "over groups.replicas, in one"),
            ("A rank's experts: Σ over module 16's ed", "stage.expert_grads over groups.expert_data",
             "all-reduce over ed"),
            code('sum_over(groups.tp, norms, "norm grads")'),
        ],
        "to_dtensor": [
            ("Shard(1) for the row-parallel wo and w_down", "wo, w_down (M, in) Shard(1)", "Shard(1): columns"),
            ("Replicate for the norms", "ln2, final_norm (M,) Replicate"),
            ("the vocabulary rows (embedding, lm_head), cut along dimension 0", "(V, M), unpadded Shard(0)",
             "Shard(0), unpadded"),
        ],
        "fsdp_traffic": [
            ("(n - 1) P_t'/n b", "n_blocks (n - 1) shard b"), ("(n - 1) P_t'/n s", "n_blocks (n - 1) shard s"),
            code("n_blocks * (n - 1) * shard * grad_dtype(dtype).itemsize"),
        ],
        "save": [
            ("three phases with a barrier between each", "rank 0 prepares, everyone saves, rank 0 renames"),
            code("dcp.save(state, storage_writer=(make_writer or dcp.FileSystemWriter)(partial))"),
            code("os.rename(partial, final)"),
        ],
        "train": [
            ("save after train_step, when k mod checkpoint_every = 0", "the step first, then the save"),
            code("(step + 1) % checkpoint_every == 0"),
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
            ("the reader's position, whose state() is already a dict of tensors", "the reader's position"),
            code('f"data.{'),
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
        # ZeRO-2 once a step from module 14's pieces; each formula's share of the mesh; the roofline of one GEMM from
        # its shape (chapter 18 works out a matrix-vector product); what of the weights' traffic hides (the
        # docstring's table gives the windows); the search's one pass.
        "data_cost": [
            ("module 14's ZeRO-2 with m = 1", "the traffic of one micro-step", "zero-2's traffic with m = 1"),
            ("ZeRO-1's state", "ZeRO-1's gradients"),
            code("micro_steps, kept = (1, 1)", "zero_state(buckets, b, size, 1)", "zero_traffic(buckets, b, size, 2, 1"),
        ],
        "axes_cost": [
            code("tp_traffic(seq, {\"t\": t}, batch // d", "tp_traffic(seq, {'t': t}, batch // d"),
            code("adjoint=True"),
        ],
        "activation_bytes": [
            code("if layout.sequence_parallel or name not in STREAM_NAMES"),
            code("size = size // dtype.itemsize + 4", "size // dtype.itemsize + 4"),
        ],
        "gemm_time": [
            ("2 rows inner cols", "2 m n k", "2mnk", "two per (row, inner, column)"),
            ("rows inner + inner cols", "rows * inner + inner * cols", "m k + k n + m n", "(mk + kn + mn)",
             "(rows + cols) inner + rows cols"),
        ],
        "step_time": [
            ("τ - min(hidden τ, w)", "min(hidden τ_op, w_op)", "tau - min(0.8 tau"),
            code("seconds - min(time_model.hidden", "min(hidden * seconds", "- min(hidden"),
            code("cost.n_calls(axis) * alpha"),
        ],
        "search": [
            code("layout.family not in best", "key not in best"),
        ],
    },
}
