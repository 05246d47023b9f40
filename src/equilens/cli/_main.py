"""The `equilens` command's options, parsed and run (`main`)."""

import argparse
import math
import os
import sys

from ._check import _check_model, _check_numbers, _check_solver, _lens_light
from ._data import _bands, _grow_region, _imaging, _positions
from ._demo import run_demo, run_demo_subhalo
from ._fit import run_fit, run_fit_multiband
from ._partial import Partial
from ._sample import run_sample
from ._source import REGULARIZATIONS
from ._subhalo import MAX_WORKERS, dask_client, run_subhalo

#: The most cells per side of `equilens subhalo --grid`.
MAX_GRID = 20
#: The most refinements of `equilens subhalo --finer-meshes` (32 -> 125 nodes a side: the
#: mask's pixels bound it before, `equilens.solve.MAX_FILL`).
MAX_FINER_MESHES = 6


def _data_options(parser: argparse.ArgumentParser, what: str) -> None:
    """The data options of `fit` and `sample`: one image, or `--band` once per band."""
    parser.add_argument("image", nargs="?", help="image FITS file (flux per pixel)")
    parser.add_argument("--noise-map", help="1-sigma noise FITS file")
    parser.add_argument("--psf", help="PSF kernel FITS file (odd-sized)")
    parser.add_argument("--pixel-scale", type=float, help="arcsec per pixel")
    parser.add_argument(
        "--band",
        nargs=3,
        action="append",
        metavar=("IMAGE", "NOISE", "PSF"),
        help=f"one band of a joint multi-band {what} (repeat per band, sharpest or deepest "
        "first: it is the reference); FITS paths may name an extension, file.fits[NAME]",
    )
    parser.add_argument("--band-names", help="comma-separated names of the --band options")
    parser.add_argument(
        "--band-pixel-scales", help="comma-separated arcsec per pixel, one per --band"
    )
    parser.add_argument(
        "--exclude-mask",
        "--mask",
        dest="mask",
        help="FITS file, non-zero = pixel excluded (--mask: the same; the API's mask= is "
        "True = used)",
    )
    parser.add_argument(
        "--mask-radius", type=float, help="use pixels within R arcsec of the centre"
    )


