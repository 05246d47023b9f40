"""`fit_lens`: the staged fit of an imaging dataset used by the `equilens` command."""

import dataclasses
import operator
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Float

from .._lens_system import LensSystem
from .._multiband import MultiBandLensSystem
from ..data import Imaging, MultiBandImaging
from ..lensing import image_positions
from ..light import FixedLight, LightSum
from ..objective import Objective, select
from ..source import (
    AbstractMesh,
    AbstractRegularization,
    DelaunayMesh,
    Inversion,
    PixelizedSource,
)
from ..terms import (
    GaussianLikelihood,
    LogEvidence,
    MultiBandTerm,
    PositionsTerm,
    PositionsThreshold,
)
from ._fit import SolverLike, fit, with_conditional_covariance, with_smoothed_covariance
from ._plausible import SIZE_FIELDS, has_field
from ._residuals import with_arc_check, with_band_arc_checks
from ._result import FitResult
from ._search import _source_at, arc_placement, first_mass, lens_search_space, search
from ._start import light_moments, start_model

#: The Einstein radii `fit_lens` searches, as fractions of the mask radius, and its bounds.
THETA_E_SEARCH = (0.1, 0.8)
THETA_E_BOUNDS = (0.02, 1.0)
#: Upper bound of a parametric source's size (`R_sersic`, `sigma`, `beta`), as a fraction
#: of the mask radius: a lensed source is compact next to its Einstein ring.
SOURCE_SIZE_BOUND = 0.5


def lens_bounds(model: LensSystem, mask_radius: float) -> dict[Any, tuple[float, float]]:
    """The physical bounds `fit_lens` fits within: the Einstein radius of the first mass
    component within `THETA_E_BOUNDS` x `mask_radius`, and every parametric source
    component's size below `SOURCE_SIZE_BOUND` x `mask_radius` (a source that runs off to
    a huge, diffuse blob then ends at a bound, which `implausible_notes` reports)."""
    te = _einstein_radius_where(model)
    out: dict[Any, tuple[float, float]] = {
        te: (THETA_E_BOUNDS[0] * mask_radius, THETA_E_BOUNDS[1] * mask_radius)
    }
    size_hi = SOURCE_SIZE_BOUND * mask_radius
    comps = model.source.components if isinstance(model.source, LightSum) else None
    for i, c in enumerate(comps if comps is not None else (model.source,)):
        for name in SIZE_FIELDS:
            if has_field(c, name) and name not in getattr(type(c), "fixed", ()):
                if comps is None:
                    out[lambda s, n=name: getattr(s.source, n)] = (0.0, size_hi)
                else:
                    out[lambda s, i=i, n=name: getattr(s.source.components[i], n)] = (0.0, size_hi)
    return out


def _checked_positions(positions: Any) -> np.ndarray:
    """`positions` (the images of one source point, x and y in arcsec) as a float `(n, 2)`
    array; `ValueError` unless n >= 2 and every value is finite."""
    pos = np.asarray(positions, dtype=float)
    if pos.ndim != 2 or pos.shape[1] != 2 or pos.shape[0] < 2:
        raise ValueError(f"positions must have shape (n >= 2, 2), got {pos.shape}")
    if not np.isfinite(pos).all():
        raise ValueError("positions must be finite")
    return pos


def _positions_term(positions: Any, sigma: float | None, pixel_scale: float) -> PositionsTerm:
    """The source-plane `PositionsTerm` of `fit_lens`'s `positions` (`(n >= 2, 2)`, arcsec)
    with 1-sigma `sigma` (default a pixel)."""
    pos = _checked_positions(positions)
    s = pixel_scale if sigma is None else float(sigma)
    if not s > 0:
        raise ValueError(f"positions_sigma must be > 0 arcsec, got {sigma}")
    return PositionsTerm(pos[:, 0], pos[:, 1], s)


