"""A fit's covariance: the Laplace approximation at the optimum (`_covariance`), over a
subset of the parameters (`with_conditional_covariance`), or from the curvature of the
objective's values over 1-sigma steps where the autodiff Hessian is not positive definite
(`with_smoothed_covariance`)."""

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree
from jaxtyping import Array, PyTree

from ..objective import Objective, Parametrisation
from ..objective._params import Bounds, Where
from ._parametrise import parametrisation
from ._result import RESULTS, FitResult
from ._unconstrained import batch_values, gradient_hessian


def _covariance(objective: Objective, param: Parametrisation, model, least_squares: bool):
    flat, unravel = ravel_pytree(param.values(model))
    if flat.shape[0] == 0:
        return jnp.zeros((0, 0), flat.dtype), jnp.array(True)

    def at(p):
        return param.with_values(unravel(p), model)

    if least_squares:
        jac = jax.jacfwd(lambda p: objective.residuals(at(p)))(flat)
        hess = jac.T @ jac
    else:
        hess = jax.hessian(lambda p: objective(at(p)))(flat)
    hess = 0.5 * (hess + hess.T)
    # Jacobi scaling, then an eigendecomposition: robust to parameters of different units
    d = jnp.sqrt(jnp.abs(jnp.diagonal(hess)))
    s = jnp.where(d > 0, 1.0 / jnp.where(d > 0, d, 1.0), 0.0)
    w, v = jnp.linalg.eigh(hess * s[:, None] * s[None, :])
    eps = jnp.finfo(hess.dtype).eps
    ok = (jnp.min(w) > 100 * eps * jnp.max(jnp.abs(w))) & jnp.all(d > 0)
    cov = (v / jnp.where(w > 0, w, jnp.nan)[None, :]) @ v.T * s[:, None] * s[None, :]
    cov = 0.5 * (cov + cov.T)
    return cov, ok


@eqx.filter_jit
def _covariance_jit(objective: Objective, param: Parametrisation, model):
    return _covariance(objective, param, model, objective.least_squares)


def with_conditional_covariance(
    result: FitResult,
    objective: Objective,
    free: PyTree[bool] | Callable[[Any], bool],
    *,
    bounds: Mapping[Where, Bounds] | None = None,
) -> FitResult:
    """`result` itself, unless its status is `RESULTS.covariance_failed` (the Hessian over
    every free parameter is not positive definite: often one parameter the data leave
    unconstrained, such as a regularization hyperparameter with no effect on the
    evidence): then the covariance of the parameters `free` selects (a subset of the
    fitted ones, e.g. the mass), the others held at their fitted values, i.e. the inverse
    of the Hessian restricted to them. When that one is positive definite, the result
    becomes successful with those errors, `NaN` for the held parameters, and a note that
    says so; otherwise it is returned unchanged.

    `objective` and `bounds` are those of the fit that gave `result`."""
    if not bool(result.result == RESULTS.covariance_failed):
        return result
    param = parametrisation(objective, result.model, free, bounds, check=False)
    kept = _kept(result, param, "with_conditional_covariance")
    if not kept:
        return result
    cov, ok = _covariance_jit(objective, param, result.model)
    if not bool(ok):
        return result
    held = [n for n in result.names if n not in set(kept)]
    note = (
        "the Hessian over every fitted parameter is not positive definite: errors of the "
        "others with " + ", ".join(held) + " held at their fitted values (no error)"
    )
    return _with_errors(result, kept, np.asarray(cov), note)


def _kept(result: FitResult, param: Parametrisation, caller: str) -> tuple[str, ...]:
    kept = param.paths(result.model)
    if not set(kept) <= set(result.names):
        raise ValueError(
            f"{caller}: `free` must select fitted parameters only, got "
            f"{sorted(set(kept) - set(result.names))}"
        )
    return kept


def _with_errors(result: FitResult, kept, cov: np.ndarray, note: str) -> FitResult:
    """`result`, successful, with the covariance `cov` of the parameters `kept` (NaN for
    the others) and `note` added."""
    index = {n: i for i, n in enumerate(result.names)}
    full = np.full((result.n_free, result.n_free), np.nan)
    rows = [index[n] for n in kept]
    full[np.ix_(rows, rows)] = cov
    return dataclasses.replace(
        result,
        covariance=jnp.asarray(full, dtype=result.covariance.dtype),
        result=RESULTS.successful,
        notes=(*result.notes, note),
    )


