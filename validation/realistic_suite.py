"""Einstein radii on lenses that look like real data, fitted by `equilens fit` with its defaults.

The simulated suite (`simulated_suite.py`) builds its lenses from the families the fit itself
uses (Sersic lens light, Sersic and Gaussian sources): it tests the optimiser, not the
modelling of real galaxies. This suite is built without equilens's forward model and, where
it can be, without its model families:

- **sources are real galaxies**: postage stamps of the Hubble Deep Field (the colour image
  shipped with scikit-image, `skimage.data.hubble_deep_field`, summed over its channels):
  spirals, clumpy irregulars and mergers, each rescaled to a half-light radius of 0.08-0.3"
  in the source plane and rotated;
- **lens light that no Sersic or Gaussian sum describes exactly**: isophotes that twist (up
  to 20 degrees) and change their axis ratio with radius, boxy or disky (generalised
  ellipses `|x|^c + |y/q|^c`, c in 1.75-2.3: a4/a from +0.025 to -0.02, the range of
  observed ellipticals), some with a dust lane and some with a neighbouring galaxy that the
  user masks out;
- **masses off the fitted family**: elliptical power laws (slopes 1.9-2.1) with external
  shear and, for half the lenses, a boxy or disky m = 4 multipole (ray-traced by
  lenstronomy; the fit's default is an SIE with shear);
- **three instruments**: HST ACS (0.05" pixels, the Jackpot's F814W PSF), JWST NIRCam
  (0.04", an obscured Airy pattern at 2 um) and Euclid VIS (0.1", the VIS PSF of the Q1
  lens in ../shared/data, copied to validation/data);
- **two regimes**: bright arcs (peak arc S/N 20-60, the lens galaxy's peak 3-10x the arcs'
  peak) and faint arcs (S/N 5-10, the lens's peak 20-100x the arcs'): the lens's peak S/N
  per pixel is then 60-1000, as in real data (the Jackpot's lens peaks at S/N 103, the
  Euclid Q1 lens's at 73 under arcs of S/N about 6); the lens light at the Einstein radius
  over the arcs' peak is reported for each lens;
- **masks drawn as a user would**: a circle around the arcs and a patch over a neighbour.

Lenses 0-9 are the **development subset** (quick checks while tuning); lenses 10-29 are the
**held-out part**, drawn from their own random stream and kept out of every tuning decision:
their table is the estimate of how the defaults generalise. Lenses 30-49 are the **tuning
part**: drawn like the others (each from its own stream), added after the held-out part
was first reported, to measure a change on more lenses than the development subset
before it is adopted; like that subset, they are tuned on. Each lens is fitted by

    equilens fit image.fits --noise-map noise.fits --psf psf.fits --pixel-scale S
        --mask-radius R [--mask neighbour.fits] [--source pixelized] --json ...

(everything else the CLI's defaults; no parameter from the truth). Results are written per
lens as they finish (`lensNN_SOURCE.json` and `rows_SOURCE.json`); a rerun skips the lenses
already fitted, so an interrupted run keeps what it finished. The table (printed, and
written to `table_SOURCE.md`) has theta_E, its error, the reduced chi2, the arcs' residual
excess (`equilens.solve.ArcResiduals`), the status of each fit and the pixels its mask
grew by onto arcs beyond the circle (`equilens.solve.fit_to_arcs`), and per part how many
are within 1% and 2% and how many are called successful while 2% or more off. A pixelized
run (`--source pixelized`: the parametric fit, then the pixelized chain) gives both
columns.

    python validation/realistic_suite.py --output realistic_out
        [--part dev|held-out|tuning|all]
        [--lenses 0,1,2] [--source sersic|pixelized] [--make-only]

Needs lenstronomy and scikit-image (the `crosscheck` extra); the Euclid lenses' PSF is the
VIS PSF of the Euclid Q1 lens in ../shared/data, copied to validation/data (not part of the
package).
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

ROOT = pathlib.Path(__file__).resolve().parents[1]
HST_PSF = ROOT / "src" / "equilens" / "_data" / "SDSSJ0946+1006" / "psf.fits"
#: the Euclid Q1 lens's VIS PSF (validation/data/README.md)
EUCLID_PSF = ROOT / "validation" / "data" / "euclid_vis_psf.fits"

DEV = tuple(range(10))
HELD_OUT = tuple(range(10, 30))
TUNING = tuple(range(30, 50))
PARTS = {"dev": DEV, "held-out": HELD_OUT, "tuning": TUNING}
SEED = 47
SUPERSAMPLE = 5  # sub-pixels per side of the simulation (the fit uses its own)

#: pixel scale ("), pixels per side, exposure (s), sky noise (e-/s per pixel), theta_E range (")
INSTRUMENTS = {
    "hst": {
        "pixel_scale": 0.05,
        "n_pix": 110,
        "exposure": 2000.0,
        "sky": 0.008,
        "theta_E": (0.8, 1.8),
    },
    "jwst": {
        "pixel_scale": 0.04,
        "n_pix": 150,
        "exposure": 3000.0,
        "sky": 0.01,
        "theta_E": (0.6, 1.5),
    },
    "euclid": {
        "pixel_scale": 0.1,
        "n_pix": 64,
        "exposure": 2200.0,
        "sky": 0.02,
        "theta_E": (0.9, 2.0),
    },
}
ORDER = ("hst", "jwst", "euclid")


# ---------------------------------------------------------------------------------------
# ingredients


#: the two stars (diffraction spikes) of the Hubble Deep Field image: (column, row) pixels
#: of their centroids
HDF_STARS = ((253, 166), (767, 565))


def hdf_galaxies(min_area: int = 250, max_area: int = 4000) -> list[np.ndarray]:
    """Postage stamps of the galaxies of the Hubble Deep Field image shipped with
    scikit-image (the 72 galaxies of 250-4000 pixels above 5 sigma: 74 objects less two stars): the
    channel sum minus the sky, zero outside each galaxy's (dilated) segment, unit sum.
    In the order of `scipy.ndimage.label` (by first row), the same on every machine."""
    import scipy.ndimage as nd
    from skimage.data import hubble_deep_field

    rgb = hubble_deep_field()
    grey = rgb.astype(float).sum(-1)
    smooth = nd.gaussian_filter(grey, 1.5)
    sky = np.median(smooth)
    spread = 1.4826 * np.median(np.abs(smooth - sky))
    labels, n = nd.label(smooth > sky + 5 * spread)
    areas = nd.sum(np.ones_like(grey), labels, range(1, n + 1))
    stamps = []
    for i, box in enumerate(nd.find_objects(labels)):
        star = any(
            box[0].start <= r < box[0].stop and box[1].start <= c < box[1].stop
            for c, r in HDF_STARS
        )
        if not min_area <= areas[i] <= max_area or star:
            continue
        r0, r1 = max(box[0].start - 4, 0), min(box[0].stop + 4, grey.shape[0])
        c0, c1 = max(box[1].start - 4, 0), min(box[1].stop + 4, grey.shape[1])
        seg = nd.binary_dilation(labels[r0:r1, c0:c1] == i + 1, iterations=3)
        stamp = np.clip(grey[r0:r1, c0:c1] - sky, 0, None) * seg
        stamps.append(stamp / stamp.sum())
    return stamps


def half_light_radius(stamp: np.ndarray) -> float:
    """Half-light radius of `stamp` (pixels) about its centroid."""
    yy, xx = np.indices(stamp.shape, dtype=float)
    cy, cx = (stamp * yy).sum(), (stamp * xx).sum()
    r = np.hypot(yy - cy, xx - cx).ravel()
    order = np.argsort(r)
    cumulative = np.cumsum(stamp.ravel()[order])
    return float(r[order][np.searchsorted(cumulative, 0.5)])


def airy_psf(pixel_scale: float, wavelength_um: float = 2.0, size: int = 25) -> np.ndarray:
    """A JWST-like PSF: the Airy pattern of a 6.5 m aperture with a 0.11 central
    obscuration at `wavelength_um`, integrated over pixels of `pixel_scale`, normalised."""
    from scipy.special import j1

    over = 9
    lam_d = wavelength_um * 1e-6 / 6.5 * 206264.806  # arcsec
    n = size * over
    c = (np.arange(n) - (n - 1) / 2) * pixel_scale / over
    r = np.hypot(*np.meshgrid(c, c))
    u = np.pi * r / lam_d
    eps = 0.11
    with np.errstate(invalid="ignore", divide="ignore"):
        amp = np.where(u > 0, 2 * j1(u) / u, 1.0) - eps**2 * np.where(
            u > 0, 2 * j1(eps * u) / (eps * u), 1.0
        )
    psf = (amp**2).reshape(size, over, size, over).mean(axis=(1, 3))
    return psf / psf.sum()


def instrument_psf(name: str) -> np.ndarray:
    from astropy.io import fits

    if name == "hst":
        psf = fits.getdata(HST_PSF).astype(float)
    elif name == "jwst":
        psf = airy_psf(INSTRUMENTS["jwst"]["pixel_scale"])
    else:
        psf = fits.getdata(EUCLID_PSF).astype(float)
    return psf / psf.sum()


def lens_light_profile(x: np.ndarray, y: np.ndarray, p: dict) -> np.ndarray:
    """Surface brightness of a lens galaxy whose isophotes twist (position angle `pa` at the
    centre, `pa + twist` far out), change axis ratio (`q_in` -> `q_out` across `r_t`) and
    are generalised ellipses (`|x'|^c + |y'/q|^c`: c > 2 boxy, c < 2 disky): a de
    Vaucouleurs-like bulge (Sersic index `n`) plus an exponential envelope, times a dust
    lane's attenuation when `dust` is set. Units: the bulge's brightness at `r_e` is 1."""
    dx, dy = x - p["center_x"], y - p["center_y"]
    rc = np.hypot(dx, dy)
    w = rc / (rc + p["r_t"])
    pa = p["pa"] + p["twist"] * w
    q = p["q_in"] + (p["q_out"] - p["q_in"]) * w
    xr = np.cos(pa) * dx + np.sin(pa) * dy
    yr = -np.sin(pa) * dx + np.cos(pa) * dy
    c = p["c"]
    m = (np.abs(xr * np.sqrt(q)) ** c + np.abs(yr / np.sqrt(q)) ** c) ** (1 / c)
    n = p["n"]
    b = 2 * n - 1 / 3 + 4 / (405 * n)
    m = np.maximum(m, 1e-4)
    bulge = np.exp(-b * ((m / p["r_e"]) ** (1 / n) - 1))
    envelope = p["envelope"] * np.exp(-m / p["r_env"])
    light = bulge + envelope
    if p.get("dust") is not None:
        d = p["dust"]
        across = -np.sin(d["pa"]) * dx + np.cos(d["pa"]) * dy - d["offset"]
        along = np.cos(d["pa"]) * dx + np.sin(d["pa"]) * dy
        tau = d["tau"] * np.exp(-0.5 * (across / d["width"]) ** 2)
        tau = tau * np.exp(-0.5 * (along / d["length"]) ** 2)
        light = light * np.exp(-tau)
    return light


def companion_profile(x: np.ndarray, y: np.ndarray, p: dict) -> np.ndarray:
    """A neighbouring galaxy: an exponential disc of scale `h`, axis ratio `q`."""
    dx, dy = x - p["x"], y - p["y"]
    xr = np.cos(p["pa"]) * dx + np.sin(p["pa"]) * dy
    yr = -np.sin(p["pa"]) * dx + np.cos(p["pa"]) * dy
    return np.exp(-np.hypot(xr * np.sqrt(p["q"]), yr / np.sqrt(p["q"])) / p["h"])


# ---------------------------------------------------------------------------------------
# drawing a lens


def draw_lens(i: int, n_stamps: int) -> dict:
    """Lens `i`'s ingredients. Each lens draws from its own random stream (`SEED`, `i`), so
    the held-out lenses do not change when the development subset does."""
    rng = np.random.default_rng([SEED, i])
    instrument = ORDER[i % 3]
    spec = INSTRUMENTS[instrument]
    theta_e = rng.uniform(*spec["theta_E"])
    q = rng.uniform(0.55, 0.95)
    phi = rng.uniform(0, np.pi)
    e = (1 - q) / (1 + q)
    cx, cy = rng.normal(0, 0.5 * spec["pixel_scale"], 2)
    g, gphi = rng.uniform(0.0, 0.1), rng.uniform(0, np.pi)
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
    if rng.uniform() < 0.5:  # boxy or disky mass: an m = 4 multipole along the major axis
        mass.append(
            {
                "m": 4,
                "a_m": rng.uniform(-0.01, 0.01) * theta_e,
                "phi_m": phi,
                "center_x": cx,
                "center_y": cy,
            }
        )
    light = {
        "center_x": cx,
        "center_y": cy,
        "pa": phi + rng.normal(0, 0.2),
        "twist": rng.uniform(-0.35, 0.35),
        "q_in": float(np.clip(q + rng.normal(0.05, 0.07), 0.5, 1.0)),
        "q_out": float(np.clip(q + rng.normal(0.0, 0.07), 0.4, 1.0)),
        "r_t": rng.uniform(0.3, 1.0),
        "c": rng.uniform(1.75, 2.3),
        "n": rng.uniform(3.0, 6.0),
        "r_e": rng.uniform(0.4, 1.2) * theta_e,
        "envelope": rng.uniform(0.0, 0.5),
        "r_env": rng.uniform(1.0, 2.0) * theta_e,
        "dust": None,
    }
    if rng.uniform() < 0.2:
        light["dust"] = {
            "pa": light["pa"] + rng.normal(0, 0.3),
            "offset": rng.normal(0, 0.1),
            "width": rng.uniform(0.03, 0.08),
            "length": rng.uniform(0.5, 1.0) * theta_e,
            "tau": rng.uniform(0.3, 1.0),
        }
    companion = None
    if rng.uniform() < 0.3:
        d, a = rng.uniform(1.2, 1.6) * theta_e + 0.5, rng.uniform(0, 2 * np.pi)
        companion = {
            "x": cx + d * np.cos(a),
            "y": cy + d * np.sin(a),
            "h": rng.uniform(0.08, 0.2),
            "q": rng.uniform(0.4, 1.0),
            "pa": rng.uniform(0, np.pi),
            "flux_ratio": rng.uniform(0.03, 0.2),
        }
    r, a = theta_e * rng.uniform(0.0, 0.3), rng.uniform(0, 2 * np.pi)
    source = {
        "stamp": int(rng.integers(n_stamps)),
        "r_half": rng.uniform(0.08, 0.3),
        "rotation": rng.uniform(0, 2 * np.pi),
        "center_x": cx + r * np.cos(a),
        "center_y": cy + r * np.sin(a),
    }
    faint = bool(i % 2)
    regime = {
        "faint_arcs": faint,
        "arc_snr": rng.uniform(5, 10) if faint else rng.uniform(20, 60),
        "lens_to_arc": rng.uniform(20, 100) if faint else rng.uniform(3, 10),
    }
    mask_radius = round(1.15 * theta_e + 0.6 + rng.uniform(-0.15, 0.15), 1)
    return {
        "index": i,
        "part": next((name for name, part in PARTS.items() if i in part), "other"),
        "instrument": instrument,
        "mass": mass,
        "lens_light": light,
        "companion": companion,
        "source": source,
        "regime": regime,
        "mask_radius": mask_radius,
    }


def _grid(spec: dict, over: int) -> tuple[np.ndarray, np.ndarray]:
    n, s = spec["n_pix"], spec["pixel_scale"]
    c = (np.arange(n * over) - (n * over - 1) / 2) * s / over
    return np.meshgrid(c, c)  # x grows with the column, y with the row


def _bin(a: np.ndarray, over: int) -> np.ndarray:
    n = a.shape[0] // over
    return a.reshape(n, over, n, over).mean(axis=(1, 3))


def lensed_source(lens: dict, stamps: list[np.ndarray]) -> np.ndarray:
    """The source's surface brightness at the sub-pixels of lens `lens` (unit total flux in
    the source plane, per arcsec^2), ray-traced by lenstronomy."""
    from lenstronomy.LensModel.lens_model import LensModel

    spec = INSTRUMENTS[lens["instrument"]]
    x, y = _grid(spec, SUPERSAMPLE)
    names = ["EPL", "SHEAR"] + ["MULTIPOLE"] * (len(lens["mass"]) - 2)
    bx, by = LensModel(names).ray_shooting(x.ravel(), y.ravel(), lens["mass"])
    return stamp_brightness(lens["source"], stamps, bx, by).reshape(x.shape)


def stamp_brightness(src: dict, stamps: list[np.ndarray], bx: np.ndarray, by: np.ndarray):
    """The surface brightness (unit total flux, per arcsec^2) at source-plane positions
    `(bx, by)` of the stamp `src["stamp"]` scaled to a half-light radius `src["r_half"]`
    (arcsec), rotated by `src["rotation"]` and centred on `src["center_x"], ["center_y"]`
    (cubic interpolation)."""
    import scipy.ndimage as nd

    stamp = stamps[src["stamp"]]
    scale = src["r_half"] / half_light_radius(stamp)  # arcsec per stamp pixel
    yy, xx = np.indices(stamp.shape, dtype=float)
    cy, cx = (stamp * yy).sum(), (stamp * xx).sum()
    dx, dy = bx - src["center_x"], by - src["center_y"]
    rot = src["rotation"]
    u = (np.cos(rot) * dx + np.sin(rot) * dy) / scale + cx
    v = (-np.sin(rot) * dx + np.cos(rot) * dy) / scale + cy
    sb = nd.map_coordinates(stamp, [v, u], order=3, mode="constant", cval=0.0)
    return np.clip(sb, 0, None) / scale**2


def simulate(lens: dict, stamps: list[np.ndarray]) -> dict:
    """Image (e-/s per pixel), noise map, PSF and exclusion mask of lens `lens`, with the
    numbers of its regime (the arcs' and the lens's peak S/N, the lens light at theta_E
    over the arcs' peak)."""
    from scipy.signal import fftconvolve

    spec = INSTRUMENTS[lens["instrument"]]
    psf = instrument_psf(lens["instrument"])
    s = spec["pixel_scale"]
    x, y = _grid(spec, SUPERSAMPLE)
    area = s * s

    def observed(sb: np.ndarray) -> np.ndarray:
        return fftconvolve(_bin(sb, SUPERSAMPLE) * area, psf, mode="same")

    arcs = observed(lensed_source(lens, stamps))
    galaxy = observed(lens_light_profile(x, y, lens["lens_light"]))
    comp = lens["companion"]
    neighbour = observed(companion_profile(x, y, comp)) if comp is not None else 0 * galaxy
    # regime: the arcs' peak brightness A set by their S/N against the sky and the lens
    # light's Poisson noise at the Einstein radius, the lens galaxy's peak lens_to_arc x A
    px, py = _grid(spec, 1)
    m0 = lens["mass"][0]
    ring = np.abs(np.hypot(px - m0["center_x"], py - m0["center_y"]) - m0["theta_E"]) < 0.5 * s
    reg = lens["regime"]
    t, sky = spec["exposure"], spec["sky"]
    galaxy = galaxy / galaxy.max()
    at_ring = float(np.median(galaxy[ring])) * reg["lens_to_arc"]  # over A
    # A / sqrt(sky^2 + (A + at_ring A) / t) = arc_snr: A^2 - k (1 + at_ring) A / t - k sky^2 = 0
    k = reg["arc_snr"] ** 2
    b_coef = k * (1 + at_ring) / t
    peak = 0.5 * (b_coef + math.sqrt(b_coef**2 + 4 * k * sky**2))
    arcs = arcs * peak / arcs.max()
    galaxy = galaxy * reg["lens_to_arc"] * peak
    if comp is not None:
        neighbour = neighbour * comp["flux_ratio"] * galaxy.sum() / neighbour.sum()
    clean = arcs + galaxy + neighbour
    rng = np.random.default_rng([SEED, lens["index"], 1])
    image = rng.poisson(np.clip(clean, 0, None) * t) / t + rng.normal(0, sky, clean.shape)
    noise = np.sqrt(sky**2 + np.clip(clean, 0, None) / t)
    exclude = np.zeros(clean.shape, dtype=np.int16)
    if comp is not None:  # the user's patch over the neighbour: where it is above 1 sigma
        exclude[np.asarray(neighbour) > noise] = 1
        patch = np.hypot(px - comp["x"], py - comp["y"]) < 4 * comp["h"] + 2 * s
        exclude[patch] = 1
    return {
        "image": image,
        "noise": noise,
        "psf": psf,
        "exclude": exclude,
        "arcs": arcs,
        "galaxy": galaxy,
        "arc_peak_snr": float((arcs / noise).max()),
        "lens_peak_snr": float((galaxy / noise).max()),
        "ring_to_arc": float(np.median(galaxy[ring]) / arcs.max()),
    }


# ---------------------------------------------------------------------------------------
# fitting and the table


def write_lens(lens: dict, sim: dict, folder: str) -> dict[str, str]:
    from astropy.io import fits

    paths = {}
    for name in ("image", "noise", "psf", "exclude"):
        if name == "exclude" and not sim["exclude"].any():
            continue
        paths[name] = os.path.join(folder, f"lens{lens['index']:02d}_{name}.fits")
        data = sim[name] if name == "exclude" else np.asarray(sim[name], dtype=np.float64)
        fits.PrimaryHDU(data).writeto(paths[name], overwrite=True)
    with open(os.path.join(folder, f"lens{lens['index']:02d}_truth.json"), "w") as f:
        json.dump(
            {**lens, **{k: sim[k] for k in ("arc_peak_snr", "lens_peak_snr", "ring_to_arc")}},
            f,
            indent=2,
        )
    return paths


def fit_one(lens: dict, paths: dict[str, str], folder: str, source: str) -> dict:
    """Fits lens `lens` with `equilens fit` and its defaults, in a process of its own (as a
    user runs the command; one process fitting tens of lenses of different shapes would
    hold their compiled programs until Linux's limit of memory mappings stops it); the
    row of the table."""
    spec = INSTRUMENTS[lens["instrument"]]
    out = os.path.join(folder, f"lens{lens['index']:02d}_{source}.json")
    argv = [
        "fit",
        paths["image"],
        "--noise-map",
        paths["noise"],
        "--psf",
        paths["psf"],
        "--pixel-scale",
        str(spec["pixel_scale"]),
        "--mask-radius",
        str(lens["mask_radius"]),
        "--json",
        out,
    ]
    if "exclude" in paths:
        argv += ["--mask", paths["exclude"]]
    if source == "pixelized":
        argv += ["--source", "pixelized"]
    t0 = time.perf_counter()
    command = "import sys; from equilens.cli import main; sys.exit(main(sys.argv[1:]))"
    code = subprocess.run([sys.executable, "-c", command, *argv], check=False).returncode
    wall = time.perf_counter() - t0
    true = lens["mass"][0]["theta_E"]
    row = {
        "lens": lens["index"],
        "part": lens["part"],
        "instrument": lens["instrument"],
        "faint_arcs": lens["regime"]["faint_arcs"],
        "theta_E_true": true,
        "exit": code,
        "wall_s": wall,
    }
    if not os.path.exists(out):  # the command refused or failed before writing
        return {**row, "theta_E_fit": None, "error": None, "status": "no result"}
    with open(out) as f:
        result = json.load(f)
    fitted = result["components"][0]["parameters"]["theta_E"]["value"]
    arcs = result.get("arc_residuals")
    row |= {
        "mask_added": (result.get("mask") or {}).get("added"),  # pixels grown onto arcs
        "theta_E_fit": fitted,
        "error": (fitted - true) / true,
        "reduced_chi2": result["reduced_chi2"],
        "arc_excess": None if arcs is None else arcs["excess"],
        "status": result["status"],
    }
    stage = result.get("parametric_stage")
    if stage is not None:  # the pixelized run's parametric first fit
        te = stage["components"][0]["parameters"]["theta_E"]["value"]
        arcs = stage.get("arc_residuals")
        row |= {
            "theta_E_parametric": te,
            "error_parametric": (te - true) / true,
            "status_parametric": stage["status"],
            "arc_excess_parametric": None if arcs is None else arcs["excess"],
        }
    return row


def table(rows: list[dict], source: str) -> str:
    """The markdown table of `rows` and, per part, how many are within 1% and 2% and how
    many are called successful while 2% or more off. For a pixelized run, its parametric
    first stage has columns of its own."""

    def pct(v):
        return "-" if v is None else f"{100 * v:+.2f}%"

    def num(v, digits=2):
        return "-" if v is None else f"{v:.{digits}f}"

    def short(status):  # the status's first words: "successful", "implausible", ...
        return "-" if status is None else status.split(":")[0].split(".")[0][:40]

    both = source == "pixelized"
    head = ["lens", "part", "instrument", "arcs", "theta_E true"]
    if both:
        head += ["parametric", "error", "arcs' excess", "status"]
    head += [source, "error", "reduced chi2", "arcs' excess", "status", "mask +", "exit"]
    head += ["wall time"]
    lines = ["| " + " | ".join(head) + " |", "| --- " * len(head) + "|"]
    for r in sorted(rows, key=lambda r: r["lens"]):
        cols = [
            str(r["lens"]),
            r["part"],
            r["instrument"],
            "faint" if r["faint_arcs"] else "bright",
            num(r["theta_E_true"], 4),
        ]
        if both:
            cols += [
                num(r.get("theta_E_parametric"), 4),
                pct(r.get("error_parametric")),
                num(r.get("arc_excess_parametric"), 1),
                short(r.get("status_parametric")),
            ]
        cols += [
            num(r["theta_E_fit"], 4),
            pct(r["error"]),
            num(r.get("reduced_chi2")),
            num(r.get("arc_excess"), 1),
            short(r["status"]),
            "-" if r.get("mask_added") is None else str(r["mask_added"]),
            str(r["exit"]),
            f"{r['wall_s']:.0f} s",
        ]
        lines.append("| " + " | ".join(cols) + " |")
    for part in (*PARTS, "other"):
        sub = [r for r in rows if r["part"] == part]
        if not sub:
            continue
        columns = [("parametric", "_parametric")] if both else []
        for name, suffix in [*columns, (source, "")]:
            errs = [r.get("error" + suffix) for r in sub]
            n1 = sum(e is not None and abs(e) < 0.01 for e in errs)
            n2 = sum(e is not None and abs(e) < 0.02 for e in errs)
            wrong = sum(
                (r.get("status" + suffix) or "").startswith("successful")
                and e is not None
                and abs(e) >= 0.02
                for r, e in zip(sub, errs, strict=True)
            )
            lines.append(
                f"\n{part}, {name}: within 1% {n1} of {len(sub)}, within 2% {n2} of "
                f"{len(sub)}; called successful while 2% or more off: {wrong}"
            )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", default="realistic_out")
    parser.add_argument("--part", default="dev", choices=[*PARTS, "all"])
    parser.add_argument("--lenses", default=None, help="comma-separated indices (overrides --part)")
    parser.add_argument("--source", default="sersic", choices=["sersic", "pixelized"])
    parser.add_argument("--make-only", action="store_true", help="write the data, fit nothing")
    args = parser.parse_args()
    os.makedirs(args.output, exist_ok=True)
    if args.lenses is not None:
        picked = [int(v) for v in args.lenses.split(",")]
    else:
        picked = list(DEV + HELD_OUT + TUNING if args.part == "all" else PARTS[args.part])
    stamps = hdf_galaxies()
    record = os.path.join(args.output, f"rows_{args.source}.json")
    rows = json.load(open(record)) if os.path.exists(record) else []
    done = {r["lens"] for r in rows}
    for i in picked:
        lens = draw_lens(i, len(stamps))
        sim = simulate(lens, stamps)
        paths = write_lens(lens, sim, args.output)
        print(
            f"lens {i:2d} ({lens['part']}, {lens['instrument']}): theta_E "
            f'{lens["mass"][0]["theta_E"]:.3f}", arc S/N {sim["arc_peak_snr"]:.1f}, lens '
            f"S/N {sim['lens_peak_snr']:.0f}, lens at theta_E / arcs {sim['ring_to_arc']:.1f}",
            flush=True,
        )
        if args.make_only or i in done:
            continue
        row = fit_one(lens, paths, args.output, args.source)
        rows.append(row)
        with open(record, "w") as f:  # after every lens: an interrupted run keeps it
            json.dump(rows, f, indent=2)
        err = "-" if row["error"] is None else f"{100 * row['error']:+.2f}%"
        print(f"  -> {row['theta_E_fit']} ({err}), {row['status']}, exit {row['exit']}", flush=True)
    if rows:
        text = table([r for r in rows if r["lens"] in picked], args.source)
        with open(os.path.join(args.output, f"table_{args.source}.md"), "w") as f:
            f.write(text + "\n")
        print("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
