"""`fit`: minimise an objective over the free parameters of a model, on device."""

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optimistix as optx
from jax.flatten_util import ravel_pytree
from jaxtyping import Array, Float, PyTree

from .._checks import is_traced
from .._resources import check_memory_maps
from ..objective import Objective, Parametrisation
from ..objective._params import Bounds, Where
from ._covariance import _covariance
from ._parametrise import parametrisation
from ._result import RESULTS, FitResult
from ._solvers import (
    IMPLICIT,
    SolverLike,
    _close_bar,
    _default_tol,
    _open_bar,
    _OptaxMinimiser,
    _progress,
    _resolve,
    _WatchedLeastSquares,
    _WatchedMinimiser,
    _where,
)


@eqx.filter_jit
@eqx.debug.assert_max_traces(max_traces=None)
def _fit_core(kind, solver, objective, param, template, raw0, limits, progress, how, scale=None):
    # `limits` (max_steps, rtol, atol, the plateau rule's steps and tolerance) and the
    # progress bar's period and id are arrays: changing them does not compile the fit
    # again. `how`: optimistix's `adjoint` and `options`, and whether to compute the
    # covariance. `scale`: None, or the flat array of `fit`'s `scale` (the solver then
    # iterates on the parameters in those units).
    adjoint, options, covariance, static_steps = how
    max_steps, rtol, atol, plateau_steps, plateau_tol = limits
    z0, unravel = ravel_pytree(raw0)
    # Minimisers see (objective - reference) / n_data: the same minimum, with a gradient and
    # a value of order one (0.5 reduced chi2 for Gaussian data), which suits their unit
    # initial Hessian and their relative stopping rules. The reference is the normalisation
    # constant of a least-squares objective, else the value at the start.
    n_scale = max(objective.n_data, 1)
    if scale is None:
        unit = None
    elif kind == "least_squares":
        unit = scale  # J^T J in units of the errors: about the identity
    else:
        unit = scale * math.sqrt(n_scale)  # the Hessian of the value below: about the identity

    # with a scale the solver iterates on the offset from the start in those units, so the
    # start is z0 itself (z0 / unit * unit can be an ulp away)
    def model_at(y, tmpl):
        return param.to_model(unravel(y if unit is None else z0 + y * unit), tmpl)

    y0 = z0 if unit is None else jnp.zeros_like(z0)
    if objective.least_squares:
        ref = objective.constant()
    else:
        ref = jax.lax.stop_gradient(objective(model_at(y0, template)))

    def residuals(z, args):
        obj, tmpl, _ = args
        return obj.residuals(model_at(z, tmpl))

    def value(z, args):
        obj, tmpl, r = args
        return (obj(model_at(z, tmpl)) - r) / n_scale

    if kind == "optax":
        solver = _OptaxMinimiser(optim=solver, rtol=rtol, atol=atol)
    # optimistix's own step limit is static (another value would compile the fit again),
    # so `_Watched` counts the steps; only a checkpointed adjoint needs the static one
    # (pyright takes the solvers' abstract rtol/atol/norm for fields: `_Watched` gives
    # them as properties, as optimistix's own wrappers do)
    entry: Callable[..., Any]
    # (the plateau rule's tolerance is the objective's: a least-squares solver's value is
    # half the squared residuals, the objective less its constant; a minimiser's is `value`)
    watch = dict(max_steps=max_steps, progress=progress, plateau_steps=plateau_steps)
    if kind == "least_squares":
        entry, fn = optx.least_squares, residuals
        watched = _WatchedLeastSquares(solver=solver, plateau_tol=plateau_tol, **watch)  # pyright: ignore[reportCallIssue]
    else:
        entry, fn = optx.minimise, value
        watched = _WatchedMinimiser(solver=solver, plateau_tol=plateau_tol / n_scale, **watch)  # pyright: ignore[reportCallIssue]
    args = (objective, template, ref)
    sol = entry(
        fn, watched, y0, args, options, max_steps=static_steps, adjoint=adjoint, throw=False
    )
    res = RESULTS.promote(sol.result)
    best = objective.complete(model_at(sol.value, template))
    values = objective.values(best)
    total = jnp.sum(objective.weights * values)
    # finite parameters can still give a non-finite objective (a singular linear solve)
    res = _where(jnp.isfinite(total), res, RESULTS.nonfinite)
    if covariance:
        cov, ok = _covariance(objective, param, best, objective.least_squares)
        res = _where((res == RESULTS.successful) & jnp.invert(ok), RESULTS.covariance_failed, res)
    else:
        cov = jnp.full((z0.shape[0], z0.shape[0]), jnp.nan, z0.dtype)
    return best, total, values, objective.chi2(best), sol.stats["num_steps"], res, cov


