"""Objective terms with the Numba backend: the same numbers as `term(model)` from NumPy.

Each final term class has one function `fn(term, model) -> float` here, registered by
class (`register_term`); `value(objective, model)` is the weighted sum, as
`objective(model)`.
"""

import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import scipy.special
from jaxtyping import Bool, Float, PyTree

from .._lens_system import LensSystem
from .._multiband import MultiBandLensSystem
from ..data import Imaging
from ..inversion._formulas import jacobi_scaling
from ..mass import AbstractMassProfile
from ..objective import Objective
from ..objective._params import Parametrisation, linear_leaves
from ..source import PixelizedSource
from ..terms import (
    AbstractTerm,
    GaussianLikelihood,
    GaussianPrior,
    LogisticPrior,
    MultiBandTerm,
    PoissonLikelihood,
    PositionsTerm,
    PositionsThreshold,
    UniformPrior,
)
from ..terms._formulas import (
    LOGISTIC_CONSTANT,
    gaussian_normalisation,
    log_volume,
    logistic_residuals,
    poisson_deviance,
    standardised,
    threshold_excess,
)
from ..terms._positions import source_plane_offsets
from ._api import mass_rows
from ._image import image, linear_images
from ._registry import DEFLECTION, JACOBIAN
from ._runtime import blas_threads, per_object

TermFunction = Callable[[Any, Any], float]
_TERMS: dict[type, TermFunction] = {}
#: Term classes whose evaluation sets BLAS's threads itself (see `term_value`).
_OWN_THREADS: set[type] = set()


def register_term(
    cls: type, *, sets_threads: bool = False
) -> Callable[[TermFunction], TermFunction]:
    """Registers `fn(term, model) -> float`, the Numba-backend value of the term class
    `cls` (exactly that class). `term_value` runs `fn` with BLAS on one thread unless
    `sets_threads` (the function chooses BLAS's threads itself)."""

    def decorate(fn: TermFunction) -> TermFunction:
        _TERMS[cls] = fn
        if sets_threads:
            _OWN_THREADS.add(cls)
        return fn

    return decorate


def term_value(term: AbstractTerm, model: PyTree[Any]) -> float:
    """`float(term(model))`, computed by the Numba backend."""
    fn = _TERMS.get(type(term))
    if fn is None:
        raise NotImplementedError(
            f"the Numba backend has no evaluation of the term {type(term).__name__}; "
            "register one with equilens.numba.register_term"
        )
    if type(term) in _OWN_THREADS:
        return fn(term, model)
    # NumPy's products on the host (normal equations, model images, chi2) on one BLAS
    # thread: BLAS's workers spin between calls and took the cores from the Numba kernels'
    # threads (on 2 cores, a 128x140 likelihood took 9.5 ms with two BLAS threads and
    # 1.5 ms with one)
    with blas_threads(1):
        return fn(term, model)


def values(objective: Objective, model: PyTree[Any]) -> Float[np.ndarray, " n_terms"]:
    """Each term's (unweighted) value, as `objective.values(model)`."""
    return np.array([term_value(t, model) for t in objective.terms])


def value(objective: Objective | AbstractTerm, model: PyTree[Any]) -> float:
    """`float(objective(model))` (the negative log posterior up to the evidence, or one
    term's value), computed by the Numba backend."""
    if isinstance(objective, AbstractTerm):
        return term_value(objective, model)
    weights = np.asarray(objective.weights, np.float64)
    return float(np.dot(weights, values(objective, model)))


# --------------------------------------------------------------------------------------
# imaging
# --------------------------------------------------------------------------------------


class _HostImaging:
    """An `Imaging` dataset's arrays as float64 NumPy, made once per dataset object."""

    def __init__(self, imaging: Imaging):
        self.grid = imaging.grid
        self.convolution = imaging.convolution
        self.data = np.asarray(imaging.data, np.float64).reshape(-1)
        self.noise = np.asarray(imaging.noise_map, np.float64).reshape(-1)
        self.pixels = np.flatnonzero(np.asarray(imaging.mask))
        self.all_pixels = self.pixels.size == self.data.size
        self.inv_noise = 1.0 / self.noise[self.pixels]
        self.log_noise_sum = float(np.sum(np.log(self.noise[self.pixels])))