def _common_options(parser: argparse.ArgumentParser) -> None:
    """The options `fit` and `sample` share after the data's."""
    parser.add_argument(
        "--mesh",
        help="pixelized source mesh: adaptive[:NYxNX] (default adaptive:32x32; on a mask of "
        "under 2048 pixels, NxN with N^2 at most half its pixels), brightness[:NYxNX] "
        "(adapted to the source's brightness too), rectangular[:NYxNX], delaunay[:N]",
    )
    parser.add_argument(
        "--regularization",
        help="pixelized: " + "|".join(REGULARIZATIONS) + " (default constant)",
    )
    parser.add_argument(
        "--regularization-strength",
        type=float,
        default=None,
        help="pixelized: fixed strength (default: fitted by the evidence)",
    )
    parser.add_argument(
        "--power-law",
        action="store_true",
        help="pixelized, one band: a last stage that frees an SIE's slope and keeps the "
        "power law when the log-evidence rises by more than 5",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="check the inputs and the model options, print what would be fitted and exit "
        "(status 0 when valid) without fitting",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="equilens", description="equilens: strong gravitational lens modelling"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="fit the shipped HST image of SDSS J0946+1006")
    demo.add_argument("--output", default="equilens_demo", help="output folder")
    demo.add_argument("--solver", default="lm", help="solver name (lm, bfgs, lbfgs, adam)")
    demo.add_argument(
        "--subhalo",
        action="store_true",
        help="scan the shipped lens for a subhalo instead (pixelized source, pseudo-Jaffe "
        "subhalo as Vegetti et al. 2010, 5x5 cells; writes subhalo.json and subhalo.png)",
    )
    demo.add_argument(
        "--workers",
        type=int,
        default=1,
        help="with --subhalo, N > 1: the cells run on a Dask LocalCluster of N one-thread "
        "worker processes (pip install equilens[cluster]; default 1: one cell after "
        "another in this process)",
    )
    fit = sub.add_parser("fit", help="fit a lens model to your own imaging data")
    _data_options(fit, "fit")
    fit.add_argument("--mass", default="sie+shear", help="mass profiles, '+'-joined")
    fit.add_argument(
        "--lens-light",
        default="mge",
        help="lens light profiles, '+'-joined (default mge: a linear multi-Gaussian "
        "expansion; sersic+sersic: a double Sersic); none for data with the lens removed",
    )
    fit.add_argument("--source", default="sersic", help="source light profiles, or 'pixelized'")
    _common_options(fit)
    fit.add_argument(
        "--supersampling",
        type=int,
        default=1,
        help="sub-pixels per pixel side (1 to 32; the global search evaluates the pixel "
        "centres only, the final fit this)",
    )
    fit.add_argument("--solver", default="lm", help="solver name (lm, bfgs, lbfgs, adam)")
    fit.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help="solver steps at most, per fit (default 300 per parametric fit, 1000 per "
        "evidence fit of the pixelized chain)",
    )
    fit.add_argument(
        "--positions",
        help="text file: x y (arcsec, one line per multiple image of one source point); "
        "adds a positions penalty to the parametric fit, and holds them together in the "
        "pixelized chain (default there: the images of the parametric source's centre)",
    )
    fit.add_argument(
        "--positions-sigma", type=float, help="1-sigma of the positions (arcsec; default a pixel)"
    )
    fit.add_argument(
        "--fixed-mask",
        action="store_true",
        help="keep the mask as given (default: with --mask-radius, one image, the mask grows "
        "to arcs that continue beyond it, never into --mask's pixels, and the fit is repeated)",
    )
    fit.add_argument("--json", required=True, help="output JSON path (PNG written beside it)")
    smp = sub.add_parser(
        "sample",
        help="fit, then draw the posterior with NUTS or nested sampling (pip install "
        "equilens[sampling])",
        description="Fits the data as `equilens fit` does (one image, or --band once per "
        "band: the bands sampled jointly), then samples the posterior from "
        "the fit: --sampler nuts (blackjax NUTS chains on the device, --chains, "
        "--warmup, --samples draws per chain, --max-tree-depth; R-hat and ESS) or --sampler "
        "nested (nautilus on the Numba likelihood in one process per CPU core, --live "
        "points, --samples effective samples, a uniform prior of --prior-width errors around "
        "the fit; also the log-evidence; progress with the time left). --sampler auto "
        "(default): nested on a CPU, NUTS on an accelerator. Writes OUT.json, the draws as "
        "NetCDF and a corner plot; Ctrl-C while sampling writes the draws so far.",
    )
    _data_options(smp, "sample")
    smp.add_argument("--mass", default="sie+shear", help="mass profiles, '+'-joined")
    smp.add_argument("--lens-light", default="mge", help="lens light profiles, or none")
    smp.add_argument("--source", default="sersic", help="source light profiles, or 'pixelized'")
    _common_options(smp)
    smp.add_argument(
        "--supersampling", type=int, default=1, help="sub-pixels per pixel side (1 to 32)"
    )
    smp.add_argument("--solver", default="lm", help="solver of the fit the chains start from")
    smp.add_argument("--max-steps", type=int, default=None, help="solver steps per fit")
    smp.add_argument("--positions", help="text file: x y of the multiple images (arcsec)")
    smp.add_argument("--positions-sigma", type=float, help="1-sigma of the positions (arcsec)")
    smp.add_argument(
        "--sampler",
        default="auto",
        choices=["auto", "nuts", "nested"],
        help="nuts (blackjax NUTS chains on device), nested (nautilus on the Numba "
        "likelihood: the posterior and the log-evidence) or auto (default: nested on a CPU, "
        "NUTS on an accelerator)",
    )
    smp.add_argument(
        "--chains",
        type=int,
        default=4,
        help="NUTS chains (vmapped; one after another for a pixelized source on a CPU)",
    )
    smp.add_argument(
        "--max-tree-depth",
        type=int,
        default=None,
        help="NUTS: at most 2^D leapfrog steps per draw (default 10; 6 with --source "
        "pixelized, whose evidence is smooth only piecewise)",
    )
    smp.add_argument("--warmup", type=int, default=500, help="window-adaptation steps per chain")
    smp.add_argument(
        "--samples",
        type=int,
        default=None,
        help="NUTS: draws kept per chain (default 1000); nested: effective samples to reach "
        "(default 4000)",
    )
    smp.add_argument(
        "--live",
        type=int,
        default=300,
        help="nested: nautilus live points (default 300; more for a posterior with several modes)",
    )
    smp.add_argument(
        "--networks",
        type=int,
        default=2,
        help="nested: neural networks per nautilus bound (default 2; training them is most "
        "of nautilus's own time)",
    )
    smp.add_argument(
        "--prior-width",
        type=float,
        default=10.0,
        help="nested: uniform prior on the fit +- this many of its 1-sigma errors, inside "
        "the class bounds (default 10)",
    )
    smp.add_argument("--seed", type=int, default=0, help="random seed")
    smp.add_argument(
        "--json", required=True, help="output JSON path (NetCDF draws, corner plot beside it)"
    )
    shp = sub.add_parser(
        "subhalo",
        help="fit the smooth model, then scan a grid of cells over the arcs for a subhalo",
        description="Fits the smooth lens model as `equilens fit` does, then each cell of a "
        "grid over the mask with a subhalo confined to it (its mass log-uniform over "
        "1e6-1e11 Msun), the macro model refitted, and compares each with the smooth model "
        "by the Bayesian evidence (Laplace approximation; a pixelized source marginalised). "
        "Writes OUT.json (the best subhalo: centre in arcsec, x along the image's columns, "
        "y along its rows; mass within 1 kpc in Msun; Delta log-evidence; every cell's), "
        "OUT.png, OUT_cells.jsonl (each cell as it finishes) and OUT_smooth.pkl (the "
        "smooth fit, with a fingerprint of the data and settings): a rerun of the same data "
        "and settings reads the smooth model back and resumes from the cells' file.",
    )
    _data_options(shp, "scan")
    shp.add_argument("--z-lens", type=float, required=True, help="lens redshift")
    shp.add_argument("--z-source", type=float, required=True, help="source redshift")
    shp.add_argument("--grid", type=int, default=5, help="N: an N x N grid of cells (default 5)")
    shp.add_argument(
        "--refine",
        type=int,
        default=2,
        help="N: the best cell then tiled by N x N sub-cells, each fitted (default 2; 0: none)",
    )
    shp.add_argument(
        "--smooth-starts",
        type=int,
        default=3,
        help="N: after the cells, the smooth model fitted again from the N best subhalo fits "
        "(their subhalos removed), the best kept as the model compared against (default 3)",
    )
    shp.add_argument(
        "--start-grid",
        type=int,
        default=3,
        help="N: each cell is fitted from its centre at 1e9 Msun and, where it beats that start "
        "and the smooth model with the macro model held, from the best of N x N positions x 8 "
        "masses, the better fit kept (default 3; 0: from the centre alone)",
    )
    shp.add_argument(
        "--held-cells",
        type=int,
        default=3,
        help="N: after the cells, the N best are fitted once more from their centres with the "
        "subhalo's mass held at 10^9.5 Msun while the macro model and its position are fitted, "
        "then all free, the better fit kept (a heavy subhalo the smooth model took up; "
        "default 3; 0: none)",
    )
    shp.add_argument(
        "--held-below",
        type=float,
        default=100.0,
        help="DELTA: of those, a cell already DELTA or more above the smooth model in log "
        "evidence is not fitted again (its fit holds a heavy subhalo; default 100; inf: every "
        "one)",
    )
    shp.add_argument(
        "--searched-cells",
        type=int,
        default=3,
        help="N: then the N best cells are fitted once more from a global search of the "
        "mass (slope included) and the cell's subhalo with a parametric source, as the smooth "
        "fit began, the better fit kept (a heavy subhalo that moved the smooth model's slope; "
        "default 3; 0: none)",
    )
    shp.add_argument(
        "--polish",
        type=int,
        default=7,
        help="N: last, the best subhalo model is fitted again with its subhalo free over the "
        "whole best cell, from the best 2 of N x N positions x 8 masses there, and kept where "
        "its evidence is higher (default 7; 0: none)",
    )
    shp.add_argument(
        "--kind",
        default="tnfw",
        choices=["tnfw", "pseudo_jaffe"],
        help="subhalo profile: tnfw (default; mass M200, Duffy et al. 2008 concentration) or "
        "pseudo_jaffe (total mass, Vegetti et al. 2010)",
    )
    shp.add_argument("--mass", default="sie+shear", help="mass profiles, '+'-joined")
    shp.add_argument("--lens-light", default="mge", help="lens light profiles, or none")
    shp.add_argument(
        "--source",
        default="pixelized",
        help="pixelized (default) or sersic (a parametric source leaves residuals a "
        "subhalo absorbs: false detections)",
    )
    shp.add_argument(
        "--mesh",
        help="pixelized source mesh, as `equilens fit --mesh` (default brightness:32x32, "
        "adapted to the source's brightness: a coarse source's misfit is what a subhalo "
        "absorbs)",
    )
    shp.add_argument(
        "--finer-meshes",
        type=int,
        default=1,
        help="N: the smooth model's source mesh then refined up to N times (1.25 times the "
        "nodes along each side) while its log-evidence rises by more than 10 (default 1; "
        "0: the mesh as given)",
    )
    shp.add_argument("--regularization", help="pixelized source regularization")
    shp.add_argument("--regularization-strength", type=float, default=None)
    shp.add_argument("--supersampling", type=int, default=1, help="sub-pixels per pixel side")
    shp.add_argument("--solver", default="lm", help="solver of the parametric fit")
    shp.add_argument("--max-steps", type=int, default=None, help="solver steps per fit")
    shp.add_argument(
        "--fit-tolerance",
        type=float,
        default=None,
        help="the scan's fits also stop when they gain less than this (log-evidence units) "
        "over their last 10 steps (default 0.5 for a pixelized source, whose evidence is "
        "rough on small scales; none for a parametric one; 0: none)",
    )
    shp.add_argument(
        "--scheduler",
        help="address of a running Dask scheduler (tcp://HOST:PORT, or a scheduler file's "
        "path): the cells run on its workers (pip install equilens[cluster])",
    )
    shp.add_argument(
        "--workers",
        type=int,
        default=1,
        help="N > 1: the cells run on a Dask LocalCluster of N one-thread worker processes "
        "on this machine, each compiling once (pip install equilens[cluster]; default 1: "
        "one cell after another in this process)",
    )
    shp.add_argument(
        "--nested",
        action="store_true",
        help="also the best cell's Delta log-evidence by nested sampling of both models "
        "(nautilus, the same priors), with its error and the subhalo's posterior (pip "
        "install equilens[sampling]; minutes to hours: a pixelized source's likelihood "
        "on every core)",
    )
    shp.add_argument("--json", required=True, help="output JSON path (PNG written beside it)")
    args = parser.parse_args(argv)
    if args.command != "demo":
        args.source = args.source.strip().lower()

    import jax

    jax.config.update("jax_enable_x64", True)
    if args.command == "demo":
        name = "subhalo.json" if args.subhalo else "demo.json"
        partial = Partial(os.path.join(args.output, name))
    else:
        partial = Partial(args.json)
    try:
        return _run(args, partial)
    except KeyboardInterrupt:
        # Ctrl-C: one line, what was finished written, the shell's status for SIGINT
        written = partial.write()
        kept = (
            f"; the result of stage {partial.stage!r} written to {written}"
            if written
            else "; nothing finished to write"
        )
        print(f"equilens: interrupted{kept}", file=sys.stderr)
        return 130