def fit_lens(
    imaging: Imaging,
    mass: str = "sie+shear",
    lens_light: str | None = "mge",
    source: str = "sersic",
    *,
    solver: SolverLike = "lm",
    max_steps: int = 300,
    n_screen: int = 512,
    n_refine: int = 4,
    positions: Any = None,
    positions_sigma: float | None = None,
    log: Callable[[str], None] | None = print,
    progress: bool = False,
    on_stage: Callable[[str, FitResult], None] | None = None,
    search_supersampling: int | None = None,
) -> FitResult:
    """Fits a lens model to `imaging` from a generic start, in three stages (the usual
    pipeline of the field, e.g. PyAutoLens's SLaM):

    1. the lens light alone (mass and source held at their starts);
    2. a global search (`equilens.solve.search`) over the mass and source: `n_screen`
       starts over the Einstein radius (`THETA_E_SEARCH` x the mask radius), mass
       ellipticity and shear, screened in one vmapped batch, each with its source placed
       where its mass maps the arcs (`arc_placement`: the pixels of the data minus the
       stage-1 lens light above 3 sigma, PSF-matched; without such pixels the source
       position is searched too); 32 of them, spread over the space, polished by 15
       steps, the best `n_refine` refined together; the best plausible minimum kept. The
       search's model images are evaluated at `search_supersampling` (default: 1, one
       point per pixel, when the PSF is given at the data's resolution; else the
       dataset's own): it only has to find the basin, and each of its steps costs
       `supersampling^2` times less (the demo's search 61 -> 16 s at 2x2);
    3. everything together, from that model, at the dataset's supersampling; its
       covariance is reported.

    Profiles are named as in `start_model` (`"sie+shear"`, `"mge"`, `"sersic"`, ...); every
    starting value comes from the data (`light_moments`); the amplitudes are solved
    linearly and constrained to be positive (`GaussianLikelihood(nonnegative=True)`);
    `lens_bounds` keeps the Einstein radius inside the data and the source
    compact. A result at a bound or otherwise implausible has the status
    `RESULTS.implausible` with the reasons in `notes`. `positions` (an `(n, 2)` array of
    `x, y` in arcsec, n >= 2) are the observed positions of the multiple images of one
    source point: they add a `PositionsTerm` (source plane, 1-sigma `positions_sigma`,
    default a pixel) to every stage, so a mass model that does not map them to one source
    point is penalised in the search too. `on_stage(name, result)`, if given, is called
    with each stage's `FitResult` as it ends (`"lens light"`, `"search"`, `"all free"`):
    what a caller keeps when the run is interrupted. Returns the stage-3 `FitResult`
    (wall time of all stages).
    """
    t0 = time.perf_counter()
    say = log or (lambda _: None)
    # positive amplitudes: light is positive, and the overlapping Gaussians of an MGE are
    # nearly degenerate on a finite mask (unconstrained, their amplitudes alternate in sign
    # by orders of magnitude, fit the arcs and make the joint solve with a source singular)
    terms: list[Any] = [GaussianLikelihood(imaging, nonnegative=True)]
    if positions is not None:
        terms.append(_positions_term(positions, positions_sigma, imaging.pixel_scale))
    objective = Objective(terms)
    searched = _search_objective(objective, imaging, search_supersampling)
    model = start_model(imaging, mass, lens_light, source)
    radius = light_moments(imaging).mask_radius
    bounds = lens_bounds(model, radius)
    if lens_light is not None:
        r = fit(
            objective,
            model,
            solver,
            free=select(model, lambda s: s.lens_light),
            max_steps=max_steps,
            throw=False,
            progress=progress,
            covariance=False,
        )
        say(
            f"  stage 1 (lens light): reduced chi2 {float(r.reduced_chi2):.3f} "
            f"({float(r.wall_time):.1f} s)"
        )
        model = r.model
        if on_stage is not None:
            on_stage("lens light", r)
    placement = arc_placement(imaging, model) if _source_at(model) is not None else None
    if placement is not None:
        say(f"  arcs: {placement.x.size} pixels above 3 sigma place the source of each start")
    space = lens_search_space(
        model,
        theta_E=(THETA_E_SEARCH[0] * radius, THETA_E_SEARCH[1] * radius),
        source_position=placement is None,
    )
    found = search(
        searched,
        model,
        space,
        n_screen=n_screen,
        n_refine=n_refine,
        solver=solver,
        free=select(model, lambda s: (s.mass, s.source)),
        bounds=bounds,
        max_steps=max_steps,
        prepare=placement,
        covariance=False,
    )
    say("  stage 2 (mass and source), " + found.summary().replace("\n", "\n  "))
    say(
        f"    best: reduced chi2 {float(found.best.reduced_chi2):.3f}, {found.best.message()} "
        f"({found.wall_time:.1f} s)"
    )
    if on_stage is not None:
        on_stage("search", found.best)
    r = fit(
        objective,
        found.best.model,
        solver,
        bounds=bounds,
        max_steps=max_steps,
        throw=False,
        progress=progress,
    )
    r, _ = with_arc_check(imaging, r, say)
    say(
        f"  stage 3 (all free): reduced chi2 {float(r.reduced_chi2):.3f}, {r.message()} "
        f"({float(r.wall_time):.1f} s)"
    )
    r = dataclasses.replace(r, wall_time=time.perf_counter() - t0)
    if on_stage is not None:
        on_stage("all free", r)
    return r


