"""Gradient, curvature, adaptive-brightness and Gaussian-process regularizations."""

import functools
import math
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, Scalar

from .._callback import host_callback
from .._checks import POSITIVE, describe
from .._custom_types import FloatScalar, ScalarLike, as_float
from ..inversion._formulas import gp_precision
from ..inversion._linalg import inverse_from_factor, logdet_factor, logdet_psd
from ..source._geometry import (
    AbstractGeometry,
    RectilinearGeometry,
    SparseRows,
    SparseSymmetric,
    gram_entries,
    rect_operator_matrix,
)
from ..source._pixelized import AbstractRegularization

#: Ridge added to the (singular) difference operators: `H = lambda (G^T G + RIDGE I)`, so
#: that `H` is positive definite and `log det H` finite (the mean level of the source is
#: otherwise unconstrained by a gradient or curvature prior). As PyAutoLens (1e-8), which
#: adds it unscaled: `ConstantRegularization(ridge=...)` sets it.
RIDGE = 1e-8

_POSITIVE = (0.0, math.inf)


@functools.cache
def rect_entries(
    ny: int, nx: int, order: int, ridge: float = RIDGE
) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """The upper triangle's non-zeros of `G^T G + ridge I` on an `ny x nx` rectilinear mesh
    (rows, columns, values; NumPy, computed once per shape) and its log det."""
    h0 = rect_operator_matrix(ny, nx, order) + ridge * np.eye(ny * nx)
    sign, value = np.linalg.slogdet(h0)
    assert sign > 0
    rows, cols = np.nonzero(np.triu(h0))
    return rows, cols, h0[rows, cols], float(value)


def _with_ridge(h: SparseSymmetric, ridge: Float[Array, " n"]) -> SparseSymmetric:
    """`h + diag(ridge)` by entries."""
    nodes = jnp.arange(h.n, dtype=h.rows.dtype)
    return SparseSymmetric(
        jnp.concatenate([h.rows, nodes]),
        jnp.concatenate([h.cols, nodes]),
        jnp.concatenate([h.values, ridge]),
        h.n,
    )


def _scaled_entries(
    coefficient: FloatScalar, geometry: AbstractGeometry, order: int, ridge: float = RIDGE
) -> tuple[SparseSymmetric, Scalar] | None:
    """`lambda (G^T G + ridge I)` by entries and its log det (`order` 1: first differences,
    2: curvature); None for the curvature of a triangulation (its square of the graph
    Laplacian has no fixed-size pattern). For a rectilinear mesh the operator depends only
    on the shape, so `log det = n log lambda + log det H0` with `H0`'s computed once
    (NumPy); for a triangulation, on the topology (`_topology_logdet`)."""
    n = geometry.n_pixels
    dtype = coefficient.dtype
    if isinstance(geometry, RectilinearGeometry):
        r, c, v, logdet0 = rect_entries(*geometry.shape, order, ridge)
        entries = SparseSymmetric(r, c, coefficient * jnp.asarray(v, dtype), n)
        return entries, n * jnp.log(coefficient) + logdet0
    if order != 1:
        return None
    rows = geometry.gradient_rows()
    h0 = _with_ridge(gram_entries(rows, n), jnp.full(n, ridge, dtype))
    entries = SparseSymmetric(h0.rows, h0.cols, coefficient * h0.values, n)
    return entries, n * jnp.log(coefficient) + _topology_logdet(rows, n, order, dtype, ridge)


def _scaled(
    coefficient: FloatScalar, geometry: AbstractGeometry, order: int, ridge: float = RIDGE
) -> tuple[Float[Array, "n n"], Scalar]:
    """`lambda (G^T G + ridge I)` (dense) and its log det."""
    sparse = _scaled_entries(coefficient, geometry, order, ridge)
    if sparse is not None:
        return sparse[0].todense(), sparse[1]
    n = geometry.n_pixels
    rows = geometry.gradient_rows()
    h0 = geometry.curvature_matrix() + ridge * jnp.eye(n, dtype=coefficient.dtype)
    logdet0 = _topology_logdet(rows, n, order, h0.dtype, ridge)
    return coefficient * h0, n * jnp.log(coefficient) + logdet0


