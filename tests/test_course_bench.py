"""Given benchmark helpers: the fits and simulators behind the measured-versus-theory tables."""
import pytest

from course.bench.m03 import fit_alpha_beta


def test_alpha_beta_fit_recovers_an_exact_model():
    alpha, beta = 50e-6, 2e9
    sizes = [4.0 * 4 ** k for k in range(10)]
    alpha_fit, beta_fit = fit_alpha_beta(sizes, [alpha + n / beta for n in sizes])
    assert alpha_fit == pytest.approx(alpha, rel=1e-9) and beta_fit == pytest.approx(beta, rel=1e-9)