def _search_objective(
    objective: Objective, imaging: Imaging, supersampling: int | None
) -> Objective:
    """`objective` with its likelihood's dataset evaluated at `supersampling` (None: 1
    when the PSF is at the data's resolution, else the dataset's own)."""
    if supersampling is None:
        supersampling = 1 if imaging.psf.supersampling == 1 else imaging.grid.supersampling
    if supersampling == imaging.grid.supersampling:
        return objective
    coarse = imaging.with_supersampling(supersampling)
    return eqx.tree_at(lambda o: o.terms[0].imaging, objective, coarse)


def fit_multiband(
    data: MultiBandImaging,
    mass: str = "sie+shear",
    lens_light: str | None = "mge",
    source: str = "sersic",
    *,
    solver: SolverLike = "lm",
    max_steps: int = 300,
    positions: Any = None,
    positions_sigma: float | None = None,
    log: Callable[[str], None] | None = print,
    progress: bool = False,
    on_stage: Callable[[str, FitResult], None] | None = None,
) -> FitResult:
    """Fits one lens model to every band of `data` jointly, from a generic start:

    1. `fit_lens` on the first band (the reference: give the sharpest or deepest band
       first), with its global search;
    2. that model as a `MultiBandLensSystem` with the lens light and the source shared in
       shape by all bands and per-band amplitudes (solved linearly, positive, in every
       band), fitted to all bands together (`MultiBandTerm` of `GaussianLikelihood`s, plus
       a `PositionsTerm` when `positions` are given), everything free, within the
       reference band's `lens_bounds`.

    Returns the joint `FitResult` (its model a `MultiBandLensSystem`; wall time of both
    stages). Profiles, positions, bounds and `on_stage` as in `fit_lens` (the joint fit's
    stage is `"joint"`)."""
    if not isinstance(data, MultiBandImaging):
        raise TypeError(f"fit_multiband needs a MultiBandImaging, got {type(data).__name__}")
    t0 = time.perf_counter()
    say = log or (lambda _: None)
    ref = data.bands[0]
    say(f"  reference band {data.names[0]!r}:")
    single = fit_lens(
        ref,
        mass,
        lens_light,
        source,
        solver=solver,
        max_steps=max_steps,
        positions=positions,
        positions_sigma=positions_sigma,
        log=log,
        progress=progress,
        on_stage=on_stage,
    )
    m = single.model
    start = MultiBandLensSystem(m.mass, m.source, m.lens_light, bands=len(data))
    terms: list[Any] = [MultiBandTerm.build(data, GaussianLikelihood, nonnegative=True)]
    if positions is not None:
        terms.append(_positions_term(positions, positions_sigma, ref.pixel_scale))
    radius = light_moments(ref).mask_radius
    bounds = {(lambda s, w=where: w(s.band(0))): b for where, b in lens_bounds(m, radius).items()}
    r = fit(
        Objective(terms),
        start,
        solver,
        bounds=bounds,
        max_steps=max_steps,
        throw=False,
        progress=progress,
    )
    r = with_band_arc_checks(data, r, r.model.bands(), say)
    say(
        f"  joint fit of {len(data)} bands: reduced chi2 {float(r.reduced_chi2):.3f}, {r.message()}"
    )
    r = dataclasses.replace(r, wall_time=time.perf_counter() - t0)
    if on_stage is not None:
        on_stage("joint", r)
    return r


def _einstein_radius_where(model: LensSystem) -> Callable[[LensSystem], Any]:
    """`where` picking the Einstein radius (`theta_E`) of the first mass component."""
    at, _ = first_mass(model)
    return lambda s: at(s).theta_E


#: `fit_pixelized`'s positions threshold (arcsec, source plane): `POSITIONS_FACTOR` times
#: the traced spread of the positions under the starting model, and at least
#: `POSITIONS_MIN_THRESHOLD` (PyAutoLens's SLaM pipelines use the same two numbers).
POSITIONS_FACTOR = 3.0
POSITIONS_MIN_THRESHOLD = 0.2