def _topology_logdet(rows: SparseRows, n: int, order: int, dtype, ridge: float = RIDGE) -> Scalar:
    """`log det H0` for `H0 = G^T G + ridge I` (`order` 1) or `(G^T G)^2 + ridge I` (2: the
    squared graph Laplacian, `curvature_matrix`), `G` the mesh's first-difference rows.
    `H0` depends on the mesh's topology only (integer edges), so it has no derivative:
    a sparse LU on the host (SciPy), about 1 ms at 1,000 nodes against 10 ms for a dense
    Cholesky and, under differentiation, 100 ms for the inverse it would form."""
    idx, coef = jax.lax.stop_gradient(rows)

    def host(idx, coef):
        return np.asarray(topology_logdet(idx, coef, n, order, ridge), dtype)

    out = jax.ShapeDtypeStruct((), dtype)
    return host_callback(host, out, idx, coef, vmap_method="sequential")


def topology_logdet(
    idx: Int[np.ndarray, "r k"],
    coef: Float[np.ndarray, "r k"],
    n: int,
    order: int,
    ridge: float = RIDGE,
) -> float:
    """`log det H0` of `_topology_logdet` for first-difference rows `(idx, coef)` (NumPy):
    a sparse LU with a symmetric ordering and no pivoting (the Cholesky pivots of a
    positive-definite `H0`); NaN when `H0` is not positive definite."""
    import scipy.sparse as sp
    from scipy.sparse.linalg import splu

    idx = np.asarray(idx)
    r = np.repeat(np.arange(idx.shape[0]), idx.shape[1])
    g = sp.csr_matrix((np.ravel(coef).astype(np.float64), (r, np.ravel(idx))), (len(idx), n))
    h = (g.T @ g).tocsc()
    if order == 2:
        h = (h.T @ h).tocsc()
    h = (h + ridge * sp.identity(n, format="csc")).tocsc()
    lu = splu(h, permc_spec="MMD_AT_PLUS_A", diag_pivot_thresh=0.0, options={"SymmetricMode": True})
    d = lu.U.diagonal()
    if np.all(d > 0):
        return float(np.sum(np.log(d)))
    # (round-off in a near-singular H0: the dense, pivoted determinant)
    sign, value = np.linalg.slogdet(h.toarray())
    return float(value) if sign > 0 else math.nan


class ConstantRegularization(AbstractRegularization):
    """Constant gradient regularization: `s^T H s = lambda sum_(i,j) (s_i - s_j)^2` over
    every pair of neighbouring pixels (mesh rows and columns; Delaunay edges), plus a ridge
    `lambda * ridge * sum s_i^2` (`ridge` 1e-8 by default) that makes `H` invertible (Suyu
    et al. 2006; PyAutoLens's `Constant`). `coefficient` is `lambda` (> 0, dimensionless
    per (flux/arcsec^2)^-2); `ridge` (static, > 0) is fixed when a fit varies `lambda`.
    `ConstantRegularization.from_pyautolens` gives PyAutoLens's `Constant` exactly."""

    fixed_sparsity: ClassVar[bool] = True
    coefficient: FloatScalar = eqx.field(metadata=describe(domain=POSITIVE, bounds=_POSITIVE))
    ridge: float = eqx.field(static=True)

    def __init__(self, coefficient: ScalarLike = 1.0, ridge: float = RIDGE):
        self.coefficient = as_float(coefficient)
        r = float(ridge)
        if not (math.isfinite(r) and r > 0):
            raise ValueError(
                f"ConstantRegularization.ridge must be finite and in (0, inf), got {ridge!r}"
            )
        self.ridge = r

    @classmethod
    def from_pyautolens(cls, coefficient: float, pixel_scale: float) -> "ConstantRegularization":
        """PyAutoLens's `al.reg.Constant(coefficient)` for data of `pixel_scale` arcsec per
        pixel: its `H = c^2 G^T G + 1e-8 I` acts on source values in flux per image pixel
        and equilens's on surface brightness per arcsec^2 (`a` = `pixel_scale^2` times
        less), so `lambda = (a c)^2` and `ridge = 1e-8 / c^2` (every evidence term then
        agrees: docs/pixelized.md, "equilens and PyAutoLens")."""
        c, scale = float(coefficient), float(pixel_scale)
        if not (math.isfinite(c) and c > 0):
            raise ValueError(f"coefficient must be finite and in (0, inf), got {coefficient!r}")
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"pixel_scale must be finite and in (0, inf), got {pixel_scale!r}")
        return cls((scale * scale * c) ** 2, ridge=RIDGE / (c * c))

    def matrix(
        self, geometry: AbstractGeometry, signal: Float[Array, " n"]
    ) -> tuple[Float[Array, "n n"], Scalar]:
        del signal
        return _scaled(self.coefficient, geometry, 1, self.ridge)

    def sparse_matrix(
        self, geometry: AbstractGeometry, signal: Float[Array, " n"]
    ) -> tuple[SparseSymmetric, Scalar] | None:
        del signal
        return _scaled_entries(self.coefficient, geometry, 1, self.ridge)


