"""Subhalo detection on simulated lenses: injection and recovery, and the null test, by
`equilens subhalo` with its defaults.

Each lens is simulated without equilens's forward model, twice from the same noise draw:
with a pseudo-Jaffe subhalo of 1e9-1e10 Msun on its arcs, and without. Its ingredients:

- **a real galaxy as the source**: a postage stamp of the Hubble Deep Field
  (`realistic_suite.hdf_galaxies`: spirals, clumpy irregulars, mergers) rescaled to a
  half-light radius of 0.1-0.25" in the source plane and rotated: no smooth profile and no
  pixelized reconstruction describes it exactly;
- **an elliptical power law with external shear** (slope 1.9-2.1, axis ratio 0.6-0.95,
  shear up to 0.08), Einstein radius 1.0-1.5", ray-traced by lenstronomy; the subhalo a
  lenstronomy `PJAFFE` whose parameters are those of `equilens.subhalo.Subhalo(kind=
  "pseudo_jaffe")` for its total mass (Vegetti et al. 2010's truncation on the host's
  Einstein ring), placed on a pixel where the arcs are brighter than a third of their peak;
- **HST-like data**: 0.05" pixels (100 x 100), the Jackpot's F814W PSF, 2,000 s of exposure,
  sky and Poisson noise, the arcs' peak S/N per pixel 15-40; the lens light subtracted (as
  Vegetti et al. 2010 worked on the Jackpot); the redshifts the Jackpot's (0.222, 0.609).

Each image is scanned by

    equilens subhalo image.fits --noise-map noise.fits --psf psf.fits --pixel-scale 0.05
        --mask-radius R --z-lens 0.222 --z-source 0.609 --kind pseudo_jaffe
        --mass epl+shear --lens-light none [--workers N] --json ...

(a pixelized source, 5 x 5 cells; the smooth model a power law with shear, the family of
the truth's macro model: the test is of the detection, not of a macro model's shortfall,
which a subhalo also absorbs). A detection is a best cell with Delta log E > 10; it is
recovered when its subhalo is within 0.1" of the truth. The null images pass when no cell
has Delta log E > 5. A cell's Delta log E is the refined cell's (the mean of its 2 x 2
sub-cells' evidences, `subhalo_scan`'s default `refine=2`; 3 x 3 before
aef4148) for the best cell, the coarse fit's for the
others; the subhalo reported is the best sub-cell's. Results are written per image as they
finish (`rows.json`); a rerun skips the images already scanned, and a scan interrupted
half-way resumes from its cells' file (`equilens subhalo`'s checkpoint).

The suite is a measurement of one version of the code: every row records the last commit
that changed `src/` (`src_commit`, and `src_dirty` when `src/` had uncommitted changes),
and a folder holding rows of another version is refused (`--allow-mixed` where the change
between them is known not to move the numbers). The finished rows of a version are kept in
the repository (`validation/results/subhalo_suite/`), so a suite longer than one sitting
accumulates.

    python validation/subhalo_suite.py --output subhalo_out [--lenses 0,1,2]
        [--which both|injected|null] [--workers 2] [--make-only]
        [--regularization constant|adaptive] [--allow-mixed]

Needs lenstronomy and scikit-image (the `crosscheck` extra) and, for `--workers`, the
`cluster` extra.
"""

import argparse
import json
import math
import os
import pathlib
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from realistic_suite import hdf_galaxies, instrument_psf, stamp_brightness

SEED = 50  # issue 50
N_LENSES = 10
PIXEL_SCALE = 0.05
N_PIX = 100
SUPERSAMPLE = 5
EXPOSURE = 2000.0
SKY = 0.008  # e-/s per pixel (sky noise)
Z_LENS, Z_SOURCE = 0.222, 0.609
#: Delta log E above which a best cell is a detection; below which a null image passes
DETECTED, NULL_PASS = 10.0, 5.0
#: how far (arcsec) a detection's subhalo may be from the truth's to be recovered
RECOVERED = 0.1


