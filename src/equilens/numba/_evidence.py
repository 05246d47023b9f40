"""The pixelized-source evidence (`equilens.LogEvidence`) with the Numba backend.

The same inversion as `LogEvidence.invert`, from NumPy: the mapped sub-pixels ray-shot
by the mass kernels, the mesh placed for that model (a function per mesh class,
`register_mesh`), the interpolation weights (a Numba kernel for rectilinear meshes;
SciPy's point location and the shared barycentric formula for Delaunay meshes), the
regularization matrix and its log det (a function per regularization class,
`register_regularization`), the linear lens light's basis images, and then the "sparse"
route's tiled Numba kernels and its host Cholesky solve (LAPACK) for the whole system,
which also gives chi2 + `s^T H s` without the model image. The Numba backend always takes
this route (the term's own `route` chooses among JAX computations); every route gives
the same evidence to round-off. The positive-only solve (`nonnegative=True`) is the JAX
side's algorithm (projected-gradient active set, then the exact solve on it) in NumPy.
"""

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import numpy as np
import scipy.linalg
from jaxtyping import Float, Int

from .._lens_system import LensSystem
from ..inversion import (
    gp_precision,
    jacobi_scaling,
    log_evidence,
    noise_normalisation,
    projected_gradient,
    python_loop,
    source_signal,
)
from ..regularization import (
    AdaptiveBrightness,
    ConstantRegularization,
    CurvatureRegularization,
    ExponentialKernel,
    MaternKernel,
)
from ..regularization._regularization import (
    RIDGE,
    brightness_weights,
    distances,
    matern,
    rect_entries,
    topology_logdet,
)
from ..source import (
    AdaptiveRectangularMesh,
    DelaunayMesh,
    PixelizedSource,
    RectangularMesh,
)
from ..source._geometry import (
    EDGE_SLACK,
    barycentric_weights,
    gram_values,
    locate_host,
    rect_rows,
    triangulate_host,
)
from ..terms import LogEvidence
from ._api import mass_rows
from ._image import convolve, linear_images
from ._registry import DEFLECTION, scalar
from ._runtime import _LOCK, blas_threads, host64, per_object, run_kernel
from ._sparse_route import SparseRoute
from ._sparse_tables import sparse_tables, table_arrays
from ._terms import host_imaging, register_term

# --------------------------------------------------------------------------------------
# source-plane geometries on the host
# --------------------------------------------------------------------------------------


