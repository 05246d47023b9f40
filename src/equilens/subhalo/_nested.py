"""`subhalo_evidence`: the evidence difference of a scan's best cell by nested sampling, with
its error, and the subhalo's posterior.

The scan ranks cells by the Laplace approximation; a detection is quoted with nested
sampling of both models (nautilus, `equilens.nested_sample`) under the same priors: the
subhalo's `log10_mass` uniform over the scan's `mass_range` (log-uniform in mass), its
position uniform over the cell, and each parameter the two models share uniform over the
same interval, the union of both fits' `value +- box_width sigma` (their Laplace errors),
so that these priors cancel in the difference as long as the posteriors lie inside them.
"""

import dataclasses
import functools
import math
import time
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree
from jaxtyping import PyTree

from ..objective import Objective
from ..objective._params import Bounds, Where
from ..solve._laplace import laplace_evidence
from ..solve._nested import NestedPosterior, nested_sample
from ..solve._parametrise import parametrisation
from ..terms import LogEvidence
from ._profile import Subhalo
from ._scan import SubhaloScan, _free_with_subhalo, _SubhaloField, scan_free

#: The 16th, 50th and 84th percentiles quoted for the subhalo's posterior.
PERCENTILES = (0.16, 0.5, 0.84)


@dataclasses.dataclass(frozen=True)
class SubhaloEvidence:
    """The outcome of `subhalo_evidence`.

    - `delta_log_evidence`, `delta_log_evidence_error`: `log Z(subhalo) - log Z(smooth)`
      by nested sampling and its statistical error (both runs' in quadrature);
      `laplace_delta_log_evidence`: the scan's Laplace value for the same cell;
    - `cell`: the cell's index in the scan (in its refinement's sub-cells when the best
      sub-cell was sampled);
    - `subhalo`: the subhalo's posterior: `center_x`, `center_y` (arcsec), `log10_mass`
      and `mass_within_1kpc` (Msun), each as `[p16, p50, p84]`;
    - `smooth`, `with_subhalo`: the two `NestedPosterior`s; `wall_time` (s).
    """

    delta_log_evidence: float
    delta_log_evidence_error: float
    laplace_delta_log_evidence: float
    cell: int
    subhalo: dict[str, list[float]]
    smooth: NestedPosterior
    with_subhalo: NestedPosterior
    wall_time: float

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary (plain numbers; both runs' parameter tables)."""
        return {
            "method": "nested sampling (nautilus) of both models, the same priors",
            "cell": self.cell,
            "delta_log_evidence": self.delta_log_evidence,
            "delta_log_evidence_error": self.delta_log_evidence_error,
            "laplace_delta_log_evidence": self.laplace_delta_log_evidence,
            "subhalo": self.subhalo,
            "percentiles": list(PERCENTILES),
            "smooth": self.smooth.to_dict(),
            "with_subhalo": self.with_subhalo.to_dict(),
            "wall_time": self.wall_time,
        }


def subhalo_evidence(
    scan: SubhaloScan,
    objective: Objective,
    *,
    cell: int | None = None,
    free: PyTree[bool] | None = None,
    bounds: Mapping[Where, Bounds] | None = None,
    box_width: float = 10.0,
    n_live: int = 1000,
    n_eff: int = 3000,
    n_networks: int = 2,
    seed: int = 0,
    processes: int | None = None,
    progress: bool = False,
) -> SubhaloEvidence:
    """Nested sampling of the smooth model and of cell `cell`'s model (default the scan's
    best: the polishing fit where it won, `SubhaloScan.polished`, else the best sub-cell of
    its refinement when it has one, `SubhaloScan.refinement`, whose index `cell` then
    is) under the same priors (module docstring): the evidence difference with its error,
    the subhalo's posterior.

    **Arguments:**

    - `scan`, `objective`: the `SubhaloScan` and the objective it was run with (its
      `GaussianPrior` and `UniformPrior` terms are priors, as in `nested_sample`, the rest
      the likelihood; a `LogEvidence` marginalises a pixelized source); `free`, `bounds`:
      those the scan was given (the same default: a pixelized source's hyperparameters
      held, `scan_free`).
    - `box_width`: each shared parameter's prior interval spans both fits' values +-
      `box_width` of their Laplace errors (inside its bounds).
    - `n_live`, `n_eff`, `n_networks`, `seed`, `processes`, `progress`: as in
      `equilens.nested_sample` (one likelihood process per CPU core by default).

    Needs `nautilus-sampler` (`pip install equilens[sampling]`). Returns a
    `SubhaloEvidence`."""
    t0 = time.perf_counter()
    if cell is None and scan.polished is not None and scan.best.get("polished"):
        scan = scan.polished  # the polishing fit over the best cell, where it won
    elif cell is None and scan.refinement is not None:
        scan = scan.refinement  # the best sub-cell of the refined cell
    cell = scan.best_index if cell is None else int(cell)
    if not 0 <= cell < len(scan.fits):
        raise ValueError(f"subhalo_evidence: cell must be in [0, {len(scan.fits)}), got {cell}")
    model = scan.fits[cell]
    if model is None:
        raise ValueError(f"subhalo_evidence: cell {cell} failed in the scan ({scan.status[cell]})")
    if not (math.isfinite(float(box_width)) and float(box_width) > 0):
        raise ValueError(f"subhalo_evidence: box_width must be > 0, got {box_width}")
    smooth = scan.smooth
    n_comp = len(model.mass.components)
    free, _ = scan_free(objective, smooth, free, bounds)
    sub_free = _free_with_subhalo(objective, smooth, free, bounds, model)
    sub_bounds = {**(bounds or {}), _SubhaloField(n_comp - 1, "log10_mass"): scan.mass_range}

    # the shared parameters' intervals: both fits' values +- box_width Laplace errors
    prefix = f"mass.components[{n_comp - 1}]."
    shared = shared_intervals(
        objective, [(smooth, free, bounds), (model, sub_free, sub_bounds)], box_width, prefix
    )
    run = functools.partial(
        nested_sample,
        objective,
        intervals=shared,
        n_live=n_live,
        n_eff=n_eff,
        n_networks=n_networks,
        seed=seed,
        processes=processes,
        progress=progress,
    )
    post_smooth = run(smooth, free=free, bounds=bounds)
    post_sub = run(model, free=sub_free, bounds=sub_bounds)
    delta = post_sub.log_evidence - post_smooth.log_evidence
    err = math.hypot(post_sub.log_evidence_error, post_smooth.log_evidence_error)
    q = post_sub.quantiles(PERCENTILES)
    sub: Subhalo = model.mass.components[-1]
    col = {c: post_sub.names.index(prefix + c) for c in ("u", "v", "log10_mass")}
    half = float(sub.half)
    # (the mass within 1 kpc of its centre grows with the mass alone: its quantiles are
    # the mass's)
    mass_q = [
        eqx.tree_at(lambda s: s.log10_mass, sub, jnp.asarray(lm)).mass_within(1.0)
        for lm in q[:, col["log10_mass"]]
    ]
    summary = {
        "center_x": [float(sub.cell_x) + half * float(u) for u in q[:, col["u"]]],
        "center_y": [float(sub.cell_y) + half * float(v) for v in q[:, col["v"]]],
        "log10_mass": [float(v) for v in q[:, col["log10_mass"]]],
        "mass_within_1kpc": [float(v) for v in mass_q],
    }
    return SubhaloEvidence(
        delta_log_evidence=float(delta),
        delta_log_evidence_error=float(err),
        laplace_delta_log_evidence=float(scan.delta_log_evidence[cell]),
        cell=cell,
        subhalo=summary,
        smooth=post_smooth,
        with_subhalo=post_sub,
        wall_time=time.perf_counter() - t0,
    )


def shared_intervals(
    objective: Objective, models: list[tuple[Any, Any, Any]], box_width: float, prefix: str
) -> dict[str, tuple[float, float]]:
    """The prior intervals of the parameters `models` (`(model, free, bounds)` each) share
    outside the subhalo's (names starting with `prefix`): the union over the models of
    each fit's value +- `box_width` of its Laplace error (`subhalo_evidence`'s priors)."""
    smoothed = any(isinstance(t, LogEvidence) for t in objective.terms)
    evidence = functools.partial(laplace_evidence, smoothed=smoothed)
    intervals: dict[str, tuple[float, float]] = {}
    for m, f, b in models:
        ev = evidence(objective, m, free=f, bounds=b)
        values = _values(objective, ev.model, f, b)
        sd = np.sqrt(np.maximum(np.diagonal(ev.covariance), 0.0))
        for name, v, s in zip(ev.names, values, sd, strict=True):
            lo, hi = v - box_width * s, v + box_width * s
            if name in intervals:
                lo, hi = min(lo, intervals[name][0]), max(hi, intervals[name][1])
            intervals[name] = (lo, hi)
    return {k: v for k, v in intervals.items() if not k.startswith(prefix)}


def _values(objective: Objective, model: Any, free: Any, bounds: Any) -> np.ndarray:
    """The free parameters' physical values of `model`, in the order of its names."""
    param = parametrisation(objective, model, free, bounds)
    return np.asarray(ravel_pytree(param.values(model))[0], np.float64)
