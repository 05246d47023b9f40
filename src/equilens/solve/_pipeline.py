"""`fit_lens`: the staged fit of an imaging dataset used by the `equilens` command."""

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Float

from .._checks import parameters
from .._lens_system import LensSystem
from .._multiband import MultiBandLensSystem
from ..data import Imaging, MultiBandImaging
from ..lensing import image_positions
from ..light import LightSum, Sersic
from ..mass import ExternalShear, MassSum
from ..objective import Objective, select
from ..terms import (
    GaussianLikelihood,
    MultiBandTerm,
    PositionsTerm,
)
from ._batch import pick
from ._fit import fit
from ._plausible import SIZE_FIELDS, has_field
from ._residuals import with_arc_check, with_band_arc_checks
from ._result import RESULTS, FitResult
from ._rivals import with_rival_minima
from ._search import (
    ArcPlacement,
    _code,
    _source_at,
    arc_placement,
    first_mass,
    lens_search_space,
    residual_placement,
    search,
)
from ._solvers import SolverLike
from ._start import light_moments, start_model

#: The Einstein radii `fit_lens` searches, as fractions of the mask radius, and its bounds.
THETA_E_SEARCH = (0.1, 0.8)
THETA_E_BOUNDS = (0.02, 1.0)
#: Upper bound of a parametric source's size (`R_sersic`, `sigma`, `beta`), as a fraction
#: of the mask radius: a lensed source is compact next to its Einstein ring.
SOURCE_SIZE_BOUND = 0.5


#: How far (arcsec, in x and in y) a mass centre may lie from the lens light's centre.
MASS_CENTER_RANGE = 0.2
#: How far (arcsec, in x and in y) a mass centre may lie from the centre of the arcs' ring
#: (`arc_center`) when the model has no lens light to place it: the ring's centre is off
#: the lens's by up to 0.23" on the subhalo suite's lenses (arcs brighter on one side).
ARC_CENTER_RANGE = 0.5
#: The largest external shear component (`gamma1`, `gamma2`) `fit_lens` fits.
SHEAR_BOUND = 0.25


