"""Critical curves and caustics (host-side contouring of det A = 0)."""

import jax.numpy as jnp
import numpy as np
from jaxtyping import Float

from .._grid import Grid
from ..mass import AbstractMassProfile


def critical_curves(mass: AbstractMassProfile, grid: Grid) -> list[Float[np.ndarray, "n 2"]]:
    """The critical curves (det A = 0) of `mass`, found on `grid` (its supersampled points
    when `grid.supersampling > 1`; finer grids give smoother curves).

    Returns a list of `(n, 2)` arrays of `(x, y)` positions in arcsec, one per closed or
    open contour, from marching squares (contourpy) with linear interpolation.
    """
    import contourpy

    x, y = grid.coordinates(supersampled=True)
    det = np.asarray(mass.jacobian_determinant(x, y), dtype=np.float64)
    det = np.where(np.isfinite(det), det, np.nan)
    gen = contourpy.contour_generator(
        np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64), det
    )
    return [np.asarray(line) for line in gen.lines(0.0) if len(line) > 1]


def caustics(mass: AbstractMassProfile, grid: Grid) -> list[Float[np.ndarray, "n 2"]]:
    """The caustics: the critical curves mapped to the source plane by the lens equation."""
    out = []
    for line in critical_curves(mass, grid):
        dtype = jnp.result_type(float)
        bx, by = mass.ray_shoot(jnp.asarray(line[:, 0], dtype), jnp.asarray(line[:, 1], dtype))
        out.append(np.stack([np.asarray(bx), np.asarray(by)], axis=1))
    return out
