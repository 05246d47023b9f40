"""Where each cell's fit of a subhalo scan starts (`subhalo_scan(start_grid=...)`): the
cell's default start and, as a second start, the best of a grid of subhalo positions in the
cell and masses, the macro model and source held at the smooth model's fit, where that
candidate beats both the default start and the smooth model.

A pixelized source's evidence is rough on small scales (traced pixels cross the mesh's cells
as the mass changes): a quasi-Newton fit of a cell started at one point (the cell's centre,
1e9 Msun) stops in the nearest of its narrow local optima, often where it started, so a cell
whose subhalo would sit elsewhere in it is not found. The grid is a global search over the
subhalo's three parameters at the price of a few dozen evaluations of the objective per
cell (one vectorised program, compiled once for every cell), before the local fit refits the
macro model with the subhalo. Neither start is better everywhere (docs/subhalo.md: a fit
from the grid's best can stall where the default start's reached the subhalo, and the
reverse), so a cell with two starts is fitted from both and keeps the better fit.
"""

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Float

from ..objective import Objective
from ._grid import place

#: The subhalo masses (log10 Msun) of the start grid, kept inside the scan's mass range.
START_MASSES = (7.0, 7.5, 8.0, 8.5, 9.0, 9.5, 10.0, 10.5)
#: Candidates evaluated at once (vectorised): bounds the memory of a pixelized source's
#: dense matrices (one set per candidate).
BATCH = 8


