"""Module 17 checkpoints: a run of 4 steps on characters of Shakespeare (V = 62), checkpointed after
steps 2 and 4 with torch.distributed.checkpoint; resumed from step 2 on the same mesh it continues the
uninterrupted loss curve bit for bit, resumed on other meshes (t = 4: vocabulary rows 16, 16, 16, 14;
d = 2, t = 2; and, in the long checks, p = 4 and 2x2x2 -> 1x4x2 -> 8x1x1) within 1e-10; a rank killed (SIGKILL) in the
middle of a save leaves the last complete checkpoint, from which the run resumes; the checkpoint is
readable by one process with no process group at all (module 06's model, whose loss on a batch is
the trained model's); a checkpoint of another model is refused in one line before any step runs.

Tolerance, resharded: float64, the same sums in another order (other t slices, other stages' order
of the microbatches' gradients): measured within 8.9e-16 on every loss after a resume (torch 2.13
CPU). We allow 1e-10. A weight restored into the wrong rows, or one t slice in every slice's place, or
an update skipped, changes the next loss by 1e-3 or more.
"""
import dataclasses
import os
import re
import shutil
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from course.chars import load_chars
from course.dataset import random_batch
from course.impl import load, reference
from course.launch import RankFailed, run_ranks
from course.mesh import init_mesh

trainer = load("m17_trainer")
run = load("m17_run")
checkpoint = load("m17_checkpoint")
given = reference("m17_composition")
given_checkpoint = reference("m17_checkpoint")  # its given helpers: latest_checkpoint, check_checkpoint
m06 = reference("m06_llama_model")

f64 = torch.float64
TEXT = load_chars()
CFG = dataclasses.replace(given.CONFIG, vocab_size=TEXT.vocab_size)
STEPS, EVERY, BATCH, M, LR = 4, 2, 8, 2, 3e-3
TOLERANCE = 1e-10
TODOS = ("to_dtensor", "save", "train")


class KillMidSave(dcp.FileSystemWriter):
    """DCP's file writer, except that on rank 1, saving step 4, the process is SIGKILLed as it starts to
    write its files (the others may have written theirs; nobody has written the metadata)."""

    def write_data(self, plan, planner):
        if dist.get_rank() == 1 and "step_000004" in str(self.fs.concat_path(self.path, "")):
            os.kill(os.getpid(), signal.SIGKILL)
        return super().write_data(plan, planner)


class Watched(dcp.FileSystemWriter):
    """DCP's file writer, noting as each rank starts to write where it writes, and whether the checkpoint's
    final name (the directory without .partial) exists at that moment."""
    seen = []

    def write_data(self, plan, planner):
        path = Path(str(self.path))
        Watched.seen.append((path.name, (path.parent / path.name.removesuffix(".partial")).exists()))
        return super().write_data(plan, planner)


def watched_renames(renames: list):
    """os.replace and os.rename (Path.rename's) that note, for each .partial directory renamed, which of
    .metadata and config.json it held at that moment: both must be there before it takes its final name."""
    def watch(move):
        def watched(src, dst, *args, **kwargs):
            if Path(src).name.endswith(".partial"):
                renames.append((Path(src).name, sorted(f for f in (".metadata", "config.json") if (Path(src) / f).exists())))
            return move(src, dst, *args, **kwargs)
        return watched
    return watch(os.replace), watch(os.rename)


def _run(cfg, sizes, root, steps, every, resume, kill=False, validate=False):
    mesh = init_mesh(given.full_sizes(sizes))
    model = trainer.ComposedLlama(cfg, mesh, M, "1f1b", dtype=f64)
    renames, moves = [], (os.replace, os.rename)
    if validate:  # this rank's process only (a forked rank): the moves are put back below
        os.replace, os.rename = watched_renames(renames)
    try:
        losses, validation = run.train(model, TEXT, steps, BATCH, LR, 0, M, root, every, resume,
                                       eval_every=steps if validate else 0, eval_batches=1,
                                       make_writer=KillMidSave if kill else Watched if validate else None)
    finally:
        os.replace, os.rename = moves
    return (losses, validation, Watched.seen, renames) if validate else losses


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """p = 2, t = 2: 4 steps, checkpoints after steps 2 and 4, the validation loss after step 4."""
    root = tmp_path_factory.mktemp("m17-checkpoints") / "p2t2"
    results = run_ranks(_run, 4, CFG, {"p": 2, "t": 2}, str(root), STEPS, EVERY, False, False, True, timeout=120)
    return root, results[0][0], results[0][1][-1][1], [r[2] for r in results], [r[3] for r in results]


