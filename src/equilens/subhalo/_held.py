"""The held-mass fits of a subhalo scan (`subhalo_scan(held_cells=n)`): the `n` cells of the
highest log-evidence fitted once more, first with the subhalo's mass held at a heavy value
while the macro model and the subhalo's position are fitted, then with everything free;
a cell keeps the better of its fits.

A heavy subhalo is a mode of its own, away from the smooth model's: the smooth fit takes up
part of the subhalo's mass in the macro model (a steeper slope, another ellipticity), so
that the true subhalo added to the smooth model as it is scores far below it, and a cell fit
started there lowers the subhalo's mass faster than it moves the macro model. On the
suite's lens 2 (a 10^9.81 Msun subhalo; docs/validation.md) every start of the truth's cell
ended at +11.5 against the smooth model, 10^8.9 Msun near the cell's centre, the macro model
unmoved, while the subhalo's mode is about +230: a 10^10 Msun start at the cell's centre
ended at +6.9, one 0.11" from the truth at -12.1. With the mass held at 10^9.5 Msun from the
cell's centre (0.35" from the truth), the fit moved the subhalo to 0.13" from the truth and
the macro model towards the subhalo's mode (slope 2.41 to 2.28), +111.4; freed, +131.3.
Held at 10^9.8 Msun from the same start it stayed where it started (+19.8): the held mass
is a continuation step, not the answer.

A cell whose fit is already far above the smooth model (`HELD_BELOW`) has left it: its
subhalo is heavy and the macro model has moved with it, the mode the held-mass fit is there
to reach; such a cell is not fitted again. The Jackpot's three best cells (+153 to +245)
are such cells, lens 2's truth cell (+11.5) is not.
"""

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import equinox as eqx
import numpy as np

from ..solve import FitResult
from ..solve._parametrise import parametrisation
from ._cells import (
    CellRecord,
    CellSetup,
    _cell_evidence,
    _cell_fit,
    _in_cell,
    _no_worse_than_smooth,
    _rows,
    keep_better,
    records_of,
)

#: `subhalo_scan`'s default `held_cells`: the cells of the highest log-evidence given a
#: held-mass fit (on lens 2 the truth's cell was the second best, +11.5 against +12.5).
HELD_CELLS = 3
#: `subhalo_scan`'s default `held_log10_mass` (log10 Msun): the mass held in the first
#: phase (module docstring: 9.5 reached lens 2's subhalo from its cell's centre, 9.8 did
#: not; the Jackpot's is about 9.5).
HELD_LOG10_MASS = 9.5
#: `subhalo_scan`'s default `held_below`: a cell of the best `held_cells` whose Delta log E
#: over the smooth model is at least this is not fitted again (module docstring; lens 2's
#: held-mass fit of its truth's cell ended at +43.5, its refinement at +214).
HELD_BELOW = 100.0


def check_held(
    cells: Any, log10_mass: Any, mass_range: tuple[float, float], below: Any = HELD_BELOW
) -> None:
    """`ValueError` unless `cells` is an integer >= 0, `log10_mass` lies strictly inside
    `mass_range` and `below` is a number > 0 (`math.inf`: no cell left out)."""
    if isinstance(cells, bool) or not isinstance(cells, int) or cells < 0:
        raise ValueError(f"held_cells must be an integer >= 0 (0: none), got {cells!r}")
    if isinstance(below, bool) or not isinstance(below, int | float) or not below > 0:
        raise ValueError(
            f"held_below must be a number > 0 (Delta log E; inf: every cell), got {below!r}"
        )
    lo, hi = mass_range
    if not (math.isfinite(float(log10_mass)) and lo < float(log10_mass) < hi):
        raise ValueError(
            f"held_log10_mass must lie inside mass_range {mass_range} (log10 Msun), "
            f"got {log10_mass!r}"
        )