def draw_lens(i: int, n_stamps: int) -> dict:
    """Lens `i`'s ingredients, from its own random stream (`SEED`, `i`)."""
    rng = np.random.default_rng([SEED, i])
    theta_e = rng.uniform(1.0, 1.5)
    q, phi = rng.uniform(0.6, 0.95), rng.uniform(0, np.pi)
    e = (1 - q) / (1 + q)
    cx, cy = rng.normal(0, 0.5 * PIXEL_SCALE, 2)
    g, gphi = rng.uniform(0.0, 0.08), rng.uniform(0, np.pi)
    mass = [
        {
            "theta_E": theta_e,
            "gamma": rng.uniform(1.9, 2.1),
            "e1": e * np.cos(2 * phi),
            "e2": e * np.sin(2 * phi),
            "center_x": cx,
            "center_y": cy,
        },
        {"gamma1": g * np.cos(2 * gphi), "gamma2": g * np.sin(2 * gphi), "ra_0": 0, "dec_0": 0},
    ]
    r, a = theta_e * rng.uniform(0.0, 0.25), rng.uniform(0, 2 * np.pi)
    source = {
        "stamp": int(rng.integers(n_stamps)),
        "r_half": rng.uniform(0.1, 0.25),
        "rotation": rng.uniform(0, 2 * np.pi),
        "center_x": cx + r * np.cos(a),
        "center_y": cy + r * np.sin(a),
    }
    return {
        "index": i,
        "mass": mass,
        "source": source,
        "arc_snr": rng.uniform(15, 40),
        "log10_mass": rng.uniform(9.0, 10.0),
        "subhalo_pick": rng.uniform(),  # which bright arc pixel holds the subhalo
        "subhalo_offset": rng.uniform(-0.5, 0.5, 2) * PIXEL_SCALE,
        "mask_radius": round(theta_e + 0.7, 1),
    }


def _grid(over: int) -> tuple[np.ndarray, np.ndarray]:
    c = (np.arange(N_PIX * over) - (N_PIX * over - 1) / 2) * PIXEL_SCALE / over
    return np.meshgrid(c, c)  # x grows with the column, y with the row (equilens's frame)


def subhalo_kwargs(log10_mass: float, x: float, y: float, host_theta_e: float) -> dict:
    """lenstronomy `PJAFFE` keywords of equilens's pseudo-Jaffe `Subhalo` of total mass
    `10**log10_mass` Msun at `(x, y)` (the mass-to-profile convention is equilens's; the
    ray-tracing lenstronomy's)."""
    import jax

    jax.config.update("jax_enable_x64", True)
    from equilens import LensCosmology
    from equilens.subhalo import Subhalo

    sub = Subhalo(
        log10_mass=log10_mass,
        cell_x=x,
        cell_y=y,
        half=0.1,
        host_theta_E=host_theta_e,
        cosmology=LensCosmology(Z_LENS, Z_SOURCE),
        kind="pseudo_jaffe",
    ).profile()
    return {k: float(getattr(sub, k)) for k in ("sigma0", "Ra", "Rs", "center_x", "center_y")}


def arcs(lens: dict, stamps: list[np.ndarray], subhalo: dict | None) -> np.ndarray:
    """The arcs' surface brightness at the sub-pixels (unit total source flux per arcsec^2),
    ray-traced by lenstronomy through the macro model and `subhalo` (PJAFFE keywords)."""
    from lenstronomy.LensModel.lens_model import LensModel

    x, y = _grid(SUPERSAMPLE)
    names, kwargs = ["EPL", "SHEAR"], list(lens["mass"])
    if subhalo is not None:
        names, kwargs = [*names, "PJAFFE"], [*kwargs, subhalo]
    bx, by = LensModel(names).ray_shooting(x.ravel(), y.ravel(), kwargs)
    return stamp_brightness(lens["source"], stamps, bx, by).reshape(x.shape)


