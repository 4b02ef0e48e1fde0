"""Module 19 asynchronous checkpoints: module 17's model (float64, d = 2) trained 6 steps with a checkpoint every
2, written by the learner's AsyncCheckpointer through a writer that takes 0.5 s to write and a stager that
copies only once the next optimizer step has run or 0.4 s have passed (whichever comes first): a save that
lets the update run before the copy saves a later step, and this stager makes it happen every time.

Checked: every save returns before its (slow) write ends; no two saves' writes overlap; nothing has its final
name while it is written, and the run ends with complete checkpoints only; resumed from a checkpoint, a run
(the test's own loop and module 17's load, the reference's) computes the uninterrupted run's losses bit for bit
(same mesh, same sums in the same order).
"""
import dataclasses
import shutil
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.optim.optimizer import register_optimizer_step_post_hook

from course.chars import load_chars
from course.impl import load, reference
from course.launch import run_ranks
from course.mesh import init_mesh

checkpointing = load("m19_async_checkpoint")
trainer, given, ck = reference("m17_trainer"), reference("m17_composition"), reference("m17_checkpoint")

TEXT = load_chars()
CFG = dataclasses.replace(given.CONFIG, vocab_size=TEXT.vocab_size)
STEPS, EVERY, BATCH, M, LR = 6, 2, 8, 2, 3e-3
WRITE_S, COPY_WAIT_S = 0.5, 0.4
DESCRIPTION = ck.describe(CFG, TEXT.chars)

optimizer_steps = [0]   # in each forked rank: optimizer steps so far (a global post-step hook counts them)
records = []            # in each forked rank: one tuple per write or save


class SlowWriter(dcp.FileSystemWriter):
    """DCP's file writer, 0.5 s slower, noting each write's start and end and whether the checkpoint's final name
    (the directory without .partial) existed as it began."""

    def write_data(self, plan, planner):
        path = Path(str(self.path))
        began, final_exists = time.monotonic(), (path.parent / path.name.removesuffix(".partial")).exists()
        time.sleep(WRITE_S)
        result = super().write_data(plan, planner)
        records.append(("write", path.name, began, time.monotonic(), final_exists))
        return result


class SlowStager(DefaultStager):
    """DefaultStager with asynchronous staging whose copy starts once the training's next optimizer step has run,
    or after COPY_WAIT_S: an update that does not wait for the copy always reaches the checkpoint."""

    def __init__(self):
        super().__init__(StagingOptions(False, False, True, False))

    def stage(self, state_dict, **kwargs):
        self.steps_then = optimizer_steps[0]
        return super().stage(state_dict, **kwargs)

    def _stage(self, state_dict, **kwargs):
        deadline = time.monotonic() + COPY_WAIT_S
        while optimizer_steps[0] == self.steps_then and time.monotonic() < deadline:
            time.sleep(0.002)
        return super()._stage(state_dict, **kwargs)


