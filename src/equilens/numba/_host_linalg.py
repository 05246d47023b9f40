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
`LAPACK_THREADS` BLAS threads (`equilens.numba._runtime`), and at most half of Numba's
(`_lapack_threads`).

`sparse_system_solve` does the same for the sparse route's whole system (curvature matrix
from the tile kernels, regularization, linear light) in one host call, without the scaling
(Cholesky's backward error does not depend on a diagonal scaling) on the envelope that the
tile kernels found (the matrix is not scanned for it), and returns with the solution the
data misfit plus regularization term (`t^T t - x^T b`, so that the evidence does not need
the model image); its reverse-mode rule forms `a^-1` only on the factor's envelope (a
selected inverse, `_envelope_kernels.envelope_inverse`), which holds every entry its
cotangents read, from the factor that the forward call left on the host with its tile
blocks of `C` (`_FactorStore`; recomputed if missing).
"""

import collections
import functools
import threading

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, Scalar

from .._callback import host_callback
from ..source._geometry import SparseSymmetric
from ._operands import kernel_operands
from ._runtime import LAPACK_THREADS, _threads, blas_threads, host64, run_kernel
from ._sparse_tables import SparseTables, table_arrays


def _lapack_threads() -> int:
    """BLAS threads for the host solve's LAPACK calls: half of Numba's threads, at least
    one and at most `LAPACK_THREADS`. BLAS's worker threads spin for a while after a call
    and then take cores from the next call's Numba kernels: on 2 cores, LAPACK on 2
    threads was no faster than on 1 and made the next tile kernel 1.5-2.5x slower
    (the evidence on 2 Numba threads 17.8 -> 12.4 ms with 1); on 16 cores, 8 were the
    fastest (docs/performance.md)."""
    return max(1, min(LAPACK_THREADS, _threads() // 2))


@functools.cache
def _lapack():
    """LAPACK's float64 `potrs` and `potri` (through SciPy)."""
    from scipy.linalg import get_lapack_funcs

    return get_lapack_funcs(("potrs", "potri"), dtype=np.float64)


def _factor(
    a: np.ndarray,
    start: np.ndarray | None = None,
    split: int | None = None,
    triangular: bool = True,
    scaled: bool = True,
    y: np.ndarray | None = None,
) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
    """The upper Cholesky factor of the Jacobi-scaled `S a S` (`S = diag(scale)`,
    `scale = 1 / sqrt(diag a)`) of a symmetric C-order float64 `a`, in place, `scale` and
    the envelope's first rows per column (from `start`, the structure's, when given); the
    factor is None if `a` is not positive definite. Without `scaled`, `a` itself is
    factored (`scale` is ones) on the envelope `start`, which must then hold every
    non-zero of its upper triangle (nothing is scanned). (The memory of `a` is the
    Fortran-order `a^T = a`, whose lower factor `L` is `U^T`.) Only the envelope of the
    upper triangle is factored (`_envelope_kernels.envelope_cholesky`: the same factor, in
    a fraction of the dense flops when the rows' non-zeros start near the diagonal), in
    blocks that begin again at `split` (the dense linear-light rows). With `triangular`,
    the strict lower triangle is zeroed (the factor goes to JAX); without, it is left as
    it was (the host's own solves and inverses read the upper triangle only). With `y`
    (float64, length n; only without `scaled`), also `U^T y' = y` in place (the forward
    half of a solve, done while the factor's rows are still in cache; `_envelope_solve`
    with `forward=False` finishes it)."""
    from ._envelope_kernels import cholesky_envelope, zero_lower

    n = a.shape[0]
    scale = np.empty(n) if scaled else None
    start = np.arange(n) if start is None else start
    info = cholesky_envelope(a, scale, start, split, y=y)
    scale = np.ones(n) if scale is None else scale
    if info != 0:
        return None, scale, start
    return (zero_lower(a) if triangular else a), scale, start


def _envelope_solve(
    u: np.ndarray, scale: np.ndarray, b: np.ndarray, start: np.ndarray, forward: bool = True
):
    """`a^-1 b` from the factor `u` of `S a S` (`_factor`) and its envelope `start`
    (without `forward`, `b` is already `U^-T S b`, from `_factor`'s `y`)."""
    from ._envelope_kernels import envelope_solve

    return envelope_solve(u, start, b * scale if forward else b, forward) * scale