def _limits(
    raw0, max_steps: int, rtol: float, atol: float, plateau: tuple[int, float] | None = None
) -> tuple[Array, Array, Array, Array, Array]:
    """`max_steps`, `rtol`, `atol` and `plateau`'s steps (0: none) and tolerance as arrays
    (the tolerances in the parameters' dtype); `plateau` checked."""
    if int(max_steps) < 0:
        raise ValueError(f"max_steps must be >= 0, got {max_steps}")
    steps, tol = (0, 0.0) if plateau is None else _plateau(plateau)
    dtype = jnp.result_type(*jtu.tree_leaves(raw0))
    return (
        jnp.asarray(int(max_steps)),
        jnp.asarray(rtol, dtype),
        jnp.asarray(atol, dtype),
        jnp.asarray(steps),
        jnp.asarray(tol, dtype),
    )


def _plateau(plateau: Any) -> tuple[int, float]:
    """`fit`'s `plateau` checked: `(steps >= 1, tolerance > 0)`."""
    try:
        steps, tol = plateau
    except (TypeError, ValueError):
        raise ValueError(f"plateau must be (steps, tolerance), got {plateau!r}") from None
    if isinstance(steps, bool) or not isinstance(steps, int | np.integer) or steps < 1:
        raise ValueError(f"plateau's steps must be an integer >= 1, got {steps!r}")
    try:
        value = float(tol)
    except (TypeError, ValueError):
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"plateau's tolerance must be > 0 (the objective's units), got {tol!r}")
    return int(steps), value


def _prepare(objective, model, solver, free, bounds, max_steps, rtol, atol, plateau=None):
    if not isinstance(objective, Objective):
        raise TypeError(f"objective must be an equilens Objective, got {type(objective)}")
    kind, solver_obj, name = _resolve(solver, objective, rtol, atol, max_steps)
    if plateau is not None and kind == "optax":
        raise ValueError(
            f"plateau needs a solver whose accepted steps lower the objective (optimistix's "
            f"minimisers and least-squares solvers), not the optax loop ({name})"
        )
    param = parametrisation(objective, model, free, bounds)
    if param.n_free == 0:
        raise ValueError("no free parameters: `free` selects no floating-point leaf")
    return kind, solver_obj, name, param


def _strong(tree: PyTree[Any]) -> PyTree[Any]:
    """`tree` with its weakly typed array leaves (Python numbers given to a constructor,
    `equilens._custom_types.as_float`) made strong, in the same dtype: the same values, and
    a fit from a model built of numbers shares its compiled program with a fit from a fitted
    model (whose leaves are strong), as the pipeline's stages do."""

    def strong(x):
        return x.astype(x.dtype) if getattr(x, "weak_type", False) else x

    return jtu.tree_map(strong, tree)


def _n_linear(objective: Objective, model) -> int:
    from .._lens_system import LensSystem
    from .._multiband import MultiBandLensSystem

    if not objective.solves_linear():
        return 0
    if isinstance(model, LensSystem):
        return int(model.amplitudes().shape[0])
    if isinstance(model, MultiBandLensSystem):
        return sum(int(s.amplitudes().shape[0]) for s in model.bands())
    return 0