class Rectilinear(NamedTuple):
    """A rectilinear mesh on the host (`equilens.source.RectilinearGeometry`)."""

    xs: Float[np.ndarray, " nx"]
    ys: Float[np.ndarray, " ny"]
    uniform: bool
    extrapolate: bool = False

    @property
    def n_pixels(self) -> int:
        return self.xs.size * self.ys.size

    def nodes(self) -> Float[np.ndarray, "n 2"]:
        y, x = np.meshgrid(self.ys, self.xs, indexing="ij")
        return np.stack([x.reshape(-1), y.reshape(-1)], axis=1)

    def interpolation(self, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        from . import _light_kernels as lk

        idx = np.empty((x.size, 4), np.int64)
        w = np.empty((x.size, 4))
        with _LOCK:
            lk.rectilinear_weights(
                x, y, idx, w, self.xs, self.ys, self.uniform, self.extrapolate, EDGE_SLACK
            )
        return idx, w


class Triangulation(NamedTuple):
    """A Delaunay triangulation on the host (`equilens.source.TriangulationGeometry`):
    its nodes and its edges (unique pairs; none when SciPy could not triangulate)."""

    points: Float[np.ndarray, "n 2"]
    edges: Int[np.ndarray, "e 2"]

    @property
    def n_pixels(self) -> int:
        return self.points.shape[0]

    def nodes(self) -> Float[np.ndarray, "n 2"]:
        return self.points

    def interpolation(self, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        verts, ok = locate_host(self.points, x, y)
        w = barycentric_weights(np, self.points[verts], verts, x, y)
        # nodes SciPy could not triangulate: NaN weights, an invalid evidence (as in JAX)
        return verts.astype(np.int64), w if int(ok) else np.full_like(w, np.nan)

    @classmethod
    def triangulate(cls, points: np.ndarray) -> "Triangulation":
        edges, weight = triangulate_host(points)
        return cls(points, edges[weight > 0].astype(np.int64))


Geometry = Rectilinear | Triangulation
#: `fn(mesh, mass, x, y) -> Geometry` for traced positions `x`, `y` (flat float64).
MeshFunction = Callable[[Any, Any, np.ndarray, np.ndarray], Geometry]
#: `fn(regularization, geometry, signal) -> (H, log det H)`, `H` dense `(n, n)` or its
#: upper-triangle entries `(rows, cols, values)` (each pair once, repeats adding up).
RegularizationFunction = Callable[[Any, Geometry, np.ndarray], tuple[Any, float]]
_MESHES: dict[type, MeshFunction] = {}
_REGULARIZATIONS: dict[type, RegularizationFunction] = {}


def register_mesh(cls: type) -> Callable[[MeshFunction], MeshFunction]:
    """Registers the Numba-backend placement of the source mesh class `cls` (that class
    only): `fn(mesh, mass, x, y)` returns the mesh's geometry for the mass model `mass`
    and the traced positions `x`, `y` (flat float64 NumPy) of the mapped image sub-pixels,
    as a `Rectilinear` or `Triangulation` (`equilens.numba._evidence`); for a mesh whose
    `uses_signal` is True, `fn(mesh, mass, x, y, signal)` with the brightness at them."""

    def decorate(fn: MeshFunction) -> MeshFunction:
        _MESHES[cls] = fn
        return fn

    return decorate


def register_regularization(
    cls: type,
) -> Callable[[RegularizationFunction], RegularizationFunction]:
    """Registers the Numba-backend regularization matrix of the class `cls` (that class
    only): `fn(regularization, geometry, signal)` returns `H` and `log det H` (NaN when
    `H` is not positive definite), `H` a dense `(n, n)` NumPy array or its entries
    `(rows, cols, values)` (upper triangle, each pair once)."""

    def decorate(fn: RegularizationFunction) -> RegularizationFunction:
        _REGULARIZATIONS[cls] = fn
        return fn

    return decorate


def _lookup(registry: dict, obj: Any, what: str, register: str):
    fn = registry.get(type(obj))
    if fn is None:
        raise NotImplementedError(
            f"the Numba backend has no {what} for {type(obj).__name__} "
            f"({type(obj).__module__}); register one with equilens.numba.{register}"
        )
    return fn


def geometry(
    mesh: Any, mass: Any, x: np.ndarray, y: np.ndarray, signal: np.ndarray | None = None
) -> Geometry:
    """The geometry of the source `mesh` for the mass model `mass` and the traced
    positions `x`, `y` (flat float64) of the mapped image sub-pixels, as `mesh.geometry`
    (NumPy: a `Rectilinear` or a `Triangulation`); `signal`, the brightness at those
    positions, is passed on as a fifth argument (given for a mesh that `uses_signal`)."""
    place = _lookup(_MESHES, mesh, "source-mesh placement", "register_mesh")
    if signal is not None:
        return place(mesh, mass, x, y, signal)  # pyright: ignore[reportCallIssue]
    return place(mesh, mass, x, y)


def regularization_matrix(
    regularization: Any, geometry: Geometry, signal: np.ndarray
) -> tuple[Any, float]:
    """`H` and `log det H` of `regularization` on `geometry` for the brightness `signal`
    (as `equilens.source._pixelized.regularization_matrix`): a dense NumPy array or the
    entries `(rows, cols, values)` of its upper triangle."""
    fn = _lookup(
        _REGULARIZATIONS, regularization, "regularization matrix", "register_regularization"
    )
    return fn(regularization, geometry, signal)


@register_mesh(RectangularMesh)
def _rectangular(mesh: RectangularMesh, mass: Any, x: np.ndarray, y: np.ndarray) -> Rectilinear:
    del mass
    xs, ys = mesh.node_positions(np, x, y)
    return Rectilinear(xs, ys, True, mesh.nodes == "centres")


@register_mesh(AdaptiveRectangularMesh)
def _adaptive(
    mesh: AdaptiveRectangularMesh,
    mass: Any,
    x: np.ndarray,
    y: np.ndarray,
    signal: np.ndarray | None = None,
):
    del mass
    xs, ys = mesh.node_positions(np, x, y, signal)
    return Rectilinear(xs, ys, False)


@register_mesh(DelaunayMesh)
def _delaunay(mesh: DelaunayMesh, mass: Any, x: np.ndarray, y: np.ndarray) -> Triangulation:
    del x, y
    ix = np.ascontiguousarray(np.asarray(mesh.image_x, np.float64))
    iy = np.ascontiguousarray(np.asarray(mesh.image_y, np.float64))
    alpha = mass_rows(mass, ix, iy, DEFLECTION)
    return Triangulation.triangulate(np.stack([ix - alpha[0], iy - alpha[1]], axis=1))


# --------------------------------------------------------------------------------------
# regularizations
# --------------------------------------------------------------------------------------


def _gradient_rows(geometry: Geometry) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(geometry, Rectilinear):
        return rect_rows(geometry.ys.size, geometry.xs.size, 1)
    idx = geometry.edges
    return idx, np.tile([1.0, -1.0], (idx.shape[0], 1))


def _with_ridge(entries: tuple, ridge: np.ndarray) -> tuple:
    rows, cols, values = entries
    nodes = np.arange(ridge.size)
    return (
        np.concatenate([rows, nodes]),
        np.concatenate([cols, nodes]),
        np.concatenate([values, ridge]),
    )


def _difference_prior(
    coefficient: float, geometry: Geometry, order: int, ridge: float = RIDGE
) -> tuple[Any, float]:
    # `_scaled_entries` / `_scaled` of equilens.regularization: lambda (G^T G + ridge I)
    n = geometry.n_pixels
    log_c = n * math.log(coefficient) if coefficient > 0 else math.nan
    if isinstance(geometry, Rectilinear):
        r, c, v, logdet0 = rect_entries(geometry.ys.size, geometry.xs.size, order, ridge)
        return (r, c, coefficient * v), log_c + logdet0
    rows = _gradient_rows(geometry)
    logdet0 = topology_logdet(*rows, n, order, ridge)
    if order == 1:
        r, c, v = _with_ridge(gram_values(np, *rows), np.full(n, ridge))
        return (r, c, coefficient * v), log_c + logdet0
    # the squared graph Laplacian, dense (as `TriangulationGeometry.curvature_matrix`)
    lap = np.zeros((n, n))
    r, c, v = gram_values(np, *rows)
    np.add.at(lap, (r, c), v)
    np.add.at(lap, (c, r), np.where(r == c, 0.0, v))
    h0 = lap.T @ lap + ridge * np.eye(n)
    return coefficient * h0, log_c + logdet0


@register_regularization(ConstantRegularization)
def _constant(reg: ConstantRegularization, geometry: Geometry, signal: np.ndarray):
    del signal
    return _difference_prior(scalar(reg, "coefficient"), geometry, 1, reg.ridge)


@register_regularization(CurvatureRegularization)
def _curvature(reg: CurvatureRegularization, geometry: Geometry, signal: np.ndarray):
    del signal
    return _difference_prior(scalar(reg, "coefficient"), geometry, 2)


def _dense(entries: tuple, n: int) -> np.ndarray:
    rows, cols, values = entries
    out = np.zeros((n, n))
    np.add.at(out, (rows, cols), values)
    np.add.at(out, (cols, rows), np.where(rows == cols, 0.0, values))
    return out


def _logdet_psd(h: np.ndarray) -> float:
    try:
        low = np.linalg.cholesky(h)
    except np.linalg.LinAlgError:
        return math.nan
    return float(2.0 * np.sum(np.log(np.diagonal(low))))


@register_regularization(AdaptiveBrightness)
def _adaptive_brightness(reg: AdaptiveBrightness, geometry: Geometry, signal: np.ndarray):
    names = ("inner_coefficient", "outer_coefficient", "signal_scale")
    inner, outer, power = (scalar(reg, n) for n in names)
    w = brightness_weights(np, signal, inner, outer, power, reg.signal_floor)
    rows = _gradient_rows(geometry)
    edge_w = 0.5 * (w[rows[0][:, 0]] + w[rows[0][:, 1]])
    entries = _with_ridge(gram_values(np, *rows, edge_w), RIDGE * w)
    return entries, _logdet_psd(_dense(entries, geometry.n_pixels))


def _gp_prior(coefficient: float, kernel: np.ndarray, jitter: float) -> tuple[Any, float]:
    # `_gp_matrix` of equilens.regularization: coefficient K^-1 from K's Cholesky factor
    n = kernel.shape[0]
    k = kernel + jitter * np.eye(n)
    try:
        low = np.linalg.cholesky(k)
    except np.linalg.LinAlgError:
        return np.full((n, n), np.nan), math.nan
    inv_low = scipy.linalg.solve_triangular(low, np.eye(n), lower=True)
    logdet_k = 2.0 * float(np.sum(np.log(np.diagonal(low))))
    with np.errstate(invalid="ignore", divide="ignore"):  # (log of a coefficient <= 0)
        h, log_det = gp_precision(np, coefficient, inv_low.T @ inv_low, logdet_k)
    return h, float(log_det)


@register_regularization(MaternKernel)
def _matern(reg: MaternKernel, geometry: Geometry, signal: np.ndarray):
    del signal
    r = distances(np, geometry.nodes()) / scalar(reg, "scale")
    return _gp_prior(scalar(reg, "coefficient"), matern(np, r, reg.nu), reg.jitter)


@register_regularization(ExponentialKernel)
def _exponential(reg: ExponentialKernel, geometry: Geometry, signal: np.ndarray):
    del signal
    r = distances(np, geometry.nodes()) / scalar(reg, "scale")
    return _gp_prior(scalar(reg, "coefficient"), matern(np, r, 0.5), reg.jitter)


# --------------------------------------------------------------------------------------
# the term
# --------------------------------------------------------------------------------------


class _HostEvidence:
    """A `LogEvidence` term's per-dataset arrays on the host (float64 NumPy), made once
    per term object: the mapped sub-pixels, the noise, the adapt image and the tile
    tables (the term's own, or built here when its route does not use them)."""

    def __init__(self, term: LogEvidence):
        imaging = term.imaging
        self.imaging = host_imaging(imaging)
        self.grid = imaging.grid
        self.pixels = np.asarray(term.pixels, np.int64)
        self.mapped = np.asarray(term.mapped, np.int64)
        sub_x, sub_y = (np.asarray(a, np.float64) for a in (term.sub_x, term.sub_y))
        self.n_mapped, self.s2 = sub_x.shape
        self.sub_x, self.sub_y = (np.ascontiguousarray(a.reshape(-1)) for a in (sub_x, sub_y))
        self.adapt = np.asarray(term.adapt, np.float64)
        noise = self.imaging.noise[self.pixels]
        self.inv_sigma = 1.0 / noise
        self.data = self.imaging.data
        self.norm = float(noise_normalisation(np, noise))
        self.kernel = np.asarray(imaging.psf.kernel(), np.float64)
        sparse = [r for r in term.routes() if isinstance(r, SparseRoute)]
        if sparse:
            tables = sparse[0].tables
        else:
            tables = sparse_tables(self.kernel, self.grid.shape, self.pixels, self.mapped)
        self.tables = tuple(host64(*table_arrays(tables)))
        # the last lens light's images: (its key, images, fixed image)
        self.lens_light: tuple[Any, np.ndarray, np.ndarray | None] | None = None


def _light_key(light: Any) -> tuple:
    """A key equal for two lens lights that give the same images: the tree's structure
    (classes and static fields) and each leaf's dtype, shape and bytes."""
    leaves, treedef = jax.tree.flatten(light)
    parts = []
    for leaf in leaves:
        if eqx.is_array_like(leaf):
            a = np.asarray(leaf)
            parts.append((a.dtype.str, a.shape, a.tobytes()))
        else:
            parts.append(leaf)
    return treedef, tuple(parts)


def _lens_light_images(
    h: "_HostEvidence", system: LensSystem, conv: Any
) -> tuple[np.ndarray, np.ndarray | None]:
    """`linear_images` of the lens light (its linear basis images and its fixed image),
    kept for the last lens light seen: where the lens light is held (a subhalo scan's
    cells, the values of a Laplace evidence over the mass) every call after the first
    reuses them (6 of the 66 ms of a Jackpot evidence value, docs/performance.md)."""
    key = _light_key(object.__getattribute__(system, "lens_light"))
    kept = h.lens_light
    if kept is not None and kept[0] == key:
        return kept[1], kept[2]
    images, fixed = linear_images(system, h.grid, conv, fields=("lens_light",))
    h.lens_light = (key, images, fixed)
    return images, fixed


_HOST: dict = {}


def _host(term: LogEvidence) -> _HostEvidence:
    return per_object(_HOST, term, _HostEvidence)


class Evidence(NamedTuple):
    """The Numba backend's inversion (a subset of `equilens.inversion.Inversion`, NumPy):
    the source values on `geometry`'s nodes, the linear amplitudes, the evidence's terms
    (`fit` is chi2 + `s^T H s`) and the log evidence (`-inf` when the system is
    singular)."""

    values: np.ndarray
    amplitudes: np.ndarray
    geometry: Geometry
    fit: float
    log_det_curvature: float
    log_det_regularization: float
    noise_normalisation: float
    log_evidence: float


def invert(term: LogEvidence, system: LensSystem) -> Evidence:
    """`term.invert(system)` with the Numba backend (see the module docstring): the
    source values, amplitudes and the evidence's terms, as NumPy."""
    src = object.__getattribute__(system, "source")
    if not isinstance(src, PixelizedSource):
        raise TypeError(
            f"LogEvidence needs a LensSystem whose source is a PixelizedSource, got "
            f"{type(src).__name__}"
        )
    h = _host(term)
    n_s = src.n_pixels
    n_r = h.pixels.size
    if n_s > n_r:
        raise ValueError(
            f"the source mesh has {n_s} pixels but the mask only {n_r}: use a coarser "
            "mesh or a larger mask"
        )
    mesh = object.__getattribute__(src, "mesh")
    regularization = object.__getattribute__(src, "regularization")
    mass = object.__getattribute__(system, "mass")
    alpha = mass_rows(mass, h.sub_x, h.sub_y, DEFLECTION)
    bx, by = h.sub_x - alpha[0], h.sub_y - alpha[1]
    signal = np.repeat(h.adapt, h.s2) if mesh.uses_signal else None
    geo = geometry(mesh, mass, bx, by, signal)
    idx, w = geo.interpolation(bx, by)
    k = h.s2 * idx.shape[1]
    idx = np.ascontiguousarray(idx.reshape(h.n_mapped, k))
    w = w.reshape(h.n_mapped, k) * (h.grid.pixel_area / h.s2)

    conv = term.imaging.convolution
    # (NumPy's products on one BLAS thread, as `equilens.numba._terms.term_value`'s; the
    # host solve sets its LAPACK calls' own)
    with blas_threads(1):
        images, fixed = _lens_light_images(h, system, conv)
        n_lin = images.shape[0]
        data = h.data if fixed is None else h.data - fixed.reshape(-1)
        target = data[h.pixels] * h.inv_sigma
        light = images.reshape(n_lin, h.data.size)[:, h.pixels] * h.inv_sigma[None, :]
        values = np.concatenate([target[:, None], light.T], axis=1)
        gram, rhs = light @ light.T, light @ target

    if type(regularization).uses_signal:
        total = np.bincount(idx.reshape(-1), (w * h.adapt[:, None]).reshape(-1), n_s)
        cover = np.bincount(idx.reshape(-1), w.reshape(-1), n_s)
        signal = source_signal(np, total, cover)
    else:
        signal = np.zeros(n_s)
    reg, log_det_reg = regularization_matrix(regularization, geo, signal)

    if term.nonnegative:
        with blas_threads(1):
            profiled = not term.marginalise_amplitudes and n_lin > 0
            x, log_det, fit = _nonnegative(
                h, n_s, idx, w, values, reg, gram, rhs, images, fixed, profiled
            )
    else:
        from ._host_linalg import _rotate, _system_solved

        if isinstance(reg, tuple):
            rows, cols, reg_values = reg
        else:
            rows = cols = np.zeros(0, np.int64)
            reg_values = reg
        x, log_det, fit = _system_solved(
            idx,
            w,
            values,
            h.inv_sigma,
            rows,
            cols,
            reg_values,
            gram,
            rhs,
            *h.tables,
            n_s=n_s,
            keep=False,
        )[:3]
        x = _rotate(x, n_s)
        if not term.marginalise_amplitudes and n_lin > 0:
            # (the amplitudes held at their solved values: log det of the source block)
            log_det = _system_solved(
                idx,
                w,
                values[:, :1],
                h.inv_sigma,
                rows,
                cols,
                reg_values,
                np.zeros((0, 0)),
                np.zeros(0),
                *h.tables,
                n_s=n_s,
                keep=False,
            )[1]
    solved = bool(np.all(np.isfinite(x)) and math.isfinite(log_det) and math.isfinite(log_det_reg))
    log_ev = log_evidence(fit, log_det, log_det_reg, h.norm) if solved else -math.inf
    if not math.isfinite(log_ev):
        log_ev = -math.inf
    return Evidence(
        values=x[n_lin:],
        amplitudes=x[:n_lin],
        geometry=geo,
        fit=float(fit),
        log_det_curvature=float(log_det),
        log_det_regularization=float(log_det_reg),
        noise_normalisation=h.norm,
        log_evidence=float(log_ev),
    )


def _nonnegative(h, n_s, idx, w, values, reg, gram, rhs, images, fixed, profiled):
    """The positive-only solve (`solve_system` with `nonnegative`, in NumPy) and the
    evidence's fit term (chi2 + `s^T H s`) from the model image; with `profiled`, the log
    det of the source block (`LogEvidence(marginalise_amplitudes=False)`)."""
    curvature, projected = run_kernel("forward", n_s, idx, w, values, h.inv_sigma, *h.tables)
    dense_reg = _dense(reg, n_s) if isinstance(reg, tuple) else reg
    a = np.block([[gram, projected[:, 1:].T], [projected[:, 1:], curvature + dense_reg]])
    b = np.concatenate([rhs, projected[:, 0]])
    n_lin = gram.shape[0]
    x, log_det = _positive_solve(a, b, np.arange(a.shape[0]) >= n_lin)
    if profiled:
        log_det = _logdet_psd(curvature + dense_reg)
    if not np.all(np.isfinite(x)):
        return x, log_det, math.nan
    amps, s = x[:n_lin], x[n_lin:]
    ny, nx = h.grid.shape
    flux = np.zeros(ny * nx)
    flux[h.mapped] = np.sum(w * s[idx], axis=1)
    model = convolve(flux.reshape(ny, nx), h.kernel) + np.tensordot(amps, images, axes=1)
    if fixed is not None:
        model = model + fixed
    r = (h.data - model.reshape(-1))[h.pixels] * h.inv_sigma
    return x, log_det, float(r @ r + s @ (dense_reg @ s))


def _positive_solve(a: np.ndarray, b: np.ndarray, constrained: np.ndarray):
    """`solve_system(a, b, constrained)` of `equilens.inversion` in NumPy: Jacobi scaling,
    the accelerated projected-gradient active set (the same formulas), the exact solve on
    the free entries; `x` and `log det a` (NaN when `a` is not positive definite)."""
    a_s, b_s, scale = jacobi_scaling(np, a, b)
    try:
        low = np.linalg.cholesky(a_s)
    except np.linalg.LinAlgError:
        return np.full(b.shape, np.nan), math.nan
    log_det = 2.0 * float(np.sum(np.log(np.diagonal(low))))
    x = projected_gradient(np, a_s, b_s, constrained, python_loop)
    free = (x > 0) | ~constrained
    both = free[:, None] & free[None, :]
    low = np.linalg.cholesky(np.where(both, a_s, np.eye(a.shape[0])))
    y = scipy.linalg.cho_solve((low, True), np.where(free, b_s, 0.0))
    return y * scale, log_det - 2.0 * float(np.sum(np.log(scale)))


@register_term(LogEvidence, sets_threads=True)
def _log_evidence(term: LogEvidence, model: LensSystem) -> float:
    return -invert(term, model).log_evidence
