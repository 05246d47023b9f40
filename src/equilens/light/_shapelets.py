"""Cartesian shapelets (Refregier 2003), lenstronomy's `SHAPELETS` convention."""

import math

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float

from .._checks import POSITIVE, describe
from .._custom_types import FloatScalar, GridArray, as_float
from ._base import AbstractLinearLightProfile


def shapelet_indices(n_max: int) -> list[tuple[int, int]]:
    """The `(n1, n2)` order of the basis: by total order `n = n1 + n2`, `n1` descending:
    (0,0), (1,0), (0,1), (2,0), (1,1), (0,2), ... (as lenstronomy)."""
    return [(n - k, k) for n in range(n_max + 1) for k in range(n + 1)]


def _hermite_functions(u: GridArray, n_max: int) -> list[GridArray]:
    # Normalised Hermite functions phi_n(u) = [2^n sqrt(pi) n!]^(-1/2) H_n(u) exp(-u^2/2),
    # by the stable three-term recurrence.
    phi = [jnp.pi**-0.25 * jnp.exp(-0.5 * u * u)]
    if n_max >= 1:
        phi.append(math.sqrt(2.0) * u * phi[0])
    for n in range(1, n_max):
        phi.append(math.sqrt(2.0 / (n + 1)) * u * phi[n] - math.sqrt(n / (n + 1)) * phi[n - 1])
    return phi


def _as_float_vector(x: Float[ArrayLike, "..."]) -> Float[Array, "..."]:
    return as_float(x)


class Shapelets(AbstractLinearLightProfile):
    """Cartesian shapelet basis (Refregier 2003), linear in its amplitudes:

        I = sum_(n1 + n2 <= n_max) amp_(n1,n2) phi_n1(x / beta) phi_n2(y / beta),

    with `phi_n` the normalised Hermite functions, exactly lenstronomy's `SHAPELETS` (no
    `1/beta` factor), in the order of `shapelet_indices(n_max)`.

    **Arguments:** `amp` (shape `((n_max+1)(n_max+2)/2,)`, flux/arcsec^2), `n_max` (static
    int), `beta` (scale, arcsec), `center_x`, `center_y` (arcsec).
    """

    amp: Float[Array, " n_basis"] = eqx.field(converter=_as_float_vector)
    n_max: int = eqx.field(static=True)
    beta: FloatScalar = eqx.field(
        converter=as_float, metadata=describe(domain=POSITIVE, bounds=(0.0, math.inf))
    )
    center_x: FloatScalar = eqx.field(converter=as_float, default=0.0)
    center_y: FloatScalar = eqx.field(converter=as_float, default=0.0)

    def __check_init__(self):
        if not isinstance(self.n_max, int) or self.n_max < 0:
            raise ValueError(f"Shapelets.n_max must be an integer >= 0, got {self.n_max!r}")
        n = (self.n_max + 1) * (self.n_max + 2) // 2
        if self.amp.shape != (n,):
            raise ValueError(
                f"Shapelets.amp must have shape ({n},) for n_max={self.n_max}, got {self.amp.shape}"
            )

    def basis(self, x: GridArray, y: GridArray) -> Float[Array, "n_basis *grid"]:
        hx = _hermite_functions((x - self.center_x) / self.beta, self.n_max)
        hy = _hermite_functions((y - self.center_y) / self.beta, self.n_max)
        return jnp.stack([hx[n1] * hy[n2] for n1, n2 in shapelet_indices(self.n_max)])
