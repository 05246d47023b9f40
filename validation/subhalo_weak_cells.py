"""The Laplace evidence of weak cells of the Jackpot's subhalo scan against nested
sampling, and the importance-sampling correction along the subhalo
(`subhalo_scan(subhalo_samples=...)`): docs/subhalo.md.

From a finished `equilens demo --subhalo` (its folder holds `subhalo_smooth.pkl` and
`subhalo_cells.jsonl`), the scan is resumed from its cells (no fit is run again), then

- with `--block`: each cell's evidence again with the subhalo's block corrected by
  importance sampling (`laplace_evidence(block=...)`, 256 points, the macro model tried
  on the line from the smooth model's through the cell's fit too, as
  `subhalo_scan(subhalo_samples=256)` does), beside the scan's Laplace value (which the
  uncorrected part reproduces);
- with `--nested`: nested sampling (nautilus) of the smooth model once and of each cell,
  under the same priors (`subhalo_evidence`'s: the subhalo's over its cell and mass range,
  each shared parameter uniform over the union of every model's value +- 10 Laplace
  errors), the evidence difference and the subhalo's posterior (21-33 minutes a model on
  2 cores).

    python validation/subhalo_weak_cells.py DEMO_DIR CELL [CELL ...] [--block] [--nested]

or, with `--suite`, of an image of the subhalo suite (`validation/subhalo_suite.py`; its
prefix, e.g. `subhalo_out/lens00_null`): its data, mask and scan's files as the suite
wrote them, each cell's Delta log E also against the scan's final smooth model (the best
of its smooth refits, what the suite's rows report).
"""

import argparse
import functools
import json
import os
import pickle
import tempfile
import time

import equinox as eqx
import jax

jax.config.update("jax_enable_x64", True)
import numpy as np  # noqa: E402
from subhalo_suite import PIXEL_SCALE  # noqa: E402

import equilens.subhalo._scan as S  # noqa: E402
from equilens.cli._data import _load  # noqa: E402
from equilens.cli._demo import (  # noqa: E402
    JACKPOT_Z_LENS,
    JACKPOT_Z_SOURCE,
    SUBHALO_MASK_RADIUS,
    demo_imaging,
)
from equilens.cosmology import LensCosmology  # noqa: E402
from equilens.objective import Objective  # noqa: E402
from equilens.solve._block import BLOCK_SAMPLES  # noqa: E402
from equilens.solve._laplace import laplace_evidence  # noqa: E402
from equilens.solve._nested import nested_sample  # noqa: E402
from equilens.subhalo._nested import shared_intervals  # noqa: E402
from equilens.terms import LogEvidence  # noqa: E402


def suite_imaging(prefix: str):
    """The data of a subhalo suite's image (`prefix`: `.../lensNN_injected` or `_null`),
    masked as `validation/subhalo_suite.py` had `equilens subhalo` mask them."""
    folder, name = os.path.split(prefix)
    lens = name.split("_")[0]
    with open(os.path.join(folder, f"{lens}_truth.json")) as f:
        radius = json.load(f)["mask_radius"]
    return _load(
        f"{prefix}_image.fits",
        f"{prefix}_noise.fits",
        os.path.join(folder, f"{lens}_psf.fits"),
        PIXEL_SCALE,
        None,
        radius,
        1,
    )


def resumed_scan(folder: str, suite: bool = False):
    """The demo's (or with `suite`, a suite image's) objective and its scan's coarse cells,
    resumed from its checkpoint, with the smooth model's Laplace evidence (as the scan took
    it) and the log-evidence of the scan's final smooth model (None for the demo)."""
    if suite:
        files = (f"{folder}_smooth.pkl", f"{folder}_cells.jsonl")
        with open(f"{folder}.json") as f:
            final = json.load(f)["smooth_log_evidence"]
        imaging = suite_imaging(folder)
    else:
        names = ("subhalo_smooth.pkl", "subhalo_cells.jsonl")
        files = tuple(os.path.join(folder, n) for n in names)
        final, imaging = None, demo_imaging(SUBHALO_MASK_RADIUS)
    with open(files[0], "rb") as f:
        payload = pickle.load(f)
    smooth, adapt = payload["smooth"], payload["adapt_image"]
    objective = Objective(LogEvidence(imaging, adapt_image=adapt))
    checkpoint = os.path.join(tempfile.mkdtemp(), "cells.jsonl")
    with open(files[1]) as f, open(checkpoint, "w") as g:
        for line in f:
            record = json.loads(line)
            if "header" in record or "cell" in record:
                g.write(line)
    kept = {}
    real = S.laplace_evidence

    def keep(*args, **kw):
        ev = real(*args, **kw)
        kept.setdefault("smooth", ev)
        return ev

    S.laplace_evidence = keep
    try:
        scan = S.subhalo_scan(
            objective,
            smooth,
            LensCosmology(JACKPOT_Z_LENS, JACKPOT_Z_SOURCE),
            grid=5,
            kind="pseudo_jaffe",
            checkpoint=checkpoint,
            refine=0,
            polish=0,
            smooth_starts=0,
            progress=False,
        )
    finally:
        S.laplace_evidence = real
    return objective, scan, kept["smooth"], final


