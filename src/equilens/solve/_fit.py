"""`fit`: minimise an objective over the free parameters of a model, on device."""

import dataclasses
import functools
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
import optimistix as optx
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh
from jaxtyping import Array, PRNGKeyArray, PyTree

from .._checks import is_traced
from .._resources import check_memory_maps
from .._sharding import check_mesh, lapack_batches_deadlock, replicate, shard, split_grids
from ..objective import Objective, Parametrisation
from ..objective._params import Bounds, Where
from ..terms import UniformPrior
from ._parametrise import parametrisation
from ._result import RESULTS, FitResult

SolverLike = (
    str | optx.AbstractLeastSquaresSolver | optx.AbstractMinimiser | optax.GradientTransformation
)
Kind = Literal["least_squares", "minimise", "optax"]
#: How `fit_batch` solves a batch (`batch_route`).
BatchRoute = Literal["auto", "vmap", "loop"]

#: Solver names accepted by `fit` and what they stand for.
SOLVER_NAMES = {
    "lm": "optimistix.LevenbergMarquardt(rtol, atol) on the whitened residuals",
    "bfgs": "optimistix.BFGS(rtol, atol) on the objective",
    "nonlinear-cg": "optimistix.NonlinearCG(rtol, atol) on the objective",
    "adam": "optax.adam, learning rate 1e-2 cosine-decayed to 1e-5 over max_steps",
    "lbfgs": "optax.lbfgs with its zoom line search (strong Wolfe conditions)",
}


@functools.lru_cache(maxsize=64)
def _named_solver(name: str, rtol: float, atol: float, max_steps: int) -> Any:
    # cached, so that repeated fits reuse one solver object and one compilation
    if name == "lm":
        return optx.LevenbergMarquardt(rtol=rtol, atol=atol)
    if name == "bfgs":
        return optx.BFGS(rtol=rtol, atol=atol)
    if name == "nonlinear-cg":
        return optx.NonlinearCG(rtol=rtol, atol=atol)
    if name == "adam":
        return optax.adam(optax.cosine_decay_schedule(1e-2, max(max_steps, 1), alpha=1e-3))
    if name == "lbfgs":
        # A backtracking (Armijo-only) search does not enforce the curvature condition that
        # keeps the L-BFGS update positive definite; on lens fits it stalls far from the
        # minimum, so the name means the strong-Wolfe zoom search.
        return optax.lbfgs()
    raise ValueError(f"unknown solver {name!r}; choose one of {sorted(SOLVER_NAMES)}")


def _resolve(
    solver: SolverLike, objective: Objective, rtol, atol, max_steps
) -> tuple[Kind, Any, str]:
    if isinstance(solver, str):
        name = solver.lower()
        obj = _named_solver(name, float(rtol), float(atol), int(max_steps))
    else:
        obj, name = solver, type(solver).__name__
    if isinstance(obj, optx.AbstractLeastSquaresSolver):
        if not objective.least_squares:
            bad = [type(t).__name__ for t in objective.terms if not t.least_squares]
            raise ValueError(
                f"{name} is a least-squares solver, but {', '.join(bad)} has no whitened "
                "residuals: use a minimiser such as solver='bfgs', 'lbfgs' or 'adam'"
            )
        return "least_squares", obj, name
    if isinstance(obj, optx.AbstractMinimiser):
        return "minimise", obj, name
    if isinstance(obj, optax.GradientTransformation):
        return "optax", optax.with_extra_args_support(obj), name
    raise TypeError(
        f"solver must be a name ({', '.join(sorted(SOLVER_NAMES))}), an optimistix "
        f"least-squares solver or minimiser, or an optax transformation; got {type(solver)}"
    )


#: `fit`'s default adjoint: gradients through a fit by the implicit function theorem.
IMPLICIT = optx.ImplicitAdjoint()


# -- progress: a host callback every few steps -------------------------------------------------

_BARS: dict[int, Any] = {}


def _progress_update(bar_id, step) -> None:
    bar = _BARS.get(int(bar_id))
    if bar is not None:
        bar.update(int(step) - bar.n)


