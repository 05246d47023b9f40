"""Fit the Euclid VIS image of Q1 lens 102018665_NEG576731213511114485 with the command a
user would run, and compare with PyAutoLens's published result.

The data (`../shared/data/EuclidQ1-102018665_NEG576731213511114485/`, not shipped with
equilens) are a 300x300 cutout at 0.1"/pixel. This script writes the VIS image, its noise
map, its PSF and an exclusion mask (neighbouring objects, and pixels flagged with
RMS >= 1e3) as FITS files, then runs

    equilens fit vis_image.fits --noise-map vis_noise.fits --psf vis_psf.fits
        --pixel-scale 0.1 --mask vis_exclude.fits --mask-radius 4.0
        --mass sie+shear --source sersic --json vis_sersic.json

(the MGE lens light is the default), and with `--source pixelized` the same followed by the
pixelized-source chain. PyAutoLens's fit (4.0" mask, 60-Gaussian MGE lens light, SIE +
shear, pixelized source with adaptive regularization) gives an SIE Einstein radius of
1.005" in equilens's (lenstronomy's) convention and q = 0.55.

    python validation/euclid_vis.py [--data DIR] [--output DIR] [--source sersic|pixelized]
"""

import argparse
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "..", "shared", "data", "EuclidQ1-102018665_NEG576731213511114485")
PYAUTOLENS = {"theta_E": 1.005, "q": 0.55, "shear": float(np.hypot(0.138, -0.063))}


def write_inputs(data: str, out: str) -> dict[str, str]:
    from astropy.io import fits

    with fits.open(os.path.join(data, "cutout.fits")) as hdul:
        image = np.asarray(hdul["VIS_FLUX"].data, dtype=np.float64)
        rms = np.asarray(hdul["VIS_RMS"].data, dtype=np.float64)
        psf = np.asarray(hdul["VIS_PSF"].data, dtype=np.float64)
    neighbours = np.asarray(fits.getdata(os.path.join(data, "mask_extra_galaxies.fits")))
    flagged = ~np.isfinite(rms) | (rms >= 1e3) | ~np.isfinite(image)
    exclude = (neighbours != 0) | flagged
    # excluded pixels still need finite, positive values in the files
    image = np.where(flagged, 0.0, image)
    rms = np.where(flagged, 1e3, rms)
    paths = {}
    for name, arr in (
        ("image", image),
        ("noise", rms),
        ("psf", psf),  # equilens normalises the kernel to sum 1 (it sums to 0.952)
        ("exclude", exclude.astype(np.int16)),
    ):
        paths[name] = os.path.join(out, f"vis_{name}.fits")
        fits.PrimaryHDU(arr).writeto(paths[name], overwrite=True)
    return paths


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default=DATA)
    parser.add_argument("--output", default="euclid_out")
    parser.add_argument("--source", default="sersic", choices=["sersic", "pixelized"])
    parser.add_argument("--lens-light", default="mge")
    args = parser.parse_args()
    os.makedirs(args.output, exist_ok=True)
    paths = write_inputs(args.data, args.output)
    from equilens.cli import main as equilens

    out = os.path.join(args.output, f"vis_{args.lens_light}_{args.source}.json")
    argv = [
        "fit",
        paths["image"],
        "--noise-map",
        paths["noise"],
        "--psf",
        paths["psf"],
        "--pixel-scale",
        "0.1",
        "--mask",
        paths["exclude"],
        "--mask-radius",
        "4.0",
        "--mass",
        "sie+shear",
        "--lens-light",
        args.lens_light,
        "--source",
        args.source,
        "--json",
        out,
    ]
    if args.source == "pixelized":
        argv += ["--mesh", "adaptive", "--regularization", "adaptive"]
    code = equilens(argv)
    with open(out) as f:
        result = json.load(f)
    sie = result["components"][0]["parameters"]
    shear = result["components"][1]["parameters"]
    e = np.hypot(sie["e1"]["value"], sie["e2"]["value"])
    ours = {
        "theta_E": sie["theta_E"]["value"],
        "q": (1 - e) / (1 + e),
        "shear": float(np.hypot(shear["gamma1"]["value"], shear["gamma2"]["value"])),
    }
    print(f"\nexit status {code}; reduced chi2 {result['reduced_chi2']:.3f}")
    print("| quantity | equilens | PyAutoLens |")
    print("| --- | --- | --- |")
    for key in ("theta_E", "q", "shear"):
        err = sie.get(key, {}).get("error") if key == "theta_E" else None
        extra = f" +- {err:.4f}" if isinstance(err, float) else ""
        print(f"| {key} | {ours[key]:.4f}{extra} | {PYAUTOLENS[key]:.3f} |")
    if "log_evidence" in result:
        print(f"log evidence {result['log_evidence']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