def auto_positions(imaging: Imaging, model: LensSystem) -> Float[np.ndarray, "n 2"] | None:
    """The multiple images of the source's centre under `model`'s mass, inside `imaging`'s
    mask: positions for a `PositionsThreshold` that keeps a later fit (a pixelized source,
    a more flexible mass) mapping the same arcs to one source region, as PyAutoLens's
    pipelines do from their parametric result. The source centre is that of the first
    source component (a parametric fit's compact source: its brightest point). Returns an
    `(n, 2)` array of `(x, y)` in arcsec, or `None` when the model has no source centre
    or fewer than two of its images lie in the mask (nothing to hold together)."""
    at = _source_at(model)
    if at is None:
        return None
    src = at(model)
    found = image_positions(model.mass, src.center_x, src.center_y, imaging.grid)
    if found.shape[0] == 0:
        return None
    g = imaging.grid
    col = np.rint((found[:, 0] - g.origin[0]) / g.pixel_scale + (g.shape[1] - 1) / 2).astype(int)
    row = np.rint((found[:, 1] - g.origin[1]) / g.pixel_scale + (g.shape[0] - 1) / 2).astype(int)
    inside = (row >= 0) & (row < g.shape[0]) & (col >= 0) & (col < g.shape[1])
    inside[inside] = np.asarray(imaging.mask)[row[inside], col[inside]]
    found = found[inside]
    return found if found.shape[0] >= 2 else None


def threshold_term(
    model: LensSystem, positions: Float[np.ndarray, "n 2"], threshold: float | None = None
) -> PositionsThreshold:
    """A `PositionsThreshold` on `positions` (`(n, 2)`, arcsec): its threshold is
    `threshold` (arcsec, source plane), or by default `POSITIONS_FACTOR` times the largest
    traced distance of the positions from their mean under `model`, and at least
    `POSITIONS_MIN_THRESHOLD`; its wall's `sigma` is a thousandth of the threshold."""
    pos = np.asarray(positions, dtype=float)
    if threshold is None:
        bx, by = (
            np.asarray(v)
            for v in model.mass.ray_shoot(jnp.asarray(pos[:, 0]), jnp.asarray(pos[:, 1]))
        )
        spread = float(np.max(np.hypot(bx - bx.mean(), by - by.mean())))
        threshold = max(POSITIONS_FACTOR * spread, POSITIONS_MIN_THRESHOLD)
    if not threshold > 0:
        raise ValueError(f"positions threshold must be > 0 arcsec, got {threshold}")
    return PositionsThreshold(pos[:, 0], pos[:, 1], threshold=threshold, sigma=1e-3 * threshold)


#: Regularization strengths tried before the evidence fit picks one (`fit_pixelized`).
COEFFICIENT_GRID = tuple(10.0**k for k in range(-9, 3))


def pixelized_model(
    model: LensSystem,
    mesh: AbstractMesh,
    regularization: AbstractRegularization,
) -> LensSystem:
    """`model` with its source replaced by `PixelizedSource(mesh, regularization)`."""
    return eqx.tree_at(lambda s: s.source, model, PixelizedSource(mesh, regularization))


def _strength_where(system: LensSystem) -> Callable[[LensSystem], Any]:
    assert isinstance(system.source, PixelizedSource)
    names = [n for n in type(system.source.regularization).bounds if n.endswith("coefficient")]
    return lambda s: tuple(getattr(s.source.regularization, n) for n in names)  # pyright: ignore[reportAttributeAccessIssue]


def _evidence_fit(
    objective: Objective,
    start: Any,
    free: Any,
    solver: SolverLike,
    max_steps: int,
    progress: bool,
    covariance: bool = True,
) -> FitResult:
    """One fit of an evidence objective, with the covariance made robust to its roughness
    (none with `covariance=False`: an intermediate stage)."""
    r = fit(
        objective,
        start,
        solver,
        free=free,
        max_steps=max_steps,
        throw=False,
        progress=progress,
        covariance=covariance,
    )
    if not covariance:
        return r
    # the evidence is rough on scales below the errors (traced pixels cross the mesh's
    # cells), so its autodiff Hessian can be indefinite at a minimum: the curvature of its
    # values over 1-sigma steps instead; a regularization hyperparameter the evidence does
    # not constrain (e.g. the inner coefficient of an AdaptiveBrightness whose signal is
    # nowhere 1) leaves even that singular: the mass errors are then given with the
    # hyperparameters held
    r = with_smoothed_covariance(r, objective, free)
    mass = jax.tree.map(operator.and_, free, select(start, lambda s: s.mass))
    r = with_smoothed_covariance(r, objective, mass)
    return with_conditional_covariance(r, objective, mass)


