"""A subhalo candidate against other source models: the Delta log-evidence of given cells of
one image of the subhalo suite (`subhalo_suite.py`), with the smooth model and the cells
fitted again for each source model (mesh, regularization, supersampling).

A false detection in a null image comes from what the smooth model cannot describe (a real
galaxy's structure finer than the source mesh, pixels too coarse for its compact clumps),
which a subhalo partly absorbs; a true subhalo's evidence should not depend on these
choices. This script measures both: run it on a null image's false cell and on an injected
image's true cell.

    python validation/subhalo_source_models.py --suite subhalo_out --lens 0 --which null
        --cells=-1.68,0.84 --half 0.42
        --variants "adaptive:32x32/constant/1" "delaunay:1000/adaptive/2"

Each variant is `MESH/REGULARIZATION/SUPERSAMPLING` (as `equilens subhalo --mesh`,
`--regularization`, `--supersampling`); each runs in a process of its own (`--jobs` at a
time) and writes `OUT/lensNN_WHICH_MESH_REG_SS.json`; the table is printed at the end.
"""

import argparse
import json
import math
import os
import pathlib
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from subhalo_suite import PIXEL_SCALE, Z_LENS, Z_SOURCE


def one(stem: str, mask_radius: float, variant: str, cells, half: float, out: str) -> dict:
    """The smooth fit and the cells for one source model, in this process."""
    import jax

    jax.config.update("jax_enable_x64", True)
    import numpy as np

    import equilens as el
    from equilens.cli._data import _load
    from equilens.cli._parametric import parametric_fit
    from equilens.cli._source import _pixelized_stage, make_mesh, make_regularization
    from equilens.solve import fit_lens

    mesh_spec, reg, ss = variant.split("/")
    t0 = time.perf_counter()
    imaging = _load(
        f"{stem}_image.fits",
        f"{stem}_noise.fits",
        os.path.join(os.path.dirname(stem), os.path.basename(stem).split("_")[0] + "_psf.fits"),
        PIXEL_SCALE,
        None,
        mask_radius,
        int(ss),
    )
    smooth = parametric_fit(
        fit_lens,
        imaging,
        "epl+shear",
        None,
        "pixelized",
        pixelized=True,
        solver="lm",
        max_steps=None,
        positions=None,
        positions_sigma=None,
        progress=False,
        partial=None,
    )
    mesh = make_mesh(mesh_spec, imaging)
    smooth, inversion, _, _ = _pixelized_stage(
        imaging, smooth, mesh, make_regularization(reg, None), None, "lm", None, None, False
    )
    objective = el.Objective(el.LogEvidence(imaging, adapt_image=inversion.adapt_image))
    scan = el.subhalo_scan(
        objective,
        smooth,
        el.LensCosmology(Z_LENS, Z_SOURCE),
        grid=np.asarray(cells, np.float64),
        half=half,
        kind="pseudo_jaffe",
        refine=0,
        progress=False,
        log=print,
    )
    result = {
        "variant": variant,
        "smooth_log_evidence": scan.smooth_log_evidence,
        "source_log_evidence": float(inversion.log_evidence),
        "cells": scan.to_dict()["cells"],
        "best": scan.best,
        "wall_time": time.perf_counter() - t0,
    }
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--suite", required=True, help="the subhalo suite's output folder")
    parser.add_argument("--lens", type=int, required=True)
    parser.add_argument("--which", choices=["injected", "null"], required=True)
    parser.add_argument("--cells", nargs="+", required=True, help="cell centres x,y (arcsec)")
    parser.add_argument("--half", type=float, required=True, help="cell half-width (arcsec)")
    parser.add_argument("--variants", nargs="+", required=True, help="MESH/REG/SUPERSAMPLING")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--output", default=None, help="default: the suite's folder")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    cells = [[float(v) for v in c.split(",")] for c in args.cells]
    stem = os.path.join(args.suite, f"lens{args.lens:02d}_{args.which}")
    with open(os.path.join(args.suite, f"lens{args.lens:02d}_truth.json")) as f:
        truth = json.load(f)
    out_dir = args.output or args.suite
    os.makedirs(out_dir, exist_ok=True)

    def path(v: str) -> str:
        tag = v.replace("/", "_").replace(":", "")
        return os.path.join(out_dir, f"lens{args.lens:02d}_{args.which}_{tag}.json")

    if args.one is not None:  # the child process of one variant
        one(stem, truth["mask_radius"], args.one, cells, args.half, path(args.one))
        return 0

    def run(v: str) -> None:
        if os.path.exists(path(v)):
            return
        with open(path(v) + ".log", "w") as log:
            subprocess.run(
                [sys.executable, __file__, *sys.argv[1:], "--one", v],
                stdout=log,
                stderr=subprocess.STDOUT,
                check=False,
            )

    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(run, args.variants))
    sub = truth.get("subhalo", {})
    print(f'lens {args.lens} {args.which}; cells {cells}, half {args.half}"')
    print("| variant | smooth log E | " + " | ".join(f"cell {c}" for c in cells) + " | best |")
    for v in args.variants:
        if not os.path.exists(path(v)):
            print(f"| {v} | failed: see {path(v)}.log |")
            continue
        with open(path(v)) as f:
            r = json.load(f)
        d = [c["delta_log_evidence"] for c in r["cells"]]
        b = r["best"]
        where = f"({b.get('center_x', math.nan):+.2f}, {b.get('center_y', math.nan):+.2f})"
        if args.which == "injected" and sub:
            off = math.hypot(b["center_x"] - sub["center_x"], b["center_y"] - sub["center_y"])
            where += f' {off:.3f}" off'
        print(
            f"| {v} | {r['smooth_log_evidence']:.1f} | "
            + " | ".join("-" if x is None else f"{x:.1f}" for x in d)
            + f" | {where} 10^{b.get('log10_mass', math.nan):.2f} ({r['wall_time']:.0f} s) |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
