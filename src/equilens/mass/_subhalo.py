"""Subhalo profiles: the truncated NFW (Baltz, Marshall & Oguri 2009) and the pseudo-Jaffe
(dual pseudo-isothermal) sphere (Eliasdottir et al. 2007, as Vegetti et al. 2010).

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
from ._nfw import _ONE_PLUS_LN_HALF, _nfw_F, _nfw_G, floored_x2

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
        return floored_x2(dx, dy, self.Rs)

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


def _pseudo_jaffe_terms(r2: GridArray, a: FloatScalar, b: FloatScalar) -> tuple:
    """`(sa, sb, d1)` with `sa = sqrt(a^2 + R^2)`, `sb = sqrt(b^2 + R^2)` and
    `d1 = (sb - sa) / (b - a) = (a + b) / (sa + sb)` (no division by `b - a`)."""
    sa, sb = jnp.sqrt(a * a + r2), jnp.sqrt(b * b + r2)
    return sa, sb, (a + b) / (sa + sb)


def _log1p_ratio(z: GridArray) -> GridArray:
    """`log1p(z) / z`, 1 at `z = 0` (a series below 1e-4)."""
    small = jnp.abs(z) < 1e-4
    zs = jnp.where(small, 1.0, z)
    return jnp.where(small, 1 - z / 2 + z * z / 3, jnp.log1p(zs) / zs)


class PseudoJaffe(AbstractMassProfile):
    """Pseudo-Jaffe sphere (lenstronomy `PJAFFE`; the dual pseudo-isothermal profile of
    Eliasdottir et al. 2007, the subhalo profile of Vegetti et al. 2010): 3D density
    `rho0 / ((1 + r^2/Ra^2) (1 + r^2/Rs^2))`, projected

        kappa = sigma0 Ra Rs / (Rs - Ra) (1/sqrt(Ra^2 + R^2) - 1/sqrt(Rs^2 + R^2)),
        alpha_R = 2 sigma0 Ra Rs / (Rs - Ra) (R/(Ra + sqrt(Ra^2+R^2)) - R/(Rs + sqrt(Rs^2+R^2))),
        psi = -2 sigma0 Ra Rs / (Rs - Ra) (sqrt(Rs^2+R^2) - sqrt(Ra^2+R^2)
              + Ra ln(Ra + sqrt(Ra^2+R^2)) - Rs ln(Rs + sqrt(Rs^2+R^2))),

    so `sigma0` is the central convergence and the total mass `2 pi sigma0 Ra Rs`
    (Sigma_crit arcsec^2). Symmetric in `Ra` and `Rs` (lenstronomy sorts them so that
    `Ra < Rs`, the core and the truncation radius); every divided difference in them is
    written without the division by `Rs - Ra`, so `Ra = Rs` is exact and smooth. Smooth
    at the centre (no floor): `kappa(0) = sigma0`.

    **Arguments:** `sigma0` (central convergence), `Ra`, `Rs` (arcsec), `center_x`,
    `center_y` (arcsec). Analytic Hessian.
    """

    sigma0: FloatScalar = eqx.field(
        converter=as_float, metadata=describe(domain=NON_NEGATIVE, bounds=(0.0, math.inf))
    )
    Ra: FloatScalar = eqx.field(
        converter=as_float, metadata=describe(domain=POSITIVE, bounds=(0.0, math.inf))
    )
    Rs: FloatScalar = eqx.field(
        converter=as_float, metadata=describe(domain=POSITIVE, bounds=(0.0, math.inf))
    )
    center_x: FloatScalar = eqx.field(converter=as_float, default=0.0)
    center_y: FloatScalar = eqx.field(converter=as_float, default=0.0)

    def _mean_kappa(self, r2: GridArray) -> GridArray:
        # alpha_R / R = 2 sigma0 a b (1 + d1) / ((a + sa) (b + sb))
        a, b = self.Ra, self.Rs
        sa, sb, d1 = _pseudo_jaffe_terms(r2, a, b)
        return 2 * self.sigma0 * a * b * (1 + d1) / ((a + sa) * (b + sb))

    def deflection(self, x: GridArray, y: GridArray) -> Deflection:
        dx, dy = x - self.center_x, y - self.center_y
        k = self._mean_kappa(dx * dx + dy * dy)
        return k * dx, k * dy

    def potential(self, x: GridArray, y: GridArray) -> GridArray:
        dx, dy = x - self.center_x, y - self.center_y
        a, b = self.Ra, self.Rs
        sa, sb, d1 = _pseudo_jaffe_terms(dx * dx + dy * dy, a, b)
        # (a ln(a + sa) - b ln(b + sb)) / (b - a) = -a w log1p(z)/z - ln(b + sb), with
        # w = (1 + d1) / (a + sa) and z = (b - a) w
        w = (1 + d1) / (a + sa)
        bracket = d1 - a * w * _log1p_ratio((b - a) * w) - jnp.log(b + sb)
        return -2 * self.sigma0 * a * b * bracket

    def convergence(self, x: GridArray, y: GridArray) -> GridArray:
        dx, dy = x - self.center_x, y - self.center_y
        a, b = self.Ra, self.Rs
        sa, sb, d1 = _pseudo_jaffe_terms(dx * dx + dy * dy, a, b)
        return self.sigma0 * a * b * d1 / (sa * sb)

    def hessian(self, x: GridArray, y: GridArray) -> Hessian:
        # psi_xx = kappa + (gamma / R^2) (dy^2 - dx^2), psi_xy = -2 (gamma / R^2) dx dy, with
        # gamma / R^2 = -d(mean kappa)/d(R^2) = sigma0 a b (1/u_a - 1/u_b) / (b - a),
        # u = s (c + s)^2, the divided difference written out (finite at R = 0)
        dx, dy = x - self.center_x, y - self.center_y
        a, b = self.Ra, self.Rs
        sa, sb, d1 = _pseudo_jaffe_terms(dx * dx + dy * dy, a, b)
        du = (
            b * b * d1
            + sa * (a + b)
            + 2 * b * (a + b)
            + 2 * sa * sa
            + d1 * (sb * sb + sa * sb + sa * sa)
        )
        u_a, u_b = sa * (a + sa) ** 2, sb * (b + sb) ** 2
        g = self.sigma0 * a * b * du / (u_a * u_b)
        kappa = self.sigma0 * a * b * d1 / (sa * sb)
        f_xx = kappa + g * (dy * dy - dx * dx)
        f_xy = -2 * g * dx * dy
        f_yy = kappa - g * (dy * dy - dx * dx)
        return f_xx, f_xy, f_xy, f_yy
