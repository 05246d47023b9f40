"""`equilens subhalo`: the smooth fit of `equilens fit`, then the subhalo scan over its
arcs (`equilens.subhalo_scan`), written as JSON and a figure."""

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

from ._kept import fingerprint, read_smooth, write_smooth
from ._parametric import parametric_fit
from ._partial import Partial
from ._source import _pixelized_stage, default_mesh, make_mesh, make_regularization

#: What the JSON says about its positions.
CONVENTION = (
    "positions in arcsec in the image's frame: x grows with the column index, y with the "
    "row index, the origin at the centre of the (cropped) image; for an image with north up "
    "and east left, x points west and y north"
)

#: The most `--workers` of a local Dask cluster.
MAX_WORKERS = 256


@contextlib.contextmanager
def dask_client(scheduler: str | None, workers: int) -> Iterator[Any]:
    """The Dask client the cells run on: connected to `scheduler` (an address, or a
    scheduler file's path), or a `LocalCluster` of `workers` one-thread worker processes
    for `workers > 1` (closed on exit); None (the cells in this process) otherwise."""
    if scheduler is None and workers == 1:
        yield None
        return
    try:
        import distributed
    except ImportError as e:
        raise ValueError(
            "--scheduler and --workers need Dask's distributed: pip install 'equilens[cluster]'"
        ) from e
    if scheduler is not None:
        if os.path.isfile(scheduler):
            client = distributed.Client(scheduler_file=scheduler)
        else:
            try:
                client = distributed.Client(scheduler, timeout=30)
            except OSError as e:
                raise ValueError(
                    f"--scheduler {scheduler}: no Dask scheduler answered ({e})"
                ) from e
        with client:
            n = len(client.scheduler_info()["workers"])
            print(f"equilens: cells on the Dask scheduler at {scheduler} ({n} workers now)")
            yield client
        return
    with (
        distributed.LocalCluster(
            n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        print(f"equilens: cells on a local Dask cluster of {workers} one-thread workers")
        yield client


def run_subhalo(
    imaging: Any,
    json_path: str,
    z_lens: float,
    z_source: float,
    *,
    mass: str = "sie+shear",
    lens_light: str | None = "mge",
    source: str = "pixelized",
    kind: str = "tnfw",
    grid: int = 5,
    refine: int = 2,
    smooth_starts: int = 3,
    start_grid: int = 3,
    polish: int = 7,
    held_cells: int = 3,
    held_below: float = 100.0,
    searched_cells: int = 3,
    solver: str = "lm",
    max_steps: int | None = None,
    fit_tolerance: float | None = None,
    mesh: str | None = None,
    finer_meshes: int = 1,
    regularization: str = "constant",
    strength: float | None = None,
    partial: Partial | None = None,
    title: str = "",
    extra: dict | None = None,
    client: Any = None,
    nested: bool = False,
) -> dict[str, str]:
    """Fits the smooth model to `imaging` as `equilens fit` does (the parametric fit, then for
    `source="pixelized"` the evidence chain), then scans a `grid` x `grid` grid of cells over
    the mask for a subhalo of profile `kind`, the best cell refined by `refine` x `refine`
    sub-cells, the smooth model fitted again from the `smooth_starts` best subhalo fits,
    each cell fitted from its centre and its `start_grid`'s best, the best model polished over
    its cell from the best of a `polish` x `polish` grid, the `held_cells` best cells (those
    less than `held_below` over the smooth model) fitted once more with the subhalo's mass
    held first, the `searched_cells` best fitted once more from a global search of the mass
    and subhalo with a parametric source (`equilens.subhalo_scan`, each
    finished cell appended to `OUT_cells.jsonl` beside the JSON, the smooth fit kept in
    `OUT_smooth.pkl` with a fingerprint of its inputs: a rerun of the same data and settings
    reads the smooth model back, `equilens.cli._kept`, and resumes from the cells' file).
    Writes the JSON (the best subhalo, every cell's log-evidence, the smooth model's) and the
    figure (`.png`). The pixelized source's mesh (`mesh`, default `brightness:32x32`)
    is refined up to `finer_meshes` times (1.25 times the nodes along each side) while the
    smooth model's evidence rises by more than 10 (`fit_pixelized(finer_meshes=)`): a
    source too coarse for its galaxy leaves a misfit that a subhalo absorbs; the mesh
    kept is in the JSON (`"mesh_kept"`). With a Dask `client`, the cells run on its
    workers. `fit_tolerance`: `subhalo_scan`'s (None: its default). `nested`: the best
    cell's evidence difference by nested sampling too (`subhalo_evidence`, under
    `"nested"` in the JSON). Returns the paths and, under
    `"status"`, `"successful"` or what failed (the smooth fit, or how many cells)."""
    from ..cosmology import LensCosmology
    from ..objective import Objective
    from ..solve import result_to_dict
    from ..subhalo import plot_subhalo_scan, subhalo_evidence, subhalo_scan
    from ..terms import GaussianLikelihood, LogEvidence

    if source not in ("pixelized", "sersic"):
        raise ValueError(f"--source must be pixelized or sersic for a subhalo scan, got {source!r}")
    if kind not in ("tnfw", "pseudo_jaffe"):
        raise ValueError(f"--kind must be tnfw or pseudo_jaffe, got {kind!r}")
    if not isinstance(grid, int) or grid < 1:
        raise ValueError(f"--grid must be a positive number of cells, got {grid}")
    cosmology = LensCosmology(z_lens, z_source)  # (checks 0 < z_lens < z_source)
    pixelized = source == "pixelized"
    # (the source adapted to its brightness too: a misfit of a coarse source's bright clump
    # is what a subhalo absorbs, docs/subhalo.md)
    mesh_spec = (mesh or default_mesh(imaging, "brightness")) if pixelized else None
    pix_mesh = make_mesh(mesh_spec, imaging) if mesh_spec is not None else None
    pix_reg = make_regularization(regularization, strength) if pixelized else None
    t0 = time.perf_counter()
    progress = sys.stderr.isatty()
    print(
        f"equilens: subhalo scan ({kind}, {grid}x{grid} cells) of {imaging.shape[0]}x"
        f"{imaging.shape[1]} pixels, {mass} mass, {lens_light or 'no'} lens light, "
        f"{source} source; z_lens {z_lens}, z_source {z_source}"
    )
    folder = os.path.dirname(os.path.abspath(json_path))
    os.makedirs(folder, exist_ok=True)
    base = os.path.splitext(json_path)[0]
    cells = base + "_cells.jsonl"
    kept_path = base + "_smooth.pkl"
    key = fingerprint(
        imaging,
        {
            "mass": mass,
            "lens_light": lens_light,
            "source": source,
            "solver": solver,
            "max_steps": max_steps,
            "mesh": mesh_spec,
            "finer_meshes": finer_meshes,
            "regularization": regularization,
            "strength": strength,
        },
    )
    kept, why = read_smooth(kept_path, key)
    if kept is not None:
        # the smooth model of the run that wrote the cells' file (equilens.cli._kept)
        smooth, adapt_image = kept
        print(f"  smooth model: {why} (delete it to fit the smooth model again)")
    else:
        if os.path.exists(kept_path):
            print(f"  smooth model: {why}")
        smooth, adapt_image = _smooth_fit(
            imaging,
            mass,
            lens_light,
            solver,
            max_steps,
            pix_mesh,
            pix_reg,
            strength,
            progress,
            partial,
            source=source,
            finer_meshes=finer_meshes,
        )
        write_smooth(kept_path, key, smooth, adapt_image)
    if pixelized:
        # the evidence the chain's last stage maximised: with the brightness estimate its
        # regularization was fitted to (an AdaptiveBrightness's adapt image), which the
        # scan holds with the regularization's parameters
        objective = Objective(LogEvidence(imaging, adapt_image=adapt_image))
    else:
        objective = Objective(GaussianLikelihood(imaging))
    if partial is not None:
        partial.keep("smooth model", smooth)
    on = f" on a {_mesh_spec(str(mesh_spec), smooth.model)} source mesh" if pixelized else ""
    print(f"  smooth model{on}: {smooth.message()}; cells written to {cells} as they finish")
    scan = subhalo_scan(
        objective,
        smooth,
        cosmology,
        grid=grid,
        refine=refine,
        smooth_starts=smooth_starts,
        start_grid=start_grid,
        polish=polish,
        held_cells=held_cells,
        held_below=held_below,
        searched_cells=searched_cells,
        kind=kind,  # pyright: ignore[reportArgumentType]
        solver=None if solver == "lm" and pixelized else solver,
        max_steps=500 if max_steps is None else max_steps,
        fit_tolerance=fit_tolerance,
        checkpoint=cells,
        client=client,
        progress=progress,
        log=None if progress else print,
    )
    png = plot_subhalo_scan(scan, objective, base + ".png", title=title)
    out = scan.to_dict()
    if nested and scan.best_fit is not None:
        print("  nested sampling of the smooth model and of the best cell's (nautilus)")
        ev = subhalo_evidence(scan, objective, progress=True)
        out["nested"] = ev.to_dict()
        q = ev.subhalo
        print(
            f"  nested: Delta log E {ev.delta_log_evidence:.2f} +- "
            f"{ev.delta_log_evidence_error:.2f} (Laplace {ev.laplace_delta_log_evidence:.2f}); "
            f'subhalo at ({q["center_x"][1]:+.3f}, {q["center_y"][1]:+.3f})", log10 mass '
            f"{q['log10_mass'][1]:.2f} [{q['log10_mass'][0]:.2f}, {q['log10_mass'][2]:.2f}] "
            f"({ev.wall_time:.0f} s)"
        )
    out.update(extra or {})
    out["convention"] = CONVENTION
    out["source"] = source
    if pixelized:
        out["mesh_kept"] = _mesh_spec(str(mesh_spec), smooth.model)
    out["smooth_fit"] = result_to_dict(smooth)
    out["cells_file"] = cells
    out["smooth_file"] = kept_path
    _write(json_path, out)
    b = scan.best
    if scan.refinement is not None:
        chosen = (
            "the polished fit over the whole cell"
            if b.get("polished")
            else f"sub-cell {b['sub_cell'] + 1}"
        )
        print(
            f"  refined cell {b['cell'] + 1}: Delta log E "
            f"{b.get('cell_delta_log_evidence') or float('nan'):.1f} over its "
            f"{len(scan.refinement.status)} sub-cells; the best is {chosen}"
        )
    print(
        f"  best cell: subhalo at ({b.get('center_x', float('nan')):+.3f}, "
        f'{b.get("center_y", float("nan")):+.3f})", log10 mass '
        f"{b.get('log10_mass', float('nan')):.2f}, mass within 1 kpc "
        f"{b.get('mass_within_1kpc', float('nan')):.3g} Msun, Delta log E "
        f"{b.get('delta_log_evidence') or float('nan'):.1f}"
    )
    print(f"  result: {json_path}\n  figure: {png}\n  wall time {time.perf_counter() - t0:.1f} s")
    status = "successful"
    if not smooth.success:
        status = f"the smooth fit: {smooth.message()}"
    elif scan.failed:
        status = f"{scan.failed} of {len(scan.status)} cells failed"
    elif scan.refinement is not None and scan.refinement.failed:
        status = f"{scan.refinement.failed} of {len(scan.refinement.status)} sub-cells failed"
    return {"json": json_path, "png": png, "cells": cells, "smooth": kept_path, "status": status}


def _smooth_fit(
    imaging: Any,
    mass: str,
    lens_light: str | None,
    solver: str,
    max_steps: int | None,
    pix_mesh: Any,
    pix_reg: Any,
    strength: float | None,
    progress: bool,
    partial: Partial | None,
    *,
    source: str,
    finer_meshes: int = 0,
) -> tuple[Any, Any]:
    """The smooth model as `equilens fit` fits it (the parametric fit, then for a pixelized
    source the evidence chain, without the errors of its last stage: the scan's Laplace
    evidence of the smooth model gives them, `SubhaloScan.smooth_errors`): its `FitResult`
    and the chain's brightness estimate (the adapt image of its last stage; None for a
    parametric source)."""
    from ..solve import fit_lens

    pixelized = pix_mesh is not None
    minima: list = []
    smooth = parametric_fit(
        fit_lens,
        imaging,
        mass,
        lens_light,
        source,
        pixelized=pixelized,
        solver=solver,
        max_steps=max_steps,
        positions=None,
        positions_sigma=None,
        progress=progress,
        partial=partial,
        minima=minima,
    )
    if not pixelized:
        return smooth, None
    smooth, inversion, _, _ = _pixelized_stage(
        imaging,
        smooth,
        pix_mesh,
        pix_reg,
        strength,
        solver,
        max_steps,
        None,
        progress,
        finer_meshes=finer_meshes,
        # (the scan's Laplace evidence of the smooth model gives its errors: `smooth_errors`)
        covariance=False,
        alternatives=minima,
    )
    return smooth, inversion.adapt_image


def _mesh_spec(spec: str, model: Any) -> str:
    """`spec` (`KIND:NYxNX`) with the shape of `model`'s source mesh."""
    ny, nx = model.source.mesh.shape
    return f"{spec.partition(':')[0]}:{ny}x{nx}"


def _write(path: str, out: dict[str, Any]) -> None:
    import json

    from .._files import atomic_path

    with atomic_path(path) as tmp, open(tmp, "w") as f:
        json.dump(out, f, indent=2, allow_nan=True)
