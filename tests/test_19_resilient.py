"""Module 19 restarts: module 17's model (float64, d = 2) trained 8 steps on module 19's reader (an epoch ends
every 4.4 batches), checkpointed every 2 steps by the learner's AsyncCheckpointer, through attempts in which a
rank is SIGKILLed after a random number of steps (seeded), each attempt starting afresh (forked ranks, as
torchrun starts fresh processes) and resuming from the last complete checkpoint. The last attempt's losses,
those carried in the checkpoint included, equal an uninterrupted run's bit for bit: the same sums in the same
order on the same mesh, from the same weights, moments and data. A repeated or skipped batch, or an update
lost or done twice, changes every loss after it by 1e-3 or more.

In the long checks (`python -m pytest -m long`): the same under `torchrun --max-restarts 3` with a c10d
rendezvous, its ranks killed from outside by course/elastic.py's killer.
"""
import dataclasses
import os
import random
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from course.chars import load_chars
from course.impl import load, reference
from course.launch import RankFailed, run_ranks
from course.mesh import init_mesh

resilient = load("m19_resilient")
data = load("m19_data")
checkpointing = load("m19_async_checkpoint")
trainer, given, ck = reference("m17_trainer"), reference("m17_composition"), reference("m17_checkpoint")

TEXT = load_chars()
CFG = dataclasses.replace(given.CONFIG, vocab_size=TEXT.vocab_size)
STEPS, EVERY, BATCH, M, LR = 8, 2, 8, 2, 3e-3
WINDOWS = TEXT.train[:600]   # 35 windows of 17 characters: an epoch is 4.4 batches of 8
TODOS = ("train", "training_state", "ShuffledSequences.restore", "ShuffledSequences.state", "AsyncCheckpointer.save",
         "AsyncCheckpointer.before_update")


def _attempt(root, kill):
    """One attempt of the job on this rank; `kill` = (rank, n): that rank SIGKILLs itself after its n-th step of
    this attempt (an async save may be in flight)."""
    model = trainer.ComposedLlama(CFG, init_mesh(given.full_sizes({"d": 2})), M, "1f1b", dtype=torch.float64)
    sampler = data.ShuffledSequences(WINDOWS, CFG.max_seq_len, BATCH, seed=0)
    checkpointer = checkpointing.AsyncCheckpointer(root, ck.describe(CFG, TEXT.chars))
    done = []

    def on_step(step, loss):
        done.append(step)
        if kill is not None and kill == (dist.get_rank(), len(done)):
            os.kill(os.getpid(), signal.SIGKILL)
    return resilient.train(model, sampler, STEPS, checkpointer, EVERY, LR, M, on_step)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return run_ranks(_attempt, 2, str(tmp_path_factory.mktemp("m19-whole") / "run"), None, timeout=120)[0]


@pytest.mark.exercises(*TODOS)
def test_a_run_killed_at_random_steps_computes_the_uninterrupted_losses(uninterrupted, tmp_path):
    # The first attempt dies after 5 or 6 steps: by then the save of step 4 has begun, which waits for the save of
    # step 2 to be committed, so the second attempt resumes; it dies after 1 or 2 steps, a save maybe in flight.
    rng = random.Random(19)
    kills = [(rng.randrange(2), rng.randrange(5, 7)), (rng.randrange(2), rng.randrange(1, 3))]
    for rank, n in kills:
        try:
            run_ranks(_attempt, 2, str(tmp_path), (rank, n), timeout=120)
        except RankFailed as failed:
            if "died without a result" not in str(failed):
                raise   # the code under test raised: its own message says where
        else:
            pytest.fail(f"the attempt whose rank {rank} was to die after its {n}-th step ran to the end: it ran fewer "
                        f"than {n} steps. From which step does your train resume (checkpoint step_00000k holds k "
                        f"steps)?")
    resumed_from = ck.latest_checkpoint(tmp_path)
    assert resumed_from is not None, f"after attempts killed at {kills}, no complete checkpoint under {tmp_path}"
    for rank, losses in enumerate(run_ranks(_attempt, 2, str(tmp_path), None, timeout=120)):
        assert len(losses) == STEPS, f"rank {rank}: {len(losses)} losses after the restarts; want one a step, {STEPS}"
        assert losses == uninterrupted, (
            f"rank {rank}, after attempts killed at {kills} (rank, its n-th step of the attempt) and a last one "
            f"resumed from {resumed_from.name}: "
            f"losses {losses}; the uninterrupted run's {uninterrupted}. From the first step that differs: what did "
            f"the resumed run read again, skip, or not get back from the checkpoint (your train's resume, "
            f"training_state)?")
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left[-1] == f"step_{STEPS:06d}" and not any(name.endswith(".partial") for name in left[-1:]), left


