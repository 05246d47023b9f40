"""`fit_pixelized` and `fit_multiband_pixelized`: the pixelized-source stages of the
`equilens` command's pipeline, by the Bayesian evidence (`LogEvidence`)."""

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
from ..light import FixedLight, Gaussian
from ..mass import EPL, SIE
from ..objective import Objective, select
from ..source import (
    AbstractMesh,
    AbstractRegularization,
    DelaunayMesh,
    Inversion,
    PixelizedSource,
)
from ..terms import GaussianLikelihood, LogEvidence, MultiBandTerm, PositionsThreshold
from ._chain_start import (
    COEFFICIENT_GRID,
    _held_light,
    _strength_start,
    _strength_where,
    _value,
)
from ._covariance import with_conditional_covariance, with_smoothed_covariance
from ._fit import fit
from ._parametrise import parametrisation
from ._pipeline import _checked_positions
from ._residuals import with_arc_check, with_band_arc_checks
from ._resolution import finer_mesh_rounds
from ._result import FitResult
from ._search import first_mass
from ._solvers import SolverLike

#: `fit_pixelized`'s positions threshold (arcsec, source plane): `POSITIONS_FACTOR` times
#: the traced spread of the positions under the starting model, and at least
#: `POSITIONS_MIN_THRESHOLD` (PyAutoLens's SLaM pipelines use the same two numbers).
POSITIONS_FACTOR = 3.0
POSITIONS_MIN_THRESHOLD = 0.2


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


#: The log-evidence a power-law mass must gain over the SIE it starts from to be kept
#: (`fit_pixelized(power_law=True)`): decisive odds (e^5, about 150 to 1, on Jeffreys'
#: scale), which also pay the slope's Occam factor (ln of its prior width over its
#: posterior width: about 3 for a slope known to +-0.03 within a prior of width 1), since
#: the evidence marginalises the source, not the mass.
POWER_LAW_GAIN = 5.0


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
    mass = jax.tree.map(operator.and_, free, select(r.model, lambda s: s.mass))
    r = with_smoothed_covariance(r, objective, mass)
    return with_conditional_covariance(r, objective, mass)


def refit_lens_light(
    imaging: Imaging,
    system: LensSystem,
    term: LogEvidence,
    *,
    solver: SolverLike = "lm",
    max_steps: int = 300,
    progress: bool = False,
) -> LensSystem:
    """`system` (a pixelized source, its lens light held: `FixedLight`) with the lens light
    refitted beside its source: the source that `term` solves for `system` is lensed and
    subtracted from the data, and the light profile's parameters (its linear amplitudes
    solved, non-negative: `GaussianLikelihood(nonnegative=True)`) are fitted by least
    squares to what is left, by `solver` in at most `max_steps` steps; the mass is held.
    Returns `system` with the new light, held again (`FixedLight`).

    A lens light fitted with the source present cannot take the arcs' light: the arcs are
    in the subtracted model. `fit_pixelized` runs this between its mass stages and keeps
    a round only when the evidence rises."""
    if not isinstance(system.lens_light, FixedLight):
        raise TypeError(
            "refit_lens_light needs a lens light held as FixedLight, got "
            f"{type(system.lens_light).__name__}"
        )
    completed = term.complete(system)
    lensed = dataclasses.replace(completed, lens_light=None)
    arcs = lensed.image(imaging.grid, imaging.convolution)
    rest = eqx.tree_at(lambda im: im.data, imaging, imaging.data - arcs)
    # the source is in the subtracted data: a source of zero light stands in for it
    # (`LensSystem.source` cannot be None)
    dark = FixedLight(Gaussian(amp=0.0, sigma=imaging.pixel_scale))
    start = LensSystem(system.mass, dark, system.lens_light.profile)
    r = fit(
        Objective([GaussianLikelihood(rest, nonnegative=True)]),
        start,
        solver,
        free=select(start, lambda s: s.lens_light),
        max_steps=max_steps,
        throw=False,
        progress=progress,
        covariance=False,
    )
    return eqx.tree_at(lambda s: s.lens_light, system, FixedLight(r.model.lens_light))


