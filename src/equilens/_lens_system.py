"""A lens system: a mass model, optional lens-galaxy light, and a source."""

import functools
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from ._custom_types import GridArray
from ._grid import Grid
from .light import AbstractLightProfile, AbstractLinearLightProfile, LightSum
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
        return _render(grid, psf, self._flux)

    def _flux(self, grid: Grid) -> Float[Array, "rows cols"]:
        """Surface brightness times the pixel area on the grid's (sub-)pixel centres."""
        x, y = grid.coordinates(supersampled=True)
        return self.surface_brightness(x, y) * grid.pixel_area

    # -- linear light: the amplitudes of `AbstractLinearLightProfile` components --

    def linear_components(self) -> tuple[tuple[str, int], ...]:
        """The light components linear in their amplitudes, as `(field, index)` pairs:
        `field` is "lens_light" or "source", `index` the position in its `LightSum` (0 for
        a single profile). Their amplitudes, in this order, are what a linear solve fills."""
        out = []
        for name in ("lens_light", "source"):
            for i, comp in enumerate(_light_components(getattr(self, name))):
                if isinstance(comp, AbstractLinearLightProfile):
                    out.append((name, i))
        return tuple(out)

    def amplitudes(self) -> Float[Array, " n_linear"]:
        """All linear amplitudes (in `linear_components` order), concatenated."""
        amps = [jnp.reshape(c.amp, (-1,)) for c in self.linear_profiles()]
        if not amps:
            return jnp.zeros((0,))
        return jnp.concatenate(amps)

    def with_amplitudes(self, amps: Float[Array, " n_linear"]) -> "LensSystem":
        """A copy whose linear amplitudes are replaced by `amps` (`amplitudes` order)."""
        profiles = self.linear_profiles()
        sizes = [c.n_basis for c in profiles]
        if amps.shape != (sum(sizes),):
            raise ValueError(f"expected {sum(sizes)} amplitudes, got shape {amps.shape}")
        new, start = [], 0
        for c, n in zip(profiles, sizes, strict=True):
            new.append(jnp.reshape(amps[start : start + n], jnp.shape(c.amp)).astype(c.amp.dtype))
            start += n
        return eqx.tree_at(lambda s: [c.amp for c in s.linear_profiles()], self, new)

    def linear_images(
        self,
        grid: Grid,
        psf: AbstractPSF | FFTConvolution | None = None,
        fields: tuple[str, ...] = ("lens_light", "source"),
    ) -> tuple[Float[Array, "n_linear ny nx"], Float[Array, "ny nx"] | None]:
        """The model image of each linear basis function at unit amplitude (convolved and
        binned as `image`), and the image of the non-linear light (None when every light
        component is linear), so that `image = sum_k amp_k images[k] + fixed`.

        `fields` restricts both to the light of "lens_light" and/or "source" (a pixelized
        source is solved separately, by `equilens.LogEvidence`). Raises `ValueError` when
        the default `fields` hold no linear light component; with `fields` given, `images`
        may have no rows."""
        blocks, fixed = self.linear_image_blocks(grid, psf, fields)
        if not blocks:
            return jnp.zeros((0, *grid.shape), jnp.result_type(float)), fixed
        return jnp.concatenate(blocks, axis=0), fixed

    def linear_image_blocks(
        self,
        grid: Grid,
        psf: AbstractPSF | FFTConvolution | None = None,
        fields: tuple[str, ...] = ("lens_light", "source"),
    ) -> tuple[list[Float[Array, "n_block ny nx"]], Float[Array, "ny nx"] | None]:
        """`linear_images` with the images kept in blocks, one per run of consecutive
        linear components of one field (their concatenation is `linear_images`'s stack).

        A derivative with respect to the parameters of one field then carries no tangent
        through the other field's block (JAX keeps it a symbolic zero), which a linear
        solve that forms its normal equations block by block (`solve_amplitudes`) keeps
        all the way to the few-by-few matrices."""
        parts = [p for p in self.linear_components() if p[0] in fields]
        if not parts and fields == ("lens_light", "source"):
            raise ValueError("the lens system has no linear light component")

        def flux(field: str) -> Callable[[Grid], Float[Array, "n rows cols"]]:
            def fn(g: Grid) -> Float[Array, "n rows cols"]:
                x, y = g.coordinates(supersampled=True)
                if field == "source":
                    x, y = self.mass.ray_shoot(x, y)
                out = []
                for name, i in parts:
                    if name == field:
                        comp = _light_components(getattr(self, name))[i]
                        assert isinstance(comp, AbstractLinearLightProfile)
                        out.append(comp.basis(x, y))
                return jnp.concatenate(out, axis=0) * g.pixel_area

            return fn

        # each field rendered (binned, convolved) on its own, then stacked: a derivative
        # with respect to the parameters of one field then carries no tangent through the
        # other's images (JAX keeps them as symbolic zeros up to the stacking), so a fit of
        # the mass and source beside a held multi-Gaussian lens light does not convolve
        # the lens light's twenty tangent images per parameter
        runs = [name for k, (name, _) in enumerate(parts) if k == 0 or parts[k - 1][0] != name]
        images = [_render(grid, psf, flux(name)) for name in runs]
        # the non-linear light alone: the linear components are not evaluated again
        others = [
            (name, comp)
            for name in fields
            for comp in _light_components(getattr(self, name))
            if not isinstance(comp, AbstractLinearLightProfile)
        ]
        if not others:
            return images, None

        def other_flux(g: Grid) -> Float[Array, "rows cols"]:
            x, y = g.coordinates(supersampled=True)
            bx, by = self.mass.ray_shoot(x, y)
            total = [c.intensity(bx, by) if n == "source" else c.intensity(x, y) for n, c in others]
            return functools.reduce(jnp.add, total) * g.pixel_area

        return images, _render(grid, psf, other_flux)

    def linear_profiles(self) -> list[AbstractLinearLightProfile]:
        """The linear light components, in `linear_components` order."""
        out = []
        for name, i in self.linear_components():
            comp = _light_components(getattr(self, name))[i]
            assert isinstance(comp, AbstractLinearLightProfile)
            out.append(comp)
        return out

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


