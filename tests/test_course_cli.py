"""main.py: bad arguments are refused before any process starts; run works with and without torchrun."""
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

import main
from course.skeleton import REPO


@pytest.fixture(autouse=True)
def keep_course_impl(monkeypatch):
    """main.py's run and bench set COURSE_IMPL for the ranks they start: undo it after each test."""
    monkeypatch.setenv("COURSE_IMPL", os.environ.get("COURSE_IMPL", "solutions"))


@pytest.mark.parametrize("argv, message", [
    (["run", "99"], "unknown module '99'"),
    (["run", "04", "--nproc", "3"], "16 layers cannot be split evenly into 3 stages"),
    (["run", "02", "--nproc", "1"], "needs --nproc of at least 2"),
    (["run", "00", "--nproc", "2"], "runs in a single process"),
    (["run", "03", "--nproc", "4"], "exactly 2 ranks"),
    (["run", "04", "--no-such-option"], "unrecognized arguments"),
    (["run", "05", "--timeout", "0"], "--timeout must be a positive number of seconds, at most 86400 (a day), got 0"),
    (["run", "05", "--timeout", "-3"], "--timeout must be a positive number of seconds, at most 86400 (a day), got -3"),
    # Issue "reliability round 2", item 6: these passed and crashed once the ranks had started.
    (["run", "05", "--timeout", "inf"], "at most 86400 (a day), got inf"),
    (["run", "05", "--timeout", "1e9"], "at most 86400 (a day), got 1e+09"),
    (["run", "00", "--timeout", "1e300"], "at most 86400 (a day), got 1e+300"),
    (["run", "05", "--timeout", "nan"], "got nan"),
    (["grade", "7x"], "unknown module"),
    # Issue 33 (reliability round 3): each of these was accepted, or refused only once the ranks had started.
    (["run", ""], "unknown module ''"),  # "".zfill(2) ran module 00
    (["run", "02", "--nproc", "100000"], "100000 ranks: at most 64 are forked on one machine (each a process); "
                                         "set COURSE_MAX_NPROC to allow more"),
    (["run", "16", "--capacity-factor", "inf"], "--capacity-factor must be a number from 1e-09 to 1e+09, got inf"),
    (["run", "15", "--gflops", "1e-300"], "--gflops must be a number from 1e-09 to 1e+09, got 1e-300"),
    (["run", "17", "--lr", "nan"], "--lr must be a number from 1e-09 to 1e+09, got nan"),
    (["run", "17", "--lr", "-1"], "--lr must be a number from 1e-09 to 1e+09, got -1"),
    (["run", "17", "--lr", "inf"], "--lr must be a number from 1e-09 to 1e+09, got inf"),
    (["run", "17", "--seed", str(10**30)], f"--seed must be at most 9,223,372,036,854,775,807, got {10**30}"),
    (["run", "16", "--expert-ranks", "0"], "--expert-ranks must be at least 1, got 0"),  # was: all ranks
    (["run", "17", "--checkpoint-every", "0"], "--checkpoint-every must be at least 1, got 0"),  # as --eval-every 0
    (["run", "17", "--eval-every", "0"], "--eval-every must be at least 1, got 0"),
    (["run", "17", "--nproc", "1"], "the mesh p=2 x d=2 x t=2 has 8 ranks, the job has 1"),  # was KeyError: 'RANK'
    (["run", "05", "--emulate-ms", "nan"], "--emulate-ms must be a number from 0 to 1e+09, got nan"),
    # Module 11's --batch: m = 6 on p = 4 runs with a batch that 6 divides; a batch it does not divide is refused.
    (["run", "11", "--nproc", "4", "--schedule", "1f1b", "--microbatches", "6"],
     "a batch of 32 cannot be split into 6 equal microbatches; use --microbatches that divides 32, or a --batch that 6 divides"),
    (["run", "11", "--nproc", "4", "--schedule", "1f1b", "--microbatches", "6", "--batch", "16"],
     "a batch of 16 cannot be split into 6 equal microbatches"),
])
def test_bad_arguments_give_one_clear_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main.parse(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.splitlines()) == 2, err  # the usage line, then the error