def resumed_from_step_2(uninterrupted, tmp_path, cfg, sizes, world_size=4):
    root, expected, *_ = uninterrupted
    shutil.copytree(root / "step_000002", tmp_path / "step_000002")
    results = run_ranks(_run, world_size, cfg, sizes, str(tmp_path), STEPS, 0, True, timeout=180)
    check_state_of_step_2(results, expected)
    return results


def check_state_of_step_2(results, expected):
    """The losses a resumed run read back from checkpoint "step 2" are the uninterrupted run's first two: a
    checkpoint taken at another moment of the loop holds others (or another number of them)."""
    for rank, losses in enumerate(results):
        assert len(losses) == len(expected) and losses[:2] == expected[:2], \
            (f"rank {rank}: resumed from checkpoint step_000002, the losses read back from it are {losses[:-2]}, the "
             f"uninterrupted run's first 2 are {expected[:2]}: the checkpoint of step k holds what a run has after k "
             f"steps, its optimizer step included (your train: when does it save, under which number?)")


@pytest.mark.exercises("save", "train")
def test_each_checkpoint_is_written_under_a_partial_name_then_renamed(uninterrupted):
    # What the long check's SIGKILL relies on, watched without a kill: every rank writes into
    # step_NNNNNN.partial/ while no step_NNNNNN/ exists, and the run ends with complete directories only.
    root, *_, seen, renames = uninterrupted
    for rank, writes in enumerate(seen):
        steps = [int(re.search(r"step_(\d+)", name)[1]) for name, _ in writes]
        assert steps == [2, 4], (f"rank {rank} saved checkpoints of steps {steps}; every {EVERY} steps of {STEPS}: "
                                 f"after steps 2 and 4, each under its step's number (your train: when does it save, "
                                 f"and under which number?)")
        assert [name for name, _ in writes] == ["step_000002.partial", "step_000004.partial"], \
            (f"rank {rank} wrote its checkpoints into {[name for name, _ in writes]}: DCP's files go into "
             f"step_NNNNNN.partial/, which only a rename after every rank's save makes step_NNNNNN/")
        early = [name for name, final_exists in writes if final_exists]
        assert not early, f"rank {rank}: {early} already had its final name while DCP was still writing into it"
    assert sorted(p.name for p in root.iterdir()) == ["step_000002", "step_000004"], sorted(root.iterdir())
    moved = [move for per_rank in renames for move in per_rank]
    assert sorted(name for name, _ in moved) == ["step_000002.partial", "step_000004.partial"], \
        f"the .partial directories renamed, by all ranks together: {moved} (each once, after its save)"
    incomplete = [(name, held) for name, held in moved if held != [".metadata", "config.json"]]
    assert not incomplete, (f"{incomplete}: renamed while holding only these of .metadata and config.json: a "
                            f"checkpoint must be complete (config.json written) before it takes its final name")


@pytest.mark.exercises(*TODOS)
def test_resuming_on_the_same_mesh_continues_the_curve_bit_for_bit(uninterrupted, tmp_path):
    _, expected, *_ = uninterrupted
    for rank, losses in enumerate(resumed_from_step_2(uninterrupted, tmp_path, CFG, {"p": 2, "t": 2})):
        assert losses == expected, (f"rank {rank}: resumed from step 2 on the same mesh, losses {losses}; the "
                                    f"uninterrupted run's {expected}: the same sums in the same order must give the "
                                    f"same bits (is the checkpoint written after the step? every t slice its own?)")


