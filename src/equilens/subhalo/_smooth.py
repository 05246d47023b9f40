"""The smooth model fitted again after a subhalo scan's cells, from the best subhalo
models' fits with their subhalos removed (`subhalo_scan(smooth_starts=...)`), and the
scan rebased on the best smooth mode found."""

import dataclasses
import json
import math
import os
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from .._lens_system import LensSystem
from ..mass import MassSum
from ..objective import Objective
from ..objective._params import Bounds, Where
from ..solve._laplace import LaplaceEvidence
from ..solve._parametrise import parametrisation
from ._cells import _fit

if TYPE_CHECKING:
    from ._scan import SubhaloScan


def _as_sum(model: Any) -> LensSystem:
    """`model` with its mass a `MassSum` (the same lens): the smooth and subhalo models then
    share the paths of their common parameters."""
    if isinstance(model.mass, MassSum):
        return model
    return eqx.tree_at(lambda s: s.mass, model, MassSum((model.mass,)))


def smooth_refits(
    scan: "SubhaloScan",
    n: int,
    say: Callable[[str], None],
    objective: Objective,
    *fit: Any,
    client: Any = None,
    checkpoint: str | os.PathLike | None = None,
    records: Sequence[dict[str, Any]] = (),
    pending: Mapping[str, Any] | None = None,
) -> "SubhaloScan":
    """`scan` against the best of its smooth model and the smooth model fitted again from
    the subhalo fits of the `n` best cells (`_best_fits`) with their subhalos removed
    (`_smooth_again`, `fit` its arguments after the start): a cell fit (the macro model
    refitted) can reach a better mode of the smooth model's own parameters than its fit
    did, and the comparison is of each model at the best mode found from several starts.

    The refits run as tasks of the Dask `client` when given (side by side on its workers),
    else one after another here; each finished one is appended to `checkpoint` (a
    `{"refit": tag, ...}` line: its start's cell, its log-evidence and the smooth model's
    free parameters), and one the `records` already hold (a resumed scan's) is not run
    again."""
    starts = _best_fits(scan, n, tagged=True)
    if not starts:
        return scan
    kept = {str(r["refit"]): r for r in records if "refit" in r}
    # the smooth model's free parameters, as the checkpoint holds them
    param = (
        parametrisation(objective, scan.smooth, *_free_and_bounds(fit))
        if kept or (checkpoint is not None)
        else None
    )
    found: dict[str, tuple[float, Any] | None] = {}
    for tag, _ in starts:
        if tag in kept:
            rec = kept[tag]
            found[tag] = None
            if rec["log_evidence"] is not None and param is not None:
                model = _from_values(param, scan.smooth, rec["values"])
                found[tag] = (float(rec["log_evidence"]), model)
    todo = [(tag, start) for tag, start in starts if tag not in found]
    for tag, again in _refitted(todo, objective, fit, client, pending or {}):
        found[tag] = None if again is None else (again.log_evidence, again.model)
        if checkpoint is not None and param is not None:
            values = None if again is None else ravel_pytree(param.values(again.model))[0]
            line = {
                "refit": tag,
                "log_evidence": None if again is None else float(again.log_evidence),
                "values": None if values is None else np.asarray(values).tolist(),
            }
            with open(checkpoint, "a") as f:
                f.write(json.dumps(line) + "\n")
    best = None
    for k, (tag, _) in enumerate(starts):
        got = found[tag]
        shown = "failed" if got is None else f"{got[0] - scan.smooth_log_evidence:+.2f}"
        said = " (resumed)" if tag in kept else ""
        say(f"smooth model refitted from fit {k + 1} of {n} ({tag}): log evidence {shown}{said}")
        if got is not None and (best is None or got[0] > best[0]):
            best = got
    if best is None or not best[0] > scan.smooth_log_evidence:
        return scan
    gain = best[0] - scan.smooth_log_evidence
    say(f"smooth model's best refit: log evidence +{gain:.2f}")
    return _rebased(scan, *best)


def _from_values(param: Any, template: Any, values: Sequence[float]) -> Any:
    """`template` with the free parameters `values` (raveled, as the checkpoint holds them)."""
    _, unravel = ravel_pytree(param.values(template))
    return param.with_values(unravel(jnp.asarray(values, jnp.result_type(float))), template)


def _free_and_bounds(fit: tuple[Any, ...]) -> tuple[Any, Any]:
    """`free` and `bounds` of `smooth_refits`' `fit` arguments (solver, free, bounds, ...)."""
    return (fit[1], fit[2]) if len(fit) >= 3 else (None, None)