def start_candidates(
    n: int, masses: Sequence[float], mass_range: tuple[float, float]
) -> Float[np.ndarray, "k 3"]:
    """The `(u, v, log10_mass)` candidates of one cell: the centres of its `n` x `n` sub-squares
    (cell units, `-1 < u, v < 1`) times the `masses` strictly inside `mass_range`."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"start_grid must be a positive number of positions a side, got {n!r}")
    lo, hi = mass_range
    kept = [float(m) for m in masses if lo < float(m) < hi]
    if not kept:
        raise ValueError(f"no start mass {tuple(masses)} lies inside mass_range {mass_range}")
    offsets = (np.arange(n) + 0.5) * 2.0 / n - 1.0
    return np.asarray([(u, v, m) for v in offsets for u in offsets for m in kept], np.float64)


def _evaluate(objective: Objective, template: Any, cell: Any, candidates: Any) -> Any:
    """`objective` of `template` with its subhalo in the cell `cell` (`(x, y)`) at each of
    `candidates` (`(k, 3)`: u, v, log10 mass), `BATCH` at a time."""

    def one(c):
        return objective(place(template, cell, c))

    return jax.lax.map(one, candidates, batch_size=BATCH)


_evaluate_jit = eqx.filter_jit(_evaluate)


def best_starts(
    objective: Objective,
    template: Any,
    centres: Float[np.ndarray, "cells 2"],
    candidates: Float[np.ndarray, "k 3"],
    defaults: Float[np.ndarray, "cells 3"],
) -> tuple[Float[np.ndarray, "cells 3"], Float[np.ndarray, " cells"]]:
    """Each cell's start `(u, v, log10_mass)`: the one of `candidates` and the cell's
    `defaults` row with the lowest `objective` (the cell fit's, priors included), the rest of
    `template` held; and that value (NaN where none is finite: the default is kept)."""
    dtype = template.mass.components[-1].log10_mass.dtype
    starts = np.array(defaults, np.float64)
    values = np.full(len(centres), np.nan)
    for i, centre in enumerate(centres):
        pool = np.concatenate([np.asarray(defaults[i : i + 1], np.float64), candidates])
        v = np.asarray(
            _evaluate_jit(
                objective, template, jnp.asarray(centre, dtype), jnp.asarray(pool, dtype)
            ),
            np.float64,
        )
        v = np.where(np.isfinite(v), v, np.inf)
        k = int(np.argmin(v))
        if np.isfinite(v[k]):
            starts[i], values[i] = pool[k], v[k]
    return starts, values


def cell_starts(
    objective: Objective,
    template: Any,
    centres: Float[np.ndarray, "cells 2"],
    candidates: Float[np.ndarray, "k 3"],
    first: Float[np.ndarray, "cells 3"],
    quiet: float,
    done: Mapping[int, Any],
    say: Callable[[str], None],
    in_tasks: bool = False,
) -> Float[np.ndarray, "cells starts 3"]:
    """The cells' starts `(u, v, log10_mass)`, one row a start: `first`, and for the cells
    not `done` a second row, the best of the `candidates` (`best_starts`, scored by the cell
    fit's `objective` with the rest of `template` held) where it beats both the cell's
    `first` start and its quiet start (a subhalo of log10 mass `quiet` at the cell's
    centre: the smooth model); NaN where there is none. Without `candidates`, `first`
    alone (one start a cell). With `in_tasks` (Dask's workers fit the cells), `first`
    alone too: each cell's task finds its second start itself, on its worker, from the
    pool `start_pool` gives (`task_starts`: the same rows scored by the same program),
    beside the other cells' fits instead of here while the workers wait."""
    todo = [i for i in range(len(centres)) if i not in done]
    if not len(candidates) or not todo or in_tasks:
        if in_tasks and len(candidates) and todo:
            say(f"start grid: the best of {len(candidates)} in each cell's task, on the workers")
        return np.asarray(first, np.float64)[:, None, :]
    t0 = time.perf_counter()
    # the quiet start leads the pool: where it is the best, no candidate beats the smooth
    # model with the macro model held, and the cell gets no second start
    pool = start_pool(candidates, quiet)
    best, _ = best_starts(objective, template, centres[todo], pool, np.asarray(first)[todo])
    second = np.full((len(centres), 3), np.nan)
    for k, i in enumerate(todo):
        second[i] = second_start(best[k], first[i], pool)
    n = int(np.sum(np.isfinite(second[:, 0])))
    say(
        f"start grid: {n} of {len(todo)} cells get a second start, the best of "
        f"{len(candidates)} ({time.perf_counter() - t0:.0f} s)"
    )
    return np.stack([np.asarray(first, np.float64), second], axis=1)


def start_pool(candidates: Float[np.ndarray, "k 3"], quiet: float) -> Float[np.ndarray, "k1 3"]:
    """The rows a cell's start grid scores: the quiet start (a subhalo of log10 mass `quiet`
    at the cell's centre: the smooth model) first, then the `candidates`."""
    return np.concatenate([[[0.0, 0.0, float(quiet)]], np.asarray(candidates, np.float64)])


def second_start(
    best: Float[np.ndarray, " 3"], first: Float[np.ndarray, " 3"], pool: Float[np.ndarray, "k1 3"]
) -> Float[np.ndarray, " 3"]:
    """A cell's second start: its start grid's `best` row, or a NaN row (none) where that is
    the cell's `first` start or the quiet start (`pool`'s first row, `start_pool`): where
    the quiet start is the best, no candidate beats the smooth model with the macro model
    held."""
    if np.array_equal(best, first) or np.array_equal(best, pool[0]):
        return np.full(3, np.nan)
    return np.asarray(best, np.float64)


def task_starts(
    objective: Objective,
    template: Any,
    centre: Float[np.ndarray, " 2"],
    first: Float[np.ndarray, " 3"],
    pool: Float[np.ndarray, "k1 3"],
) -> Float[np.ndarray, "2 3"]:
    """One cell's starts as `cell_starts` gives them: its `first` start and its second
    (`second_start` of the best of `first` and the `pool`'s rows, `best_starts`)."""
    first = np.asarray(first, np.float64)
    best, _ = best_starts(objective, template, np.asarray(centre)[None, :], pool, first[None, :])
    return np.stack([first, second_start(best[0], first, pool)])