_HOST: dict = {}


def host_imaging(imaging: Imaging) -> _HostImaging:
    """The host arrays of `imaging` (cached while `imaging` lives)."""
    return per_object(_HOST, imaging, _HostImaging)


def _cholesky_solve(g: np.ndarray, h: np.ndarray) -> np.ndarray:
    """`g^-1 h` by Cholesky (NaN when `g` is not positive definite). The few-by-few
    systems of the linear light go through NumPy's LAPACK calls directly: SciPy's checks
    cost more than the solve."""
    try:
        low = np.linalg.cholesky(g)
    except np.linalg.LinAlgError:
        return np.full(h.shape, np.nan)
    return np.linalg.solve(low.T, np.linalg.solve(low, h))


def solve_amplitudes(
    system: LensSystem, imaging: Imaging, *, nonnegative: bool = False
) -> tuple[Float[np.ndarray, " n_linear"], Float[np.ndarray, "ny nx"]]:
    """The weighted least-squares amplitudes of the linear light components of `system`
    against `imaging` and the model image with them, as
    `equilens.terms.solve_amplitudes` (Jacobi-scaled normal equations, Cholesky; with
    `nonnegative`, the same Lawson-Hanson active set and the exact solve on it). A
    degenerate basis gives NaN amplitudes."""
    with blas_threads(1):  # (see term_value)
        return _solve_amplitudes(system, imaging, nonnegative)


def _solve_amplitudes(
    system: LensSystem, imaging: Imaging, nonnegative: bool
) -> tuple[Float[np.ndarray, " n_linear"], Float[np.ndarray, "ny nx"]]:
    host = host_imaging(imaging)
    images, fixed = linear_images(system, host.grid, host.convolution)
    flat = images.reshape(images.shape[0], -1)
    a = (flat if host.all_pixels else flat[:, host.pixels]) * host.inv_noise[None, :]
    target = host.data if fixed is None else host.data - fixed.reshape(-1)
    b = (target if host.all_pixels else target[host.pixels]) * host.inv_noise
    g = a @ a.T
    h = a @ b
    g, h, scale = jacobi_scaling(np, g, h, degenerate=0.0)
    if nonnegative:  # (compiled: as NumPy calls, its small solves cost ~2 ms a call)
        from ._solve_kernels import nnls, solve_on

        g, h = np.ascontiguousarray(g), np.ascontiguousarray(h)
        x = solve_on(g, h, nnls(g, h) > 0)
    else:
        x = _cholesky_solve(g, h)
    amps = x * scale
    model = np.tensordot(amps, images, axes=1)
    if fixed is not None:
        model = model + fixed
    return amps, model


def model_image(term: Any, system: LensSystem) -> np.ndarray:
    """The model image an imaging term compares with its data, as `term.model_image`."""
    if isinstance(system.source, PixelizedSource):
        raise TypeError(
            f"{type(term).__name__} cannot solve a PixelizedSource: use equilens.LogEvidence"
        )
    if term.linear:
        return _solve_amplitudes(system, term.imaging, term.nonnegative)[1]
    host = host_imaging(term.imaging)
    return image(system, host.grid, host.convolution)


@register_term(GaussianLikelihood)
def _gaussian(term: GaussianLikelihood, model: LensSystem) -> float:
    host = host_imaging(term.imaging)
    m = model_image(term, model).reshape(-1)[host.pixels]
    r = (host.data[host.pixels] - m) * host.inv_noise
    constant = gaussian_normalisation(host.log_noise_sum, host.pixels.size)
    return float(0.5 * np.dot(r, r) + constant)


@register_term(PoissonLikelihood)
def _poisson(term: PoissonLikelihood, model: LensSystem) -> float:
    host = host_imaging(term.imaging)
    t, bg = float(term.exposure_time), float(term.background)
    m = model_image(term, model).reshape(-1)[host.pixels]
    d = host.data[host.pixels]
    return float(poisson_deviance(np, m, d, bg, t, scipy.special.gammaln))


# --------------------------------------------------------------------------------------
# positions and priors
# --------------------------------------------------------------------------------------


def _mass_of(model: Any) -> AbstractMassProfile:
    return model.mass if isinstance(model, LensSystem | MultiBandLensSystem) else model