def _report(progress: "_Progress", step) -> None:
    on, every, bar_id = progress
    if on:
        jax.lax.cond(
            step % every == 0,
            lambda: jax.debug.callback(_progress_update, bar_id, step),
            lambda: None,
        )


def _where(pred, a, b) -> RESULTS:
    """`RESULTS.where`, typed for pyright (it types the enumeration's members as literals)."""
    return RESULTS.where(pred, a, b)  # pyright: ignore[reportArgumentType]


# -- the solvers: optimistix's entry points, with the fit's own guards ----------------------


class _WatchState(eqx.Module):
    inner: Any
    steps: Array
    still: Array
    moved: Array


_STALL = 20
#: rejected steps in a row that end a fit before any step was accepted: a quasi-Newton
#: solver starts from an identity Hessian, so its first trial steps are the gradient, and a
#: steep objective (a pixelized source's evidence: gradients of 1e4-1e5) needs 20-40
#: halvings of the line search before one is accepted; 64 halvings reach any float's
#: precision
_STALL_START = 64
_PATIENCE = 10


class _Watched(eqx.Module):
    """Wraps a solver for `optx.minimise` / `optx.least_squares`: counts steps against
    `max_steps` (an array, so another value reuses the compiled fit), reports them to the
    progress bar, and stops after `_STALL` rejected steps in a row (a rejected step leaves
    `y` unchanged: no decrease can be found at this floating-point precision; in float32 a
    trust region can shrink forever): a converged fit; before the first accepted step,
    after `_STALL_START` (the first line search's halvings). Everything else, `postprocess`
    included (`optx.BestSoFarMinimiser` returns its best point), is the wrapped solver's."""

    solver: Any
    max_steps: Array
    progress: "_Progress"

    @property
    def rtol(self):
        return self.solver.rtol

    @property
    def atol(self):
        return self.solver.atol

    @property
    def norm(self):
        return self.solver.norm

    def init(self, fn, y, args, options, f_struct, aux_struct, tags):
        inner = self.solver.init(fn, y, args, options, f_struct, aux_struct, tags)
        return _WatchState(inner, jnp.array(0), jnp.array(0), jnp.array(False))

    def step(self, fn, y, args, options, state, tags):
        new_y, inner, aux = self.solver.step(fn, y, args, options, state.inner, tags)
        pairs = zip(jtu.tree_leaves(new_y), jtu.tree_leaves(y), strict=True)
        same = jnp.all(jnp.stack([jnp.all(a == b) for a, b in pairs]))
        steps = state.steps + 1
        _report(self.progress, steps)
        still = jnp.where(same, state.still + 1, 0)
        return new_y, _WatchState(inner, steps, still, state.moved | ~same), aux

    def terminate(self, fn, y, args, options, state, tags):
        done, res = self.solver.terminate(fn, y, args, options, state.inner, tags)
        done = done | (state.still >= jnp.where(state.moved, _STALL, _STALL_START))
        out = state.steps >= self.max_steps
        late = out & jnp.invert(done) & (res == optx.RESULTS.successful)
        return done | out, optx.RESULTS.where(late, optx.RESULTS.nonlinear_max_steps_reached, res)

    def postprocess(self, fn, y, aux, args, options, state, tags, result):
        return self.solver.postprocess(fn, y, aux, args, options, state.inner, tags, result)


class _WatchedMinimiser(_Watched, optx.AbstractMinimiser):  # pyright: ignore[reportIncompatibleVariableOverride]
    pass


class _WatchedLeastSquares(_Watched, optx.AbstractLeastSquaresSolver):  # pyright: ignore[reportIncompatibleVariableOverride]
    pass


class _OptaxState(eqx.Module):
    opt_state: Any
    f_prev: Array
    calm: Array
    finite: Array