def simulate(lens: dict, stamps: list[np.ndarray]) -> dict:
    """Both images of lens `lens` (with and without its subhalo; the same noise draw), their
    noise maps, the PSF, and the subhalo's truth."""
    from scipy.signal import fftconvolve

    psf = instrument_psf("hst")

    def observed(sb: np.ndarray) -> np.ndarray:
        n = sb.shape[0] // SUPERSAMPLE
        binned = sb.reshape(n, SUPERSAMPLE, n, SUPERSAMPLE).mean(axis=(1, 3))
        return fftconvolve(binned * PIXEL_SCALE**2, psf, mode="same")

    smooth = observed(arcs(lens, stamps, None))
    # the subhalo on a pixel where the smooth arcs are brighter than a third of their peak
    px, py = _grid(1)
    bright = np.flatnonzero(smooth.ravel() > smooth.max() / 3)
    k = bright[min(int(lens["subhalo_pick"] * bright.size), bright.size - 1)]
    sx, sy = px.ravel()[k] + lens["subhalo_offset"][0], py.ravel()[k] + lens["subhalo_offset"][1]
    sub = subhalo_kwargs(lens["log10_mass"], sx, sy, lens["mass"][0]["theta_E"])
    perturbed = observed(arcs(lens, stamps, sub))
    # the arcs' peak A from their S/N against sky and their own Poisson noise:
    # A / sqrt(sky^2 + A / t) = snr  =>  A^2 - k A / t - k sky^2 = 0
    k = lens["arc_snr"] ** 2
    peak = 0.5 * (k / EXPOSURE + math.sqrt((k / EXPOSURE) ** 2 + 4 * k * SKY**2))
    norm = peak / smooth.max()
    out = {"psf": psf, "subhalo": {"center_x": sx, "center_y": sy, **sub}}
    rng = np.random.default_rng([SEED, lens["index"], 1])
    uniform = rng.uniform(size=smooth.shape)  # one draw for both: Poisson by inversion
    gauss = rng.normal(0, SKY, smooth.shape)
    for name, clean in (("null", smooth * norm), ("injected", perturbed * norm)):
        counts = _poisson_from_uniform(np.clip(clean, 0, None) * EXPOSURE, uniform)
        out[name] = {
            "image": counts / EXPOSURE + gauss,
            "noise": np.sqrt(SKY**2 + np.clip(clean, 0, None) / EXPOSURE),
        }
    out["arc_peak_snr"] = float((smooth * norm / out["null"]["noise"]).max())
    return out