#: The lens-equation solve's tolerance (arcsec) and most Newton steps, as
#: `equilens.lensing.solve_lens_equation`'s in float64.
LENS_EQUATION_TOL = 1e-10
LENS_EQUATION_STEPS = 50


def solve_lens_equation(
    mass: AbstractMassProfile,
    x0: Float[np.ndarray, " n"],
    y0: Float[np.ndarray, " n"],
    beta_x: float,
    beta_y: float,
) -> tuple[Float[np.ndarray, " n"], Float[np.ndarray, " n"], Bool[np.ndarray, " n"]]:
    """Newton solves of the lens equation `theta - alpha(theta) = beta` from each start
    `(x0[i], y0[i])` (arcsec), with the analytic Hessians of the mass kernels, as
    `equilens.lensing.solve_lens_equation`: an image has converged when its Newton step
    and its lens-equation residual are below `LENS_EQUATION_TOL` (relative to `1 + |theta|`)
    within `LENS_EQUATION_STEPS` steps. Returns the solutions and whether each converged."""
    tol = LENS_EQUATION_TOL
    x, y = np.array(x0, np.float64), np.array(y0, np.float64)
    done = np.zeros(x.size, dtype=bool)
    ok = np.zeros(x.size, dtype=bool)
    for _ in range(LENS_EQUATION_STEPS):
        todo = np.flatnonzero(~done)
        if todo.size == 0:
            break
        xt, yt = np.ascontiguousarray(x[todo]), np.ascontiguousarray(y[todo])
        alpha = mass_rows(mass, xt, yt, DEFLECTION)
        fx, fy = xt - alpha[0] - beta_x, yt - alpha[1] - beta_y
        fxx, fxy, fyx, fyy = mass_rows(mass, xt, yt, JACOBIAN)
        a11, a12, a21, a22 = 1.0 - fxx, -fxy, -fyx, 1.0 - fyy
        with np.errstate(divide="ignore", invalid="ignore"):
            det = a11 * a22 - a12 * a21
            dx = -(a22 * fx - a12 * fy) / det
            dy = -(a11 * fy - a21 * fx) / det
        x[todo], y[todo] = xt + dx, yt + dy
        small = (np.maximum(np.abs(dx), np.abs(dy)) <= tol * (1.0 + np.hypot(xt, yt))) & (
            np.maximum(np.abs(fx), np.abs(fy)) <= tol
        )
        failed = ~np.isfinite(dx) | ~np.isfinite(dy)
        ok[todo[small & ~failed]] = True
        done[todo[small | failed]] = True
    return x, y, ok


@register_term(MultiBandTerm, sets_threads=True)  # (each band's term sets them)
def _multiband(term: MultiBandTerm, model: MultiBandLensSystem) -> float:
    return math.fsum(term_value(t, s) for t, s in zip(term.terms, term._bands(model), strict=True))


@register_term(PositionsTerm)
def _positions(term: PositionsTerm, model: Any) -> float:
    mass = _mass_of(model)
    x, y = np.asarray(term.x, np.float64), np.asarray(term.y, np.float64)
    alpha = mass_rows(mass, x, y, DEFLECTION)
    fxx, fxy, fyx, fyy = mass_rows(mass, x, y, JACOBIAN)
    (rx, ry), (beta_x, beta_y) = source_plane_offsets(
        x - alpha[0], y - alpha[1], fxx, fxy, fyx, fyy
    )
    if term.plane != "source":
        tx, ty, ok = solve_lens_equation(mass, x, y, float(beta_x), float(beta_y))
        # (an image the solve cannot reach: an infinite residual, as in JAX)
        rx = np.where(ok, tx, np.inf) - x
        ry = np.where(ok, ty, np.inf) - y
    sigma = float(term.sigma)
    r = np.concatenate([rx, ry]) / sigma
    n = 2 * x.size
    return float(0.5 * np.dot(r, r) + gaussian_normalisation(n * math.log(sigma), n))


