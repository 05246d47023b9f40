"""Where `fit_pixelized`'s chain starts: `pixelized_model` (a lens model with a pixelized
source), the regularization's starting strength (`COEFFICIENT_GRID`), and `rank_starts`
(the log evidence of several starts, e.g. the minima of a parametric fit's search)."""

from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Float

from .._checks import default_bounds
from .._lens_system import LensSystem
from ..data import Imaging
from ..light import FixedLight
from ..source import AbstractMesh, AbstractRegularization, PixelizedSource
from ..terms import LogEvidence

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
    bounded = default_bounds(type(system.source.regularization))
    names = [n for n in bounded if n.endswith("coefficient")]
    return lambda s: tuple(getattr(s.source.regularization, n) for n in names)  # pyright: ignore[reportAttributeAccessIssue]


def _held_light(model: LensSystem) -> LensSystem:
    """`model` with its lens light (if any) held as it is (`FixedLight`)."""
    if model.lens_light is None or isinstance(model.lens_light, FixedLight):
        return model
    return eqx.tree_at(lambda s: s.lens_light, model, FixedLight(model.lens_light))


def _strength_start(
    term: LogEvidence, model: LensSystem, dtype: Any
) -> tuple[LensSystem, float, float]:
    """`model` with its regularization's strength coefficients (of `dtype`, the data's) at
    the best of `COEFFICIENT_GRID` for `term` (`fit_pixelized`'s stage-1 start), that
    strength, and the log evidence there (all NaN where no strength gives a finite one:
    `model` is then returned as it is)."""
    where = _strength_where(model)
    scores = []
    for c in COEFFICIENT_GRID:
        trial = eqx.tree_at(where, model, replace_fn=lambda _, c=c: jnp.asarray(c, dtype))
        scores.append(float(_value(term, trial)))
    scores = np.where(np.isfinite(scores), scores, np.nan)
    if np.isnan(scores).all():
        return model, float("nan"), float("nan")
    k = int(np.nanargmin(scores))
    best = COEFFICIENT_GRID[k]
    model = eqx.tree_at(where, model, replace_fn=lambda _: jnp.asarray(best, dtype))
    return model, best, -float(scores[k])


#: How much higher (natural log units) another start's log evidence (`rank_starts`) must
#: be than the parametric fit's own for the commands' chain to start there instead: less
#: is within what the parametric fit's last stages (supersampling, all parameters free)
#: move it, and not worth a start that differs from what the fit reported.
START_GAIN = 10.0


def rank_starts(
    imaging: Imaging,
    starts: Sequence[LensSystem],
    *,
    fit_strength: bool = True,
    lens_light: str = "fixed",
) -> Float[np.ndarray, " n"]:
    """The log evidence (`LogEvidence`, the data as the brightness estimate) at each of
    `starts`, lens models with a pixelized source (`pixelized_model`): where
    `fit_pixelized` could start its chain. With `fit_strength`, each at its
    regularization's best strength of `COEFFICIENT_GRID` (as `fit_pixelized`'s stage 1
    starts it; else at its own); with `lens_light="fixed"`, its lens light held
    (`FixedLight`), as the `equilens` command's chain holds it. NaN where the evidence is
    not finite.

    What it is for: the minima of a parametric fit's search (`fit_lens(on_minima=...)`)
    ranked by the evidence the chain maximises rather than by the parametric source's
    likelihood. A parametric source too simple for a real, clumpy galaxy (`fit_lens` then
    reports arcs left in its residuals) ranks mass models by how well they bend the arcs
    to its shape: on the subhalo suite's lens 2 (no lens light, a Hubble Deep Field
    galaxy as the source) the search's best minimum had an axis ratio of 0.2 and a slope
    of 2.8 and the chain from it stayed there, 1,017 in log evidence below the true mass
    refitted; the search's fourth minimum, 405 worse in chi2 / 2, was 1,355 higher in log
    evidence than the chosen one (docs/fitting.md)."""
    if lens_light not in ("solved", "fixed"):
        raise ValueError(f'lens_light must be "solved" or "fixed", got {lens_light!r}')
    term = LogEvidence(imaging)
    out = np.full(len(starts), np.nan)
    for i, model in enumerate(starts):
        if not isinstance(model.source, PixelizedSource):
            raise TypeError(
                f"rank_starts needs models with a PixelizedSource (start {i} has a "
                f"{type(model.source).__name__}): pixelized_model(model, mesh, regularization)"
            )
        model = _held_light(model) if lens_light == "fixed" else model
        if fit_strength:
            out[i] = _strength_start(term, model, imaging.data.dtype)[2]
        else:
            value = float(_value(term, model))
            out[i] = -value if np.isfinite(value) else np.nan
    return out


@eqx.filter_jit
def _value(objective: Any, model: Any) -> Any:
    """`objective(model)`, compiled once for every call with the same structure."""
    return objective(model)
