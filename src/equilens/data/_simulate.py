"""Simulated imaging: a lens system observed with a PSF, sky and Poisson noise."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray, PyTree

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
    _check_exposure(exposure_time, sky_level, read_noise)
    data, noise = _observe(key, system, grid, psf, exposure_time, sky_level, read_noise)
    _check_noise(noise)
    return Imaging(
        np.asarray(data),
        np.asarray(noise),
        psf,
        grid.pixel_scale,
        mask=mask,
        supersampling=grid.supersampling,
        origin=grid.origin,
    )


def _check_exposure(exposure_time: float, sky_level: float, read_noise: float) -> None:
    if not float(exposure_time) > 0 or not np.isfinite(exposure_time):
        raise ValueError(f"exposure_time must be a finite number > 0, got {exposure_time}")
    if float(sky_level) < 0 or float(read_noise) < 0:
        raise ValueError("sky_level and read_noise must be >= 0")


def _check_noise(noise: Array) -> None:
    if not bool(jnp.all(noise > 0)):
        raise ValueError(
            "the noise map has zero pixels (no flux, sky or read noise there): give a "
            "sky_level or read_noise > 0"
        )


def _observe(
    key: PRNGKeyArray,
    system: LensSystem,
    grid: Grid,
    psf: AbstractPSF,
    exposure_time: float,
    sky_level: float,
    read_noise: float,
) -> tuple[Array, Array]:
    """The noisy data and the noise map (see `simulate`), in JAX (jit- and vmap-able)."""
    model = system.image(grid, psf)
    sky = sky_level * grid.pixel_area
    expected = jnp.maximum(model + sky, 0.0) * exposure_time
    k_poisson, k_read = jax.random.split(key)
    counts = jax.random.poisson(k_poisson, expected).astype(model.dtype)
    counts = counts + read_noise * jax.random.normal(k_read, model.shape, dtype=model.dtype)
    data = counts / exposure_time - sky
    noise = jnp.sqrt(expected + read_noise**2) / exposure_time
    return data, noise


def simulate_batch(
    key: PRNGKeyArray,
    system: Callable[[Any], LensSystem],
    batch: PyTree[Any],
    grid: Grid,
    psf: AbstractPSF,
    *,
    exposure_time: float,
    sky_level: float = 0.0,
    read_noise: float = 0.0,
    batch_size: int | None = 64,
) -> tuple[Float[Array, "n ny nx"], Float[Array, "n ny nx"]]:
    """Many lenses observed in one compiled call: `system(item)` is the `LensSystem` of one
    entry of `batch` (a pytree whose arrays have a leading axis of length `n`, e.g. the
    realisations of `MultiPlane.stack`), observed as by `simulate` (the same noise model,
    units and checks). Returns `(data, noise_map)`, each of shape `(n, ny, nx)`.

    The entries are vmapped in blocks of `batch_size` (`jax.lax.map`; `None`: all at once),
    which bounds the memory; entry `i` gets key `jax.random.split(key, n)[i]`, so that the
    result does not depend on `batch_size` (to round-off) and entry `i` equals
    `simulate(jax.random.split(key, n)[i], system(entry i), ...)`. Compiled once per
    `system` function and shapes: pass the same function on every call."""
    _check_exposure(exposure_time, sky_level, read_noise)
    leaves = [a for a in jax.tree.leaves(batch) if eqx.is_array(a)]
    if not leaves or any(a.ndim == 0 for a in leaves):
        raise ValueError("batch must be a pytree of arrays with a leading batch axis")
    n = int(leaves[0].shape[0])
    if any(int(a.shape[0]) != n for a in leaves):
        sizes = sorted({int(a.shape[0]) for a in leaves})
        raise ValueError(f"batch's arrays must share their leading axis, got lengths {sizes}")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1 or None, got {batch_size}")
    keys = jax.random.split(key, n)
    data, noise = _batch_observe(
        keys, system, batch, grid, psf, exposure_time, sky_level, read_noise, batch_size
    )
    _check_noise(noise)
    return data, noise


@eqx.filter_jit
def _batch_observe(keys, system, batch, grid, psf, exposure_time, sky_level, read_noise, size):
    def one(args):
        k, item = args
        return _observe(k, system(item), grid, psf, exposure_time, sky_level, read_noise)

    return jax.lax.map(one, (keys, batch), batch_size=size)
