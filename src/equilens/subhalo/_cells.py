"""How the cells of a subhalo scan run (`subhalo_scan`): each cell's fit from what every cell
shares (`CellSetup`), in this process, vectorised (`fit_batch`) or as Dask tasks; the
quiet restart; its Laplace evidence; the checkpoint's records written as they finish and
read back."""

import json
import math
import os
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.flatten_util import ravel_pytree

from .._lens_system import LensSystem
from ..objective import Objective
from ..objective._params import Bounds, Where
from ..solve import RESULTS, FitResult, fit, fit_batch, pick
from ..solve._batch import BatchRoute, batch_route
from ..solve._laplace import LaplaceEvidence
from ._grid import place
from ._seed import task_starts

#: A cell's `(log-evidence, status, fitted model, 1-sigma errors of the subhalo's u, v and
#: log10_mass)`.
CellRecord = tuple[float, str, Any, dict[str, float]]
#: The quiet start of a cell fit (`_no_worse_than_smooth`): the subhalo's log10 mass this
#: far (dex) above the prior's lower bound, a negligible perturber.
QUIET_DEX = 0.5
#: A cell's status when its fit ran out of steps (its evidence is still computed).
MAX_STEPS_STATUS = "successful (the fit reached max_steps; evidence from where it stopped)"
#: The checkpoint's format version (a file of another version is not resumed from).
CHECKPOINT_FORMAT = 1
#: What the log and the progress bar call the fits of each kind of checkpoint record:
#: the cells, the refinement's sub-cells, the best cell's polishing fit (`_polish.py`), the
#: best cells' held-mass fits (`_held.py`) and searched fits (`_searched.py`).
NAMES = {
    "cell": "cell",
    "sub": "sub-cell",
    "polish": "polished cell",
    "held": "held-mass fit",
    "searched": "searched fit",
}
BARS = {
    "cell": "subhalo scan",
    "sub": "refinement",
    "polish": "polish",
    "held": "held mass",
    "searched": "searched",
}


class CellSetup(NamedTuple):
    """What every cell of a scan shares: the scan's `objective`, the `cell_objective` (it
    plus the subhalo's priors), the `template` model (the smooth model plus a subhalo),
    the fit's `solver`, `free` parameters, `bounds` and `max_steps`, the `evidence`
    function, the `quiet` log10 mass (`_no_worse_than_smooth`), the fit's `scale`
    (`equilens.fit`'s preconditioner, ordered as the cell's free parameters; or None)
    and its `plateau` (`equilens.fit`'s; None: none)."""

    objective: Objective
    cell_objective: Objective
    template: Any  # a LensSystem whose mass is a MassSum ending in the Subhalo
    solver: str
    free: Any
    bounds: Mapping[Where, Bounds]
    max_steps: int
    evidence: Callable[..., LaplaceEvidence]
    quiet: float
    scale: np.ndarray | None = None
    plateau: tuple[int, float] | None = None


#: The cell fit's `scale` (`equilens.fit`'s preconditioner) of the subhalo's `u`, `v` and
#: `log10_mass` in the fit's unconstrained coordinates (logits of the cell and the mass
#: range): between a detected subhalo's errors (about 0.02) and an unconstrained one's
#: (about 2, the prior's width).
SUBHALO_SCALE = 0.03
#: `subhalo_scan`'s default `fit_tolerance` (log-evidence units) where the objective has a
#: `LogEvidence` term: its roughness on small scales keeps a quasi-Newton fit stepping by
#: thousandths of an error for hundreds of steps at `fit`'s default tolerances, for gains
#: of a few tenths in all (docs/subhalo.md).
FIT_TOLERANCE = 0.5
#: The steps over which a scan's fit must gain `fit_tolerance` to go on (`fit`'s `plateau`).
PLATEAU_STEPS = 10


def fit_plateau(fit_tolerance: float | None, rough: bool) -> tuple[int, float] | None:
    """`equilens.fit`'s `plateau` for a scan's fits from `subhalo_scan`'s `fit_tolerance`:
    `(PLATEAU_STEPS, fit_tolerance)`, a fit stopping when it has gained less than
    `fit_tolerance` over its last `PLATEAU_STEPS` steps; None (the default) is
    `FIT_TOLERANCE` when `rough` (a pixelized source's evidence), else no plateau rule;
    0: no plateau rule (`fit`'s tolerances alone)."""
    if fit_tolerance is None:
        if not rough:
            return None
        fit_tolerance = FIT_TOLERANCE
    tol = float(fit_tolerance)
    if not (math.isfinite(tol) and tol >= 0):
        raise ValueError(
            f"fit_tolerance must be >= 0 (log-evidence units; 0: none), got {fit_tolerance!r}"
        )
    return None if tol == 0 else (PLATEAU_STEPS, tol)