# --- the job under torchrun (long checks) and the command line's refusals --------------------------------------

def _uninterrupted_job(job, root):
    from course.elastic import run_job
    return run_job(job, Path(root), None)


@pytest.mark.long
@pytest.mark.exercises(*TODOS)
def test_under_torchrun_a_killed_job_restarts_and_computes_the_uninterrupted_losses(tmp_path):
    # torchrun --max-restarts 2, c10d rendezvous (a store per attempt), 2 ranks; the killer SIGKILLs a random rank
    # 12 steps into each attempt's training (steps, not seconds: a fast machine ends a short job before any
    # wall-clock deadline), twice. Float64: the last attempt's losses equal a forked uninterrupted run's.
    from course.elastic import Events, Job, Killer, torchrun
    job = Job(mesh={"d": 2}, dim=32, layers=2, seq_len=32, batch=8, microbatches=2, steps=60, every=5,
              dtype="float64")
    expected = run_ranks(_uninterrupted_job, 2, job, str(tmp_path / "whole"), timeout=300)[0]
    run_dir = tmp_path / "job"
    run_dir.mkdir()
    job.save(run_dir)
    events = Events(run_dir / "events.jsonl")
    with torchrun(run_dir, 2, 2, os.environ.get("COURSE_IMPL", "solutions")) as agent:
        killer = Killer(events, 2, 2.0, 2, False, seed=19, after_steps=12)
        killer.start()
        try:
            agent.wait(timeout=400)
        finally:
            killer.done.set()
    log = events.read()
    errors = [e["message"] for e in log if e["event"] == "error" and "TODO" in e["message"]]
    assert not errors, errors[0]
    kills = [e for e in log if e["event"] == "kill"]
    done = [e for e in log if e["event"] == "done"]
    assert len(kills) == 2 and agent.returncode == 0 and done, (
        f"torchrun exited with {agent.returncode} after {len(kills)} kills; its log: "
        f"{(run_dir / 'torchrun.log').read_text()[-2000:]}")
    assert done[-1]["losses"] == expected, (f"after {len(kills)} kills and restarts: losses {done[-1]['losses']}; "
                                            f"uninterrupted {expected}")


@pytest.mark.long
@pytest.mark.given
def test_run_19_tells_each_failure(tmp_path):
    import subprocess
    import sys

    from course import REPO
    out = subprocess.run([sys.executable, "main.py", "run", "19", "--impl", "solutions", "--steps", "40",
                          "--kill-every", "2", "--failures", "1", "--max-restarts", "1", "--checkpoint-every", "10",
                          "--dim", "32", "--seq-len", "32", "--checkpoint-dir", str(tmp_path / "run")],
                         cwd=REPO, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for line in ("failure 1: rank ", "  detected ", "  restart: attempt 1's ranks started ",
                 "every step done again computed the loss of its first run: bit for bit", "goodput: 40 steps"):
        assert line in out.stdout, out.stdout


@pytest.mark.given
@pytest.mark.parametrize("options, message", [
    (["--max-restarts", "0"], "--max-restarts 0: a job that restarts needs at least 1"),
    (["--checkpoint-every", "0"], "the interval between checkpoints must be at least 1 step"),
    (["--kill-every", "0"], "the killer's interval must be a positive number of seconds"),
    (["--kill-every", "0.2"], "leaves no step between failures"),
    (["--failures", "4"], "between 0 and --max-restarts (3)"),
])
def test_run_19_refuses_bad_options_in_one_line(options, message, capsys):
    import main
    with pytest.raises(SystemExit) as exit_:
        main.parse(["run", "19", *options])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and len(err.splitlines()) == 2, err


@pytest.mark.given
def test_run_19_refuses_to_resume_another_models_checkpoint(tmp_path, capsys):
    import json

    import main
    from course.elastic import Job, config_of
    other = config_of(Job(mesh={"d": 2}, dim=32), TEXT.vocab_size)   # the demo's default is dim 64
    step = tmp_path / "checkpoints" / "step_000010"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"")
    (step / "config.json").write_text(json.dumps(ck.describe(other, TEXT.chars)))
    with pytest.raises(SystemExit) as exit_:
        main.parse(["run", "19", "--resume", str(tmp_path)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "was saved for another model: dim=32 (this run: 64)" in err, err
    assert len(err.splitlines()) == 2, err


@pytest.mark.given
@pytest.mark.parametrize("options, message", [
    (["--mtbf", "0"], "--mtbf must be a positive number of seconds"),
    (["--intervals", "5,0"], "a checkpoint interval is at least 1 step"),
])
def test_bench_19_refuses_bad_options_before_any_rank_starts(options, message, capsys):
    import main
    with pytest.raises(SystemExit) as exit_:
        main.main(["bench", "19", *options, "--impl", "solutions"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err, err
