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

`H` the Hessian of `F` (central differences of its autodiff gradient,
`_unconstrained.gradient_hessian`). A negative eigenvalue of `H` (an evidence rough on
scales below the step, or a mode not reached) counts by its magnitude, and is counted;
eigenvalues below `LAPLACE_EIGEN_FLOOR` times the largest (a direction the objective and
the prior leave flat: an improper prior's parameter the data do not constrain) are
floored there and counted.
"""

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree
from jaxtyping import PyTree

from ..objective import Objective, Parametrisation
from ..objective._params import Bounds, Where
from ._block import BLOCK_SAMPLES, block_integral
from ._covariance import smoothed_value_hessian
from ._importance import importance_evidence
from ._parametrise import parametrisation
from ._unconstrained import (
    batch_values as _batch_values,
    gradient_hessian as _parts,
    value as _value,
)

#: Eigenvalues of the Hessian below this fraction of the largest are floored there.
LAPLACE_EIGEN_FLOOR = 1e-12
#: Largest Newton step in any unconstrained coordinate (a bounded parameter's logit).
LAPLACE_MAX_STEP = 4.0


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
    weighted points, Kish's; with `block`, those of the block's importance sampling; NaN
    otherwise); `backend` (which evaluated the smoothed values: "numba" or "jax"; "jax"
    without smoothing); `block_correction` (with `block`: the log of the block's integral
    along it over its Gaussian's, `_block.block_integral`, added to
    `log_evidence`; NaN without).
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
    block_correction: float = math.nan


def _log_norm(param: Parametrisation, model: PyTree[Any]) -> float:
    """`sum log(upper - lower)` over the free scalars with two-sided finite bounds."""
    out = 0.0
    for value, b in zip(param.values(model), _free_bounds(param), strict=True):
        if b is not None and math.isfinite(b[0]) and math.isfinite(b[1]):
            out += int(np.size(value)) * math.log(b[1] - b[0])
    return out


def _free_bounds(param: Parametrisation) -> list[Bounds | None]:
    return [b for f, b in zip(param.free, param.bounds, strict=True) if f]


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


def _start_errors(start: Mapping[str, float] | None, names: tuple[str, ...]) -> dict[str, float]:
    """`laplace_evidence`'s `smoothing_start` for the parameters `names` it names (checked:
    finite and > 0)."""
    if start is None:
        return {}
    out = {}
    for n in names:
        if n in start:
            v = float(start[n])
            if not (math.isfinite(v) and v > 0):
                raise ValueError(
                    f"laplace_evidence: smoothing_start[{n!r}] must be a finite error > 0 "
                    f"(unconstrained coordinates), got {start[n]!r}"
                )
            out[n] = v
    return out


def _block_indices(
    param: Parametrisation, model: Any, block: Sequence[str] | None, smoothing: str
) -> tuple[list[int], list[Bounds]]:
    """The indices (into the free parameters' names) of `laplace_evidence`'s `block` and
    their bounds, checked: free, each with a two-sided finite bound, and the smoothing the
    differences."""
    if not block:
        return [], []
    if smoothing != "differences":
        raise ValueError("laplace_evidence: block needs smoothing='differences'")
    names = param.paths(model)
    each: list[Bounds | None] = []
    for value, b in zip(param.values(model), _free_bounds(param), strict=True):
        each += [b] * int(np.size(value))
    out, bounds = [], []
    for n in block:
        if n not in names:
            raise ValueError(f"laplace_evidence: block names {n!r}, not a free parameter")
        i = names.index(n)
        b = each[i]
        if b is None or not (math.isfinite(b[0]) and math.isfinite(b[1])):
            raise ValueError(
                f"laplace_evidence: block's {n!r} needs a two-sided finite bound (its prior)"
            )
        out.append(i)
        bounds.append(b)
    return out, bounds


def _block_response(
    size: Callable[[np.ndarray], np.ndarray], bounds: list[Bounds], z_block: np.ndarray
) -> Callable[[np.ndarray], np.ndarray]:
    """`block_integral`'s `response` from `laplace_evidence`'s `block_response`: `size`
    of the block's values (rows; from its unconstrained coordinates through the bounds'
    sigmoid) over its size at the mode `z_block`."""
    lo = np.array([b[0] for b in bounds], np.float64)
    hi = np.array([b[1] for b in bounds], np.float64)

    def values(zb: np.ndarray) -> np.ndarray:
        return lo + (hi - lo) / (1.0 + np.exp(-np.asarray(zb, np.float64)))

    at_mode = float(np.asarray(size(values(z_block[None, :])), np.float64).reshape(-1)[0])
    if not (math.isfinite(at_mode) and at_mode != 0.0):
        raise ValueError(f"laplace_evidence: block_response is {at_mode} at the mode")
    return lambda zb: np.asarray(size(values(zb)), np.float64) / at_mode


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
    smoothing_start: Mapping[str, float] | None = None,
    block: Sequence[str] | None = None,
    block_samples: int = BLOCK_SAMPLES,
    block_anchors: Sequence[PyTree[Any]] = (),
    block_response: Callable[[np.ndarray], np.ndarray] | None = None,
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

    `smoothing_start` (with `smoothed=True`): 1-sigma errors in the unconstrained
    coordinates by parameter name (`names`' spelling; e.g. a like model's
    `LaplaceEvidence.raw_errors`) that the first round's steps start from, instead of the
    diagonal of the gradient's differences, which is then taken only for the parameters
    it does not name (2 gradients each); names of no free parameter are ignored. A
    subhalo scan's cells start from the smooth model's errors (docs/subhalo.md).

    `block` (parameter names, each with a two-sided bound; with `smoothing="differences"`):
    parameters the data may leave flat or bound on one side only (a subhalo's position
    and mass). Their part of the integral is corrected by importance sampling of the
    integrand along them (`block_samples` points, half from their Laplace Gaussian, half
    from their prior; at each, the other parameters at the better of the mode and the
    Gaussian's conditional mode, which follows the couplings of the mode's curvature,
    and of the models `block_anchors` (models like `model`; a subhalo's cell: the
    smooth model, where a light subhalo leaves it), or with `block_response` on the line
    from each anchor through the mode, `anchor + r (mode - anchor)`, `r` the response's
    size at the block's values (an array of rows, in `block`'s order, to one size a row)
    over its size at the mode (a subhalo: `10 ** log10_mass`, as the macro model's
    response to a light one is linear in its mass): one value a point for each place;
    `_block.block_integral`): the log of that integral over the Gaussian's is added to
    the evidence (`block_correction`). A
    Gaussian block is left as it is (to the sampling's error, `log_evidence_error`); a
    flat one gets its prior's mass instead of an Occam penalty from a curvature that is
    the objective's roughness (docs/subhalo.md).

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
    in_block, block_bounds = _block_indices(param, model, block, smoothing)
    if (block_anchors or block_response is not None) and not in_block:
        raise ValueError("laplace_evidence: block_anchors and block_response need a block")
    if block_response is not None and not block_anchors:
        raise ValueError("laplace_evidence: block_response needs block_anchors (its lines' ends)")
    if in_block and not (isinstance(block_samples, int) and block_samples >= 2):
        raise ValueError(
            f"laplace_evidence: block_samples must be an integer >= 2, got {block_samples!r}"
        )
    norm = jnp.asarray(_log_norm(param, model))
    raw = param.to_raw(model)
    z, unravel = ravel_pytree(raw)
    names = param.paths(model)
    known = _start_errors(smoothing_start, names) if smoothed else {}
    rows = [i for i, n in enumerate(names) if n not in known] if known else None
    f, g, h = _parts(objective, param, model, z, unravel, norm, rows)
    if known:
        # the smoothing's first steps (its only use of `h`) from the errors given, the
        # gradient's differences for the other parameters
        h = np.diag([1.0 / known[n] ** 2 if n in known else h[i, i] for i, n in enumerate(names)])
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
    corrected = None
    if in_block:
        # (the Hessian the approximation integrated: its eigenvalues' magnitudes, floored)
        at = values or _batch_values(objective, param, model, unravel, norm, backend)[0]
        zz = np.asarray(z, np.float64)
        anchors = [np.asarray(ravel_pytree(param.to_raw(a))[0]) for a in block_anchors]
        response = None
        if block_response is not None:
            response = _block_response(block_response, block_bounds, zz[in_block])
        corrected = block_integral(
            at,
            zz,
            (v * w[None, :]) @ v.T,
            in_block,
            block_samples,
            anchors=anchors,
            response=response,
        )
        log_e += corrected.log_ratio
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
        log_evidence_error=math.nan if corrected is None else corrected.error,
        effective_samples=math.nan if corrected is None else corrected.effective,
        block_correction=math.nan if corrected is None else corrected.log_ratio,
    )
