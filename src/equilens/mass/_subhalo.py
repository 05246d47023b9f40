"""Subhalo profiles: the truncated NFW (Baltz, Marshall & Oguri 2009).

Parametrisation as lenstronomy (`TNFW`): scale radius `Rs`, `alpha_Rs` (the deflection at
`Rs` of the untruncated NFW of the same density normalisation) and truncation radius
`r_trunc`, all in arcsec. The 3D density is the NFW one times `r_trunc^2 / (r^2 +
r_trunc^2)`. With `X = R / Rs`, `t = r_trunc / Rs`, `rho0 = alpha_Rs / (4 Rs^2 (1 + ln
1/2))`, `G(u)` the NFW function of `equilens.mass._nfw` (`G(1 - X^2)` is lenstronomy's
`F(X)`), `s = sqrt(t^2 + X^2)` and `L = ln(X / (t + s))` (Baltz et al. 2009, eqs. A.4-A.8):

    kappa = 2 rho0 Rs t^2/(t^2+1)^2 [(t^2+1) (1 - G)/(X^2 - 1) + 2 G - pi/s
                                      + (t^2-1) L / (t s)],
    alpha = 4 rho0 Rs g(X) / X^2 (x, y),
    g(X)  = t^2/(t^2+1)^2 [(t^2 + 1 + 2 (X^2 - 1)) G + pi t + (t^2-1) ln t
                           + s (-pi + (t^2-1) L / t)],
    psi   = 2 rho0 Rs^3 h(X)   (h: lenstronomy's `TNFW._h`, whose constant it shares).

For `X < 1/2` the terms of `g` cancel to `O(X^2 ln X)`; `g / X^2` is then evaluated from a
form with the cancellations done analytically (no precision lost at small radii). Inside
`X < 10 sqrt(eps)` (1.5e-7 Rs in float64) the radius is floored, as for the NFW.
"""

import math

import equinox as eqx
import jax.numpy as jnp

from .._checks import NON_NEGATIVE, POSITIVE, describe
from .._custom_types import FloatScalar, GridArray, as_float
from .._math import atanh_ratio
from ._base import AbstractMassProfile, Deflection, Hessian
from ._nfw import _ONE_PLUS_LN_HALF, _nfw_F, _nfw_G, _x_min

_LN2 = math.log(2.0)


def _tnfw_g_over_x2(X2: GridArray, t: FloatScalar) -> GridArray:
    """`g(X) / X^2` of the truncated NFW (see the module docstring)."""
    t2 = t * t
    pre = t2 / ((t2 + 1) * (t2 + 1))
    # direct, for X >= 1/2
    X2d = jnp.maximum(X2, 0.25)
    s = jnp.sqrt(t2 + X2d)
    L = 0.5 * jnp.log(X2d) - jnp.log(t + s)
    G = atanh_ratio(1 - X2d)
    direct = (
        (t2 + 1 + 2 * (X2d - 1)) * G
        + math.pi * t
        + (t2 - 1) * jnp.log(t)
        + s * (-math.pi + (t2 - 1) * L / t)
    ) / X2d
    # small X: G = (ln(1 + su) - ln X) / su with su = sqrt(1 - X^2); the ln X terms and
    # the rest each vanish at X = 0, and are written here divided by X^2 exactly
    X2s = jnp.minimum(X2, 0.25)
    su = jnp.sqrt(1 - X2s)
    ss = jnp.sqrt(t2 + X2s)
    c = (t2 - 1) / (t * (ss + t)) - (t2 - 1) / (su * (1 + su)) - 2 / su
    d = (
        jnp.log1p(-X2s / (2 * (1 + su))) / (su * X2s)
        + _LN2 / (su * (1 + su))
        - jnp.log1p(X2s / (2 * t * (ss + t))) / X2s
        - jnp.log(t + ss) / (t * (ss + t))
    )
    small = 0.5 * jnp.log(X2s) * c + (t2 - 1) * d + 2 * jnp.log1p(su) / su - math.pi / (t + ss)
    return pre * jnp.where(X2 < 0.25, small, direct)


def _tnfw_F(X2: GridArray, t: FloatScalar) -> GridArray:
    """The truncated NFW's convergence over `2 rho0 Rs`."""
    t2 = t * t
    s = jnp.sqrt(t2 + X2)
    L = 0.5 * jnp.log(X2) - jnp.log(t + s)
    G = _nfw_G(X2)
    inner = (t2 + 1) * _nfw_F(X2) + 2 * G - math.pi / s + (t2 - 1) * L / (t * s)
    return t2 / ((t2 + 1) * (t2 + 1)) * inner


