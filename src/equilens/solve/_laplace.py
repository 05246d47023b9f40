"""`laplace_evidence`: the log-evidence of a fitted model by the Laplace approximation over
its free parameters, each with the uniform prior of its bounds.

The parameters are integrated in the unconstrained coordinates `z` a fit iterates on
(`Parametrisation`: a bounded value is `lower + (upper - lower) sigmoid(z)`), where the
integrand is

    exp(-F(z)),   F(z) = objective(theta(z)) - log |d theta / d z| + log(upper - lower)

summed over the parameters (the prior density `1 / (upper - lower)` of a two-sided bound;
a one-sided or absent bound contributes the Jacobian alone, an improper prior that cancels
in a comparison of two models sharing the parameter). In `z` the integrand is a proper,
smooth density even when the data leave a parameter unconstrained (then it is the
prior's logistic shape, which the approximation integrates to within 0.12 in log) or
pinned at a bound, where the fitted optimum in the physical value sits at infinity in `z`.
From the fit's optimum a few damped Newton steps find the mode `z*` of `exp(-F)`; then

    log E = -F(z*) + (k / 2) log(2 pi) - (1 / 2) log det H(z*),

`H` the Hessian of `F` (central differences of its autodiff gradient, `_parts`). A
negative eigenvalue of `H` (an evidence rough on scales below the step, or a mode not
reached) counts by its magnitude, and is counted; eigenvalues below `LAPLACE_EIGEN_FLOOR`
times the largest (a direction the objective and the prior leave flat: an improper
prior's parameter the data do not constrain) are floored there and counted.
"""

import math
from collections.abc import Callable, Mapping
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree
from jaxtyping import PyTree

from ..objective import Objective, Parametrisation
from ..objective._params import Bounds, Where
from ._covariance import smoothed_value_hessian
from ._importance import importance_evidence
from ._parametrise import parametrisation

#: Eigenvalues of the Hessian below this fraction of the largest are floored there.
LAPLACE_EIGEN_FLOOR = 1e-12
#: Largest Newton step in any unconstrained coordinate (a bounded parameter's logit).
LAPLACE_MAX_STEP = 4.0
#: The step (unconstrained coordinates, float64; 30 times it in float32) of the central
#: differences of the gradient that give the Hessian.
LAPLACE_STEP = 1e-3


class LaplaceEvidence(eqx.Module):
    """The outcome of `laplace_evidence`.

    **Fields:** `log_evidence` (natural log); `model` (at the mode `z*`); `covariance` (of
    the free parameters in physical units, `J H^-1 J` with `J` the diagonal of `d theta /
    d z`, ordered as `names`); `names`; `newton_steps` (taken); `floored` (eigenvalues
    floored: 0 when every direction is constrained by the data or the prior);
    `negative` (negative eigenvalues of the Hessian, counted by their magnitude);
    `gradient_norm` (`|dF/dz|` at the end: small when the mode was found);
    `smoothing_step` (with `smoothed=True`, the widest step of the values' central
    differences in units of the errors: 1, or 2 or 4 where the values over narrower steps
    did not give a positive-definite Hessian; NaN without smoothing); `smoothing_steps`
    (each parameter's step, ordered as `names`: only the parameters along the directions
    where the Hessian was not positive definite are widened, `smoothed_value_hessian`;
    None without smoothing); `raw_errors` (the 1-sigma errors
    in the unconstrained coordinates, ordered as `names`: a `scale` for `equilens.fit` of
    a like model); `log_evidence_error`, `effective_samples` (with
    `smoothing="importance"`: the estimate's standard error and the effective number of
    weighted points, Kish's; NaN otherwise); `backend` (which evaluated the smoothed
    values: "numba" or "jax"; "jax" without smoothing).
    """

    log_evidence: float
    model: PyTree[Any]
    covariance: np.ndarray
    names: tuple[str, ...]
    newton_steps: int
    floored: int
    negative: int
    gradient_norm: float
    smoothing_step: float = math.nan
    smoothing_steps: np.ndarray | None = None
    raw_errors: np.ndarray | None = None
    log_evidence_error: float = math.nan
    effective_samples: float = math.nan
    backend: str = "jax"


