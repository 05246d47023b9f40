"""A lens system: a mass model, optional lens-galaxy light, and a source."""

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from ._custom_types import GridArray
from ._grid import Grid
from .light import AbstractLightProfile
from .mass import AbstractMassProfile
from .mass._base import Deflection
from .psf import AbstractPSF, FFTConvolution


class LensSystem(eqx.Module):
    """A single-plane lens: `mass` deflects the light of `source`; `lens_light` is the
    (unlensed) light of the deflector, or None.

    `image(grid, psf)` is the model image in flux per pixel: surface brightness (per
    arcsec^2) times the pixel area, averaged over the `grid.supersampling^2` sub-pixels of
    each pixel, convolved with the PSF (zero-padded 'same' convolution). As lenstronomy.
    """

    mass: AbstractMassProfile
    source: AbstractLightProfile
    lens_light: AbstractLightProfile | None = None

    def ray_shoot(self, x: GridArray, y: GridArray) -> Deflection:
        """Source-plane positions `beta = theta - alpha(theta)` (arcsec)."""
        return self.mass.ray_shoot(x, y)

    def surface_brightness(self, x: GridArray, y: GridArray) -> GridArray:
        """Unconvolved surface brightness per arcsec^2 seen at image positions `(x, y)`."""
        bx, by = self.mass.ray_shoot(x, y)
        out = self.source.intensity(bx, by)
        if self.lens_light is not None:
            out = out + self.lens_light.intensity(x, y)
        return out

    def image(
        self, grid: Grid, psf: AbstractPSF | FFTConvolution | None = None
    ) -> Float[Array, "ny nx"]:
        """Model image (flux per pixel) on `grid`, optionally convolved with `psf`.

        A PSF with `supersampling == 1` (or an `FFTConvolution` prepared for `grid.shape`)
        convolves the binned image; a PSF defined at the grid's supersampled resolution
        convolves before binning. Any other combination raises `ValueError`. With an FFT at
        the data resolution the model is evaluated on the FFT's column-padded domain and
        zeroed outside the image (exactly the zero-padded linear convolution, faster on CPU).
        Inside fits pass `psf.fft_operator(grid.shape)` (or `Imaging.convolution`), so that
        the kernel's transform is computed once rather than in every call.
        """
        if psf is None:
            return grid.bin(self._flux(grid))
        sub_shape = (grid.shape[0] * grid.supersampling, grid.shape[1] * grid.supersampling)
        if isinstance(psf, AbstractPSF):
            if psf.supersampling == grid.supersampling and grid.supersampling > 1:
                # PSF defined at the sub-pixel scale: convolve, then bin
                return grid.bin(psf.convolve(self._flux(grid)))
            if psf.supersampling != 1:
                raise ValueError(
                    f"PSF supersampling {psf.supersampling} must be 1 or equal the grid's "
                    f"supersampling {grid.supersampling}"
                )
            psf = psf.fft_operator(grid.shape)
        if psf.image_shape == sub_shape and grid.supersampling > 1:
            return grid.bin(psf(self._flux(grid)))
        if psf.image_shape != grid.shape:
            raise ValueError(
                f"FFTConvolution prepared for shape {psf.image_shape}, but the grid has shape "
                f"{grid.shape} (supersampled {sub_shape})"
            )
        # Evaluate the model directly on the FFT's column-padded domain (zeros right of the
        # image), binned at the data resolution, then convolve without a fused `pad`.
        padded = grid.padded((grid.shape[0], psf.fft_shape[1]))
        inside = np.zeros((sub_shape[0], padded.shape[1] * grid.supersampling), dtype=bool)
        inside[:, : sub_shape[1]] = True
        return psf.convolve_padded(padded.bin(jnp.where(inside, self._flux(padded), 0.0)))

    def _flux(self, grid: Grid) -> Float[Array, "rows cols"]:
        """Surface brightness times the pixel area on the grid's (sub-)pixel centres."""
        x, y = grid.coordinates(supersampled=True)
        return self.surface_brightness(x, y) * grid.pixel_area

    def source_plane_image(self, grid: Grid) -> Float[Array, "ny nx"]:
        """The unlensed source's surface brightness (per arcsec^2) on a source-plane `grid`
        (sub-pixel averaged when the grid is supersampled)."""
        x, y = grid.coordinates(supersampled=True)
        return grid.bin(self.source.intensity(x, y))

    def lensed_source_image(self, grid: Grid) -> Float[Array, "ny nx"]:
        """Lensed source alone, unconvolved, in flux per pixel."""
        x, y = grid.coordinates(supersampled=True)
        bx, by = self.mass.ray_shoot(x, y)
        return grid.bin(self.source.intensity(bx, by) * grid.pixel_area)
