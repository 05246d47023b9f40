"""The Cholesky solve of the "sparse" route on the host CPU (LAPACK through SciPy): the
route already runs on the CPU, and there LAPACK's factorisation and inverse are several
times faster than XLA's (`benchmarks/bench_pixelized.py`).

`host_cholesky_solve(a, b)` returns `x = a^-1 b` and `log det a` of a symmetric
positive-definite `a`, in float64 on the host whatever the input precision, after a
symmetric Jacobi scaling `S a S` (`S = diag(a)^(-1/2)`; only the upper triangle of `a` is
read). Its reverse-mode rule keeps the upper Cholesky factor `U` of `S a S` and forms
`a^-1 = S (S a S)^-1 S` from it (LAPACK `potri`): `bbar = a^-1 xbar`,
`abar = lbar a^-1 - bbar x^T`. A matrix that is not positive definite gives NaN `x` and log
det, and a zero cotangent (callers mask the NaN evidence). LAPACK runs on at most
`LAPACK_THREADS` BLAS threads (`equilens.source._sparse`).
"""

import functools

import jax
import numpy as np
from jaxtyping import Array, Float, Scalar

from ._sparse import LAPACK_THREADS, blas_threads


@functools.cache
def _lapack():
    """LAPACK's float64 `potrf`, `potrs` and `potri` (through SciPy)."""
    from scipy.linalg import get_lapack_funcs

    return get_lapack_funcs(("potrf", "potrs", "potri"), dtype=np.float64)


def _factor(a: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
    """The upper Cholesky factor of the Jacobi-scaled `S a S` (`S = diag(scale)`,
    `scale = 1 / sqrt(diag a)`) of a symmetric C-order float64 `a`, in place, and `scale`;
    the factor is None if `a` is not positive definite. (The memory of `a` is the
    Fortran-order `a^T = a`, whose lower factor `L` is `U^T`.)"""
    from ._sparse_kernels import jacobi_upper, zero_lower

    scale = np.empty(a.shape[0])
    jacobi_upper(a, scale)
    # (LAPACK's own `clean` of the other triangle is several times slower than this loop)
    lower, info = _lapack()[0](a.T, lower=1, clean=0, overwrite_a=1)
    return (zero_lower(lower.T) if info == 0 else None), scale


def _solve_host(a, b, keep_factor: bool):
    with blas_threads(LAPACK_THREADS):
        u, scale = _factor(np.array(a, dtype=np.float64))
        n = b.shape[0]
        if u is None:
            x = np.full(n, np.nan, b.dtype)
            logdet = np.asarray(np.nan, b.dtype)
        else:
            y, _ = _lapack()[1](u.T, np.asarray(b, np.float64) * scale, lower=1)
            x = (y * scale).astype(b.dtype)
            value = 2.0 * (np.sum(np.log(np.diagonal(u))) - np.sum(np.log(scale)))
            logdet = np.asarray(value, b.dtype)
    if not keep_factor:
        return x, logdet
    u = np.full((n, n), np.nan) if u is None else u
    return x, logdet, u.astype(a.dtype, copy=False), scale.astype(b.dtype)


def _solve_bwd_host(u, scale, x, x_bar, l_bar):
    n = x.shape[0]
    if not np.all(np.isfinite(u)):
        return np.zeros((n, n), u.dtype), np.zeros(n, u.dtype)
    from ._sparse_kernels import solve_cotangent

    inv = np.array(u, dtype=np.float64)
    # U^T (Fortran order) is the lower factor; potri writes the lower triangle of the
    # inverse there, i.e. the upper triangle of `inv`.
    with blas_threads(LAPACK_THREADS):
        lower, _ = _lapack()[2](inv.T, lower=1, overwrite_c=1)
    b_bar = np.empty(n)
    a_bar = solve_cotangent(
        lower.T,
        np.asarray(scale, np.float64),
        np.asarray(x, np.float64),
        np.asarray(x_bar, np.float64),
        float(l_bar),
        b_bar,
    )
    return a_bar.astype(u.dtype, copy=False), b_bar.astype(u.dtype, copy=False)


def _solve(a, b, keep_factor: bool):
    shapes = (jax.ShapeDtypeStruct(b.shape, b.dtype), jax.ShapeDtypeStruct((), b.dtype))
    if keep_factor:
        shapes = (*shapes, jax.ShapeDtypeStruct(a.shape, a.dtype), shapes[0])
    host = functools.partial(_solve_host, keep_factor=keep_factor)
    return jax.pure_callback(host, shapes, a, b, vmap_method="sequential")


@jax.custom_vjp
def _cholesky_solve(a, b):
    # (the factor, an 8 MiB copy back from the host at n = 1000, only when differentiated)
    return _solve(a, b, keep_factor=False)


def _cholesky_solve_fwd(a, b):
    x, logdet, u, scale = _solve(a, b, keep_factor=True)
    return (x, logdet), (u, scale, x)


def _cholesky_solve_bwd(residuals, g):
    u, scale, x = residuals
    x_bar, l_bar = g
    shapes = (
        jax.ShapeDtypeStruct(u.shape, u.dtype),
        jax.ShapeDtypeStruct(x.shape, x.dtype),
    )
    return jax.pure_callback(
        _solve_bwd_host, shapes, u, scale, x, x_bar, l_bar, vmap_method="sequential"
    )


_cholesky_solve.defvjp(_cholesky_solve_fwd, _cholesky_solve_bwd)


def host_cholesky_solve(
    a: Float[Array, "n n"], b: Float[Array, " n"]
) -> tuple[Float[Array, " n"], Scalar]:
    """`x = a^-1 b` and `log det a` of the symmetric positive-definite `a` by LAPACK on the
    host CPU, reverse-mode differentiable in `a` and `b`. NaN (and a zero cotangent) when
    `a` is not positive definite."""
    return _cholesky_solve(a, b)