@pytest.mark.exercises(*TODOS)
def test_resuming_with_t_4_reshards_rows_that_do_not_divide(uninterrupted, tmp_path):
    # V = 62 over t = 4: rows 16, 16, 16 and 14 (the padding's two rows are no part of the checkpoint).
    _, expected, *_ = uninterrupted
    for rank, losses in enumerate(resumed_from_step_2(uninterrupted, tmp_path, CFG, {"t": 4})):
        worst = max(abs(a - b) for a, b in zip(losses, expected, strict=True))
        assert worst <= TOLERANCE, f"rank {rank}: resumed with t=4, losses {losses}, uninterrupted {expected}"


@pytest.mark.exercises(*TODOS)
def test_resuming_with_d_2_reads_one_copy_into_both_data_ranks(uninterrupted, tmp_path):
    # p = 2, t = 2 -> d = 2, t = 2: the two stages' names into one stage, every weight's t slice on two d ranks.
    _, expected, *_ = uninterrupted
    for rank, losses in enumerate(resumed_from_step_2(uninterrupted, tmp_path, CFG, {"d": 2, "t": 2})):
        worst = max(abs(a - b) for a, b in zip(losses, expected, strict=True))
        assert worst <= TOLERANCE, f"rank {rank}: resumed with d=2, t=2, losses {losses}, uninterrupted {expected}"


@pytest.mark.exercises(*TODOS)
def test_one_process_reads_the_checkpoint_without_a_process_group(uninterrupted):
    # Module 06's model with the checkpoint's weights computes, on step 4's validation batch, the loss the
    # trained model reports for it.
    root, *_ = uninterrupted
    model = given_checkpoint.load_into_one_process(root / "step_000004", CFG, f64)
    assert model.embedding.shape == (TEXT.vocab_size, CFG.dim)
    _, _, expected, *_ = uninterrupted
    generator = torch.Generator().manual_seed(run.VALIDATION_SEED)
    tokens, targets = random_batch(TEXT.validation, BATCH, CFG.max_seq_len, generator)
    loss, _ = model.forward_backward(tokens, targets)
    assert abs(loss.item() - expected) <= TOLERANCE, \
        f"one process on the checkpoint: loss {loss.item()}, the ranks that saved it: {expected}"


MOE = reference("m16_router").MoEConfig(n_experts=4, top_k=2, expert_dim=16, shared_expert=True, aux_coef=0.1)
MOE_MESH = {"p": 2, "d": 2, "e": 2}  # 4 ranks: 2 stages, each with its 4 experts over e = 2 (2 a rank)


def _run_moe(root, steps, every, resume):
    model = trainer.ComposedLlama(CFG, init_mesh(given.full_sizes(MOE_MESH)), M, "1f1b", dtype=f64, moe=MOE)
    return run.train(model, TEXT, steps, BATCH, LR, 0, M, root, every, resume)[0]


@pytest.mark.exercises(*TODOS)
def test_the_moe_model_with_experts_over_e_resumes_bit_for_bit(tmp_path):
    # Module 16's experts sharded over e: each expert saved under its own number, whole (the ranks of its
    # expert-data group hold the same copy), so the checkpoint has every expert of every layer once, and a
    # run resumed from step 2 on the same mesh continues the uninterrupted curve bit for bit.
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    expected = run_ranks(_run_moe, 4, str(whole), STEPS, EVERY, False, timeout=120)[0]
    keys = dcp.FileSystemReader(whole / "step_000002").read_metadata().state_dict_metadata
    experts = sorted(k for k in keys if k.startswith("model.") and ".experts." in k)
    want = sorted(f"model.layers.{layer}.experts.{k}.{f}" for layer in range(CFG.n_layers) for k in range(4)
                  for f in ("gate", "up", "down"))
    assert experts == want, f"the MoE checkpoint's experts: {experts}; every layer's 4 experts, each once: {want}"
    shutil.copytree(whole / "step_000002", resumed / "step_000002")
    results = run_ranks(_run_moe, 4, str(resumed), STEPS, 0, True, timeout=120)
    check_state_of_step_2(results, expected)
    for rank, losses in enumerate(results):
        assert losses == expected, (f"rank {rank}: the MoE model resumed from step 2, losses {losses}; the "
                                    f"uninterrupted run's {expected}: not the same bits")