class CurvatureRegularization(AbstractRegularization):
    """Constant curvature regularization: `s^T H s = lambda |L s|^2` with `L` the second
    differences along the mesh rows and columns (rectangular meshes, Suyu et al. 2006) or
    the graph Laplacian of the triangulation (Delaunay), plus the ridge of
    `ConstantRegularization`. `coefficient` is `lambda` (> 0)."""

    fixed_sparsity: ClassVar[bool] = True
    coefficient: FloatScalar = eqx.field(metadata=describe(domain=POSITIVE, bounds=_POSITIVE))

    def __init__(self, coefficient: ScalarLike = 1.0):
        self.coefficient = as_float(coefficient)

    def matrix(
        self, geometry: AbstractGeometry, signal: Float[Array, " n"]
    ) -> tuple[Float[Array, "n n"], Scalar]:
        del signal
        return _scaled(self.coefficient, geometry, 2)

    def sparse_matrix(
        self, geometry: AbstractGeometry, signal: Float[Array, " n"]
    ) -> tuple[SparseSymmetric, Scalar] | None:
        del signal
        return _scaled_entries(self.coefficient, geometry, 2)


#: `AdaptiveBrightness`'s default `signal_floor`: the brightness estimate (scaled to a peak
#: of 1) below which a source pixel counts as this faint. See the class docstring.
SIGNAL_FLOOR = 1e-4


def brightness_weights(xp, signal, inner, outer, power, floor=0.0):
    """`AdaptiveBrightness`'s pixel weights `(inner S + outer (1 - S))^2`, `S` the
    brightness `signal` clipped to `[floor, 1]` and raised to `power` (`xp`: the array
    namespace, `jax.numpy` or NumPy; `floor` a float in `[0, 1)`).

    `1 - S` is `-expm1(power log signal)`, exact to round-off: computed as `1 - S` it is
    a multiple of the machine epsilon where `power` is small, and a fit of the
    hyperparameters can go there (`power -> 0` with `outer * power` finite is a weight
    `(outer power log signal)^2`: on the subhalo suite's lens 2, `power` 6.6e-16 and
    `outer` 3.3e13), where the weights then jump between those multiples as the mass
    moves the traced pixels: the log-evidence jumped by up to 1.9 between mass models
    0.05 sigma apart. With `floor` 0 a signal of exactly 0 has `S = 0` (PyAutoLens's
    formula), a step from the weight of the faintest lit pixel in that limit."""
    s = xp.clip(signal, floor, 1.0)
    lit = s > 0
    t = power * xp.log(xp.where(lit, s, 1.0))
    s_p = xp.where(lit, xp.exp(t), 0.0)
    rest = xp.where(lit, -xp.expm1(t), 1.0)
    return (inner * s_p + outer * rest) ** 2