def _solve_factored(
    a: np.ndarray,
    b: np.ndarray,
    start: np.ndarray | None = None,
    split: int | None = None,
    triangular: bool = True,
    scaled: bool = True,
):
    """`x = a^-1 b`, `log det a`, the factor, scale and envelope of `_factor` (`a` C-order
    float64, overwritten; `b` float64); NaN `x` and log det and a None factor when `a` is
    not positive definite."""
    # (unscaled, the forward half of the solve runs inside the factorisation)
    y = None if scaled else np.array(b, np.float64)
    with blas_threads(_lapack_threads()):
        u, scale, start = _factor(a, start, split, triangular, scaled, y)
    if u is None:
        return np.full(b.shape[0], np.nan), np.nan, None, scale, start
    logdet = 2.0 * (np.sum(np.log(np.diagonal(u))) - np.sum(np.log(scale)))
    x = _envelope_solve(u, scale, b if y is None else y, start, forward=y is None)
    return x, logdet, u, scale, start


def _inverse(
    u: np.ndarray,
    scale: np.ndarray,
    x_bar: np.ndarray,
    start: np.ndarray | None = None,
    split: int | None = None,
):
    """`a^-1 x_bar` and (the upper triangle of) `Z = (S a S)^-1`, in place of a writable
    float64 copy `u` of the factor (`a^-1 = S Z S`): all of it (LAPACK's `potri`), or,
    given the factor's envelope `start` (and `split`), only on that envelope
    (`_envelope_kernels.envelope_inverse`: exact there and on its diagonal blocks, the
    factor's zeros in the rest of the upper triangle)."""
    from ._envelope_kernels import inverse_envelope

    with blas_threads(_lapack_threads()):
        if start is not None:
            # (a zero x_bar, as for the evidence, which reads x only through the misfit:
            # no solve)
            y = _envelope_solve(u, scale, x_bar, start) if x_bar.any() else np.zeros_like(x_bar)
            inverse_envelope(u, start, split)
            return y, u
        y, _ = _lapack()[0](u.T, x_bar * scale, lower=1)
        # U^T (Fortran order) is the lower factor; potri writes the lower triangle of the
        # inverse there, i.e. the upper triangle of `u`.
        lower, _ = _lapack()[1](u.T, lower=1, overwrite_c=1)
    return y * scale, lower.T


def _outputs(solved: tuple, dtype, keep_factor: bool) -> tuple:
    """`_solve_factored`'s results in `dtype` for JAX: `x`, `log det` and, with
    `keep_factor`, the factor (NaN when there is none) and the scale."""
    x, logdet, u, scale, _ = solved
    out = (x.astype(dtype), np.asarray(logdet, dtype))
    if not keep_factor:
        return out
    n = x.shape[0]
    u = np.full((n, n), np.nan) if u is None else u
    return (*out, u.astype(dtype, copy=False), scale.astype(dtype))


def _solve_host(a, b, keep_factor: bool):
    solved = _solve_factored(np.array(a, dtype=np.float64), np.asarray(b, np.float64))
    return _outputs(solved, b.dtype, keep_factor)


def _solve_bwd_host(u, scale, x, x_bar, l_bar):
    n = x.shape[0]
    if not np.all(np.isfinite(u)):
        return np.zeros((n, n), u.dtype), np.zeros(n, u.dtype)
    from ._envelope_kernels import inverse_cotangent

    scale, x, x_bar = (np.asarray(v, np.float64) for v in (scale, x, x_bar))
    b_bar, z = _inverse(np.array(u, dtype=np.float64), scale, x_bar)
    z, scale, b_bar, x = kernel_operands(z, scale, b_bar, x)
    a_bar = inverse_cotangent(z, scale, b_bar, x, float(l_bar), 0, n)
    return a_bar.astype(u.dtype, copy=False), b_bar.astype(u.dtype, copy=False)


