"""Given benchmark code: the fits and simulators behind the measured-versus-theory tables, and
argument checks that refuse bad options before any rank starts."""
import importlib
import os

import pytest

import main
from course.bench.m03 import fit_alpha_beta


@pytest.fixture(autouse=True)
def keep_course_impl(monkeypatch):
    """main.py's run and bench set COURSE_IMPL for the ranks they start: undo it after each test."""
    monkeypatch.setenv("COURSE_IMPL", os.environ.get("COURSE_IMPL", "solutions"))


def test_alpha_beta_fit_recovers_an_exact_model():
    alpha, beta = 50e-6, 2e9
    sizes = [4.0 * 4 ** k for k in range(10)]
    alpha_fit, beta_fit = fit_alpha_beta(sizes, [alpha + n / beta for n in sizes])
    assert alpha_fit == pytest.approx(alpha, rel=1e-9) and beta_fit == pytest.approx(beta, rel=1e-9)


@pytest.mark.parametrize("argv, message", [
    (["05", "--nproc", "3"], "16 layers cannot be split evenly over 3 ranks"),
    (["05", "--microbatches", "5"], "cannot be split into 5 equal microbatches"),
    (["07", "--dim", "16"], "--dim must be a multiple of 16 and at least 32"),
    (["07", "--dim", "80"], "n_heads=5 is not divisible by n_kv_heads=2"),
    (["08", "--heads", "5"], "--dim 4096 must be divisible by --heads 5"),
    (["10", "--kv-heads", "3"], "n_heads=4 is not divisible by n_kv_heads=3"),
    (["11", "--microbatches", "5"], "--microbatches divide the batch of 32"),
    (["11", "--steps", "1"], "--steps must be at least 2"),
    (["13", "--meshes", "2x3"], "mesh 2x3 needs 6 ranks"),
    (["13", "--meshes", "1x3"], "t=3 does not divide n_heads H=8, n_kv_heads K=4"),
    (["12", "--nproc", "3"], "t=3 does not divide n_heads H=8, n_kv_heads K=4"),
    (["07", "--nproc", "3"], "d=3 does not divide batch B=8"),
])
def test_bad_bench_arguments_give_one_clear_error_before_any_rank_starts(argv, message, monkeypatch, capsys):
    bench = importlib.import_module(f"course.bench.m{argv[0]}")
    if hasattr(bench, "run_ranks"):
        monkeypatch.setattr(bench, "run_ranks", lambda *a, **k: pytest.fail("ranks started before the check"))
    with pytest.raises(SystemExit) as exit_:
        main.main(["bench", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"main.py bench {argv[0]}: error: " in err and message in err and "Traceback" not in err, err
