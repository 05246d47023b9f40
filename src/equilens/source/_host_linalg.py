"""The Cholesky solves of the "sparse" route on the host CPU (BLAS and LAPACK through
SciPy): the route already runs on the CPU, and there LAPACK's factorisation and inverse are
several times faster than XLA's (`benchmarks/bench_pixelized.py`).

`host_cholesky_solve(a, b)` returns `x = a^-1 b` and `log det a` of a symmetric
positive-definite `a`, in float64 on the host whatever the input precision, after a
symmetric Jacobi scaling `S a S` (`S = diag(a)^(-1/2)`; only the upper triangle of `a` is
read), factored on its envelope (blocked: BLAS `trsm`/`syrk` and LAPACK `potrf`). Its
reverse-mode rule keeps the upper Cholesky factor `U` of `S a S` and forms
`a^-1 = S (S a S)^-1 S` from it (LAPACK `potri`): `bbar = a^-1 xbar`,
`abar = lbar a^-1 - bbar x^T`. A matrix that is not positive definite gives NaN `x` and log
det, and a zero cotangent (callers mask the NaN evidence). LAPACK runs on at most
`LAPACK_THREADS` BLAS threads (`equilens.source._sparse`).

`sparse_system_solve` does the same for the sparse route's whole system (curvature matrix
from the tile kernels, regularization, linear light) in one host call.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, Scalar

from ._sparse import (
    LAPACK_THREADS,
    SparseTables,
    blas_threads,
    host64,
    run_kernel,
    table_arrays,
)


@functools.cache
def _lapack():
    """LAPACK's float64 `potrs` and `potri` (through SciPy)."""
    from scipy.linalg import get_lapack_funcs

    return get_lapack_funcs(("potrs", "potri"), dtype=np.float64)