def _run(args, partial: Partial) -> int:
    """`main` after the arguments are parsed: the command run, errors as one line."""
    try:
        if args.command == "demo":
            _check_solver(args.solver)
            _check_workers(args.workers)
            if args.subhalo:
                with dask_client(None, args.workers) as client:
                    out = run_demo_subhalo(args.output, partial, client)
                return _exit(out, "the subhalo scan")
            if args.workers != 1:
                raise ValueError("--workers applies to demo --subhalo (the scan's cells)")
            return _exit(run_demo(args.output, args.solver, partial))
        if args.command == "subhalo":
            return _exit(_subhalo(args, partial), "the subhalo scan")
        _check_numbers(args)
        positions = _positions(args.positions)
        if args.band:
            data = _bands(args)
            first = data.bands[0]
            partial.band_names = data.names
        else:
            _require_one_image(args, " (or --band once per band)")
            data = first = _imaging(args)
        plan = _check_model(args, first, positions)
        if data is not first:
            plan.insert(0, f"{len(data)} bands ({', '.join(data.names)}); the first:")
        if args.check:
            print(f"equilens {args.command}: the inputs are valid (--check: nothing fitted)")
            print("\n".join(f"  {line}" for line in plan))
            return 0
        mesh = args.mesh  # None: default_mesh of the data
        regularization = "constant" if args.regularization is None else args.regularization
        lens_light = _lens_light(args)
        if args.command == "sample":
            out = run_sample(
                data,
                args.json,
                args.mass,
                lens_light,
                args.source,
                n_chains=args.chains,
                n_warmup=args.warmup,
                n_samples=args.samples,
                seed=args.seed,
                solver=args.solver,
                max_steps=args.max_steps,
                positions=positions,
                positions_sigma=args.positions_sigma,
                sampler=args.sampler,
                n_live=args.live,
                n_networks=args.networks,
                prior_width=args.prior_width,
                mesh=mesh,
                regularization=regularization,
                strength=args.regularization_strength,
                max_tree_depth=args.max_tree_depth,
                partial=partial,
                power_law=args.power_law,
            )
        else:
            run = run_fit_multiband if args.band else run_fit
            one = {} if args.band else {"power_law": args.power_law, "region": _grow_region(args)}
            out = run(
                data,
                args.json,
                args.mass,
                lens_light,
                args.source,
                args.solver,
                max_steps=args.max_steps,
                positions=positions,
                positions_sigma=args.positions_sigma,
                mesh=mesh,
                regularization=regularization,
                strength=args.regularization_strength,
                partial=partial,
                **one,
            )
    except (ValueError, OSError, RuntimeError, TypeError) as err:
        msg = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"equilens: error: {msg}", file=sys.stderr)
        return 1
    return _exit(out)


