"""Imaging datasets: data, noise, PSF and mask, from arrays or FITS files."""

import os
import warnings

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float

from .._checks import warn_if_float32
from .._grid import Grid
from ..psf import AbstractPSF, FFTConvolution, PixelPSF


def _load_fits(path: str | os.PathLike, hdu: int = 0, what: str = "image") -> np.ndarray:
    """The image in HDU `hdu` of a FITS file; `path` may name the extension itself, as
    `file.fits[NAME]` or `file.fits[N]` (astropy's and ds9's notation)."""
    from astropy.io import fits

    path = os.fspath(path)
    ext: int | str = hdu
    if path.endswith("]") and "[" in path and not os.path.isfile(path):
        path, _, name = path[:-1].rpartition("[")
        ext = int(name) if name.isdigit() else name
    if not os.path.isfile(path):
        raise ValueError(f"{what} file not found: {path}")
    try:
        hdul = fits.open(path)
    except (OSError, ValueError, TypeError) as err:
        raise ValueError(f"{what} file {path} is not a readable FITS file ({err})") from None
    with hdul:
        try:
            data = hdul[ext].data  # pyright: ignore[reportAttributeAccessIssue]
        except (KeyError, IndexError):
            data = None
        except (OSError, ValueError, TypeError) as err:  # a damaged data unit
            raise ValueError(f"{what} file {path}: cannot read HDU {ext} ({err})") from None
        if data is None:
            raise ValueError(f"{what} file {path} has no image data in HDU {ext}")
        return np.asarray(data, dtype=np.float64)


