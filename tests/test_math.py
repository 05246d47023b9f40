"""The numerical helpers: fast transcendental functions and the q = 1 handling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from equilens._math import (
    atanh_ratio,
    elliptical_radius_sq,
    fast_arctan,
    fast_atanh,
    fast_log,
)
from helpers import default_eps


def _dtype():
    return jnp.result_type(float)


def _ulp_error(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.max(np.abs(got - want) / np.maximum(np.abs(want), np.finfo(np.float64).tiny))


def test_fast_arctan_accuracy_and_derivative():
    t = np.concatenate([np.linspace(-6, 6, 20001), np.geomspace(1e-30, 1e30, 2001)])
    t = np.concatenate([t, -t, [0.0, 2.414213562373095, 0.41421356237309503]])
    got = fast_arctan(jnp.asarray(t, dtype=_dtype()))
    assert got.dtype == _dtype()
    assert _ulp_error(got, np.arctan(t.astype(got.dtype))) < 4 * default_eps()
    d = jax.vmap(jax.grad(fast_arctan))(jnp.asarray([-3.0, 0.0, 0.5, 40.0], dtype=_dtype()))
    np.testing.assert_allclose(d, 1 / (1 + np.array([-3.0, 0.0, 0.5, 40.0]) ** 2), rtol=1e-6)
    assert float(fast_arctan(jnp.asarray(np.inf, dtype=_dtype()))) == pytest.approx(np.pi / 2)


def test_fast_log_accuracy_and_derivative():
    hi = 1e300 if default_eps() < 1e-10 else 1e30
    x = np.concatenate([np.geomspace(1 / hi, hi, 20001), np.linspace(0.5, 2.0, 20001)])
    x = x.astype(_dtype())
    got = fast_log(jnp.asarray(x))
    want = np.log(x.astype(np.float64))
    # absolute error relative to the scale of log(x) near 1, ulp-relative elsewhere
    err = np.abs(np.asarray(got, np.float64) - want) / np.maximum(np.abs(want), 1.0)
    assert err.max() < 4 * default_eps()
    d = jax.vmap(jax.grad(fast_log))(jnp.asarray([0.3, 1.0, 7.0], dtype=_dtype()))
    np.testing.assert_allclose(d, 1 / np.array([0.3, 1.0, 7.0]), rtol=10 * default_eps())


def test_fast_atanh_accuracy_and_derivative():
    u = np.concatenate([np.geomspace(1e-300 if default_eps() < 1e-10 else 1e-30, 0.999, 20001)])
    u = np.concatenate([u, -u, [0.0]]).astype(_dtype())
    got = np.asarray(fast_atanh(jnp.asarray(u)), np.float64)
    want = np.arctanh(u.astype(np.float64))
    err = np.abs(got - want) / np.maximum(np.abs(want), np.finfo(np.float64).tiny)
    assert err.max() < 40 * default_eps()
    d = jax.vmap(jax.grad(fast_atanh))(jnp.asarray([1e-12, -0.5, 0.9], dtype=_dtype()))
    np.testing.assert_allclose(d, 1 / (1 - np.array([1e-12, -0.5, 0.9]) ** 2), rtol=1e-6)


def test_atanh_ratio_is_one_analytic_function():
    u = np.linspace(-5, 0.99, 20001)
    got = np.asarray(atanh_ratio(jnp.asarray(u, dtype=_dtype())), np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        want = np.where(
            u > 0,
            np.arctanh(np.sqrt(np.abs(u))) / np.sqrt(np.abs(u)),
            np.arctan(np.sqrt(np.abs(u))) / np.sqrt(np.abs(u)),
        )
    want[u == 0] = 1.0
    assert np.max(np.abs(got - want) / np.abs(want)) < 100 * default_eps()


def test_elliptical_radius_matches_rotated_form():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=50), rng.normal(size=50)
    q, phi = 0.6, 0.7
    c = (1 - q) / (1 + q)
    e1, e2 = c * np.cos(2 * phi), c * np.sin(2 * phi)
    xp = np.cos(phi) * x + np.sin(phi) * y
    yp = -np.sin(phi) * x + np.cos(phi) * y
    want = q * xp**2 + yp**2 / q
    got = elliptical_radius_sq(
        jnp.asarray(x, _dtype()),
        jnp.asarray(y, _dtype()),
        jnp.asarray(e1, _dtype()),
        jnp.asarray(e2, _dtype()),
    )
    np.testing.assert_allclose(np.asarray(got), want, rtol=100 * default_eps())


def test_ellipticity_conversions_round_trip():
    import equilens as el

    e1, e2 = el.ellipticity_from_q_phi(0.7, 0.4)
    q, phi = el.q_phi_from_ellipticity(e1, e2)
    assert q == pytest.approx(0.7, rel=1e-14) and phi == pytest.approx(0.4, rel=1e-14)
    assert np.hypot(e1, e2) == pytest.approx(0.3 / 1.7, rel=1e-14)
