"""The free parameters and bounds of a fit (`parametrisation`): what `fit`, the samplers
and the plausibility checks read a model's parameters through."""

from collections.abc import Callable, Mapping
from typing import Any

from jaxtyping import PyTree

from ..objective import Objective, Parametrisation
from ..objective._params import Bounds, Where, linear_leaves
from ..terms import UniformPrior


def _prior_bounds(objective: Objective) -> dict[Where, Bounds]:
    """The bounds the objective's scalar `UniformPrior` terms set."""
    out = {}
    for t in objective.terms:
        if isinstance(t, UniformPrior) and t.lower.ndim == 0 and t.upper.ndim == 0:
            out[t.where] = (float(t.lower), float(t.upper))
    return out


def parametrisation(
    objective: Objective,
    model: PyTree[Any],
    free: PyTree[bool] | Callable[[Any], bool] | None,
    bounds: Mapping[Where, Bounds] | None,
    check: bool = True,
) -> Parametrisation:
    """The free parameters and bounds `fit` uses for `objective` and `model`."""
    return Parametrisation.build(
        model,
        linear_leaves(model, objective),
        free=free,
        bounds=bounds,
        prior_bounds=_prior_bounds(objective),
        check=check,
    )
