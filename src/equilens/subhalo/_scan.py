"""`subhalo_scan`: the search for a dark subhalo by Bayesian model comparison, cell by cell
over the arcs (Vegetti et al. 2010; PyAutoLens's grid search).

For each cell of a grid over the mask, the smooth model plus a `Subhalo` confined to the
cell (its mass log-uniform over its bounds) is fitted (the macro model refitted with it),
and its evidence is compared with the smooth model's: `Delta log E = log E(cell) - log
E(smooth)`, each by the Laplace approximation over every free parameter
(`equilens.solve.laplace_evidence`; with a pixelized source the objective is already the
source-marginalised `LogEvidence`). The cells are one compiled fit with other values (the
cell is a fixed field of the `Subhalo`, its bounds fixed in cell units), fitted one after
another; a scan given `checkpoint=` writes each cell as it finishes and, run again,
resumes from the cells written.
"""

import dataclasses
import functools
import json
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.sharding import Mesh
from jaxtyping import Float, PyTree

from .._lens_system import LensSystem
from ..cosmology import LensCosmology
from ..mass import MassSum, MultiPlane
from ..objective import Objective
from ..objective._params import Bounds, Where
from ..solve import FitResult
from ..solve._batch import BatchRoute
from ..solve._laplace import laplace_evidence
from ..solve._parametrise import parametrisation
from ..source import PixelizedSource
from ..terms import LogEvidence, LogisticPrior
from ._cells import (
    CHECKPOINT_FORMAT,
    QUIET_DEX,
    CellSetup,
    _finite_or_none,
    _fit,
    _read_checkpoint,
    _run_cells,
    cell_scale,
    fit_plateau,
)
from ._grid import grid_cells, tile
from ._held import HELD_BELOW, HELD_CELLS, HELD_LOG10_MASS, check_held, held_fits
from ._polish import POLISH_GRID, cell_template, check_polish, polished
from ._profile import MASS_RANGE, Subhalo, SubhaloKind
from ._result import SubhaloScan, _summary
from ._searched import SEARCHED_CELLS, check_searched, searched_fits
from ._seed import START_MASSES, cell_starts, start_candidates, start_pool
from ._smooth import _as_sum, early_refits, smooth_refits

#: The rounds of the smoothed curvature (`laplace_evidence(smoothing_rounds=)`) of the
#: scan's evidences after the smooth model's, which start from the smooth model's errors
#: (its own takes `laplace_evidence`'s default 3, from the gradient's differences).
SMOOTHING_ROUNDS = 2


@dataclasses.dataclass(frozen=True)
class _SubhaloField:
    """`where` function of the subhalo's field `name` (the mass's component `index`): a
    value, not a closure, so that it pickles (Dask) and equal ones hash alike (the
    programs a worker compiled for one cell serve the next)."""

    index: int
    name: str

    def __call__(self, model: Any) -> Any:
        return getattr(model.mass.components[self.index], self.name)


def with_subhalo(model: LensSystem, subhalo: Subhalo) -> LensSystem:
    """`model` with `subhalo` added as the last component of its mass (a `MassSum`)."""
    mass = model.mass
    if isinstance(mass, MultiPlane):
        raise TypeError("subhalo_scan takes a single-plane mass model, not a MultiPlane")
    comps = mass.components if isinstance(mass, MassSum) else (mass,)
    return eqx.tree_at(lambda s: s.mass, model, MassSum((*comps, subhalo)))


