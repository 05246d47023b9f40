"""`importance_evidence` and `laplace_evidence(smoothing="importance")`: the integral of
`exp(-F)` for objectives rough on scales below their errors, against integrals known
independently (closed forms, quadrature, plain Monte Carlo)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.integrate import quad
from scipy.special import i0

import equilens as el
from equilens import mass
from equilens.solve._covariance import smoothed_value_hessian
from equilens.solve._importance import importance_evidence
from equilens.solve._laplace import laplace_evidence

_A3 = np.array([[400.0, 120.0, 30.0], [120.0, 100.0, -20.0], [30.0, -20.0, 50.0]])
_M3 = np.array([0.3, -0.2, 0.1])


def _rough(a, m, ripple, cycles=60.0):
    """`F = (z - m) A (z - m) / 2 + ripple sum_i sin^2(w_i (z_i - m_i))`, the ripple's
    period 1/`cycles`-th of each 1-sigma error: its integral is the Gaussian's times
    `prod_i <exp(-ripple sin^2)>` = `(e^{-ripple/2} I0(ripple/2))^k` (the ripple far finer
    than the Gaussian), and its minimum, at `m`, one of the ripple's dips."""
    sigma = np.sqrt(np.diagonal(np.linalg.inv(a)))
    w = cycles / sigma

    def f(z):
        d = np.atleast_2d(z) - m[None, :]
        return 0.5 * np.einsum("ni,ij,nj->n", d, a, d) + ripple * np.sum(np.sin(w * d) ** 2, 1)

    k = a.shape[0]
    log_e = 0.5 * k * math.log(2 * math.pi) - 0.5 * np.linalg.slogdet(a)[1]
    return f, log_e + k * math.log(math.exp(-ripple / 2) * i0(ripple / 2))


@pytest.mark.parametrize("ripple", [0.0, 0.3, 1.0])
def test_importance_evidence_integrates_a_rough_gaussian(ripple):
    f, exact = _rough(_A3, _M3, ripple)
    sigma = np.sqrt(np.diagonal(np.linalg.inv(_A3)))
    for factor in (0.5, 1.0, 2.0):  # the first Hessian's errors off by this
        for z0 in (_M3, _M3 + 0.5 * sigma):  # from the minimum, or half a sigma off
            out = importance_evidence(f, z0, _A3 / factor**2)
            assert out.log_evidence == pytest.approx(exact, abs=0.2)
            assert out.error < 0.1 and out.effective > 50
            assert out.values == 3 * 64 and out.invalid == 0
            # the weights' moments: the Gaussian's mean and errors to 20%
            np.testing.assert_allclose(out.mean, _M3, atol=0.3 * sigma.min())
            np.testing.assert_allclose(np.sqrt(np.diagonal(out.covariance)), sigma, rtol=0.2)
    # the same call, the same value: the draws come from a fixed seed
    again = importance_evidence(f, _M3, _A3)
    assert again.log_evidence == importance_evidence(f, _M3, _A3).log_evidence


@pytest.mark.x64_only
def test_importance_evidence_where_central_differences_fail():
    """Eleven parameters, a ripple of amplitude 1: the integral (plain Monte Carlo over
    the Gaussian, 200,000 draws) to 0.15 from first errors off by x0.5 to x2, where the
    Laplace approximation from central differences at the fitted dip is off by more than
    1 (the premise: its `F` at a dip, its Hessian from differences about that dip)."""
    rng = np.random.default_rng(1)
    k = 11
    g = rng.standard_normal((k, k))
    a = g @ g.T / k + 0.3 * np.eye(k)
    m = np.zeros(k)
    sigma = np.sqrt(np.diagonal(np.linalg.inv(a)))
    w = rng.standard_normal((40, k)) * 8.0 / sigma
    phase = rng.uniform(0.0, 2 * math.pi, 40)

    def f(z):
        z = np.atleast_2d(z)
        q = 0.5 * np.einsum("ni,ij,nj->n", z, a, z)
        return q + np.sin(z @ w.T + phase).sum(1) / math.sqrt(40)

    draws = rng.multivariate_normal(m, np.linalg.inv(a), 200_000)
    gauss = 0.5 * k * math.log(2 * math.pi) - 0.5 * np.linalg.slogdet(a)[1]
    log_w = -f(draws) + 0.5 * np.einsum("ni,ij,nj->n", draws, a, draws)
    exact = gauss + float(np.log(np.mean(np.exp(log_w - log_w.max())))) + float(log_w.max())
    # the fitted optimum: a dip of the ripple near the mode (descent on the values)
    z0 = 0.3 * sigma
    for _ in range(300):
        step = np.array(
            [(f(z0 + e)[0] - f(z0 - e)[0]) / (2e-6) for e in 1e-6 * np.eye(k)]
        )  # fmt: skip
        z0 = z0 - 0.01 * step * sigma**2
    hess, _, _ = smoothed_value_hessian(
        lambda z: f(np.asarray(z))[0],
        jnp.asarray(z0),
        np.diagonal(a),
        values=lambda p: f(np.asarray(p)),
    )
    laplace = -f(z0)[0] + 0.5 * k * math.log(2 * math.pi) - 0.5 * np.linalg.slogdet(hess)[1]
    assert abs(laplace - exact) > 1.0
    for factor in (0.5, 0.7, 1.0, 1.4, 2.0):
        out = importance_evidence(f, z0, a / factor**2)
        assert out.log_evidence == pytest.approx(exact, abs=0.15)