@register_term(PositionsThreshold)
def _positions_threshold(term: PositionsThreshold, model: Any) -> float:
    x, y = np.asarray(term.x, np.float64), np.asarray(term.y, np.float64)
    alpha = mass_rows(_mass_of(model), x, y, DEFLECTION)
    bx, by = x - alpha[0], y - alpha[1]
    excess = threshold_excess(np, bx, by, float(term.threshold), float(term.sigma))
    return float(0.5 * np.dot(excess, excess))


@register_term(GaussianPrior)
def _gaussian_prior(term: GaussianPrior, model: Any) -> float:
    value = np.asarray(term.where(model), np.float64)
    mean, sigma = np.asarray(term.mean, np.float64), np.asarray(term.sigma, np.float64)
    r = standardised(np, value, mean, sigma)
    return float(0.5 * np.dot(r, r) + gaussian_normalisation(np.sum(np.log(sigma)), sigma.size))


@register_term(LogisticPrior)
def _logistic_prior(term: LogisticPrior, model: Any) -> float:
    value = np.asarray(term.where(model), np.float64)
    r = logistic_residuals(np, value, term.lower, term.upper)
    return float(0.5 * np.dot(r, r) + LOGISTIC_CONSTANT * r.size)


@register_term(UniformPrior)
def _uniform_prior(term: UniformPrior, model: Any) -> float:
    value = np.asarray(term.where(model), np.float64)
    lower, upper = np.asarray(term.lower, np.float64), np.asarray(term.upper, np.float64)
    inside = bool(np.all((value >= lower) & (value <= upper)))
    constant = float(log_volume(np, lower, upper))
    return constant if inside else math.inf


# --------------------------------------------------------------------------------------
# a plain function of a parameter vector, for samplers
# --------------------------------------------------------------------------------------


#: `log_density(backend="auto")` on a CPU leaves objectives whose parametric imaging terms
#: (all bands of a `MultiBandTerm` counted) have more (supersampled) pixels than this to
#: JAX: at 100x100 the two
#: backends' images and likelihoods cost about the same, at 128x140 (the HST lens of
#: examples/nested_sampling_hst.py) JAX's likelihood took 1.19 ms and Numba's 1.39 ms, at
#: 200x200 and 400x400 JAX's image is 1.4x and 1.8x faster (benchmarks/bench_numba.py, 2
#: cores). The pixelized evidence is as fast or faster on the Numba backend at every size
#: measured (50x50 to 400x400).
AUTO_MAX_PIXELS = 128 * 128


def _parametric_pixels(objective: Objective) -> int:
    """The (supersampled) pixels of the objective's parametric imaging terms, summed over
    terms and bands: JAX evaluates them in one compiled call, the Numba backend one band
    after another (four bands of 100^2 + 3 x 50^2 pixels: JAX's joint likelihood 1.4 ms,
    Numba's 2.6 ms, benchmarks/bench_multiband.py)."""
    total = 0
    for term in objective.terms:
        for t in term.terms if isinstance(term, MultiBandTerm) else (term,):
            if isinstance(t, GaussianLikelihood | PoissonLikelihood):
                grid = t.imaging.grid
                total += grid.shape[0] * grid.shape[1] * grid.supersampling**2
    return total


class LogDensity(NamedTuple):
    """`log_density(objective, model, ...)`'s result: `f(vector) -> float`, the start
    `x0`, one name per entry of the vector, each entry's `(lower, upper)` bounds, and the
    backend that evaluates `f` ("numba" or "jax")."""

    f: Callable[[np.ndarray], float]
    x0: np.ndarray
    names: tuple[str, ...]
    bounds: np.ndarray
    backend: str


