"""`fit_lens`: the staged fit of an imaging dataset used by the `equilens` command."""

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import numpy as np

from .._lens_system import LensSystem
from ..data import Imaging
from ..mass import MassSum
from ..objective import Objective, select
from ..terms import GaussianLikelihood
from ._fit import SolverLike, fit
from ._result import FitResult
from ._start import light_moments, start_model

#: Einstein-radius starts of `fit_lens`, as fractions of the mask radius.
THETA_E_FRACTIONS = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7)


def fit_lens(
    imaging: Imaging,
    mass: str = "sie+shear",
    lens_light: str | None = "sersic",
    source: str = "sersic",
    *,
    solver: SolverLike = "lm",
    max_steps: int = 300,
    log: Callable[[str], None] | None = print,
    progress: bool = False,
) -> FitResult:
    """Fits a lens model to `imaging` from a generic start, in three stages (the usual
    pipeline of the field, e.g. PyAutoLens's SLaM):

    1. the lens light alone (mass and source held at their starts);
    2. the mass and source, from Einstein radii `THETA_E_FRACTIONS` x the mask radius (each
       start fitted in turn, the same compiled solver), keeping the best;
    3. everything together, from the best stage-2 model; its covariance is reported.

    Profiles are named as in `start_model` (`"sie+shear"`, `"sersic"`, ...); every
    starting value comes from the data (`light_moments`); the amplitudes are solved
    linearly. Returns the stage-3 `FitResult` (wall time of all stages).
    """
    t0 = time.perf_counter()
    say = log or (lambda _: None)
    objective = Objective(GaussianLikelihood(imaging))
    model = start_model(imaging, mass, lens_light, source)
    if lens_light is not None:
        r = fit(
            objective,
            model,
            solver,
            free=select(model, lambda s: s.lens_light),
            max_steps=max_steps,
            throw=False,
            progress=progress,
        )
        say(f"  stage 1 (lens light): reduced chi2 {float(r.reduced_chi2):.3f}")
        model = r.model
    radius = light_moments(imaging).mask_radius
    best, best_value = None, np.inf
    free = select(model, lambda s: (s.mass, s.source))
    for frac in THETA_E_FRACTIONS:
        te = frac * radius
        start = eqx.tree_at(
            _einstein_radius_where(model), model, jnp.asarray(te, imaging.data.dtype)
        )
        r = fit(
            objective, start, solver, free=free, max_steps=max_steps, throw=False, progress=progress
        )
        value = float(r.value)
        say(f'  stage 2 from theta_E = {te:.2f}": reduced chi2 {float(r.reduced_chi2):.3f}')
        if np.isfinite(value) and value < best_value:
            best, best_value = r, value
    if best is None:
        raise RuntimeError("every stage-2 start failed")
    r = fit(objective, best.model, solver, max_steps=max_steps, throw=False, progress=progress)
    say(f"  stage 3 (all free): reduced chi2 {float(r.reduced_chi2):.3f}, {r.message()}")
    return dataclasses.replace(r, wall_time=time.perf_counter() - t0)


def _einstein_radius_where(model: LensSystem) -> Callable[[LensSystem], Any]:
    """`where` picking the Einstein radius (`theta_E`) of the first mass component."""
    if isinstance(model.mass, MassSum):
        first = model.mass.components[0]
        if "theta_E" in {f.name for f in dataclasses.fields(first)}:
            return lambda s: s.mass.components[0].theta_E  # pyright: ignore
    elif "theta_E" in {f.name for f in dataclasses.fields(model.mass)}:
        return lambda s: s.mass.theta_E  # pyright: ignore
    raise ValueError("fit_lens needs a first mass component with an Einstein radius theta_E")
