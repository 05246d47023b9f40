"""Model images with the Numba backend: ray shooting, light, binning and PSF convolution."""

import functools
import weakref

import numpy as np
import scipy.fft
from jaxtyping import ArrayLike, Float

from .._grid import Grid
from .._lens_system import LensSystem
from ..light import AbstractLinearLightProfile, LightSum
from ..psf import AbstractPSF, FFTConvolution, PixelPSF
from ..psf._psf import fft_padded_shape
from ._api import light_basis, light_intensity, mass_rows
from ._registry import DEFLECTION, _flat

#: `method="auto"` convolves by direct summation up to this many kernel pixels (7 x 7),
#: by FFT above (benchmarks/bench_numba.py: on 100 x 100 images the FFT wins from about
#: 9 x 9 on one or two threads).
DIRECT_MAX_PIXELS = 49
#: `scipy.fft` runs with Numba's thread count as workers from this many padded pixels
#: (1024 x 1024), with one worker below.
FFT_THREADS_MIN_PIXELS = 1 << 20


def coordinates(grid: Grid, supersampled: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """`(x, y)` of the (sub-)pixel centres of `grid` as float64 NumPy arrays (the same
    values as `grid.coordinates`)."""
    x, y = _coordinates(grid.shape, grid.pixel_scale, grid.origin, grid.supersampling, supersampled)
    return x.copy(), y.copy()


@functools.lru_cache(maxsize=32)
def _coordinates(
    shape: tuple[int, int],
    pixel_scale: float,
    origin: tuple[float, float],
    supersampling: int,
    supersampled: bool,
) -> tuple[np.ndarray, np.ndarray]:
    # (made once per grid: internal callers must not write into them)
    factor = supersampling if supersampled else 1
    ny, nx = shape
    jx = (np.arange(nx * factor, dtype=np.float64) + 0.5) / factor - 0.5
    iy = (np.arange(ny * factor, dtype=np.float64) + 0.5) / factor - 0.5
    xs = (jx - (nx - 1) / 2) * pixel_scale + origin[0]
    ys = (iy - (ny - 1) / 2) * pixel_scale + origin[1]
    y, x = np.meshgrid(ys, xs, indexing="ij")
    return np.ascontiguousarray(x), np.ascontiguousarray(y)


def _grid_coordinates(grid: Grid) -> tuple[np.ndarray, np.ndarray]:
    return _coordinates(grid.shape, grid.pixel_scale, grid.origin, grid.supersampling, True)


def surface_brightness(
    system: LensSystem, x: Float[ArrayLike, "*grid"], y: Float[ArrayLike, "*grid"]
) -> Float[np.ndarray, "*grid"]:
    """Unconvolved surface brightness per arcsec^2 at image positions `(x, y)`, as
    `system.surface_brightness(x, y)`."""
    xf, yf, shape = _flat(x, y)
    alpha = mass_rows(system.mass, xf, yf, DEFLECTION)
    out = light_intensity(system.source, xf - alpha[0], yf - alpha[1])
    if system.lens_light is not None:
        out = out + light_intensity(system.lens_light, xf, yf)
    return out.reshape(shape)


def _kernels():
    from . import _image_kernels

    return _image_kernels


def bin_image(grid: Grid, sub: np.ndarray) -> np.ndarray:
    """Averages a supersampled `(ny s, nx s)` array to the grid's `(ny, nx)`."""
    s = grid.supersampling
    ny, nx = grid.shape
    if sub.shape != (ny * s, nx * s):
        raise ValueError(f"bin expects an array of shape {(ny * s, nx * s)}, got {sub.shape}")
    return sub if s == 1 else _kernels().bin_mean(np.ascontiguousarray(sub), s)


@functools.lru_cache(maxsize=16)
def _kernel_ft(kernel_bytes: bytes, kshape: tuple[int, int], fft_shape: tuple[int, int]):
    kernel = np.frombuffer(kernel_bytes, np.float64).reshape(kshape)
    return np.asarray(scipy.fft.rfft2(kernel, s=fft_shape))


def _threads() -> int:
    from ._runtime import _threads

    return _threads()


def convolve(
    image: Float[ArrayLike, "*batch ny nx"], kernel: Float[ArrayLike, "ky kx"], method: str = "auto"
) -> Float[np.ndarray, "*batch ny nx"]:
    """'Same'-size linear convolution of `image` (or of each image of a stack) with an
    odd-sized `kernel`, zero outside the image (as `AbstractPSF.convolve`): `method` "fft"
    (`scipy.fft` on the exact padded shape of `fft_padded_shape`, a stack in one batched
    transform, with Numba's thread count as workers from `FFT_THREADS_MIN_PIXELS`),
    "direct" (a Numba kernel, rows in parallel) or "auto" (direct up to
    `DIRECT_MAX_PIXELS` kernel pixels)."""
    img = np.ascontiguousarray(image, np.float64)
    # (a writable copy: a read-only kernel, a JAX array's view, would compile the direct
    # kernel a second time)
    k = np.array(kernel, np.float64, order="C")
    if k.ndim != 2 or k.shape[0] % 2 == 0 or k.shape[1] % 2 == 0:
        raise ValueError(f"PSF kernel must be 2-d with odd side lengths, got shape {k.shape}")
    if method not in ("auto", "fft", "direct"):
        raise ValueError(f"convolution method must be 'auto', 'fft' or 'direct', got {method!r}")
    if img.ndim < 2:
        raise ValueError(f"convolve needs a 2-d image or a stack of them, got shape {img.shape}")
    if method == "direct" or (method == "auto" and k.size <= DIRECT_MAX_PIXELS):
        from ._runtime import _LOCK

        flat = img.reshape(-1, *img.shape[-2:])
        with _LOCK:
            out = [_kernels().convolve_same(im, k) for im in flat]
        return np.stack(out).reshape(img.shape)
    ny, nx = img.shape[-2:]
    fft_shape = fft_padded_shape((ny, nx), (k.shape[0], k.shape[1]))
    kft = _kernel_ft(k.tobytes(), k.shape, fft_shape)
    # scipy's threads pay only for large transforms (measured on 2 cores: 2 workers were
    # slower than 1 for every image up to 840 x 840)
    workers = _threads() if fft_shape[0] * fft_shape[1] >= FFT_THREADS_MIN_PIXELS else 1
    spectrum = np.asarray(scipy.fft.rfft2(img, s=fft_shape, workers=workers)) * kft
    full = np.asarray(scipy.fft.irfft2(spectrum, s=fft_shape, workers=workers))
    oy, ox = k.shape[0] // 2, k.shape[1] // 2
    return np.ascontiguousarray(full[..., oy : oy + ny, ox : ox + nx])


_KERNELS: dict[int, tuple[weakref.ref, np.ndarray]] = {}


def _psf_kernel(psf: AbstractPSF | FFTConvolution) -> np.ndarray:
    """The PSF's pixel kernel as float64 NumPy (an `FFTConvolution`'s recovered once from
    its transform, exact to round-off, and kept while the operator lives)."""
    if isinstance(psf, FFTConvolution):
        key = id(psf)
        entry = _KERNELS.get(key)
        if entry is not None and entry[0]() is psf:
            return entry[1]
        full = np.fft.irfft2(np.asarray(psf.kernel_ft), s=psf.fft_shape)
        kernel = np.ascontiguousarray(full[: psf.kernel_shape[0], : psf.kernel_shape[1]])
        _KERNELS[key] = (weakref.ref(psf, lambda _, key=key: _KERNELS.pop(key, None)), kernel)
        return kernel
    if isinstance(psf, PixelPSF):
        return np.asarray(psf.kernel_array, np.float64)
    return np.asarray(psf.kernel(), np.float64)


def image(
    system: LensSystem,
    grid: Grid,
    psf: AbstractPSF | FFTConvolution | None = None,
    method: str = "auto",
) -> Float[np.ndarray, "ny nx"]:
    """Model image (flux per pixel) on `grid`, optionally convolved with `psf`: the same
    numbers as `system.image(grid, psf)` (same rules for the PSF's supersampling), from
    the Numba kernels and `scipy.fft`. `method` chooses the convolution (see `convolve`)."""
    x, y = _grid_coordinates(grid)
    flux = surface_brightness(system, x, y) * grid.pixel_area
    return _render(grid, psf, flux[None], method)[0]


def _bin_stack(grid: Grid, sub: np.ndarray) -> np.ndarray:
    return np.stack([bin_image(grid, s) for s in sub]) if grid.supersampling > 1 else sub


def _render(grid: Grid, psf: AbstractPSF | FFTConvolution | None, flux: np.ndarray, method: str):
    """Bins and convolves a stack `(k, ny s, nx s)` of flux images with the rules of
    `LensSystem.image`: a PSF at the grid's supersampling (or an `FFTConvolution` for the
    supersampled shape) convolves before binning, one at the data pixels after."""
    if psf is None:
        return _bin_stack(grid, flux)
    s = grid.supersampling
    sub_shape = (grid.shape[0] * s, grid.shape[1] * s)
    if isinstance(psf, AbstractPSF):
        sub_psf = psf.supersampling == s and s > 1
        if not sub_psf and psf.supersampling != 1:
            raise ValueError(
                f"PSF supersampling {psf.supersampling} must be 1 or equal the grid's "
                f"supersampling {s}"
            )
    else:
        sub_psf = psf.image_shape == sub_shape and s > 1
        if not sub_psf and psf.image_shape != grid.shape:
            raise ValueError(
                f"FFTConvolution prepared for shape {psf.image_shape}, but the grid has shape "
                f"{grid.shape} (supersampled {sub_shape})"
            )
    kernel = _psf_kernel(psf)
    if sub_psf:
        return _bin_stack(grid, convolve(flux, kernel, method))
    return convolve(_bin_stack(grid, flux), kernel, method)


def linear_images(
    system: LensSystem,
    grid: Grid,
    psf: AbstractPSF | FFTConvolution | None = None,
    method: str = "auto",
    fields: tuple[str, ...] = ("lens_light", "source"),
) -> tuple[Float[np.ndarray, "n_linear ny nx"], Float[np.ndarray, "ny nx"] | None]:
    """The model image of each linear light basis function at unit amplitude and the image
    of the non-linear light (None when every light component is linear), as
    `system.linear_images(grid, psf, fields)`: `image = sum_k amp_k images[k] + fixed`
    (`fields` restricts both to the light of "lens_light" and/or "source"; with `fields`
    given, `images` may have no rows)."""

    # (the light components read directly: equinox wraps each method call of a module
    # in a new bound-method module, which cost more than the kernels of a small image)
    parts = [
        (name, comp)
        for name in fields
        for comp in _components(object.__getattribute__(system, name))
        if isinstance(comp, AbstractLinearLightProfile)
    ]
    if not parts and fields == ("lens_light", "source"):
        raise ValueError("the lens system has no linear light component")
    x, y = _grid_coordinates(grid)
    xf, yf = x.reshape(-1), y.reshape(-1)
    others = [
        (name, comp)
        for name in fields
        for comp in _components(object.__getattribute__(system, name))
        if not isinstance(comp, AbstractLinearLightProfile)
    ]
    if any(name == "source" for name, _ in parts + others):
        alpha = mass_rows(system.mass, xf, yf, DEFLECTION)
        bx, by = xf - alpha[0], yf - alpha[1]
    else:
        bx, by = xf, yf
    if parts:
        rows = [
            light_basis(p, bx, by) if name == "source" else light_basis(p, xf, yf)
            for name, p in parts
        ]
        flux = np.concatenate(rows, axis=0).reshape(-1, *x.shape) * grid.pixel_area
        images = _render(grid, psf, flux, method)
    else:
        images = np.zeros((0, *grid.shape))
    if not others:
        return images, None
    total = np.zeros(xf.size)
    for name, comp in others:
        total += (
            light_intensity(comp, bx, by) if name == "source" else light_intensity(comp, xf, yf)
        )
    fixed = _render(grid, psf, (total * grid.pixel_area).reshape(1, *x.shape), method)[0]
    return images, fixed


def _components(profile) -> tuple:
    if profile is None:
        return ()
    if isinstance(profile, LightSum):
        return object.__getattribute__(profile, "components")
    return (profile,)
