"""The linear algebra of a pixelized-source inversion (arrays only).

Notation (Suyu et al. 2006; Dye & Warren 2005; as PyAutoLens): `M` maps source values to
the image pixels they light (sparse: node indices and weights per image pixel), `B` is the
PSF convolution, `W = diag(1/sigma^2)` on the mask. Data vector `D = (BM)^T W d`,
curvature `F = (BM)^T W (BM)`, regularization `H`; the source solves `(F + H) s = D`.

Three routes give `F` (the third, "sparse", tiled Numba kernels for CPUs, is in
`equilens.source._sparse`):

- "dense": `BM` column by column (one batched FFT convolution of the mapping images),
  then the Gram matrix `C C^T` with `C = W^(1/2) B M`: `O(n_source^2 n_mask)` flops in one
  matrix product (what an accelerator does best).
- "w_tilde": `F = M^T W~ M` with `W~ = B^T W B` precomputed once per dataset as a banded
  table (each image pixel against the `(2K-1)^2` offsets within two PSF half-widths):
  `O(n_mapped (2K-1)^2 v)` scatter-adds, independent of the number of source pixels.
"""

import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
from jaxtyping import Array, Bool, Float, Int, Scalar

from .._grid import Grid
from ..psf import FFTConvolution
from ._geometry import AbstractGeometry

#: Accelerated projected-gradient iterations of the positive-only solve (both backends).
NONNEG_ITERATIONS = 500


def mapped_pixels(
    mask: Bool[np.ndarray, "ny nx"], kernel_shape: tuple[int, int]
) -> Int[np.ndarray, " p"]:
    """Flat indices of the pixels whose light can reach the mask through the PSF: the mask
    grown by the kernel's half-widths (the pixels a source is mapped to)."""
    from scipy.ndimage import binary_dilation

    m = np.asarray(mask, dtype=bool)
    grown = binary_dilation(m, structure=np.ones(kernel_shape, dtype=bool))
    return np.flatnonzero(grown | m)


def w_tilde_table(
    kernel: Float[np.ndarray, "ky kx"],
    weight: Float[np.ndarray, "ny nx"],
    mapped: Int[np.ndarray, " p"],
) -> tuple[Int[np.ndarray, "p o"], Float[np.ndarray, "p o"]]:
    """`W~ = B^T W B` restricted to the `mapped` pixels, as a banded table: for each mapped
    pixel `p` and each offset `o` within two kernel half-widths, the index (into `mapped`;
    `len(mapped)` where the neighbour is not mapped) of `q = p + o` and
    `W~[p, q] = sum_r weight[r] kernel[r - p] kernel[r - q]`. NumPy/SciPy, once per dataset."""
    from scipy.signal import correlate

    k = np.asarray(kernel, dtype=np.float64)
    ky, kx = k.shape
    hy, hx = ky // 2, kx // 2
    w = np.asarray(weight, dtype=np.float64)
    ny, nx = w.shape
    n_p = mapped.shape[0]
    lookup = np.full(ny * nx, n_p, dtype=np.int64)
    lookup[mapped] = np.arange(n_p)
    pr, pc = np.divmod(mapped, nx)
    offsets = [(dy, dx) for dy in range(-2 * hy, 2 * hy + 1) for dx in range(-2 * hx, 2 * hx + 1)]
    nbr = np.full((n_p, len(offsets)), n_p, dtype=np.int64)
    val = np.zeros((n_p, len(offsets)))
    padded = np.zeros((ky + 2 * ky, kx + 2 * kx))
    for j, (dy, dx) in enumerate(offsets):
        # prod[u] = kernel[u] kernel[u - o] on the kernel's support (u centred)
        shifted = padded.copy()
        shifted[ky + dy : 2 * ky + dy, kx + dx : 2 * kx + dx] = k
        prod = k * shifted[ky : 2 * ky, kx : 2 * kx]
        if not prod.any():
            continue
        # W~_o(p) = sum_u w(p + u) prod(u): a correlation of the weights with prod
        corr = correlate(w, prod, mode="same", method="fft" if ky * kx > 50 else "direct")
        qr, qc = pr + dy, pc + dx
        ok = (qr >= 0) & (qr < ny) & (qc >= 0) & (qc < nx)
        q = np.where(ok, qr * nx + qc, 0)
        idx = np.where(ok, lookup[q], n_p)
        nbr[:, j] = idx
        val[:, j] = np.where(idx < n_p, corr.reshape(-1)[mapped], 0.0)
    keep = np.any(val != 0.0, axis=0)
    return nbr[:, keep], val[:, keep]


