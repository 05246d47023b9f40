"""Priors on any parameter of a model, selected with a `where` function."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, PyTree, Scalar

from .._custom_types import as_float
from ._base import AbstractLeastSquaresTerm
from ._formulas import (
    LOGISTIC_CONSTANT,
    gaussian_normalisation,
    log_volume,
    logistic_residuals,
    standardised,
)


def _float_array(x: Float[ArrayLike, "..."]) -> Float[Array, "..."]:
    return as_float(x)


class GaussianPrior(AbstractLeastSquaresTerm):
    """Normal prior `N(mean, sigma^2)` on the parameter(s) `where(model)` picks, e.g.
    `GaussianPrior(lambda m: m.mass.components[1].gamma1, 0.0, 0.05)`.

    Residuals `(where(model) - mean) / sigma`; constant `sum log(sigma sqrt(2 pi))`. A
    vector parameter gets independent priors per element: `sigma` then has one entry per
    element (a scalar `sigma` for a vector parameter is refused, as the normalisation
    would count it once); `mean` broadcasts.
    """

    where: Callable[[PyTree[Any]], Float[Array, "..."]] = eqx.field(static=True)
    mean: Float[Array, "..."] = eqx.field(converter=_float_array)
    sigma: Float[Array, "..."] = eqx.field(converter=_float_array)

    def __check_init__(self):
        if not isinstance(self.sigma, jnp.ndarray) or self.sigma.ndim > 1:
            raise ValueError("GaussianPrior.sigma must be a scalar or a vector")

    def residuals(self, model: PyTree[Any]) -> Float[Array, " n"]:
        return standardised(jnp, self.where(model), self.mean, self.sigma)

    def constant(self) -> Scalar:
        return gaussian_normalisation(jnp.sum(jnp.log(self.sigma)), self.sigma.size)


class UniformPrior(AbstractLeastSquaresTerm):
    """Uniform prior on `[lower, upper]` for the parameter(s) `where(model)` picks.

    Its value is `log(upper - lower)` per element inside the interval and `inf` outside (the
    residuals are 0 inside, `inf` outside). `equilens.fit` keeps the parameter inside by
    reparametrising it to the interval, and multi-start draws starts from it.
    """

    where: Callable[[PyTree[Any]], Float[Array, "..."]] = eqx.field(static=True)
    lower: Float[Array, "..."] = eqx.field(converter=_float_array)
    upper: Float[Array, "..."] = eqx.field(converter=_float_array)

    def residuals(self, model: PyTree[Any]) -> Float[Array, " n"]:
        value = self.where(model)
        inside = (value >= self.lower) & (value <= self.upper)
        return jnp.reshape(jnp.where(inside, 0.0, jnp.inf).astype(value.dtype), (-1,))

    def constant(self) -> Scalar:
        return log_volume(jnp, self.lower, self.upper)


class LogisticPrior(AbstractLeastSquaresTerm):
    """The uniform prior on `(lower, upper)` of the scalar parameter `where(model)` picks,
    as a density over the fit's unconstrained coordinate `z = logit((theta - lower) /
    (upper - lower))`: `-log(s (1 - s))`, `s = sigmoid(z)` (the Jacobian of the bounded
    map `equilens.fit` uses). A fit with it finds the mode of the integrand
    `equilens.solve.laplace_evidence` approximates, which is finite in `z` even where the
    data push the parameter onto a bound (without it the fit chases the bound to infinity
    in `z`). Least-squares form (`logistic_residuals`): residual `2 sign(z) sqrt(log
    cosh(z / 2))`, constant `2 log 2`.
    """

    where: Callable[[PyTree[Any]], Float[Array, ""]] = eqx.field(static=True)
    lower: float = eqx.field(static=True)
    upper: float = eqx.field(static=True)

    def __check_init__(self):
        if not float(self.lower) < float(self.upper):
            raise ValueError(f"LogisticPrior needs lower < upper, got ({self.lower}, {self.upper})")

    def residuals(self, model: PyTree[Any]) -> Float[Array, " n"]:
        return logistic_residuals(jnp, self.where(model), self.lower, self.upper)

    def constant(self) -> Scalar:
        return jnp.asarray(LOGISTIC_CONSTANT)
