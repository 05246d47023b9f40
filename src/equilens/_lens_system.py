"""A lens system: a mass model, optional lens-galaxy light, and a source."""

import equinox as eqx
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
        convolves before binning. Any other combination raises `ValueError`.
        """
        x, y = grid.coordinates(supersampled=True)
        flux = self.surface_brightness(x, y) * grid.pixel_area
        if psf is None:
            return grid.bin(flux)
        sub_shape = flux.shape
        if isinstance(psf, FFTConvolution):
            if psf.image_shape == grid.shape:
                return psf(grid.bin(flux))
            if psf.image_shape == sub_shape:
                return grid.bin(psf(flux))
            raise ValueError(
                f"FFTConvolution prepared for shape {psf.image_shape}, but the grid has shape "
                f"{grid.shape} (supersampled {sub_shape})"
            )
        if psf.supersampling == 1:
            return psf.convolve(grid.bin(flux))
        if psf.supersampling == grid.supersampling:
            return grid.bin(psf.convolve(flux))
        raise ValueError(
            f"PSF supersampling {psf.supersampling} must be 1 or equal the grid's "
            f"supersampling {grid.supersampling}"
        )

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