def fit_pixelized(
    imaging: Imaging,
    model: LensSystem,
    *,
    solver: SolverLike | None = None,
    fit_strength: bool = True,
    lens_light: str = "solved",
    rounds: int = 3,
    max_steps: int = 1000,
    positions: Any = None,
    positions_threshold: float | None = None,
    log: Callable[[str], None] | None = print,
    progress: bool = False,
) -> tuple[FitResult, Inversion, list[dict[str, Any]]]:
    """Fits a lens model with a pixelized source by maximising the Bayesian evidence
    (`LogEvidence`), from `model` (usually the mass and lens light of a parametric fit,
    `fit_lens`, with `pixelized_model` putting in the source). A chain of stages:

    1. with `fit_strength`, the regularization's strength coefficients start at the best
       of `COEFFICIENT_GRID` and are fitted alone (mass held);
    2. the mass (and, with `fit_strength`, the regularization parameters) by `solver`
       (a minimiser: the evidence has no least-squares form). The default is BFGS, or adam
       for a `DelaunayMesh`, whose evidence is only piecewise smooth (the triangulation
       changes with the mass), which stalls quasi-Newton line searches;
    3. for a regularization that adapts to the source's brightness
       (`AdaptiveBrightness`), up to `rounds - 1` more rounds: the adapt image becomes the
       lensed source of the last reconstruction (instead of the data, which holds the lens
       light too), and stage 2 is repeated; the chain stops when the log-evidence gains
       less than 1 (or drops: the previous round is kept).

    `max_steps` is per stage (default 1000: BFGS on the evidence of an adaptive mesh,
    whose quantile nodes make it only piecewise smooth, can need several hundred steps
    from a parametric start).

    `lens_light`: "solved" (its linear amplitudes solved in the same system as the
    source, unregularized) or "fixed" (held as it is in `model`, `FixedLight`: the usual
    choice after a parametric fit, and the only sound one for a multi-Gaussian lens light,
    whose nearly degenerate Gaussians make an unregularized joint solve singular).

    `positions`: an `(n, 2)` array of `(x, y)` in arcsec, the multiple images of one
    source point (e.g. `auto_positions(imaging, parametric.model)`: the images of a
    parametric fit's source centre, as the `equilens` command does), or `None`. With
    positions, every stage adds a `PositionsThreshold` (`threshold_term`: the images must
    keep tracing within `positions_threshold` arcsec of their mean in the source plane;
    default 3 times their spread under the starting model, at least 0.2"): the guard of
    the established pipelines against mass models that map the arcs to a large, smeared
    source, which a pixelized source can fit nearly as well. Each stage's record then
    holds its `positions_penalty` (zero while the guard is not touched).

    The errors are those of the Laplace approximation over every fitted parameter. The
    evidence is smooth only piecewise in the mass (traced pixels cross the mesh's cells),
    so when its autodiff Hessian is not positive definite, the curvature comes from its
    values over 1-sigma steps (`with_smoothed_covariance`); when that is singular too (a
    hyperparameter the evidence leaves unconstrained), the mass errors with the
    hyperparameters held (`with_smoothed_covariance`, then `with_conditional_covariance`,
    over the mass alone). The result's `notes` say which.

    Returns the `FitResult` of the last kept stage (solved source and amplitudes filled
    in), its `Inversion` (the source's 1-sigma errors included), and one record per stage
    (`{"stage": name, "log_evidence": value, "status": words}`)."""
    t0 = time.perf_counter()
    say = log or (lambda _: None)
    if not isinstance(model.source, PixelizedSource):
        raise TypeError("fit_pixelized needs a model whose source is a PixelizedSource")
    if lens_light not in ("solved", "fixed"):
        raise ValueError(f'lens_light must be "solved" or "fixed", got {lens_light!r}')
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if lens_light == "fixed" and model.lens_light is not None:
        if not isinstance(model.lens_light, FixedLight):
            model = eqx.tree_at(lambda s: s.lens_light, model, FixedLight(model.lens_light))
    if solver is None:
        delaunay = isinstance(model.source.mesh, DelaunayMesh)  # pyright: ignore[reportAttributeAccessIssue]
        solver = "adam" if delaunay else "bfgs"
    term = LogEvidence(imaging)
    dtype = imaging.data.dtype
    stages: list[dict[str, Any]] = []
    guard: tuple[Any, ...] = ()
    if positions is not None:
        pos = _checked_positions(positions)
        guard = (threshold_term(model, pos, positions_threshold),)
        say(
            f"  positions: {pos.shape[0]} images held within "
            f'{float(guard[0].threshold):.3g}" of each other in the source plane'
        )

    def record(name: str, r: FitResult) -> None:
        # the evidence term comes first; a positions guard adds nothing inside its threshold
        log_ev = -float(r.term_values[0])
        stages.append({"stage": name, "log_evidence": log_ev, "status": r.message()})
        if guard:
            stages[-1]["positions_penalty"] = float(r.term_values[1])
        say(f"  {name}: log evidence {log_ev:.1f}, {r.message()}")

    def run(objective: Objective, start: LensSystem, free: Any, covariance=True) -> FitResult:
        return _evidence_fit(objective, start, free, solver, max_steps, progress, covariance)

    if fit_strength:
        where = _strength_where(model)
        value = eqx.filter_jit(lambda t, m: t(m))
        scores = []
        for c in COEFFICIENT_GRID:
            trial = eqx.tree_at(where, model, replace_fn=lambda _, c=c: jnp.asarray(c, dtype))
            scores.append(float(value(term, trial)))
        best = COEFFICIENT_GRID[int(np.nanargmin(scores))]
        model = eqx.tree_at(where, model, replace_fn=lambda _: jnp.asarray(best, dtype))
        say(f"  regularization start {best:g} (log evidence {-min(scores):.1f})")
        regularization = select(model, lambda s: s.source.regularization)  # pyright: ignore[reportAttributeAccessIssue]
        r = run(Objective([term, *guard]), model, regularization, covariance=False)
        record("stage 1 (regularization)", r)
        model = r.model
    free = select(model, lambda s: (s.mass, s.source.regularization) if fit_strength else s.mass)  # pyright: ignore[reportAttributeAccessIssue]
    r = run(Objective([term, *guard]), model, free)
    record("stage 2 (mass)", r)
    uses_signal = model.source.regularization.uses_signal  # pyright: ignore[reportAttributeAccessIssue]
    for k in range(1, rounds if uses_signal else 1):
        completed = term.complete(r.model)
        lensed = dataclasses.replace(completed, lens_light=None)
        adapt = np.asarray(lensed.image(imaging.grid, imaging.convolution))
        new_term = LogEvidence(imaging, adapt_image=adapt)
        trial = run(Objective([new_term, *guard]), r.model, free)
        record(f"stage {2 + k} (adapted to the source, round {k})", trial)
        gain = float(r.value) - float(trial.value)
        if not trial.success or not gain > 0:
            say("    (no gain: the previous stage is kept)")
            break
        r, term = trial, new_term
        if gain < 1.0:
            break
    inversion = eqx.filter_jit(lambda t, m: t.invert(m, errors=True))(term, r.model)
    r, _ = with_arc_check(imaging, r, say, term.complete(r.model))
    return dataclasses.replace(r, wall_time=time.perf_counter() - t0), inversion, stages


