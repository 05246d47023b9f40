"""`search`: a global first stage. Many starts screened in one compiled, vmapped batch, the
best few refined together by gradient steps, the best plausible minimum kept."""

import dataclasses
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, Float, PyTree

from .._lens_system import LensSystem
from ..data import Imaging
from ..light import LightSum
from ..mass import ExternalShear, MassSum
from ..objective import Objective
from ..objective._params import Bounds, Where
from ._batch import BatchRoute, fit_batch, pick
from ._fit import fit
from ._plausible import has_field, implausible_notes, with_plausibility
from ._result import RESULTS, FitResult
from ._solvers import SolverLike

#: Default half-widths of `lens_search_space`: mass ellipticity components, shear
#: components, and the source position as a fraction of the largest Einstein radius.
ELLIPTICITY_RANGE = 0.3
SHEAR_RANGE = 0.1
SOURCE_OFFSET = 0.25


def _source_at(model: LensSystem) -> Callable[[Any], Any] | None:
    """`where` picking the first source component, if it has a centre."""
    src = model.source
    if isinstance(src, LightSum):
        if has_field(src.components[0], "center_x"):
            return lambda s: s.source.components[0]
    elif has_field(src, "center_x"):
        return lambda s: s.source
    return None


def first_mass(model: LensSystem) -> tuple[Callable[[Any], Any], Any]:
    """`where` picking the first mass component of `model` (the main deflector), and that
    component. Raises `ValueError` when it has no Einstein radius `theta_E`."""
    if isinstance(model.mass, MassSum):
        first, at = model.mass.components[0], lambda s: s.mass.components[0]
    else:
        first, at = model.mass, lambda s: s.mass
    if not has_field(first, "theta_E"):
        raise ValueError(
            f"the first mass component must have an Einstein radius theta_E, got "
            f"{type(first).__name__}"
        )
    return at, first


def lens_search_space(
    model: LensSystem,
    theta_E: tuple[float, float] | None = None,
    *,
    source_position: bool = True,
) -> dict[Where, Bounds]:
    """The default `search` space of a `LensSystem`: the Einstein radius of the first mass
    component over `theta_E` (arcsec; default 0.5 to 2 times its starting value), its
    `e1`, `e2` within +-`ELLIPTICITY_RANGE`, every `ExternalShear`'s `gamma1`, `gamma2`
    within +-`SHEAR_RANGE`, and the first source component's centre within
    +-`SOURCE_OFFSET` x the largest Einstein radius of its start (a source lies close to
    the caustics, near the lens centre; left out with `source_position=False`, for a
    search that places the source itself, `ArcPlacement`). Parameters the model lacks
    are left out.

    Raises `ValueError` when the first mass component has no `theta_E`, or for an empty
    or reversed `theta_E` range."""
    comps = model.mass.components if isinstance(model.mass, MassSum) else (model.mass,)
    mass_at, first = first_mass(model)
    names = {f.name for f in dataclasses.fields(first)}
    if theta_E is None:
        te = float(first.theta_E)  # pyright: ignore[reportAttributeAccessIssue]
        theta_E = (0.5 * te, 2.0 * te)
    lo, hi = float(theta_E[0]), float(theta_E[1])
    if not 0 < lo < hi:
        raise ValueError(f"theta_E range must satisfy 0 < lower < upper, got {theta_E}")
    space: dict[Where, Bounds] = {lambda s: mass_at(s).theta_E: (lo, hi)}
    if {"e1", "e2"} <= names:
        r = ELLIPTICITY_RANGE
        space[lambda s: mass_at(s).e1] = (-r, r)
        space[lambda s: mass_at(s).e2] = (-r, r)
    for i, c in enumerate(comps):
        if isinstance(c, ExternalShear) and isinstance(model.mass, MassSum):
            space[lambda s, i=i: s.mass.components[i].gamma1] = (-SHEAR_RANGE, SHEAR_RANGE)
            space[lambda s, i=i: s.mass.components[i].gamma2] = (-SHEAR_RANGE, SHEAR_RANGE)
    src_at = _source_at(model) if source_position else None
    if src_at is not None:
        cx = float(first.center_x) if has_field(first, "center_x") else 0.0  # pyright: ignore
        cy = float(first.center_y) if has_field(first, "center_y") else 0.0  # pyright: ignore
        d = SOURCE_OFFSET * hi
        at = src_at
        space[lambda s: at(s).center_x] = (cx - d, cx + d)
        space[lambda s: at(s).center_y] = (cy - d, cy + d)
    return space