def _log_norm(param: Parametrisation, model: PyTree[Any]) -> float:
    """`sum log(upper - lower)` over the free scalars with two-sided finite bounds."""
    out = 0.0
    for value, b in zip(param.values(model), _free_bounds(param), strict=True):
        if b is not None and math.isfinite(b[0]) and math.isfinite(b[1]):
            out += int(np.size(value)) * math.log(b[1] - b[0])
    return out


def _free_bounds(param: Parametrisation) -> list[Bounds | None]:
    return [b for f, b in zip(param.free, param.bounds, strict=True) if f]


@eqx.filter_jit
def _value_and_grad(
    objective: Objective, param: Parametrisation, template: Any, raw: Any, norm: Any
):
    def F(r):
        return objective(param.to_model(r, template)) - param.log_jacobian(r) + norm

    return jax.value_and_grad(F)(raw)


@eqx.filter_jit
def _value(objective: Objective, param: Parametrisation, template: Any, raw: Any, norm: Any):
    return objective(param.to_model(raw, template)) - param.log_jacobian(raw) + norm


@eqx.filter_jit
def _values(objective: Objective, param: Parametrisation, template: Any, raws: Any, norm: Any):
    """`F` at each of the stacked raw values `raws` (one after another: `lax.map`)."""

    def one(raw):
        return objective(param.to_model(raw, template)) - param.log_jacobian(raw) + norm

    return jax.lax.map(one, raws)


@eqx.filter_jit
def _physical(param: Parametrisation, template: Any, raws: Any):
    """The free parameters' physical values (one flat vector a point, `param.values`'s
    order) and `log |d theta / d z|` at each of the stacked raw values `raws`."""

    def one(raw):
        return ravel_pytree(param.values(param.to_model(raw, template)))[0], param.log_jacobian(raw)

    return jax.vmap(one)(raws)


def _batch_values(
    objective: Objective,
    param: Parametrisation,
    template: Any,
    unravel: Any,
    norm: Any,
    backend: str,
) -> tuple[Callable[[Any], np.ndarray], str]:
    """`F` at each row of an array of unconstrained points, and the backend that gives it:
    "jax" (`_values`: one compiled `lax.map`) or "numba" (`equilens.numba.value` of each
    point's model, the points' physical values and Jacobians from one compiled call),
    chosen as `equilens.numba.log_density` chooses ("auto": Numba on a CPU where it can
    evaluate the objective; the same values to round-off, 1.6x faster on the Jackpot's
    pixelized evidence, docs/performance.md)."""
    dtype = ravel_pytree(param.to_raw(template))[0].dtype

    def jax_values(points):
        # the points as one stacked pytree of raw values: `_values` compiles once for
        # every call with the same model and objective (a closure given to lax.map would
        # compile again each time)
        raw = jax.vmap(unravel)(jnp.asarray(points, dtype))
        return np.asarray(_values(objective, param, template, raw, norm))

    if backend == "jax":
        return jax_values, "jax"
    from ..numba._terms import density

    dens = density(objective, template, param, backend)
    if dens.backend != "numba":
        return jax_values, "jax"
    shift = float(norm)

    def numba_values(points):
        phys, log_jac = _physical(param, template, jax.vmap(unravel)(jnp.asarray(points, dtype)))
        phys, log_jac = np.asarray(phys, np.float64), np.asarray(log_jac, np.float64)
        # `dens.f` is -objective; -inf (a model it cannot evaluate) gives F = inf
        f = np.array([-dens.f(v) for v in phys])
        return f - log_jac + shift

    return numba_values, "numba"


def _smoothed_hessian(
    objective, param, template, z, unravel, norm, h0, rounds, values
) -> tuple[np.ndarray, np.ndarray]:
    """The Hessian of `F` from central differences of its values over 1-sigma steps
    (`smoothed_value_hessian`, its steps widened where a round's Hessian is not positive
    definite), the first steps from the diagonal of `h0`, then from the covariance each
    round gives, the values from `values` (`_batch_values`); returns it (not positive
    definite when even the widest round's was not) and each parameter's step used, in
    sigma."""

    def f(zz):
        return _value(objective, param, template, unravel(zz), norm)

    hess, _, scale = smoothed_value_hessian(f, z, np.diagonal(h0), rounds=rounds, values=values)
    return hess, np.asarray(scale)


