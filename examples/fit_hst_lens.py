"""Fit the real HST image of SDSS J0946+1006 shipped with equilens (what `equilens demo`
does), step by step.

The Imaging dataset comes from FITS files (image, noise map, PSF, a mask of nearby
galaxies); a 3" circular mask keeps the lens and its inner Einstein ring, and the image is
cropped to the mask plus the PSF's half-width (this changes nothing in the fit). The staged
fit (`equilens.solve.fit_lens`) starts from values measured on the data (light moments),
fits the lens light, then the SIE + shear mass and Sersic source from several Einstein
radii, then everything. Writes `hst_fit.json` and `hst_fit.png` to $EQUILENS_EXAMPLE_OUT.

Published: theta_E = 1.38" (Bolton et al. 2008) for the inner ring.
"""

import os
from importlib.resources import files

import jax

jax.config.update("jax_enable_x64", True)

import numpy as np  # noqa: E402

import equilens as el  # noqa: E402
from equilens.plot import plot_fit  # noqa: E402

folder = files("equilens") / "_data" / "SDSSJ0946+1006"
full = el.Imaging.from_fits(
    str(folder / "image.fits"),
    str(folder / "noise_map.fits"),
    str(folder / "psf.fits"),
    pixel_scale=0.05,
    exclude_mask=str(folder / "mask_extra_galaxies.fits"),
)
mask = np.asarray(full.mask) & full.grid.circular_mask(3.0)
imaging = el.Imaging(
    np.asarray(full.data), np.asarray(full.noise_map), full.psf, 0.05, mask=mask, supersampling=2
).cropped()
print(f"{imaging.shape} pixels after cropping, {int(imaging.mask.sum())} in the mask")

result = el.solve.fit_lens(imaging, mass="sie+shear", lens_light="sersic", source="sersic")
print(result.table())
theta_e = float(result.model.mass.components[0].theta_E)
print(f'theta_E = {theta_e:.3f}" (published 1.38"), {100 * (theta_e / 1.38 - 1):+.1f}%')

out = os.environ.get("EQUILENS_EXAMPLE_OUT", ".")
el.solve.write_json(os.path.join(out, "hst_fit.json"), result)
plot_fit(result.model, imaging, os.path.join(out, "hst_fit.png"))
assert abs(theta_e / 1.38 - 1) < 0.04