def test_importance_evidence_refuses_bad_sizes_and_weighs_invalid_values_zero():
    f, exact = _rough(_A3, _M3, 0.0)
    with pytest.raises(ValueError, match="rounds"):
        importance_evidence(f, _M3, _A3, rounds=0)
    with pytest.raises(ValueError, match="size"):
        importance_evidence(f, _M3, _A3, size=1)

    def half_invalid(z):  # F infinite where z_0 > m_0 + 3 sigma: outside the support
        v = f(z)
        return np.where(np.atleast_2d(z)[:, 0] > _M3[0] + 3 * 0.05, np.nan, v)

    sigma0 = math.sqrt(np.linalg.inv(_A3)[0, 0])
    cut = 0.5 * (1 + math.erf(3 * 0.05 / sigma0 / math.sqrt(2)))
    out = importance_evidence(half_invalid, _M3, _A3)
    assert out.invalid > 0
    assert out.log_evidence == pytest.approx(exact + math.log(cut), abs=0.1)


class _Ripple(el.terms.AbstractTerm):
    """`200 a^2 + r cos(k a)` (+ b held): a ripple with a period of 1/15 of the error."""

    def __call__(self, model):
        return 200.0 * model.a**2 + 0.3 * jnp.cos(30.0 * math.pi * model.a) + 0.0 * model.b


@pytest.mark.x64_only
def test_laplace_evidence_by_importance_sampling_against_quadrature():
    import equinox as eqx

    class Point(eqx.Module):
        a: jax.Array
        b: jax.Array

    objective = el.Objective(_Ripple())
    exact = math.log(
        quad(lambda a: math.exp(-200 * a * a - 0.3 * math.cos(30 * math.pi * a)), -1, 1)[0]
    )
    point = Point(jnp.asarray(0.0), jnp.asarray(0.0))
    held = Point(True, False)
    ev = laplace_evidence(objective, point, free=held, smoothed=True, smoothing="importance")
    assert ev.log_evidence == pytest.approx(exact, abs=0.05)
    assert ev.log_evidence_error < 0.05 and ev.effective_samples > 50
    assert ev.covariance[0, 0] == pytest.approx(1 / 400.0, rel=0.2)
    # the premise: central differences about the fitted dip are off by more
    by_differences = laplace_evidence(objective, point, free=held, smoothed=True)
    assert abs(by_differences.log_evidence - exact) > 0.1
    assert np.isnan(by_differences.log_evidence_error)
    # (a `Literal`: jaxtyping's check refuses it first where it is on, as in the tests)
    with pytest.raises((ValueError, TypeError), match="smoothing"):
        laplace_evidence(objective, point, free=held, smoothed=True, smoothing="nested")  # pyright: ignore[reportArgumentType]


@pytest.mark.x64_only
def test_laplace_evidence_by_importance_sampling_in_a_uniform_prior():
    """A normal likelihood inside a uniform prior on (0, 4): `E = 1 / 4`; a flat
    likelihood: the prior's own integral, 1 (where the Laplace approximation of the
    logistic density is 0.12 off)."""
    model = mass.SIS(theta_E=1.0)
    free = el.select(model, lambda m: m.theta_E)
    bounds = {lambda m: m.theta_E: (0.0, 4.0)}
    normal = el.Objective(el.GaussianPrior(lambda m: m.theta_E, 1.7, 0.01))
    start = el.fit(normal, model, free=free, bounds=bounds, covariance=False).model
    ev = laplace_evidence(
        normal, start, free=free, bounds=bounds, smoothed=True, smoothing="importance"
    )
    assert ev.log_evidence == pytest.approx(-math.log(4.0), abs=0.03)
    flat = el.Objective(el.GaussianPrior(lambda m: m.theta_E, 0.0, 1e6))
    ev = laplace_evidence(
        flat, model, free=free, bounds=bounds, smoothed=True, smoothing="importance"
    )
    norm = -math.log(1e6 * math.sqrt(2 * math.pi))
    assert ev.log_evidence - norm == pytest.approx(0.0, abs=0.05)