def _parts(objective, param, template, z, unravel, norm) -> tuple[float, np.ndarray, np.ndarray]:
    """`F`, its gradient (autodiff) and its Hessian: central differences of the gradient
    over steps of `LAPLACE_STEP` in each coordinate (2k gradients: on the shipped HST
    lens's pixelized evidence 20 times cheaper than the autodiff Hessian, and over a step
    about a posterior width it averages the evidence's roughness below that scale, as
    `with_smoothed_covariance` does)."""

    def grad(zz):
        f, g = _value_and_grad(objective, param, template, unravel(zz), norm)
        return float(f), np.asarray(ravel_pytree(g)[0], np.float64)

    f, g = grad(z)
    k = z.shape[0]
    step = LAPLACE_STEP if z.dtype == jnp.float64 else 30 * LAPLACE_STEP
    h = np.zeros((k, k))
    for i in range(k):
        e = jnp.zeros_like(z).at[i].set(step)
        h[i] = (grad(z + e)[1] - grad(z - e)[1]) / (2 * step)
    return f, g, 0.5 * (h + h.T)


def _jacobian(param: Parametrisation, model: Any, unravel, z) -> np.ndarray:
    """`d theta / d z` at `z` (diagonal: the maps are elementwise)."""
    return np.asarray(
        jax.jacfwd(lambda zz: ravel_pytree(param.values(param.to_model(unravel(zz), model)))[0])(z)
    )