def early_refits(
    scan: "SubhaloScan",
    n: int,
    objective: Objective,
    *fit: Any,
    client: Any = None,
    records: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    """The smooth refits of `smooth_refits` that the coarse cells already decide, submitted
    now to the Dask `client` (tag -> future; none without a client): those from the `n`
    best cells' fits other than the best cell's, whose entry the refinement and the
    polishing fit can only raise, so the same cells stay the `n` best. Their workers then
    fit them beside the refinement and the polishing fit instead of after them (the best
    cell's refit waits for those); `smooth_refits(pending=...)` takes them. Refits the
    checkpoint's `records` hold are not submitted."""
    if client is None or n < 2:
        return {}
    kept = {str(r["refit"]) for r in records if "refit" in r}
    best = f"cell {scan.best_index + 1}"
    todo = [(t, m) for t, m in _best_fits(scan, n, tagged=True) if t != best and t not in kept]
    return _submit(todo, objective, fit, client)


def _submit(
    todo: list[tuple[str, Any]], objective: Objective, fit: tuple[Any, ...], client: Any
) -> dict[str, Any]:
    """The refits `todo` (`(tag, start)`) as tasks of the Dask `client` (the objective sent
    to each worker once): tag -> future."""
    if not todo:
        return {}
    import jax

    from ._cells import _x64

    client.run(_x64, bool(jax.config.read("jax_enable_x64")))
    shared = client.scatter(objective, broadcast=True, hash=False)
    run = uuid.uuid4().hex  # (a key of its own for every task: see _cells._on_dask)
    return {
        tag: client.submit(_smooth_again, shared, start, *fit, key=f"subhalo-refit-{k}-{run}")
        for k, (tag, start) in enumerate(todo)
    }


def _refitted(
    todo: list[tuple[str, Any]],
    objective: Objective,
    fit: tuple[Any, ...],
    client: Any,
    pending: Mapping[str, Any],
) -> Iterator[tuple[str, LaplaceEvidence | None]]:
    """`(tag, evidence or None)` of the refits `todo` (`(tag, start)`), as they finish: as
    tasks of the Dask `client` (those in `pending`, tag -> future, already are; the
    others of `pending` are cancelled), or here one after another."""
    wanted = {tag for tag, _ in todo}
    for tag, future in pending.items():
        if tag not in wanted:
            future.cancel()
    if client is None or not todo:
        for tag, start in todo:
            yield tag, _smooth_again(objective, start, *fit)
        return
    from distributed import as_completed

    futures = {pending[tag]: tag for tag in wanted if tag in pending}
    new = _submit([(t, m) for t, m in todo if t not in pending], objective, fit, client)
    futures.update({f: tag for tag, f in new.items()})
    for future in as_completed(futures):
        yield futures[future], future.result()


def _best_fits(scan: "SubhaloScan", n: int, tagged: bool = False) -> list[Any]:
    """The fitted subhalo models of the `n` cells of the highest log-evidence, one fit a
    cell (the refined cell's the best of its own fit, its sub-cells' and its polishing
    fit's): starts from different cells, whose macro models differ more than those of one
    cell's sub-cells (fewer where fewer cells' fits succeeded). `tagged`: `(tag, fit)`
    pairs, the tag naming the fit ("cell i", "sub-cell j of n of cell i" or "polished cell
    i"; counted from 1, as the scan's log counts them) for the checkpoint."""

    def ok(le: Any, fit: Any) -> bool:
        return fit is not None and math.isfinite(float(le))

    entries = {
        i: (float(le), f"cell {i + 1}", fit)
        for i, (le, fit) in enumerate(zip(scan.log_evidence, scan.fits, strict=True))
        if ok(le, fit)
    }
    sub = scan.refinement
    if sub is not None:
        own = [entries[scan.best_index]] if scan.best_index in entries else []
        n_sub = len(sub.fits)
        subs = [
            (float(le), f"sub-cell {j + 1} of {n_sub} of cell {scan.best_index + 1}", f)
            for j, (le, f) in enumerate(zip(sub.log_evidence, sub.fits, strict=True))
            if ok(le, f)
        ]
        if own or subs:
            entries[scan.best_index] = max([*own, *subs], key=lambda p: p[0])
    pol = scan.polished
    if pol is not None and ok(pol.log_evidence[0], pol.fits[0]):
        mine = (float(pol.log_evidence[0]), f"polished cell {scan.best_index + 1}", pol.fits[0])
        if scan.best_index not in entries or mine[0] > entries[scan.best_index][0]:
            entries[scan.best_index] = mine
    ranked = sorted(entries.values(), key=lambda p: -p[0])[:n]
    return [(tag, fit) for _, tag, fit in ranked] if tagged else [fit for _, _, fit in ranked]


def _smooth_again(
    objective: Objective,
    model: LensSystem,
    solver: str,
    free: Any,
    bounds: Mapping[Where, Bounds] | None,
    max_steps: int,
    evidence: Callable[..., LaplaceEvidence],
    plateau: tuple[int, float] | None = None,
) -> LaplaceEvidence | None:
    """The smooth model's evidence from a fit started at `model` (a cell's fit) without its
    subhalo (`plateau`: the fit's, as in `fit`); None when that fit or its evidence fails."""
    comps = model.mass.components[:-1]  # pyright: ignore[reportAttributeAccessIssue]
    start = eqx.tree_at(lambda s: s.mass, model, MassSum(tuple(comps)))
    r = _fit(objective, start, solver, free, bounds, max_steps, plateau=plateau)
    if not math.isfinite(float(r.value)):
        return None
    try:
        ev = evidence(objective, _as_sum(r.model), free=free, bounds=bounds)
    except ValueError:
        return None
    return ev if math.isfinite(ev.log_evidence) else None


def _rebased(scan: "SubhaloScan", log_evidence: float, model: Any) -> "SubhaloScan":
    """`scan` (and its refinement) against the smooth `model` of `log_evidence` (higher than
    the one it was computed against), `smooth_gain` recording the rise."""
    gain = log_evidence - scan.smooth_log_evidence

    def less(v: Any) -> Any:
        return None if v is None else v - gain

    def one(sc: "SubhaloScan") -> "SubhaloScan":
        best = dict(sc.best)
        for key in ("delta_log_evidence", "cell_delta_log_evidence"):
            if key in best:
                best[key] = less(best[key])
        return dataclasses.replace(
            sc,
            delta_log_evidence=sc.log_evidence - log_evidence,
            delta_log_evidence_grid=sc.delta_log_evidence_grid - gain,
            smooth_log_evidence=log_evidence,
            smooth=model,
            best=best,
            smooth_gain=sc.smooth_gain + gain,
        )

    sub = None if scan.refinement is None else one(scan.refinement)
    polished = None if scan.polished is None else one(scan.polished)
    return dataclasses.replace(one(scan), refinement=sub, polished=polished)
