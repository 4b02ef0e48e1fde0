"""Answers that a TODO asks the learner to derive, which neither its module's chapter nor its
skeleton may state (issue 26: passing means deriving). Read by tests/test_course_derive.py.

FORBIDDEN[module][function] lists, for the TODOs of `function` (as `python main.py hint` names it),
the strings that would hand the answer over: the spec strings a line must derive, the count
formula a cost function returns, the schedule a docstring used to spell out. The check compares
lower-case text with all whitespace, backticks, table bars and comment marks taken out, so
"2Lm - kept (2m - 1)" also catches "2 L m-kept(2m-1)" in a table cell or a wrapped comment. A
chapter may derive the method on a smaller or neighbouring case (chapter 13 works out the
attention half's specs; chapter 07 the shards of 10 values on 4 ranks); the hint levels
(`python main.py hint`) may hold the answers, and are not checked.

Module 11: the interleaved order's k-th forward and backward and its warm-up (chapter 11 derives
1F1B's order from arrival times and asks for the loop), DualPipeV's rounds per phase (chapter 11
derives ZB-V's phases, the neighbouring case), the executor's calls (the chapter's table of actions
says what each kind needs and who waits for it).
"""

FORBIDDEN = {
    "07": {
        # The shards of 10 values on 4 ranks are the learner's case; chapter 07 cuts 12 values on 3.
        "FlatLayout.shard": [
            "[r * s, (r + 1) * s)", "r * shard_numel", "(r + 1) * shard_numel", "rank * shard_numel",
            "rank * self.shard_numel", "rank 2 6-8", "rank 3 element 9", "rank 3 keeps 9",
        ],
        "FlatLayout.__init__": [
            "s = ceil((P + 2M) / d)", "ceil(numel / world_size)", "-(-numel // world_size)", "math.ceil",
            "rounded up", "round up", "ceiling division", "so each holds 3", "the buffer is 12 long",
            "2 zeros of padding",
        ],
        "fsdp_traffic": [
            "2Lm - kept (2m - 1)", "2 L m - kept", "kept (2m - 1)", "kept * (2 * m - 1)", "2m - 1 turns",
            "turns = 2m - 1", "Lm reduce-scatters", "3 collectives, 3 payloads", "3 per block",
            "collectives x (d - 1) x payload", "2 x d x ceil", "2 d payloads + 2 payloads",
            "d ceil((P + 2M) / d) b", "(L shard + replicated) b",
        ],
        "ShardedWeights.gather": [
            "buf.layer == layer and buf.version == self.version", "record in buf the layer and version",
            "buf.pending is what get() must wait for", "if it already holds this layer at the current version",
            "finds layer l in its buffer at the current version sends nothing",
        ],
        "ShardedWeights.get": [
            "mark the buffer IN_USE; afterwards nothing is pending", "buf.pending.wait()", "buf.pending = None",
            "buf.state = IN_USE", "leave the buffer IN_USE", "wait for it, then clear it", "state IN_USE;",
        ],
        "ShardedWeights.release": [
            "only the state changes", "keep the layer and version it remembers",
            "state becomes FREE, and nothing else changes", "resetting layer or version here",
        ],
    },
    "11": {
        "interleaved": [
            "(k // (g * v)) * g + k % g", "(k // (g*v)) g", "k // (g v)", "(k // g) % v", "(k // p) % v",
            "v - 1 - (k // g) % v", "(k // (p * v)) * p + k % p", "(v-1)g + 2(p-r-1)", "(v-1)·g + 2(p-r-1)",
            "(v - 1) * g + 2 * (p - r - 1)", "(v-1)p + 2(p-r-1)", "(v-1)·p + 2(p-r-1)", "(v - 1) * p + 2 * (p - r - 1)",
            "(v - 1) * g + 2 * (world_size - r - 1)", "(v-1)·p + 2(p-1) + 1", "(v-1)·g + (p-r-1)",
            "(v-1)g + (p-r-1)", "(v - 1) * g + (p - r - 1)", "(v-1)·g + p stage activations",
            "2(p-r-1) forwards", "each later rank counted twice", "2 per later rank",
        ],
        "dualpipev": [
            "2(p-r-1) times F(down)", "r+1 times: F(down), F(up)", "p-r-1 times: I(up)", "m-2p+r+1",
            "m - 2p + r + 1", "p-r-1 times: B(up), F(up), B(down)", "r+1 times (k = 0..r)", "(r+1)//2",
            "p-r-1 times: the oldest queued W, I(down)", "r+1 times: the oldest queued W", "2(r+1) backwards",
        ],
        "run_action": [
            'comms.recv("act", action.stage, m', 'comms.recv("grad", action.stage, m', '"act", action.stage + 1',
            '"grad", action.stage - 1', '"act" message of stage action.stage + 1',
            '"grad" message of stage action.stage - 1', "stage.forward(input, m, ys[m], n_microbatches)",
            "stage.forward(inp, m, ys[m], n_microbatches)", "the output of stage s is \"act\" of s + 1",
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
            "addmm(main_grad, dyᵀ, x, out=main_grad)", "addmm(main_grad, dy", "addmm_into(main_grad, dy",
            "torch.addmm with out=main_grad",
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
        # The spec strings of every line but the attention half's forward, which chapter 13 works out.
        "Llama2D.embed": [
            "B/d T V/t, V/t M -> B/d T M", "V/t M/d -> V/t M", "B/d T -> B/d T V/t",
        ],
        "Llama2D.ffn_half": [
            "B/d T M, F/t M -> B/d T F/t", "F/t M/d -> F/t M", "B/d T F/t, B/d T F/t -> B/d T F/t",
            "M/d F/t -> M F/t", "B/d T F/t, M F/t -> B/d T M",
        ],
        "Llama2D.loss_forward": [
            "B/d T M, V/t M -> B/d T V/t", '"{U_d} ->"', "'{U_d} ->'",
        ],
        "Llama2D.loss_backward": [
            "B/d T V/t, V/t M -> B/d T M", "B/d T V/t, B/d T M -> V/t M", "V/t M {U_d} -> V/t M/d",
            "B/d T M {U_t}, B/d T M, B/d T, M -> B/d T M {U_t}, M {U_d,t}",
        ],
        "Llama2D.ffn_half_backward": [
            "B/d T M, M F/t -> B/d T F/t", "B/d T M, B/d T F/t -> M F/t", "M F/t {U_d} -> M/d F/t",
            "F/t M {U_d} -> F/t M/d", "B/d T F/t, B/d T M -> F/t M", "B/d T F/t, F/t M -> B/d T M",
            "B/d T F/t, B/d T F/t, B/d T F/t -> B/d T F/t, B/d T F/t",
        ],
        "Llama2D.attention_half_backward": [
            "B/d T M, M K/t Q D -> B/d T K/t Q D", "B/d T M, B/d T K/t Q D -> M K/t Q D",
            "M K/t Q D {U_d} -> M/d K/t Q D", "B/d T K/t Q D, K/t Q D M -> B/d T M",
            "B/d T K/t D, K/t D M -> B/d T M", "B/d T K/t Q D, B/d T M -> K/t Q D M",
            "K/t Q D M {U_d} -> K/t Q D M/d", "K/t D M {U_d} -> K/t D M/d", "B/d T K/t D, B/d T M -> K/t D M",
        ],
        "Llama2D.embed_backward": [
            "B/d T V/t, B/d T M -> V/t M", "V/t M {U_d} -> V/t M/d",
        ],
        "step_traffic": [
            "14L + 3", "7L + 2", "4L + 2", "2 L P + 3 V' M", "L P + 2 V' M", "2 (2L + 1) + 4L + 2",
            "2L + 1 + 4L + 2", "6 (t-1)/t N s", "2 (2L+1) (d-1)/(d t) M b", "(2L+1) (t-1)/t M b",
            "3 (d-1)/(d t) P b", "8 (t-1)/t A a block",
        ],
        "state_bytes": [
            "L (P + 2M) + 2 V' M + M", "(L (P + 2 M) + 2 V' M + M) // (d t)", "twice as many AdamW moments",
            "AdamW keeps two moments", "AdamW's two moments", "exp_avg and exp_avg_sq", "a quarter of the model",
            "2 values b", "2 * values * b",
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
            'fsdp=mesh.group("d", "c")', 'replicas=mesh.group("d", "c")', "fsdp | d x c", "replicas | d x c",
            "FSDP partners are {5, 7}", "FSDP over d x c", 'FSDP over "dc"', "cut over the d c ranks",
        ],
        "LlamaStage.__init__": [
            "first over t, the way the block computes", "then the slice is laid out flat",
            "FlatLayout over d c", "1/(d c) of 1/t",
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
        ],
        "to_dtensor": [
            "wo, w_down (M, in) Shard(1)", "Shard(1): columns", "ln2, final_norm (M,) Replicate",
            "(V, M), unpadded Shard(0)", "Shard(0), unpadded", "the module docstring's table",
        ],
        "fsdp_traffic": [
            "(n - 1) P_t'/n b", "(n - 1) P_t'/n s", "n_blocks (n - 1) shard", "The module docstring has the formulas",
        ],
        "save": [
            "every rank: dcp.save(state, storage_writer=... into partial); wait; rank 0 renames",
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