def fit_pixelized(
    imaging: Imaging,
    model: LensSystem,
    *,
    solver: SolverLike | None = None,
    fit_strength: bool = True,
    lens_light: str = "solved",
    rounds: int = 3,
    light_rounds: int = 2,
    power_law: bool = False,
    finer_meshes: int = 0,
    max_steps: int = 1000,
    positions: Any = None,
    positions_threshold: float | None = None,
    log: Callable[[str], None] | None = print,
    progress: bool = False,
    covariance: bool = True,
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
    3. with a held lens light (`lens_light="fixed"`), up to `light_rounds` rounds of the
       lens light refitted beside the pixelized source (`refit_lens_light`: its
       parameters and non-negative amplitudes by least squares on the data minus the
       lensed source of the last stage, mass and source held), each followed by stage 2
       again; a round is kept when it raises the log-evidence, and the rounds stop when
       one gains less than 1 (the lens light of a parametric fit was fitted beside a
       parametric source, which cannot describe an irregular galaxy: the light the
       source missed is left in it, and only the source's reconstruction shows it:
       PyAutoLens's source -> light -> mass chain);
    4. for a regularization or a mesh that adapts to the source's brightness
       (`AdaptiveBrightness`, `AdaptiveRectangularMesh(weight_floor=...)`), up to
       `rounds - 1` more rounds: the adapt image becomes the
       lensed source of the last reconstruction (instead of the data, which holds the lens
       light too), and stage 2 is repeated; the chain stops when the log-evidence gains
       less than 1 (or drops: the previous round is kept);
    5. with `finer_meshes > 0` and a rectangular mesh (`RectangularMesh`,
       `AdaptiveRectangularMesh`): up to `finer_meshes` finer meshes, each with
       `MESH_STEP` (1.25) times the nodes along each side of the last kept one (at most
       `MAX_FILL` source pixels per masked pixel), the mass and regularization refitted on
       it (stage 2); a finer mesh is kept when it raises the log-evidence by more than
       `MESH_GAIN` (10), and the rounds stop at the first that does not
       (`finer_mesh_rounds`): the source's resolution chosen by the evidence. A mesh too
       coarse for a real galaxy's clumps leaves a misfit that a mass model bends to (a
       subhalo scan's false detections: docs/subhalo.md);
    6. with `power_law` and a first mass component that is an `SIE`: the mass as an `EPL`
       (`as_power_law`: the slope freed from 2, where the two profiles are the same) is
       fitted by the evidence with everything else as the last kept stage left it, and
       kept when it succeeds and raises the log-evidence by more than `POWER_LAW_GAIN`
       (the model comparison of the SIE against the power law, by the evidence; the stage
       record is written either way, so the power law's Einstein radius is seen beside the
       SIE's). Real lenses' slopes scatter around 2 by about 0.1-0.2, which an SIE turns
       into a bias of its Einstein radius wherever the arcs do not sit on it.

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

    The stages are fitted without their covariance and kept for their evidence (a round
    that converged and raised it); the errors are computed once, for the stage that is
    kept (fitted once more from its minimum, a few steps), so a round is not dropped
    because its errors could not be computed: the result is then that round's model with
    the status `RESULTS.covariance_failed`. The errors are those of the Laplace
    approximation over every fitted parameter. The evidence is smooth only piecewise in
    the mass (traced pixels cross the mesh's cells), so when its autodiff Hessian is not
    positive definite, the curvature comes from its values over 1-sigma steps
    (`with_smoothed_covariance`); when that is singular too (a hyperparameter the
    evidence leaves unconstrained), the mass errors with the hyperparameters held
    (`with_smoothed_covariance`, then `with_conditional_covariance`, over the mass
    alone). The result's `notes` say which. With `covariance=False` the kept stage is
    fitted once more from its minimum all the same (the same model), but no errors are
    computed (`errors` NaN): for a caller that computes its own, as `equilens subhalo`
    does (the scan's Laplace evidence of the smooth model; on the Jackpot this saves
    about a minute and a half: the autodiff Hessian's compilation and evaluation, then
    the smoothed curvature).

    Returns the `FitResult` of the last kept stage (solved source and amplitudes filled
    in), its `Inversion` (the source's 1-sigma errors included; its `adapt_image` the
    brightness estimate of that stage's `LogEvidence`: build the same term from it to
    evaluate or refit this model's evidence), and one record per stage
    (`{"stage": name, "log_evidence": value, "status": words, "num_steps": n, "seconds":
    wall time since the previous record, "theta_E": arcsec, "gamma": slope}`, the last
    two the first mass component's Einstein radius and slope where it has them)."""
    t0 = time.perf_counter()
    say = log or (lambda _: None)
    if not isinstance(model.source, PixelizedSource):
        raise TypeError("fit_pixelized needs a model whose source is a PixelizedSource")
    if lens_light not in ("solved", "fixed"):
        raise ValueError(f'lens_light must be "solved" or "fixed", got {lens_light!r}')
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if light_rounds < 0:
        raise ValueError(f"light_rounds must be >= 0, got {light_rounds}")
    if finer_meshes < 0:
        raise ValueError(f"finer_meshes must be >= 0, got {finer_meshes}")
    if lens_light == "fixed":
        model = _held_light(model)
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

    last = [t0]  # when the previous record was written

    def record(name: str, r: FitResult) -> None:
        # the evidence term comes first; a positions guard adds nothing inside its threshold
        log_ev = -float(r.term_values[0])
        now = time.perf_counter()
        stages.append(
            {
                "stage": name,
                "log_evidence": log_ev,
                "status": r.message(),
                "num_steps": int(r.num_steps),
                "seconds": now - last[0],
            }
        )
        last[0] = now
        theta_e = _theta_e(r.model)
        if theta_e is not None:
            stages[-1]["theta_E"] = theta_e
        slope = _slope(r.model)
        if slope is not None:
            stages[-1]["gamma"] = slope
        if guard:
            stages[-1]["positions_penalty"] = float(r.term_values[1])
        radius = "" if theta_e is None else f', theta_E {theta_e:.4f}"'
        say(f"  {name}: log evidence {log_ev:.1f}{radius}, {int(r.num_steps)} steps, {r.message()}")

    def run(objective: Objective, start: LensSystem, free: Any, covariance=False) -> FitResult:
        return _evidence_fit(objective, start, free, solver, max_steps, progress, covariance)

    objective = Objective([term, *guard])
    if fit_strength:
        model, best, log_ev = _strength_start(term, model, dtype)
        say(f"  regularization start {best:g} (log evidence {log_ev:.1f})")
        regularization = select(model, lambda s: s.source.regularization)  # pyright: ignore[reportAttributeAccessIssue]
        r = run(objective, model, regularization)
        record("stage 1 (regularization)", r)
        model = r.model

    def fitted(m: LensSystem) -> Any:
        """The parameters stage 2 fits: the mass (and the regularization's)."""
        return select(m, lambda s: (s.mass, s.source.regularization) if fit_strength else s.mass)  # pyright: ignore[reportAttributeAccessIssue]

    free = fitted(model)
    # every stage is fitted without its covariance: a stage is kept for its evidence, and
    # the covariance is computed once, for the stage that is kept (at the end)
    light_stages = light_rounds > 0 and isinstance(model.lens_light, FixedLight)
    r = run(objective, model, free)
    record("stage 2 (mass)", r)
    stage = 3

    def light_round(k: int, last: FitResult, _: None) -> tuple[FitResult, None]:
        nonlocal stage
        light = refit_lens_light(imaging, last.model, term, max_steps=300, progress=progress)
        trial = run(objective, light, free)
        record(f"stage {stage} (lens light beside the source, round {k}; then the mass)", trial)
        stage += 1
        return trial, None

    if light_stages:
        r, _ = _kept_rounds(r, light_rounds, light_round, say)

    def adapt_round(k: int, last: FitResult, made: Any) -> tuple[FitResult, LogEvidence]:
        nonlocal stage
        # the term (its adapt image) of the last kept round
        source_of = term if made is None else made
        lensed = dataclasses.replace(source_of.complete(last.model), lens_light=None)
        adapt = np.asarray(lensed.image(imaging.grid, imaging.convolution))
        new_term = LogEvidence(imaging, adapt_image=adapt)
        trial = run(Objective([new_term, *guard]), last.model, free)
        record(f"stage {stage} (adapted to the source, round {k})", trial)
        stage += 1
        return trial, new_term

    src = model.source
    if src.regularization.uses_signal or src.mesh.uses_signal:  # pyright: ignore[reportAttributeAccessIssue]
        r, adapted = _kept_rounds(r, rounds - 1, adapt_round, say)
        term = term if adapted is None else adapted
    objective = Objective([term, *guard])
    if finer_meshes > 0:

        def mesh_record(name: str, trial: FitResult) -> None:
            nonlocal stage
            record(f"stage {stage} ({name})", trial)
            stage += 1

        def refit(m: LensSystem) -> FitResult:
            return run(objective, m, fitted(m))

        n_data = int(np.asarray(imaging.mask).sum())
        r = finer_mesh_rounds(r, finer_meshes, n_data, refit, mesh_record, say)
        free = fitted(r.model)
    epl = as_power_law(r.model) if power_law else None
    if epl is not None:
        epl_free = fitted(epl)
        # the slope trades against the ellipticity, shear and Einstein radius along a
        # narrow valley that a quasi-Newton solver started with an identity Hessian does
        # not enter from the SIE's minimum (its line search finds no decrease): a Newton
        # step over the mass first, then the solver
        epl, drop = newton_start(objective, epl, select(epl, lambda s: s.mass))
        say(
            f"    (a Newton step over the mass: log evidence {drop:+.1f})"
            if drop > 0
            else "    (no Newton step over the mass raised the log evidence)"
        )
        trial = run(objective, epl, epl_free)
        record(f"stage {stage} (power-law mass)", trial)
        gain = float(r.value) - float(trial.value)
        if trial.success and gain > POWER_LAW_GAIN:
            say(f"    (kept: log evidence {gain:+.1f} over the SIE)")
            r, free = trial, epl_free
        else:
            why = trial.message() if not trial.success else f"log evidence {gain:+.1f}"
            say(f"    (not kept: {why}; the SIE needs a gain over {POWER_LAW_GAIN:g})")
    # the kept stage once more from its minimum (a few steps), with its covariance: a stage
    # whose errors cannot be computed is still the model of the highest evidence (its
    # status then says so, `RESULTS.covariance_failed`)
    r = run(objective, r.model, free, covariance=covariance)
    if not covariance:
        r = dataclasses.replace(r, notes=(*r.notes, "no errors computed (covariance=False)"))
    inversion = dataclasses.replace(
        _invert_with_errors(term, r.model), adapt_image=term.adapt_image
    )
    r, _ = with_arc_check(imaging, r, say, term.complete(r.model))
    return dataclasses.replace(r, wall_time=time.perf_counter() - t0), inversion, stages


#: The multiples of the Newton step `newton_start` tries.
NEWTON_MULTIPLES = (0.125, 0.25, 0.5, 1.0, 1.5, 2.0)


def newton_start(objective: Objective, model: Any, free: Any) -> tuple[Any, float]:
    """`model` moved by a Newton step of `objective` over the `free` parameters (a
    `select` mask; every one a scalar): the step `-H^-1 g` from the autodiff gradient `g`
    and Hessian `H` at `model`, over `H`'s positive eigen-directions only (the evidence is
    rough at small scales, so its Hessian can have a few non-positive ones), the best of
    `NEWTON_MULTIPLES` of it that stays within the parameters' bounds and lowers the
    objective; `model` itself when none does. Returns the model and how much the
    objective fell (0 when it did not move).

    A quasi-Newton solver (BFGS) started at a minimum of a narrower model with a new
    parameter freed takes its first steps along the gradient (an identity Hessian), which
    on a narrow, curved valley (a power law's slope against its ellipticity, the shear
    and the Einstein radius) finds no decrease and stops: the Newton step enters the
    valley, and the solver goes on from there."""
    param = parametrisation(objective, model, free, None, check=False)
    if not all(np.ndim(v) == 0 for v in param.values(model)):
        raise ValueError("newton_start steps scalar parameters only")
    grad, hess = (np.asarray(a) for a in _grad_hess(objective, param, model))
    if not (np.all(np.isfinite(grad)) and np.all(np.isfinite(hess))):
        return model, 0.0
    x0 = np.array([float(v) for v in param.values(model)])
    bounds = [b for f, b in zip(param.free, param.bounds, strict=True) if f]
    lo = np.array([-np.inf if b is None else b[0] for b in bounds])
    hi = np.array([np.inf if b is None else b[1] for b in bounds])
    w, v = np.linalg.eigh(0.5 * (hess + hess.T))
    keep = w > 1e-12 * max(float(np.max(np.abs(w))), 1e-300)
    step = -(v[:, keep] @ ((v[:, keep].T @ grad) / w[keep]))
    dtype = np.asarray(param.values(model)[0]).dtype

    def at(x: np.ndarray) -> Any:
        return param.with_values(tuple(jnp.asarray(xi, dtype) for xi in x), model)

    start_value = float(_value(objective, model))
    best, best_value = model, start_value
    for k in NEWTON_MULTIPLES:
        x = x0 + k * step
        if not np.all((x > lo) & (x < hi)):
            continue
        trial = at(x)
        v_k = float(_value(objective, trial))
        if np.isfinite(v_k) and v_k < best_value:
            best, best_value = trial, v_k
    return best, start_value - best_value


@eqx.filter_jit
def _invert_with_errors(term: Any, model: Any) -> Any:
    """`term.invert(model, errors=True)`, compiled once per structure."""
    return term.invert(model, errors=True)


@eqx.filter_jit
def _band_values(term: Any, model: Any) -> Any:
    """Each band's value of a `MultiBandTerm`, compiled once per structure."""
    return term.values(model)


@eqx.filter_jit
def _grad_hess(objective: Objective, param: Any, model: Any) -> tuple[Any, Any]:
    """The gradient and Hessian of `objective` over `param`'s free scalars at `model`."""
    x0 = jnp.stack(param.values(model))

    def f(x):
        return objective(param.with_values(tuple(x[i] for i in range(x.shape[0])), model))

    return jax.grad(f)(x0), jax.hessian(f)(x0)


def as_power_law(model: LensSystem) -> LensSystem | None:
    """`model` with its first mass component, an `SIE`, replaced by the `EPL` of slope
    `gamma = 2` with the same Einstein radius, ellipticity and centre (the same deflection
    field: lenstronomy's conventions, which both follow), so that a fit can free the slope
    from where the SIE ended; `None` when the first mass component is not an `SIE`."""
    found = _first_mass(model)
    if found is None or not isinstance(found[1], SIE):
        return None
    at, first = found
    epl = EPL(
        theta_E=first.theta_E,
        gamma=jnp.asarray(2.0, dtype=jnp.asarray(first.theta_E).dtype),
        e1=first.e1,
        e2=first.e2,
        center_x=first.center_x,
        center_y=first.center_y,
    )
    return eqx.tree_at(at, model, epl)


def _kept_rounds(
    r: FitResult,
    n: int,
    attempt: Callable[[int, FitResult, Any], tuple[FitResult, Any]],
    say: Callable[[str], None],
) -> tuple[FitResult, Any]:
    """Up to `n` rounds of `attempt(k, last kept result, what it was made with) -> (trial,
    what the trial was made with)`, k = 1, 2, ... (`None` before a round is kept): a round
    is kept when it succeeds and lowers the objective (raises the log-evidence); the rounds
    stop at the first one that does not, or that gains less than 1. Returns the last kept
    result and what the last kept round was made with (`None` when none was kept)."""
    made = None
    for k in range(1, n + 1):
        trial, with_ = attempt(k, r, made)
        gain = float(r.value) - float(trial.value)
        if not trial.success or not gain > 0:
            say("    (no gain: the previous stage is kept)")
            break
        r, made = trial, with_
        if gain < 1.0:
            break
    return r, made


def _first_mass(model: LensSystem) -> tuple[Callable[[Any], Any], Any] | None:
    """`first_mass(model)` (where the first mass component is, and that component), or
    `None` for a first component without an Einstein radius."""
    try:
        return first_mass(model)
    except ValueError:
        return None


def _theta_e(model: LensSystem) -> float | None:
    """The first mass component's Einstein radius (arcsec), for a stage's record; `None`
    for a first component without one."""
    found = _first_mass(model)
    return None if found is None else float(found[1].theta_E)


def _slope(model: LensSystem) -> float | None:
    """The first mass component's slope `gamma` where it has one (an `EPL`), else `None`."""
    found = _first_mass(model)
    return float(found[1].gamma) if found is not None and isinstance(found[1], EPL) else None


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
    (the sum over bands), "band_log_evidence", "status", "theta_E"}`, the last the first mass
    component's Einstein radius where it has one)."""
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
        for i, (t, band) in enumerate(zip(terms, bands, strict=True)):
            trial_system = LensSystem(band.mass, sources[i], None if lens is None else lens[i])
            where = _strength_where(trial_system)
            scores = []
            for c in COEFFICIENT_GRID:
                trial = eqx.tree_at(
                    where, trial_system, replace_fn=lambda _, c=c: jnp.asarray(c, dtype)
                )
                scores.append(float(_value(t, trial)))
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

    def record(name: str, r: FitResult) -> None:
        per_band = [-float(v) for v in _band_values(term, r.model)]
        stages.append(
            {
                "stage": name,
                "log_evidence": -float(r.term_values[0]),
                "band_log_evidence": dict(zip(data.names, per_band, strict=True)),
                "status": r.message(),
            }
        )
        theta_e = _theta_e(r.model.band(0))
        if theta_e is not None:
            stages[-1]["theta_E"] = theta_e
        if guard:
            stages[-1]["positions_penalty"] = float(r.term_values[1])
        radius = "" if theta_e is None else f', theta_E {theta_e:.4f}"'
        say(f"  {name}: log evidence {-float(r.term_values[0]):.1f}{radius}, {r.message()}")

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
    inversions = _invert_with_errors(term, r.model)
    r = with_band_arc_checks(data, r, term.complete(r.model).bands(), say)
    return dataclasses.replace(r, wall_time=time.perf_counter() - t0), inversions, stages
