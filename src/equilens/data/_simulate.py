"""Simulated imaging: a lens system observed with a PSF, sky and Poisson noise."""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, PRNGKeyArray

from .._grid import Grid
from .._lens_system import LensSystem
from ..psf import AbstractPSF
from ._imaging import Imaging


def simulate(
    key: PRNGKeyArray,
    system: LensSystem,
    grid: Grid,
    psf: AbstractPSF,
    *,
    exposure_time: float,
    sky_level: float = 0.0,
    read_noise: float = 0.0,
    mask: Array | np.ndarray | None = None,
) -> Imaging:
    """Observes `system` on `grid` and returns a noisy `Imaging` dataset.

    The model image `m` (flux per pixel, e.g. electrons/s) plus the sky `s = sky_level x
    pixel area` is turned into counts over `exposure_time` seconds, with Poisson noise on
    the counts and Gaussian read noise (`read_noise` electrons rms per pixel). The data are
    sky-subtracted, in flux per pixel: `d = (Poisson((m + s) t) + N(0, read_noise^2)) / t - s`;
    the noise map is the expected 1-sigma, `sqrt((m + s) t + read_noise^2) / t`.

    Deterministic: the same `key` gives the same data. `sky_level` is in flux/arcsec^2.
    """
    if not float(exposure_time) > 0 or not np.isfinite(exposure_time):
        raise ValueError(f"exposure_time must be a finite number > 0, got {exposure_time}")
    if float(sky_level) < 0 or float(read_noise) < 0:
        raise ValueError("sky_level and read_noise must be >= 0")
    model = system.image(grid, psf)
    sky = sky_level * grid.pixel_area
    expected = jnp.maximum(model + sky, 0.0) * exposure_time
    k_poisson, k_read = jax.random.split(key)
    counts = jax.random.poisson(k_poisson, expected).astype(model.dtype)
    counts = counts + read_noise * jax.random.normal(k_read, model.shape, dtype=model.dtype)
    data = counts / exposure_time - sky
    noise = jnp.sqrt(expected + read_noise**2) / exposure_time
    if not bool(jnp.all(noise > 0)):
        raise ValueError(
            "the noise map has zero pixels (no flux, sky or read noise there): give a "
            "sky_level or read_noise > 0"
        )
    return Imaging(
        np.asarray(data),
        np.asarray(noise),
        psf,
        grid.pixel_scale,
        mask=mask,
        supersampling=grid.supersampling,
        origin=grid.origin,
    )