class AdaptiveBrightness(AbstractRegularization):
    """Brightness-adaptive gradient regularization (Nightingale, Dye & Massey 2018): pixel
    weights `w_i = (inner * S_i + outer * (1 - S_i))^2` from a source-brightness estimate
    `S_i` in `[signal_floor, 1]` (raised to `signal_scale`), so bright regions are
    regularized with `inner` and faint ones with `outer`; `s^T H s = sum_(i,j) (w_i + w_j)/2
    (s_i - s_j)^2 + 1e-8 sum w_i s_i^2` over neighbouring pixels. The brightness estimate
    comes from the inversion's adapt image (`LogEvidence(adapt_image=...)`, by default the
    data) mapped to the source pixels and scaled to a peak of 1.

    `signal_floor` (static, in `[0, 1)`; default `SIGNAL_FLOOR`, 1e-4 of the peak) is the
    estimate below which a pixel counts as that faint. `signal_floor=0` is PyAutoLens's
    formula, where a pixel whose estimate is exactly 0 (the adapt image 0 where it maps,
    or no image pixel mapping to it) has `S = 0`: a fit of the hyperparameters can reach
    `signal_scale -> 0` with `outer * signal_scale` finite (weights `(inner + outer
    signal_scale |log S|)^2`, seen on the subhalo suite's lens 2), where that pixel's
    weight is `outer^2` against `(outer signal_scale |log S|)^2` for an estimate of 1e-7,
    a factor of 1e27 on lens 2; the log-evidence then jumped by 0.7-1.8 whenever the mass
    moved a traced pixel's estimate to 0 or from it. With the floor the weights are
    continuous in the estimate (on lens 2 the largest second difference of the
    log-evidence along each mass parameter's line fell from 0.16-1.98 to 0.03-0.40,
    docs/pixelized.md). For an ordinary `signal_scale` (about 1) the floor changes only
    the weights of pixels fainter than it, each by a relative `2 signal_floor^signal_scale
    |inner - outer| / outer` at most (to first order in the floor)."""

    uses_signal: ClassVar[bool] = True
    fixed_sparsity: ClassVar[bool] = True
    factored_logdet: ClassVar[bool] = True
    inner_coefficient: FloatScalar = eqx.field(metadata=describe(domain=POSITIVE, bounds=_POSITIVE))
    outer_coefficient: FloatScalar = eqx.field(metadata=describe(domain=POSITIVE, bounds=_POSITIVE))
    signal_scale: FloatScalar = eqx.field(metadata=describe(domain=POSITIVE, bounds=(0.0, 10.0)))
    signal_floor: float = eqx.field(static=True)

    def __init__(
        self,
        inner_coefficient: ScalarLike = 1.0,
        outer_coefficient: ScalarLike = 1.0,
        signal_scale: ScalarLike = 1.0,
        signal_floor: float = SIGNAL_FLOOR,
    ):
        self.inner_coefficient = as_float(inner_coefficient)
        self.outer_coefficient = as_float(outer_coefficient)
        self.signal_scale = as_float(signal_scale)
        f = float(signal_floor)
        if not 0.0 <= f < 1.0:
            raise ValueError(
                f"AdaptiveBrightness.signal_floor must be in [0, 1), got {signal_floor!r}"
            )
        self.signal_floor = f

    def _entries(self, geometry: AbstractGeometry, signal: Float[Array, " n"]) -> SparseSymmetric:
        w = brightness_weights(
            jnp,
            signal,
            self.inner_coefficient,
            self.outer_coefficient,
            self.signal_scale,
            self.signal_floor,
        )
        rows = geometry.gradient_rows()
        idx = rows[0]
        edge_w = 0.5 * (w[idx[:, 0]] + w[idx[:, 1]])
        return _with_ridge(gram_entries(rows, geometry.n_pixels, edge_w), RIDGE * w)

    def matrix(
        self, geometry: AbstractGeometry, signal: Float[Array, " n"]
    ) -> tuple[Float[Array, "n n"], Scalar]:
        h = self._entries(geometry, signal).todense()
        return h, logdet_psd(h)

    def sparse_matrix(
        self, geometry: AbstractGeometry, signal: Float[Array, " n"]
    ) -> tuple[SparseSymmetric, Scalar] | None:
        entries = self._entries(geometry, signal)
        return entries, logdet_psd(entries.todense())


def distances(xp, nodes):
    """The distances between all pairs of `nodes` (`xp`: the array namespace)."""
    d2 = xp.sum((nodes[:, None, :] - nodes[None, :, :]) ** 2, axis=-1)
    pos = d2 > 0
    return xp.where(pos, xp.sqrt(xp.where(pos, d2, 1.0)), 0.0)


