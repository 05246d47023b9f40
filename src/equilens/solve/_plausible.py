"""Plausibility of a fitted lens model: what a converged fit can still get wrong."""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

from .._lens_system import LensSystem
from ..light import AbstractLightProfile, LightSum
from ..mass import MassSum
from ..objective import Objective
from ..objective._params import Bounds, Where
from ..regularization import AbstractRegularization
from ._parametrise import parametrisation
from ._result import RESULTS, FitResult

#: A free parameter closer to a finite bound than this fraction of its interval is "at" it.
AT_BOUND = 1e-3

#: Fields that give a parametric source component's size (arcsec).
SIZE_FIELDS = ("R_sersic", "sigma", "beta")

#: Shape indices whose bounds are the profile's own range: at a bound, the profile
#: describes the light poorly (a clumpy source drives a Sersic to n = 0.3), which says
#: nothing against the lens model, so it is not a reason to call a fit implausible.
SHAPE_INDEX_FIELDS = ("n_sersic",)


def _data_radius(objective: Objective) -> tuple[float, float] | None:
    """Half the larger side of the box around the used pixels of the imaging terms, and the
    finest pixel scale (arcsec); None without imaging terms."""
    radius, scale = 0.0, np.inf
    for t in objective.imaging_terms():
        im = t.imaging
        used = np.asarray(im.mask)
        x, y = np.asarray(im.grid.x)[used], np.asarray(im.grid.y)[used]
        if x.size:
            radius = max(radius, 0.5 * float(max(np.ptp(x), np.ptp(y))) + im.pixel_scale)
        scale = min(scale, float(im.pixel_scale))
    return (radius, scale) if radius > 0 else None


def _components(profile: Any) -> tuple[Any, ...]:
    if profile is None:
        return ()
    return tuple(profile.components) if isinstance(profile, LightSum) else (profile,)


def has_field(module: Any, name: str) -> bool:
    """Whether the dataclass (Equinox module) `module` has a field `name`."""
    return dataclasses.is_dataclass(module) and any(
        f.name == name for f in dataclasses.fields(module)
    )


def implausible_notes(
    objective: Objective,
    model: PyTree[Any],
    *,
    free: PyTree[bool] | Callable[[Any], bool] | None = None,
    bounds: Mapping[Where, Bounds] | None = None,
) -> tuple[str, ...]:
    """Why a fitted `model` is implausible, one note per reason (empty when it is not):

    - a free parameter (chosen and bounded as in `equilens.fit`) within `AT_BOUND` of a
      finite bound of a two-sided interval: the data did not stop it, the bound did
      (shape indices, `SHAPE_INDEX_FIELDS`, and the hyperparameters of a regularization
      excepted: at a bound, the evidence prefers the limiting form, e.g. the constant
      weights of `AdaptiveBrightness` with `signal_scale -> 0`, which says nothing against
      the lens model);
    - for a `LensSystem` fitted to imaging: a parametric source component larger than the
      data (its `R_sersic`, `sigma` or `beta` beyond the half-width of the used pixels: a
      source that has run off to a diffuse blob), a parametric source without flux (its
      amplitudes, e.g. solved non-negative, all zero), an Einstein radius beyond the data
      or smaller than two pixels (no lensing resolved).
    """

    notes: list[str] = []
    param = parametrisation(objective, model, free, bounds, check=False)
    is_reg = lambda x: isinstance(x, AbstractRegularization)
    hyper = jtu.tree_leaves(
        jtu.tree_map(
            lambda node: jtu.tree_map(lambda _: True, node) if is_reg(node) else False,
            model,
            is_leaf=is_reg,
        )
    )
    for leaf, f, b, path, h in zip(
        jtu.tree_leaves(model), param.free, param.bounds, param.leaf_paths, hyper, strict=True
    ):
        if h or not f or b is None or not (np.isfinite(b[0]) and np.isfinite(b[1])):
            continue
        if path.rsplit(".", 1)[-1] in SHAPE_INDEX_FIELDS:
            continue
        v = np.asarray(leaf, dtype=float)
        tol = AT_BOUND * (b[1] - b[0])
        if np.any(v - b[0] < tol) or np.any(b[1] - v < tol):
            val = f"{float(v):.6g}" if v.ndim == 0 else str(v.tolist())
            notes.append(f"{path.lstrip('.')} = {val} is at its bound {b}")
    extent = _data_radius(objective)
    if isinstance(model, LensSystem) and extent is not None:
        radius, scale = extent
        for i, c in enumerate(_components(model.source)):
            if not isinstance(c, AbstractLightProfile):
                continue
            for name in SIZE_FIELDS:
                if has_field(c, name):
                    size = float(np.max(np.asarray(getattr(c, name))))
                    if size > radius:
                        where = "source" if len(_components(model.source)) == 1 else f"source[{i}]"
                        notes.append(
                            f'{where}.{name} = {size:.4g}" is larger than the data '
                            f'(half-width {radius:.3g}"): the source has run off to a diffuse '
                            "blob"
                        )
        amps = [
            np.asarray(c.amp)  # pyright: ignore[reportAttributeAccessIssue]
            for c in _components(model.source)
            if isinstance(c, AbstractLightProfile) and has_field(c, "amp")
        ]
        if amps and all(np.all(a <= 0) for a in amps):
            notes.append(
                "the source has no flux (its amplitude is zero): the model has no lensed "
                "light, so nothing constrains the mass"
            )
        comps = model.mass.components if isinstance(model.mass, MassSum) else (model.mass,)
        for i, c in enumerate(comps):
            if any(f.name == "theta_E" for f in dataclasses.fields(c)):
                te = float(np.max(np.asarray(c.theta_E)))  # pyright: ignore[reportAttributeAccessIssue]
                if te > radius:
                    notes.append(
                        f'mass[{i}].theta_E = {te:.4g}" is beyond the data ({radius:.3g}")'
                    )
                elif te < 2 * scale:
                    notes.append(
                        f'mass[{i}].theta_E = {te:.4g}" is under two pixels: no lensing resolved'
                    )
    return tuple(notes)


def with_plausibility(result: FitResult, notes: tuple[str, ...]) -> FitResult:
    """`result` with `notes` attached; a successful status becomes `RESULTS.implausible`."""
    if not notes:
        return result
    code = result.result
    if result.success:
        code = RESULTS.implausible
    return dataclasses.replace(result, result=code, notes=tuple(notes))
