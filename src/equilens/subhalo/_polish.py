"""The last step of a subhalo scan (`subhalo_scan(polish=n)`): the best subhalo model's fit
again over the whole best cell, from the best of a fine grid of subhalo positions and
masses.

The refinement's sub-cells bound the subhalo to boxes a fraction of the cell wide; a subhalo
near a sub-cell's edge is fitted with its centre pressed against that bound (a logit
near its end: the fit hardly moves it), and the sub-cell beside it takes a worse
position. On the suite's lens 2 (a 10^9.81 Msun subhalo 0.03" inside a sub-cell's edge)
the best sub-cell put it 0.167" away; the same model with its subhalo re-placed by the
best of a 7 x 7 grid over the cell (8 masses, the rest of the model held) and fitted
again with the subhalo free over the whole cell put it 0.011" away, its objective 99
lower (docs/validation.md). A 5 x 5 grid (0.17" apart on that cell) found it 0.13" away.
"""

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Float

from ._cells import CellSetup
from ._seed import _evaluate_jit, start_candidates

#: The default `polish`: positions a side of the grid over the best cell (7: 0.12" apart
#: on a 0.84" cell, where 5 missed lens 2's subhalo, module docstring).
POLISH_GRID = 7
#: The polishing fit's starts: the grid's best few (its fit keeps the one that ends
#: lowest): on lens 2 the fit from the best start (10^9.5 Msun) ended 73 above the one
#: from the next (10^9.8, beside it), both within 0.06" of the subhalo.
POLISH_STARTS = 2


def check_polish(polish: Any) -> int:
    """`polish` as given, or `ValueError` unless it is 0 (none) or an integer >= 2."""
    if isinstance(polish, bool) or not isinstance(polish, int) or polish < 0 or polish == 1:
        raise ValueError(
            f"polish must be 0 (none) or an integer >= 2 positions a side, got {polish!r}"
        )
    return polish


def cell_template(best: Any, half: float) -> Any:
    """The best subhalo model `best` (a cell's or a sub-cell's fit) as the template of fits
    over cells of half-width `half` (their centres and the subhalo's place set per fit): the
    refinement's sub-cells and the polishing fit's whole cell."""
    dtype = best.mass.components[-1].log10_mass.dtype
    return eqx.tree_at(
        lambda s: (s.mass.components[-1].half, s.mass.components[-1].u, s.mass.components[-1].v),
        best,
        (jnp.asarray(half, dtype), jnp.zeros((), dtype), jnp.zeros((), dtype)),
    )


def polish_start(
    setup: CellSetup,
    centre: np.ndarray,
    n: int,
    masses: Sequence[float],
    mass_range: tuple[float, float],
) -> Float[np.ndarray, "starts 3"]:
    """The starts `(u, v, log10_mass)` of the polishing fit: the `POLISH_STARTS` best, in
    the cell fit's objective with the rest of `setup.template` held, of the `n` x `n`
    positions over the cell at `centre` times `masses` (the template's own subhalo is not
    among them: the point is to leave where its fit stopped); fewer where fewer are
    finite (NaN rows: no start)."""
    candidates = start_candidates(n, masses, mass_range)
    dtype = setup.template.mass.components[-1].log10_mass.dtype
    values = np.asarray(
        _evaluate_jit(
            setup.cell_objective,
            setup.template,
            jnp.asarray(centre, dtype),
            jnp.asarray(candidates, dtype),
        ),
        np.float64,
    )
    order = [int(k) for k in np.argsort(np.where(np.isfinite(values), values, np.inf))]
    rows = np.full((POLISH_STARTS, 3), np.nan)
    for j, k in enumerate(order[:POLISH_STARTS]):
        if np.isfinite(values[k]):
            rows[j] = candidates[k]
    return rows


def polished_best(best: dict[str, Any], polished: dict[str, Any]) -> dict[str, Any] | None:
    """The scan's `best` replaced by the polishing fit's subhalo (`polished`: its `best`,
    as `SubhaloScan.best`) when its evidence beats `best`'s; None when it does not (or the
    fit failed)."""
    delta = polished.get("delta_log_evidence")
    if delta is None or not math.isfinite(delta):
        return None
    if best.get("delta_log_evidence") is not None and not delta > best["delta_log_evidence"]:
        return None
    kept = {k: best[k] for k in ("cell", "cell_delta_log_evidence") if k in best}
    return {**polished, **kept, "sub_cell": None, "polished": True}


def polish_done(
    records: Sequence[Mapping[str, Any]], centre: np.ndarray, half: float
) -> dict[int, Mapping[str, Any]]:
    """The polishing fit's checkpoint record (`{"polish": 0, ...}`) of this cell, if any,
    under its index 0 (`_run_cells`'s `done`)."""
    mine = [
        r
        for r in records
        if "polish" in r
        and np.allclose(r["center"], centre, rtol=0, atol=1e-9)
        and math.isclose(r["half"], half, rel_tol=1e-9)
    ]
    return {0: mine[-1]} if mine else {}


def polished(
    scan: Any,
    setup: CellSetup,
    run: Callable[..., Any],
    summary: Callable[..., Any],
    n: int,
    masses: Sequence[float],
    records: Sequence[Mapping[str, Any]],
    say: Callable[[str], None],
) -> Any:
    """`scan` (a `SubhaloScan`) with its best subhalo model fitted again over the whole best
    cell from the best of an `n` x `n` x `masses` grid there (`subhalo_scan(polish=n)`;
    `run`: the scan's `_run_cells`, `summary`: its `_summary` of one cell's results), the
    fit's `best` taken where its evidence is higher; a record in the checkpoint's `records`
    is read back instead of fitted."""
    centre, half = scan.centres[scan.best_index], scan.half
    polish_setup = setup._replace(template=cell_template(scan.best_fit, half))
    done = polish_done(records, centre, half)
    if done:
        # (the record's values replace everything but the cell: any start in it serves)
        start = np.array([[0.0, 0.0, float(scan.best["log10_mass"])]])
    else:
        start = polish_start(polish_setup, centre, n, masses, scan.mass_range)
    fitted = run(polish_setup, centre[None, :], half, start[None], done, "polish")
    one = summary(centre[None, :], half, fitted, resumed=len(done))
    best = polished_best(scan.best, one.best)
    if best is None:
        say("  polished cell: the best (sub-)cell's fit stands")
        best = {**scan.best, "polished": False}
    return dataclasses.replace(scan, polished=one, best=best)
