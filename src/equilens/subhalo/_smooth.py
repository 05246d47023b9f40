"""The smooth model fitted again after a subhalo scan's cells, from the best subhalo
models' fits with their subhalos removed (`subhalo_scan(smooth_starts=...)`), and the
scan rebased on the best smooth mode found."""

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import equinox as eqx

from .._lens_system import LensSystem
from ..mass import MassSum
from ..objective import Objective
from ..objective._params import Bounds, Where
from ..solve._laplace import LaplaceEvidence
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
    scan: "SubhaloScan", n: int, say: Callable[[str], None], objective: Objective, *fit: Any
) -> "SubhaloScan":
    """`scan` against the best of its smooth model and the smooth model fitted again from
    the subhalo fits of the `n` best cells (`_best_fits`) with their subhalos removed
    (`_smooth_again`, `fit` its arguments after the start): a cell fit (the macro model
    refitted) can reach a better mode of the smooth model's own parameters than its fit
    did, and the comparison is of each model at the best mode found from several starts."""
    best = None
    for k, start in enumerate(_best_fits(scan, n)):
        again = _smooth_again(objective, start, *fit)
        shown = (
            "failed" if again is None else f"{again.log_evidence - scan.smooth_log_evidence:+.2f}"
        )
        say(f"smooth model refitted from cell fit {k + 1} of {n}: log evidence {shown}")
        if again is not None and (best is None or again.log_evidence > best.log_evidence):
            best = again
    if best is None or not best.log_evidence > scan.smooth_log_evidence:
        return scan
    gain = best.log_evidence - scan.smooth_log_evidence
    say(f"smooth model's best refit: log evidence +{gain:.2f}")
    return _rebased(scan, best)


def _best_fits(scan: "SubhaloScan", n: int) -> list[Any]:
    """The fitted subhalo models of the `n` cells of the highest log-evidence, one fit a
    cell (the refined cell's the best of its own fit and its sub-cells'): starts from
    different cells, whose macro models differ more than those of one cell's sub-cells
    (fewer where fewer cells' fits succeeded)."""

    def ok(le: Any, fit: Any) -> bool:
        return fit is not None and math.isfinite(float(le))

    entries = {
        i: (float(le), fit)
        for i, (le, fit) in enumerate(zip(scan.log_evidence, scan.fits, strict=True))
        if ok(le, fit)
    }
    sub = scan.refinement
    if sub is not None:
        own = [entries[scan.best_index]] if scan.best_index in entries else []
        pairs = zip(sub.log_evidence, sub.fits, strict=True)
        best = max([*own, *((float(le), f) for le, f in pairs if ok(le, f))], key=lambda p: p[0])
        entries[scan.best_index] = best
    ranked = sorted(entries.values(), key=lambda p: -p[0])
    return [fit for _, fit in ranked[:n]]


def _smooth_again(
    objective: Objective,
    model: LensSystem,
    solver: str,
    free: Any,
    bounds: Mapping[Where, Bounds] | None,
    max_steps: int,
    evidence: Callable[..., LaplaceEvidence],
) -> LaplaceEvidence | None:
    """The smooth model's evidence from a fit started at `model` (a cell's fit) without its
    subhalo; None when that fit or its evidence fails."""
    comps = model.mass.components[:-1]  # pyright: ignore[reportAttributeAccessIssue]
    start = eqx.tree_at(lambda s: s.mass, model, MassSum(tuple(comps)))
    r = _fit(objective, start, solver, free, bounds, max_steps)
    if not math.isfinite(float(r.value)):
        return None
    try:
        ev = evidence(objective, _as_sum(r.model), free=free, bounds=bounds)
    except ValueError:
        return None
    return ev if math.isfinite(ev.log_evidence) else None


def _rebased(scan: "SubhaloScan", smooth_ev: LaplaceEvidence) -> "SubhaloScan":
    """`scan` (and its refinement) against the smooth model of `smooth_ev` (a higher
    evidence than the one it was computed against), `smooth_gain` recording the rise."""
    gain = smooth_ev.log_evidence - scan.smooth_log_evidence

    def less(v: Any) -> Any:
        return None if v is None else v - gain

    def one(sc: "SubhaloScan") -> "SubhaloScan":
        best = dict(sc.best)
        for key in ("delta_log_evidence", "cell_delta_log_evidence"):
            if key in best:
                best[key] = less(best[key])
        return dataclasses.replace(
            sc,
            delta_log_evidence=sc.log_evidence - smooth_ev.log_evidence,
            delta_log_evidence_grid=sc.delta_log_evidence_grid - gain,
            smooth_log_evidence=smooth_ev.log_evidence,
            smooth=smooth_ev.model,
            best=best,
            smooth_gain=sc.smooth_gain + gain,
        )

    sub = None if scan.refinement is None else one(scan.refinement)
    return dataclasses.replace(one(scan), refinement=sub)