class ArcPlacement(eqx.Module):
    """Puts a lens model's source where its mass maps the lensed light: the bright pixels
    of the lens-light-subtracted data (`arc_placement`) are ray-shot through the model's
    mass, and the first source component's centre is set to their geometric median,
    each pixel weighted by its signal-to-noise over its magnification (the source-plane
    area it stands for); pixels demagnified more than twofold (the inner half of an
    isothermal Einstein radius, where the lens light's residuals are) are left out.
    Weiszfeld's iteration from the weighted mean; the median is robust to the pixels that
    are lens-light residuals rather than arcs, which map far from the source.

    A search over the mass then needs no source position: each screened mass is judged
    with the source where that mass puts it (`lens_search_space(...,
    source_position=False)`). Call it on a `LensSystem`; it is a pytree, so `jit` and
    `vmap` trace it.

    **Fields:** `x`, `y` (arcsec), `weight` (positive) of the arc pixels; `iterations`.
    """

    x: Float[Array, " n"]
    y: Float[Array, " n"]
    weight: Float[Array, " n"]
    iterations: int = eqx.field(static=True, default=20)

    def __call__(self, system: LensSystem) -> LensSystem:
        at = _source_at(system)
        if at is None:
            raise ValueError("ArcPlacement needs a source whose first component has a centre")
        bx, by = system.mass.ray_shoot(self.x, self.y)
        # each pixel stands for a source-plane area of its own divided by its
        # magnification: weighting by 1 / |magnification| keeps the strongly magnified
        # pixels near the critical curve from pulling the estimate towards the caustics.
        # Pixels demagnified more than twofold (det A < -1: for an isothermal lens,
        # within half the Einstein radius) hold the lens light's residuals, not images:
        # left out, unless nothing else is left
        fxx, fxy, fyx, fyy = system.mass.hessian(self.x, self.y)
        det = (1 - fxx) * (1 - fyy) - fxy * fyx
        w = self.weight * jnp.where(det < -1, 0.0, jnp.abs(det))
        w = jnp.where(jnp.sum(w) > 0, w, self.weight)
        c0 = (jnp.sum(w * bx) / jnp.sum(w), jnp.sum(w * by) / jnp.sum(w))
        # an arcsec / 1000 floor keeps a pixel that maps onto the estimate finite
        eps = 1e-3

        def step(c, _):
            u = w / (jnp.hypot(bx - c[0], by - c[1]) + eps)
            return (jnp.sum(u * bx) / jnp.sum(u), jnp.sum(u * by) / jnp.sum(u)), None

        (cx, cy), _ = jax.lax.scan(step, c0, None, length=self.iterations)
        src = at(system)
        return eqx.tree_at(
            lambda s: (at(s).center_x, at(s).center_y),
            system,
            (cx.astype(jnp.result_type(src.center_x)), cy.astype(jnp.result_type(src.center_y))),
        )


def arc_placement(
    imaging: Imaging,
    model: LensSystem,
    threshold: float = 3.0,
    min_pixels: int = 5,
    smooth: bool = True,
) -> ArcPlacement | None:
    """The `ArcPlacement` of `imaging`'s arcs: the used pixels where the data minus the
    lens light of `model` (its amplitudes filled in, as a fit returns them; e.g. after a
    lens-light-only stage) exceed `threshold` times the noise, weighted by that
    signal-to-noise. With `smooth` (and a PSF at the data's resolution) the
    signal-to-noise is that of the PSF-matched filter (the residual convolved with the PSF,
    over its noise), which finds faint arcs that no single pixel shows. None when fewer
    than `min_pixels` pixels pass, or fewer than five times as many as noise alone would
    pass (no arcs detected)."""
    lens = jnp.zeros_like(imaging.data) if model.lens_light is None else _lens_image(model, imaging)
    return residual_placement(imaging, imaging.data - lens, threshold, min_pixels, smooth)