#: The largest `scale` taken from the smooth model's errors (a direction its evidence
#: leaves flat has an error as wide as the floor of its Hessian's eigenvalues allows).
MAX_SCALE = 1.0


def cell_scale(smooth_ev: LaplaceEvidence, names: tuple[str, ...]) -> np.ndarray:
    """The cell fit's `scale` for its free parameters `names`: the smooth model's errors in
    the unconstrained coordinates (`smooth_ev.raw_errors`, at most `MAX_SCALE`) for the
    parameters both share, `SUBHALO_SCALE` for the subhalo's."""
    known = dict(zip(smooth_ev.names, np.asarray(smooth_ev.raw_errors), strict=True))
    return np.array([min(float(known.get(n, SUBHALO_SCALE)), MAX_SCALE) for n in names])


def _finite_or_none(v: float) -> float | None:
    return float(v) if math.isfinite(float(v)) else None


def _run_cells(
    setup: CellSetup,
    centres: np.ndarray,
    half: float,
    starts: np.ndarray,
    done: dict[int, dict[str, Any]],
    key: str,
    *,
    param: Any,
    checkpoint: Any,
    client: Any,
    route: BatchRoute,
    mesh: Any,
    progress: bool,
    say: Callable[..., None],
    pool: np.ndarray | None = None,
    task: Callable[..., CellRecord] | None = None,
) -> tuple[np.ndarray, list[str], list[Any], list[dict[str, float]]]:
    """Fits the cells `centres` (of half-width `half`, the subhalo started at `starts`: rows
    `(u, v, log10_mass)` a cell, NaN rows none, `_cell_task`) not in `done` (the
    checkpoint's records, by index); each finished cell written to `checkpoint` under `key`
    ("cell", "sub" for the refinement's sub-cells, "polish" for the polishing fit) as it
    finishes; with a start grid's `pool` (Dask only: `_seed.cell_starts(in_tasks=True)`), each task
    scores its cell's grid itself. `task`: what fits a cell (default `_cell_task`; "held",
    the held-mass fits' `_held.held_task`, "searched", `_searched.searched_task`, with its
    signature; never vectorised). Returns
    each cell's log-evidence, status, fitted model and subhalo errors."""
    if pool is not None and client is None:
        raise ValueError("a start grid's pool is scored in the cells' tasks on Dask only")
    task = task or _cell_task
    template = setup.template
    dtype = template.mass.components[-1].log10_mass.dtype
    n = centres.shape[0]
    log_e = np.full(n, np.nan)
    status = ["not run"] * n
    fits: list[Any] = [None] * n
    errors: list[dict[str, float]] = [{} for _ in range(n)]
    _, unravel = ravel_pytree(param.values(template))
    for i, rec in done.items():
        log_e[i] = np.nan if rec["log_evidence"] is None else rec["log_evidence"]
        status[i] = rec["status"]
        errors[i] = rec.get("errors") or {}
        if rec["values"] is not None:
            values = unravel(jnp.asarray(rec["values"], dtype))
            at = _rows(starts[i])[0]  # (the cell's centre and the template's fixed fields)
            fits[i] = param.with_values(values, _in_cell(template, centres[i], at, dtype))
    todo = [i for i in range(n) if i not in done]
    bar = _bar(len(todo), progress, BARS[key])
    if client is not None:
        finished = _on_dask(client, setup, centres, starts, todo, pool, task)
    elif todo and task is _cell_task and batch_route(route, mesh) == "vmap":
        finished = _vmapped(setup, centres, starts, todo, mesh)
    else:
        finished = ((i, task(setup, centres[i], starts[i])) for i in todo)
    for i, rec in finished:
        log_e[i], status[i], fits[i], errors[i] = rec
        values = None if rec[2] is None else np.asarray(ravel_pytree(param.values(rec[2]))[0])
        if checkpoint is not None:
            line = {
                key: i,
                **({} if key == "cell" else {"center": centres[i].tolist(), "half": half}),
                "log_evidence": _finite_or_none(log_e[i]),
                "status": status[i],
                "values": None if values is None else values.tolist(),
                "errors": errors[i],
            }
            with open(checkpoint, "a") as f:
                f.write(json.dumps(line) + "\n")
        say(i, NAMES[key], centres[i], log_e[i], status[i])
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return log_e, status, fits, errors