def fit(
    objective: Objective,
    model: PyTree[Any],
    solver: SolverLike = "lm",
    *,
    free: PyTree[bool] | Callable[[Any], bool] | None = None,
    bounds: Mapping[Where, Bounds] | None = None,
    max_steps: int = 500,
    rtol: float | None = None,
    atol: float | None = None,
    plateau: tuple[int, float] | None = None,
    throw: bool = True,
    progress: bool = False,
    covariance: bool = True,
    adjoint: optx.AbstractAdjoint = IMPLICIT,
    options: dict[str, Any] | None = None,
    scale: Float[np.ndarray, " n"] | Float[Array, " n"] | Sequence[float] | None = None,
) -> FitResult:
    """Fits `model` by minimising `objective` over its free parameters, on device.

    **Arguments:**

    - `objective`: an `Objective` (weighted sum of terms).
    - `model`: the starting model (e.g. a `LensSystem`); its structure is kept.
    - `solver`: a name from `SOLVER_NAMES` ("lm" (default), "bfgs", "nonlinear-cg",
      "adam", "lbfgs"), an optimistix least-squares solver (needs an objective whose
      terms all have whitened residuals) or minimiser, or an optax transformation.
    - `free`: which leaves vary: None (all floating-point leaves but the fields a class
      lists in `fixed`), a boolean pytree shaped like `model` (`equilens.select`), or a
      predicate on leaves. Amplitudes the objective solves linearly are never free: they
      are solved at every evaluation (`GaussianLikelihood(..., linear=False)` fits them).
    - `bounds`: `{where: (lower, upper)}` overriding the default bounds of the profile
      classes (and of `UniformPrior` terms); parameters are reparametrised to stay inside.
    - `max_steps`: solver steps at most (another value reuses the compiled fit); `rtol`,
      `atol`: tolerances of named solvers (and of the optax loop's stopping rule: the
      objective changes by less than `atol + rtol |f|` for 10 steps in a row); default
      1e-6 in float64, 1e-3 in float32.
    - `plateau`: None, or `(steps, tolerance)`: the fit also stops (converged) when the
      objective at the solver's accepted point has fallen by less than `tolerance` (the
      objective's units: a log-likelihood or log-evidence) over its last `steps` steps. For
      objectives rough on small scales (a pixelized source's evidence), where a
      quasi-Newton solver keeps taking tiny steps for tiny gains long after the tolerances
      above would stop it on a smooth one; unlike a looser `atol`, one short step (a line
      search's backtracking far from the minimum) does not stop the fit. Only the solver's
      accepted steps count; refused for the optax loop (`"adam"`, `"lbfgs"`, an optax
      transformation), whose steps need not lower the objective.
    - `throw`: raise if the fit fails (else read `result.result`): a `RuntimeError` with
      the reason, or, when `fit` is called inside a JAX transformation, an error from the
      device as with optimistix's `throw`.
    - `progress`: show a progress bar (tqdm) updated every few steps from the device loop.
    - `covariance`: compute the covariance at the optimum (a Hessian or Jacobian: the
      costliest part of a fit with few steps); False gives a NaN matrix and no
      `RESULTS.covariance_failed` (the pipelines' intermediate stages).
    - `adjoint`, `options`: optimistix's. The solve is `optimistix.least_squares` (for
      least-squares solvers) or `optimistix.minimise`, so `adjoint` says how to
      differentiate through the fit: the default `optimistix.ImplicitAdjoint()` gives the
      gradients of the fitted model with respect to the data or any other array of the
      objective or of the model's fixed parameters by the implicit function theorem
      (`jax.grad` of a function that calls `fit(..., throw=False)`; the fit must have
      converged). `options` go to the solver.
    - `scale`: None, or the expected 1-sigma size of each free parameter's change in the
      fit's unconstrained coordinates (positive, one per free scalar, ordered as the
      result's `names`; e.g. `LaplaceEvidence.raw_errors` of an earlier fit of a like
      model): the solver then iterates on the parameters in those units, where the
      Hessian is about the identity, as a quasi-Newton solver's first guess is (a
      preconditioner: the same minimum, fewer steps when the parameters' errors differ by
      orders of magnitude). The model a fit starts from and returns are unchanged.

    Any optimistix solver works, wrappers included: the solver's `postprocess` gives the
    result (`optimistix.BestSoFarMinimiser(optimistix.BFGS(...))` returns the best point
    it saw). A step the solver rejects 20 times in a row ends the fit as converged (no
    decrease left at the working precision: float32's trust regions can shrink forever);
    64 times before the first accepted step (a quasi-Newton solver's first line search
    halves its step from the gradient's size down to the objective's scale).

    **Returns:** a `FitResult`. A fit that converged to an implausible model (a parameter
    at a bound, a source larger than the data, an Einstein radius beyond the data or under
    two pixels: `equilens.solve.implausible_notes`) has the status `RESULTS.implausible`
    and says why in `notes`: a local minimum, not a success.

    Raises `ValueError` for an incompatible combination (Levenberg-Marquardt with a term
    that has no residuals, no free parameter, a start outside the bounds), naming the
    reason.
    """
    t0 = time.perf_counter()
    check_memory_maps()
    model = _strong(model)
    rtol, atol = _default_tol(rtol), _default_tol(atol)
    kind, solver_obj, name, param = _prepare(
        objective, model, solver, free, bounds, max_steps, rtol, atol, plateau
    )
    raw0 = param.to_raw(model)
    limits = _limits(raw0, max_steps, rtol, atol, plateau)
    how = _how(adjoint, options, covariance, max_steps)
    unit = _scale(scale, raw0)
    traced = any(is_traced(x) for x in jtu.tree_leaves((objective, model)))
    bar_id, every = _open_bar(progress and not traced, max_steps, name)
    try:
        out = _fit_core(
            kind,
            solver_obj,
            objective,
            param,
            model,
            raw0,
            limits,
            _progress(every, bar_id),
            how,
            unit,
        )
        if not traced:
            jax.block_until_ready(out)
    finally:
        _close_bar(bar_id)
    result = _result(out, objective, param, model, name, t0)
    if traced:
        # inside a transformation: no host-side plausibility notes, and failures are
        # raised from the device, as optimistix's `throw` does
        if throw:
            bad = result.result != RESULTS.successful
            result = eqx.tree_at(
                lambda r: r.value, result, result.result.error_if(result.value, bad)
            )
        return result
    from ._plausible import implausible_notes, with_plausibility

    result = with_plausibility(
        result, implausible_notes(objective, result.model, free=free, bounds=bounds)
    )
    if throw:
        _raise_if_failed(result)
    return result