def _fixed(light: Any) -> FixedLight:
    return light if isinstance(light, FixedLight) else FixedLight(light)


def fit_multiband_pixelized(
    data: MultiBandImaging,
    model: MultiBandLensSystem,
    mesh: AbstractMesh,
    regularization: AbstractRegularization,
    *,
    solver: SolverLike | None = None,
    fit_strength: bool = True,
    max_steps: int = 1000,
    positions: Any = None,
    positions_threshold: float | None = None,
    log: Callable[[str], None] | None = print,
    progress: bool = False,
) -> tuple[FitResult, tuple[Inversion, ...], list[dict[str, Any]]]:
    """Fits a pixelized source in every band of `data` jointly, by the sum of the bands'
    Bayesian evidences (`MultiBandTerm` of `LogEvidence`s), from `model` (e.g. the result
    of `fit_multiband`): one mass model; in each band the lens light held as it is in
    `model` (`FixedLight`) and a source of its own on `mesh` (the same mesh in every band,
    each traced through its band's grid) with its own copy of `regularization`, whose
    strength each band's evidence sets (bands differ in flux units and signal-to-noise).

    Stages, as `fit_pixelized`'s first two: each band's strength started at the best of
    `COEFFICIENT_GRID` and fitted with the mass held (when `fit_strength`), then the mass
    and the strengths together. A regularization that adapts to the source's brightness
    uses the data as its brightness estimate (no adaptation rounds). `positions` and
    `positions_threshold` add `fit_pixelized`'s `PositionsThreshold` guard (on the shared
    mass). The default solver is BFGS, or adam for a `DelaunayMesh`.

    Returns the `FitResult` of the last stage (every band's source solved), each band's
    `Inversion` (source errors included), and one record per stage (`{"stage", "log_evidence"
    (the sum over bands), "band_log_evidence", "status"}`)."""
    t0 = time.perf_counter()
    say = log or (lambda _: None)
    if not isinstance(data, MultiBandImaging):
        raise TypeError(f"expected a MultiBandImaging, got {type(data).__name__}")
    if not isinstance(model, MultiBandLensSystem) or model.n_bands != len(data):
        raise ValueError(f"model must be a MultiBandLensSystem of the {len(data)} bands")
    if solver is None:
        solver = "adam" if isinstance(mesh, DelaunayMesh) else "bfgs"
    bands = model.bands()
    lens = None
    if model.lens_light is not None:
        lens = tuple(_fixed(b.lens_light) for b in bands)
    sources = [PixelizedSource(mesh, regularization) for _ in bands]
    terms = [LogEvidence(b) for b in data.bands]
    dtype = data.bands[0].data.dtype
    if fit_strength:  # each band's strength started at the best of a coarse grid
        value = eqx.filter_jit(lambda t, m: t(m))
        for i, (t, band) in enumerate(zip(terms, bands, strict=True)):
            trial_system = LensSystem(band.mass, sources[i], None if lens is None else lens[i])
            where = _strength_where(trial_system)
            scores = []
            for c in COEFFICIENT_GRID:
                trial = eqx.tree_at(
                    where, trial_system, replace_fn=lambda _, c=c: jnp.asarray(c, dtype)
                )
                scores.append(float(value(t, trial)))
            best = COEFFICIENT_GRID[int(np.nanargmin(scores))]
            chosen = eqx.tree_at(
                where, trial_system, replace_fn=lambda _, b=best: jnp.asarray(b, dtype)
            )
            sources[i] = chosen.source
            say(f"  band {data.names[i]}: regularization start {best:g}")
    start = MultiBandLensSystem(model.mass, tuple(sources), lens)
    term = MultiBandTerm(terms, data.names)
    guard: tuple[Any, ...] = ()
    if positions is not None:
        pos = _checked_positions(positions)
        guard = (threshold_term(start.band(0), pos, positions_threshold),)
    objective = Objective([term, *guard])
    stages: list[dict[str, Any]] = []
    band_values = eqx.filter_jit(lambda t, m: t.values(m))

    def record(name: str, r: FitResult) -> None:
        per_band = [-float(v) for v in band_values(term, r.model)]
        stages.append(
            {
                "stage": name,
                "log_evidence": -float(r.term_values[0]),
                "band_log_evidence": dict(zip(data.names, per_band, strict=True)),
                "status": r.message(),
            }
        )
        if guard:
            stages[-1]["positions_penalty"] = float(r.term_values[1])
        say(f"  {name}: log evidence {-float(r.term_values[0]):.1f}, {r.message()}")

    def regs(m: MultiBandLensSystem) -> Any:
        return tuple(s.regularization for s in m.source)  # pyright: ignore[reportAttributeAccessIssue]

    if fit_strength:
        r = _evidence_fit(
            objective, start, select(start, regs), solver, max_steps, progress, covariance=False
        )
        record("stage 1 (regularization)", r)
        start = r.model
    free = select(start, lambda m: (m.mass, *regs(m)) if fit_strength else m.mass)
    r = _evidence_fit(objective, start, free, solver, max_steps, progress)
    record("stage 2 (mass)", r)
    inversions = eqx.filter_jit(lambda t, m: t.invert(m, errors=True))(term, r.model)
    r = with_band_arc_checks(data, r, term.complete(r.model).bands(), say)
    return dataclasses.replace(r, wall_time=time.perf_counter() - t0), inversions, stages