def lens_bounds(
    model: LensSystem,
    mask_radius: float,
    center: tuple[float, float] | None = None,
    center_range: float = MASS_CENTER_RANGE,
) -> dict[Any, tuple[float, float]]:
    """The physical bounds `fit_lens` fits within: the Einstein radius of the first mass
    component within `THETA_E_BOUNDS` x `mask_radius`; every mass centre within
    +-`center_range` (arcsec; default `MASS_CENTER_RANGE`) of `center` (x, y in arcsec),
    by default the centre of `model`'s lens light (its first component's, when it has
    one: the mass of a galaxy lies where its light is, and a fit that moves it further
    away has found a minimum of the arcs alone; without a lens light, `mass_anchor` gives
    the centre of the arcs' ring and `ARC_CENTER_RANGE`; a range that would leave out the
    model's own mass centre, one that ended at the bound of a range around a light centre
    that has moved since, is widened to hold it, so that a fit can start there); every
    `ExternalShear`'s `gamma1`, `gamma2` within +-`SHEAR_BOUND`; and every parametric
    source component's size below `SOURCE_SIZE_BOUND` x `mask_radius` (a source that runs
    off to a huge, diffuse blob then ends at a bound). A fit that ends at any of these
    bounds is reported `implausible` (`implausible_notes`)."""
    te = _einstein_radius_where(model)
    out: dict[Any, tuple[float, float]] = {
        te: (THETA_E_BOUNDS[0] * mask_radius, THETA_E_BOUNDS[1] * mask_radius)
    }
    light = _light_center(model) if center is None else (float(center[0]), float(center[1]))
    masses = model.mass.components if isinstance(model.mass, MassSum) else (model.mass,)
    for i, c in enumerate(masses):
        at = (lambda s: s.mass) if len(masses) == 1 else (lambda s, i=i: s.mass.components[i])
        if isinstance(c, ExternalShear):
            for name in ("gamma1", "gamma2"):
                out[lambda s, at=at, n=name: getattr(at(s), n)] = (-SHEAR_BOUND, SHEAR_BOUND)
        elif light is not None and has_field(c, "center_x") and has_field(c, "center_y"):
            r = float(center_range)
            for name, v in zip(("center_x", "center_y"), light, strict=True):
                now = float(getattr(c, name))
                lo, hi = min(v - r, now - 0.05 * r), max(v + r, now + 0.05 * r)
                lo, hi = (v - r, v + r) if v - r < now < v + r else (lo, hi)
                out[lambda s, at=at, n=name: getattr(at(s), n)] = (lo, hi)
    size_hi = SOURCE_SIZE_BOUND * mask_radius
    comps = model.source.components if isinstance(model.source, LightSum) else None
    for i, c in enumerate(comps if comps is not None else (model.source,)):
        for name in SIZE_FIELDS:
            if has_field(c, name) and not parameters(type(c))[name].fixed:
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
    n_other: int = 2,
    positions: Any = None,
    positions_sigma: float | None = None,
    log: Callable[[str], None] | None = print,
    progress: bool = False,
    on_stage: Callable[[str, FitResult], None] | None = None,
    search_supersampling: int | None = None,
    second_source: bool = True,
    on_minima: Callable[[list[FitResult]], None] | None = None,
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
       steps, the best `n_refine` refined together with up to `n_other` more, each the
       best of another Einstein radius (candidates for stage 3's rival check); the best
       plausible minimum of the `n_refine` kept. The
       search's model images are evaluated at `search_supersampling` (default: 1, one
       point per pixel, when the PSF is given at the data's resolution; else the
       dataset's own): it only has to find the basin, and each of its steps costs
       `supersampling^2` times less (the demo's search 61 -> 16 s at 2x2);
    3. everything together, from that model, at the dataset's supersampling; its
       covariance is reported. The other refined starts that ended with another Einstein
       radius (by more than 1%) and an objective within a few units are fitted the same
       way (`with_rival_minima`): a rival that fits as well (within `RIVAL_TOLERANCE`)
       makes the status `RESULTS.ambiguous`, both radii in `notes`; one that fits better
       is chosen instead;
    4. when stage 3 leaves arcs in its residuals (`with_arc_check`) and its source is one
       `Sersic`, a second Sersic beside it and everything fitted again
       (`second_source=False`: never); kept by the Bayesian information criterion
       (`SECOND_SOURCE_PENALTY`), else stage 3 stands.

    Profiles are named as in `start_model` (`"sie+shear"`, `"mge"`, `"sersic"`, ...); every
    starting value comes from the data (`light_moments`); the amplitudes are solved
    linearly and constrained to be positive (`GaussianLikelihood(nonnegative=True)`);
    `lens_bounds` keeps the Einstein radius inside the data, the source compact, the
    mass centred within `MASS_CENTER_RANGE` of the stage-1 lens light's centre (where
    stages 2 and 3 start it; with `lens_light=None`, within `ARC_CENTER_RANGE` of the
    centre of the arcs' ring, `arc_center`, where they start it: without it the mass
    centre was free, and on a clumpy source the search's minima put it up to 2" off)
    and the shear within `SHEAR_BOUND`. A result at a bound or
    otherwise implausible has the status `RESULTS.implausible` with the reasons in
    `notes`. `positions` (an `(n, 2)` array of `x, y` in arcsec, n >= 2) are the observed
    positions of the multiple images of one source point: they add a `PositionsTerm`
    (source plane, 1-sigma `positions_sigma`, default a pixel) to every stage, so a mass
    model that does not map them to one source point is penalised in the search too.
    `on_stage(name, result)`, if given, is called with each stage's `FitResult` as it
    ends (`"lens light"`, `"search"`, `"all free"`, `"second source"` when stage 4 ran):
    what a caller keeps when the run is interrupted. `on_minima(results)`, if given, is
    called once with the search's refined minima of a finite objective (stage 2's ends,
    the lowest objective first; the chosen one among them): other macro models for a
    caller that ranks them by another measure, as the `equilens` command's pixelized
    chain does by its evidence (`rank_starts`: a parametric source too simple for a
    clumpy galaxy can prefer a wrong mass). Returns the last kept stage's `FitResult`
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
    # the mass centre's range: around the fitted light's centre, or without a lens light
    # around the arcs' ring's; the mass starts there
    center, center_range = mass_anchor(imaging, model, placement)
    if center is not None:
        model = _mass_at(model, center)
        if _light_center(model) is None:
            say(
                f"  no lens light: the mass centre within {center_range:g}\" of the arcs' "
                f"ring's centre ({center[0]:+.3f}, {center[1]:+.3f})\""
            )
    elif model.lens_light is None:
        say("  no lens light, and no ring in the arcs: the mass centre is free")
    bounds = lens_bounds(model, radius, center, center_range)
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
        n_other=n_other,
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
    n_found = int(np.size(found.refined.value))
    if on_minima is not None:
        values = np.asarray(found.refined.value, dtype=float).reshape(-1)
        order = [int(i) for i in np.argsort(values) if np.isfinite(values[i])]
        on_minima([pick(found.refined, i) for i in order])
    r = fit(
        objective,
        found.best.model,
        solver,
        bounds=bounds,
        max_steps=max_steps,
        throw=False,
        progress=progress,
    )
    others = [pick(found.refined, i) for i in range(n_found) if i != found.best_index]
    r, _ = with_rival_minima(
        objective,
        r,
        others,
        solver=solver,
        bounds=bounds,
        max_steps=max_steps,
        progress=progress,
        log=say,
        candidates_reference=float(found.best.value),
    )
    r, check = with_arc_check(imaging, r, say)
    say(
        f"  stage 3 (all free): reduced chi2 {float(r.reduced_chi2):.3f}, {r.message()} "
        f"({float(r.wall_time):.1f} s)"
    )
    last = "all free"
    if check.left and second_source and isinstance(r.model.source, Sersic):
        if on_stage is not None:
            on_stage(last, r)
        last = "second source"
        r = _with_second_source(
            imaging,
            objective,
            r,
            radius,
            solver=solver,
            max_steps=max_steps,
            progress=progress,
            say=say,
        )
    r = dataclasses.replace(r, wall_time=time.perf_counter() - t0)
    if on_stage is not None:
        on_stage(last, r)
    return r


#: `fit_lens`'s fourth stage keeps a second source component when it lowers chi2 by more
#: than this many times ln(pixels) per parameter it adds (the Bayesian information
#: criterion's penalty).
SECOND_SOURCE_PENALTY = 1.0


def _with_second_source(
    imaging: Imaging,
    objective: Objective,
    r: FitResult,
    radius: float,
    *,
    solver: SolverLike,
    max_steps: int,
    progress: bool,
    say: Callable[[str], None],
) -> FitResult:
    """`fit_lens`'s stage 4, run when stage 3 left arcs in its residuals: a source of one
    `Sersic` gets a second (n = 1, round), from two starts (three times wider at the
    first's centre: a disc or envelope beside a compact core; half as wide where the light
    stage 3 misses maps to, `residual_placement`: a clump), and everything is fitted again
    within `lens_bounds` (the mass centre's range around the lens light as stage 3 left
    it); the better of the two is judged. It is kept when it is
    plausible, not stopped by a failure, and lowers chi2 by more than the Bayesian
    information criterion's penalty for the parameters it adds
    (`SECOND_SOURCE_PENALTY` x ln(pixels) each); else `r` is returned unchanged. A real
    galaxy (a spiral, a clumpy irregular) is not one Sersic profile: at S/N 20-60 the
    profile the fit cannot match pulls the mass (the realistic suite's bright-arc lenses
    ended 2-3% off)."""
    first = r.model.source
    if not isinstance(first, Sersic):
        return r
    dtype = first.R_sersic.dtype

    def second(size: float, x: Any, y: Any) -> Sersic:
        return Sersic(
            amp=jnp.ones_like(first.amp),
            R_sersic=jnp.asarray(size, dtype),
            n_sersic=jnp.ones_like(first.n_sersic),
            e1=jnp.zeros_like(first.e1),
            e2=jnp.zeros_like(first.e2),
            center_x=jnp.asarray(x, dtype),
            center_y=jnp.asarray(y, dtype),
        )

    r_first = float(first.R_sersic)
    # a disc or envelope around the first (three times wider, at its centre), and a clump
    # where the light the fit misses maps to (half its size): the second's amplitude is
    # solved non-negative, so a start where it would take no light gets no gradient
    starts = [
        second(min(3.0 * r_first, 0.5 * SOURCE_SIZE_BOUND * radius), first.center_x, first.center_y)
    ]
    likelihood = objective.terms[0]
    assert isinstance(likelihood, GaussianLikelihood)
    completed = likelihood.complete(r.model)
    missed = residual_placement(imaging, imaging.data - _image(completed, imaging))
    if missed is not None:
        clump = second(0.5 * r_first, 0.0, 0.0)
        placed = missed(LensSystem(mass=r.model.mass, source=clump))
        starts.append(placed.source)  # pyright: ignore[reportArgumentType]
    trials = []
    for start in starts:
        model = eqx.tree_at(lambda s: s.source, r.model, first + start)
        trials.append(
            fit(
                objective,
                model,
                solver,
                bounds=lens_bounds(model, radius, *mass_anchor(imaging, model)),
                max_steps=max_steps,
                throw=False,
                progress=progress,
            )
        )
    late = _code(RESULTS.nonlinear_max_steps_reached)

    def usable(t: FitResult) -> bool:
        stopped = bool(_code(t.result) == late)
        return (t.success or stopped) and not t.notes and bool(np.isfinite(float(t.chi2)))

    ranked = sorted(trials, key=lambda t: (not usable(t), float(np.nan_to_num(t.chi2, nan=np.inf))))
    trial = ranked[0]
    added = 7  # the second Sersic's six shape parameters and its amplitude
    penalty = SECOND_SOURCE_PENALTY * added * float(np.log(trial.n_data))
    gain = float(r.chi2) - float(trial.chi2)
    kept = usable(trial) and gain > penalty
    trial, _ = with_arc_check(imaging, trial, say)
    say(
        f"  stage 4 (a second source component): chi2 {-gain:+.1f} (kept below "
        f"{-penalty:.1f}), reduced chi2 {float(trial.reduced_chi2):.3f}, {trial.message()}: "
        + ("kept" if kept else "not kept, stage 3 stands")
        + f" ({float(trial.wall_time):.1f} s)"
    )
    return trial if kept else r


@eqx.filter_jit
def _image(model: LensSystem, imaging: Imaging) -> Any:
    """`model`'s image of `imaging` (one compiled program)."""
    return model.image(imaging.grid, imaging.psf)


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
    second_source: bool = True,
) -> FitResult:
    """Fits one lens model to every band of `data` jointly, from a generic start:

    1. `fit_lens` on the first band (the reference: give the sharpest or deepest band
       first), with its global search;
    2. that model as a `MultiBandLensSystem` with the lens light and the source shared in
       shape by all bands and per-band amplitudes (solved linearly, positive, in every
       band), fitted to all bands together (`MultiBandTerm` of `GaussianLikelihood`s, plus
       a `PositionsTerm` when `positions` are given), everything free, within the
       reference band's `lens_bounds` (the reference band's source: one Sersic, or two
       when `fit_lens`'s stage 4 kept a second; `second_source=False`: never).

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
        second_source=second_source,
    )
    m = single.model
    start = MultiBandLensSystem(m.mass, m.source, m.lens_light, bands=len(data))
    terms: list[Any] = [MultiBandTerm.build(data, GaussianLikelihood, nonnegative=True)]
    if positions is not None:
        terms.append(_positions_term(positions, positions_sigma, ref.pixel_scale))
    radius = light_moments(ref).mask_radius
    ref_bounds = lens_bounds(m, radius, *mass_anchor(ref, m))
    bounds = {(lambda s, w=where: w(s.band(0))): b for where, b in ref_bounds.items()}
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


def _mass_at(model: LensSystem, center: tuple[float, float]) -> LensSystem:
    """`model` with every mass centre (every mass component with one but an external
    shear's) moved to `center` (x, y in arcsec): where `lens_bounds` centres the mass
    centre's range (`mass_anchor`)."""
    masses = model.mass.components if isinstance(model.mass, MassSum) else (model.mass,)
    for i, c in enumerate(masses):
        if isinstance(c, ExternalShear) or not (
            has_field(c, "center_x") and has_field(c, "center_y")
        ):
            continue
        at = (lambda s: s.mass) if len(masses) == 1 else (lambda s, i=i: s.mass.components[i])
        model = eqx.tree_at(
            lambda s, at=at: (at(s).center_x, at(s).center_y),
            model,
            tuple(jnp.asarray(v, dtype=jnp.asarray(c.center_x).dtype) for v in center),  # pyright: ignore[reportAttributeAccessIssue]
        )
    return model


def arc_center(placement: ArcPlacement, mask_radius: float) -> tuple[float, float] | None:
    """The centre (x, y in arcsec) of the circle fitted to the arc pixels of `placement`
    (weighted least squares of `x^2 + y^2 = 2 a x + 2 b y + c` over the pixels, each by its
    signal-to-noise weight: Kasa's fit): the lensed light of a source lies around the
    Einstein ring, so the ring's centre places a lens whose own light is absent (a
    lens-light-subtracted image) or too faint to fit. On the subhalo suite's simulated
    lenses it lies 0.02-0.23" from the lens centre, where the data's light centroid
    (`light_moments`) lies up to 1.3" off (arcs brighter on one side pull it). None when
    the circle is not defined: fewer than three pixels, a singular fit, or a radius beyond
    `mask_radius` (arcs too short or straight to show a ring)."""
    x, y, w = (np.asarray(a, np.float64) for a in (placement.x, placement.y, placement.weight))
    if x.size < 3 or not np.all(np.isfinite(w)) or not w.sum() > 0:
        return None
    sw = np.sqrt(w)
    design = np.stack([x, y, np.ones_like(x)], axis=1) * sw[:, None]
    solution, _, rank, _ = np.linalg.lstsq(design, (x * x + y * y) * sw, rcond=None)
    if rank < 3 or not np.all(np.isfinite(solution)):
        return None
    cx, cy = 0.5 * float(solution[0]), 0.5 * float(solution[1])
    r2 = float(solution[2]) + cx * cx + cy * cy
    if not 0 < r2 <= float(mask_radius) ** 2:
        return None
    return cx, cy


def mass_anchor(
    imaging: Imaging, model: LensSystem, placement: ArcPlacement | None = None
) -> tuple[tuple[float, float] | None, float]:
    """Where `lens_bounds` centres the mass centre's range, and that range (arcsec): the
    lens light's centre and `MASS_CENTER_RANGE` when `model` has a lens light with a
    centre; else the centre of the arcs' ring (`arc_center` of `placement`, default
    `arc_placement(imaging, model)`) and `ARC_CENTER_RANGE`; else None (the mass centre
    free: no ring to place it)."""
    light = _light_center(model)
    if light is not None:
        return light, MASS_CENTER_RANGE
    if placement is None and _source_at(model) is not None:
        placement = arc_placement(imaging, model)
    if placement is None:
        return None, ARC_CENTER_RANGE
    return arc_center(placement, light_moments(imaging).mask_radius), ARC_CENTER_RANGE


def _light_center(model: LensSystem) -> tuple[float, float] | None:
    """The centre (arcsec) of the first component of `model`'s lens light that has one,
    or None (no lens light, or none with a centre)."""
    if model.lens_light is None:
        return None
    light = model.lens_light
    for c in light.components if isinstance(light, LightSum) else (light,):
        if has_field(c, "center_x") and has_field(c, "center_y"):
            return float(c.center_x), float(c.center_y)  # pyright: ignore[reportAttributeAccessIssue]
    return None


def _einstein_radius_where(model: LensSystem) -> Callable[[LensSystem], Any]:
    """`where` picking the Einstein radius (`theta_E`) of the first mass component."""
    at, _ = first_mass(model)
    return lambda s: at(s).theta_E


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