def test_an_unwritable_trace_is_refused_before_the_run(tmp_path, capsys):
    # Item 9: found only after the whole run before (a rank's FileNotFoundError). A file stands where
    # the folder should be: unwritable for root too, who may write in a read-only folder.
    (tmp_path / "file").write_text("")
    for trace in (tmp_path / "file" / "m05-trace", tmp_path / "file" / "deeper" / "m05-trace"):
        with pytest.raises(SystemExit) as exit_:
            main.parse(["run", "05", "--trace", str(trace)])
        assert exit_.value.code == 2
        assert f"--trace {trace}: cannot write in " in capsys.readouterr().err
    assert main.parse(["run", "05", "--trace", str(tmp_path / "new" / "m05-trace")]).trace  # a new folder is fine


def test_the_bound_on_forked_ranks_is_stated_once_and_can_be_raised(monkeypatch, capsys):
    from course.arguments import MAX_NPROC
    assert MAX_NPROC == 64 and main.parse(["run", "02", "--nproc", "64"]).world_size == 64
    monkeypatch.setenv("COURSE_MAX_NPROC", "100")
    assert main.parse(["run", "02", "--nproc", "100"]).world_size == 100
    monkeypatch.setenv("COURSE_MAX_NPROC", "lots")
    with pytest.raises(SystemExit) as exit_:
        main.parse(["run", "02", "--nproc", "100"])
    assert exit_.value.code == 2 and "COURSE_MAX_NPROC='lots': expected a whole number" in capsys.readouterr().err


def test_an_unwritable_checkpoint_folder_is_refused_before_the_run(tmp_path, monkeypatch, capsys):
    # Issue 33: module 17 trained, then failed at its first save (step 200 by default): minutes lost. A
    # file stands where the folder should be: unwritable for root too, as a read-only checkout is.
    import course.demos.m17
    (tmp_path / "file").write_text("")
    for argv, said in ((["--checkpoint-dir", str(tmp_path / "file" / "run")], f"--checkpoint-dir {tmp_path}/file/run: "),
                       ([], "the checkpoints' default folder (give --checkpoint-dir another) ")):
        monkeypatch.setattr(course.demos.m17, "RESULTS", tmp_path / "file" / "results")  # the default, read-only
        with pytest.raises(SystemExit) as exit_:
            main.parse(["run", "17", *argv])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and said in err and f"cannot write there ({tmp_path}/file is a file)" in err, err
    assert not (tmp_path / "new").exists() and main.parse(["run", "17", "--checkpoint-dir", str(tmp_path / "new")])
    assert not (tmp_path / "new").exists(), "a run that may yet be refused creates no folder"


@pytest.mark.parametrize("zero", ["2", "2once"])
def test_plan_pins_zero_2_as_a_row_names_it(zero, capsys):
    # "zero2" (a reduce-scatter each micro-step) and "zero2once" are two layouts: the calculator pins each by name.
    from course.plan import main as plan
    plan(["--model", "llama3-8b", "--gpus", "8", "--zero", zero, "--top", "3", "--impl", "solutions"])
    rows = [line for line in capsys.readouterr().out.splitlines() if re.match(r"^ +\d+  [pdcet]=", line)]
    assert rows and all(f" zero{zero} " in row for row in rows), rows