def log_density(
    objective: Objective,
    model: PyTree[Any],
    *,
    free: PyTree[bool] | Callable[[Any], bool] | None = None,
    bounds: Mapping[Any, tuple[float, float]] | None = None,
    backend: str = "auto",
) -> LogDensity:
    """`-objective` (the log posterior density up to the evidence: the log likelihood of
    the data terms plus the log priors among the terms) as a plain Python function of a
    NumPy vector of the **physical** values of the free parameters, evaluated by the
    Numba backend: for samplers (nested sampling, MCMC) that call a likelihood from NumPy.

    The free parameters, their order and their bounds are those `equilens.fit` uses for
    the same arguments (`free`, `bounds`; the class defaults otherwise; amplitudes the
    objective solves linearly are not free). `names` are `FitResult.names`'s; `bounds` is
    an `(n, 2)` array (`-inf`/`inf` where a parameter is unbounded): a sampler's prior box.
    A vector outside the bounds gets `-inf`, as does a model the likelihood cannot
    evaluate (non-finite value). `f` is safe to call from several threads.

    `backend`: "numba" (`value(objective, model)`), "jax" (the jitted `objective`, on
    JAX's default device, in JAX's precision) or "auto" (default): JAX on an accelerator;
    on a CPU the Numba backend (as fast per call as JAX for the parametric likelihood at
    100x100 pixels, as fast or faster for the pixelized evidence at every size, and no
    compilation per objective: `benchmarks/bench_numba.py`), except for an objective whose
    parametric imaging terms have more than `AUTO_MAX_PIXELS` (128^2) supersampled pixels
    in all (JAX's image is 1.4-1.8x faster at 200^2-400^2, and evaluates the bands of a
    `MultiBandTerm` in one call) or with a class the Numba backend
    cannot evaluate (tried once at `x0`): JAX then. `LogDensity.backend` says which.
    """
    param = Parametrisation.build(model, linear_leaves(model, objective), free=free, bounds=bounds)
    return density(objective, model, param, backend)


def density(
    objective: Objective, model: PyTree[Any], param: Parametrisation, backend: str = "auto"
) -> LogDensity:
    """`log_density` with the free parameters and bounds given as a `Parametrisation`
    (for callers that built it already: `equilens.nested_sample` uses the fit's)."""
    if backend not in ("auto", "numba", "jax"):
        raise ValueError(f"backend must be 'auto', 'numba' or 'jax', got {backend!r}")
    leaves, treedef = jax.tree.flatten(model)
    free_leaves = [i for i, f in enumerate(param.free) if f]
    shapes = [np.shape(leaves[i]) for i in free_leaves]
    sizes = [int(np.prod(s)) for s in shapes]
    host_leaves = [np.asarray(leaf) if eqx.is_array(leaf) else leaf for leaf in leaves]
    x0 = np.concatenate([np.asarray(leaves[i], np.float64).reshape(-1) for i in free_leaves])
    box = np.array(
        [
            b if b is not None else (-math.inf, math.inf)
            for i, n in zip(free_leaves, sizes, strict=True)
            for b in [param.bounds[i]] * n
        ],
        dtype=np.float64,
    ).reshape(-1, 2)
    lower, upper = box[:, 0], box[:, 1]
    offsets = np.cumsum([0, *sizes])

    def numba_value(v: np.ndarray) -> float:
        new = list(host_leaves)
        for k, i in enumerate(free_leaves):
            new[i] = v[offsets[k] : offsets[k + 1]].reshape(shapes[k])
        return value(objective, jax.tree.unflatten(treedef, new))

    def jax_objective(v, objective, leaves):
        new = list(leaves)
        for k, i in enumerate(free_leaves):
            new[i] = (
                v[offsets[k] : offsets[k + 1]].reshape(shapes[k]).astype(jnp.result_type(leaves[i]))
            )
        return objective(jax.tree.unflatten(treedef, new))

    jitted = eqx.filter_jit(jax_objective)

    def jax_value(v: np.ndarray) -> float:
        return float(jitted(jnp.asarray(v), objective, leaves))

    if backend == "auto":
        from ._runtime import numba_available

        backend = "numba" if jax.default_backend() == "cpu" and numba_available() else "jax"
        if _parametric_pixels(objective) > AUTO_MAX_PIXELS:
            backend = "jax"
        if backend == "numba":
            try:  # (one evaluation: a class without a Numba kernel leaves it to JAX)
                numba_value(x0)
            except NotImplementedError:
                backend = "jax"
    evaluate = numba_value if backend == "numba" else jax_value

    def f(vector: np.ndarray) -> float:
        v = np.asarray(vector, np.float64)
        if v.shape != x0.shape:
            raise ValueError(f"expected a vector of {x0.size} parameters, got shape {v.shape}")
        if not (np.all(v >= lower) and np.all(v <= upper)):
            return -math.inf
        out = -evaluate(v)
        return out if math.isfinite(out) else -math.inf

    return LogDensity(f, x0, param.paths(model), box, backend)