def _tnfw_h(X2: GridArray, t: FloatScalar) -> GridArray:
    """The truncated NFW's potential over `2 rho0 Rs^3`."""
    t2 = t * t
    s = jnp.sqrt(t2 + X2)
    L = 0.5 * jnp.log(X2) - jnp.log(t + s)
    u = 1 - X2
    G = _nfw_G(X2)
    ln_t = jnp.log(t)
    return (
        2 * t2 * math.pi * (t - s + t * jnp.log(t + s))
        + 2 * (t2 - 1) * t * s * L
        + t2 * (t2 - 1) * L * L
        + 4 * t2 * (X2 - 1) * G
        - t2 * (t2 - 1) * u * G * G
        + t2 * ((t2 - 1) * ln_t - t2 - 1) * jnp.log(X2)
        - t2
        * (
            (t2 - 1) * ln_t * jnp.log(4 * t)
            + 2 * jnp.log(0.5 * t)
            - 2 * t * (t - math.pi) * jnp.log(2 * t)
        )
    ) / ((t2 + 1) * (t2 + 1))


class TNFW(AbstractMassProfile):
    """Truncated NFW profile (lenstronomy `TNFW`; Baltz, Marshall & Oguri 2009): the NFW
    density times `r_trunc^2 / (r^2 + r_trunc^2)`, so its mass is finite; the usual
    profile of a tidally stripped subhalo.

    **Arguments:** `Rs` (scale radius, arcsec), `alpha_Rs` (deflection at `Rs` of the
    untruncated NFW with the same density normalisation, arcsec), `r_trunc` (truncation
    radius, arcsec), `center_x`, `center_y` (arcsec). Formulas in the module docstring;
    analytic Hessian. Inside `X < 10 sqrt(eps)` the radius is floored (finite values and
    gradients at the centre).
    """

    Rs: FloatScalar = eqx.field(
        converter=as_float, metadata=describe(domain=POSITIVE, bounds=(0.0, math.inf))
    )
    alpha_Rs: FloatScalar = eqx.field(
        converter=as_float, metadata=describe(domain=NON_NEGATIVE, bounds=(0.0, math.inf))
    )
    r_trunc: FloatScalar = eqx.field(
        converter=as_float, metadata=describe(domain=POSITIVE, bounds=(0.0, math.inf))
    )
    center_x: FloatScalar = eqx.field(converter=as_float, default=0.0)
    center_y: FloatScalar = eqx.field(converter=as_float, default=0.0)

    def _X2(self, dx: GridArray, dy: GridArray) -> GridArray:
        x_min = _x_min(jnp.result_type(dx))
        return jnp.maximum((dx * dx + dy * dy) / (self.Rs * self.Rs), x_min * x_min)

    def deflection(self, x: GridArray, y: GridArray) -> Deflection:
        dx, dy = x - self.center_x, y - self.center_y
        X2 = self._X2(dx, dy)
        a = self.alpha_Rs / (self.Rs * _ONE_PLUS_LN_HALF)
        a = a * _tnfw_g_over_x2(X2, self.r_trunc / self.Rs)
        return a * dx, a * dy

    def potential(self, x: GridArray, y: GridArray) -> GridArray:
        X2 = self._X2(x - self.center_x, y - self.center_y)
        h = _tnfw_h(X2, self.r_trunc / self.Rs)
        return self.alpha_Rs * self.Rs / (2 * _ONE_PLUS_LN_HALF) * h

    def convergence(self, x: GridArray, y: GridArray) -> GridArray:
        X2 = self._X2(x - self.center_x, y - self.center_y)
        F = _tnfw_F(X2, self.r_trunc / self.Rs)
        return self.alpha_Rs / (2 * self.Rs * _ONE_PLUS_LN_HALF) * F

    def hessian(self, x: GridArray, y: GridArray) -> Hessian:
        # a circular profile: psi_xx = kappa + gamma (dy^2 - dx^2) / R^2,
        # psi_xy = -2 gamma dx dy / R^2, with gamma = mean kappa inside R - kappa
        dx, dy = x - self.center_x, y - self.center_y
        X2 = self._X2(dx, dy)
        t = self.r_trunc / self.Rs
        unit = self.alpha_Rs / (self.Rs * _ONE_PLUS_LN_HALF)
        mean = unit * _tnfw_g_over_x2(X2, t)
        kappa = 0.5 * unit * _tnfw_F(X2, t)
        r2 = X2 * self.Rs * self.Rs
        gamma = (mean - kappa) / r2
        f_xx = kappa + gamma * (dy * dy - dx * dx)
        f_xy = -2 * gamma * dx * dy
        f_yy = kappa - gamma * (dy * dy - dx * dx)
        return f_xx, f_xy, f_xy, f_yy