def _solve(a, b, keep_factor: bool):
    shapes = (jax.ShapeDtypeStruct(b.shape, b.dtype), jax.ShapeDtypeStruct((), b.dtype))
    if keep_factor:
        shapes = (*shapes, jax.ShapeDtypeStruct(a.shape, a.dtype), shapes[0])
    host = functools.partial(_solve_host, keep_factor=keep_factor)
    return host_callback(host, shapes, a, b, vmap_method="sequential")


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
    return host_callback(
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


def _entries_logdet_host(rows, cols, values, *, n: int, cotangent: bool):
    # log det of the symmetric matrix with these entries (`SparseSymmetric`'s convention),
    # factored on the envelope of its pattern (a regularization's 5-point stencil on an
    # N x N mesh: bandwidth N, n N^2 multiply-adds against n^3 / 3 dense); with
    # `cotangent`, also d log det / d values (the selected inverse on the envelope, read at
    # the entries: twice off the diagonal); NaN and zeros when it is not positive definite
    from ._envelope_kernels import add_entries, entries_cotangent, inverse_envelope

    dtype = values.dtype
    rows, cols, values = host64(rows, cols, values)
    _check_pattern(rows, cols, n)
    rows, cols, values = kernel_operands(rows, cols, values)
    a = np.zeros((n, n))  # (pages touched only on the envelope)
    start = np.arange(n)
    add_entries(a, start, rows, cols, values)
    with blas_threads(_lapack_threads()):
        u, _, start = _factor(a, start, triangular=False, scaled=False)
        if u is None:
            nan = np.asarray(np.nan, dtype)
            return (nan, np.zeros(values.shape, dtype)) if cotangent else (nan,)
        logdet = np.asarray(2.0 * np.sum(np.log(np.diagonal(u))), dtype)
        if not cotangent:
            return (logdet,)
        inverse_envelope(u, start)
    z, ones, zero = kernel_operands(u, np.ones(n), np.zeros(n))
    g = entries_cotangent(z, ones, zero, zero, 1.0, rows, cols)
    return logdet, g.astype(dtype, copy=False)


def _entries_logdet_call(values, rows, cols, n: int, cotangent: bool):
    shapes = (jax.ShapeDtypeStruct((), values.dtype),)
    if cotangent:
        shapes = (*shapes, jax.ShapeDtypeStruct(values.shape, values.dtype))
    host = functools.partial(_entries_logdet_host, n=n, cotangent=cotangent)
    return host_callback(host, shapes, rows, cols, values, vmap_method="sequential")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _entries_logdet(values, rows, cols, n):
    return _entries_logdet_call(values, rows, cols, n, False)[0]


def _entries_logdet_fwd(values, rows, cols, n):
    logdet, g = _entries_logdet_call(values, rows, cols, n, True)
    return logdet, (g, rows, cols)


def _entries_logdet_bwd(n, residuals, l_bar):
    del n
    g, rows, cols = residuals
    zero = np.zeros(rows.shape, jax.dtypes.float0)
    return l_bar * g, zero, np.zeros(cols.shape, jax.dtypes.float0)


_entries_logdet.defvjp(_entries_logdet_fwd, _entries_logdet_bwd)


def host_entries_logdet(entries: SparseSymmetric) -> Scalar:
    """`log det` of the symmetric positive-definite matrix `entries` (`SparseSymmetric`)
    on the host CPU: factored on its pattern's envelope (`_envelope_kernels`), and
    reverse-mode differentiable in its values (the selected inverse on the envelope, read
    at the entries; computed in the forward call when differentiated). NaN (and a zero
    cotangent) when it is not positive definite. For a brightness-adaptive regularization
    on a 40 x 40 mesh it replaces a dense factorisation and inverse of 1,600 x 1,600
    (docs/performance.md)."""
    return _entries_logdet(entries.values, entries.rows, entries.cols, entries.n)


def _rotate(v, k: int):
    # v's entries from k on, then those before: [linear, source] (the caller's order) ->
    # [source, linear] (the host system's) with k = n_linear, and back with k = n_source
    return np.concatenate([v[k:], v[:k]])


def _system_solved(
    idx, w, values, inv_sigma, rows, cols, reg, gram, rhs, *tables, n_s: int, keep: bool
):
    # a = [[F + reg, E1], [E1^T, gram]] (only its upper triangle is formed; F's in place),
    # b = [E0, rhs], with [E0, E1] = E, solved: x (in this order), log det a, the misfit
    # t^T t - x^T b (t = values[:, 0]: chi2 + s^T reg s at the solution), the factor
    # (None when a is not positive definite), its scale, the selected inverse's envelope,
    # all float64, and the tile blocks of C (kept with `keep`, for the reverse pass: see
    # `_sparse_kernels.forward_into`). The linear-light rows come last, so that their
    # dense rows do not widen the envelope of the source's. `reg` is dense (n_s x n_s) or
    # the values of the entries at (rows, cols) (`SparseSymmetric`).
    o = gram.shape[0]
    n = n_s + o
    idx, w, values, inv_sigma, rows, cols, reg, gram, rhs, *tables = host64(
        idx, w, values, inv_sigma, rows, cols, reg, gram, rhs, *tables
    )
    a = np.empty((n, n))
    e, first, nonzero, blocks = run_kernel(
        "forward_into", a, 0, n_s, idx, w, values, inv_sigma, *tables, keep=keep
    )
    from ._envelope_kernels import add_entries, add_upper

    # the factor's envelope: the non-zeros of F (from its tile blocks) + reg (the entries
    # of a sparse reg, whatever their values; a dense reg's are scanned), the linear rows
    # dense
    start = np.concatenate([nonzero, np.zeros(o, np.int64)])
    if reg.ndim == 2:
        (reg,) = kernel_operands(reg)
        add_upper(a, 0, reg, start)
    else:
        _check_pattern(rows, cols, n_s)
        rows, cols, reg = kernel_operands(rows, cols, reg)
        add_entries(a, start, rows, cols, reg)
    a[:n_s, n_s:] = e[:, 1:]
    a[n_s:, n_s:] = gram
    b = np.concatenate([e[:, 0], rhs])
    if _leading_block_singular(gram):
        x, logdet, u, scale = np.full(n, np.nan), np.nan, None, np.ones(n)
    else:
        # (the factor stays on the host, where only its upper triangle is read)
        # (not Jacobi-scaled: Cholesky's backward error does not depend on a diagonal
        # scaling, and the envelope is known, so `a` is not read once more)
        x, logdet, u, scale, start = _solve_factored(
            a, b, start, n_s, triangular=False, scaled=False
        )
    # the selected inverse's (for the reverse-mode rule): that and F's structure (every
    # pair of source pixels that share a tile: the entries the backward kernel reads, some
    # of which can be zero in F)
    start = np.minimum(start, np.concatenate([first, np.zeros(o, np.int64)]))
    return x, logdet, _misfit(values[:, 0], x, b), u, scale, start, blocks


def _misfit(t: np.ndarray, x: np.ndarray, b: np.ndarray) -> float:
    """`t^T t - x^T b`: for `x` solving `a x = b`, `a = G + R`, `b = K^T t` with `G = K^T
    K` (the data's Gram matrix) and a regularization `R` acting on the source part `s` of
    `x`, this is `|t - K x|^2 + s^T R s` (chi2 plus the regularization term), without the
    model image: `x^T G x = x^T b - s^T R s`. In float64 it loses `log10(t^T t / misfit)`
    digits to cancellation (four at a signal-to-noise of 100 per pixel); NaN with `x`."""
    return float(t @ t - x @ b)


def _system_host(*args, n_s: int, keep_factor: bool, keep_blocks: bool):
    # x (in the caller's order [linear, source]) and log det a; with `keep_factor`, also
    # the token under which the factor (and, with `keep_blocks`, the tile blocks of C: the
    # reverse pass reads them only for the cotangents of w and values) waits on the host
    solved = _system_solved(*args, n_s=n_s, keep=keep_blocks)
    x, logdet, fit, u = solved[:4]
    dtype = args[1].dtype
    out = (_rotate(x, n_s).astype(dtype), np.asarray(logdet, dtype), np.asarray(fit, dtype))
    if not keep_factor:
        return out
    size = solved[-1][2].nbytes + (0 if u is None else u.nbytes)
    return (*out, np.asarray(_FACTORS.keep(solved, size), np.int32))


class _FactorStore:
    """What the sparse route's forward calls leave on the host for their reverse pass:
    the factor (which would otherwise go to JAX and back: two copies of 8 MiB at
    n = 1,024, and rounded to float32 in a float32 program) and the tile blocks of `C`
    (which the reverse pass would otherwise build again), under a token that the forward
    call returns; `size` is what an item holds in bytes. A reverse pass takes its item
    out; one that finds none (dropped to stay within `max_bytes`, or taken by another
    pass of the same call) recomputes it from the operands, so the store never changes a
    result."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._items: collections.OrderedDict[int, tuple] = collections.OrderedDict()
        self._bytes: dict[int, int] = {}
        self._next = 0
        self._lock = threading.Lock()

    def keep(self, item: tuple, size: int) -> int:
        with self._lock:
            self._next = self._next % (2**31 - 1) + 1
            token = self._next
            self._items[token] = item
            self._bytes[token] = size
            while sum(self._bytes.values()) > self.max_bytes and len(self._items) > 1:
                old, _ = self._items.popitem(last=False)
                del self._bytes[old]
            return token

    def take(self, token: int) -> tuple | None:
        with self._lock:
            self._bytes.pop(token, None)
            return self._items.pop(token, None)


#: At most this much memory of factors and tile blocks waits on the host between the
#: forward and reverse passes of the sparse route (more are recomputed in the reverse
#: pass).
FACTOR_STORE_BYTES = 512 * 2**20
_FACTORS = _FactorStore(FACTOR_STORE_BYTES)


def _check_pattern(rows: np.ndarray, cols: np.ndarray, n: int) -> None:
    """Raises if a sparse regularization's entry lies outside the `n x n` matrix."""
    if rows.size and (min(rows.min(), cols.min()) < 0 or max(rows.max(), cols.max()) >= n):
        raise ValueError(
            f"a SparseSymmetric regularization entry lies outside its {n} x {n} matrix"
        )


def _leading_block_singular(gram: np.ndarray) -> bool:
    """Whether the linear-light block (a principal block of the system: the system is
    positive definite only if it is) fails its own Jacobi-scaled Cholesky. Factored
    first, it would end the system's factorisation there; factored last (as the host
    orders it), round-off in the source block's Schur complement could let two identical
    linear components pass with a tiny pivot."""
    if gram.shape[0] == 0:
        return False
    d = np.diagonal(gram)
    s = np.where(d > 0, 1.0 / np.sqrt(np.where(d > 0, d, 1.0)), 1.0)
    try:
        np.linalg.cholesky(gram * s[:, None] * s[None, :])
    except np.linalg.LinAlgError:
        return True
    return False


#: The differentiable operands of `sparse_system_solve`, in order.
_DIFF: tuple[str, ...] = ("w", "values", "reg", "gram", "rhs")


def _system_bwd_host(token, x_bar, l_bar, m_bar, *args, o, need, selected, sparse_reg):
    # the cotangents of the operands named in `need` (`args`: those of `_system_solved`)
    # for those of x, log det a and the misfit m = t^T t - b^T a^-1 b (dm = 2 t^T dt
    # - 2 x^T db + x^T da x: with y = a^-1 x_bar, b_bar = y - 2 m_bar x and a_bar =
    # l_bar a^-1 - (y - m_bar x) x^T, the kernels' form with y - m_bar x in place of
    # b_bar)
    idx, w, values, inv_sigma, rows, cols = args[:6]
    tables = args[9:]
    dtype = w.dtype
    n_s = x_bar.shape[0] - o
    solved = _FACTORS.take(int(token))
    if solved is None:
        solved = _system_solved(*args, n_s=n_s, keep="w" in need or "values" in need)
    x, _, _, u, scale, start, blocks = solved
    if u is None:
        reg_shape = rows.shape if sparse_reg else (n_s, n_s)
        shapes = {"w": w.shape, "values": values.shape, "reg": reg_shape, "gram": (o, o)}
        return tuple(np.zeros(shapes.get(name, (o,)), dtype) for name in need)  # rhs: (o,)
    from ._envelope_kernels import entries_cotangent, inverse_cotangent

    x_bar = _rotate(np.asarray(x_bar, np.float64), o)
    l_bar = float(l_bar)
    m_bar = float(m_bar)
    # (S Z S = a^-1 is needed on F's, E1's and gram's entries, all inside the envelope;
    # on reg's too, which holds them unless its zeros can move: a dense reg and `selected`
    # False)
    whole = "reg" in need and not (selected or sparse_reg)
    y, z = _inverse(u, scale, x_bar, None if whole else start, n_s)
    b_bar = y - 2.0 * m_bar * x
    y -= m_bar * x  # (a_bar's vector)
    out: dict[str, np.ndarray] = {"rhs": b_bar[n_s:]}
    if "w" in need or "values" in need:
        # E's cotangent: [b_bar of E0, that of E1 (E1 is in a twice: a[:n_s, n_s:] and
        # its transpose): 2 l_bar (S Z S)[:n_s, n_s:] - b_bar[:n_s] x[n_s:]^T
        # - x[:n_s] b_bar[n_s:]^T]
        inv_cross = scale[:n_s, None] * z[:n_s, n_s:] * scale[None, n_s:]
        e_bar = np.empty((n_s, o + 1))
        e_bar[:, 0] = b_bar[:n_s]
        e_bar[:, 1:] = (
            2.0 * l_bar * inv_cross - np.outer(y[:n_s], x[n_s:]) - np.outer(x[:n_s], y[n_s:])
        )
        host = host64(idx, w, values, inv_sigma, *tables)
        out["w"], out["values"] = run_kernel(
            "backward_inverse",
            z,
            scale,
            y,
            x,
            l_bar,
            0,
            n_s,
            *host[:4],
            e_bar,
            *blocks,
            *host[4:],
        )
        out["values"][:, 0] += 2.0 * m_bar * host[2][:, 0]
    z, scale, y, x = kernel_operands(z, scale, y, x)
    if "reg" in need:
        if sparse_reg:
            rows, cols = kernel_operands(*host64(rows, cols))
            out["reg"] = entries_cotangent(z, scale, y, x, l_bar, rows, cols)
        else:
            out["reg"] = inverse_cotangent(z, scale, y, x, l_bar, 0, n_s)
    if "gram" in need:
        out["gram"] = inverse_cotangent(z, scale, y, x, l_bar, n_s, o)
    return tuple(out[name].astype(dtype, copy=False) for name in need)


def _system_args(diff, pattern, idx, inv_sigma, tables) -> tuple:
    # the operands of `_system_solved`, in its order
    w, values, reg, gram, rhs = diff
    return (idx, w, values, inv_sigma, *pattern, reg, gram, rhs, *table_arrays(tables))


def _system(
    diff, pattern, idx, inv_sigma, tables, n_s: int, keep_factor: bool, keep_blocks: bool = False
):
    w, _, _, gram, _ = diff
    n = gram.shape[0] + n_s
    scalar = jax.ShapeDtypeStruct((), w.dtype)
    shapes = (jax.ShapeDtypeStruct((n,), w.dtype), scalar, scalar)
    if keep_factor:
        shapes = (*shapes, jax.ShapeDtypeStruct((), jnp.int32))
    host = functools.partial(
        _system_host, n_s=n_s, keep_factor=keep_factor, keep_blocks=keep_factor and keep_blocks
    )
    args = _system_args(diff, pattern, idx, inv_sigma, tables)
    return host_callback(host, shapes, *args, vmap_method="sequential")


@eqx.filter_custom_vjp
def _sparse_system(diff, pattern, idx, inv_sigma, tables, n_s, selected):
    del selected
    return _system(diff, pattern, idx, inv_sigma, tables, n_s, keep_factor=False)


@_sparse_system.def_fwd
def _sparse_system_fwd(perturbed, diff, pattern, idx, inv_sigma, tables, n_s, selected):
    del selected
    # (the tile blocks only for a reverse pass that forms the cotangents of w or values)
    blocks = any(jax.tree.leaves(perturbed[:2]))
    x, logdet, fit, token = _system(
        diff, pattern, idx, inv_sigma, tables, n_s, keep_factor=True, keep_blocks=blocks
    )
    return (x, logdet, fit), token


@_sparse_system.def_bwd
def _sparse_system_bwd(
    residuals, g, perturbed, diff, pattern, idx, inv_sigma, tables, n_s, selected
):
    token = residuals
    w, _, reg, gram, _ = diff
    x_bar, l_bar, m_bar = g
    n = n_s + gram.shape[0]
    # (a symbolic-zero cotangent arrives as None)
    x_bar = jnp.zeros(n, w.dtype) if x_bar is None else x_bar
    l_bar = jnp.zeros((), w.dtype) if l_bar is None else l_bar
    m_bar = jnp.zeros((), w.dtype) if m_bar is None else m_bar
    arrays = dict(zip(_DIFF, diff, strict=True))
    need = tuple(name for name, p in zip(_DIFF, perturbed, strict=True) if p)
    shapes = tuple(jax.ShapeDtypeStruct(arrays[name].shape, w.dtype) for name in need)
    host = functools.partial(
        _system_bwd_host,
        o=gram.shape[0],
        need=need,
        selected=selected,
        sparse_reg=reg.ndim == 1,
    )
    args = (token, x_bar, l_bar, m_bar, *_system_args(diff, pattern, idx, inv_sigma, tables))
    got = host_callback(host, shapes, *args, vmap_method="sequential") if need else ()
    return tuple(dict(zip(need, got, strict=True)).get(name) for name in _DIFF)


def sparse_system_solve(
    idx: Int[Array, "p k"],
    w: Float[Array, "p k"],
    values: Float[Array, "n_mask m"],
    inv_sigma: Float[Array, " n_mask"],
    reg: Float[Array, "n_source n_source"] | SparseSymmetric,
    gram: Float[Array, "n_linear n_linear"],
    rhs: Float[Array, " n_linear"],
    tables: SparseTables,
    fixed_sparsity: bool = False,
) -> tuple[Float[Array, " n"], Scalar, Scalar]:
    """The sparse route's whole linear system in one host call: with `F`, `E = [E0, E1]`
    of `sparse_gram(idx, w, values, inv_sigma, n_source, tables)` (`E1`: `n_linear`
    columns), solves `a x = b` for `a = [[gram, E1^T], [E1, F + reg]]`, `b = [rhs, E0]`
    (`n = n_linear + n_source`) and returns `x`, `log det a` and the misfit
    `t^T t - x^T b` (`t = values[:, 0]`; see `_misfit`: when `values = [t, L^T]`,
    `gram = L L^T` and `rhs = L t`, as for an inversion, this is chi2 + `s^T reg s` at the
    solution, computed in float64 without the model image) (NaN, with zero cotangents,
    when `a` is not positive definite). The `n x n` matrices never leave the
    host (the factor waits there for the reverse pass), except a dense `reg` and its
    cotangent: two to six fewer `n^2` copies than `sparse_gram` followed by
    `host_cholesky_solve`. Reverse-mode differentiable in `w`, `values`,
    `reg` (a dense `reg`, or a `SparseSymmetric`'s values), `gram` and `rhs` (`reg` and
    `gram` symmetric; their upper triangles are read).

    The reverse-mode rule needs `a^-1` only on the entries that can vary: for a sparse
    `reg`, or a dense one with `fixed_sparsity` (`reg`'s zero entries stay zero, as every
    built-in regularization's do), it forms it only on the envelope of `a`'s factor (a
    selected inverse, exact there; a sparse `reg`'s entries are in it whatever their
    values), otherwise all of it; a dense `reg`'s cotangent is then exact only where
    `reg` (or `F`) is non-zero."""
    n_s = int(reg.n if isinstance(reg, SparseSymmetric) else reg.shape[0])
    if isinstance(reg, SparseSymmetric):
        pattern = (reg.rows, reg.cols)
        reg_values = reg.values
    else:
        empty = jnp.zeros(0, jnp.int32)
        pattern = (empty, empty)
        reg_values = reg
    fixed = jax.lax.stop_gradient((inv_sigma, tables, pattern))
    diff = (w, values, reg_values, gram, rhs)
    return _sparse_system(diff, fixed[2], idx, fixed[0], fixed[1], n_s, bool(fixed_sparsity))
