"""Simulate an HST-like strong lens and inspect its lensing quantities.

Builds a lens system from typed modules (an SIE plus external shear, a Sersic lens galaxy
and a Sersic source), observes it with a 21x21 pixelated PSF, sky and Poisson noise, and
prints the Einstein radius, the magnification of the brightest image and the critical
curves. Writes `simulated_lens.png` to $EQUILENS_EXAMPLE_OUT (default: the current folder).

Units: arcsec for angles, electrons/s per pixel for images, e-/s/arcsec^2 for brightness.
"""

import os

import jax

jax.config.update("jax_enable_x64", True)  # lens models want float64

import jax.numpy as jnp  # noqa: E402
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

import equilens as el  # noqa: E402
from equilens import light, mass  # noqa: E402

# The lens: lenstronomy's parameter names and conventions.
e1, e2 = el.ellipticity_from_q_phi(q=0.8, phi=0.4)  # axis ratio and angle (rad, CCW from +x)
system = el.LensSystem(
    mass=mass.SIE(theta_E=1.3, e1=e1, e2=e2) + mass.ExternalShear(gamma1=0.03, gamma2=0.02),
    lens_light=light.Sersic(amp=6.0, R_sersic=1.0, n_sersic=4.0, e1=e1, e2=e2),
    source=light.Sersic(amp=30.0, R_sersic=0.1, n_sersic=1.0, center_x=0.05, center_y=-0.03),
)

# 100x100 pixels of 0.05", each evaluated on 2x2 sub-pixels; a Gaussian PSF pixelated to 21x21.
grid = el.Grid((100, 100), pixel_scale=0.05, supersampling=2)
kernel = el.GaussianPSF(fwhm=0.1, pixel_scale=0.05).kernel()
pad = (21 - kernel.shape[0]) // 2
psf = el.PixelPSF(jnp.pad(kernel, pad))
imaging = el.simulate(jax.random.key(0), system, grid, psf, exposure_time=2000.0, sky_level=2.0)
print(
    f"simulated {imaging.shape} image, PSF {psf.kernel().shape}, "
    f"peak S/N {float(jnp.max(imaging.data / imaging.noise_map)):.0f}"
)

# Lensing quantities of the mass model.
curves = el.lensing.critical_curves(system.mass, el.Grid((300, 300), 0.02))
tangential = max(curves, key=len)
r_crit = np.hypot(tangential[:, 0], tangential[:, 1])
print(f'tangential critical curve: {r_crit.min():.3f}" to {r_crit.max():.3f}" (theta_E = 1.3")')
model = system.image(grid, psf)
i, j = np.unravel_index(np.argmax(np.asarray(system.lensed_source_image(grid))), grid.shape)
mu = system.mass.magnification(grid.x[i, j], grid.y[i, j])
print(
    f'brightest source pixel at ({float(grid.x[i, j]):.2f}, {float(grid.y[i, j]):.2f})", '
    f"magnification {float(mu):.1f}"
)

out = os.environ.get("EQUILENS_EXAMPLE_OUT", ".")
fig, axes = plt.subplots(1, 2, figsize=(9, 4.2), constrained_layout=True)
ext = [-2.5, 2.5, -2.5, 2.5]
axes[0].imshow(np.asarray(imaging.data), origin="lower", extent=ext, cmap="magma")
axes[0].set_title("data")
axes[1].imshow(np.asarray(model), origin="lower", extent=ext, cmap="magma")
for c in curves:
    axes[1].plot(c[:, 0], c[:, 1], color="cyan", lw=0.8)
axes[1].set_title("model + critical curves")
fig.savefig(os.path.join(out, "simulated_lens.png"), dpi=100)
print(f"wrote {os.path.join(out, 'simulated_lens.png')}")