def residual_placement(
    imaging: Imaging,
    residual: Float[Array, "ny nx"] | Float[np.ndarray, "ny nx"],
    threshold: float = 3.0,
    min_pixels: int = 5,
    smooth: bool = True,
) -> ArcPlacement | None:
    """`arc_placement`'s `ArcPlacement` of a given `residual` image (flux per pixel, on
    `imaging`'s grid): of the data minus a lens light, or minus a whole model, to place a
    further source component where the light a model misses maps to."""
    if not threshold > 0:
        raise ValueError(f"threshold must be > 0 (in noise sigmas), got {threshold}")
    r = np.asarray(residual, dtype=float)
    inv_var = np.where(np.asarray(imaging.mask), np.asarray(imaging.noise_map, float) ** -2, 0.0)
    if smooth and imaging.psf.supersampling == 1:
        # matched filter: the signal-to-noise of a PSF-shaped source at each pixel, which
        # lifts faint extended arcs out of the per-pixel noise
        from scipy.signal import fftconvolve

        k = np.asarray(imaging.psf.kernel(), dtype=float)
        num = fftconvolve(r * inv_var, k[::-1, ::-1], mode="same")
        den = np.sqrt(np.maximum(fftconvolve(inv_var, (k * k)[::-1, ::-1], mode="same"), 0))
        snr = np.where(den > 0, num / np.where(den > 0, den, 1.0), 0.0)
    else:
        snr = r * np.sqrt(inv_var)
    use = np.asarray(imaging.mask) & np.isfinite(snr) & (snr > threshold)
    # pure noise passes the threshold in a fraction sf(threshold) of the pixels: ask for
    # five times that many, so that noise alone gives no placement
    from scipy.stats import norm

    chance = float(norm.sf(threshold)) * int(np.asarray(imaging.mask).sum())
    if int(use.sum()) < max(min_pixels, math.ceil(5 * chance)):
        return None
    dtype = imaging.data.dtype
    return ArcPlacement(
        jnp.asarray(np.asarray(imaging.grid.x)[use], dtype),
        jnp.asarray(np.asarray(imaging.grid.y)[use], dtype),
        jnp.asarray(snr[use], dtype),
    )


@eqx.filter_jit
def _lens_image(model: LensSystem, imaging: Imaging) -> Float[Array, "ny nx"]:
    """The lens light's part of `model`'s image (one compiled program: run eagerly, its
    few hundred operations each cost a program of their own in every new process)."""
    total = model.image(imaging.grid, imaging.psf)
    no_lens = eqx.tree_at(lambda s: s.lens_light, model, None, is_leaf=lambda v: v is None)
    return total - no_lens.image(imaging.grid, imaging.psf)


@dataclasses.dataclass(frozen=True)
class Search:
    """The outcome of `search`.

    - `best`: the chosen `FitResult` (the lowest objective among the refined starts that
      converged to a plausible model; else the lowest of all, its status saying why not).
    - `refined`: every refined start's `FitResult`, batched along a leading axis (see
      `equilens.solve.pick`); `notes[i]` says why start `i` is implausible (empty if not).
    - `screen_points`: the screened starts, shape `(n_screen, n_space)`, ordered as
      `names`; `screen_values`: the objective at each; `refined_index`: which of them
      were refined (the best polished first, or without polishing the best screened).
    - `best_index`: index of `best` in `refined`; `wall_time`: seconds, compile included.
    - `polished_values`: the objective of each polished start after `polish_steps`
      (None when none were polished).
    - `other_basins`: how many of the refined starts, the last ones, were refined from
      other basins (`search`'s `n_other`): candidates for `with_rival_minima`, never
      chosen as `best`.
    """

    best: FitResult
    refined: FitResult
    notes: tuple[tuple[str, ...], ...]
    names: tuple[str, ...]
    screen_points: np.ndarray
    screen_values: np.ndarray
    refined_index: np.ndarray
    best_index: int
    wall_time: float
    polished_values: np.ndarray | None = None
    other_basins: int = 0

    def summary(self, tolerance: float = 1.0) -> str:
        """How the chosen minimum compares with the others: how many refined starts reached
        it (objective within `tolerance`, i.e. a chi2 within 2 x `tolerance`), the
        distinct other minima and how much worse each is (a lower one is implausible, and
        says why)."""
        values = np.asarray(self.refined.value, dtype=float)
        ok = np.asarray(self.refined.result._value) == _code(RESULTS.successful)  # pyright: ignore
        best = float(values[self.best_index])
        same = int(np.sum(np.abs(values - best) <= tolerance))
        polished = (
            ""
            if self.polished_values is None
            else f"the best {len(self.polished_values)} polished, "
        )
        extra = f" and {self.other_basins} of other Einstein radii" if self.other_basins else ""
        lines = [
            f"search: {len(self.screen_values)} starts screened, {polished}the best "
            f"{len(values) - self.other_basins}{extra} refined ({self.refined.solver}); "
            f"{same} of {len(values)} reached "
            f"the chosen minimum (objective {best:.2f}) within the refinement steps, "
            f"{int(ok.sum())} converged"
        ]
        others = sorted({round(float(v), 1) for v in values if abs(v - best) > tolerance})
        if others:
            # a lower one is implausible (the chosen is the lowest plausible): say why
            why = {
                round(float(v), 1): "; ".join(n)
                for v, n in zip(values, self.notes, strict=True)
                if n and v < best
            }
            gaps = ", ".join(
                f"{v - best:+.1f}" + (f" (implausible: {why[v]})" if v in why else "")
                for v in others[:5]
            )
            lines.append(f"  other minima (objective minus the chosen one's): {gaps}")
        return "\n".join(lines)