def test_plan_prices_each_row_under_failures_with_module_19s_goodput(capsys):
    # Each row's Γ and checkpoint interval: module 19's (the reference's) for the row's printed step time and a save
    # of its printed state at 2 GB/s; the job fails once in τ_gpu / R.
    from course.impl import reference
    from course.plan import main as plan
    plan(["--model", "llama3-8b", "--gpus", "8", "--top", "2", "--gpu-mtbf", "1000", "--restart", "300",
          "--save-gbps", "2", "--impl", "solutions"])
    out = capsys.readouterr().out
    assert "the job once in 125.0 h" in out, out
    rows = [line for line in out.splitlines() if re.match(r"^ +\d+  [pdcet]=", line)]
    assert len(rows) == 2, out
    for row in rows:
        state = float(re.search(r" (\d+\.\d) +\d+\.\d +\d+\.\d  ", row).group(1))   # state, acts, total
        step, shown, every = float(row.split()[-5]), float(row.split()[-2].rstrip("%")) / 100, int(row.split()[-1])
        want = reference("m19_goodput").goodput(step, state / 2, 300.0, 1000 * 3600 / 8)
        assert abs(shown - want.goodput) < 2e-3 and abs(every - want.every) <= max(1, want.every // 50), (row, want)


@pytest.mark.parametrize("argv, said", [
    (["--microbatches", "0"], "--microbatches must be at least 1, got 0"),  # ZeroDivisionError
    (["--model", "dim=inf,layers=2,heads=2,kv_heads=2,ffn=8,vocab=8,seq=8"], "--model dim must be a whole number from "
     "1 to 16,777,216, got inf"),  # OverflowError
    (["--model", "dim=1e300,layers=2,heads=2,kv_heads=2,ffn=8,vocab=8,seq=8"], "got 1e+300"),  # torch's C++ frames
    (["--gpus", str(10**30)], f"--gpus must be at most 1,048,576, got {10**30}"),  # minutes of search
    (["--gpu", "memory=nan,bf16=989,intra=450,inter=50"], "--gpu memory must be a number from 1e-09 to 1e+09, got nan"),
    (["--gpu", "memory=inf,bf16=inf,intra=450,inter=50"], "--gpu memory must be a number from 1e-09 to 1e+09, got inf"),
    (["--zero", "7"], "--zero '7' is not one of 0, 1, 2, 2once, 3"),
    (["--gpu-mtbf", "0"], "--gpu-mtbf must be a number from 1e-09 to 1e+09, got 0"),
    (["--gpu-mtbf", "1000", "--restart", "nan"], "--restart must be a number from 1e-09 to 1e+09, got nan"),
])
def test_plan_refuses_a_bad_number_in_one_line_with_exit_code_2(argv, said, capsys):
    # Issue 33: tracebacks, a plan for "nan GB" GPUs, an MFU of 0.0 %; and exit code 1 where run's is 2.
    from course.plan import main as plan
    given = dict(zip(argv[::2], argv[1::2]))
    defaults = {"--model": "llama3-8b", "--gpus": "8", **given}
    with pytest.raises(SystemExit) as exit_:
        plan([*(x for kv in defaults.items() for x in kv), "--impl", "solutions"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("error: ") and err.endswith(f"{said}\n") and err.count("\n") == 1, err


@pytest.mark.parametrize("argv", [["grade", "03"], ["bench", "03"], ["list"], ["hint", "05"], []])
def test_under_torchrun_only_run_is_accepted(argv, monkeypatch, capsys):
    # Item 9: `torchrun ... main.py grade NN` ran one grade per rank, their lines interleaved.
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as exit_:
        main.parse(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "only `run` runs under torchrun" in err and len(err.splitlines()) == 2, err


def test_a_single_process_module_under_torchrun_says_to_run_it_without(monkeypatch, capsys):
    # Item 9: it said "drop --nproc" when no --nproc was given.
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit):
        main.parse(["run", "00"])
    err = capsys.readouterr().err
    assert "module 00 runs in a single process: run it without torchrun" in err and "--nproc" not in err, err


def test_the_sampled_text_cannot_drive_the_terminal(capfd):
    # Item 9: after one step the model samples bytes at random, ESC, BEL and form feeds among them.
    main.main(["run", "06", "--steps", "1", "--sample", "150", "--impl", "solutions"])  # 15 of them
    out = capfd.readouterr().out
    sample = out.split("Sample (temperature 0.8):\n", 1)[1]
    assert len(sample) > 100, out
    assert not [c for c in sample if not c.isprintable() and c != "\n"], repr(sample)


def test_a_curve_with_a_nan_or_an_inf_anywhere_is_not_the_same_curve():
    # Item 10: max() skips a nan unless it comes first, so this curve was "NO: they differ by up to 1.0e-05"
    # (and with the nan in the expected curve, "bit for bit" if the rest matched).
    from course.demos import same_curve
    expected = [2.0, 1.5, 1.2, 1.1]
    assert same_curve([2.0, 1.5, float("nan"), 1.1 + 1e-5], expected) == "NO: step 2's loss is nan (expected 1.2)"
    assert same_curve([2.0, float("inf"), 1.2, 1.1], expected) == "NO: step 1's loss is inf (expected 1.5)"
    assert same_curve(expected, [2.0, 1.5, float("nan"), 1.1]).startswith("NO: step 2's loss is 1.2 (expected nan)")
    assert same_curve(list(expected), expected) == "bit for bit"
    assert same_curve([2.0, 1.5, 1.2 + 1e-7, 1.1], expected) == "up to float32 rounding (1.0e-07)"


def test_run_launches_its_own_ranks(capfd):
    main.main(["run", "04", "--nproc", "2", "--impl", "solutions"])
    assert "logits equal the monolith's bit for bit: True" in capfd.readouterr().out


# Every module's demo from 05 on, and the tour's, with the reference and small sizes (under a second
# each on 2 cores): module, run's options ({tmp}: a temporary folder), a line the demo prints once it
# has worked.
DEMOS = [
    ("00", [], r"^  final     loss "),
    ("05", ["--steps", "2", "--emulate-ms", "0", "--trace", "{tmp}/m05-trace"],  # 4 ranks, 8 microbatches
     r"^  every step's loss equals the monolith's: (bit for bit|up to float32 rounding)"),
    ("06", ["--steps", "3", "--sample", "8"], r"^  3 steps in .*\(mean of the last 3\)$"),
    ("07", ["--steps", "2", "--batch", "4", "--layers", "2"], r"max \|loss difference\| .* -> match "),
    ("08", ["--layers", "3"], r"^Loss and gradients equal the all-resident model's bit for bit: True$"),
    ("09", ["--steps", "3"], r"^Mean of the last 3 losses: fp32 "),
    ("10", [], r"^ +block .* identical, bit for bit$"),
    ("11", ["--schedule", "zbv", "--nproc", "4", "--chunks", "8",  # --chunks: torch's name for --microbatches
            "--steps", "2", "--emulate-ms", "0", "--trace", "{tmp}/m11-trace"],
     r"^  \.\.\. and the monolith's trained on the same 8 microbatches \(gradient accumulation\): bit for bit$"),
    ("12", ["--nproc", "2", "--steps", "2", "--batch", "4", "--layers", "1", "--sequence-parallel"],
     r"max \|loss difference\| .* -> match "),
    ("13", ["--mesh", "2x2", "--steps", "2", "--batch", "4"], r"^Bytes sent per step and rank: .* -> equal$"),
    ("14", ["--nproc", "2", "--steps", "2", "--zero", "2", "--microbatches", "2"], r"^Per step and rank: .* -> equal$"),
    ("15", ["--nproc", "4", "--variant", "zigzag", "--steps", "2", "--batch", "4"],
     r"^Bytes rank 0 sends per step over 'c' by send: .* -> equal$"),
    ("16", ["--nproc", "4", "--steps", "2"], r"^  all_to_all over +e: .* -> equal$"),
    # 17: test_a_resumed_run_keeps_the_earlier_validation_losses_and_says_it_redrew_the_plot runs it twice.
    # 19 (torchrun with restarts, minutes): tests/test_19_resilient.py::test_run_19_tells_each_failure, marked long.
]
FAILED = ("MISMATCH", "DIFFERENT", ": False", ": NO")  # what the demos print when a check fails


@pytest.mark.parametrize("number, options, expected", DEMOS, ids=[d[0] for d in DEMOS])
def test_each_demo_runs(number, options, expected, capfd, tmp_path):
    main.main(["run", number, *(o.format(tmp=tmp_path) for o in options), "--impl", "solutions"])  # no exit: 0
    out, err = capfd.readouterr()
    assert re.search(expected, out, re.MULTILINE), f"expected a line matching {expected!r}:\n{out}{err}"
    assert not any(word in out for word in FAILED), out


# Module 17, small: a checkpoint every 2 steps and a validation loss after each.
SMALL_17 = ["--dim", "32", "--seq-len", "32", "--layers", "2", "--batch", "4", "--microbatches", "2",
            "--checkpoint-every", "2", "--eval-every", "1", "--sample", "0", "--impl", "solutions"]


@pytest.fixture(scope="module")
def run_17(tmp_path_factory):
    """The run directory of module 17's run of 2 steps on one rank (issue 33: `--nproc 1` crashed with
    KeyError: 'RANK'; a distributed demo on one rank now runs on one forked rank, in a process group)."""
    root = tmp_path_factory.mktemp("m17") / "run"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("COURSE_IMPL", os.environ.get("COURSE_IMPL", "solutions"))  # which main.py sets
        main.main(["run", "17", "--mesh", "d=1", *SMALL_17, "--steps", "2", "--checkpoint-dir", str(root)])
    return root


def test_a_resumed_run_keeps_the_earlier_validation_losses_and_says_it_redrew_the_plot(run_17, tmp_path, capfd):
    # Issue 33: the plot of a resumed run lost the earlier validation points, and replaced the earlier plot unsaid.
    # Resumed from one rank onto 4 (2 pipeline stages x 2 tensor slices, with sampling): module 17's smoke run.
    assert {p.name for p in run_17.iterdir()} == {"step_000002", "loss.png", "validation.json"}
    shutil.copytree(run_17, tmp_path / "run")
    main.main(["run", "17", "--nproc", "4", "--mesh", "p=2,t=2", *SMALL_17, "--sample", "8", "--steps", "3",
               "--resume", str(tmp_path / "run")])
    out = capfd.readouterr().out
    assert "1 steps in " in out and not any(word in out for word in FAILED), out
    assert re.search(r"^validation loss: [0-9.]+ \(step 1\), [0-9.]+ \(step 2\), [0-9.]+ \(step 3\)$", out, re.M), out
    assert f"loss plot: {tmp_path}/run/loss.png (steps 1 to 3; it replaces the plot that ended at step 2)" in out, out
    assert [step for step, _ in json.loads((tmp_path / "run" / "validation.json").read_text())] == [1, 2, 3]


def damage(run, tmp_path, how) -> str:
    """A copy of the run with its checkpoint damaged `how`; the path the refusal must name."""
    shutil.copytree(run, tmp_path / "run")
    step = tmp_path / "run" / "step_000002"
    if how == "truncated .metadata":
        (step / ".metadata").write_bytes((step / ".metadata").read_bytes()[:40])
        return f"{step}/.metadata cannot be read (UnpicklingError"
    if how == "no .metadata":
        (step / ".metadata").unlink()
        return f"{step} is not a complete checkpoint (no .metadata or config.json): --resume takes a run's directory"
    if how == "a step given":
        return f"--resume {step}: no complete checkpoint (step_NNNNNN/) there: --resume takes the run's directory, {tmp_path}/run,"
    (step / "config.json").write_text(how)
    return f"{step}/config.json " + ("cannot be read as JSON" if how == "{not json" else "is not a checkpoint's description")


@pytest.mark.parametrize("how", ["{}", "[1, 2]", "{not json", "truncated .metadata", "no .metadata", "a step given"])
def test_a_damaged_checkpoint_is_named_in_one_line_before_the_run(how, run_17, tmp_path, capsys):
    # Issue 33: KeyError or TypeError; invalid JSON without its path; a truncated .metadata gave four DCP
    # tracebacks once the ranks had started; "not a complete checkpoint" said to give a step directory.
    said = damage(run_17, tmp_path, how)
    resume = tmp_path / "run" / ("step_000002" if how == "a step given" else "")
    with pytest.raises(SystemExit) as exit_:
        main.parse(["run", "17", "--mesh", "d=1", *SMALL_17, "--steps", "4", "--resume", str(resume)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and said in err and len(err.splitlines()) == 2, err


def test_the_tour_runs_the_reference_of_smoke_tested_demos(monkeypatch, capsys):
    # `python main.py` takes about 20 s on 2 cores, too long to run here: check which demos it runs
    # (each is covered by test_each_demo_runs), and run the rest of it (the module list).
    ran = []
    monkeypatch.setattr(main, "cmd_run", lambda args: ran.append((args.number, args.impl)))
    main.main([])
    assert ran == [(number, "solutions") for number in main.TOUR]
    assert set(main.TOUR) <= {number for number, _, _ in DEMOS}
    assert "Next: read docs/00-monolith.md" in capsys.readouterr().out


@pytest.fixture
def skeleton_steps(tmp_path):
    """A freshly generated steps/ (a learner's starting point), whatever this checkout's steps/ holds."""
    from course.skeleton import write
    write(tmp_path / "steps")
    return {**os.environ, "COURSE_STEPS_DIR": str(tmp_path / "steps")}


def test_run_reports_an_unfinished_todo_in_one_line(skeleton_steps):
    run = subprocess.run([sys.executable, "main.py", "run", "02", "--nproc", "2"], cwd=REPO,
                         env=skeleton_steps, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert "raised NotImplementedError: TODO(m02)" in run.stderr and "--impl solutions" in run.stderr


def test_run_help_lists_the_modules_own_options(capsys):
    with pytest.raises(SystemExit) as exit_:
        main.parse(["run", "05", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--nproc" in out and "--schedule" in out and "--microbatches" in out, out


def test_bench_of_unfinished_code_says_which_todo_without_a_traceback(skeleton_steps):
    bench = subprocess.run([sys.executable, "main.py", "bench", "03", "--repeats", "1", "--impl", "steps"], cwd=REPO,
                           env=skeleton_steps, capture_output=True, text=True, timeout=120)
    assert bench.returncode == 1
    assert "raised NotImplementedError: TODO(m02)" in bench.stderr and "Traceback" not in bench.stderr, bench.stderr


def test_grade_prints_one_line_per_check_and_the_todo_that_failed_it(skeleton_steps):
    grade = subprocess.run([sys.executable, "main.py", "grade", "03"], cwd=REPO, env=skeleton_steps,
                           capture_output=True, text=True, timeout=120)
    assert grade.returncode == 1, grade.stdout + grade.stderr
    lines = grade.stdout.splitlines()
    checks = [line for line in lines if line.startswith("  FAIL  ")]
    assert len(checks) >= 3, grade.stdout  # every check of tests/test_03_ping_pong.py (at least three)
    assert all("NotImplementedError: TODO(m03)" in lines[lines.index(c) + 1] for c in checks), grade.stdout
    assert f"0/{len(checks)} checks pass" in lines, grade.stdout
    assert lines[-1].startswith("A check's whole output") and "-m m03 -k NAME" in lines[-1]


def test_grading_a_given_module_says_so(capsys):
    main.main(["grade", "00"])  # no graded test and nothing to fill in: not a failure
    assert "module 00 is given" in capsys.readouterr().out


def test_list_and_torchrun():
    listing = subprocess.run([sys.executable, "main.py", "list"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert listing.returncode == 0 and "04" in listing.stdout
    # torchrun as a module of this Python: a virtualenv's python need not have its scripts on PATH.
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "main.py", "run", "04",
                          "--impl", "solutions"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "logits equal the monolith's bit for bit: True" in run.stdout


def test_list_shows_the_ranks_a_demo_starts_under_torchrun_itself():
    # Module 19's demo starts torchrun on its --mesh (the catalog forks one process): list shows the mesh's ranks.
    import argparse

    from course.catalog import MODULES
    from course.demos import m19
    from course.mesh import parse_mesh
    parser = argparse.ArgumentParser()
    m19.add_args(parser)
    assert MODULES["19"].ranks == math.prod(parse_mesh(parser.parse_args([]).mesh).values())


def test_nproc_must_agree_with_torchrun(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "4")  # as torchrun --nproc-per-node 4 sets it
    with pytest.raises(SystemExit):
        main.parse(["run", "04", "--nproc", "2"])
    assert "disagrees with torchrun's 4 ranks" in capsys.readouterr().err
    assert main.parse(["run", "04"]).world_size == 4


@pytest.mark.parametrize("command", [["run", "05"], ["grade", "05"], ["bench", "05"]])
def test_every_command_runs_your_steps_unless_told_otherwise(command):
    assert main.parse(command).impl == "steps", f"`python main.py {' '.join(command)}` must use steps/ by default"
    assert main.parse([*command, "--impl", "solutions"]).impl == "solutions"


@pytest.mark.parametrize("command", [["grade", "03"], ["run", "05"]])
def test_a_python_without_torch_gets_one_line_naming_it(tmp_path, command):
    # An interpreter that cannot find torch (here: this one, with find_spec told to say so).
    import_hook = tmp_path / "hide_torch.py"
    import_hook.write_text("import importlib.util, sys\n"
                           "real = importlib.util.find_spec\n"
                           "importlib.util.find_spec = lambda name, *a: None if name == 'torch' else real(name, *a)\n")
    run = subprocess.run([sys.executable, "-c", f"import runpy, sys; sys.path.insert(0, {str(tmp_path)!r}); "
                          f"import hide_torch; sys.argv = ['main.py', *{command!r}]; runpy.run_path('main.py', run_name='__main__')"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "has no torch" in run.stderr and sys.executable in run.stderr, run.stderr
    assert "Traceback" not in run.stderr, run.stderr


def test_list_counts_the_todos_of_the_steps_selected(tmp_path, monkeypatch, capsys):
    # Every command reads the implementation selected: here a steps/ folder with every TODO done.
    shutil.copytree(REPO / "solutions", tmp_path / "steps")
    monkeypatch.setenv("COURSE_STEPS_DIR", str(tmp_path / "steps"))
    main.main(["list"])
    rows = capsys.readouterr().out.splitlines()[1:]
    assert rows and all(row.split()[2] in ("done", "given") for row in rows), rows


# --- hint (items 7 and 8) ---------------------------------------------------------------------

@pytest.fixture
def hint_record(tmp_path, monkeypatch):
    """The record of hint levels seen, in a temporary folder."""
    import course.hints
    record = tmp_path / "hints.json"
    monkeypatch.setattr(course.hints, "HINTS_SHOWN", record)
    monkeypatch.setattr(course.hints, "PASSED", tmp_path / "passed.json")
    return record


def hint(capsys, *argv) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_:
        main.main(["hint", *argv])
    out, err = capsys.readouterr()
    return exit_.value.code, out, err


@pytest.mark.parametrize("which", ["a", "", "  ", "schedule", "0", "99"])
def test_hint_refuses_anything_but_one_todo_in_one_line(which, hint_record, capsys):
    # Item 7: "a" and "" matched every title by substring and advanced every TODO a level.
    code, out, err = hint(capsys, "05", which)
    assert code == 2 and out == "" and err.startswith("error: ") and len(err.splitlines()) == 1, (out, err)
    assert not hint_record.exists()


def test_a_function_holding_several_todos_is_refused(hint_record, capsys):
    code, out, err = hint(capsys, "06", "backward")
    assert code == 2 and out == "" and "backward holds TODOs " in err and "name one by its number" in err, err


def test_hint_takes_a_number_an_exact_title_or_the_function_of_one_todo(hint_record, capsys):
    from course.catalog import MODULES
    from course.hints import module_todos
    first = module_todos(MODULES["05"])[0]
    for which in ("1", first.title.split(": ", 1)[1], first.title, first.function):
        code, out, err = hint(capsys, "05", which)
        assert code == 0 and out.startswith("TODO 1, steps/m05_schedules.py") and err == "", (which, out, err)
    assert json.loads(hint_record.read_text()) == {first.title: min(4, len(first.hints))}


@pytest.mark.parametrize("content", ["[]", "null", "3", '"text"', '{"TODO(m05): x": "2"}', '{"TODO(m05): x": true}',
                                     '{"TODO(m05): x": -1}', "{not json", ""])
def test_a_hint_record_that_is_not_one_is_named_and_kept(content, hint_record, capsys):
    # Item 8: a list, null or wrong types gave a traceback; invalid JSON was silently reset to {}.
    hint_record.write_text(content)
    for argv in (["05"], ["05", "1"]):
        code, out, err = hint(capsys, *argv)
        assert code == 1 and out == "" and len(err.splitlines()) == 1, (out, err)
        assert err.startswith(f"error: {hint_record} is not a record of hints seen"), err
    assert hint_record.read_text() == content


def test_a_hint_record_that_is_not_utf8_is_named_and_kept(hint_record, capsys):
    # Issue 33: a UnicodeDecodeError traceback.
    hint_record.write_bytes(b"\xff\xfe{")
    code, out, err = hint(capsys, "05", "1")
    assert code == 1 and out == "" and err.startswith(f"error: {hint_record} is not a record of hints seen"), err
    assert len(err.splitlines()) == 1 and hint_record.read_bytes() == b"\xff\xfe{"


def test_a_hint_record_that_is_a_folder_is_named(hint_record, capsys):
    hint_record.mkdir()
    code, out, err = hint(capsys, "05", "1")
    assert code == 1 and out == "" and err.startswith(f"error: the record of hints seen, {hint_record}, cannot be read")
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err


def test_a_hint_record_that_cannot_be_saved_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    # Item 8: a read-only checkout printed the hint, then a traceback. A file stands where the folder
    # should be: unwritable for root too.
    import course.hints
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(course.hints, "HINTS_SHOWN", tmp_path / "file" / "hints.json")
    code, out, err = hint(capsys, "05", "1")
    assert code == 1 and out.startswith("TODO 1, "), out  # the hint is shown all the same
    assert err.startswith("error: which hint levels you have seen could not be saved in ") and len(err.splitlines()) == 1


def test_the_hint_record_is_replaced_whole_not_rewritten_in_place(hint_record, capsys):
    # Item 8: written in place, an interrupted save left half a record. Now a new file takes its place.
    hint_record.write_text("{}\n")
    before = hint_record.stat().st_ino
    assert hint(capsys, "05", "2")[0] == 0
    assert hint_record.stat().st_ino != before and len(json.loads(hint_record.read_text())) == 1
    assert [p.name for p in hint_record.parent.iterdir()] == [hint_record.name]  # no partial file left


def test_a_reader_that_leaves_early_gets_no_traceback():
    # `python main.py list | head -1`: head closes the pipe after one line.
    shell = f"{shlex.quote(sys.executable)} main.py list | head -1"
    done = subprocess.run(["bash", "-o", "pipefail", "-c", shell], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.stdout.startswith("module"), done.stdout
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
