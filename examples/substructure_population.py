"""Simulate a JWST-like strong lens with its dark-matter substructure.

Draws one cold-dark-matter realisation of subhalos and line-of-sight halos (1e7-1e10 Msun)
with pyHalo (`pip install 'equilens[substructure]'`), puts the macro model (an SIE plus
external shear at z = 0.5) on the lens plane and traces through every plane to a source at
z = 2 (`equilens.mass.MultiPlane`), and observes the lens with and without the halos on a
JWST NIRCam-like grid (0.031" pixels, PSF FWHM 0.07"). Prints the number of halos and
planes, the projected mass of the subhalos within 1" of the centre, and how far the
substructure moves the arcs in units of the noise; writes `substructure.png` (the two
images and their difference over the noise) to $EQUILENS_EXAMPLE_OUT (default: the current
folder). Also runs a batch of 8 realisations through `el.simulate_batch`.

Most of the difference is a change of the ring's radius: the halos and pyHalo's negative
mass sheets change the mean convergence inside the ring, which a refit of the macro model
absorbs (the mass-sheet pitfall of docs/substructure.md); what a subhalo search looks for
is the small-scale residual left after that refit.

Units: arcsec for angles, electrons/s per pixel for images, Msun for masses.
"""

import os
import time

import jax

jax.config.update("jax_enable_x64", True)  # lens models want float64

import jax.numpy as jnp  # noqa: E402
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

import equilens as el  # noqa: E402
from equilens import light, mass, substructure  # noqa: E402

Z_LENS, Z_SOURCE = 0.5, 2.0
macro = mass.SIE(theta_E=1.1, e1=0.08, e2=-0.04) + mass.ExternalShear(gamma1=0.02, gamma2=0.01)
source = light.Sersic(amp=25.0, R_sersic=0.12, n_sersic=1.2, center_x=0.04, center_y=-0.02)
population = dict(sigma_sub=0.05, log_mlow=7.0, log_mhigh=10.0, cone_opening_angle_arcsec=6.0)

t0 = time.perf_counter()
lens = substructure.population(Z_LENS, Z_SOURCE, seed=2, macro=macro, **population)
planes = lens.components()
halos = [(z, m) for z, ms in planes for m in ms if isinstance(m, mass.TNFW)]
subhalos = [m for z, m in halos if z == Z_LENS]
print(
    f"{len(halos)} halos ({len(subhalos)} subhalos at the lens redshift) on "
    f"{len(lens.plane_redshifts)} planes, drawn in {time.perf_counter() - t0:.1f} s"
)

# the subhalos' projected mass within 1" of the lens centre (the flux of their deflection)
lc = el.LensCosmology(Z_LENS, Z_SOURCE, lens.cosmology)
inner = sum(lc.mass_within(m, 1.0) for m in subhalos)
print(f'projected subhalo mass within 1": {inner:.3g} Msun')

grid = el.Grid((128, 128), pixel_scale=0.031, supersampling=2)
psf = el.GaussianPSF(fwhm=0.07, pixel_scale=0.031)
smooth = el.LensSystem(mass=macro, source=source)  # (one plane: the single-plane lens)
lumpy = el.LensSystem(mass=lens, source=source)
key = jax.random.key(0)
t0 = time.perf_counter()
data = el.simulate(key, lumpy, grid, psf, exposure_time=3000.0, sky_level=0.5)
print(f"simulated {data.shape} image with the halos in {time.perf_counter() - t0:.1f} s")
difference = lumpy.image(grid, psf) - smooth.image(grid, psf)
z = np.asarray(difference / data.noise_map)
print(f"substructure moves the arcs by up to {np.max(np.abs(z)):.1f} sigma per pixel")

# a batch of realisations of the same model, observed in one compiled call
batch = mass.MultiPlane.stack(
    [substructure.population(Z_LENS, Z_SOURCE, seed=s, macro=macro, **population)
     for s in range(8)]
)  # fmt: skip
t0 = time.perf_counter()
images, _ = el.simulate_batch(
    key, lambda m: el.LensSystem(mass=m, source=source), batch, grid, psf,
    exposure_time=3000.0, sky_level=0.5, batch_size=4,
)  # fmt: skip
print(
    f"{images.shape[0]} realisations simulated in one call in {time.perf_counter() - t0:.1f} s "
    f"(compilation included); total flux {float(jnp.min(images.sum(axis=(1, 2)))):.0f}-"
    f"{float(jnp.max(images.sum(axis=(1, 2)))):.0f} e-/s"
)

out = os.environ.get("EQUILENS_EXAMPLE_OUT", ".")
fig, axes = plt.subplots(1, 3, figsize=(12, 4), constrained_layout=True)
extent = [float(grid.x.min()), float(grid.x.max()), float(grid.y.min()), float(grid.y.max())]
for ax, im, title in (
    (axes[0], smooth.image(grid, psf), "smooth lens"),
    (axes[1], data.data, "with substructure (observed)"),
):
    ax.imshow(np.asarray(im), origin="lower", extent=extent, cmap="magma")
    ax.set_title(title)
lim = float(np.max(np.abs(z)))
shown = axes[2].imshow(z, origin="lower", extent=extent, cmap="RdBu_r", vmin=-lim, vmax=lim)
axes[2].set_title("(with - without) / noise")
for _, m in halos:
    axes[2].plot(float(m.center_x), float(m.center_y), ".", ms=1, color="k", alpha=0.3)
axes[2].set_xlim(extent[:2])
axes[2].set_ylim(extent[2:])
fig.colorbar(shown, ax=axes[2])
fig.savefig(os.path.join(out, "substructure.png"), dpi=120)
print(f"wrote {os.path.join(out, 'substructure.png')}")
