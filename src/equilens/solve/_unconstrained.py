"""An objective as a function of a fit's unconstrained coordinates `z` (`Parametrisation`:
a bounded value is `lower + (upper - lower) sigmoid(z)`), as `laplace_evidence` and
`with_smoothed_covariance` take its curvature:

    F(z) = objective(theta(z))                                   (prior=False)
    F(z) = objective(theta(z)) - log |d theta / d z| + norm      (prior=True)

the second with the uniform priors of the bounds (`norm`: `sum log(upper - lower)`): the
integrand `exp(-F)` of the Laplace evidence. Here: its value and gradient, its values at
many points (one compiled JAX program, or the Numba backend on a CPU) and the central
differences of its gradient."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from ..objective import Objective, Parametrisation

#: The step (unconstrained coordinates, float64; 30 times it in float32) of the central
#: differences of the gradient that give the Hessian (`gradient_hessian`).
GRADIENT_STEP = 1e-3


def _F(objective: Objective, param: Parametrisation, template: Any, raw: Any, norm: Any, prior):
    value = objective(param.to_model(raw, template))
    return value - param.log_jacobian(raw) + norm if prior else value


@eqx.filter_jit
def value_and_grad(
    objective: Objective, param: Parametrisation, template: Any, raw: Any, norm: Any, prior=True
):
    """`F` and its gradient (a pytree like `raw`) at the raw values `raw`."""
    return jax.value_and_grad(lambda r: _F(objective, param, template, r, norm, prior))(raw)


@eqx.filter_jit
def value(objective: Objective, param: Parametrisation, template: Any, raw: Any, norm: Any):
    """`F` (`prior=True`) at the raw values `raw`."""
    return _F(objective, param, template, raw, norm, True)


@eqx.filter_jit
def values(
    objective: Objective, param: Parametrisation, template: Any, raws: Any, norm: Any, prior=True
):
    """`F` at each of the stacked raw values `raws` (one after another: `lax.map`)."""
    return jax.lax.map(lambda raw: _F(objective, param, template, raw, norm, prior), raws)


@eqx.filter_jit
def physical(param: Parametrisation, template: Any, raws: Any):
    """The free parameters' physical values (one flat vector a point, `param.values`'s
    order) and `log |d theta / d z|` at each of the stacked raw values `raws`."""

    def one(raw):
        return ravel_pytree(param.values(param.to_model(raw, template)))[0], param.log_jacobian(raw)

    return jax.vmap(one)(raws)


def batch_values(
    objective: Objective,
    param: Parametrisation,
    template: Any,
    unravel: Any,
    norm: Any,
    backend: str,
    prior: bool = True,
) -> tuple[Callable[[Any], np.ndarray], str]:
    """`F` at each row of an array of unconstrained points, and the backend that gives it:
    "jax" (`values`: one compiled `lax.map`) or "numba" (`equilens.numba.value` of each
    point's model, the points' physical values and Jacobians from one compiled call),
    chosen as `equilens.numba.log_density` chooses ("auto": Numba on a CPU where it can
    evaluate the objective; the same values to round-off, 1.6x faster on the Jackpot's
    pixelized evidence, docs/performance.md)."""
    dtype = ravel_pytree(param.to_raw(template))[0].dtype

    def jax_values(points):
        # the points as one stacked pytree of raw values: `values` compiles once for
        # every call with the same model and objective (a closure given to lax.map would
        # compile again each time)
        raw = jax.vmap(unravel)(jnp.asarray(points, dtype))
        return np.asarray(values(objective, param, template, raw, norm, prior))

    if backend == "jax":
        return jax_values, "jax"
    from ..numba._terms import density

    dens = density(objective, template, param, backend)
    if dens.backend != "numba":
        return jax_values, "jax"
    shift = float(norm)

    def numba_values(points):
        phys, log_jac = physical(param, template, jax.vmap(unravel)(jnp.asarray(points, dtype)))
        phys, log_jac = np.asarray(phys, np.float64), np.asarray(log_jac, np.float64)
        # `dens.f` is -objective; -inf (a model it cannot evaluate) gives F = inf
        f = np.array([-dens.f(v) for v in phys])
        return f - log_jac + shift if prior else f

    return numba_values, "numba"


def gradient_hessian(
    objective, param, template, z, unravel, norm, rows=None, prior=True
) -> tuple[float, np.ndarray, np.ndarray]:
    """`F`, its gradient (autodiff) and its Hessian at the flat raw values `z`: central
    differences of the gradient over steps of `GRADIENT_STEP` in each coordinate (2k
    gradients: on the shipped HST lens's pixelized evidence 20 times cheaper than the
    autodiff Hessian, and over a step about a posterior width it averages the evidence's
    roughness below that scale, as the smoothed curvature does). `rows` (indices), if
    given: only those rows of the Hessian (2 gradients each), the others NaN and the
    Hessian not symmetrised (its diagonal at `rows` is what the caller uses)."""

    def grad(zz):
        f, g = value_and_grad(objective, param, template, unravel(zz), norm, prior)
        return float(f), np.asarray(ravel_pytree(g)[0], np.float64)

    f, g = grad(z)
    k = z.shape[0]
    step = GRADIENT_STEP if z.dtype == jnp.float64 else 30 * GRADIENT_STEP
    h = np.zeros((k, k)) if rows is None else np.full((k, k), np.nan)
    for i in range(k) if rows is None else rows:
        e = jnp.zeros_like(z).at[i].set(step)
        h[i] = (grad(z + e)[1] - grad(z - e)[1]) / (2 * step)
    return f, g, 0.5 * (h + h.T) if rows is None else h