def _held_free(
    setup: CellSetup, held: tuple[str, ...] = ("log10_mass",)
) -> tuple[Any, np.ndarray | None]:
    """The first phase's free parameters (the cell's, less the subhalo's fields `held`) and
    its `scale` (the cell's without their entries)."""
    free = setup.free
    for name in held:
        free = eqx.tree_at(lambda m, name=name: getattr(m.mass.components[-1], name), free, False)
    if setup.scale is None:
        return free, None
    param = parametrisation(setup.cell_objective, setup.template, setup.free, setup.bounds)
    names = param.paths(setup.template)
    n_comp = len(setup.template.mass.components)
    out = {f"mass.components[{n_comp - 1}].{name}" for name in held}
    keep = [k for k, n in enumerate(names) if n not in out]
    return free, np.asarray(setup.scale)[keep]


def held_then_free(
    setup: CellSetup, start: Any, held: tuple[str, ...] = ("log10_mass",)
) -> FitResult:
    """The cell's fit from `start` in two phases: the subhalo's fields `held` held while the
    rest is fitted, then everything free from there (from `start` where the first phase
    failed)."""
    first = _cell_fit(setup, start, held=_held_free(setup, held))
    return _cell_fit(setup, first.model if math.isfinite(float(first.value)) else start)


def held_task(
    setup: CellSetup, centre: np.ndarray, at: np.ndarray, pool: np.ndarray | None = None
) -> CellRecord:
    """One cell's held-mass fit (`_cells._cell_task`'s signature; `pool` unused): from
    `at`'s first row `(u, v, log10_mass)`, the macro model and the subhalo's `u`, `v` fitted
    with its `log10_mass` held, then everything free from there; the quiet start's fit
    instead where it ends better (`_no_worse_than_smooth`); its evidence."""
    del pool
    dtype = setup.template.mass.components[-1].log10_mass.dtype
    start = _in_cell(setup.template, centre, _rows(at)[0], dtype)
    fitted = _no_worse_than_smooth(held_then_free(setup, start), start, setup)
    return _cell_evidence(setup.objective, fitted, setup.free, setup.bounds, setup.evidence)


def held_done(
    records: Sequence[Mapping[str, Any]], centres: np.ndarray, half: float
) -> dict[int, Mapping[str, Any]]:
    """The held-mass fits' checkpoint records of the cells `centres` (`_cells.records_of`)."""
    return records_of(records, "held", centres, half)


def held_fits(
    cells: tuple[np.ndarray, list[str], list[Any], list[dict[str, float]]],
    setup: CellSetup,
    centres: np.ndarray,
    half: float,
    run: Callable[..., Any],
    n: int,
    log10_mass: float,
    records: Sequence[Mapping[str, Any]],
    say: Callable[[str], None],
    *,
    smooth: float,
    below: float = HELD_BELOW,
) -> tuple[np.ndarray, list[str], list[Any], list[dict[str, float]]]:
    """The cells' results (`_run_cells`'s) with those of the `n` of the highest
    log-evidence less than `below` over the `smooth` model's log-evidence fitted again by
    `held_task` (the mass held at `log10_mass`, each from its cell's centre; `run`: the
    scan's `_run_cells`), a cell's result replaced where the held-mass fit's evidence is
    higher; a record in the checkpoint's `records` is read back instead of fitted."""
    log_e = cells[0]
    finite = [i for i in range(len(log_e)) if math.isfinite(float(log_e[i]))]
    best = sorted(finite, key=lambda i: -float(log_e[i]))[:n]
    top = [i for i in best if float(log_e[i]) - smooth < below]
    for i in best:
        if i not in top:
            say(
                f"  cell {i + 1}: Delta log E {float(log_e[i]) - smooth:.2f}, at least "
                f"{below:g}: no held-mass fit"
            )
    if not top:
        return cells
    chosen = centres[top]
    starts = np.tile([0.0, 0.0, float(log10_mass)], (len(top), 1))[:, None, :]
    done = held_done(records, chosen, half)
    which = f"the {len(top)}" if len(top) == len(best) else f"{len(top)} of the {len(best)}"
    say(f"held-mass fits of {which} best cells (log10 mass {log10_mass} held first)")
    again = run(setup, chosen, half, starts, done, "held", task=held_task)
    return keep_better(cells, top, again, say, "the held-mass fit")