def cell_parts(objective, scan, i):
    """Cell `i`'s model, free parameters and bounds as the scan had them."""
    smooth = S._as_sum(scan.smooth)
    free, _ = S.scan_free(objective, smooth, None, None)
    model = scan.fits[i]
    n = len(model.mass.components)
    sub_free = S._free_with_subhalo(objective, smooth, free, None, model)
    return model, sub_free, {S._SubhaloField(n - 1, "log10_mass"): scan.mass_range}, n - 1


def block(objective, scan, smooth_ev, cells, final=None):
    start = dict(zip(smooth_ev.names, np.asarray(smooth_ev.raw_errors).tolist(), strict=True))
    print(
        "cell, centre, Laplace (the scan's), Laplace (again), corrected, its error, "
        "effective points"
        + ("; Laplace and corrected against the final smooth model" if final else "")
    )
    for i in cells:
        model, free, bounds, k = cell_parts(objective, scan, i)
        names = tuple(f"mass.components[{k}].{c}" for c in ("u", "v", "log10_mass"))
        # (the smooth model's macro model with the cell's subhalo: the line's far end)
        anchor = eqx.tree_at(
            lambda t: t.mass.components,
            model,
            (*S._as_sum(scan.smooth).mass.components, model.mass.components[k]),
        )
        ev = laplace_evidence(
            objective,
            model,
            free=free,
            bounds=bounds,
            smoothed=True,
            smoothing_start=start,
            smoothing_rounds=S.SMOOTHING_ROUNDS,
            block=names,
            block_samples=BLOCK_SAMPLES,
            block_anchors=(anchor,),
            block_response=S._subhalo_mass,
        )
        s0 = smooth_ev.log_evidence
        print(
            i,
            np.round(scan.centres[i], 2).tolist(),
            round(scan.log_evidence[i] - s0, 2),
            round(ev.log_evidence - ev.block_correction - s0, 2),
            round(ev.log_evidence - s0, 2),
            round(ev.log_evidence_error, 3),
            round(ev.effective_samples, 1),
            *(
                ()
                if final is None
                else (
                    round(scan.log_evidence[i] - final, 2),
                    round(ev.log_evidence - final, 2),
                )
            ),
            flush=True,
        )


def nested(objective, scan, cells):
    smooth = S._as_sum(scan.smooth)
    free, _ = S.scan_free(objective, smooth, None, None)
    # (label, cell index or None, model, free, bounds)
    models = [("smooth", None, smooth, free, None)]
    for i in cells:
        model, f, b, _ = cell_parts(objective, scan, i)
        models.append((f"cell {i}", i, model, f, b))
    # (every cell's subhalo is the mass's last component, of the same index)
    sub = f"mass.components[{len(models[-1][2].mass.components) - 1}]."
    intervals = shared_intervals(objective, [m[2:] for m in models], 10.0, sub)
    run = functools.partial(
        nested_sample,
        objective,
        intervals=intervals,
        n_live=1000,
        n_eff=3000,
        n_networks=2,
        seed=0,
    )
    log_z = {}
    for label, i, model, f, b in models:
        t = time.perf_counter()
        post = run(model, free=f, bounds=b)
        log_z[label] = post.log_evidence
        print(
            f"{label}: nested log Z {post.log_evidence:.2f} +- {post.log_evidence_error:.2f} "
            f"({time.perf_counter() - t:.0f} s)",
            flush=True,
        )
        if i is not None:
            q = post.quantiles((0.16, 0.5, 0.84))
            names = {
                c: post.names.index(sub_name)
                for c in ("u", "v", "log10_mass")
                for sub_name in [f"mass.components[{len(model.mass.components) - 1}].{c}"]
            }
            print(
                f"  Delta log E: nested {post.log_evidence - log_z['smooth']:.2f}, Laplace "
                f"{scan.delta_log_evidence[i]:.2f}; u, v, log10 mass (16/50/84%): "
                + "; ".join(str(np.round(q[:, k], 3).tolist()) for k in names.values()),
                flush=True,
            )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder")
    parser.add_argument("cells", type=int, nargs="+")
    parser.add_argument("--block", action="store_true")
    parser.add_argument("--nested", action="store_true")
    parser.add_argument("--suite", action="store_true", help="FOLDER is a suite image's prefix")
    args = parser.parse_args(argv)
    objective, scan, smooth_ev, final = resumed_scan(args.folder, args.suite)
    if args.block:
        block(objective, scan, smooth_ev, args.cells, final)
    if args.nested:
        nested(objective, scan, args.cells)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