def run(root, steps: int, checkpointer=None, resume: bool = False) -> list[float]:
    """The test's own loop: module 17's model, module 19's reader, AdamW with the checkpointer's pre-hook; with
    `resume`, from the latest checkpoint under root through module 17's load (the reference's)."""
    data = reference("m19_data")
    model = trainer.ComposedLlama(CFG, init_mesh(given.full_sizes({"d": 2})), M, "1f1b", dtype=torch.float64)
    sampler = data.ShuffledSequences(TEXT.train[:3000], CFG.max_seq_len, BATCH, 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    if checkpointer is not None:
        optimizer.register_step_pre_hook(lambda *_: checkpointer.before_update())
    losses, start = [], 0
    if resume:
        latest = ck.latest_checkpoint(root)
        start = int(latest.name.removeprefix("step_"))
        state = {"epoch": torch.tensor(0), "position": torch.tensor(0), "losses": torch.zeros(start, dtype=torch.float64)}
        ck.load(model, optimizer, state, latest, DESCRIPTION)
        sampler.restore({"epoch": state["epoch"], "position": state["position"]})
        losses = state["losses"].tolist()
    for step in range(start, steps):
        losses.append(model.train_step(*sampler.next_batch(), M, optimizer))
        if checkpointer is not None and (step + 1) % EVERY == 0:
            state = {**sampler.state(), "losses": torch.tensor(losses, dtype=torch.float64)}
            checkpointer.save(model, optimizer, state, step + 1)
            records.append(("returned", step + 1, time.monotonic()))
    if checkpointer is not None:
        checkpointer.close()
    return losses


def _watched(root):
    register_optimizer_step_post_hook(
        lambda *_: optimizer_steps.__setitem__(0, optimizer_steps[0] + 1))
    checkpointer = checkpointing.AsyncCheckpointer(root, DESCRIPTION, "async", SlowWriter, SlowStager())
    return run(root, STEPS, checkpointer), records


def _resumed(root):
    return run(root, STEPS, resume=True)


@pytest.fixture(scope="module")
def watched(tmp_path_factory):
    root = tmp_path_factory.mktemp("m19-async") / "run"
    results = run_ranks(_watched, 2, str(root), timeout=60)
    return root, results[0][0], [r[1] for r in results]


@pytest.mark.exercises("AsyncCheckpointer.save")
def test_save_returns_before_its_write_ends(watched):
    root, _, per_rank = watched
    for rank, noted in enumerate(per_rank):
        ends = {int(name[5:11]): end for kind, name, *rest in noted if kind == "write" for _, end, _ in [rest]}
        returned = {step: at for kind, step, at in (n for n in noted if n[0] == "returned")}
        assert sorted(ends) == [2, 4, 6], f"rank {rank} wrote the checkpoints of steps {sorted(ends)}; want 2, 4, 6"
        late = {step: round(ends[step] - at, 2) for step, at in returned.items() if at >= ends[step]}
        assert not late, (f"rank {rank}: AsyncCheckpointer.save returned after its {WRITE_S} s write had ended "
                          f"(step: seconds after the write) {late}: it waited for the write, as a synchronous save does")


@pytest.mark.exercises("AsyncCheckpointer.save")
def test_no_two_saves_are_written_at_once(watched):
    _, _, per_rank = watched
    for rank, noted in enumerate(per_rank):
        writes = sorted((began, end, name) for kind, name, began, end, _ in (n for n in noted if n[0] == "write"))
        for (_, end, name), (began, _, later) in zip(writes, writes[1:]):
            assert began >= end, (f"rank {rank} began writing {later} {end - began:.2f} s before it had finished "
                                  f"writing {name}: the previous save was not finished when the next one started")


@pytest.mark.exercises("AsyncCheckpointer.save")
def test_each_checkpoint_takes_its_name_only_once_written(watched):
    root, _, per_rank = watched
    for rank, noted in enumerate(per_rank):
        early = [name for kind, name, _, _, final_exists in (n for n in noted if n[0] == "write") if final_exists]
        assert not early, f"rank {rank}: {early} already had its final name while DCP was still writing into it"
        names = [name for kind, name, *_ in noted if kind == "write"]
        assert all(name.endswith(".partial") for name in names), f"rank {rank} wrote into {names}, not .partial ones"
    left = sorted(p.name for p in root.iterdir())
    assert left == ["step_000002", "step_000004", "step_000006"], f"after the run, {root} holds {left}"
    for name in left:
        assert (root / name / ".metadata").exists() and (root / name / "config.json").exists(), f"{name} is incomplete"


@pytest.mark.exercises("AsyncCheckpointer.before_update", "AsyncCheckpointer.save")
def test_a_run_resumed_from_a_checkpoint_computes_the_same_losses(watched, tmp_path):
    # Every checkpoint of the watched run went through the same slow copy: resuming from the one of step 4 shows
    # whether they hold their own step's state.
    root, expected, _ = watched
    shutil.copytree(root / "step_000004", tmp_path / "step_000004")
    for rank, losses in enumerate(run_ranks(_resumed, 2, str(tmp_path), timeout=60)):
        assert losses == expected, (
            f"rank {rank}, resumed from the checkpoint of step 4: losses {losses}; the uninterrupted run's "
            f"{expected}. The checkpoint holds another step's weights or moments beside step 4's data position: did "
            f"the optimizer's update run before the copy was done (AsyncCheckpointer.before_update)?")


@pytest.mark.given
def test_the_checkpointer_refuses_an_unknown_staging():
    with pytest.raises(ValueError, match="staging 'eager'"):
        reference("m19_async_checkpoint").AsyncCheckpointer("/nonexistent", {}, "eager")
    assert dist.is_available()