def matern(xp, r, nu: float):
    """The unit-variance Matern covariance at scaled distances `r` (`nu` 1/2, 3/2, 5/2)."""
    if nu == 0.5:
        return xp.exp(-r)
    if nu == 1.5:
        a = math.sqrt(3.0) * r
        return (1.0 + a) * xp.exp(-a)
    a = math.sqrt(5.0) * r
    return (1.0 + a + a * a / 3.0) * xp.exp(-a)


def _gp_matrix(
    coefficient: FloatScalar, kernel: Float[Array, "n n"], jitter: float
) -> tuple[Float[Array, "n n"], Scalar]:
    n = kernel.shape[0]
    k = kernel + jitter * jnp.eye(n, dtype=kernel.dtype)
    chol = jnp.linalg.cholesky(k)
    inv = inverse_from_factor(chol, lower=True)
    return gp_precision(jnp, coefficient, inv, logdet_factor(k, chol, True))


class MaternKernel(AbstractRegularization):
    """Gaussian-process prior with a Matern covariance (Vernardos & Koopmans 2022):
    `Cov(s_i, s_j) = k(d_ij) / coefficient`, with `d_ij` the source-plane distance between
    nodes (arcsec) and, for `r = d / scale`,
    `nu = 1/2: exp(-r)`, `3/2: (1 + sqrt3 r) exp(-sqrt3 r)`,
    `5/2: (1 + sqrt5 r + 5 r^2 / 3) exp(-sqrt5 r)`. So `H = coefficient K^-1` and
    `log det H = n log coefficient - log det K`. `scale` (arcsec, > 0) and `coefficient`
    (> 0) can be fitted; `nu` is static; `jitter` (default 1e-6) is added to the diagonal
    of the unit-variance `K` for numerical stability."""

    fixed_sparsity: ClassVar[bool] = True
    coefficient: FloatScalar = eqx.field(metadata=describe(domain=POSITIVE, bounds=_POSITIVE))
    scale: FloatScalar = eqx.field(metadata=describe(domain=POSITIVE, bounds=_POSITIVE))
    nu: float = eqx.field(static=True)
    jitter: float = eqx.field(static=True)

    def __init__(
        self,
        coefficient: ScalarLike = 1.0,
        scale: ScalarLike = 0.1,
        nu: float = 1.5,
        jitter: float = 1e-6,
    ):
        if float(nu) not in (0.5, 1.5, 2.5):
            raise ValueError(f"MaternKernel.nu must be 0.5, 1.5 or 2.5, got {nu}")
        self.coefficient = as_float(coefficient)
        self.scale = as_float(scale)
        self.nu = float(nu)
        self.jitter = float(jitter)

    def matrix(
        self, geometry: AbstractGeometry, signal: Float[Array, " n"]
    ) -> tuple[Float[Array, "n n"], Scalar]:
        del signal
        k = matern(jnp, distances(jnp, geometry.nodes()) / self.scale, self.nu)
        return _gp_matrix(self.coefficient, k, self.jitter)


class ExponentialKernel(AbstractRegularization):
    """Gaussian-process prior with the exponential covariance `exp(-d / scale) /
    coefficient` (the Matern kernel with `nu = 1/2`; Vernardos & Koopmans 2022). See
    `MaternKernel` for the meaning of the fields."""

    fixed_sparsity: ClassVar[bool] = True
    coefficient: FloatScalar = eqx.field(metadata=describe(domain=POSITIVE, bounds=_POSITIVE))
    scale: FloatScalar = eqx.field(metadata=describe(domain=POSITIVE, bounds=_POSITIVE))
    jitter: float = eqx.field(static=True)

    def __init__(
        self, coefficient: ScalarLike = 1.0, scale: ScalarLike = 0.1, jitter: float = 1e-6
    ):
        self.coefficient = as_float(coefficient)
        self.scale = as_float(scale)
        self.jitter = float(jitter)

    def matrix(
        self, geometry: AbstractGeometry, signal: Float[Array, " n"]
    ) -> tuple[Float[Array, "n n"], Scalar]:
        del signal
        k = matern(jnp, distances(jnp, geometry.nodes()) / self.scale, 0.5)
        return _gp_matrix(self.coefficient, k, self.jitter)
