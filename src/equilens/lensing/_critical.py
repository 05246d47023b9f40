"""Critical curves and caustics (host-side contouring of det A = 0)."""

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Float

from .._grid import Grid
from ..mass import AbstractMassProfile


def critical_curves(mass: AbstractMassProfile, grid: Grid) -> list[Float[np.ndarray, "_n 2"]]:
    """The critical curves (det A = 0) of `mass`, found on `grid` (its supersampled points
    when `grid.supersampling > 1`; finer grids give smoother curves).

    Returns a list of `(n, 2)` arrays of `(x, y)` positions in arcsec, one per closed or
    open contour, from marching squares (contourpy) with linear interpolation.
    """
    import contourpy

    x, y, det = (np.asarray(a, dtype=np.float64) for a in _determinant(mass, grid))
    det = np.where(np.isfinite(det), det, np.nan)
    gen = contourpy.contour_generator(x, y, det)
    return [np.asarray(line) for line in gen.lines(0.0) if len(line) > 1]


def caustics(mass: AbstractMassProfile, grid: Grid) -> list[Float[np.ndarray, "_n 2"]]:
    """The caustics: the critical curves mapped to the source plane by the lens equation."""
    return source_plane_lines(mass, critical_curves(mass, grid))


def source_plane_lines(
    mass: AbstractMassProfile, lines: list[Float[np.ndarray, "_n 2"]]
) -> list[Float[np.ndarray, "_n 2"]]:
    """Image-plane polylines (`(n, 2)` arrays of `x, y` in arcsec, e.g. critical curves)
    mapped to the source plane by the lens equation, all in one compiled call."""
    if not lines:
        return []
    dtype = jnp.result_type(float)
    points = np.concatenate(lines)
    bx, by = _ray_shoot(mass, jnp.asarray(points[:, 0], dtype), jnp.asarray(points[:, 1], dtype))
    mapped = np.stack([np.asarray(bx), np.asarray(by)], axis=1)
    return np.split(mapped, np.cumsum([len(line) for line in lines])[:-1])


# compiled: run eagerly, a mass model's hundreds of operations each cost a program of their
# own in every new process (a second apiece for a figure)
@eqx.filter_jit
def _determinant(mass: AbstractMassProfile, grid: Grid):
    x, y = grid.coordinates(supersampled=True)
    return x, y, mass.jacobian_determinant(x, y)


@eqx.filter_jit
def _ray_shoot(mass: AbstractMassProfile, x, y):
    return mass.ray_shoot(x, y)