def _require_one_image(args, hint: str = "") -> None:
    """A `ValueError` naming the first of IMAGE, --noise-map, --psf, --pixel-scale missing."""
    for option, value in (
        ("IMAGE", args.image),
        ("--noise-map", args.noise_map),
        ("--psf", args.psf),
        ("--pixel-scale", args.pixel_scale),
    ):
        if value is None:
            raise ValueError(f"{option} is required{hint}")


def _subhalo(args, partial: Partial) -> dict[str, str]:
    """`equilens subhalo`: the options checked, the data read, the scan run."""
    if args.band:
        raise ValueError("equilens subhalo takes one image (IMAGE --noise-map --psf), not --band")
    _require_one_image(args)
    if args.source not in ("pixelized", "sersic"):
        raise ValueError(f"--source must be pixelized or sersic, got {args.source!r}")
    if not 1 <= args.grid <= MAX_GRID:
        raise ValueError(f"--grid must be between 1 and {MAX_GRID}, got {args.grid}")
    if args.refine == 1 or not 0 <= args.refine <= MAX_GRID:
        raise ValueError(
            f"--refine must be 0 (none) or between 2 and {MAX_GRID}, got {args.refine}"
        )
    if not 0 <= args.smooth_starts <= MAX_GRID**2:
        raise ValueError(
            f"--smooth-starts must be between 0 and {MAX_GRID**2}, got {args.smooth_starts}"
        )
    if not 0 <= args.start_grid <= MAX_GRID:
        raise ValueError(f"--start-grid must be between 0 and {MAX_GRID}, got {args.start_grid}")
    if not 0 <= args.held_cells <= MAX_GRID**2:
        raise ValueError(f"--held-cells must be between 0 and {MAX_GRID**2}, got {args.held_cells}")
    if not 0 <= args.searched_cells <= MAX_GRID**2:
        raise ValueError(
            f"--searched-cells must be between 0 and {MAX_GRID**2}, got {args.searched_cells}"
        )
    if not args.held_below > 0:
        raise ValueError(f"--held-below must be > 0 (log-evidence units), got {args.held_below}")
    if args.polish == 1 or not 0 <= args.polish <= MAX_GRID:
        raise ValueError(
            f"--polish must be 0 (none) or between 2 and {MAX_GRID}, got {args.polish}"
        )
    if not 0 <= args.finer_meshes <= MAX_FINER_MESHES:
        raise ValueError(
            f"--finer-meshes must be between 0 and {MAX_FINER_MESHES}, got {args.finer_meshes}"
        )
    if args.fit_tolerance is not None and not (
        math.isfinite(args.fit_tolerance) and args.fit_tolerance >= 0
    ):
        raise ValueError(
            f"--fit-tolerance must be >= 0 (log-evidence units; 0: none), got {args.fit_tolerance}"
        )
    args.positions = args.positions_sigma = None
    args.power_law = False
    args.fixed_mask = True
    if args.scheduler is not None and args.workers != 1:
        raise ValueError("--scheduler and --workers exclude each other (the scheduler has its own)")
    if args.nested:
        import importlib.util

        if importlib.util.find_spec("nautilus") is None:
            raise ValueError("--nested needs nautilus-sampler: pip install 'equilens[sampling]'")
    _check_workers(args.workers)
    _check_numbers(args)
    imaging = _imaging(args)
    _check_model(args, imaging, None)
    with dask_client(args.scheduler, args.workers) as client:
        return run_subhalo(
            imaging,
            args.json,
            args.z_lens,
            args.z_source,
            mass=args.mass,
            lens_light=_lens_light(args),
            source=args.source,
            kind=args.kind,
            grid=args.grid,
            refine=args.refine,
            smooth_starts=args.smooth_starts,
            start_grid=args.start_grid,
            polish=args.polish,
            held_cells=args.held_cells,
            held_below=args.held_below,
            searched_cells=args.searched_cells,
            solver=args.solver,
            max_steps=args.max_steps,
            fit_tolerance=args.fit_tolerance,
            mesh=args.mesh,
            finer_meshes=args.finer_meshes,
            regularization="constant" if args.regularization is None else args.regularization,
            strength=args.regularization_strength,
            partial=partial,
            client=client,
            nested=args.nested,
        )


def _check_workers(workers: int) -> None:
    """`--workers` of `equilens subhalo` and `equilens demo --subhalo`: 1 to MAX_WORKERS."""
    if not 1 <= workers <= MAX_WORKERS:
        raise ValueError(f"--workers must be between 1 and {MAX_WORKERS}, got {workers}")


def _exit(out: dict[str, str], what: str | None = None) -> int:
    if out["status"] != "successful":
        # the results are written for inspection, but a failed fit is not a success
        what = what or ("the sampling" if "netcdf" in out else "the fit")
        print(f"equilens: {what} did not succeed: {out['status']}", file=sys.stderr)
        return 2
    return 0