def _poisson_from_uniform(lam: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Poisson draws of means `lam` from the uniforms `u` (the inverse CDF): the two images
    of a lens share their noise where their means agree."""
    from scipy.stats import poisson

    return poisson.ppf(u, lam)


def write(lens: dict, sim: dict, folder: str) -> dict[str, dict[str, str]]:
    from astropy.io import fits

    paths: dict[str, dict[str, str]] = {}
    stem = os.path.join(folder, f"lens{lens['index']:02d}")
    psf = f"{stem}_psf.fits"
    fits.PrimaryHDU(np.asarray(sim["psf"], dtype=np.float64)).writeto(psf, overwrite=True)
    for which in ("injected", "null"):
        paths[which] = {"psf": psf}
        for name in ("image", "noise"):
            path = f"{stem}_{which}_{name}.fits"
            fits.PrimaryHDU(np.asarray(sim[which][name], dtype=np.float64)).writeto(
                path, overwrite=True
            )
            paths[which][name] = path
    with open(f"{stem}_truth.json", "w") as f:
        json.dump(
            {**lens, "subhalo": sim["subhalo"], "arc_peak_snr": sim["arc_peak_snr"]},
            f,
            indent=2,
            default=lambda o: np.asarray(o).tolist(),
        )
    return paths


def code_version() -> dict:
    """The version of the code the scans run: the last commit that changed `src/` (short
    hash) and whether `src/` has uncommitted changes; `None` for both outside a git
    checkout."""
    root = pathlib.Path(__file__).resolve().parent.parent

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "-C", str(root), *args], capture_output=True, text=True, check=True
            )
        except (OSError, subprocess.CalledProcessError):
            return None
        return done.stdout.strip()

    commit = git("log", "-1", "--format=%h", "--", "src")
    dirty = git("status", "--porcelain", "--", "src")
    return {"src_commit": commit or None, "src_dirty": None if dirty is None else bool(dirty)}


def imported_equilens() -> str:
    """Where the scans' processes (this interpreter, this environment) import equilens
    from: its package folder."""
    command = "import equilens, os; print(os.path.dirname(equilens.__file__))"
    done = subprocess.run([sys.executable, "-c", command], capture_output=True, text=True)
    return done.stdout.strip()


def version_label(row: dict) -> str:
    """A row's (or `code_version`'s) version as text: the commit, `+` when `src/` was dirty."""
    return f"{row.get('src_commit')}{'+' if row.get('src_dirty') else ''}"


def other_versions(rows: list[dict], version: dict) -> list[dict]:
    """The rows of `rows` scanned by another version of the code than `version` (a row
    without a recorded version counts as another)."""
    mine = (version["src_commit"], version["src_dirty"])
    return [r for r in rows if (r.get("src_commit"), r.get("src_dirty")) != mine]


def scan_one(
    lens: dict,
    paths: dict[str, str],
    folder: str,
    which: str,
    workers: int,
    regularization: str = "constant",
) -> dict:
    """Scans one image with `equilens subhalo` in a process of its own (as a user runs
    it), the pixelized source's `regularization` (`--regularization`); the row of the
    table."""
    out = os.path.join(folder, f"lens{lens['index']:02d}_{which}.json")
    argv = [
        "subhalo",
        paths["image"],
        "--noise-map",
        paths["noise"],
        "--psf",
        paths["psf"],
        "--pixel-scale",
        str(PIXEL_SCALE),
        "--mask-radius",
        str(lens["mask_radius"]),
        "--z-lens",
        str(Z_LENS),
        "--z-source",
        str(Z_SOURCE),
        "--kind",
        "pseudo_jaffe",
        "--mass",
        "epl+shear",
        "--lens-light",
        "none",
        "--regularization",
        regularization,
        "--workers",
        str(workers),
        "--json",
        out,
    ]
    t0 = time.perf_counter()
    command = "import sys; from equilens.cli import main; sys.exit(main(sys.argv[1:]))"
    code = subprocess.run([sys.executable, "-c", command, *argv], check=False).returncode
    row = {
        "lens": lens["index"],
        "which": which,
        "exit": code,
        "wall_s": time.perf_counter() - t0,
        **code_version(),
    }
    if not os.path.exists(out):
        return {**row, "status": "no result"}
    with open(out) as f:
        result = json.load(f)
    best = result["best"]
    coarse = [c["delta_log_evidence"] for c in result["cells"]]
    # each cell's Delta log E, the refined cell's from its sub-cells (the mean of their
    # evidences: the same position prior over the cell, from n^2 fits): the detection
    # statistic is the largest; the best sub-cell's subhalo says where and how heavy
    cells = list(coarse)
    refined = result.get("refinement")
    if refined is not None and refined["cell_delta_log_evidence"] is not None:
        cells[refined["cell"]] = refined["cell_delta_log_evidence"]
    row |= {
        "delta_log_evidence": max((d for d in cells if d is not None), default=None),
        "best_sub_cell": best.get("delta_log_evidence"),
        "center_x": best.get("center_x"),
        "center_y": best.get("center_y"),
        "log10_mass": best.get("log10_mass"),
        "cells_failed": sum(d is None for d in cells),
        "cells_above_5": sum(d is not None and d > NULL_PASS for d in cells),
        "lowest_cell": min((d for d in cells if d is not None), default=None),
        "best_coarse_cell": max((d for d in coarse if d is not None), default=None),
        # the refined cell's Delta log E (the mean of its sub-cells' evidences)
        "refined_cell": best.get("cell_delta_log_evidence"),
        # "a subhalo anywhere on the grid" (every cell equally likely) against the smooth
        # model: the look-elsewhere-free comparison, beside the best-cell statistic
        "any_cell": result.get("delta_log_evidence_grid"),
        "smooth_gain": result.get("smooth_gain"),
        # the source mesh the smooth model's evidence chose (`--finer-meshes`)
        "mesh": result.get("mesh_kept"),
    }
    return row


def table(rows: list[dict], truths: dict[int, dict]) -> str:
    lines = [
        '| lens | arc S/N | true log10 M | injected: best Delta log E | offset (") | '
        "log10 M | null: best Delta log E | null cells > 5 | wall (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    found = recovered = null_ok = n_inj = n_null = 0
    for i in sorted(truths):
        t = truths[i]
        inj = next((r for r in rows if r["lens"] == i and r["which"] == "injected"), None)
        nul = next((r for r in rows if r["lens"] == i and r["which"] == "null"), None)
        cols = [str(i), f"{t['arc_peak_snr']:.0f}", f"{t['log10_mass']:.2f}"]
        if inj is not None and inj.get("delta_log_evidence") is not None:
            n_inj += 1
            off = math.hypot(
                inj["center_x"] - t["subhalo"]["center_x"],
                inj["center_y"] - t["subhalo"]["center_y"],
            )
            det = inj["delta_log_evidence"] > DETECTED
            found += det
            recovered += det and off < RECOVERED
            cols += [f"{inj['delta_log_evidence']:.1f}", f"{off:.3f}", f"{inj['log10_mass']:.2f}"]
        else:
            cols += ["-", "-", "-"]
        if nul is not None and nul.get("delta_log_evidence") is not None:
            n_null += 1
            null_ok += nul["delta_log_evidence"] < NULL_PASS
            cols += [f"{nul['delta_log_evidence']:.1f}", str(nul["cells_above_5"])]
        else:
            cols += ["-", "-"]
        wall = sum(r["wall_s"] for r in rows if r["lens"] == i)
        cols.append(f"{wall:.0f}")
        lines.append("| " + " | ".join(cols) + " |")
    lines.append("")
    lines.append(
        f"injected: {found} of {n_inj} detected (Delta log E > {DETECTED:g}), {recovered} "
        f'within {RECOVERED}" of the truth; null: {null_ok} of {n_null} without a detection '
        f"(best Delta log E < {NULL_PASS:g})"
    )
    versions = sorted({version_label(r) for r in rows})
    lines.append(f"code: src at {', '.join(versions)}" + (" (mixed)" if len(versions) > 1 else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", default="subhalo_out")
    parser.add_argument("--lenses", default=None, help="comma-separated indices (default all)")
    parser.add_argument("--which", default="both", choices=["both", "injected", "null"])
    parser.add_argument("--workers", type=int, default=1, help="equilens subhalo --workers")
    parser.add_argument("--make-only", action="store_true", help="write the data, scan nothing")
    parser.add_argument(
        "--regularization",
        default="constant",
        choices=["constant", "adaptive"],
        help="the pixelized source's (equilens subhalo --regularization); one output folder each",
    )
    parser.add_argument(
        "--allow-mixed",
        action="store_true",
        help="add rows to a folder holding rows of another version of src/ (one whose "
        "change is known not to move the numbers)",
    )
    args = parser.parse_args(argv)
    os.makedirs(args.output, exist_ok=True)
    picked = (
        list(range(N_LENSES)) if args.lenses is None else [int(v) for v in args.lenses.split(",")]
    )
    kinds = ["injected", "null"] if args.which == "both" else [args.which]
    record = os.path.join(args.output, "rows.json")
    rows = []
    if os.path.exists(record):
        with open(record) as f:
            rows = json.load(f)
    done = {(r["lens"], r["which"]) for r in rows}
    version = code_version()
    here = pathlib.Path(__file__).resolve().parent.parent / "src" / "equilens"
    used = imported_equilens()
    if not args.make_only and pathlib.Path(used or "/nonexistent").resolve() != here:
        # the version recorded is this checkout's: the scans must run its code
        print(
            f"the scans would import equilens from {used or '(nowhere)'}, not this "
            f"checkout's {here}: install it editable (pip install -e .) or set "
            "PYTHONPATH to its src/",
            file=sys.stderr,
        )
        return 2
    others = other_versions(rows, version)
    if others and not args.make_only:
        seen = ", ".join(sorted({version_label(r) for r in others}))
        print(
            f"{record} holds {len(others)} rows of src {seen}; this checkout's src is "
            f"{version_label(version)}: use another --output (one version a folder), or "
            "--allow-mixed where the change does not move the numbers",
            file=sys.stderr,
        )
        if not args.allow_mixed:
            return 2
    stamps = hdf_galaxies()
    truths = {}
    for i in picked:
        lens = draw_lens(i, len(stamps))
        sim = simulate(lens, stamps)
        paths = write(lens, sim, args.output)
        truths[i] = {**lens, "subhalo": sim["subhalo"], "arc_peak_snr": sim["arc_peak_snr"]}
        s = sim["subhalo"]
        print(
            f'lens {i}: theta_E {lens["mass"][0]["theta_E"]:.2f}", arc S/N '
            f"{sim['arc_peak_snr']:.0f}, subhalo 10^{lens['log10_mass']:.2f} Msun at "
            f'({s["center_x"]:+.2f}, {s["center_y"]:+.2f})"',
            flush=True,
        )
        if args.make_only:
            continue
        for which in kinds:
            if (i, which) in done:
                continue
            row = scan_one(
                lens, paths[which], args.output, which, args.workers, args.regularization
            )
            rows.append(row)
            with open(record, "w") as f:  # after every scan: an interrupted run keeps it
                json.dump(rows, f, indent=2)
            print(f"  {which}: {json.dumps(row)}", flush=True)
    if rows:
        text = table(rows, truths)
        with open(os.path.join(args.output, "table.md"), "w") as f:
            f.write(text + "\n")
        print("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
