"""The host (LAPACK) Cholesky solve of the sparse route: values against NumPy, its
reverse-mode rule against JAX's own derivative of a dense solve, and bad input."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from equilens.source._host_linalg import host_cholesky_solve
from helpers import rel_err

X64 = jax.config.read("jax_enable_x64")
TOL = 1e-10 if X64 else 2e-3


def _spd(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 2 * n))
    return x @ x.T / n + 0.1 * np.eye(n), rng.normal(size=n)


def _dense(a, b):
    return jnp.linalg.solve(a, b), jnp.linalg.slogdet(a)[1]


def test_solution_and_log_det_match_numpy():
    a, b = _spd(60)
    x, logdet = jax.jit(host_cholesky_solve)(jnp.asarray(a), jnp.asarray(b))
    assert x.dtype == jnp.asarray(b).dtype
    assert rel_err(x, np.linalg.solve(a, b)) < TOL
    assert abs(float(logdet) - np.linalg.slogdet(a)[1]) < TOL * abs(np.linalg.slogdet(a)[1])


def test_reverse_mode_matches_the_dense_derivative():
    a, b = _spd(40, seed=1)
    rng = np.random.default_rng(2)
    weights = jnp.asarray(rng.normal(size=b.shape[0]))

    def loss(solve, a, b):
        x, logdet = solve(a, b)
        return jnp.sum(weights * x) + 0.7 * logdet

    args = (jnp.asarray(a), jnp.asarray(b))
    got = jax.jit(jax.grad(lambda a, b: loss(host_cholesky_solve, a, b), argnums=(0, 1)))(*args)
    ref = jax.grad(lambda a, b: loss(_dense, a, b), argnums=(0, 1))(*args)
    assert rel_err(got[0], ref[0]) < 10 * TOL
    assert rel_err(got[1], ref[1]) < 10 * TOL


def test_vmap_matches_a_loop():
    pairs = [_spd(20, seed=s) for s in range(3)]
    a = jnp.asarray(np.stack([p[0] for p in pairs]))
    b = jnp.asarray(np.stack([p[1] for p in pairs]))
    xs, logdets = jax.vmap(host_cholesky_solve)(a, b)
    for i, (ai, bi) in enumerate(pairs):
        assert rel_err(xs[i], np.linalg.solve(ai, bi)) < TOL
        assert math.isclose(float(logdets[i]), np.linalg.slogdet(ai)[1], rel_tol=TOL)


@pytest.mark.parametrize("bad", ["indefinite", "nan"])
def test_not_positive_definite_gives_nan_and_a_zero_cotangent(bad):
    a, b = _spd(10)
    a[3, 3] = -5.0 if bad == "indefinite" else np.nan
    args = (jnp.asarray(a), jnp.asarray(b))
    x, logdet = host_cholesky_solve(*args)
    assert bool(jnp.all(jnp.isnan(x))) and bool(jnp.isnan(logdet))
    ga, gb = jax.grad(lambda a, b: host_cholesky_solve(a, b)[1], argnums=(0, 1))(*args)
    assert bool(jnp.all(ga == 0.0)) and bool(jnp.all(gb == 0.0))


@pytest.mark.parametrize("cap", [1, 8])
def test_lapack_threads_are_capped_and_never_raised(monkeypatch, cap):
    import threadpoolctl

    from equilens.source import _host_linalg

    seen = []
    real = _host_linalg._lapack()

    def spy(f):
        def wrapped(*args, **kwargs):
            info = threadpoolctl.threadpool_info()
            seen.append(max(i["num_threads"] for i in info if i["user_api"] == "blas"))
            return f(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(_host_linalg, "_lapack", lambda: tuple(spy(f) for f in real))
    monkeypatch.setattr(_host_linalg, "LAPACK_THREADS", cap)
    a, b = _spd(30, seed=4)

    def loss(a, b):
        x, logdet = host_cholesky_solve(a, b)
        return jnp.sum(x) + logdet

    with threadpoolctl.threadpool_limits(limits=2, user_api="blas"):
        jax.block_until_ready(jax.grad(loss)(jnp.asarray(a), jnp.asarray(b)))
        # and restored afterwards
        info = threadpoolctl.threadpool_info()
        assert all(i["num_threads"] == 2 for i in info if i["user_api"] == "blas")
    # potrf, potrs and potri ran, each under min(cap, the 2 threads there were)
    assert len(seen) == 3
    assert all(n == min(cap, 2) for n in seen)
