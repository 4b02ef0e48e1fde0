"""`python main.py run 17 [--mesh p=2,d=2,t=2] [--steps 600] [--fp8] [--resume DIR] [--trace PREFIX]`: train the tiny
Llama on characters of Shakespeare with every parallelism of the course on one mesh (8 ranks by
default: 2 pipeline stages x 2 data shards x 2 tensor slices), with a progress bar, a validation loss,
a checkpoint every --checkpoint-every steps (torch.distributed.checkpoint, one directory per step),
a loss plot, and text sampled at the end from the checkpoint loaded into one process."""
import argparse
import json
import math
import time
from datetime import datetime
from pathlib import Path

import torch

from course import RESULTS
from course.arguments import MAX_SEED, check_count, check_counts, check_folder_writable, check_number
from course.chars import load_chars
from course.demos import printable
from course.impl import load, reference
from course.mesh import check_mesh, init_mesh, parse_mesh
from course.progress import ProgressBar

TIMEOUT_S = 3600.0  # the run's default --timeout: the real run takes about 10 minutes on 2 cores
SCHEDULES = ("gpipe", "1f1b", "interleaved")  # the Llama stage has no I/W split (zero-bubble schedules need one)
PROMPT = "MENENIUS:\n"
VALIDATION_FILE = "validation.json"  # in the run's directory: [[step, loss], ...], for the plot of a resumed run


def add_args(parser: argparse.ArgumentParser):
    parser.add_argument("--mesh", default="p=2,d=2,t=2",
                        help="axis=size pairs over p, d, c, t (and e with --experts); their product is --nproc "
                             "(default p=2,d=2,t=2)")
    parser.add_argument("--steps", type=int, default=600, help="training steps (default 600)")
    parser.add_argument("--batch", type=int, default=16, help="global batch B, sequences of --seq-len (default 16)")
    parser.add_argument("--microbatches", type=int, default=4, help="m, microbatches a step (default 4)")
    parser.add_argument("--schedule", default="1f1b", help=f"the pipeline's: {', '.join(SCHEDULES)} (default 1f1b)")
    parser.add_argument("--stages-per-rank", type=int, default=2, help="v, for interleaved (default 2)")
    parser.add_argument("--variant", default="zigzag",
                        help="context parallelism's attention (c > 1): ring, zigzag, allgather, ulysses (default zigzag)")
    parser.add_argument("--layers", type=int, default=4, help="blocks L (default 4)")
    parser.add_argument("--dim", type=int, default=128, help="width M, 4 query heads of M/4 (default 128)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens a sequence, T (default 128)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW's learning rate (default 3e-3)")
    parser.add_argument("--seed", type=int, default=0, help="the weights' and the batches' seed (default 0)")
    parser.add_argument("--experts", type=int, default=0,
                        help="E > 0: module 16's MoE blocks with E experts, top-2, over the mesh's e (default 0: dense)")
    parser.add_argument("--recompute", action="store_true",
                        help="module 10's block recompute: each block keeps its input only and reruns its forward "
                             "in the backward")
    parser.add_argument("--fp8", action="store_true",
                        help="module 09's FP8Matmul in every block's linears (on CPU emulated in float32 by module 09's scaled_mm)")
    parser.add_argument("--eval-every", type=int, default=100, help="a validation loss every N steps (default 100)")
    parser.add_argument("--checkpoint-every", type=int, default=200, help="a checkpoint every N steps (default 200)")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="where this run's step_NNNNNN/ directories go (default results/m17_runs/<date-time>)")
    parser.add_argument("--resume", default=None,
                        help="continue the run in DIR (a --checkpoint-dir) from its latest complete checkpoint, "
                             "on this mesh (any mesh the model fits)")
    parser.add_argument("--sample", type=int, default=300, help="characters to sample at the end (default 300)")
    parser.add_argument("--trace", default=None,
                        help="also time one more step of every rank: PREFIX.json (Perfetto) and PREFIX.png")


def default_world_size(args) -> int:
    """--nproc's default: the mesh's product (a mesh given once is enough); e is carved out of d x c."""
    return math.prod(size for axis, size in parse_mesh(args.mesh).items() if axis != "e")