def _names(model: PyTree[Any], space: Mapping[Where, Bounds]) -> tuple[str, ...]:
    flat = jtu.tree_flatten_with_path(model)[0]
    paths = {id(leaf): jtu.keystr(p).lstrip(".") for p, leaf in flat}
    out = []
    for where in space:
        leaf = where(model)
        out.append(paths.get(id(leaf), "?"))
    return tuple(out)


def _check_space(model: PyTree[Any], space: Mapping[Where, Bounds]) -> None:
    if not space:
        raise ValueError("the search space is empty")
    for where, (lo, hi) in space.items():
        leaf = where(model)
        if not eqx.is_inexact_array(leaf) or jnp.ndim(leaf) != 0:
            raise ValueError("every search-space entry must pick one scalar float parameter")
        if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
            raise ValueError(
                f"search-space bounds must be finite with lower < upper, got {(lo, hi)}"
            )


@eqx.filter_jit
def _screen(
    objective: Objective, model, wheres, points: Float[Array, "n d"], prepare
) -> Float[Array, " n"]:
    def value(p):
        v = objective(_start(model, wheres, p, prepare))
        return jnp.where(jnp.isfinite(v), v, jnp.inf)

    return jax.lax.map(value, points, batch_size=64)


def search(
    objective: Objective,
    model: PyTree[Any],
    space: Mapping[Where, Bounds] | None = None,
    *,
    n_screen: int = 512,
    n_refine: int = 8,
    n_other: int = 0,
    solver: SolverLike = "lm",
    free: PyTree[bool] | Callable[[Any], bool] | None = None,
    bounds: Mapping[Where, Bounds] | None = None,
    refine_steps: int = 100,
    max_steps: int = 500,
    seed: int = 0,
    prepare: Callable[[Any], Any] | None = None,
    separation: float = 0.15,
    n_polish: int = 32,
    polish_steps: int = 15,
    batch_size: int | None = 8,
    covariance: bool = True,
    route: BatchRoute = "auto",
) -> Search:
    """A global fit that does not depend on a lucky start.

    1. `n_screen` starts fill `space` (`{where: (lower, upper)}`, one scalar parameter
       each; default `lens_search_space(model)`: Einstein radius, mass ellipticity,
       shear and source position) evenly, as a scrambled Sobol sequence (`seed`); every
       other parameter keeps its value in `model`; `prepare` (a pytree callable, e.g.
       `ArcPlacement`), if given, then completes each start (vmapped; e.g. puts the
       source where the start's mass maps the arcs). The objective is evaluated at all of
       them in one compiled, vmapped batch. A source's size is not searched, so a source
       that would run off to a huge, diffuse blob cannot win the screening.
    2. The `n_polish` best, each at least `separation` from those picked before it (the
       RMS distance over the space's dimensions, each scaled to its width: the best few
       starts of one basin do not crowd out the other basins; when too few are that far
       apart, the best of the rest fill up), are polished together by `polish_steps`
       steps of `solver` (the screen judges a start before its source and lens have
       met; a few steps tell the basins apart: on a lenstronomy-simulated lens the true
       minimum's start ranked 21st in the screen, and the best 4 screened starts all
       refined into a trap 480 worse in chi2 / 2, while after 15 steps the best 8 of 32
       polished starts all lay in the true basin); the `n_refine` best polished, and up
       to `n_other` more, each the best one of another basin (an Einstein radius more
       than `BASIN_THETA_E` from every one picked), are fitted on for up to
       `refine_steps` steps
       (`fit_batch` with `solver`, `free`, `bounds`; the batch runs until its slowest
       member stops, so a few hundred steps of hopeless starts cost as much as the rest).
       Polishing and refining are `fit_batch` calls (`route`: on a CPU one compiled fit
       after another, each start stopping at its own step count; on an accelerator
       vmapped, `batch_size` starts at a time: memory grows with it, 32 starts of a
       110x110 image supersampled twice at once: 9 GB). `covariance=False` skips the
       refined fits' covariances (a pipeline that fits on from the best does not need
       them; the polishing and refining then run the same compiled program).
    3. The result is the refined fit with the lowest objective among the `n_refine` best
       polished (the other basins' fits are candidates for `with_rival_minima`, which
       `fit_lens` runs: one that ends lower there is chosen) that reached a
       plausible model (`equilens.solve.implausible_notes`: no parameter at a bound, no
       source larger than the data, no Einstein radius beyond it or under two pixels);
       one still descending is finished by `fit` (up to `max_steps` more steps).

    `Search.summary()` tells how many refined starts reached the chosen minimum and how
    far the others are. Raises `ValueError` for a bad space or counts.
    """
    t0 = time.perf_counter()
    if model is None or not isinstance(objective, Objective):
        raise TypeError("search needs an equilens Objective and a starting model")
    if n_screen < 1 or not 1 <= n_refine <= n_screen:
        raise ValueError(
            f"need n_screen >= 1 and 1 <= n_refine <= n_screen, got {n_screen}, {n_refine}"
        )
    if n_other < 0:
        raise ValueError(f"n_other must be >= 0, got {n_other}")
    if n_polish < 0 or polish_steps < 0:
        raise ValueError(f"n_polish and polish_steps must be >= 0, got {n_polish}, {polish_steps}")
    if space is None:
        if not isinstance(model, LensSystem):
            raise ValueError("pass a search space for a model that is not a LensSystem")
        space = lens_search_space(model)
    _check_space(model, space)
    wheres = tuple(space)
    lo = np.array([b[0] for b in space.values()], dtype=float)
    hi = np.array([b[1] for b in space.values()], dtype=float)
    from scipy.stats import qmc

    # powers of two keep the Sobol sequence balanced; draw that many, keep n_screen
    m = max(math.ceil(math.log2(n_screen)), 1)
    u = qmc.Sobol(len(wheres), scramble=True, rng=seed).random_base2(m)[:n_screen]
    points = lo + (hi - lo) * u
    dtype = jnp.result_type(*[w(model) for w in wheres])
    values = np.asarray(_screen(objective, model, wheres, jnp.asarray(points, dtype), prepare))
    n_polish = max(n_polish, n_refine)
    order = _diverse_best(values, u, min(n_polish, n_screen), separation)
    starts = _starts(model, wheres, jnp.asarray(points[order], dtype), prepare)
    polished_values = None
    if polish_steps > 0 and order.size > n_refine:
        polished = fit_batch(
            objective,
            starts,
            solver,
            free=free,
            bounds=bounds,
            max_steps=polish_steps,
            batch_size=batch_size,
            covariance=False,
            route=route,
        )
        polished_values = np.asarray(polished.value, dtype=float)
        keep = _refine_choice(polished_values, _theta_e_of(polished.model), n_refine, n_other)
        starts = jtu.tree_map(lambda x: x[keep] if eqx.is_array(x) else x, polished.model)
        order = order[keep]
    else:
        order = order[:n_refine]
        starts = jtu.tree_map(lambda x: x[:n_refine] if eqx.is_array(x) else x, starts)
    refined = fit_batch(
        objective,
        starts,
        solver,
        free=free,
        bounds=bounds,
        max_steps=refine_steps,
        batch_size=batch_size,
        covariance=covariance,
        route=route,
    )
    n_fitted = int(np.size(refined.value))
    notes = tuple(
        implausible_notes(objective, pick(refined, i).model, free=free, bounds=bounds)
        for i in range(n_fitted)
    )
    final = np.asarray(refined.value, dtype=float)
    codes = np.asarray(refined.result._value)  # pyright: ignore[reportAttributeAccessIssue]
    # a start still descending after refine_steps may be the best: it is finished below
    usable = np.isin(codes, [_code(RESULTS.successful), _code(RESULTS.nonlinear_max_steps_reached)])
    good = usable & np.array([not n for n in notes]) & np.isfinite(final)
    # the best is chosen among the n_refine best polished; the other basins' starts after
    # them are candidates for `with_rival_minima` only
    choosable = np.arange(n_fitted) < min(n_refine, n_fitted)
    pool = np.where(good & choosable, final, np.inf)
    if not np.isfinite(pool).any():
        pool = np.where(choosable, np.nan_to_num(final, nan=np.inf), np.inf)
    k = int(np.argmin(pool))
    best = with_plausibility(pick(refined, k), notes[k])
    if codes[k] == _code(RESULTS.nonlinear_max_steps_reached):
        best = fit(
            objective,
            best.model,
            solver,
            free=free,
            bounds=bounds,
            max_steps=max_steps,
            throw=False,
            covariance=covariance,
        )
    return Search(
        best=best,
        refined=refined,
        notes=notes,
        names=_names(model, space),
        screen_points=points,
        screen_values=values,
        refined_index=order,
        best_index=k,
        wall_time=time.perf_counter() - t0,
        polished_values=polished_values,
        other_basins=n_fitted - int(np.sum(choosable)),
    )


