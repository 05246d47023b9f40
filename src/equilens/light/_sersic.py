"""Sersic and core-Sersic profiles (lenstronomy `SERSIC_ELLIPSE`, `CORE_SERSIC`)."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._checks import POSITIVE, Domain, describe
from .._custom_types import FloatScalar, GridArray, as_float
from .._math import elliptical_radius_sq, fast_log
from ._base import AbstractLinearLightProfile

# lenstronomy's inner smoothing radius (arcsec): R is floored here, so the cusp of n > 1
# profiles has finite values and gradients at the centre.
_R_MIN = 1e-4


def sersic_b_n(n_sersic: FloatScalar) -> FloatScalar:
    """`b_n = 1.9992 n - 0.3271` (Capaccioli 1989), as lenstronomy: with it `R_sersic` is the
    half-light radius to better than 0.1% for 0.5 <= n <= 10."""
    return jnp.maximum(1.9992 * n_sersic - 0.3271, 1e-5)


#: The Sersic indices the profiles accept: `b_n` is positive only for n > 0.164, and from
#: n = 0.2 down the profile is a flat disc whose `R_sersic` no longer halves the light.
N_SERSIC = Domain(0.2, math.inf)


class Sersic(AbstractLinearLightProfile):
    """Elliptical Sersic profile (lenstronomy `SERSIC_ELLIPSE`; Sersic 1963):

        I(R) = amp exp(-b_n [(R / R_sersic)^(1/n) - 1]),  R = sqrt(q x'^2 + y'^2 / q),

    so `amp` is the surface brightness at `R = R_sersic` (flux/arcsec^2) and `R_sersic` is
    the half-light radius along the intermediate axis (arcsec); `b_n` from `sersic_b_n`.

    **Arguments:** `amp`, `R_sersic` (arcsec), `n_sersic`, `e1`, `e2`, `center_x`,
    `center_y` (arcsec).
    """

    amp: FloatScalar = eqx.field(converter=as_float)
    R_sersic: FloatScalar = eqx.field(
        converter=as_float, metadata=describe(domain=POSITIVE, bounds=(0.0, math.inf))
    )
    n_sersic: FloatScalar = eqx.field(
        converter=as_float, metadata=describe(domain=N_SERSIC, bounds=(0.3, 8.0))
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
        r2 = jnp.maximum(r2, _R_MIN * _R_MIN)
        # (R / R_s)^(1/n) = exp((log R^2 - log R_s^2) / (2 n)): one log, one exp per pixel
        k = 1 / (2 * self.n_sersic)
        ratio = jnp.exp(k * (fast_log(r2) - 2 * jnp.log(self.R_sersic)))
        return jnp.exp(-sersic_b_n(self.n_sersic) * (ratio - 1))[None]


class CoreSersic(AbstractLinearLightProfile):
    """Core-Sersic profile (Graham et al. 2003; Trujillo et al. 2004; lenstronomy
    `CORE_SERSIC`):

        I(R) = amp [1 + (R_b / R)^alpha]^(gamma / alpha)
               exp(-b_n [((R^alpha + R_b^alpha) / R_sersic^alpha)^(1/(alpha n)) - 1]),

    with `R = sqrt(q x'^2 + y'^2 / q)`: a Sersic profile outside the break radius `Rb` and a
    power law of slope `gamma` inside it, `alpha` setting the sharpness of the transition.

    **Arguments:** `amp` (flux/arcsec^2), `R_sersic` (arcsec), `Rb` (arcsec), `n_sersic`,
    `gamma`, `e1`, `e2`, `center_x`, `center_y` (arcsec), `alpha` (default 3).
    """

    amp: FloatScalar = eqx.field(converter=as_float)
    R_sersic: FloatScalar = eqx.field(
        converter=as_float, metadata=describe(domain=POSITIVE, bounds=(0.0, math.inf))
    )
    Rb: FloatScalar = eqx.field(
        converter=as_float, metadata=describe(domain=POSITIVE, bounds=(0.0, math.inf))
    )
    n_sersic: FloatScalar = eqx.field(
        converter=as_float, metadata=describe(domain=N_SERSIC, bounds=(0.3, 8.0))
    )
    # the light inside Rb (~ R^-gamma) integrable
    gamma: FloatScalar = eqx.field(
        converter=as_float, metadata=describe(domain=Domain(-math.inf, 2.0, upper_open=True))
    )
    e1: FloatScalar = eqx.field(
        converter=as_float, default=0.0, metadata=describe(bounds=(-0.6, 0.6))
    )
    e2: FloatScalar = eqx.field(
        converter=as_float, default=0.0, metadata=describe(bounds=(-0.6, 0.6))
    )
    center_x: FloatScalar = eqx.field(converter=as_float, default=0.0)
    center_y: FloatScalar = eqx.field(converter=as_float, default=0.0)
    # the core's factor grows as 2^(gamma / alpha): a transition sharper than alpha = 0.1
    # is not a profile
    alpha: FloatScalar = eqx.field(
        converter=as_float,
        default=3.0,
        metadata=describe(domain=Domain(0.1, math.inf), bounds=(0.0, math.inf), fixed=True),
    )

    def basis(self, x: GridArray, y: GridArray) -> Float[Array, "1 *grid"]:
        r2 = elliptical_radius_sq(x - self.center_x, y - self.center_y, self.e1, self.e2)
        log_r = 0.5 * jnp.log(jnp.maximum(r2, _R_MIN * _R_MIN))
        log_rb, log_re = jnp.log(self.Rb), jnp.log(self.R_sersic)
        a, n = self.alpha, self.n_sersic
        # in logarithms throughout (softplus, logaddexp): finite for any sharpness `alpha`
        # and any ratio Rb / R, where the powers themselves would overflow
        core = jnp.exp(self.gamma / a * jax.nn.softplus(a * (log_rb - log_r)))
        outer = jnp.exp((jnp.logaddexp(a * log_r, a * log_rb) - a * log_re) / (a * n))
        return (core * jnp.exp(-sersic_b_n(n) * (outer - 1)))[None]
