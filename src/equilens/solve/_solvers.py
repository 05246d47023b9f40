"""The solvers `fit` runs: names (`SOLVER_NAMES`), optimistix's solvers wrapped with the
fit's own step limit and stall rule (`_Watched`), optax transformations as optimistix
minimisers (`_OptaxMinimiser`), and the progress bars fed from the device loop."""

import functools
from collections.abc import Callable
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import optax
import optimistix as optx
from jaxtyping import Array

from ..objective import Objective
from ._result import RESULTS

SolverLike = (
    str | optx.AbstractLeastSquaresSolver | optx.AbstractMinimiser | optax.GradientTransformation
)


Kind = Literal["least_squares", "minimise", "optax"]


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


class _WatchState(eqx.Module):
    inner: Any
    steps: Array
    still: Array
    moved: Array
    best: Array  # the lowest value at which the plateau rule last saw a gain
    flat: Array  # steps since then


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
    after `_STALL_START` (the first line search's halvings). With `plateau_steps > 0`, it
    also stops when the value at the accepted point (`_accepted_value`) has fallen by less
    than `plateau_tol` over the last `plateau_steps` accepted steps (`fit`'s `plateau`, in
    the solver's units). Everything else, `postprocess` included (`optx.BestSoFarMinimiser`
    returns its best point), is the wrapped solver's."""

    solver: Any
    max_steps: Array
    progress: "_Progress"
    plateau_steps: Array
    plateau_tol: Array

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
        best = jnp.asarray(jnp.inf, self.plateau_tol.dtype)
        zero, no = jnp.array(0), jnp.array(False)
        return _WatchState(inner, zero, zero, no, best, zero)

    def step(self, fn, y, args, options, state, tags):
        new_y, inner, aux = self.solver.step(fn, y, args, options, state.inner, tags)
        pairs = zip(jtu.tree_leaves(new_y), jtu.tree_leaves(y), strict=True)
        same = jnp.all(jnp.stack([jnp.all(a == b) for a, b in pairs]))
        steps = state.steps + 1
        _report(self.progress, steps)
        still = jnp.where(same, state.still + 1, 0)
        moved = state.moved | ~same
        best, flat = state.best, state.flat
        f = _accepted_value(inner)
        if f is not None:
            # accepted steps alone count (a rejected one, a line search's halving, is on its
            # way to the next; `_STALL` ends a run of them), and before the first the
            # solver's state holds no value yet
            f = jnp.asarray(f, best.dtype)
            gain = ~same & ((f < best - self.plateau_tol) | ~jnp.isfinite(best))
            best = jnp.where(gain, f, best)
            flat = jnp.where(gain, 0, jnp.where(same, flat, flat + 1))
        return new_y, _WatchState(inner, steps, still, moved, best, flat), aux

    def terminate(self, fn, y, args, options, state, tags):
        done, res = self.solver.terminate(fn, y, args, options, state.inner, tags)
        done = done | (state.still >= jnp.where(state.moved, _STALL, _STALL_START))
        done = done | ((self.plateau_steps > 0) & (state.flat >= self.plateau_steps))
        out = state.steps >= self.max_steps
        late = out & jnp.invert(done) & (res == optx.RESULTS.successful)
        return done | out, optx.RESULTS.where(late, optx.RESULTS.nonlinear_max_steps_reached, res)

    def postprocess(self, fn, y, aux, args, options, state, tags, result):
        return self.solver.postprocess(fn, y, aux, args, options, state.inner, tags, result)


#: optimistix's records of the value at a solver's accepted point, and of its residuals
_VALUED = (
    optx.FunctionInfo.Eval,
    optx.FunctionInfo.EvalGrad,
    optx.FunctionInfo.EvalGradHessian,
    optx.FunctionInfo.EvalGradHessianInv,
)
_RESIDUAL = (optx.FunctionInfo.Residual, optx.FunctionInfo.ResidualJac)


def _accepted_value(inner: Any) -> Array | None:
    """The value at the accepted point a solver's state holds: an optimistix quasi-Newton
    or descent solver's `f_info.f`, half the squared residuals of a least-squares one's;
    None for a state without one (`fit` refuses `plateau` for the optax loop, whose steps
    need not decrease the objective; another solver's without one is never stopped by
    the plateau rule)."""
    info = getattr(inner, "f_info", None)
    if isinstance(info, _VALUED):
        return info.f
    if isinstance(info, _RESIDUAL):
        squares = [jnp.sum(jnp.square(r)) for r in jtu.tree_leaves(info.residual)]
        return 0.5 * jnp.sum(jnp.stack(squares))
    return None


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


_Progress = tuple[bool, Array, Array]


def _progress(every: int, bar_id: int) -> _Progress:
    """Whether to report (static), every how many steps, and to which bar (arrays)."""
    return every > 0, jnp.asarray(max(every, 1)), jnp.asarray(bar_id)


def _default_tol(tol: float | None) -> float:
    # 1e-6 in float64; in float32 the objective's rounding (~1e-7 relative on a sum over
    # thousands of pixels) needs a looser rule
    if tol is not None:
        return float(tol)
    return 1e-6 if jnp.finfo(jnp.result_type(float)).bits == 64 else 1e-3


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
