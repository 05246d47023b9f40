"""The `equilens` command.

`equilens demo [--output DIR] [--solver NAME]` fits the HST image of SDSS J0946+1006 shipped
with the package (SIE + external shear, Sersic lens light, Sersic source with linear
amplitudes, 3" circular mask, 2x2 supersampling, generic start) and writes `demo.json` and
`demo.png` to DIR (default `equilens_demo`).

`equilens fit IMAGE.fits --noise-map NOISE.fits --psf PSF.fits --pixel-scale 0.05
[--mask MASK.fits] [--mask-radius R] --mass sie+shear [--lens-light sersic]
--source sersic --json OUT.json` fits a user's data the same way and writes OUT.json and a
PNG next to it. Errors are one line on stderr and a non-zero exit status.
"""

import argparse
import os
import sys
import time

DEMO_MASK_RADIUS = 3.0  # arcsec: the lens and the inner ring of SDSS J0946+1006
DEMO_SUPERSAMPLING = 2  # the source is compact (R ~ 0.1"): 2x2 sub-pixels per pixel


def _load(
    image: str,
    noise_map: str,
    psf: str,
    pixel_scale: float,
    exclude: str | None,
    radius: float | None,
    supersampling: int,
):
    import numpy as np

    from . import Imaging

    if not pixel_scale > 0:
        raise ValueError(f"--pixel-scale must be > 0 arcsec, got {pixel_scale}")
    if radius is not None and not radius > 0:
        raise ValueError(f"--mask-radius must be > 0 arcsec, got {radius}")
    full = Imaging.from_fits(image, noise_map, psf, pixel_scale, exclude_mask=exclude)
    mask = np.asarray(full.mask)
    if radius is not None:
        mask = mask & full.grid.circular_mask(radius)
    return Imaging(
        np.asarray(full.data),
        np.asarray(full.noise_map),
        full.psf,
        pixel_scale,
        mask=mask,
        supersampling=supersampling,
    ).cropped()


def run_fit(
    imaging,
    json_path: str,
    mass: str,
    lens_light: str | None,
    source: str,
    solver: str = "lm",
    title: str = "",
    extra: dict | None = None,
) -> dict[str, str]:
    """Fits `imaging` (`equilens.solve.fit_lens`), prints the parameters with errors, and
    writes the JSON result to `json_path` and the figure next to it (`.png`)."""
    from .plot import plot_fit
    from .solve import fit_lens, write_json

    t0 = time.perf_counter()
    print(
        f"equilens: fitting {mass} mass, {lens_light or 'no'} lens light, {source} source to "
        f"{imaging.shape[0]}x{imaging.shape[1]} pixels ({int(imaging.mask.sum())} in the mask)"
    )
    # a progress bar per fit when a person is watching (stderr is a terminal)
    result = fit_lens(
        imaging, mass, lens_light, source, solver=solver, progress=sys.stderr.isatty()
    )
    print(result.table())
    folder = os.path.dirname(os.path.abspath(json_path))
    os.makedirs(folder, exist_ok=True)
    write_json(json_path, result, **(extra or {}))
    png = os.path.splitext(json_path)[0] + ".png"
    plot_fit(result.model, imaging, png, title=title)
    print(f"  result: {json_path}\n  figure: {png}\n  wall time {time.perf_counter() - t0:.1f} s")
    return {"json": json_path, "png": png}


def run_demo(output: str, solver: str = "lm") -> dict[str, str]:
    """Fits the shipped HST image of SDSS J0946+1006; returns the output paths."""
    from importlib.resources import files

    folder = files("equilens") / "_data" / "SDSSJ0946+1006"
    imaging = _load(
        str(folder / "image.fits"),
        str(folder / "noise_map.fits"),
        str(folder / "psf.fits"),
        0.05,
        str(folder / "mask_extra_galaxies.fits"),
        DEMO_MASK_RADIUS,
        DEMO_SUPERSAMPLING,
    )
    out = run_fit(
        imaging,
        os.path.join(output, "demo.json"),
        "sie+shear",
        "sersic",
        "sersic",
        solver,
        title="SDSS J0946+1006 (HST F814W): SIE + shear, Sersic lens light, Sersic source",
        extra={
            "data": "SDSS J0946+1006, HST ACS F814W (see equilens/_data/SDSSJ0946+1006)",
            "published_theta_E": 1.38,
        },
    )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="equilens", description="equilens: strong gravitational lens modelling"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="fit the shipped HST image of SDSS J0946+1006")
    demo.add_argument("--output", default="equilens_demo", help="output folder")
    demo.add_argument("--solver", default="lm", help="solver name (lm, bfgs, lbfgs, adam)")
    fit = sub.add_parser("fit", help="fit a lens model to your own imaging data")
    fit.add_argument("image", help="image FITS file (flux per pixel)")
    fit.add_argument("--noise-map", required=True, help="1-sigma noise FITS file")
    fit.add_argument("--psf", required=True, help="PSF kernel FITS file (odd-sized)")
    fit.add_argument("--pixel-scale", required=True, type=float, help="arcsec per pixel")
    fit.add_argument("--mask", help="FITS file, non-zero = pixel excluded")
    fit.add_argument("--mask-radius", type=float, help="use pixels within R arcsec of the centre")
    fit.add_argument("--mass", default="sie+shear", help="mass profiles, '+'-joined")
    fit.add_argument("--lens-light", default=None, help="lens light profiles (default none)")
    fit.add_argument("--source", default="sersic", help="source light profiles")
    fit.add_argument("--supersampling", type=int, default=1, help="sub-pixels per pixel side")
    fit.add_argument("--solver", default="lm", help="solver name (lm, bfgs, lbfgs, adam)")
    fit.add_argument("--json", required=True, help="output JSON path (PNG written beside it)")
    args = parser.parse_args(argv)

    import jax

    jax.config.update("jax_enable_x64", True)
    try:
        if args.command == "demo":
            run_demo(args.output, args.solver)
        else:
            if args.supersampling < 1:
                raise ValueError(f"--supersampling must be >= 1, got {args.supersampling}")
            imaging = _load(
                args.image,
                args.noise_map,
                args.psf,
                args.pixel_scale,
                args.mask,
                args.mask_radius,
                args.supersampling,
            )
            run_fit(imaging, args.json, args.mass, args.lens_light, args.source, args.solver)
    except (ValueError, OSError, RuntimeError, TypeError) as err:
        msg = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"equilens: error: {msg}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