def mesh_sizes(args) -> dict[str, int]:
    return reference("m17_composition").full_sizes(parse_mesh(args.mesh))


def config(args, vocab_size: int):
    """The tiny Llama: 4 query and 2 key/value heads, FFN 11 M / 4 (352 for M = 128: t up to 4 divides it)."""
    LlamaConfig = reference("m06_llama_block").LlamaConfig
    return LlamaConfig(dim=args.dim, n_heads=4, n_kv_heads=2, head_dim=args.dim // 4, ffn_dim=args.dim * 11 // 4,
                       n_layers=args.layers, max_seq_len=args.seq_len, vocab_size=vocab_size)


def moe_config(args):
    if not args.experts:
        return None
    return reference("m16_router").MoEConfig(n_experts=args.experts, top_k=min(2, args.experts),
                                             expert_dim=args.dim * 11 // 8, aux_coef=0.01)


def check_args(args):
    """One line for a bad option, mesh or checkpoint, before any rank starts (the given checks)."""
    check_counts(args, "steps", "batch", "microbatches", "layers", "seq_len", "eval_every", "checkpoint_every",
                 "stages_per_rank", "dim")
    check_counts(args, "sample", "experts", low=0)
    check_number(args.lr, "--lr")  # nan, -1 or inf: every step's update would be nonsense, found minutes later
    check_count(args.seed, "--seed", 0, MAX_SEED)
    if args.dim < 8 or args.dim % 8:
        raise ValueError(f"--dim {args.dim}: the model has 4 heads of an even width, so --dim must be a multiple of 8")
    if args.schedule not in SCHEDULES:
        raise ValueError(f"--schedule {args.schedule!r}: the Llama stage runs {', '.join(SCHEDULES)} (the zero-bubble "
                         f"schedules need the backward split into I and W, which this stage does not have)")
    sizes = parse_mesh(args.mesh)
    check_mesh(sizes, args.world_size)
    sizes = mesh_sizes(args)
    text = load_chars()
    cfg, moe = config(args, text.vocab_size), moe_config(args)
    if moe is None and "e" in sizes:
        raise ValueError("the mesh has an axis e: pass --experts E for the MoE model (dense blocks have no experts)")
    if moe is not None:
        reference("m17_moe_stage").check_moe_mesh(sizes, moe, args.recompute, args.fp8)
    reference("m11_generators").check_arguments(args.schedule, sizes["p"], args.microbatches, args.stages_per_rank)
    v = reference("m11_generators").stages_per_rank_of(args.schedule, args.stages_per_rank)
    reference("m17_composition").check_composition(cfg, sizes, args.batch, args.microbatches, v,
                                                   moe.n_experts if moe else None)
    if args.fp8:
        reference("m17_composition").check_fp8(cfg, sizes, args.batch, args.microbatches)
    if sizes["c"] > 1:
        reference("m15_cp_model").check_cp(cfg, args.variant, sizes["c"], args.seq_len)
        if args.variant == "ulysses":
            reference("m15_ulysses").check_ulysses(cfg.n_heads // sizes["t"], cfg.n_kv_heads // sizes["t"], sizes["c"])
    checkpoints = reference("m17_checkpoint")
    if args.resume:
        latest = checkpoints.latest_checkpoint(args.resume)
        if latest is None:
            inside = Path(args.resume).parent
            hint = (f": --resume takes the run's directory, {inside}, and continues from its latest step"
                    if checkpoints.STEP_DIR.fullmatch(Path(args.resume).name) else "")
            raise ValueError(f"--resume {args.resume}: no complete checkpoint (step_NNNNNN/) there{hint}")
        checkpoints.check_checkpoint(latest, cfg, text.chars, moe)
        if int(latest.name.removeprefix("step_")) >= args.steps:
            raise ValueError(f"--resume {args.resume}: its latest checkpoint is {latest.name}, at or beyond --steps "
                             f"{args.steps}: ask for more steps")
        args.checkpoint_dir, option = args.resume, "--resume"
    elif args.checkpoint_dir is None:
        args.checkpoint_dir = str(RESULTS / "m17_runs" / datetime.now().strftime("%Y%m%d-%H%M%S"))
        option = "the checkpoints' default folder (give --checkpoint-dir another)"
    elif checkpoints.latest_checkpoint(args.checkpoint_dir) is not None:
        raise ValueError(f"--checkpoint-dir {args.checkpoint_dir} holds an earlier run's checkpoints: continue it with "
                         f"--resume {args.checkpoint_dir}, or give another directory")
    else:
        option = "--checkpoint-dir"
    # The first checkpoint comes after minutes of training: a folder that cannot take it is refused now.
    check_folder_writable(args.checkpoint_dir, option)


def earlier_validation(run_dir, until: int) -> list[tuple[int, float]]:
    """The validation points the run in `run_dir` recorded up to step `until` (the checkpoint it resumes
    from: later ones are computed again); none if there is no record to read."""
    try:
        recorded = json.loads((Path(run_dir) / VALIDATION_FILE).read_text())
        return [(int(step), float(loss)) for step, loss in recorded if step <= until]
    except (OSError, ValueError, TypeError):
        return []


def sample(model, text, prompt: str, n: int, seed: int, temperature: float = 0.8) -> str:
    """n characters after `prompt` from a single-process model (module 06's), a window of T at a time."""
    generator = torch.Generator().manual_seed(seed)
    ids = text.encode(prompt).unsqueeze(0)
    for _ in range(n):
        logits = model.next_token_logits(ids[:, -model.cfg.max_seq_len:])
        probs = torch.softmax(logits.double() / temperature, dim=-1)
        ids = torch.cat([ids, torch.multinomial(probs, 1, generator=generator)], dim=1)
    return text.decode(ids[0])


def plot_losses(losses, validation, path: Path, title: str):
    from matplotlib.figure import Figure
    figure = Figure(figsize=(8, 4.5))
    ax = figure.add_subplot()
    ax.plot(range(1, len(losses) + 1), losses, lw=0.8, label="training loss (each step's batch)")
    if validation:
        ax.plot(*zip(*validation), "o-", label="validation loss (the last 10% of the text)")
    ax.axhline(math.log(62), color="0.6", ls=":", label="log V: a uniform guess")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per character)")
    ax.set_title(title)
    ax.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)