def _kernel_pixels(psf: AbstractPSF) -> tuple[int, int]:
    """The PSF kernel's size in image pixels (a supersampled kernel's, rounded up)."""
    ky, kx = psf.kernel().shape
    return -(-ky // psf.supersampling), -(-kx // psf.supersampling)


def _convolution(psf: AbstractPSF, shape: tuple[int, int], supersampling: int):
    """The PSF's FFT operator for images of `shape` pixels evaluated at `supersampling`
    (convolved at the sub-pixel level when the PSF is supersampled, else after binning)."""
    s = 1 if psf.supersampling == 1 else supersampling
    return psf.fft_operator((shape[0] * s, shape[1] * s))


class DataWarning(UserWarning):
    """A dataset that is valid but probably not what was meant (e.g. a PSF much wider than
    the sharpest feature in the data)."""


#: The PSF width check (`_psf_wider_than_data`) reads the data's local maxima with at least
#: this S/N whose eight neighbours have at least this S/N, at most this many (the brightest).
PEAK_SNR, NEIGHBOUR_SNR, MAX_PEAKS = 30.0, 10.0, 100


#: The directions in which `_peak_widths` measures a peak: along the rows, the columns and
#: the two diagonals (steps of 1, 1, sqrt 2, sqrt 2 pixels).
_DIRECTIONS = ((1, 0), (0, 1), (1, 1), (1, -1))


def _peak_widths(img: np.ndarray, r: int, c: int) -> np.ndarray | None:
    """The squared widths (pixels^2) of the peak of `img` at `(r, c)` in the four
    `_DIRECTIONS`, from the curvature of its logarithm (exact for a Gaussian:
    ln I(+h) + ln I(-h) - 2 ln I(0) = -h^2/sigma^2); None where it is not a positive peak."""
    if not 0 < r < img.shape[0] - 1 or not 0 < c < img.shape[1] - 1:
        return None
    out = np.empty(len(_DIRECTIONS))
    for k, (dr, dc) in enumerate(_DIRECTIONS):
        centre, one, two = img[r, c], img[r + dr, c + dc], img[r - dr, c - dc]
        if not (centre > 0 and one > 0 and two > 0):
            return None
        curvature = 2 * np.log(centre) - np.log(one) - np.log(two)
        if not curvature > 0:
            return None
        out[k] = (dr * dr + dc * dc) / curvature
    return out


def _psf_wider_than_data(
    data: np.ndarray, noise: np.ndarray, mask: np.ndarray, kernel: np.ndarray
) -> str | None:
    """Why the PSF cannot be the data's, or None. The data are the sky convolved with the
    PSF, so no feature in them is narrower than the PSF in any direction (for Gaussians,
    widths add in quadrature). The data's peaks in the mask (local maxima at S/N >=
    `PEAK_SNR` whose eight neighbours are at >= `NEIGHBOUR_SNR`; the `MAX_PEAKS` brightest)
    are measured along the rows, columns and diagonals: one narrower than half the PSF's
    width in the same direction says that the kernel is not the data's (another band's,
    another pixel scale's, or a flat kernel)."""
    ny, nx = data.shape
    snr = np.full(data.shape, -np.inf)
    np.divide(data, noise, out=snr, where=mask)
    mid = snr[1:-1, 1:-1]
    around = np.stack(
        [snr[1 + dr : ny - 1 + dr, 1 + dc : nx - 1 + dc] for dr in (-1, 0, 1) for dc in (-1, 0, 1)]
    )
    peak = (mid >= around.max(axis=0)) & (mid >= PEAK_SNR) & (around.min(axis=0) >= NEIGHBOUR_SNR)
    rows, cols = np.nonzero(peak)
    rows, cols = rows + 1, cols + 1
    kr, kc = np.unravel_index(int(np.argmax(kernel)), kernel.shape)
    w_psf = _peak_widths(kernel, int(kr), int(kc))
    positive = kernel[kernel > 0]
    if w_psf is None and (positive.size == 0 or kernel.max() < 2 * np.median(positive)):
        w_psf = np.full(len(_DIRECTIONS), np.inf)  # a kernel without a peak (flat)
    if rows.size == 0 or w_psf is None:
        return None
    worst, where = 0.0, None
    for k in np.argsort(snr[rows, cols])[::-1][:MAX_PEAKS]:
        w_data = _peak_widths(data, int(rows[k]), int(cols[k]))
        if w_data is not None and np.max(w_psf / w_data) > worst:
            worst, where = float(np.max(w_psf / w_data)), (int(rows[k]), int(cols[k]), w_data)
    if where is None or not worst > 4.0:
        return None
    r, c, w_data = where
    d = int(np.argmax(w_psf / w_data))
    fwhm = 2 * np.sqrt(2 * np.log(2))
    what = (
        "flat: it has no peak"
        if np.isinf(w_psf[d])
        else f"FWHM ~ {fwhm * np.sqrt(w_psf[d]):.3g} pixels at its peak, along {_NAMES[d]}"
    )
    return (
        f"the PSF ({what}) is more than twice as wide as a bright feature of the data (FWHM ~ "
        f"{fwhm * np.sqrt(w_data[d]):.3g} pixels at row {r}, column {c}, S/N "
        f"{snr[r, c]:.0f}), which the PSF cannot make: is it the data's PSF, at the data's "
        "pixel scale (or is that pixel a cosmic ray)?"
    )


_NAMES = ("y", "x", "a diagonal", "a diagonal")


def _at_least(lo: int, hi: int, size: int, n: int) -> tuple[int, int]:
    """The range `[lo, hi)` grown about its middle to `size` (at most `n`) inside `[0, n)`."""
    grow = size - (hi - lo)
    if grow <= 0:
        return lo, hi
    lo = max(lo - (grow + 1) // 2, 0)
    hi = min(lo + size, n)
    return max(hi - size, 0), hi


class Imaging(eqx.Module):
    """An imaging dataset: one band of pixel data with its noise, PSF and mask.

    **Arguments:**

    - `data`: image (flux per pixel, e.g. electrons/s), shape `(ny, nx)`; row 0 is the
      bottom of the image (y grows with the row, x with the column).
    - `noise_map`: 1-sigma noise per pixel, same shape and units, finite and > 0 on the mask.
    - `psf`: an `AbstractPSF` (e.g. `PixelPSF(kernel)`).
    - `pixel_scale`: arcsec per pixel.
    - `mask`: boolean `(ny, nx)`, True where the pixel is used in the fit (lenstronomy's
      `likelihood_mask` convention); default all pixels.
    - `supersampling`: sub-pixels per pixel side for model evaluation (default 1).
    - `origin`: (x, y) of the array centre in arcsec (default (0, 0)).

    Raises `ValueError` naming the problem for: non-2-d data, a shape mismatch, NaN or
    infinite data or noise inside the mask, non-positive noise inside the mask, an empty
    mask, a PSF kernel larger than the image; warns (`DataWarning`) when the PSF is more
    than twice as wide as a bright feature of the data (S/N >= 30) in some direction, which a
    convolution with it could not have made (the wrong band's or pixel scale's PSF, a flat
    kernel). Unused (masked-out) pixels are set to 0 data
    and unit noise; `ignored_bad_pixels` counts those among them that were bad (NaN or
    infinite data or noise, or noise <= 0: e.g. the NaN borders of a cutout).
    """

    data: Float[Array, "ny nx"]
    noise_map: Float[Array, "ny nx"]
    psf: AbstractPSF
    mask: Bool[Array, "ny nx"]
    grid: Grid
    convolution: FFTConvolution
    ignored_bad_pixels: int = eqx.field(static=True)

    def __init__(
        self,
        data: Float[ArrayLike, "..."],
        noise_map: Float[ArrayLike, "..."],
        psf: AbstractPSF,
        pixel_scale: float,
        mask: Bool[ArrayLike, "..."] | None = None,
        supersampling: int = 1,
        origin: tuple[float, float] = (0.0, 0.0),
    ):
        warn_if_float32()
        d = np.asarray(data, dtype=np.float64)
        n = np.asarray(noise_map, dtype=np.float64)
        if d.ndim != 2:
            raise ValueError(f"data must be a 2-d image, got shape {d.shape}")
        if n.shape != d.shape:
            raise ValueError(f"noise_map shape {n.shape} does not match data shape {d.shape}")
        m = np.ones(d.shape, dtype=bool) if mask is None else np.asarray(mask, dtype=bool)
        if m.shape != d.shape:
            raise ValueError(f"mask shape {m.shape} does not match data shape {d.shape}")
        if not m.any():
            raise ValueError("mask is empty: no pixel is used")
        if not np.all(np.isfinite(d[m])):
            raise ValueError(
                f"data has {int((~np.isfinite(d[m])).sum())} NaN/inf pixels inside the mask"
            )
        if not np.all(np.isfinite(n[m])):
            raise ValueError(
                f"noise_map has {int((~np.isfinite(n[m])).sum())} NaN/inf pixels inside the mask"
            )
        if not np.all(n[m] > 0):
            raise ValueError(
                f"noise_map must be > 0 inside the mask; {int((n[m] <= 0).sum())} pixels are not"
            )
        if not isinstance(psf, AbstractPSF):
            raise ValueError(f"psf must be an AbstractPSF (e.g. PixelPSF), got {type(psf)}")
        kernel = _kernel_pixels(psf)
        if kernel[0] > d.shape[0] or kernel[1] > d.shape[1]:
            raise ValueError(
                f"the PSF kernel ({kernel[0]}x{kernel[1]} image pixels) is larger than the "
                f"image ({d.shape[0]}x{d.shape[1]}): crop the kernel, or give a larger cutout"
            )
        if psf.supersampling == 1:
            why = _psf_wider_than_data(d, n, m, np.asarray(psf.kernel(), np.float64))
            if why is not None:
                warnings.warn(why, DataWarning, stacklevel=2)
        bad = ~(np.isfinite(d) & np.isfinite(n) & (np.where(np.isfinite(n), n, 0.0) > 0))
        self.ignored_bad_pixels = int((bad & ~m).sum())
        d = np.where(m, d, 0.0)
        n = np.where(m, n, 1.0)
        dtype = jnp.result_type(float)
        self.grid = Grid(d.shape, pixel_scale, origin, supersampling)
        if psf.supersampling not in (1, supersampling):
            raise ValueError(
                f"PSF supersampling {psf.supersampling} must be 1 or the dataset's "
                f"supersampling {supersampling}"
            )
        self.data = jnp.asarray(d, dtype=dtype)
        self.noise_map = jnp.asarray(n, dtype=dtype)
        self.psf = psf
        self.mask = jnp.asarray(m)
        self.convolution = _convolution(psf, d.shape, supersampling)

    @property
    def shape(self) -> tuple[int, int]:
        return self.grid.shape

    @property
    def pixel_scale(self) -> float:
        return self.grid.pixel_scale

    def with_supersampling(self, supersampling: int) -> "Imaging":
        """The same dataset with its model images evaluated on `supersampling`^2 sub-pixels
        per pixel (`Grid.supersampling`): data, noise, mask and PSF unchanged. E.g. 1 for a
        cheap first look (`fit_lens` searches at 1, then fits at the dataset's own). Raises
        `ValueError` for a factor that is not a positive integer, or when the PSF is
        supersampled (`psf.supersampling > 1`) at another factor."""
        g = self.grid
        grid = Grid(g.shape, g.pixel_scale, g.origin, supersampling, g.split)
        if self.psf.supersampling not in (1, supersampling):
            raise ValueError(
                f"PSF supersampling {self.psf.supersampling} must be 1 or the dataset's "
                f"supersampling {supersampling}"
            )
        convolution = _convolution(self.psf, g.shape, supersampling)
        return eqx.tree_at(lambda im: (im.grid, im.convolution), self, (grid, convolution))

    def shifted(self, dx: float, dy: float) -> "Imaging":
        """The same dataset with its grid moved by `(dx, dy)` arcsec on the sky (e.g. a
        band's registration offset from the model's reference frame)."""
        g = self.grid
        origin = (g.origin[0] + dx, g.origin[1] + dy)
        grid = Grid(g.shape, g.pixel_scale, origin, g.supersampling, g.split)
        return eqx.tree_at(lambda im: im.grid, self, grid)

    def cropped(self, margin: int | None = None) -> "Imaging":
        """The smallest sub-image holding the mask plus `margin` pixels on each side
        (default: the PSF kernel's half-width, at the data resolution), with the grid's
        origin moved so that every pixel keeps its sky position.

        With the default margin the fit is unchanged (light more than half a kernel away
        from every used pixel cannot reach it through the PSF) and cheaper. The sub-image is
        never smaller than the PSF kernel (grown inside the image where the mask is
        smaller). Raises `ValueError` for a negative margin."""
        k = self.psf.kernel().shape[0] // 2
        m = -(-k // self.psf.supersampling) if margin is None else int(margin)
        if m < 0:
            raise ValueError(f"margin must be >= 0 pixels, got {m}")
        mask = np.asarray(self.mask)
        rows, cols = np.nonzero(mask)
        ny, nx = mask.shape
        r0, r1 = int(max(rows.min() - m, 0)), int(min(rows.max() + m + 1, ny))
        c0, c1 = int(max(cols.min() - m, 0)), int(min(cols.max() + m + 1, nx))
        ky, kx = _kernel_pixels(self.psf)
        r0, r1 = _at_least(r0, r1, ky, ny)
        c0, c1 = _at_least(c0, c1, kx, nx)
        ps = self.grid.pixel_scale
        ox = self.grid.origin[0] + ((c0 + c1 - 1) / 2 - (nx - 1) / 2) * ps
        oy = self.grid.origin[1] + ((r0 + r1 - 1) / 2 - (ny - 1) / 2) * ps
        return Imaging(
            np.asarray(self.data)[r0:r1, c0:c1],
            np.asarray(self.noise_map)[r0:r1, c0:c1],
            self.psf,
            ps,
            mask=mask[r0:r1, c0:c1],
            supersampling=self.grid.supersampling,
            origin=(ox, oy),
        )

    @classmethod
    def from_fits(
        cls,
        image: str | os.PathLike,
        noise_map: str | os.PathLike,
        psf: str | os.PathLike,
        pixel_scale: float,
        exclude_mask: str | os.PathLike | None = None,
        mask: Bool[ArrayLike, "ny nx"] | None = None,
        supersampling: int = 1,
        hdu: int = 0,
        mask_radius: float | None = None,
        exclude_bad: bool = False,
    ) -> "Imaging":
        """Loads an image, its noise map and PSF kernel from FITS files (astropy).

        `exclude_mask` is an optional FITS file whose non-zero pixels are excluded; it is
        combined with `mask` (True = used) and with `mask_radius` (arcsec: only pixels whose
        centre lies within it of the image centre are used). Bad pixels outside the
        combined mask (a cutout's NaN border) are ignored and counted in
        `ignored_bad_pixels`; `exclude_bad=True` excludes the bad pixels inside it too
        (else they are refused: `ValueError`). The PSF kernel is normalised to sum 1; one
        as large as the image in either axis is refused (`ValueError`: the wrong file, e.g.
        the image itself). Each path may name its extension, `file.fits[NAME]` or `file.fits[N]`
        (else `hdu`).
        """
        d = _load_fits(image, hdu, "image")
        n = _load_fits(noise_map, hdu, "noise map")
        k = _load_fits(psf, hdu, "PSF")
        m = np.ones(d.shape, dtype=bool) if mask is None else np.asarray(mask, dtype=bool)
        if exclude_mask is not None:
            ex = _load_fits(exclude_mask, hdu, "mask")
            if ex.shape != d.shape:
                raise ValueError(f"mask shape {ex.shape} does not match image shape {d.shape}")
            m = m & (ex == 0)
        if exclude_bad:
            m = m & np.isfinite(d) & np.isfinite(n) & (np.where(np.isfinite(n), n, 0.0) > 0)
        if mask_radius is not None:
            if not mask_radius > 0:
                raise ValueError(f"mask_radius must be > 0 arcsec, got {mask_radius}")
            m = m & Grid(d.shape, pixel_scale).circular_mask(mask_radius)
        out = cls(d, n, PixelPSF(k), pixel_scale, mask=m, supersampling=supersampling)
        if k.shape[0] >= d.shape[0] or k.shape[1] >= d.shape[1]:
            # (a larger kernel is refused by the constructor) a kernel is a small stamp
            # around the PSF's peak: one as large as the image is almost surely the wrong
            # file, the image itself passed as the PSF
            same = " (it equals the image)" if k.shape == d.shape and np.array_equal(k, d) else ""
            raise ValueError(
                f"the PSF kernel {psf} ({k.shape[0]}x{k.shape[1]} pixels) is as large as the "
                f"image ({d.shape[0]}x{d.shape[1]}){same}: a PSF file holds a small stamp of "
                "the PSF, smaller than the image"
            )
        return out