def _scale(scale: Any, raw0: PyTree[Any]) -> Array | None:
    """`fit`'s `scale` checked (one positive finite value per free scalar) as an array in
    the parameters' dtype, or None."""
    if scale is None:
        return None
    z0, _ = ravel_pytree(raw0)
    s = np.asarray(scale, np.float64)
    if s.shape != z0.shape:
        raise ValueError(
            f"scale must hold one value per free scalar (shape ({z0.shape[0]},), ordered as "
            f"the result's names), got shape {s.shape}"
        )
    if not np.all(np.isfinite(s) & (s > 0)):
        raise ValueError(f"scale must be positive and finite, got {s}")
    return jnp.asarray(s, z0.dtype)


def _how(adjoint: Any, options: dict[str, Any] | None, covariance: bool, max_steps: int):
    """`_fit_core`'s static choices: the adjoint, the options, whether to compute the
    covariance, and optimistix's own step limit (None: `_Watched` counts the steps; a
    checkpointed adjoint needs it)."""
    if not isinstance(adjoint, optx.AbstractAdjoint):
        raise TypeError(f"adjoint must be an optimistix adjoint, got {type(adjoint).__name__}")
    if options is not None and not isinstance(options, dict):
        raise TypeError(f"options must be a dict, got {type(options).__name__}")
    checkpointed = isinstance(adjoint, optx.RecursiveCheckpointAdjoint)
    return adjoint, options, bool(covariance), int(max_steps) if checkpointed else None


def _result(out, objective: Objective, param: Parametrisation, model, name: str, t0: float):
    """A `FitResult` from `_fit_core`'s outputs (batched or not)."""
    best, value, values, chi2, steps, res, cov = out
    return FitResult(
        model=best,
        value=value,
        term_values=values,
        chi2=chi2,
        num_steps=steps,
        result=res,
        covariance=cov,
        names=param.paths(model),
        n_data=objective.n_data,
        n_linear=_n_linear(objective, model),
        solver=name,
        wall_time=jnp.full(jnp.shape(value), time.perf_counter() - t0),
    )


def _raise_if_failed(result: FitResult) -> None:
    if not result.success:
        raise RuntimeError(f"fit failed: {result.message()} (pass throw=False to inspect)")
