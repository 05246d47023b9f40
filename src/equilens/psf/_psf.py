"""Point-spread functions and image convolution (FFT and direct)."""

import abc
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Complex, Float

from .._custom_types import FloatScalar, as_float


def fast_fft_size(n: int) -> int:
    """The smallest integer >= n whose prime factors are 2, 3, 5 or 7 (fast FFT sizes)."""
    m = max(int(n), 1)
    while True:
        k = m
        for p in (2, 3, 5, 7):
            while k % p == 0:
                k //= p
        if k == 1:
            return m
        m += 1


def fft_padded_shape(
    image_shape: tuple[int, int], kernel_shape: tuple[int, int]
) -> tuple[int, int]:
    """FFT shape for an exact 'same'-size linear convolution: `N + K//2` per axis is the
    least that keeps circular wrap-around out of the kept region, rounded up to a fast size."""
    return tuple(  # type: ignore[return-value]
        fast_fft_size(n + k // 2) for n, k in zip(image_shape, kernel_shape, strict=True)
    )


def direct_convolve(
    image: Float[Array, "ny nx"], kernel: Float[Array, "ky kx"]
) -> Float[Array, "ny nx"]:
    """'Same'-size linear convolution by direct summation (zero padding outside)."""
    return jax.scipy.signal.convolve2d(image, kernel, mode="same")


class FFTConvolution(eqx.Module):
    """A precomputed FFT convolution for one image shape and kernel.

    Holds the kernel's real FFT on the padded shape (see `fft_padded_shape`), so each
    convolution costs one `rfft2` and one `irfft2`. Made by `PixelPSF.fft_operator(shape)`.
    """

    kernel_ft: Complex[Array, "py px"]
    image_shape: tuple[int, int] = eqx.field(static=True)
    kernel_shape: tuple[int, int] = eqx.field(static=True)
    fft_shape: tuple[int, int] = eqx.field(static=True)

    def __init__(self, kernel: Float[Array, "ky kx"], image_shape: tuple[int, int]):
        self.image_shape = (int(image_shape[0]), int(image_shape[1]))
        self.kernel_shape = (int(kernel.shape[0]), int(kernel.shape[1]))
        self.fft_shape = fft_padded_shape(self.image_shape, self.kernel_shape)
        self.kernel_ft = jnp.fft.rfft2(kernel, s=self.fft_shape)

    def __call__(self, image: Float[Array, "ny nx"]) -> Float[Array, "ny nx"]:
        if image.shape != self.image_shape:
            raise ValueError(
                f"FFTConvolution was prepared for shape {self.image_shape}, got {image.shape}"
            )
        return self.convolve_padded(
            jnp.pad(image, ((0, 0), (0, self.fft_shape[1] - image.shape[1])))
        )

    def convolve_padded(self, padded: Float[Array, "ny px"]) -> Float[Array, "ny nx"]:
        """Convolves an image whose columns are already zero-padded to the FFT width
        (the image in the first `nx` columns, zeros up to `fft_shape[1]`); returns the
        'same'-size result. The row padding happens after the first (row-wise) FFT.

        A model evaluated directly on this domain stays vectorised: when XLA fuses a `pad`
        into the model's elementwise computation it evaluates it per element with bounds
        checks, which on CPU costs more than the extra columns."""
        ny, nx = self.image_shape
        py, px = self.fft_shape
        if padded.shape != (ny, px):
            raise ValueError(
                f"expected a column-padded image of shape {(ny, px)}, got {padded.shape}"
            )
        rows = jnp.fft.rfft(padded, axis=1)
        spectrum = jnp.fft.fft(jnp.pad(rows, ((0, py - ny), (0, 0))), axis=0)
        full = jnp.fft.irfft2(spectrum * self.kernel_ft, s=self.fft_shape)
        oy, ox = self.kernel_shape[0] // 2, self.kernel_shape[1] // 2
        return full[oy : oy + ny, ox : ox + nx].astype(padded.dtype)


class AbstractPSF(eqx.Module):
    """A point-spread function acting on model images (flux per pixel).

    `supersampling` says at which resolution the PSF is defined: 1 = the data pixels; s > 1 =
    pixels `s` times smaller, for convolving a supersampled model image before binning.
    """

    supersampling: eqx.AbstractVar[int]

    @abc.abstractmethod
    def kernel(self) -> Float[Array, "k k"]:
        """The normalised (sum 1) pixelated kernel, odd-sized, centred on its middle pixel."""

    def convolve(self, image: Float[Array, "ny nx"], method: str = "fft") -> Float[Array, "ny nx"]:
        """Convolves `image` ('same' size, zero outside): `method` is 'fft' or 'direct'."""
        if method == "fft":
            shape = (int(image.shape[0]), int(image.shape[1]))
            return FFTConvolution(self.kernel(), shape)(image)
        if method == "direct":
            return direct_convolve(image, self.kernel().astype(image.dtype))
        raise ValueError(f"convolution method must be 'fft' or 'direct', got {method!r}")

    def fft_operator(self, image_shape: tuple[int, int]) -> FFTConvolution:
        """The FFT convolution for images of `image_shape`, with the kernel transform done
        once (use it inside fits)."""
        return FFTConvolution(self.kernel(), image_shape)


def _as_kernel(kernel: Float[ArrayLike, "..."]) -> Float[Array, "..."]:
    return as_float(kernel)


class PixelPSF(AbstractPSF):
    """A pixelated PSF kernel (e.g. from a star or a PSF model), normalised to sum 1.

    **Arguments:**

    - `kernel`: 2-d array with odd side lengths, centred on its middle pixel.
    - `supersampling`: the kernel's pixels are `supersampling` times smaller than the data
      pixels (default 1).

    Raises `ValueError` for an even-sized, non-finite, negative-sum or non-2-d kernel.
    """

    kernel_array: Float[Array, "ky kx"]
    supersampling: int = eqx.field(static=True)

    def __init__(self, kernel: Float[ArrayLike, "..."], supersampling: int = 1):
        k = np.asarray(kernel)
        if k.ndim != 2:
            raise ValueError(f"PSF kernel must be 2-d, got shape {k.shape}")
        if k.shape[0] % 2 == 0 or k.shape[1] % 2 == 0:
            raise ValueError(f"PSF kernel must have odd side lengths, got shape {k.shape}")
        if not np.all(np.isfinite(k)):
            raise ValueError("PSF kernel contains NaN or infinite values")
        total = float(k.sum())
        if not total > 0:
            raise ValueError(f"PSF kernel must have a positive sum, got {total}")
        if not isinstance(supersampling, int) or supersampling < 1:
            raise ValueError(f"PSF supersampling must be a positive integer, got {supersampling}")
        # normalised in float64 first: a sum of subnormal numbers flushes to zero on a
        # device (0 / 0 would give a NaN kernel)
        arr = _as_kernel(k.astype(np.float64) / total)
        arr = arr / arr.sum()
        if not bool(jnp.all(jnp.isfinite(arr))):
            raise ValueError(
                f"PSF kernel cannot be normalised in {arr.dtype} (sum {total}): rescale it"
            )
        self.kernel_array = arr
        self.supersampling = supersampling

    def kernel(self) -> Float[Array, "ky kx"]:
        return self.kernel_array


class GaussianPSF(AbstractPSF):
    """A circular Gaussian PSF of full width at half maximum `fwhm` (arcsec), pixelated on a
    grid of `pixel_scale / supersampling` by integrating the Gaussian over each pixel (error
    functions), truncated at `truncation` sigma and normalised to sum 1.

    **Arguments:** `fwhm` (arcsec), `pixel_scale` (arcsec), `supersampling` (default 1),
    `truncation` (kernel half-size in units of sigma, default 5; the size is fixed from
    the `fwhm` given at construction).
    """

    fwhm: FloatScalar
    pixel_scale: float = eqx.field(static=True)
    supersampling: int = eqx.field(static=True)
    half_size: int = eqx.field(static=True)

    def __init__(
        self,
        fwhm: float,
        pixel_scale: float,
        supersampling: int = 1,
        truncation: float = 5.0,
    ):
        if not float(fwhm) > 0:
            raise ValueError(f"GaussianPSF.fwhm must be > 0 arcsec, got {fwhm}")
        if not float(pixel_scale) > 0:
            raise ValueError(f"GaussianPSF.pixel_scale must be > 0 arcsec, got {pixel_scale}")
        if not isinstance(supersampling, int) or supersampling < 1:
            raise ValueError(f"PSF supersampling must be a positive integer, got {supersampling}")
        self.fwhm = as_float(fwhm)
        self.pixel_scale = float(pixel_scale)
        self.supersampling = supersampling
        # The kernel size is static (it sets array shapes): fixed from the concrete fwhm.
        sigma = float(fwhm) / (2 * math.sqrt(2 * math.log(2)))
        step = self.pixel_scale / supersampling
        self.half_size = max(1, math.ceil(truncation * sigma / step))

    def kernel(self) -> Float[Array, "k k"]:
        h = self.half_size
        step = self.pixel_scale / self.supersampling
        sigma = self.fwhm / (2 * math.sqrt(2 * math.log(2)))
        edges = (jnp.arange(-h, h + 2, dtype=jnp.result_type(self.fwhm)) - 0.5) * step
        cdf = jax.scipy.special.erf(edges / (math.sqrt(2.0) * sigma))
        w = jnp.diff(cdf)
        k = jnp.outer(w, w)
        return k / k.sum()
