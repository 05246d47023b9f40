"""The `equilens` command.

`equilens demo [--output DIR] [--seed N]` simulates an HST-like lens (SIE + external shear,
Sersic lens light, Sersic source; 100x100 pixels at 0.05", Gaussian PSF, sky and Poisson
noise), and writes `demo.png` (data, noise-free model with critical curves, source plane
with caustics) and `demo.fits` (the simulated image) to DIR (default `equilens_demo`).
"""

import argparse
import os
import sys
import time


def _demo_system():
    from . import LensSystem, light, mass

    return LensSystem(
        mass=mass.SIE(theta_E=1.2, e1=0.12, e2=-0.06) + mass.ExternalShear(0.04, -0.02),
        lens_light=light.Sersic(amp=8.0, R_sersic=0.9, n_sersic=3.5, e1=0.08, e2=-0.03),
        source=light.Sersic(
            amp=12.0, R_sersic=0.12, n_sersic=1.2, e1=0.1, e2=0.15, center_x=0.06, center_y=0.04
        ),
    )


def run_demo(output: str, seed: int = 0) -> dict[str, str]:
    """Simulates the demo lens and writes its figure and FITS image; returns the paths."""
    import jax

    jax.config.update("jax_enable_x64", True)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from astropy.io import fits

    from . import GaussianPSF, Grid, lensing, simulate

    t0 = time.perf_counter()
    system = _demo_system()
    grid = Grid((100, 100), 0.05, supersampling=2)
    psf = GaussianPSF(fwhm=0.1, pixel_scale=0.05)
    data = simulate(jax.random.key(seed), system, grid, psf, exposure_time=2000.0, sky_level=1.0)
    model = np.asarray(system.image(grid, psf))
    fine = Grid((200, 200), 0.025, supersampling=2)
    crit = lensing.critical_curves(system.mass, fine)
    caus = lensing.caustics(system.mass, fine)
    src_grid = Grid((100, 100), 0.006, origin=(0.06, 0.04))
    src = np.asarray(system.source_plane_image(src_grid))

    os.makedirs(output, exist_ok=True)
    half = 50 * 0.05
    ext = [-half, half, -half, half]
    fig, axes = plt.subplots(1, 3, figsize=(13.5, 4.4), constrained_layout=True)
    im = axes[0].imshow(np.asarray(data.data), origin="lower", extent=ext, cmap="magma")
    axes[0].set_title("simulated data (e-/s per pixel)")
    fig.colorbar(im, ax=axes[0], shrink=0.8)
    im = axes[1].imshow(model, origin="lower", extent=ext, cmap="magma")
    for line in crit:
        axes[1].plot(line[:, 0], line[:, 1], color="cyan", lw=0.8)
    axes[1].set_title("model and critical curves")
    fig.colorbar(im, ax=axes[1], shrink=0.8)
    sh = 50 * 0.006
    sext = [0.06 - sh, 0.06 + sh, 0.04 - sh, 0.04 + sh]
    im = axes[2].imshow(src, origin="lower", extent=sext, cmap="magma")
    for line in caus:
        axes[2].plot(line[:, 0], line[:, 1], color="cyan", lw=0.8)
    axes[2].set_xlim(sext[:2])
    axes[2].set_ylim(sext[2:])
    axes[2].set_title("source (e-/s/arcsec$^2$) and caustics")
    fig.colorbar(im, ax=axes[2], shrink=0.8)
    for ax in axes:
        ax.set_xlabel("x [arcsec]")
        ax.set_ylabel("y [arcsec]")
    png = os.path.join(output, "demo.png")
    fig.savefig(png, dpi=110)
    plt.close(fig)
    fits_path = os.path.join(output, "demo.fits")
    fits.PrimaryHDU(np.asarray(data.data)).writeto(fits_path, overwrite=True)
    print(
        f"equilens demo: simulated a {grid.shape[0]}x{grid.shape[1]} lens "
        f'(SIE theta_E = 1.2" + shear) in {time.perf_counter() - t0:.1f} s'
    )
    print(f"  figure: {png}")
    print(f"  image:  {fits_path}")
    return {"png": png, "fits": fits_path}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="equilens", description="equilens: strong gravitational lens modelling"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="simulate a lens and write its image as PNG")
    demo.add_argument("--output", default="equilens_demo", help="output folder")
    demo.add_argument("--seed", type=int, default=0, help="noise seed")
    args = parser.parse_args(argv)
    try:
        if args.command == "demo":
            run_demo(args.output, args.seed)
    except (ValueError, OSError) as err:
        print(f"equilens: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