class _OptaxMinimiser(optx.AbstractMinimiser):
    """An optax transformation as an optimistix minimiser, with the fit's stopping rule:
    the value changes by less than `atol + rtol |f|` for `_PATIENCE` steps in a row. The
    transformation gets optax's extra arguments (`value`, `grad`, `value_fn`), which the
    line searches of `optax.lbfgs` need."""

    optim: optax.GradientTransformationExtraArgs
    rtol: Array
    atol: Array
    norm: Callable = optx.max_norm

    def init(self, fn, y, args, options, f_struct, aux_struct, tags):
        # optax mixes integer step counts with floats: standard promotion for its internals
        with jax.numpy_dtype_promotion("standard"):
            opt_state = self.optim.init(y)
        inf = jnp.array(jnp.inf, dtype=f_struct.dtype)
        return _OptaxState(opt_state, inf, jnp.array(0), jnp.array(True))

    def step(self, fn, y, args, options, state, tags):
        (f, aux), grad = jax.value_and_grad(fn, has_aux=True)(y, args)

        def value_fn(z):
            return fn(z, args)[0]

        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = self.optim.update(
                grad, state.opt_state, y, value=f, grad=grad, value_fn=value_fn
            )
        new_y = optax.apply_updates(y, updates)
        small = jnp.abs(f - state.f_prev) <= self.atol + self.rtol * jnp.abs(f)
        calm = jnp.where(small, state.calm + 1, 0)
        return new_y, _OptaxState(opt_state, f, calm, jnp.isfinite(f)), aux

    def terminate(self, fn, y, args, options, state, tags):
        res = optx.RESULTS.where(state.finite, optx.RESULTS.successful, optx.RESULTS.nonfinite)
        return state.calm >= _PATIENCE, res

    def postprocess(self, fn, y, aux, args, options, state, tags, result):
        return y, aux, {}


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
@eqx.debug.assert_max_traces(max_traces=None)
def _fit_core(kind, solver, objective, param, template, raw0, limits, progress, how):
    # `limits` (max_steps, rtol, atol) and the progress bar's period and id are arrays:
    # changing them does not compile the fit again. `how`: optimistix's `adjoint` and
    # `options`, and whether to compute the covariance.
    adjoint, options, covariance, static_steps = how
    max_steps, rtol, atol = limits
    z0, unravel = ravel_pytree(raw0)

    def model_at(z, tmpl):
        return param.to_model(unravel(z), tmpl)

    # Minimisers see (objective - reference) / n_data: the same minimum, with a gradient and
    # a value of order one (0.5 reduced chi2 for Gaussian data), which suits their unit
    # initial Hessian and their relative stopping rules. The reference is the normalisation
    # constant of a least-squares objective, else the value at the start.
    n_scale = max(objective.n_data, 1)
    if objective.least_squares:
        ref = objective.constant()
    else:
        ref = jax.lax.stop_gradient(objective(model_at(z0, template)))

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
    if kind == "least_squares":
        entry, fn = optx.least_squares, residuals
        watched = _WatchedLeastSquares(solver=solver, max_steps=max_steps, progress=progress)  # pyright: ignore[reportCallIssue]
    else:
        entry, fn = optx.minimise, value
        watched = _WatchedMinimiser(solver=solver, max_steps=max_steps, progress=progress)  # pyright: ignore[reportCallIssue]
    args = (objective, template, ref)
    sol = entry(
        fn, watched, z0, args, options, max_steps=static_steps, adjoint=adjoint, throw=False
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


_Progress = tuple[bool, Array, Array]


def _progress(every: int, bar_id: int) -> _Progress:
    """Whether to report (static), every how many steps, and to which bar (arrays)."""
    return every > 0, jnp.asarray(max(every, 1)), jnp.asarray(bar_id)


def _limits(raw0, max_steps: int, rtol: float, atol: float) -> tuple[Array, Array, Array]:
    """`max_steps`, `rtol` and `atol` as arrays (the tolerances in the parameters' dtype)."""
    if int(max_steps) < 0:
        raise ValueError(f"max_steps must be >= 0, got {max_steps}")
    dtype = jnp.result_type(*jtu.tree_leaves(raw0))
    return jnp.asarray(int(max_steps)), jnp.asarray(rtol, dtype), jnp.asarray(atol, dtype)


def _default_tol(tol: float | None) -> float:
    # 1e-6 in float64; in float32 the objective's rounding (~1e-7 relative on a sum over
    # thousands of pixels) needs a looser rule
    if tol is not None:
        return float(tol)
    return 1e-6 if jnp.finfo(jnp.result_type(float)).bits == 64 else 1e-3


def _prepare(objective, model, solver, free, bounds, max_steps, rtol, atol):
    if not isinstance(objective, Objective):
        raise TypeError(f"objective must be an equilens Objective, got {type(objective)}")
    kind, solver_obj, name = _resolve(solver, objective, rtol, atol, max_steps)
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
    throw: bool = True,
    progress: bool = False,
    covariance: bool = True,
    adjoint: optx.AbstractAdjoint = IMPLICIT,
    options: dict[str, Any] | None = None,
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
        objective, model, solver, free, bounds, max_steps, rtol, atol
    )
    raw0 = param.to_raw(model)
    limits = _limits(raw0, max_steps, rtol, atol)
    how = _how(adjoint, options, covariance, max_steps)
    traced = any(is_traced(x) for x in jtu.tree_leaves((objective, model)))
    bar_id, every = _open_bar(progress and not traced, max_steps, name)
    try:
        out = _fit_core(
            kind, solver_obj, objective, param, model, raw0, limits, _progress(every, bar_id), how
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


def _value_hessian(f: Callable[[Array], Array], z0: Array, h: np.ndarray) -> np.ndarray:
    """The Hessian of `f` at `z0` by central differences of its values with steps `h`:
    `(f(+i) - 2 f0 + f(-i)) / h_i^2` on the diagonal, `(f(+i+j) - f(+i-j) - f(-i+j) +
    f(-i-j)) / (4 h_i h_j)` off it; exact for a quadratic whatever the step."""
    n = z0.shape[0]
    steps = np.diag(h)
    points = [np.zeros(n)]
    for i in range(n):
        points += [steps[i], -steps[i]]
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    for i, j in pairs:
        points += [steps[i] + steps[j], steps[i] - steps[j], steps[j] - steps[i]]
        points += [-steps[i] - steps[j]]
    at = z0[None, :] + jnp.asarray(np.stack(points), dtype=z0.dtype)
    v = np.asarray(jax.lax.map(f, at), dtype=np.float64)
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
    return hess


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
    `n` parameters) with a step of `step` times each parameter's 1-sigma error: first
    estimated from the autodiff Hessian's diagonal, then from the errors so found, until
    the steps change by less than 10% (at most `SMOOTHING_ROUNDS` rounds). The Laplace
    approximation this gives is that of the objective smoothed over its 1-sigma region,
    which is what the errors describe; the note says so.

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

    f = jax.jit(value)
    diag = np.abs(np.diagonal(np.asarray(jax.jit(jax.hessian(value))(raw0))))
    h = np.where(diag > 0, step / np.sqrt(np.where(diag > 0, diag, 1.0)), 1e-3)
    cov = None
    for _ in range(SMOOTHING_ROUNDS):
        cov = _inverse_pd(_value_hessian(f, raw0, h))
        if cov is None:
            return result
        h, previous = step * np.sqrt(np.diagonal(cov)), h
        if np.all(np.abs(h / previous - 1) < 0.1):
            break
    # from the unconstrained parametrisation to the physical values: J cov J^T
    jac = np.asarray(
        jax.jacfwd(lambda z: ravel_pytree(param.values(param.to_model(unravel(z), model)))[0])(raw0)
    )
    cov = jac @ cov @ jac.T
    held = [n for n in result.names if n not in set(kept)]
    note = (
        "the autodiff Hessian is not positive definite (the objective is rough on scales "
        f"below its errors): errors from the curvature of its values over {step:g}-sigma "
        "steps (central differences)"
    )
    if held:
        note += ", with " + ", ".join(held) + " held at their fitted values (no error)"
    return _with_errors(result, kept, cov, note)


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


