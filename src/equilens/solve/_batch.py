"""Batches of fits: `fit_batch` (many starts or objectives: a loop of compiled fits on a
CPU, vmapped on an accelerator, split over devices with `mesh=`; `batch_route`), `pick`,
`multi_start` and `sample_starts`."""

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.sharding import Mesh
from jaxtyping import Array, Float, PRNGKeyArray, PyTree

from .._checks import is_traced
from .._resources import check_memory_maps
from .._sharding import check_mesh, lapack_batches_deadlock, replicate, shard, split_grids
from ..objective import Objective
from ..objective._params import Bounds, Where
from ..terms import UniformPrior
from ._fit import _fit_core, _how, _limits, _prepare, _result, _scale, _strong
from ._result import RESULTS, FitResult
from ._solvers import IMPLICIT, SolverLike, _default_tol, _progress

#: How `fit_batch` solves a batch (`batch_route`).
BatchRoute = Literal["auto", "vmap", "loop"]


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
    plateau: tuple[int, float] | None = None,
    batch_size: int | None = None,
    mesh: Mesh | None = None,
    covariance: bool = True,
    route: BatchRoute = "auto",
    scale: Float[np.ndarray, " n"] | Float[Array, " n"] | Sequence[float] | None = None,
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

    `covariance=False` skips each element's covariance (as in `fit`); `scale` (one
    value per free scalar, shared by every element) preconditions each fit as in `fit`;
    `plateau` stops each element's fit as in `fit`.

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
        obj0, first, solver, free, bounds, max_steps, rtol, atol, plateau
    )
    raw0 = jax.vmap(param.to_raw)(models)
    for i in range(jtu.tree_leaves(raw0)[0].shape[0]):
        param.check(_index(models, i))

    limits = _limits(_index(raw0, 0), max_steps, rtol, atol, plateau)
    how = _how(IMPLICIT, None, covariance, max_steps)
    unit = _scale(scale, _index(raw0, 0))

    @eqx.filter_vmap(in_axes=(obj_axes, 0, 0))
    def run(obj, tmpl, r0):
        return _fit_core(
            kind, solver_obj, obj, param, tmpl, r0, limits, _progress(0, -1), how, unit
        )

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
                unit,
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