def _in_cell(template: LensSystem, centre: np.ndarray, start: np.ndarray, dtype: Any) -> LensSystem:
    """`place` from host values: `template`'s subhalo in the cell at `centre`, at `start`."""
    return place(template, jnp.asarray(centre, dtype), jnp.asarray(start, dtype))


def _cell_task(
    setup: CellSetup, centre: np.ndarray, at: np.ndarray, pool: np.ndarray | None = None
) -> CellRecord:
    """One cell of the scan from what every cell shares (`setup`), its centre and the
    subhalo's starts in it (`at`: rows `(u, v, log10_mass)`, NaN rows skipped; one row
    also taken; with a start grid's `pool`, the first row and the grid's second start,
    `_seed.task_starts`, scored here): fitted from each, the better fit kept (`_better`),
    then its evidence. What a Dask worker runs."""
    if pool is not None:
        at = task_starts(setup.cell_objective, setup.template, centre, _rows(at)[0], pool)
    dtype = setup.template.mass.components[-1].log10_mass.dtype
    tried = []
    for row in _rows(at):
        start = _in_cell(setup.template, centre, row, dtype)
        fitted = _cell_fit(setup, start)
        tried.append((fitted, start))
    fitted, start = _better(tried)
    fitted = _no_worse_than_smooth(fitted, start, setup)
    return _cell_evidence(setup.objective, fitted, setup.free, setup.bounds, setup.evidence)


def _rows(at: np.ndarray) -> list[np.ndarray]:
    """The starts of a cell: the finite rows of `at` (one start a row, or one row)."""
    return [row for row in np.atleast_2d(np.asarray(at, np.float64)) if np.all(np.isfinite(row))]


def _better(tried: list[tuple[FitResult, Any]]) -> tuple[FitResult, Any]:
    """The `(fit, start)` of `tried` whose fit ends lowest in the cell objective (each fit's
    `value`, `_lowest`)."""
    return tried[_lowest([float(r.value) for r, _ in tried])]


def _lowest(values: list[float]) -> int:
    """The index of the lowest of `values`, a value that is not finite never chosen while
    another is (0 where none is)."""
    finite = [k for k, v in enumerate(values) if math.isfinite(v)]
    return min(finite, key=values.__getitem__) if finite else 0


def _vmapped(setup: CellSetup, centres: np.ndarray, starts: np.ndarray, todo: list[int], mesh: Any):
    """`(cell, record)` of the cells `todo`: the fits from all their starts as one
    `fit_batch` (vectorised, split over `mesh`'s devices), then each cell's better fit's
    evidence."""
    dtype = setup.template.mass.components[-1].log10_mass.dtype
    runs = [(i, row) for i in todo for row in _rows(starts[i])]
    models = [_in_cell(setup.template, centres[i], row, dtype) for i, row in runs]
    stacked = jtu.tree_map(lambda *x: jnp.stack(x) if eqx.is_array(x[0]) else x[0], *models)
    batch = fit_batch(
        setup.cell_objective,
        stacked,
        setup.solver,
        free=setup.free,
        bounds=setup.bounds,
        max_steps=setup.max_steps,
        mesh=mesh,
        covariance=False,
        route="vmap",
        scale=setup.scale,
        plateau=setup.plateau,
    )
    for i in todo:
        tried = [(pick(batch, k), models[k]) for k, (j, _) in enumerate(runs) if j == i]
        fitted = _no_worse_than_smooth(*_better(tried), setup)
        yield i, _cell_evidence(setup.objective, fitted, setup.free, setup.bounds, setup.evidence)


def _x64(enabled: bool) -> None:
    """Sets JAX's float64 mode in a Dask worker (before any array reaches it)."""
    import jax

    jax.config.update("jax_enable_x64", enabled)