#: `with_smoothed_covariance`'s step, in units of each parameter's 1-sigma error, and the
#: most rounds it takes to make the steps and the errors agree (to 10%).
SMOOTHING_STEP = 1.0


SMOOTHING_ROUNDS = 6

#: the most times the smoothed curvature's step is doubled when the values over the
#: current steps do not give a positive-definite Hessian (so at most 4 sigma): an
#: objective whose roughness on the scale of the errors outweighs its curvature there
#: (measured on a pixelized source's evidence with the brightness-adaptive mesh, whose
#: 1-sigma Hessian had one negative eigenvalue and whose 2-sigma one had none)
SMOOTHING_WIDENINGS = 2

#: A parameter whose steps a widening doubles: its share (the squared component, summed)
#: of the eigenvectors of the round's Hessian (in units of the steps) whose eigenvalues
#: are not positive is at least this, or at least half the largest parameter's share
SMOOTHING_INVOLVED = 0.1


def _value_hessian(
    f: Callable[[Array], Array],
    z0: Array,
    h: np.ndarray,
    values: Callable[[Array], np.ndarray] | None = None,
    previous: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The Hessian of `f` at `z0` by central differences of its values with steps `h`
    (`values(points)`, if given, evaluates `f` at the rows of `points` instead of
    `jax.lax.map`, e.g. with a program compiled once for many calls):
    `(f(+i) - 2 f0 + f(-i)) / h_i^2` on the diagonal, `(f(+i+j) - f(+i-j) - f(-i+j) +
    f(-i-j)) / (4 h_i h_j)` off it; exact for a quadratic whatever the step.

    `previous`, an earlier call's steps and values at the same `z0`: the points whose
    steps are the same (the centre, each diagonal entry's and each pair's whose steps
    did not change) take its values instead of being evaluated again, so a widening of
    some steps evaluates only the points that involve them (the same points, the same
    values). Returns the Hessian and the values at every point (`previous` for a later
    call)."""
    n = z0.shape[0]
    steps = np.diag(h)
    points = [np.zeros(n)]
    uses: list[tuple[int, ...]] = [()]
    for i in range(n):
        points += [steps[i], -steps[i]]
        uses += [(i,), (i,)]
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    for i, j in pairs:
        points += [steps[i] + steps[j], steps[i] - steps[j], steps[j] - steps[i]]
        points += [-steps[i] - steps[j]]
        uses += [(i, j)] * 4
    v = np.empty(len(points))
    need = np.ones(len(points), dtype=bool)
    if previous is not None:
        h_prev, v_prev = previous
        same = np.asarray(h_prev) == np.asarray(h)
        need = np.array([not all(same[k] for k in u) for u in uses])
        v[~need] = v_prev[~need]
    if need.any():
        at = z0[None, :] + jnp.asarray(np.stack(points)[need], dtype=z0.dtype)
        v[need] = np.asarray(jax.lax.map(f, at) if values is None else values(at), np.float64)
    hess = np.empty((n, n))
    # a step into a region where the objective is not finite (an invalid inversion) gives
    # NaN entries, which `_inverse_pd` refuses: no warning for inf - inf
    with np.errstate(invalid="ignore", over="ignore"):
        for i in range(n):
            hess[i, i] = (v[1 + 2 * i] - 2 * v[0] + v[2 + 2 * i]) / h[i] ** 2
        base = 1 + 2 * n
        for k, (i, j) in enumerate(pairs):
            a, b, c, d = v[base + 4 * k : base + 4 * k + 4]
            hess[i, j] = hess[j, i] = (a - b - c + d) / (4 * h[i] * h[j])
    return hess, v


def _inverse_pd(hess: np.ndarray) -> np.ndarray | None:
    """The inverse of a symmetric positive-definite `hess` (Jacobi-scaled eigendecomposition,
    as `_covariance`), or None when it is not positive definite."""
    d = np.sqrt(np.abs(np.diagonal(hess)))
    if not np.all(d > 0) or not np.all(np.isfinite(hess)):
        return None
    w, v = np.linalg.eigh(hess / d[:, None] / d[None, :])
    if not w.min() > 100 * np.finfo(float).eps * np.abs(w).max():
        return None
    cov = (v / w[None, :]) @ v.T / d[:, None] / d[None, :]
    return 0.5 * (cov + cov.T)


def _indefinite_parameters(hess: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """Which parameters carry the directions along which `hess` is not positive definite:
    each parameter's share of the eigenvectors of `hess` in units of the `steps` whose
    eigenvalues are not positive (`_inverse_pd`'s tolerance), at least `SMOOTHING_INVOLVED`
    or half the largest share. Every parameter where `hess` is not finite."""
    if not np.all(np.isfinite(hess)):
        return np.ones(hess.shape[0], dtype=bool)
    scaled = hess * steps[:, None] * steps[None, :]
    w, v = np.linalg.eigh(0.5 * (scaled + scaled.T))
    bad = ~(w > 100 * np.finfo(float).eps * np.abs(w).max())
    share = np.sum(v[:, bad] ** 2, axis=1)
    return share >= min(SMOOTHING_INVOLVED, 0.5 * float(share.max()))


def smoothed_value_hessian(
    f: Callable[[Array], Array],
    z0: Array,
    curvature: np.ndarray,
    *,
    step: float = SMOOTHING_STEP,
    rounds: int = SMOOTHING_ROUNDS,
    values: Callable[[Array], np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """The Hessian of `f` at `z0` from central differences of its values over steps of
    `step` times the 1-sigma errors (`_value_hessian`): first those of the Hessian's
    diagonal estimate `curvature` (its magnitudes; 1e-3 where it is 0), then the errors
    each round's covariance gives, until the steps change by less than 10% or `rounds`
    rounds. A round whose Hessian is not positive definite doubles the steps of the
    parameters along whose directions it is not (`_indefinite_parameters`; at most
    `SMOOTHING_WIDENINGS` such rounds) and is taken again: the curvature of the objective
    smoothed over a wider region there, where its roughness below the errors weighs less.
    The other parameters keep their 1-sigma steps: a direction the data leave flat (a
    subhalo too light to matter, whose position the likelihood does not see) does not
    widen the smoothing of the parameters the data do constrain, whose curvature then
    stays that of the same scale as in a model without that direction (over 4-sigma
    steps, a Jackpot cell's mass parameters' log-determinant was 5 lower than over 1-sigma
    steps: 5 more log-evidence for that cell against the smooth model, docs/subhalo.md).
    The round after a widening evaluates only the points that involve a widened
    parameter, the others' values being the round before's (the same points), and every
    round takes the centre's value from the first: the same Hessian, fewer values.

    Returns the last round's Hessian, its inverse (`None` when that Hessian is not
    positive definite) and each parameter's step used, in sigma."""
    diag = np.abs(np.asarray(curvature, np.float64))
    sigma = np.where(diag > 0, 1.0 / np.sqrt(np.where(diag > 0, diag, 1.0)), 1e-3)
    scale = np.full(sigma.shape, float(step))
    widened, taken = 0, 0
    steps = scale * sigma
    hess, cov = None, None
    # `rounds` positive-definite rounds at most, each not positive-definite one taken
    # again with the steps of the parameters it involves doubled (at most
    # `SMOOTHING_WIDENINGS` such rounds in all)
    done: tuple[np.ndarray, np.ndarray] | None = None
    while True:
        # after a widening, the points whose steps it kept are not evaluated again
        hess, v = _value_hessian(f, z0, steps, values, done)
        done = (steps, v)
        cov = _inverse_pd(hess)
        if cov is None:
            if widened == SMOOTHING_WIDENINGS:
                break
            wider = np.where(_indefinite_parameters(hess, steps), 2.0, 1.0)
            widened, scale, steps = widened + 1, wider * scale, wider * steps
            continue
        taken += 1
        steps, previous = scale * np.sqrt(np.diagonal(cov)), steps
        if taken >= max(int(rounds), 1) or np.all(np.abs(steps / previous - 1) < 0.1):
            break
    assert hess is not None
    return hess, cov, scale


def steps_text(scale: np.ndarray, names: Sequence[str]) -> str:
    """The smoothed curvature's steps (`smoothed_value_hessian`'s, in sigma, one a
    parameter of `names`) in words: "1-sigma steps", or "1-sigma steps (4 sigma for a,
    b)" where a widening doubled some."""
    scale = np.asarray(scale, np.float64)
    base = float(np.min(scale))
    text = f"{base:g}-sigma steps"
    wider = sorted({float(v) for v in scale if v != base})
    if wider:
        parts = [
            f"{w:g} sigma for " + ", ".join(n for n, v in zip(names, scale, strict=True) if v == w)
            for w in wider
        ]
        text += " (" + "; ".join(parts) + ")"
    return text


def with_smoothed_covariance(
    result: FitResult,
    objective: Objective,
    free: PyTree[bool] | Callable[[Any], bool],
    *,
    bounds: Mapping[Where, Bounds] | None = None,
    step: float = SMOOTHING_STEP,
) -> FitResult:
    """`result` itself, unless its status is `RESULTS.covariance_failed`: then the
    covariance of the parameters `free` selects (all or some of the fitted ones; the
    others held at their fitted values, `NaN` errors) from the curvature of the
    objective's values on the scale of the errors, when that is positive definite.

    For objectives that are rough on scales below their errors: the log-evidence of a
    pixelized source changes its mapping whenever a traced image pixel crosses a cell of
    the mesh (and an adaptive mesh moves its nodes with the mass), so it is smooth only
    piecewise, and its autodiff Hessian, the curvature of one piece, can be indefinite at
    a minimum that the values show plainly. Here the Hessian comes from central
    differences of the values (unconstrained parametrisation, `2 n^2 + 1` evaluations for
    `n` parameters; the Numba backend's where it evaluates the objective on a CPU) with a
    step of `step` times each parameter's 1-sigma error: first estimated from the
    diagonal of the central differences of its gradient, then from the errors so found, until
    the steps change by less than 10% (at most `SMOOTHING_ROUNDS` rounds;
    `smoothed_value_hessian`). The Laplace approximation this gives is that of the
    objective smoothed over its 1-sigma region, which is what the errors describe. When
    the values over those steps do not give a positive-definite Hessian (the roughness
    outweighs the curvature on that scale), the steps of the parameters along the
    directions where it is not are doubled, at most `SMOOTHING_WIDENINGS` times; the note
    says which steps were used.

    `objective` and `bounds` are those of the fit that gave `result`."""
    if not bool(result.result == RESULTS.covariance_failed):
        return result
    if not step > 0:
        raise ValueError(f"step must be > 0 (in units of 1 sigma), got {step}")
    model = result.model
    param = parametrisation(objective, model, free, bounds, check=False)
    kept = _kept(result, param, "with_smoothed_covariance")
    if not kept:
        return result
    raw0, unravel = ravel_pytree(param.to_raw(model))

    def value(z):
        return objective(param.to_model(unravel(z), model))

    # the first steps from the central differences of the gradient (2k gradients: the
    # autodiff Hessian of a pixelized evidence costs 20 times more), the values from the
    # Numba backend where it evaluates the objective on a CPU (`batch_values`)
    zero = jnp.zeros((), raw0.dtype)
    _, _, h0 = gradient_hessian(objective, param, model, raw0, unravel, zero, prior=False)
    values, _ = batch_values(objective, param, model, unravel, zero, "auto", prior=False)
    _, cov, scale = smoothed_value_hessian(
        jax.jit(value), raw0, np.diagonal(h0), step=step, values=values
    )
    if cov is None:
        return result
    # from the unconstrained parametrisation to the physical values: J cov J^T
    jac = np.asarray(
        jax.jacfwd(lambda z: ravel_pytree(param.values(param.to_model(unravel(z), model)))[0])(raw0)
    )
    cov = jac @ cov @ jac.T
    held = [n for n in result.names if n not in set(kept)]
    note = (
        "the autodiff Hessian is not positive definite (the objective is rough on scales "
        "below its errors): errors from the curvature of its values over "
        f"{steps_text(scale, kept)} (central differences)"
    )
    if held:
        note += ", with " + ", ".join(held) + " held at their fitted values (no error)"
    return _with_errors(result, kept, cov, note)