def _light_components(profile: AbstractLightProfile | None) -> tuple[AbstractLightProfile, ...]:
    if profile is None:
        return ()
    return profile.components if isinstance(profile, LightSum) else (profile,)


def _map2d(
    fn: Callable[[Float[Array, "a b"]], Float[Array, "c d"]], x: Float[Array, "*batch a b"]
) -> Float[Array, "*batch c d"]:
    return fn(x) if x.ndim == 2 else jax.vmap(fn)(x)


def _bin(grid: Grid, flux: Float[Array, "*batch rows cols"]) -> Float[Array, "*batch ny nx"]:
    return _map2d(grid.bin, flux)


def _render(
    grid: Grid,
    psf: AbstractPSF | FFTConvolution | None,
    flux_fn: Callable[[Grid], Float[Array, "*batch rows cols"]],
) -> Float[Array, "*batch ny nx"]:
    """Bins and convolves `flux_fn(g)` (flux per (sub-)pixel of a grid `g`, with optional
    leading batch axes) as `LensSystem.image` describes."""
    if psf is None:
        return _bin(grid, flux_fn(grid))
    # (a grid split over devices: the flux is computed split, convolved gathered)
    sub_shape = (grid.shape[0] * grid.supersampling, grid.shape[1] * grid.supersampling)
    if isinstance(psf, AbstractPSF):
        if psf.supersampling == grid.supersampling and grid.supersampling > 1:
            # PSF defined at the sub-pixel scale: convolve, then bin
            return _bin(grid, _map2d(psf.convolve, grid.gathered(flux_fn(grid))))
        if psf.supersampling != 1:
            raise ValueError(
                f"PSF supersampling {psf.supersampling} must be 1 or equal the grid's "
                f"supersampling {grid.supersampling}"
            )
        psf = psf.fft_operator(grid.shape)
    if psf.image_shape == sub_shape and grid.supersampling > 1:
        return _bin(grid, _map2d(psf, grid.gathered(flux_fn(grid))))
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
    flux = _bin(padded, jnp.where(inside, flux_fn(padded), 0.0))
    return _map2d(psf.convolve_padded, grid.gathered(flux))