def _on_dask(
    client: Any,
    setup: CellSetup,
    centres: np.ndarray,
    starts: np.ndarray,
    todo: list[int],
    pool: np.ndarray | None = None,
    task: Callable[..., CellRecord] | None = None,
):
    """`(cell, record)` of the cells `todo` as Dask's workers finish them (`task`, default
    `_cell_task`, each scoring its cell's start grid `pool` first, where given). The shared set-up
    is sent to every worker once (`scatter(broadcast=True)`): each worker's tasks get the
    same objects, whose static parts (the `where` functions, the parametrisation) then
    match the programs the worker compiled for its first cell: one compilation per
    worker. The workers' JAX runs in the client's precision."""
    import jax
    from distributed import as_completed

    client.run(_x64, bool(jax.config.read("jax_enable_x64")))
    # random keys for the scattered set-up (`hash=False`): by default a scattered object's
    # key is a hash of its content, so a second call with the same parts (the refinement
    # after the cells, a second scan) scatters them again under keys the scheduler may be
    # forgetting from the first call's futures: its tasks were then cancelled for "lost
    # dependencies" (seen in CI), the same race as dask/distributed#7356's
    shared = client.scatter(setup, broadcast=True, hash=False)
    # a key of its own for every task of every call: Dask refuses nothing when a key comes
    # back, it returns the old task, and a key submitted again while the scheduler is still
    # forgetting it can leave the task waiting for ever (dask/distributed#7356); `id(setup)`
    # is reused once a set-up is freed
    run = uuid.uuid4().hex
    futures = {
        client.submit(
            task or _cell_task, shared, centres[i], starts[i], pool, key=f"subhalo-cell-{i}-{run}"
        ): i
        for i in todo
    }
    for future in as_completed(futures):
        yield futures[future], future.result()


def _fit(
    objective: Objective,
    start: LensSystem,
    solver: str,
    free: Any,
    bounds: Mapping[Where, Bounds] | None,
    max_steps: int,
    scale: np.ndarray | None = None,
    plateau: tuple[int, float] | None = None,
) -> FitResult:
    """The scan's fit of `objective` from `start`, failures returned, not raised, and no
    covariance: a cell's (the scan's objective with the subhalo's priors in the fit's
    coordinates) or the smooth model's; `scale` and `plateau` as in `fit`."""
    return fit(
        objective,
        start,
        solver,
        free=free,
        bounds=bounds,
        max_steps=max_steps,
        throw=False,
        covariance=False,
        scale=scale,
        plateau=plateau,
    )


def _cell_fit(
    setup: CellSetup, start: LensSystem, held: tuple[Any, np.ndarray | None] | None = None
) -> FitResult:
    """A cell's fit from `start` with the set-up's objective, solver, bounds, steps and
    plateau; its free parameters and `scale` the set-up's, or `held`'s `(free, scale)`
    (the held-mass fit's first phase, `_held.py`)."""
    free, scale = held if held is not None else (setup.free, setup.scale)
    return _fit(
        setup.cell_objective,
        start,
        setup.solver,
        free,
        setup.bounds,
        setup.max_steps,
        scale,
        setup.plateau,
    )


@eqx.filter_jit
def _value(objective: Objective, model: Any) -> Any:
    return objective(model)


def _no_worse_than_smooth(fitted: FitResult, start: LensSystem, setup: CellSetup) -> FitResult:
    """`fitted`, or the fit from the quiet start (`start` with the subhalo of the set-up's
    quiet log10 mass: the smooth model) when `fitted` ended worse than that start: a model
    with a subhalo holds the smooth one, so its fit must do at least as well (from the
    start at 1e9 Msun, a fit can stop in a worse local minimum: a subhalo at the mask's
    edge, the macro model pulled away); the better of the two is kept."""
    cell_objective, quiet = setup.cell_objective, setup.quiet
    low = eqx.tree_at(
        lambda s: s.mass.components[-1].log10_mass,
        start,
        jnp.asarray(quiet, start.mass.components[-1].log10_mass.dtype),  # pyright: ignore[reportAttributeAccessIssue]
    )
    at_fit = float(fitted.value)  # (the cell objective at the fit's model)
    if at_fit <= float(_value(cell_objective, low)):
        return fitted
    again = _cell_fit(setup, low)
    value = float(again.value)
    return again if math.isfinite(value) and not value >= at_fit else fitted


def _cell_evidence(
    objective: Objective,
    r: FitResult,
    free: Any,
    bounds: Mapping[Where, Bounds],
    evidence: Callable[..., LaplaceEvidence],
) -> CellRecord:
    """A cell's `(log E, status, model)` from its fit `r`."""
    # a fit that ran out of steps (a pixelized source's evidence is rough: quasi-Newton
    # steps stall on it) still gives its evidence, from where it stopped, polished by the
    # Newton steps of `laplace_evidence`; its status says so
    out_of_steps = (RESULTS.max_steps_reached, RESULTS.nonlinear_max_steps_reached)
    stopped = any(r.result == u for u in out_of_steps)
    usable = stopped or r.result == RESULTS.successful or r.result == RESULTS.implausible
    if not usable:
        return math.nan, r.message(), None, {}
    try:
        ev = evidence(objective, r.model, free=free, bounds=bounds)
    except ValueError as e:
        return math.nan, f"evidence failed: {e}", None, {}
    if not math.isfinite(ev.log_evidence):
        return math.nan, "evidence failed: not finite", None, {}
    status = MAX_STEPS_STATUS if stopped else "successful"
    prefix = f"mass.components[{len(ev.model.mass.components) - 1}]."
    sigma = {
        name[len(prefix) :]: math.sqrt(max(float(ev.covariance[k, k]), 0.0))
        for k, name in enumerate(ev.names)
        if name.startswith(prefix)
    }
    return ev.log_evidence, status, ev.model, sigma