def _code(result: Any) -> Any:
    return np.asarray(result._value)  # pyright: ignore[reportAttributeAccessIssue]


def _set(model: PyTree[Any], wheres: tuple[Where, ...], p: Float[Array, " d"]) -> PyTree[Any]:
    for i, w in enumerate(wheres):
        model = eqx.tree_at(w, model, p[i].astype(w(model).dtype))
    return model


def _start(model: PyTree[Any], wheres: tuple[Where, ...], p: Float[Array, " d"], prepare):
    model = _set(model, wheres, p)
    return model if prepare is None else prepare(model)


@eqx.filter_jit
def _starts(model: PyTree[Any], wheres: tuple[Where, ...], points: Float[Array, "n d"], prepare):
    """`_start` at each row of `points`, batched along a leading axis (compiled: the
    placement's ray tracing run eagerly costs a program per operation)."""
    return jax.vmap(lambda p: _start(model, wheres, p, prepare))(points)


#: Two polished starts lie in different basins of the search when their Einstein radii
#: differ by more than this fraction (`_refine_choice`).
BASIN_THETA_E = 0.02


def _theta_e_of(models: Any) -> np.ndarray | None:
    """The first mass component's Einstein radius of each of a batch of models, or None
    for a model without one (the refinement then goes by the objective alone)."""
    if not isinstance(models, LensSystem):
        return None
    try:
        _, first = first_mass(models)
    except ValueError:
        return None
    return np.atleast_1d(np.asarray(first.theta_E, dtype=float))


