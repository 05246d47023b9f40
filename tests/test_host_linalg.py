"""The host (LAPACK) Cholesky solve of the sparse route: values against NumPy, its
reverse-mode rule against JAX's own derivative of a dense solve, and bad input."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from equilens.numba._host_linalg import host_cholesky_solve
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

    from equilens.numba import _envelope_kernels, _host_linalg

    seen = []
    real = _host_linalg._lapack()

    def spy(f):
        def wrapped(*args, **kwargs):
            info = threadpoolctl.threadpool_info()
            seen.append(max(i["num_threads"] for i in info if i["user_api"] == "blas"))
            return f(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(_host_linalg, "_lapack", lambda: tuple(spy(f) for f in real))
    kernels = _envelope_kernels
    monkeypatch.setattr(kernels, "cholesky_envelope", spy(kernels.cholesky_envelope))
    monkeypatch.setattr(_host_linalg, "LAPACK_THREADS", cap)
    # (LAPACK takes at most half of Numba's threads: as on an 8-thread machine)
    monkeypatch.setattr(_host_linalg, "_threads", lambda: 8)
    a, b = _spd(30, seed=4)

    def loss(a, b):
        x, logdet = host_cholesky_solve(a, b)
        return jnp.sum(x) + logdet

    with threadpoolctl.threadpool_limits(limits=2, user_api="blas"):
        jax.block_until_ready(jax.grad(loss)(jnp.asarray(a), jnp.asarray(b)))
        # and restored afterwards
        info = threadpoolctl.threadpool_info()
        assert all(i["num_threads"] == 2 for i in info if i["user_api"] == "blas")
    # the factorisation (its solves run on the envelope, without BLAS), then potrs and
    # potri ran, each under min(cap, the 2 threads there were)
    assert len(seen) == 3
    assert all(n == min(cap, 2) for n in seen)
    # half of Numba's threads, at least one, at most the cap
    for numba_threads, want in [(1, 1), (2, 1), (5, min(cap, 2)), (16, min(cap, 8))]:
        monkeypatch.setattr(_host_linalg, "_threads", lambda n=numba_threads: n)
        assert _host_linalg._lapack_threads() == want


def _envelope_spd(n: int, seed: int) -> np.ndarray:
    """An SPD matrix whose rows' non-zeros start at varying distances left of the diagonal
    (a sum of random outer products of short vectors), with zero entries inside."""
    rng = np.random.default_rng(seed)
    a = 0.5 * np.eye(n)
    for _ in range(3 * n):
        i = int(rng.integers(0, n))
        width = int(rng.integers(1, 12 if rng.uniform() < 0.8 else n // 2))
        v = np.zeros(n)
        v[max(i - width, 0) : i + 1] = rng.normal(size=i + 1 - max(i - width, 0))
        v[rng.uniform(size=n) < 0.2] = 0.0
        a += np.outer(v, v)
    return a


@pytest.mark.parametrize("nb", [1, 7, 16, 64, 200])
def test_envelope_cholesky_is_the_dense_factor(nb):
    from equilens.numba import _envelope_kernels

    kernels = _envelope_kernels
    a = _envelope_spd(150, seed=nb)
    assert np.mean(a == 0.0) > 0.3
    upper = np.triu(a)  # (the lower triangle is never read)
    upper[np.tril_indices(150, -1)] = np.nan
    scale = np.empty(150)
    assert kernels.cholesky_envelope(upper, scale, nb=nb) == 0
    s = 1.0 / np.sqrt(np.diagonal(a))
    assert np.allclose(scale, s, rtol=1e-15, atol=0.0)
    ref = np.linalg.cholesky(a * s[:, None] * s[None, :]).T
    assert rel_err(np.triu(upper), ref) < 1e-13


def _banded_with_wide_rows(n: int, seed: int) -> np.ndarray:
    """An SPD matrix whose rows reach 5 to 30 columns left of the diagonal, except every
    40th row, which also has a few entries about 300 columns to its left (the pattern of
    the rectangular mesh's curvature matrix: local rows, and a few that couple distant
    source pixels)."""
    rng = np.random.default_rng(seed)
    a = np.zeros((n, n))
    for i in range(n):
        width = int(rng.integers(5, 30))
        a[i, max(i - width, 0) : i] = rng.normal(size=i - max(i - width, 0))
        if i % 40 == 39 and i >= 300:
            far = i - 300 + rng.choice(60, size=4, replace=False)
            a[i, far] = rng.normal(size=4)
    a = np.tril(a, -1)
    a = a + a.T
    return a + np.diag(np.abs(a).sum(axis=1) + 1.0)  # diagonally dominant


@pytest.mark.parametrize("nb", [48, 96])
def test_envelope_cholesky_solves_early_starting_rows_in_levels(nb):
    # the few rows that start far left of their block are solved apart, in levels, so
    # that the block's other rows keep their own window: still the dense factor
    from equilens.numba import _envelope_kernels

    kernels = _envelope_kernels
    n = 500
    a = _banded_with_wide_rows(n, seed=nb)
    upper = np.triu(a)
    upper[np.tril_indices(n, -1)] = np.nan  # (never read)
    scale = np.empty(n)
    start = np.arange(n)
    assert kernels.cholesky_envelope(upper, scale, start, nb=nb) == 0
    bounds = kernels.envelope_bounds(start, None, nb)
    cuts = np.empty(n + 1, np.int64)
    levels = [
        kernels._levels(start, bounds[b], bounds[b + 1], cuts)[0] for b in range(len(bounds) - 1)
    ]
    assert max(levels) >= 1  # the levels ran
    s = 1.0 / np.sqrt(np.diagonal(a))
    ref = np.linalg.cholesky(a * s[:, None] * s[None, :]).T
    assert rel_err(np.triu(upper), ref) < 1e-13


@pytest.mark.parametrize("split", [None, 420])
def test_envelope_solve_matches_numpy(split):
    # x = a^-1 b from the envelope factor, reading only the factor's envelope in the
    # upper triangle (NaN below it)
    from equilens.numba._host_linalg import _envelope_solve, _factor

    n = 500
    a = _banded_with_wide_rows(n, seed=1)
    if split is not None:  # dense trailing rows
        c = 0.05 * np.random.default_rng(2).normal(size=(n - split, split))
        a[split:, :split] = c
        a[:split, split:] = c.T
        a[split:, split:] += 50.0 * np.eye(n - split)
    b = np.random.default_rng(3).normal(size=n)
    work = np.triu(a)
    work[np.tril_indices(n, -1)] = np.nan
    start = np.arange(n) if split is None else np.r_[np.arange(split), np.zeros(n - split, int)]
    u, scale, start = _factor(work, start, split, triangular=False)
    assert u is not None and np.isnan(u[1, 0])  # the lower triangle left as it was
    x = _envelope_solve(u, scale, b, start)
    assert rel_err(x, np.linalg.solve(a, b)) < 1e-11


@pytest.mark.parametrize("case", ["levels", "split", "dense"])
def test_unscaled_solve_with_the_forward_half_in_the_factorisation(case):
    # the sparse route's solve: a not scaled, its exact envelope given, U^T y = b solved
    # block row by block row inside the factorisation (in the levels, the shared windows
    # and the diagonal blocks; on one dense block when the envelope is too wide), then
    # U x = y: x and log det as NumPy's
    from equilens.numba import _envelope_kernels as kernels
    from equilens.numba._host_linalg import _factor, _solve_factored

    n = 500
    split = 420 if case == "split" else None
    a = _banded_with_wide_rows(n, seed=4) if case != "dense" else _envelope_spd(n, seed=4)
    if case == "dense":
        a += np.outer(np.ones(n), np.ones(n))  # no zero left in the upper triangle
    if split is not None:
        c = 0.05 * np.random.default_rng(2).normal(size=(n - split, split))
        a[split:, :split] = c
        a[:split, split:] = c.T
        a[split:, split:] += 50.0 * np.eye(n - split)
    nonzero = np.triu(a) != 0.0
    start = np.argmax(nonzero, axis=0)  # each column's first non-zero row
    bounds = kernels.envelope_bounds(start, split)
    if case == "levels":
        cuts = np.empty(n + 1, np.int64)
        assert any(
            kernels._levels(start, bounds[i], bounds[i + 1], cuts)[0] > 0
            for i in range(len(bounds) - 1)
        )
    assert (len(bounds) == 2) == (case == "dense")
    b = np.random.default_rng(3).normal(size=n)
    work = np.triu(a)
    work[np.tril_indices(n, -1)] = np.nan  # (never read)
    x, logdet, u, _, _ = _solve_factored(work, b, start, split, triangular=False, scaled=False)
    assert u is not None
    assert rel_err(x, np.linalg.solve(a, b)) < 1e-11
    assert logdet == pytest.approx(np.linalg.slogdet(a)[1], rel=1e-12)
    with pytest.raises(ValueError, match="unscaled"):
        _factor(np.triu(a), start, split, scaled=True, y=b.copy())


@pytest.mark.parametrize("nb", [4, 64])
def test_envelope_cholesky_reports_where_positive_definiteness_fails(nb):
    from equilens.numba import _envelope_kernels

    a = _envelope_spd(40, seed=3)
    a[25, 25] = 1e-3  # the leading 26 x 26 block is no longer positive definite
    first = next(k for k in range(1, 41) if np.any(np.linalg.eigvalsh(a[:k, :k]) <= 0))
    info = _envelope_kernels.cholesky_envelope(np.triu(a), np.empty(40), nb=nb)
    assert info == first


@pytest.mark.parametrize("nb,split", [(1, None), (7, None), (16, 140), (64, 120), (200, None)])
def test_envelope_inverse_is_the_inverse_on_the_envelope(nb, split):
    # the selected inverse from the envelope factor: exact on the envelope (every entry a
    # structure's derivative can need) and finite elsewhere in the upper triangle, with
    # the linear-light rows (dense, after `split`) in blocks of their own
    from equilens.numba import _envelope_kernels

    kernels = _envelope_kernels
    n = 150
    a = _envelope_spd(n, seed=nb)
    if split is not None:  # dense trailing rows, coupled to everything
        c = 0.05 * np.random.default_rng(7).normal(size=(n - split, split))
        a[split:, :split] = c
        a[:split, split:] = c.T
        a[split:, split:] += 50.0 * np.eye(n - split)
    start = np.arange(n)
    if nb == 7:  # a wider structure given than the non-zeros (kept: exact there too)
        start = np.maximum(start - 9, 0)
    u = np.triu(a)
    scale = np.empty(n)
    assert kernels.cholesky_envelope(u, scale, start, split, nb=nb) == 0
    z = np.triu(u)
    assert kernels.inverse_envelope(z, start, split, nb=nb) == 0
    ref = np.linalg.inv(a * scale[:, None] * scale[None, :])
    rows, cols = np.indices((n, n))
    envelope = (rows <= cols) & (rows >= start[None, :])
    assert np.mean(envelope[np.triu_indices(n)]) < (0.999 if split is None else 1.0)
    assert rel_err(np.where(envelope, z, 0.0), np.where(envelope, ref, 0.0)) < 1e-12
    assert np.all(np.isfinite(np.triu(z)))


def _stencil_entries(ny: int, nx: int, seed: int = 0):
    """A brightness-adaptive-like regularization on an ny x nx mesh: positive weights on
    the 5-point stencil's edges, a ridge on the diagonal given as repeated entries (as
    `AdaptiveBrightness` lists it), each pair once in either order."""
    from equilens.source._geometry import SparseSymmetric

    rng = np.random.default_rng(seed)
    n = ny * nx
    rows, cols, vals = [], [], []
    for i in range(n):
        r, c = divmod(i, nx)
        for j in ([i + 1] if c + 1 < nx else []) + ([i + nx] if r + 1 < ny else []):
            w = rng.uniform(0.5, 2.0)
            pair = (i, j) if rng.random() < 0.5 else (j, i)  # either order
            rows += [pair[0], i, j]
            cols += [pair[1], i, j]
            vals += [-w, w, w]
    rows += list(range(n))
    cols += list(range(n))
    vals += list(rng.uniform(0.01, 0.1, n))  # the ridge, repeated diagonal entries
    return SparseSymmetric(np.asarray(rows), np.asarray(cols), jnp.asarray(vals), n)


def test_entries_log_det_and_its_gradient_match_the_dense_factorisation():
    from equilens.inversion import logdet_psd
    from equilens.numba._host_linalg import host_entries_logdet

    entries = _stencil_entries(9, 12)
    dense = np.asarray(entries.todense(), np.float64)
    got = jax.jit(host_entries_logdet)(entries)
    assert got.dtype == entries.values.dtype
    assert abs(float(got) - np.linalg.slogdet(dense)[1]) < TOL * abs(np.linalg.slogdet(dense)[1])

    def with_values(f, v):
        return f(type(entries)(entries.rows, entries.cols, v, entries.n))

    g = jax.jit(jax.grad(lambda v: with_values(host_entries_logdet, v)))(entries.values)
    ref = jax.grad(lambda v: with_values(lambda e: logdet_psd(e.todense()), v))(entries.values)
    assert rel_err(g, ref) < 10 * TOL
    # (vmapped: one host call per matrix)
    v2 = jnp.stack([entries.values, 2.0 * entries.values])
    both = jax.vmap(lambda v: with_values(host_entries_logdet, v))(v2)
    assert float(both[1] - both[0]) == pytest.approx(entries.n * math.log(2.0), rel=TOL)


def test_entries_log_det_of_a_matrix_not_positive_definite_is_nan_with_a_zero_cotangent():
    from equilens.numba._host_linalg import host_entries_logdet

    entries = _stencil_entries(4, 5)
    v = entries.values.at[-3].set(-10.0)  # a negative ridge entry: not positive definite
    f = lambda v: host_entries_logdet(type(entries)(entries.rows, entries.cols, v, entries.n))
    assert bool(jnp.isnan(f(v)))
    assert bool(jnp.all(jax.grad(f)(v) == 0.0))


def test_the_sparse_route_factors_a_regularizations_entries_and_the_dense_route_does_not():
    from equilens.inversion import DenseRoute
    from equilens.numba._sparse_route import SparseRoute

    entries = _stencil_entries(6, 7)
    expected = np.linalg.slogdet(np.asarray(entries.todense(), np.float64))[1]
    assert DenseRoute().entries_logdet(entries) is None
    got = SparseRoute.entries_logdet(None, entries)  # pyright: ignore[reportArgumentType]
    assert abs(float(got) - expected) < TOL * abs(expected)