def records_of(
    records: Any, key: str, centres: np.ndarray, half: float
) -> dict[int, Mapping[str, Any]]:
    """The checkpoint's `records` of kind `key` (`{key: j, "center": ..., "half": ...}`: the
    held-mass and searched fits) of the cells `centres`, by their index in `centres`,
    matched by centre and size: a record's own index is its place among the cells fitted
    when it was written, which other settings (or a resumed scan's other best cells) change."""
    done = {}
    for r in records:
        if key not in r or not math.isclose(r["half"], half, rel_tol=1e-9):
            continue
        for j, centre in enumerate(centres):
            if np.allclose(r["center"], centre, rtol=0, atol=1e-9):
                done[j] = r
    return done


def keep_better(
    cells: tuple[np.ndarray, list[str], list[Any], list[dict[str, float]]],
    top: Sequence[int],
    again: tuple[np.ndarray, list[str], list[Any], list[dict[str, float]]],
    say: Callable[[str], None],
    what: str,
) -> tuple[np.ndarray, list[str], list[Any], list[dict[str, float]]]:
    """`cells` (`_run_cells`'s results) with cell `top[j]`'s replaced by `again`'s `j`th
    where that evidence is higher (said, as `what`'s); the input left as it was."""
    log_e, status, fits, errors = np.array(cells[0]), list(cells[1]), list(cells[2]), list(cells[3])
    a_log_e, a_status, a_fits, a_errors = again
    for j, i in enumerate(top):
        if math.isfinite(float(a_log_e[j])) and a_log_e[j] > log_e[i]:
            gain = a_log_e[j] - log_e[i]
            say(f"  cell {i + 1}: {what} kept, log evidence {gain:+.2f} over its fit")
            log_e[i], status[i] = a_log_e[j], a_status[j]
            fits[i], errors[i] = a_fits[j], a_errors[j]
    return log_e, status, fits, errors


def _bar(total: int, show: bool, desc: str) -> Any:
    if not show or total == 0:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="cell")


def _read_checkpoint(path: Any, header: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The records (cells and sub-cells) a checkpoint holds (None without one); `ValueError`
    for another set-up's."""
    if path is None or not os.path.isfile(path):
        return None
    with open(path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    if not lines or "header" not in lines[0]:
        raise ValueError(f"{path} is not a subhalo scan checkpoint")
    # (a header without the start grid's keys was written before it existed: every cell
    # started at its centre, as with start_grid=0)
    # (and without "preconditioned", before the cell fits were: not preconditioned; without
    # "second_start", before the start grid's best was a second start: it replaced the
    # default start; without "fit_plateau", before the scan's fits had one: none; without
    # "smoothing_start", before the later evidences started from the smooth model's errors;
    # without "subhalo_samples", before the cells' evidences were corrected along the
    # subhalo; without "held", before the best cells' held-mass fits)
    old = {
        "start_grid": 0,
        "start_masses": [],
        "preconditioned": False,
        "second_start": False,
        "fit_plateau": None,
        "smoothing_start": None,
        "subhalo_samples": 0,
        "held": None,
        **lines[0]["header"],
    }
    keys = ("format", "kind", "mass_range", "centres", "start_grid", "start_masses")
    later = (
        "preconditioned",
        "second_start",
        "fit_plateau",
        "smoothing_start",
        "subhalo_samples",
        "held",
    )
    for key in (*keys, *later):
        if old.get(key) != header[key]:
            name = {
                "fit_plateau": "fit_tolerance",
                "smoothing_start": "evidence",
                "held": "held_cells or held_log10_mass",
            }.get(key, key)
            raise ValueError(
                f"{path} holds a scan with another {name}: remove it or pass another checkpoint"
            )
    if not np.isclose(old["half"], header["half"]) or not np.isclose(
        old["smooth_log_evidence"], header["smooth_log_evidence"], rtol=0, atol=1e-6
    ):
        raise ValueError(f"{path} holds a scan of another smooth model or cell size")
    return lines[1:]