def describe_mesh(mesh, model):
    g = model.groups
    lines = [f"  rank 0's groups: pp {g.pp.ranks} (pipeline neighbours), fsdp {g.fsdp.ranks} (FSDP shards), replicas "
             f"{g.replicas.ranks} (replicated gradients), tp {g.tp.ranks} (tensor and sequence parallel), cp "
             f"{g.cp.ranks} (attention's ring)"]
    if g.experts is not None:
        lines.append(f"  experts {g.experts.ranks}, their gradients over expert_data {g.expert_data.ranks}")
    stage = next(iter(model.stages.values()))
    lines.append(f"  rank 0 holds stage(s) {list(model.stages)} of {model.schedule.n_stages} ({model.schedule.name}): "
                 f"blocks {[list(s.layers) for s in model.stages.values()]}, each a t slice in {stage.layout.padded_numel:,} "
                 f"values, {stage.layout.shard_numel:,} of them kept (1/{g.fsdp.size}); messages of "
                 f"{stage.hidden} values a row (T/(c t) = {stage.stream_len} positions)")
    return "\n".join(lines)


def demo(args):
    m02, trainer, run = load("m02_comms"), load("m17_trainer"), load("m17_run")
    checkpoints = reference("m17_checkpoint")  # loading into one process, to sample: given code
    rank, world_size, _ = m02.init_distributed(backend="gloo")
    torch.set_num_threads(1)
    text = load_chars()
    cfg, moe, sizes = config(args, text.vocab_size), moe_config(args), mesh_sizes(args)
    mesh = init_mesh(sizes)
    model = trainer.ComposedLlama(cfg, mesh, args.microbatches, args.schedule, args.stages_per_rank, args.seed,
                                  torch.float32, args.variant, moe, recompute=args.recompute, fp8=args.fp8)
    tokens_per_step = args.batch * cfg.max_seq_len
    checkpoint_dir = args.checkpoint_dir
    if rank == 0:
        shown = " x ".join(f"{a}={s}" for a, s in sizes.items())
        print(f"Mesh {shown} on {world_size} ranks. The model: {cfg.n_layers} blocks of dim {cfg.dim}, "
              f"{cfg.n_heads} query / {cfg.n_kv_heads} key-value heads, FFN "
              f"{cfg.ffn_dim if moe is None else f'{moe.n_experts} experts of {moe.expert_dim}, top-{moe.top_k}'}, "
              f"a vocabulary of V={text.vocab_size} characters; {args.batch} x {cfg.max_seq_len} tokens a step in "
              f"{args.microbatches} microbatches{'; FP8 linears in every block (module 09)' if args.fp8 else ''}")
        print(describe_mesh(mesh, model))
        if checkpoint_dir:
            print(f"  checkpoints: {checkpoint_dir}/step_NNNNNN every {args.checkpoint_every} steps"
                  f"{' (resuming from its latest)' if args.resume else ''}")
    began = time.perf_counter()
    bar = ProgressBar(args.steps, tokens_per_step) if rank == 0 else None

    def on_step(step, loss):
        if bar is not None:
            bar.update(step, loss)

    start_step = 0
    if args.resume:
        start_step = int(reference("m17_checkpoint").latest_checkpoint(args.resume).name.removeprefix("step_"))
        if bar is not None:
            bar.start = start_step
    # The run's validation points so far, kept in its directory: the checkpoint holds the training losses only.
    points = earlier_validation(checkpoint_dir, start_step) if args.resume else []
    record = Path(checkpoint_dir) / VALIDATION_FILE

    def on_validation(step, loss):
        if bar is not None:
            bar.note(f"validation {loss:.4f} (step {step})")
            points.append((step, loss))
            record.parent.mkdir(parents=True, exist_ok=True)
            record.write_text(json.dumps(points))

    losses, _ = run.train(model, text, args.steps, args.batch, args.lr, args.seed, args.microbatches, checkpoint_dir,
                          args.checkpoint_every, bool(args.resume), args.eval_every, on_step=on_step,
                          on_validation=on_validation, checkpoint_last=True)
    elapsed = time.perf_counter() - began
    final = checkpoints.latest_checkpoint(checkpoint_dir) if checkpoint_dir else None  # the last step's
    if args.trace:
        from course.timeline import trace_one_step
        trace_one_step(model, text, args, rank)
    if rank != 0:
        return
    done, last = args.steps - start_step, losses[-20:]
    print(f"\n{done} steps in {elapsed:.0f} s: {done * tokens_per_step / elapsed:,.0f} tokens/s on {world_size} ranks; "
          f"training loss {losses[start_step]:.3f} at step {start_step + 1} -> {losses[-1]:.3f} at step {args.steps} "
          f"(mean of the last {len(last)}: {sum(last) / len(last):.3f})")
    if points:
        print("validation loss: " + ", ".join(f"{v:.3f} (step {s})" for s, v in points))
    plot = Path(checkpoint_dir) / "loss.png"  # the run's own: a resumed run redraws it whole, its earlier part included
    replaced = f" (steps 1 to {args.steps}; it replaces the plot that ended at step {start_step})" if plot.exists() else ""
    plot_losses(losses, points, plot, f"module 17: mesh {args.mesh}, {cfg.n_layers} blocks of dim {cfg.dim}")
    print(f"loss plot: {plot}{replaced}")
    if final is not None and args.sample and moe is not None:
        print(f"\nCheckpoint: {final} (sampling reads a checkpoint into module 06's dense model, not the MoE model)")
    elif final is not None and args.sample:
        one = checkpoints.load_into_one_process(final, cfg)
        print(f"\nSampled from {final} loaded into one process (temperature 0.8), after {PROMPT!r}:\n")
        print(printable(sample(one, text, PROMPT, args.sample, args.seed)))