def blur_mapping(
    idx: Int[Array, "p k"],
    w: Float[Array, "p k"],
    n_source: int,
    mapped: Int[Array, " p"],
    conv: FFTConvolution,
) -> Float[Array, "n_source ny nx"]:
    """`B M` as `n_source` images (each source pixel at unit value, blurred)."""
    ny, nx = conv.image_shape
    px = conv.fft_shape[1]
    cols = (mapped // nx) * px + mapped % nx
    m = jnp.zeros((n_source, ny * px), w.dtype).at[idx, cols[:, None]].add(w)
    return jax.vmap(conv.convolve_padded)(m.reshape(n_source, ny, px))


def curvature_w_tilde(
    idx: Int[Array, "p k"],
    w: Float[Array, "p k"],
    n_source: int,
    neighbours: Int[Array, "p o"],
    w_tilde: Float[Array, "p o"],
) -> Float[Array, "n_source n_source"]:
    """`F = M^T W~ M` from the banded `W~` table (see `w_tilde_table`)."""
    n_p, k = idx.shape
    idx_pad = jnp.concatenate([idx, jnp.zeros((1, k), idx.dtype)])
    w_pad = jnp.concatenate([w, jnp.zeros((1, k), w.dtype)])
    # H = W~ M (mapped pixels x source pixels), then F = M^T H
    vals = w_tilde[:, :, None] * w_pad[neighbours]
    cols = idx_pad[neighbours]
    rows = jnp.broadcast_to(jnp.arange(n_p)[:, None, None], cols.shape)
    h = jnp.zeros((n_p, n_source), w.dtype).at[rows, cols].add(vals)
    contrib = (w[:, :, None] * h[:, None, :]).reshape(n_p * k, n_source)
    return jax.ops.segment_sum(contrib, idx.reshape(-1), n_source)


def map_to_source(
    idx: Int[Array, "p k"], w: Float[Array, "p k"], values: Float[Array, "p ..."], n_source: int
) -> Float[Array, "n_source ..."]:
    """`M^T v` for values `v` on the mapped pixels."""
    contrib = w.reshape(w.shape + (1,) * (values.ndim - 1)) * values[:, None]
    flat = contrib.reshape((-1, *values.shape[1:]))
    return jax.ops.segment_sum(flat, idx.reshape(-1), n_source)


def map_to_image(
    idx: Int[Array, "p k"], w: Float[Array, "p k"], values: Float[Array, " n_source"]
) -> Float[Array, " p"]:
    """`M s`: the (unblurred) flux of source `s` in each mapped pixel."""
    return jnp.sum(w * values[idx], axis=1)


class Solution(eqx.Module):
    """The solved linear system `(F + H) x = D` and the evidence's determinant terms."""

    x: Float[Array, " n"]
    log_det_curvature: Scalar
    factor: Float[Array, "n n"] | None
    scale: Float[Array, " n"]

    def inverse_diagonal(self) -> Float[Array, " n"]:
        """`diag((F + H)^-1)`: the variances of the solved values (Gaussian posterior).
        Needs the factor (a solve with `host=False`)."""
        if self.factor is None:
            raise ValueError("the errors need the Cholesky factor: solve with host=False")
        inv = inverse_from_factor(self.factor, lower=False)
        return jnp.diagonal(inv) * self.scale**2


def _jacobi(a: Float[Array, "n n"], b: Float[Array, " n"]) -> tuple[Array, Array, Array]:
    d = jnp.diagonal(a)
    scale = jnp.where(d > 0, 1.0 / jnp.sqrt(jnp.where(d > 0, d, 1.0)), 1.0)
    return a * scale[:, None] * scale[None, :], b * scale, scale


def inverse_from_factor(factor: Float[Array, "n n"], lower: bool) -> Float[Array, "n n"]:
    """`a^-1` from the Cholesky factor of `a` (`a = L L^T` or `U^T U`): one triangular
    solve against the identity and one product."""
    n = factor.shape[0]
    eye = jnp.eye(n, dtype=factor.dtype)
    inv = jax.scipy.linalg.solve_triangular(factor, eye, lower=lower)
    return inv.T @ inv if lower else inv @ inv.T


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def logdet_factor(a: Float[Array, "n n"], factor: Float[Array, "n n"], lower: bool) -> Scalar:
    """`log det a` from its Cholesky `factor` (`lower` or upper): the derivative is taken
    with respect to `a` only (`d log det a = tr(a^-1 da)`, with `a^-1` from the factor:
    one triangular solve and one product, several times cheaper than differentiating
    through the factorisation); the factor's own tangent is ignored."""
    del a
    return 2.0 * jnp.sum(jnp.log(jnp.diagonal(factor)))


@logdet_factor.defjvp
def _logdet_factor_jvp(lower, primals, tangents):
    a, factor = primals
    a_dot, _ = tangents
    inv = inverse_from_factor(factor, lower)
    # A factor that failed (a not positive definite) gives a NaN log det, which callers
    # mask; its zero cotangent must not become NaN * 0.
    inv = jnp.where(jnp.isfinite(inv), inv, 0.0)
    return logdet_factor(a, factor, lower), jnp.sum(inv * a_dot)


def logdet_psd(matrix: Float[Array, "n n"]) -> Scalar:
    """`log det` of a symmetric positive-definite matrix by Cholesky (NaN if it is not).
    Its gradient, `a^-1`, comes from the factor (one triangular solve and one product:
    several times cheaper than differentiating through the factorisation)."""
    return logdet_factor(matrix, jnp.linalg.cholesky(matrix), True)


def _cholesky(
    a: Float[Array, "n n"], b: Float[Array, " n"], host: bool = False
) -> tuple[Array, Array | None, Array]:
    """Solves the positive-definite `a x = b` by Cholesky through lineax (or, with `host`,
    by LAPACK on the host CPU); returns `x`, the upper factor (None with `host`) and
    `log det a` (NaN when `a` is not positive definite)."""
    if host:
        from ..numba._host_linalg import host_cholesky_solve

        x, logdet = host_cholesky_solve(a, b)
        return x, None, logdet
    op = lx.MatrixLinearOperator(a, lx.positive_semidefinite_tag)
    solver = lx.Cholesky()
    state = solver.init(op, {})
    x = lx.linear_solve(op, b, solver, state=state, throw=False).value
    factor = state[0]
    return x, factor, logdet_factor(a, factor, False)


def solve_system(
    a: Float[Array, "n n"],
    b: Float[Array, " n"],
    nonnegative: Bool[Array, " n"] | None = None,
    host: bool = False,
) -> Solution:
    """Solves `a x = b` (`a = F + H`, symmetric positive definite) after a symmetric Jacobi
    scaling. With `nonnegative` (a mask), those entries are constrained to be `>= 0`: an
    accelerated projected-gradient solve finds the active set, then the free entries are
    re-solved exactly (so the solution is differentiable on its active set). The log det
    is always that of the full `a`. With `host`, the factorisations run on the host CPU
    (LAPACK; reverse mode only, the factor not differentiated: see
    `equilens.numba._host_linalg`)."""
    if host and nonnegative is None:  # (the host solve scales `a` itself)
        # (imported here and above: `equilens.numba._host_linalg` imports this package)
        from ..numba._host_linalg import host_cholesky_solve

        x, logdet = host_cholesky_solve(a, b)
        return Solution(x=x, log_det_curvature=logdet, factor=None, scale=jnp.ones_like(b))
    a_s, b_s, scale = _jacobi(a, b)
    x, factor, logdet = _cholesky(a_s, b_s, host)
    if nonnegative is not None:
        x_pos = jax.lax.stop_gradient(_projected_solve(a_s, b_s, nonnegative))
        free = (x_pos > 0) | ~nonnegative
        both = free[:, None] & free[None, :]
        eye = jnp.eye(a.shape[0], dtype=a.dtype)
        x, _, _ = _cholesky(jnp.where(both, a_s, eye), jnp.where(free, b_s, 0.0), host)
    logdet = logdet - 2.0 * jnp.sum(jnp.log(scale))
    return Solution(x=x * scale, log_det_curvature=logdet, factor=factor, scale=scale)


def _projected_solve(
    a: Float[Array, "n n"], b: Float[Array, " n"], constrained: Bool[Array, " n"]
) -> Float[Array, " n"]:
    # FISTA on 0.5 x^T a x - b^T x with x >= 0 where constrained; a has unit diagonal, so
    # its largest eigenvalue is at most its largest absolute row sum.
    step = 1.0 / jnp.max(jnp.sum(jnp.abs(a), axis=1))

    def project(x):
        return jnp.where(constrained, jnp.maximum(x, 0.0), x)

    def body(_, carry):
        x, z, t = carry
        x_new = project(z - step * (a @ z - b))
        t_new = 0.5 * (1.0 + jnp.sqrt(1.0 + 4.0 * t * t))
        z_new = x_new + ((t - 1.0) / t_new) * (x_new - x)
        return x_new, z_new, t_new

    x0 = project(b)
    one = jnp.ones((), a.dtype)
    x, _, _ = jax.lax.fori_loop(0, NONNEG_ITERATIONS, body, (x0, x0, one))
    return x


def noise_normalisation(noise: Float[Array, " n"]) -> Scalar:
    """`sum log(2 pi sigma^2)` over the mask."""
    return jnp.sum(2.0 * jnp.log(noise)) + math.log(2 * math.pi) * noise.shape[0]


class Inversion(eqx.Module):
    """Everything a pixelized-source inversion produces for one lens model.

    - `values`: the source (surface brightness per arcsec^2) on the nodes of `geometry`;
      `errors`: their 1-sigma errors `sqrt(diag((F+H)^-1))` (zeros unless requested).
    - `amplitudes`: the linear light amplitudes solved in the same system (lens light,
      `LensSystem.linear_components` order).
    - `model_image`: the model (flux per pixel, PSF-convolved) on the dataset's grid;
      `residuals`: `(data - model) / noise` on the mask, zero outside.
    - `chi2`, `regularization_term` (`s^T H s`), `log_det_curvature` (`log det (F+H)`),
      `log_det_regularization` (`log det H`), `noise_normalisation` (`sum log 2 pi
      sigma^2`) and `log_evidence = -(chi2 + s^T H s + log det(F+H) - log det H + sum log
      2 pi sigma^2) / 2`, which is `-inf` when the system is singular (`valid` False;
      the solved quantities are then NaN, and the evidence's gradient is zero). (The
      "sparse" route's single host solve gives `chi2 + s^T H s` as `|t|^2 - x^T b`, with
      `t` the noise-weighted data and `b` the system's right-hand side, in float64; the
      evidence then needs no model image. The reported `chi2` is from the residuals and
      agrees to round-off.)
    """

    values: Float[Array, " n"]
    errors: Float[Array, " n"]
    amplitudes: Float[Array, " n_linear"]
    geometry: AbstractGeometry
    model_image: Float[Array, "ny nx"]
    residuals: Float[Array, "ny nx"]
    chi2: Scalar
    regularization_term: Scalar
    log_det_curvature: Scalar
    log_det_regularization: Scalar
    noise_normalisation: Scalar
    log_evidence: Scalar
    valid: Bool[Array, ""]
    route: str = eqx.field(static=True)

    def source_image(self, grid: Grid) -> Float[Array, "ny nx"]:
        """The source interpolated to a regular source-plane `grid` (an `equilens.Grid`):
        surface brightness per arcsec^2 at the pixel centres."""
        x, y = grid.coordinates()
        return self.geometry.values_at(self.values, x, y)

    def error_image(self, grid: Grid) -> Float[Array, "ny nx"]:
        """The 1-sigma errors interpolated to a regular source-plane `grid`."""
        x, y = grid.coordinates()
        return self.geometry.values_at(self.errors, x, y)