@pytest.mark.given
def test_a_checkpoint_of_another_model_is_one_line_before_any_step(uninterrupted):
    root, *_ = uninterrupted
    other = dataclasses.replace(CFG, dim=48, head_dim=6)
    with pytest.raises(given_checkpoint.CheckpointError) as refused:
        given_checkpoint.check_checkpoint(root / "step_000002", other, TEXT.chars)
    message = str(refused.value)
    assert "dim=32 (this run: 48)" in message and "head_dim=4 (this run: 6)" in message and "\n" not in message
    with pytest.raises(given_checkpoint.CheckpointError, match="not a complete checkpoint"):
        given_checkpoint.check_checkpoint(root, CFG, TEXT.chars)


@pytest.mark.given
def test_the_latest_checkpoint_is_the_highest_complete_step(tmp_path):
    for name in ("step_000002", "step_000004", "step_000006.partial", "notes"):
        (tmp_path / name).mkdir()
    assert given_checkpoint.latest_checkpoint(tmp_path) == tmp_path / "step_000004"
    assert given_checkpoint.latest_checkpoint(tmp_path / "none") is None


@pytest.mark.long
@pytest.mark.exercises(*TODOS)
def test_resuming_with_p_4_continues_the_curve(uninterrupted, tmp_path):
    _, expected, *_ = uninterrupted
    for rank, losses in enumerate(resumed_from_step_2(uninterrupted, tmp_path, CFG, {"p": 4})):
        worst = max(abs(a - b) for a, b in zip(losses, expected, strict=True))
        assert worst <= TOLERANCE, f"rank {rank}: resumed with p=4, losses {losses}, uninterrupted {expected}"


@pytest.mark.long
@pytest.mark.exercises(*TODOS)
def test_8_ranks_2x2x2_then_1x4x2_then_8x1x1(tmp_path):
    cfg = dataclasses.replace(CFG, n_layers=8)
    whole = tmp_path / "whole"
    expected = run_ranks(_run, 8, cfg, {"p": 2, "d": 2, "t": 2}, str(whole), 6, 2, False, timeout=300)[0]
    chain = tmp_path / "chain"
    shutil.copytree(whole / "step_000002", chain / "step_000002")
    run_ranks(_run, 8, cfg, {"d": 4, "t": 2}, str(chain), 4, 2, True, timeout=300)   # 2x2x2 -> 1x4x2, to step 4
    losses = run_ranks(_run, 8, cfg, {"p": 8}, str(chain), 6, 0, True, timeout=300)  # -> 8x1x1, to step 6
    for rank, got in enumerate(losses):
        worst = max(abs(a - b) for a, b in zip(got, expected, strict=True))
        assert worst <= TOLERANCE, f"rank {rank}: 2x2x2 -> 1x4x2 -> 8x1x1, losses {got}, uninterrupted {expected}"


@pytest.mark.long
@pytest.mark.exercises(*TODOS)
def test_a_rank_killed_mid_save_leaves_the_last_complete_checkpoint(uninterrupted, tmp_path):
    _, expected, *_ = uninterrupted
    with pytest.raises(RankFailed):
        run_ranks(_run, 4, CFG, {"p": 2, "t": 2}, str(tmp_path), STEPS, EVERY, False, True, timeout=120)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["step_000002", "step_000004.partial"], \
        f"after rank 1 was killed saving step 4 the checkpoint directory holds {left}"
    assert given_checkpoint.latest_checkpoint(tmp_path) == tmp_path / "step_000002"
    for rank, losses in enumerate(run_ranks(_run, 4, CFG, {"p": 2, "t": 2}, str(tmp_path), STEPS, EVERY, True,
                                            timeout=120)):
        assert losses == expected, f"rank {rank}: resumed after the kill, losses {losses}, uninterrupted {expected}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000002", "step_000004"]