def _open_bar(progress: bool, total: int, name: str) -> tuple[int, int]:
    if not progress:
        return -1, 0
    from tqdm.auto import tqdm

    bar_id = max(_BARS, default=0) + 1
    _BARS[bar_id] = tqdm(total=total, desc=f"fit ({name})", unit="step", leave=False)
    return bar_id, max(1, total // 100)


def _close_bar(bar_id: int) -> None:
    bar = _BARS.pop(bar_id, None)
    if bar is not None:
        bar.close()


def fit_batch(
    objective: Objective,
    models: PyTree[Any],
    solver: SolverLike = "lm",
    *,
    objective_batched: Where | None = None,
    free: PyTree[bool] | Callable[[Any], bool] | None = None,
    bounds: Mapping[Where, Bounds] | None = None,
    max_steps: int = 500,
    rtol: float | None = None,
    atol: float | None = None,
    batch_size: int | None = None,
    mesh: Mesh | None = None,
    covariance: bool = True,
    route: BatchRoute = "auto",
) -> FitResult:
    """Fits a batch of starting models (array leaves with a leading batch axis, e.g. from
    `jax.tree.map(lambda *x: jnp.stack(x), *models)`) in one `vmap`-ed solve.
    `objective_batched` (a `where` function, e.g. `lambda o: o.weights`) names the parts of
    the objective that carry the same leading axis: a hyperparameter survey over term
    weights or prior parameters.

    `batch_size` (default: the whole batch at once) solves the batch in consecutive chunks
    of that many elements, one compiled program for all chunks (the last is padded with
    copies of its last element, dropped from the result). Memory grows with the number
    of elements solved together (the Jacobian of every element is held at once: about
    9 GB for 32 starts of a 110x110 image supersampled twice), and a vmapped chunk runs
    until its slowest element stops; results are the same per element.

    `mesh` (a one-axis `jax.sharding.Mesh`, e.g. `equilens.device_mesh()`) splits the
    batch axis over its devices: each chunk (`batch_size` rounded up to a multiple of the
    device count; the whole batch by default) is padded to that multiple with copies of
    its last element, placed with `equilens.shard(..., batch=True)`, and solved as one
    partitioned program; the objective is replicated (it must not be sharded over pixels
    itself: a `ValueError` says so). With jaxlib 0.10 (Python 3.11) on several CPU
    devices, chunks hold one element per device whatever `batch_size` says: that
    jaxlib's batched LAPACK kernels deadlock when several CPU devices run them at once
    (`equilens.shard` docs); the results are the same.

    `covariance=False` skips each element's covariance (as in `fit`).

    `route` says how the batch is solved: `"vmap"` (one vectorised program per chunk, as
    above), `"loop"` (one compiled single fit, the program `fit` itself runs, called once
    per element: each element stops at its own step count, and the batch costs what the
    same number of `fit` calls cost), or `"auto"` (default): `"loop"` on a CPU, where a
    vectorised batch is slower per element than a loop (measured in
    docs/performance.md: 8 starts of a 100x100 lens, vmap 3.4x the loop), `"vmap"` on an
    accelerator or with a `mesh` (`batch_route`). `batch_size` applies to `"vmap"` alone.
    Both routes give the same fits to round-off.

    Returns a `FitResult` whose array fields have the leading batch axis; failures are
    reported per element in `result` (never raised).
    """
    t0 = time.perf_counter()
    check_memory_maps()
    models = _strong(models)
    rtol, atol = _default_tol(rtol), _default_tol(atol)
    first = _index(models, 0)
    if objective_batched is None:
        obj0, obj_axes = objective, None
    else:
        obj0 = eqx.tree_at(objective_batched, objective, replace_fn=lambda n: _index(n, 0))
        axes = jtu.tree_map(lambda _: None, objective)
        obj_axes = eqx.tree_at(
            objective_batched,
            axes,
            replace_fn=lambda n: jtu.tree_map(lambda _: 0, n, is_leaf=lambda x: x is None),
            is_leaf=lambda x: x is None,
        )
    kind, solver_obj, name, param = _prepare(
        obj0, first, solver, free, bounds, max_steps, rtol, atol
    )
    raw0 = jax.vmap(param.to_raw)(models)
    for i in range(jtu.tree_leaves(raw0)[0].shape[0]):
        param.check(_index(models, i))

    limits = _limits(_index(raw0, 0), max_steps, rtol, atol)
    how = _how(IMPLICIT, None, covariance, max_steps)

    @eqx.filter_vmap(in_axes=(obj_axes, 0, 0))
    def run(obj, tmpl, r0):
        return _fit_core(kind, solver_obj, obj, param, tmpl, r0, limits, _progress(0, -1), how)

    n = jtu.tree_leaves(raw0)[0].shape[0]
    if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"fit_batch: batch_size must be a positive integer, got {batch_size!r}")
    traced = any(is_traced(x) for x in jtu.tree_leaves((objective, models)))
    if batch_route(route, mesh) == "loop" and not traced:

        def one(i: int):
            obj_i = objective
            if objective_batched is not None:
                obj_i = eqx.tree_at(
                    objective_batched, objective, replace_fn=lambda x, i=i: _index(x, i)
                )
            out = _fit_core(
                kind,
                solver_obj,
                obj_i,
                param,
                _index(models, i),
                _index(raw0, i),
                limits,
                _progress(0, -1),
                how,
            )
            return jax.block_until_ready(out)

        # one after another: two host threads running the program side by side gained
        # 13 % on 2 cores (the demo's polishing, XLA already uses the second core)
        outs = [one(i) for i in range(n)]
        out = jtu.tree_map(lambda *xs: jnp.stack(xs) if eqx.is_array(xs[0]) else xs[0], *outs)
        return _result(out, obj0, param, first, name, t0)
    size = n if batch_size is None else min(batch_size, n)
    place = _identity
    if mesh is not None:
        if split_grids(objective):
            raise ValueError(
                "fit_batch(mesh=): the objective's pixels are already split over devices "
                "(equilens.shard); a batch is split along its batch axis: pass the "
                "objective unsharded"
            )
        n_dev = mesh.shape[check_mesh(mesh, None)]
        # one element per device where jaxlib's batched CPU LAPACK kernels deadlock
        size = n_dev if lapack_batches_deadlock(mesh) else -(-size // n_dev) * n_dev
        objective = replicate(objective, mesh)

        def place(tree):
            return shard(tree, mesh, batch=True)

    if size == n and mesh is None:
        out = run(objective, models, raw0)
    else:

        def chunk(tree, i):
            # elements i .. i + size - 1, the last element repeated past the end
            rows = np.minimum(np.arange(i, i + size), n - 1)
            return place(jtu.tree_map(lambda x: x[rows] if eqx.is_array(x) else x, tree))

        outs = []
        for i in range(0, n, size):
            obj_i = objective
            if objective_batched is not None:
                obj_i = eqx.tree_at(
                    objective_batched, objective, replace_fn=lambda x, i=i: chunk(x, i)
                )
            outs.append(run(obj_i, chunk(models, i), chunk(raw0, i)))
        out = jtu.tree_map(
            lambda *xs: jnp.concatenate(xs)[:n] if eqx.is_array(xs[0]) else xs[0], *outs
        )
    return _result(out, obj0, param, first, name, t0)


def batch_route(route: BatchRoute = "auto", mesh: Mesh | None = None) -> Literal["vmap", "loop"]:
    """How `fit_batch` (and so `multi_start`, `search` and the pipelines) solves a batch:
    `route` itself when it is `"vmap"` or `"loop"`; for `"auto"`, `"vmap"` when the batch
    is split over a `mesh` or the default device is an accelerator (a GPU or TPU runs the
    elements of a vectorised batch side by side), `"loop"` on a CPU (a vectorised batch
    there costs more per element than the same fits one after another: its linear
    algebra is batched, and every element runs until the slowest stops). Raises
    `ValueError` for another name."""
    if route not in ("auto", "vmap", "loop"):
        raise ValueError(f"route must be 'auto', 'vmap' or 'loop', got {route!r}")
    if route == "loop" and mesh is not None:
        raise ValueError("route='loop' solves on one device: a mesh needs route 'vmap' or 'auto'")
    if route != "auto":
        return route
    if mesh is not None:
        return "vmap"
    return "loop" if jax.default_backend() == "cpu" else "vmap"


def _identity(tree: PyTree[Any]) -> PyTree[Any]:
    return tree


def _index(tree: PyTree[Any], i: int) -> PyTree[Any]:
    return jtu.tree_map(lambda x: x[i] if eqx.is_array(x) else x, tree)


def pick(batch: FitResult, index: int) -> FitResult:
    """Element `index` of a batched `FitResult` (from `fit_batch` or `multi_start`)."""
    return _index(batch, index)


class MultiStart(eqx.Module):
    """The outcome of `multi_start`: `best` (the successful start with the lowest
    objective) and `starts` (every start's `FitResult`, batched along a leading axis)."""

    best: FitResult
    starts: FitResult
    best_index: int = eqx.field(static=True)


def sample_starts(
    key: PRNGKeyArray, objective: Objective, model: PyTree[Any], n: int
) -> PyTree[Any]:
    """`n` starting models (leaves stacked on a leading axis): every parameter with a
    `GaussianPrior` or `UniformPrior` term in `objective` drawn from it, the rest as in
    `model`."""
    from ..terms import GaussianPrior

    models = []
    for k in jax.random.split(key, n):
        m = model
        for t, kk in zip(objective.terms, jax.random.split(k, len(objective.terms)), strict=True):
            if isinstance(t, GaussianPrior):
                shape = jnp.shape(t.where(m))
                draw = t.mean + t.sigma * jax.random.normal(kk, shape, t.sigma.dtype)
            elif isinstance(t, UniformPrior):
                shape = jnp.shape(t.where(m))
                u = jax.random.uniform(kk, shape, t.lower.dtype)
                draw = t.lower + (t.upper - t.lower) * u
            else:
                continue
            m = eqx.tree_at(t.where, m, draw.astype(t.where(m).dtype))
        models.append(m)
    return jtu.tree_map(lambda *x: jnp.stack(x), *models)


def multi_start(
    key: PRNGKeyArray,
    objective: Objective,
    model: PyTree[Any],
    solver: SolverLike = "lm",
    *,
    n_starts: int = 8,
    free: PyTree[bool] | Callable[[Any], bool] | None = None,
    bounds: Mapping[Where, Bounds] | None = None,
    max_steps: int = 500,
    rtol: float | None = None,
    atol: float | None = None,
    throw: bool = True,
    batch_size: int | None = None,
    mesh: Mesh | None = None,
    route: BatchRoute = "auto",
) -> MultiStart:
    """Fits `n_starts` starting points drawn from the objective's priors
    (`sample_starts`) as one batch (`fit_batch`: on a CPU one compiled fit after another,
    on an accelerator vmapped, `batch_size` starts at a time, split over the devices of
    `mesh` if given; `route` as there) and picks the best.

    Raises `RuntimeError` when no start succeeds and `throw` is True."""
    starts = sample_starts(key, objective, model, n_starts)
    batch = fit_batch(
        objective,
        starts,
        solver,
        free=free,
        bounds=bounds,
        max_steps=max_steps,
        rtol=rtol,
        atol=atol,
        batch_size=batch_size,
        mesh=mesh,
        route=route,
    )
    ok = np.asarray(batch.result._value) == RESULTS.successful._value  # pyright: ignore
    values = np.where(ok, np.asarray(batch.value), np.inf)
    if not np.isfinite(values).any():
        if throw:
            raise RuntimeError(f"multi-start fit: none of the {n_starts} starts succeeded")
        values = np.nan_to_num(np.asarray(batch.value), nan=np.inf)
    best = int(np.argmin(values))
    return MultiStart(best=pick(batch, best), starts=batch, best_index=best)
