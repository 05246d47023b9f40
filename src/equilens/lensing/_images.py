"""The multiple images of a source point: solutions of the lens equation."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optimistix as optx
from jaxtyping import Array, Bool, Float

from .._custom_types import ScalarLike
from .._grid import Grid
from ..mass import AbstractMassProfile


@eqx.filter_jit
def _traced(mass: AbstractMassProfile, x: Array, y: Array) -> tuple[Array, Array]:
    return mass.ray_shoot(x, y)


def _tolerance(dtype) -> float:
    """The lens-equation solve's tolerance (arcsec) in a precision."""
    return 1e-10 if jnp.finfo(dtype).bits == 64 else 1e-5


def solve_lens_equation(
    mass: AbstractMassProfile,
    x0: Float[Array, " n"],
    y0: Float[Array, " n"],
    beta_x: Float[Array, ""],
    beta_y: Float[Array, ""],
) -> tuple[Float[Array, " n"], Float[Array, " n"], Bool[Array, " n"]]:
    """Newton solves (optimistix) of the lens equation `theta - alpha(theta) = beta`, one
    from each start `(x0[i], y0[i])` (arcsec), to 1e-10" in float64 (1e-5" in float32):
    far below any astrometric error, and reachable in the working precision. Returns the
    solutions `(x, y)` and whether each converged; differentiable (implicitly) with
    respect to the mass and `beta`. Used by `image_positions` and by
    `PositionsTerm(plane="image")`."""
    tol = _tolerance(x0.dtype)
    beta = jnp.stack([beta_x, beta_y])

    def lens_equation(theta, beta):
        bx, by = mass.ray_shoot(theta[0], theta[1])
        return jnp.stack([bx - beta[0], by - beta[1]])

    def one(x, y):
        sol = optx.root_find(
            lens_equation,
            optx.Newton(rtol=tol, atol=tol),
            jnp.stack([x, y]),
            args=beta,
            max_steps=50,
            throw=False,
        )
        return sol.value[0], sol.value[1], sol.result == optx.RESULTS.successful

    return jax.vmap(one)(x0, y0)


_solve_jit = eqx.filter_jit(solve_lens_equation)


def image_positions(
    mass: AbstractMassProfile,
    source_x: ScalarLike,
    source_y: ScalarLike,
    grid: Grid,
) -> Float[np.ndarray, "n 2"]:
    """The image-plane positions of a source point at `(source_x, source_y)` (arcsec):
    every solution `theta` of the lens equation `theta - alpha(theta) = beta` inside
    `grid`'s extent.

    The grid (its supersampled points when `grid.supersampling > 1`) is ray-traced; each
    point whose traced position is closer to `beta` than those of its eight neighbours,
    and closer than the largest source-plane distance to one of them (so the point's cell
    can hold a solution), starts a Newton solve of the lens equation (optimistix); the
    converged solutions (to 1e-10" in float64, 1e-5" in float32), inside the grid and
    distinct by more than a tenth of a pixel, are returned. The usual approach of the field
    (e.g. lenstronomy's `LensEquationSolver`). A grid finer than the smallest image
    separation is needed to separate images that lie close to a critical curve; images of a
    point on a caustic are found or missed by chance, as with any grid search.

    Returns an `(n, 2)` NumPy array of `(x, y)` in arcsec, ordered by decreasing absolute
    magnification (n = 0 when no image lies inside the grid)."""
    x, y = grid.coordinates(supersampled=True)
    dtype = x.dtype
    beta = jnp.stack([jnp.asarray(source_x, dtype), jnp.asarray(source_y, dtype)])
    bx, by = (np.asarray(v, dtype=np.float64) for v in _traced(mass, x, y))
    d = np.hypot(bx - float(beta[0]), by - float(beta[1]))
    d = np.where(np.isfinite(d), d, np.inf)
    centre = d[1:-1, 1:-1]
    is_min = np.ones_like(centre, dtype=bool)
    reach = np.zeros_like(centre)
    for di in (-1, 0, 1):
        for dj in (-1, 0, 1):
            if di == 0 and dj == 0:
                continue
            sl = (slice(1 + di, d.shape[0] - 1 + di), slice(1 + dj, d.shape[1] - 1 + dj))
            is_min &= centre <= d[sl]
            step = np.hypot(bx[sl] - bx[1:-1, 1:-1], by[sl] - by[1:-1, 1:-1])
            reach = np.maximum(reach, np.where(np.isfinite(step), step, 0.0))
    rows, cols = np.nonzero(is_min & (centre <= reach))
    if rows.size == 0:
        return np.zeros((0, 2))
    # the candidates padded to a power of two (repeating the first): the compiled Newton
    # solve is reused across calls
    n = rows.size
    pad = np.concatenate([np.arange(n), np.zeros((1 << (n - 1).bit_length()) - n, int)])
    x0 = x[rows[pad] + 1, cols[pad] + 1]
    y0 = y[rows[pad] + 1, cols[pad] + 1]
    tol = _tolerance(dtype)
    tx, ty, ok = _solve_jit(mass, x0, y0, beta[0], beta[1])
    theta = jnp.stack([tx, ty], axis=1)
    traced = np.stack([np.asarray(v) for v in _traced(mass, theta[:, 0], theta[:, 1])], axis=1)
    theta, ok, traced = np.array(theta, dtype=np.float64)[:n], np.array(ok)[:n], traced[:n]
    ok &= np.all(np.isfinite(theta), axis=1)
    ok &= np.hypot(*(traced - np.asarray(beta)[None, :]).T) <= 100 * tol
    half = 0.5 * np.array(grid.shape[::-1]) * grid.pixel_scale
    ok &= np.all(np.abs(theta - np.array(grid.origin)[None, :]) <= half[None, :], axis=1)
    found: list[np.ndarray] = []
    for t in theta[ok]:
        if all(np.hypot(*(t - f)) > 0.1 * grid.pixel_scale for f in found):
            found.append(t)
    if not found:
        return np.zeros((0, 2))
    out = np.stack(found)
    mu = np.asarray(
        mass.magnification(jnp.asarray(out[:, 0], dtype), jnp.asarray(out[:, 1], dtype))
    )
    return out[np.argsort(-np.abs(mu))]
