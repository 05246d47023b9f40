"""Gaussian profiles: elliptical Gaussian and the multi-Gaussian expansion (MGE)."""

import math

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float

from .._checks import POSITIVE, describe
from .._custom_types import FloatScalar, GridArray, as_float
from .._math import elliptical_radius_sq
from ._base import AbstractLinearLightProfile


class Gaussian(AbstractLinearLightProfile):
    """Elliptical Gaussian (lenstronomy `GAUSSIAN_ELLIPSE`):

        I = amp / (2 pi sigma^2) exp(-R^2 / (2 sigma^2)),  R^2 = q x'^2 + y'^2 / q,

    so `amp` is the total flux (flux units; the product-average radius conserves area).

    **Arguments:** `amp` (total flux), `sigma` (arcsec), `e1`, `e2`, `center_x`, `center_y`.
    """

    amp: FloatScalar = eqx.field(converter=as_float)
    sigma: FloatScalar = eqx.field(
        converter=as_float, metadata=describe(domain=POSITIVE, bounds=(0.0, math.inf))
    )
    e1: FloatScalar = eqx.field(
        converter=as_float, default=0.0, metadata=describe(bounds=(-0.6, 0.6))
    )
    e2: FloatScalar = eqx.field(
        converter=as_float, default=0.0, metadata=describe(bounds=(-0.6, 0.6))
    )
    center_x: FloatScalar = eqx.field(converter=as_float, default=0.0)
    center_y: FloatScalar = eqx.field(converter=as_float, default=0.0)

    def basis(self, x: GridArray, y: GridArray) -> Float[Array, "1 *grid"]:
        r2 = elliptical_radius_sq(x - self.center_x, y - self.center_y, self.e1, self.e2)
        s2 = self.sigma * self.sigma
        return (jnp.exp(-r2 / (2 * s2)) / (2 * jnp.pi * s2))[None]


def _as_float_vector(x: Float[ArrayLike, "..."]) -> Float[Array, "..."]:
    return as_float(x)


class MGE(AbstractLinearLightProfile):
    """Multi-Gaussian expansion (Emsellem et al. 1994; Cappellari 2002): concentric
    elliptical Gaussians with fixed widths and shared ellipticity and centre, linear in
    their amplitudes (lenstronomy `MULTI_GAUSSIAN_ELLIPSE`):

        I = sum_k amp_k / (2 pi sigma_k^2) exp(-R^2 / (2 sigma_k^2)),  R^2 = q x'^2 + y'^2/q.

    **Arguments:** `amp` (shape `(K,)`, total flux of each Gaussian), `sigma` (shape `(K,)`,
    arcsec; normally held fixed, e.g. log-spaced), `e1`, `e2`, `center_x`, `center_y`.
    """

    amp: Float[Array, " n_basis"] = eqx.field(converter=_as_float_vector)
    sigma: Float[Array, " n_basis"] = eqx.field(
        converter=_as_float_vector,
        metadata=describe(domain=POSITIVE, bounds=(0.0, math.inf), fixed=True),
    )
    e1: FloatScalar = eqx.field(
        converter=as_float, default=0.0, metadata=describe(bounds=(-0.6, 0.6))
    )
    e2: FloatScalar = eqx.field(
        converter=as_float, default=0.0, metadata=describe(bounds=(-0.6, 0.6))
    )
    center_x: FloatScalar = eqx.field(converter=as_float, default=0.0)
    center_y: FloatScalar = eqx.field(converter=as_float, default=0.0)

    def __check_init__(self):
        if self.amp.shape != self.sigma.shape or self.amp.ndim != 1:
            raise ValueError(
                f"MGE.amp and MGE.sigma must be 1-d of equal length, got shapes "
                f"{self.amp.shape} and {self.sigma.shape}"
            )

    def basis(self, x: GridArray, y: GridArray) -> Float[Array, "n_basis *grid"]:
        r2 = elliptical_radius_sq(x - self.center_x, y - self.center_y, self.e1, self.e2)
        s2 = jnp.expand_dims(self.sigma * self.sigma, tuple(range(1, 1 + r2.ndim)))
        return jnp.exp(-r2[None] / (2 * s2)) / (2 * jnp.pi * s2)