def laplace_evidence(
    objective: Objective,
    model: PyTree[Any],
    *,
    free: PyTree[bool] | Callable[[Any], bool] | None = None,
    bounds: Mapping[Where, Bounds] | None = None,
    newton_steps: int = 8,
    smoothed: bool = False,
    smoothing_rounds: int = 3,
    smoothing: Literal["differences", "importance"] = "differences",
    backend: Literal["auto", "numba", "jax"] = "auto",
) -> LaplaceEvidence:
    """The log-evidence of `objective` (a negative log posterior up to the priors of the
    bounds: a likelihood, or `LogEvidence`'s source-marginalised one) integrated over the
    free parameters of `model` (`free`, `bounds` as in `equilens.fit`), each with the
    uniform prior of its bounds, by the Laplace approximation in the fit's unconstrained
    coordinates (module docstring). `model` should be a fitted optimum; at most
    `newton_steps` damped Newton steps move it to the mode of the integrand.

    `smoothed=True` is for objectives rough on scales below their errors (a pixelized
    source's evidence: its mapping changes as traced pixels cross the mesh's cells, and an
    adaptive mesh moves with the mass; its local curvature, by autodiff or over small
    steps, is indefinite at a minimum the values show plainly): no Newton steps, and the
    Hessian from central differences of the values over 1-sigma steps, the steps
    re-estimated from the covariance so found (at most `smoothing_rounds` rounds;
    `with_smoothed_covariance`'s scheme): the Laplace approximation of the integrand
    smoothed over its 1-sigma region. With `smoothing="importance"` the integral is
    estimated instead by importance sampling (`_importance.importance_evidence`): one
    round of those differences gives the first Gaussian, then `smoothing_rounds` rounds of
    as many values each adapt it to the values and weigh them; no quadratic is assumed,
    the dip a fit stops in counts for what it is, and `log_evidence_error` and
    `effective_samples` say how well the points covered the integrand (the covariance
    is the weighted points' own). Default `"differences"`: on a rough evidence the two
    differ by the differences' bias (docs/subhalo.md).

    `backend` evaluates those values (with `smoothed=True`; the mode, gradient and
    Newton steps are always JAX's): "jax" (one compiled `lax.map`), "numba"
    (`equilens.numba.value` of each point's model: the same values to round-off) or
    "auto" (default), which takes Numba on a CPU where the Numba backend can evaluate
    the objective, as `equilens.numba.log_density` does (on the Jackpot's pixelized
    evidence 60 ms a value against 95 ms, one thread; docs/performance.md), JAX
    otherwise.

    A comparison of two models (e.g. a subhalo against none) by the difference of their
    log-evidences is meaningful for the parameters both share only when they share the
    bounds. Raises `ValueError` when the objective is not finite at `model`."""
    if smoothing not in ("differences", "importance"):
        raise ValueError(
            f"laplace_evidence: smoothing must be 'differences' or 'importance', got {smoothing!r}"
        )
    if backend not in ("auto", "numba", "jax"):
        raise ValueError(
            f"laplace_evidence: backend must be 'auto', 'numba' or 'jax', got {backend!r}"
        )
    param = parametrisation(objective, model, free, bounds)
    if param.n_free == 0:
        raise ValueError("laplace_evidence: no free parameters")
    norm = jnp.asarray(_log_norm(param, model))
    raw = param.to_raw(model)
    z, unravel = ravel_pytree(raw)
    f, g, h = _parts(objective, param, model, z, unravel, norm)
    if not np.isfinite(f):
        raise ValueError("laplace_evidence: the objective is not finite at the model")
    steps = 0
    for _ in range(0 if smoothed else newton_steps):
        w, v = np.linalg.eigh(0.5 * (h + h.T))
        top = max(float(np.max(np.abs(w))), 1e-300)
        w = np.maximum(np.abs(w), LAPLACE_EIGEN_FLOOR * top)
        dz = -v @ ((v.T @ g) / w)
        if float(-g @ dz) < 1e-10:  # the predicted decrease: at the mode
            break
        dz *= min(1.0, LAPLACE_MAX_STEP / float(np.max(np.abs(dz))))
        accepted = False
        for t in (1.0, 0.5, 0.25, 0.125):
            trial = unravel(jnp.asarray(np.asarray(z) + t * dz, z.dtype))
            ft = float(_value(objective, param, model, trial, norm))
            if np.isfinite(ft) and ft < f:
                z, accepted = jnp.asarray(np.asarray(z) + t * dz, z.dtype), True
                break
        if not accepted:
            break
        steps += 1
        f, g, h = _parts(objective, param, model, z, unravel, norm)
    steps_used = None
    values, used = None, "jax"
    if smoothed:
        values, used = _batch_values(objective, param, model, unravel, norm, backend)
    if values is not None and smoothing == "importance":
        h, _ = _smoothed_hessian(objective, param, model, z, unravel, norm, h, 1, values)
        ie = importance_evidence(values, np.asarray(z, np.float64), h, rounds=smoothing_rounds)
        cov_z = 0.5 * (ie.covariance + ie.covariance.T)
        jac = _jacobian(param, model, unravel, z)
        cov = jac @ cov_z @ jac.T
        return LaplaceEvidence(
            log_evidence=ie.log_evidence,
            model=objective.complete(param.to_model(unravel(z), model)),
            covariance=0.5 * (cov + cov.T),
            names=param.paths(model),
            newton_steps=0,
            floored=0,
            negative=0,
            gradient_norm=float(np.linalg.norm(g)),
            raw_errors=np.sqrt(np.maximum(np.diagonal(cov_z), 0.0)),
            log_evidence_error=ie.error,
            effective_samples=ie.effective,
            backend=used,
        )
    if values is not None:
        h, steps_used = _smoothed_hessian(
            objective, param, model, z, unravel, norm, h, smoothing_rounds, values
        )
    h = 0.5 * (h + h.T)
    if not np.all(np.isfinite(h)):
        names = param.paths(model)
        bad = sorted({names[i] for i in np.argwhere(~np.isfinite(h))[:, 0]})
        raise ValueError(
            f"laplace_evidence: the Hessian at the mode is not finite in {', '.join(bad)} "
            "(hold those parameters, or give them bounds the data constrain)"
        )
    w, v = np.linalg.eigh(h)
    negative = int(np.sum(w < 0))
    w = np.abs(w)
    top = max(float(np.max(w)), 1e-300)
    floor = LAPLACE_EIGEN_FLOOR * top
    floored = int(np.sum(w < floor))
    w = np.maximum(w, floor)
    k = w.shape[0]
    log_e = -f + 0.5 * k * math.log(2.0 * math.pi) - 0.5 * float(np.sum(np.log(w)))
    raw_end = unravel(z)
    best = param.to_model(raw_end, model)
    jac = _jacobian(param, model, unravel, z)
    cov_z = (v / w[None, :]) @ v.T
    cov = jac @ cov_z @ jac.T
    return LaplaceEvidence(
        log_evidence=float(log_e),
        model=objective.complete(best),
        covariance=0.5 * (cov + cov.T),
        names=param.paths(model),
        newton_steps=steps,
        floored=floored,
        negative=negative,
        gradient_norm=float(np.linalg.norm(g)),
        smoothing_step=math.nan if steps_used is None else float(np.max(steps_used)),
        smoothing_steps=steps_used,
        raw_errors=np.sqrt(np.diagonal(cov_z)),
        backend=used,
    )