def _refine_choice(
    values: np.ndarray, theta_e: np.ndarray | None, n: int, n_other: int = 0
) -> np.ndarray:
    """Indices of the polished starts to refine: the `n` best by `values`, then up to
    `n_other` more, each the best start whose Einstein radius `theta_e` differs by more
    than `BASIN_THETA_E` from every one picked (another basin: e.g. a mass that maps the
    arcs as other images of the source). The best few polished starts often lie in one
    basin while another, ranked lower after the few polishing steps, would end about as
    low or lower: refining one start of it lets `with_rival_minima` weigh it."""
    order = [int(i) for i in np.argsort(np.nan_to_num(values, nan=np.inf), kind="stable")]
    picked = order[:n]
    if theta_e is None:
        return np.asarray(picked)
    for _ in range(n_other):
        apart = [
            i
            for i in order
            if i not in picked
            and np.isfinite(values[i])
            and all(abs(theta_e[i] / theta_e[j] - 1.0) > BASIN_THETA_E for j in picked)
        ]
        if not apart:
            break
        picked.append(apart[0])
    return np.asarray(picked)


def _diverse_best(values: np.ndarray, unit: np.ndarray, n: int, separation: float) -> np.ndarray:
    """Indices of the `n` lowest `values`, each at least `separation` (RMS over the
    dimensions of the unit-cube coordinates `unit`) from those picked before it; the
    lowest of the rest fill up when too few are that far apart."""
    order = np.argsort(values, kind="stable")
    picked: list[int] = []
    for i in order:
        if len(picked) == n:
            break
        if not np.isfinite(values[i]):
            continue
        if all(np.sqrt(np.mean((unit[i] - unit[j]) ** 2)) >= separation for j in picked):
            picked.append(int(i))
    for i in order:
        if len(picked) == n:
            break
        if int(i) not in picked:
            picked.append(int(i))
    return np.asarray(picked)