def scan_free(
    objective: Objective,
    smooth: LensSystem,
    free: PyTree[bool] | Callable[[Any], bool] | None,
    bounds: Mapping[Where, Bounds] | None,
) -> tuple[PyTree[bool] | Callable[[Any], bool] | None, tuple[str, ...]]:
    """The free parameters of a scan's smooth model, and the parameters held at their
    values: `free` as given; for None, what `equilens.fit` frees, less a pixelized
    source's mesh and regularization parameters (its hyperparameters, held at the smooth
    model's values: the smooth and subhalo models are then compared under one source
    prior, as PyAutoLens's search holds those its source pipeline chose; freed, an
    adaptive regularization's three left the evidence's Hessian singular)."""
    if free is not None:
        return free, ()
    param = parametrisation(objective, smooth, None, bounds, check=False)
    is_pix = lambda x: isinstance(x, PixelizedSource)
    hyper: list[bool] = []
    for node in jtu.tree_leaves(smooth, is_leaf=is_pix):
        hyper.extend([is_pix(node)] * (len(jtu.tree_leaves(node)) if is_pix(node) else 1))
    if not any(f and h for f, h in zip(param.free, hyper, strict=True)):
        return None, ()
    flags = [f and not h for f, h in zip(param.free, hyper, strict=True)]
    held = tuple(
        path.lstrip(".")
        for path, f, h in zip(param.leaf_paths, param.free, hyper, strict=True)
        if f and h
    )
    return jtu.tree_unflatten(jtu.tree_structure(smooth), flags), held


def _free_with_subhalo(
    objective: Objective,
    smooth: LensSystem,
    free: Any,
    bounds: Mapping[Where, Bounds] | None,
    model: LensSystem,
) -> PyTree[bool]:
    """The free leaves of the subhalo model: the smooth model's, and the subhalo's."""
    param = parametrisation(objective, smooth, free, bounds, check=False)
    flags = dict(zip(param.leaf_paths, param.free, strict=True))
    prefix = f".mass.components[{len(model.mass.components) - 1}]"  # pyright: ignore[reportAttributeAccessIssue]
    own = tuple(prefix + name for name in (".log10_mass", ".u", ".v"))
    leaves = []
    for p, _ in jtu.tree_flatten_with_path(model)[0]:
        key = jtu.keystr(p)
        leaves.append(key in own if key.startswith(prefix + ".") else flags.get(key, False))
    return jtu.tree_unflatten(jtu.tree_structure(model), leaves)


def _subhalo_mass(block: np.ndarray) -> np.ndarray:
    """A subhalo's mass (Msun) from its block's values (`u`, `v`, `log10_mass` rows): the
    size of the macro model's response to it (`laplace_evidence(block_response=...)`)."""
    return 10.0 ** np.asarray(block)[:, 2]


