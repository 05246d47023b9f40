"""What `subhalo_scan` returns (`SubhaloScan`) and how its cells' results make one
(`_summary`)."""

import dataclasses
import math
from typing import Any

import numpy as np

from ..cosmology import LensCosmology
from ..solve._laplace import LaplaceEvidence
from ._cells import _finite_or_none
from ._profile import MASS_RANGE, Subhalo


@dataclasses.dataclass(frozen=True)
class SubhaloScan:
    """The outcome of `subhalo_scan`.

    - `centres` (`(n, 2)`, arcsec) and `half` (arcsec): the cells;
    - `log_evidence` (`(n,)`): each cell's Laplace log-evidence (NaN where its fit
      failed); `delta_log_evidence`: minus the smooth model's, `smooth_log_evidence`;
    - `status` (`(n,)` strings: "successful", `MAX_STEPS_STATUS`, or why the cell
      failed), `fits` (each cell's fitted
      model, with the subhalo as the mass's last component; None where it failed);
    - `best_index` (the cell of the largest `delta_log_evidence`); `best`: that cell's
      subhalo (`center_x`, `center_y` arcsec, `log10_mass`, `mass` Msun, its 1-sigma
      errors from the Laplace covariance, `mass_within_1kpc` Msun, `kind`,
      `delta_log_evidence`) as a dict;
    - `delta_log_evidence_grid`: the log-evidence of "a subhalo anywhere on the grid"
      (every cell equally likely: `logsumexp(log E) - log n`) minus the smooth one's;
    - `smooth`: the smooth model; `cosmology`; `wall_time` (s, this run's); `resumed`
      (cells read from the checkpoint); `mass_range`: the subhalo's `log10_mass` prior
      bounds.
    - `refinement`: the refinement of the best cell (`subhalo_scan(refine=n)`), itself a
      `SubhaloScan` over the `n` x `n` sub-cells tiling that cell (None without one). Its
      `delta_log_evidence_grid` is the refined cell's `Delta log E` (a uniform position
      prior over the cell is the mean of the sub-cells' uniform ones: `E(cell) = (1/n^2)
      sum E(sub-cell)`); with a refinement, `best` is its best sub-cell's subhalo (with
      `sub_cell`, `cell` the refined cell, `cell_delta_log_evidence` that cell's refined
      value) and `best_index` still the coarse cell.
    - `polished`: the best subhalo model fitted again over the whole best cell
      (`subhalo_scan(polish=n)`), a one-cell `SubhaloScan` (None without it); where its
      evidence beats the best (sub-)cell's, `best` is its subhalo, with `polished` True.
    - `smooth_gain`: how much the smooth model's log-evidence rose when it was fitted
      again from the best subhalo models' fits with their subhalos removed
      (`subhalo_scan(smooth_starts=...)`; 0 when it did not: the first smooth fit was at
      the best mode); `smooth_log_evidence`, `smooth` and every `delta_log_evidence` are
      against the best of them.
    - `held`: the parameters held at the smooth model's values in both models (a
      pixelized source's hyperparameters, by default: `subhalo_scan`'s `free`).
    - `smooth_errors`: the 1-sigma errors of the smooth model's free parameters (by path)
      from its Laplace evidence, of the smooth model the cells start from (a smooth refit
      that gains moves the values, not these errors).
    """

    centres: np.ndarray
    half: float
    log_evidence: np.ndarray
    delta_log_evidence: np.ndarray
    smooth_log_evidence: float
    status: tuple[str, ...]
    fits: tuple[Any, ...]
    best_index: int
    best: dict[str, Any]
    delta_log_evidence_grid: float
    smooth: Any
    cosmology: LensCosmology
    wall_time: float
    resumed: int
    mass_range: tuple[float, float] = MASS_RANGE
    refinement: "SubhaloScan | None" = None
    polished: "SubhaloScan | None" = None
    smooth_gain: float = 0.0
    held: tuple[str, ...] = ()
    smooth_errors: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def best_fit(self) -> Any:
        """The fitted model of `best` (the polishing fit's where it won, else the best
        sub-cell's with a refinement; None when that cell failed)."""
        if self.polished is not None and self.best.get("polished"):
            return self.polished.fits[0]
        scan = self if self.refinement is None else self.refinement
        return scan.fits[scan.best_index]

    @property
    def failed(self) -> int:
        """The number of cells whose fit or evidence failed."""
        return sum(not s.startswith("successful") for s in self.status)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary (positions in arcsec in the data's frame: x grows with the
        column index, y with the row index, the origin at the image centre unless the
        grid says otherwise; masses in Msun)."""
        return {
            "best": self.best,
            "smooth_log_evidence": self.smooth_log_evidence,
            "smooth_gain": self.smooth_gain,
            "held": list(self.held),
            "smooth_errors": {k: _finite_or_none(v) for k, v in self.smooth_errors.items()},
            "delta_log_evidence_grid": self.delta_log_evidence_grid,
            "z_lens": self.cosmology.z_lens,
            "z_source": self.cosmology.z_source,
            "cell_half_width": self.half,
            "cells": [
                {
                    "center_x": float(c[0]),
                    "center_y": float(c[1]),
                    "log_evidence": _finite_or_none(le),
                    "delta_log_evidence": _finite_or_none(d),
                    "status": s,
                }
                for c, le, d, s in zip(
                    self.centres,
                    self.log_evidence,
                    self.delta_log_evidence,
                    self.status,
                    strict=True,
                )
            ],
            "failed_cells": self.failed,
            "wall_time": self.wall_time,
            "resumed_cells": self.resumed,
            **({} if self.refinement is None else {"refinement": self._refinement_dict()}),
            **({} if self.polished is None else {"polished": self._polished_dict()}),
        }

    def _polished_dict(self) -> dict[str, Any]:
        p = self.polished
        assert p is not None
        return {
            "cell": self.best.get("cell"),
            "cell_half_width": p.half,
            "log_evidence": _finite_or_none(p.log_evidence[0]),
            "delta_log_evidence": _finite_or_none(p.delta_log_evidence[0]),
            "status": p.status[0],
            "chosen": bool(self.best.get("polished")),
            "best": p.best,
        }

    def _refinement_dict(self) -> dict[str, Any]:
        sub = self.refinement
        assert sub is not None
        out = sub.to_dict()
        return {
            "cell": self.best.get("cell"),
            "cell_delta_log_evidence": sub.delta_log_evidence_grid,
            "sub_cell_half_width": out["cell_half_width"],
            "sub_cells": out["cells"],
            "failed_sub_cells": out["failed_cells"],
            "resumed_sub_cells": out["resumed_cells"],
        }


def _summary(
    centres: np.ndarray,
    half: float,
    cells: tuple[np.ndarray, list[str], list[Any], list[dict[str, float]]],
    smooth_ev: LaplaceEvidence,
    kind: str,
    cosmology: LensCosmology,
    mass_range: tuple[float, float],
    resumed: int,
) -> SubhaloScan:
    """The `SubhaloScan` of the cells' results (`_run_cells`); `wall_time` left 0."""
    log_e, status, fits, errors = cells
    n = centres.shape[0]
    delta = log_e - smooth_ev.log_evidence
    ok = np.isfinite(delta)
    if ok.any():
        best_index = int(np.nanargmax(np.where(ok, delta, -np.inf)))
        m = np.max(log_e[ok])
        grid_log_e = m + math.log(np.sum(np.exp(log_e[ok] - m)) / n)
    else:
        best_index, grid_log_e = 0, math.nan
    best = _best(fits[best_index], errors[best_index], kind)
    best["delta_log_evidence"] = _finite_or_none(delta[best_index])
    best["cell"] = best_index
    return SubhaloScan(
        centres=centres,
        half=half,
        log_evidence=log_e,
        delta_log_evidence=delta,
        smooth_log_evidence=smooth_ev.log_evidence,
        status=tuple(status),
        fits=tuple(fits),
        best_index=best_index,
        best=best,
        delta_log_evidence_grid=grid_log_e - smooth_ev.log_evidence,
        smooth=smooth_ev.model,
        cosmology=cosmology,
        wall_time=0.0,
        resumed=resumed,
        mass_range=mass_range,
        smooth_errors={
            n: math.sqrt(max(float(smooth_ev.covariance[k, k]), 0.0))
            for k, n in enumerate(smooth_ev.names)
        },
    )


def _best(model: Any, sigma: dict[str, float], kind: str) -> dict[str, Any]:
    """The best cell's subhalo as a JSON-ready dict, with the 1-sigma errors of its
    Laplace covariance (`sigma`: of `u`, `v` and `log10_mass`)."""
    if model is None:
        return {"kind": kind}
    sub: Subhalo = model.mass.components[-1]
    x, y = (float(c) for c in sub.center)
    log_m = float(sub.log10_mass)
    return {
        "kind": kind,
        "center_x": x,
        "center_y": y,
        "center_x_error": float(sub.half) * sigma.get("u", math.nan),
        "center_y_error": float(sub.half) * sigma.get("v", math.nan),
        "log10_mass": log_m,
        "log10_mass_error": sigma.get("log10_mass", math.nan),
        "mass": 10.0**log_m,
        "mass_definition": "M200 (untruncated NFW)" if kind == "tnfw" else "total mass",
        "mass_within_1kpc": sub.mass_within(1.0),
    }