def _factor(a: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
    """The upper Cholesky factor of the Jacobi-scaled `S a S` (`S = diag(scale)`,
    `scale = 1 / sqrt(diag a)`) of a symmetric C-order float64 `a`, in place, and `scale`;
    the factor is None if `a` is not positive definite. (The memory of `a` is the
    Fortran-order `a^T = a`, whose lower factor `L` is `U^T`.) Only the envelope of the
    upper triangle is factored (`_sparse_kernels.envelope_cholesky`: the same factor, in
    a fraction of the dense flops when the rows' non-zeros start near the diagonal)."""
    from ._sparse_kernels import cholesky_envelope, zero_lower

    scale = np.empty(a.shape[0])
    info = cholesky_envelope(a, scale)
    return (zero_lower(a) if info == 0 else None), scale


def _solve_factored(a: np.ndarray, b: np.ndarray):
    """`x = a^-1 b`, `log det a`, the factor and scale of `_factor` (`a` C-order float64,
    overwritten; `b` float64); NaN `x` and log det and a None factor when `a` is not
    positive definite."""
    with blas_threads(LAPACK_THREADS):
        u, scale = _factor(a)
        if u is None:
            return np.full(b.shape[0], np.nan), np.nan, None, scale
        y, _ = _lapack()[0](u.T, b * scale, lower=1)
    logdet = 2.0 * (np.sum(np.log(np.diagonal(u))) - np.sum(np.log(scale)))
    return y * scale, logdet, u, scale


def _inverse(u: np.ndarray, scale: np.ndarray, x_bar: np.ndarray):
    """`a^-1 x_bar` and (the upper triangle of) `Z = (S a S)^-1`, in place of a writable
    float64 copy `u` of the factor (`a^-1 = S Z S`)."""
    with blas_threads(LAPACK_THREADS):
        y, _ = _lapack()[0](u.T, x_bar * scale, lower=1)
        # U^T (Fortran order) is the lower factor; potri writes the lower triangle of the
        # inverse there, i.e. the upper triangle of `u`.
        lower, _ = _lapack()[1](u.T, lower=1, overwrite_c=1)
    return y * scale, lower.T


def _outputs(solved: tuple, dtype, keep_factor: bool) -> tuple:
    """`_solve_factored`'s results in `dtype` for JAX: `x`, `log det` and, with
    `keep_factor`, the factor (NaN when there is none) and the scale."""
    x, logdet, u, scale = solved
    out = (x.astype(dtype), np.asarray(logdet, dtype))
    if not keep_factor:
        return out
    n = x.shape[0]
    u = np.full((n, n), np.nan) if u is None else u
    return *out, u.astype(dtype, copy=False), scale.astype(dtype)


def _solve_host(a, b, keep_factor: bool):
    solved = _solve_factored(np.array(a, dtype=np.float64), np.asarray(b, np.float64))
    return _outputs(solved, b.dtype, keep_factor)


def _solve_bwd_host(u, scale, x, x_bar, l_bar):
    n = x.shape[0]
    if not np.all(np.isfinite(u)):
        return np.zeros((n, n), u.dtype), np.zeros(n, u.dtype)
    from ._sparse_kernels import inverse_cotangent

    scale, x, x_bar = (np.asarray(v, np.float64) for v in (scale, x, x_bar))
    b_bar, z = _inverse(np.array(u, dtype=np.float64), scale, x_bar)
    a_bar = inverse_cotangent(z, scale, b_bar, x, float(l_bar), 0)
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


def _system_host(idx, w, values, inv_sigma, reg, gram, rhs, *tables, keep_factor: bool):
    # a = [[gram, E1^T], [E1, F + reg]] (only its upper triangle is formed; F's in place),
    # b = [rhs, E0], with [E0, E1] = E: solved, factor kept when differentiated
    dtype = w.dtype
    o = gram.shape[0]
    n = o + reg.shape[0]
    idx, w, values, inv_sigma, reg, gram, rhs, *tables = host64(
        idx, w, values, inv_sigma, reg, gram, rhs, *tables
    )
    a = np.empty((n, n))
    e = run_kernel("forward_into", a, o, idx, w, values, inv_sigma, *tables)
    from ._sparse_kernels import add_upper

    add_upper(a, o, reg)
    a[:o, :o] = gram
    a[:o, o:] = e[:, 1:].T
    solved = _solve_factored(a, np.concatenate([rhs, e[:, 0]]))
    return _outputs(solved, dtype, keep_factor)


#: The differentiable operands of `sparse_system_solve`, in order.
_DIFF: tuple[str, ...] = ("w", "values", "reg", "gram", "rhs")


def _system_bwd_host(u, scale, x, x_bar, l_bar, idx, w, values, inv_sigma, *tables, o, need):
    # the cotangents of the operands named in `need` (see `_system_host`)
    n = x.shape[0]
    dtype = u.dtype
    if not np.all(np.isfinite(u)):
        shapes = {"w": w.shape, "values": values.shape, "reg": (n - o,) * 2, "gram": (o, o)}
        return tuple(np.zeros(shapes.get(key, (o,)), dtype) for key in need)  # rhs: (o,)
    from ._sparse_kernels import inverse_cotangent

    scale, x, x_bar = (np.asarray(v, np.float64) for v in (scale, x, x_bar))
    l_bar = float(l_bar)
    b_bar, z = _inverse(np.array(u, dtype=np.float64), scale, x_bar)
    out: dict[str, np.ndarray] = {"rhs": b_bar[:o]}
    if "w" in need or "values" in need:
        # E's cotangent: [b_bar of E0, that of E1 (E1 is in a twice: a[o:, :o] and its
        # transpose a[:o, o:]): 2 l_bar (S Z S)[o:, :o] - b_bar[o:] x[:o]^T - x[o:] b_bar[:o]^T]
        inv_cross = scale[o:, None] * z[:o, o:].T * scale[None, :o]
        e_bar = np.empty((n - o, o + 1))
        e_bar[:, 0] = b_bar[o:]
        e_bar[:, 1:] = (
            2.0 * l_bar * inv_cross - np.outer(b_bar[o:], x[:o]) - np.outer(x[o:], b_bar[:o])
        )
        args = host64(idx, w, values, inv_sigma, *tables)
        out["w"], out["values"] = run_kernel(
            "backward_inverse", z, scale, b_bar, x, l_bar, o, *args[:4], e_bar, *args[4:]
        )
    if "reg" in need:
        out["reg"] = inverse_cotangent(z, scale, b_bar, x, l_bar, o)
    if "gram" in need:
        out["gram"] = inverse_cotangent(z[:o, :o], scale, b_bar, x, l_bar, 0)
    return tuple(out[key].astype(dtype, copy=False) for key in need)


def _system(diff, idx, inv_sigma, tables, keep_factor: bool):
    w, values, reg, gram, rhs = diff
    n = gram.shape[0] + reg.shape[0]
    shapes = (jax.ShapeDtypeStruct((n,), w.dtype), jax.ShapeDtypeStruct((), w.dtype))
    if keep_factor:
        shapes = (*shapes, jax.ShapeDtypeStruct((n, n), w.dtype), shapes[0])
    host = functools.partial(_system_host, keep_factor=keep_factor)
    args = (idx, w, values, inv_sigma, reg, gram, rhs, *table_arrays(tables))
    return jax.pure_callback(host, shapes, *args, vmap_method="sequential")


@eqx.filter_custom_vjp
def _sparse_system(diff, idx, inv_sigma, tables):
    return _system(diff, idx, inv_sigma, tables, keep_factor=False)


@_sparse_system.def_fwd
def _sparse_system_fwd(perturbed, diff, idx, inv_sigma, tables):
    del perturbed
    x, logdet, u, scale = _system(diff, idx, inv_sigma, tables, keep_factor=True)
    return (x, logdet), (u, scale, x)


@_sparse_system.def_bwd
def _sparse_system_bwd(residuals, g, perturbed, diff, idx, inv_sigma, tables):
    u, scale, x = residuals
    w, values, _, gram, _ = diff
    x_bar, l_bar = g
    # (a symbolic-zero cotangent arrives as None)
    x_bar = jnp.zeros_like(x) if x_bar is None else x_bar
    l_bar = jnp.zeros((), x.dtype) if l_bar is None else l_bar
    arrays = dict(zip(_DIFF, diff, strict=True))
    need = tuple(key for key, p in zip(_DIFF, perturbed, strict=True) if p)
    shapes = tuple(jax.ShapeDtypeStruct(arrays[key].shape, x.dtype) for key in need)
    host = functools.partial(_system_bwd_host, o=gram.shape[0], need=need)
    args = (u, scale, x, x_bar, l_bar, idx, w, values, inv_sigma, *table_arrays(tables))
    got = jax.pure_callback(host, shapes, *args, vmap_method="sequential") if need else ()
    return tuple(dict(zip(need, got, strict=True)).get(key) for key in _DIFF)


def sparse_system_solve(
    idx: Int[Array, "p k"],
    w: Float[Array, "p k"],
    values: Float[Array, "n_mask m"],
    inv_sigma: Float[Array, " n_mask"],
    reg: Float[Array, "n_source n_source"],
    gram: Float[Array, "n_linear n_linear"],
    rhs: Float[Array, " n_linear"],
    tables: SparseTables,
) -> tuple[Float[Array, " n"], Scalar]:
    """The sparse route's whole linear system in one host call: with `F`, `E = [E0, E1]`
    of `sparse_gram(idx, w, values, inv_sigma, n_source, tables)` (`E1`: `n_linear`
    columns), solves `a x = b` for `a = [[gram, E1^T], [E1, F + reg]]`, `b = [rhs, E0]`
    (`n = n_linear + n_source`) and returns `x` and `log det a` (NaN, with zero
    cotangents, when `a` is not positive definite). The `n x n` matrices never leave the
    host, except the factor that the reverse-mode rule keeps (and `reg`'s cotangent, when
    `reg` is differentiated): two to six fewer `n^2` copies than `sparse_gram` followed
    by `host_cholesky_solve`. Reverse-mode differentiable in `w`, `values`, `reg`,
    `gram` and `rhs` (`reg` and `gram` symmetric; their upper triangles are read)."""
    fixed = jax.lax.stop_gradient((inv_sigma, tables))
    return _sparse_system((w, values, reg, gram, rhs), idx, fixed[0], fixed[1])