def subhalo_scan(
    objective: Objective,
    smooth: LensSystem | FitResult,
    cosmology: LensCosmology,
    *,
    grid: int | Float[np.ndarray, "cells 2"] = 5,
    half: float | None = None,
    kind: SubhaloKind = "tnfw",
    mass_range: tuple[float, float] = MASS_RANGE,
    start_log10_mass: float = 9.0,
    start_grid: int = 3,
    start_masses: Sequence[float] = START_MASSES,
    host_theta_E: float | None = None,
    free: PyTree[bool] | Callable[[Any], bool] | None = None,
    bounds: Mapping[Where, Bounds] | None = None,
    solver: str | None = None,
    max_steps: int = 500,
    fit_tolerance: float | None = None,
    precondition: bool = True,
    smoothed: bool | None = None,
    refit_smooth: bool = True,
    smooth_starts: int = 3,
    held_cells: int = HELD_CELLS,
    held_log10_mass: float = HELD_LOG10_MASS,
    held_below: float = HELD_BELOW,
    searched_cells: int = SEARCHED_CELLS,
    refine: int = 2,
    polish: int = POLISH_GRID,
    subhalo_samples: int = 0,
    checkpoint: str | os.PathLike | None = None,
    client: Any = None,
    route: BatchRoute = "auto",
    mesh: Mesh | None = None,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
) -> SubhaloScan:
    """Scans a grid of cells for a subhalo (module docstring): each cell's fit of the smooth
    model plus a `Subhalo` confined to it, ranked by the evidence against the smooth model.

    **Arguments:**

    - `objective`: the fit's objective (a `GaussianLikelihood` for a parametric source, a
      `LogEvidence` for a pixelized one, priors beside); its first imaging term's mask
      sets the default grid.
    - `smooth`: the fitted smooth model (or its `FitResult`); its mass must be one plane
      (a profile or a `MassSum`).
    - `cosmology`: the lens's `LensCosmology` (redshifts: the subhalo's mass scale).
    - `grid`: `n` for an `n` x `n` grid over the mask (cells holding no masked pixel
      dropped: `scan_cells`), or an `(m, 2)` array of cell centres (arcsec) with `half`
      their half-width.
    - `kind`: the subhalo's profile, `"tnfw"` or `"pseudo_jaffe"` (`Subhalo`);
      `mass_range`: its `log10_mass` bounds (log10 Msun, the log-uniform prior; default
      `MASS_RANGE`, 1e6-1e11); `start_log10_mass`: each cell fit's start (a fit that
      ends worse than the cell model with a negligible subhalo, `QUIET_DEX` above the
      lower bound, is done again from there and the better kept: a subhalo model holds
      the smooth one); `start_grid`, `start_masses`: each cell is also fitted from a
      second start, the best (by the cell fit's objective, the macro model and source
      held at the smooth fit) of the subhalo at the centres of `start_grid` x
      `start_grid` sub-squares of the cell times `start_masses` (log10 Msun, those inside
      `mass_range`), where it beats both the start above and the smooth model (a quiet
      subhalo), and the better of the two fits is kept (a global search over the
      subhalo where a local fit stops in the nearest of a rough evidence's local optima;
      neither start is better everywhere: `equilens.subhalo._seed`, docs/subhalo.md);
      default 3; 0: one start, the cell's centre at `start_log10_mass`. The grid's start
      needs the smooth model at its mode, as `refit_smooth` makes
      it: far from it, a heavy subhalo can stand in for the macro model's error);
      `host_theta_E`: the host's Einstein radius (arcsec) for the
      subhalo's truncation, default the smooth model's first mass component's `theta_E`.
    - `free`, `bounds`: the smooth model's free parameters and their bounds (as in
      `equilens.fit`; the subhalo's `log10_mass`, `u` and `v` are added); the same for
      both models, so their shared priors cancel in the comparison. Default: `fit`'s,
      less a pixelized source's mesh and regularization parameters, held at the smooth
      model's values (`scan_free`; listed in `SubhaloScan.held`). `bounds` `where`
      functions see the model with its mass as a `MassSum`.
    - `solver`: default `"lm"` for a least-squares objective, else `"bfgs"`;
      `max_steps` per cell.
    - `fit_tolerance`: every fit of the scan (the cells', the smooth model's refits) also
      stops when it has gained less than `fit_tolerance` (log-evidence units) over its last
      `PLATEAU_STEPS` (10) steps (`equilens.fit`'s `plateau`; `_cells.fit_plateau`).
      Default `FIT_TOLERANCE` (0.5) when the objective has a `LogEvidence` term, whose
      roughness on small scales keeps a fit at `fit`'s default tolerances stepping by
      thousandths of an error for hundreds of steps for gains of a few tenths in all
      (docs/subhalo.md); else none. 0: none (`fit`'s tolerances alone).
    - `precondition`: fit each cell in units of the smooth model's errors (`equilens.fit`'s
      `scale`: its Laplace evidence's `raw_errors`, `SUBHALO_SCALE` for the subhalo's
      parameters), where a quasi-Newton solver's unit first Hessian is about right: the
      same minima in fewer steps (measured in docs/performance.md). Default True.
    - `smoothed`: the evidence's Hessian from its values over 1-sigma steps
      (`laplace_evidence(smoothed=True)`: for an evidence rough on small scales, a
      pixelized source's); default True when the objective has a `LogEvidence` term.
      The smooth model's takes `laplace_evidence`'s defaults; every later one (cells,
      sub-cells, refits) starts its steps from the smooth model's errors (the subhalo's
      from the gradient's differences) and takes `SMOOTHING_ROUNDS` (2) rounds: a third
      less time for the same evidences to within what the start alone moves them
      (docs/subhalo.md).
    - `subhalo_samples`: the points of the importance sampling that corrects each cell's
      Laplace evidence for the shape of its integrand along the subhalo's `u`, `v` and
      `log10_mass` (`laplace_evidence(block=...)`): a subhalo the data do not want
      leaves them flat, or its mass bounded from above only, where the Laplace
      approximation's Gaussian (its curvature the objective's roughness) charges an
      Occam penalty of several for nothing (a Jackpot cell: -8.2 against nested
      sampling's +0.2). At each point the macro model is tried where the cell's fit has
      it, at the Laplace Gaussian's conditional mode, and on the line from the smooth
      model's through the fit's, as far along it as the subhalo's mass is of the fit's
      (the macro model's response to a light subhalo; that cell: -1.1), the best taken;
      three values a point. A mode the cell's fit missed stays missed; docs/subhalo.md.
      Default 0: the Laplace approximation alone; `BLOCK_SAMPLES` (256) is the measured
      setting.
    - `refit_smooth`: first fit the smooth model again with this objective, `solver`,
      `free`, `bounds` and `max_steps`, as the cells are fitted (default True: `smooth`
      may come from a fit with other terms, a positions guard, or another stopping
      point, which would shift every cell's `Delta log E` alike); the cells start from it.
    - `smooth_starts`: after the cells, the smooth model is fitted again from the fits of
      the `smooth_starts` cells of the highest log-evidence (one fit a cell, the refined
      cell's the best of its own and its sub-cells'), each with its subhalo removed, and
      the best of these and the first smooth fit is the one compared against
      (`SubhaloScan.smooth_gain`): a cell's fit, the macro model refitted beside a
      subhalo, can reach a better mode of the smooth model's own parameters than the
      smooth fit did, and the subhalo model is already the best of many fits (one a
      cell), so the smooth one gets several starts too. 0 for none (every `Delta log E`
      then against the first smooth fit). With a `client` the refits run side by side on
      its workers; each is written to `checkpoint` as it finishes, and a resumed scan
      does not run it again.
    - `held_cells`, `held_log10_mass`: after the cells, the `held_cells` cells of the
      highest log-evidence are fitted once more from their centres, first with the
      subhalo's mass held at `held_log10_mass` (log10 Msun, inside `mass_range`) while the
      macro model and the subhalo's position are fitted, then with everything free; a cell
      keeps the better of its fits (`equilens.subhalo._held`): a heavy subhalo whose mass
      the smooth fit took up in its macro model (a steeper slope) is a mode a fit started
      beside the smooth model does not reach, as it lowers the subhalo's mass sooner than it
      moves the macro model (the suite's lens 2: +11.5 from every start of the truth's
      cell, +131 from the held-mass fit; docs/validation.md). Default 3 and 9.5; 0 cells:
      none.
    - `held_below`: of those cells, one whose Delta log E over the smooth model is at least
      this is not fitted again: its fit has already left the smooth model for a heavy
      subhalo's mode (default 100: the Jackpot's three best cells, +153 to +245, are
      left as they are; `math.inf`: every one fitted again).
    - `searched_cells`: then the `searched_cells` cells of the highest log-evidence are
      fitted once more from a global search (`equilens.subhalo._searched`): the smooth
      model's mass plus the cell's subhalo with a parametric `Sersic` source (in place of a
      pixelized one), searched by chi^2 as the smooth model's fit began (`fit_lens`'s
      search: Einstein radius, ellipticity, shear, and here the slope and the subhalo's
      position and mass too), the cell then fitted with this objective from the searched
      mass; a cell keeps the better of its fits. A heavy subhalo can pull the smooth fit
      far from the truth's macro model (the suite's lens 4: slope 1.54 for 2.07), and no
      local fit reaches the subhalo's mode from there (a pixelized source follows the
      wrong macro model); a parametric source cannot, and the search finds the slope and
      the subhalo together (lens 4: 0.008" from the truth, where the cells' fits ended
      0.48" off; docs/validation.md). Needs an objective with an imaging term. Default 3;
      0: none.
    - `refine`: the best cell is then tiled by `refine` x `refine` sub-cells (half-width
      `half / refine`), each fitted as a cell from the best cell's fit (the sub-cell
      holding its subhalo from its position): a cell's fit can stop in a local minimum
      away from a subhalo near its edge or corner, and the smaller boxes locate it
      (`SubhaloScan.refinement`; `best` is then the best sub-cell's subhalo). Default 2
      (on the Jackpot the same subhalo as with 3, to 2e-5", in 4 sub-cells' fits instead
      of 9: the polishing fit after it places the subhalo over the whole cell); 0 for
      none.
    - `polish`: last, the best subhalo model (the best sub-cell's, or cell's) is fitted
      again with its subhalo free over the whole best cell, from the best of `polish` x
      `polish` positions over that cell times `start_masses` (the rest of the model held
      at that fit): a sub-cell's bounds can hold a subhalo near its edge away from its
      place (docs/subhalo.md); kept as `best` where its evidence is higher
      (`SubhaloScan.polished`). 0 for none.
    - `checkpoint`: a JSON-lines file each finished cell (and sub-cell) is appended to; a
      scan run again with the same file and set-up skips the cells it holds (a file from
      another set-up is a `ValueError`).
    - `client`: a Dask `distributed.Client` (PyPI `distributed`, the extra `cluster`): the
      cells are its tasks, run on its workers as they are free (a `LocalCluster`, or a
      SLURM/PBS cluster through `dask-jobqueue`: docs/subhalo.md), each worker compiling
      the cell fit once; the cells are written to `checkpoint` as they finish. Default
      None: the cells in this process (`route`). On a multi-core machine a
      `LocalCluster` of one-thread workers can be the faster route (measured in
      docs/performance.md: 2.4x on 2 cores for a small lens).
    - `route`, `mesh`: without a client, how the cells' fits run (`fit_batch`'s
      `batch_route`): `"loop"` (one compiled fit after another: the default on a CPU,
      where it is faster), `"vmap"` (every cell's fit in one vectorised program: the
      default on an accelerator; `mesh`, a one-axis `jax.sharding.Mesh`, splits the cells
      over its devices); the evidences follow one cell after another.
    - `progress`: a progress bar over the cells; `log`: a function for one line per cell.

    Returns a `SubhaloScan`. A cell whose fit fails is recorded as failed (NaN evidence),
    never raised; the smooth model's evidence failing raises `RuntimeError`."""
    t0 = time.perf_counter()
    if isinstance(smooth, FitResult):
        smooth = smooth.model
    if not isinstance(smooth, LensSystem):
        raise TypeError(f"subhalo_scan needs a LensSystem, got {type(smooth).__name__}")
    lo, hi = (float(v) for v in mass_range)
    if not lo < hi:
        raise ValueError(f"mass_range must have lower < upper (log10 Msun), got {mass_range}")
    if not lo < float(start_log10_mass) < hi:
        raise ValueError(f"start_log10_mass must be inside mass_range {mass_range}")
    if isinstance(start_grid, bool) or not isinstance(start_grid, int) or start_grid < 0:
        raise ValueError(f"start_grid must be 0 (none) or a positive integer, got {start_grid!r}")
    candidates = (
        start_candidates(start_grid, start_masses, (lo, hi)) if start_grid else np.zeros((0, 3))
    )
    if isinstance(smooth_starts, bool) or not isinstance(smooth_starts, int) or smooth_starts < 0:
        raise ValueError(f"smooth_starts must be an integer >= 0, got {smooth_starts!r}")
    if isinstance(refine, bool) or not isinstance(refine, int) or refine < 0 or refine == 1:
        raise ValueError(
            f"refine must be 0 (none) or an integer >= 2 sub-cells a side, got {refine!r}"
        )
    check_polish(polish)
    check_held(held_cells, held_log10_mass, (lo, hi), held_below)
    check_searched(searched_cells)
    smooth = _as_sum(smooth)
    if host_theta_E is None:
        host_theta_E = float(getattr(smooth.mass.components[0], "theta_E", 1.0))  # pyright: ignore[reportAttributeAccessIssue]
    if not float(host_theta_E) > 0:
        raise ValueError(f"host_theta_E must be > 0 arcsec, got {host_theta_E}")
    if isinstance(subhalo_samples, bool) or not isinstance(subhalo_samples, int):
        raise ValueError(f"subhalo_samples must be an integer, got {subhalo_samples!r}")
    if subhalo_samples < 0 or subhalo_samples == 1:
        raise ValueError(f"subhalo_samples must be 0 (none) or >= 2, got {subhalo_samples}")
    pixelized = any(isinstance(t, LogEvidence) for t in objective.terms)
    smoothed = pixelized if smoothed is None else smoothed
    plateau = fit_plateau(fit_tolerance, pixelized)
    centres, half = grid_cells(objective, grid, half)
    free, held = scan_free(objective, smooth, free, bounds)
    solver = solver or ("lm" if objective.least_squares else "bfgs")
    dtype = jnp.result_type(float)
    say = log or (lambda _: None)
    if refit_smooth:
        # the smooth model fitted as the cells are (this objective, solver, free parameters
        # and step limit; the fit given may have had other terms, such as a positions
        # guard, or stopped elsewhere): the comparison is then of like with like, and the
        # cells start from it
        refit = _fit(objective, smooth, solver, free, bounds, max_steps, plateau=plateau)
        if not math.isfinite(float(refit.value)):
            raise RuntimeError(f"subhalo_scan: the smooth model's refit failed: {refit.message()}")
        smooth = _as_sum(refit.model)

    template = with_subhalo(
        smooth,
        Subhalo(
            log10_mass=jnp.asarray(start_log10_mass, dtype),
            u=jnp.zeros((), dtype),
            v=jnp.zeros((), dtype),
            cell_x=jnp.asarray(centres[0, 0], dtype),
            cell_y=jnp.asarray(centres[0, 1], dtype),
            half=jnp.asarray(half, dtype),
            host_theta_E=jnp.asarray(host_theta_E, dtype),
            cosmology=cosmology,
            kind=kind,
        ),
    )
    n_comp = len(template.mass.components)  # pyright: ignore[reportAttributeAccessIssue]

    sub_where = _SubhaloField(n_comp - 1, "log10_mass")
    sub_bounds = {**(bounds or {}), sub_where: (lo, hi)}
    # the cell fits find the mode in the fit's coordinates of what the evidence integrates
    # (LogisticPrior): a subhalo the data do not want stays finite there
    priors = [
        LogisticPrior(sub_where, lo, hi),
        *(LogisticPrior(_SubhaloField(n_comp - 1, c), -1.0, 1.0) for c in "uv"),
    ]
    cell_objective = Objective(
        [*objective.terms, *priors], jnp.concatenate([objective.weights, jnp.ones(3, dtype)])
    )
    sub_free = _free_with_subhalo(objective, smooth, free, bounds, template)

    evidence = functools.partial(laplace_evidence, smoothed=smoothed)
    try:
        smooth_ev = evidence(objective, smooth, free=free, bounds=bounds)
    except ValueError as e:
        raise RuntimeError(f"subhalo_scan: the smooth model's evidence failed: {e}") from e
    if not math.isfinite(smooth_ev.log_evidence):
        raise RuntimeError("subhalo_scan: the smooth model's evidence is not finite")
    say(f"smooth model: log evidence {smooth_ev.log_evidence:.2f}")
    if smoothed:
        # every later evidence (cells, sub-cells, the smooth refits) starts its smoothing
        # from the smooth model's errors, where its steps' iteration has settled, with
        # the gradient's differences for the subhalo's parameters alone, and takes
        # `SMOOTHING_ROUNDS` rounds (docs/subhalo.md: the same evidences to within the
        # spread the start alone gives, a third less of a cell's evidence time)
        start = dict(zip(smooth_ev.names, np.asarray(smooth_ev.raw_errors).tolist(), strict=True))
        evidence = functools.partial(
            evidence, smoothing_start=start, smoothing_rounds=SMOOTHING_ROUNDS
        )
    # the cells' evidences (not the smooth model's): the subhalo's block corrected by
    # importance sampling along it, the macro model tried on the line from the smooth
    # model's (where the subhalo is too light to matter, its maximum) through the cell's
    # fit, as far along it as the subhalo's mass is of the fit's
    cell_evidence = evidence
    if subhalo_samples:
        prefix = f"mass.components[{n_comp - 1}]."
        cell_evidence = functools.partial(
            evidence,
            block=tuple(prefix + c for c in ("u", "v", "log10_mass")),
            block_samples=subhalo_samples,
            block_anchors=(template,),
            block_response=_subhalo_mass,
        )

    header = {
        "format": CHECKPOINT_FORMAT,
        "kind": kind,
        "mass_range": [lo, hi],
        "half": half,
        "centres": centres.tolist(),
        "smooth_log_evidence": smooth_ev.log_evidence,
        "start_grid": start_grid,
        "start_masses": sorted({float(m) for m in candidates[:, 2]}),
        "preconditioned": bool(precondition),
        # (the start grid's best is a second start, the default start kept: since 2026-12-04)
        "second_start": bool(start_grid),
        # (the fits' plateau rule, `fit_plateau`; None: none, as before 2026-12-05)
        "fit_plateau": None if plateau is None else list(plateau),
        # (the later evidences' smoothing from the smooth model's errors, in this many
        # rounds; None: from the gradient's differences in 3, as before 2026-12-06)
        "smoothing_start": SMOOTHING_ROUNDS if smoothed else None,
        # (the cells' evidences corrected along the subhalo by this many points; 0: not,
        # as before 2026-12-06's session 65)
        "subhalo_samples": int(subhalo_samples),
        # (the held-mass fits' cells and mass, `held_fits`; None: none, as before
        # 2026-12-07's session 70; `held_below` is not here: it picks which cells get
        # one, and a "held" record is its cell's fit whatever picked it)
        "held": [int(held_cells), float(held_log10_mass)] if held_cells else None,
    }
    records = _read_checkpoint(checkpoint, header)
    if checkpoint is not None and records is None:
        with open(checkpoint, "w") as f:
            f.write(json.dumps({"header": header}) + "\n")
    records = records or []
    param = parametrisation(objective, template, sub_free, sub_bounds)
    # the quiet start: a subhalo of negligible mass (QUIET_DEX above the prior's lower
    # bound), where the cell model is the smooth model
    setup = CellSetup(
        objective,
        cell_objective,
        template,
        solver,
        sub_free,
        sub_bounds,
        max_steps,
        cell_evidence,
        lo + QUIET_DEX,
        cell_scale(smooth_ev, param.paths(template)) if precondition else None,
        plateau,
    )
    run = functools.partial(
        _run_cells,
        param=param,
        checkpoint=checkpoint,
        client=client,
        route=route,
        mesh=mesh,
        progress=progress,
        say=lambda i, name, c, le, st: say(
            f'{name} {i + 1} at ({c[0]:+.2f}, {c[1]:+.2f})": '
            f"Delta log E {le - smooth_ev.log_evidence:.2f} ({st})"
        ),
    )
    done = {int(r["cell"]): r for r in records if "cell" in r}
    first = np.tile([0.0, 0.0, float(start_log10_mass)], (len(centres), 1))
    # (with Dask each cell's task scores its own start grid from `pool`: `_seed.task_starts`)
    pool = start_pool(candidates, setup.quiet) if client is not None and len(candidates) else None
    seed = functools.partial(cell_starts, quiet=setup.quiet, say=say, in_tasks=pool is not None)
    starts = seed(cell_objective, template, centres, candidates, first, done=done)
    cells = run(setup, centres, half, starts, done, "cell", pool=pool)
    if held_cells:
        cells = held_fits(
            cells,
            setup,
            centres,
            half,
            run,
            held_cells,
            held_log10_mass,
            records,
            say,
            smooth=smooth_ev.log_evidence,
            below=held_below,
        )
    if searched_cells:
        cells = searched_fits(cells, setup, centres, half, run, searched_cells, records, say)
    scan = _summary(centres, half, cells, smooth_ev, kind, cosmology, (lo, hi), len(done))
    best = scan.fits[scan.best_index]
    refit_args = (solver, free, bounds, max_steps, evidence, plateau)
    # with Dask, the smooth refits the coarse cells decide run beside what follows
    pending = early_refits(
        scan, smooth_starts, objective, *refit_args, client=client, records=records
    )
    if refine and best is not None:
        # the best cell tiled by refine x refine sub-cells, each fitted as a cell, from the
        # best cell's fit (its macro model and source, the subhalo's mass; the sub-cell
        # holding its subhalo starts from its position, the others from their centres)
        sub_half = half / refine
        sub_centres = tile(scan.centres[scan.best_index], float(half), refine)
        at = np.asarray(best.mass.components[-1].center, np.float64)
        first = np.zeros((len(sub_centres), 3))
        first[:, 2] = float(best.mass.components[-1].log10_mass)
        inside = np.all(np.abs(at - sub_centres) <= sub_half, axis=1)
        k = int(np.argmax(inside))
        first[k, :2] = np.clip((at - sub_centres[k]) / sub_half, -0.95, 0.95)
        sub_template = cell_template(best, sub_half)
        sub_setup = setup._replace(template=sub_template)
        say(f"refining cell {scan.best_index + 1} with {refine} x {refine} sub-cells")
        done = {
            int(r["sub"]): r
            for r in records
            if "sub" in r
            and int(r["sub"]) < len(sub_centres)
            and np.allclose(r["center"], sub_centres[int(r["sub"])], rtol=0, atol=1e-9)
            and math.isclose(r["half"], sub_half, rel_tol=1e-9)
        }
        starts = seed(cell_objective, sub_template, sub_centres, candidates, first, done=done)
        sub_cells = run(sub_setup, sub_centres, sub_half, starts, done, "sub", pool=pool)
        refined = _summary(
            sub_centres, sub_half, sub_cells, smooth_ev, kind, cosmology, (lo, hi), len(done)
        )
        best_dict = {
            **refined.best,
            "cell": scan.best_index,
            "sub_cell": refined.best.get("cell"),
            "cell_delta_log_evidence": _finite_or_none(refined.delta_log_evidence_grid),
        }
        scan = dataclasses.replace(scan, refinement=refined, best=best_dict)
    if polish and scan.best_fit is not None:
        summary = functools.partial(
            _summary, smooth_ev=smooth_ev, kind=kind, cosmology=cosmology, mass_range=(lo, hi)
        )
        scan = polished(scan, setup, run, summary, polish, start_masses, records, say)
    scan = smooth_refits(
        scan,
        smooth_starts,
        say,
        objective,
        *refit_args,
        client=client,
        checkpoint=checkpoint,
        records=records,
        pending=pending,
    )
    return dataclasses.replace(scan, held=held, wall_time=time.perf_counter() - t0)
