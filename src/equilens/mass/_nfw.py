"""Navarro-Frenk-White profiles: spherical NFW and NFW elliptical in the convergence.

Parametrisation as lenstronomy (`NFW`, `NFW_ELLIPSE_CSE`): scale radius `Rs` (arcsec) and
`alpha_Rs`, the deflection at `Rs` of the spherical profile (arcsec). With
`rho0 = alpha_Rs / (4 Rs^2 (1 + ln 1/2))` and `X = r / Rs` (Bartelmann 1996; Golse &
Kneib 2002, eqs. 37-55):

    kappa = 2 rho0 Rs F(X),   F(X) = (1 - G(1 - X^2)) / (X^2 - 1),
    alpha = 4 rho0 Rs g(X) / X^2 (x, y),   g(X) = ln(X/2) + G(1 - X^2),
    psi   = 2 rho0 Rs^3 [ln^2(X/2) - (1 - X^2) G(1 - X^2)^2],

where `G(u) = atanh(sqrt u)/sqrt u` for `u > 0` and `atan(sqrt(-u))/sqrt(-u)` for `u < 0`
is one analytic function (so X = 1 needs no special case).
"""

import math

import equinox as eqx
import jax.numpy as jnp
import numpy as np

from .._checks import NON_NEGATIVE, POSITIVE, describe
from .._custom_types import FloatScalar, GridArray, as_float
from .._math import atanh_ratio, rotate, smooth_in_ellipticity, unrotate
from ._base import AbstractMassProfile, Deflection

_ONE_PLUS_LN_HALF = 1.0 + float(np.log(0.5))


def _x_min(dtype) -> float:
    # Below this X the NFW expressions lose all precision (1 - X^2 rounds to 1).
    return 10 * float(np.sqrt(np.finfo(dtype).eps))


def floored_x2(dx: GridArray, dy: GridArray, Rs: FloatScalar) -> GridArray:
    """`X^2 = (dx^2 + dy^2) / Rs^2`, floored at `X = 10 sqrt(eps)` (the NFW family's
    expressions lose all precision below it)."""
    x_min = _x_min(jnp.result_type(dx))
    return jnp.maximum((dx * dx + dy * dy) / (Rs * Rs), x_min * x_min)


def _nfw_g_over_x2(X2: GridArray) -> GridArray:
    """g(X) / X^2 with g(X) = ln(X/2) + G(1 - X^2)."""
    u = 1 - X2
    direct = (0.5 * jnp.log(X2 / 4) + atanh_ratio(u)) / X2
    # For X < 1/2 the two terms of g nearly cancel (g ~ X^2 ln X); with G(u) =
    # ln((1 + sqrt u)/X)/sqrt u the sum is rewritten without cancellation:
    # g/X^2 = -ln(X/2) / (sqrt u (1 + sqrt u)) + log1p(-X^2 / (2 (1 + sqrt u))) / (sqrt u X^2).
    small = X2 < 0.25
    X2s = jnp.where(small, X2, 0.1)
    su = jnp.sqrt(1 - X2s)
    stable = -0.5 * jnp.log(X2s / 4) / (su * (1 + su)) + jnp.log1p(-X2s / (2 * (1 + su))) / (
        su * X2s
    )
    return jnp.where(small, stable, direct)


def _nfw_G(X2: GridArray) -> GridArray:
    """`G(1 - X^2)` (lenstronomy's `F(X)`) with full relative precision at small `X`, where
    `atanh(sqrt(1 - X^2))` would lose it: `(ln(1 + su) - ln X) / su`, `su = sqrt(1 - X^2)`."""
    small = X2 < 0.25
    X2s = jnp.where(small, X2, 0.1)
    su = jnp.sqrt(1 - X2s)
    stable = (jnp.log1p(su) - 0.5 * jnp.log(X2s)) / su
    return jnp.where(small, stable, atanh_ratio(1 - jnp.where(small, 0.5, X2)))


def _nfw_F(X2: GridArray) -> GridArray:
    """`(1 - G(1 - X^2)) / (X^2 - 1)`: the NFW convergence over `2 rho0 Rs`."""
    u = 1 - X2
    small = jnp.abs(u) < 1e-3
    us = jnp.where(small, jnp.full_like(u, 0.5), u)
    series = jnp.full_like(u, 1.0 / 15.0)
    for k in range(6, 0, -1):  # sum_{k>=1} u^(k-1) / (2k+1)
        series = series * u + 1.0 / (2 * k + 1)
    return jnp.where(small, series, (_nfw_G(jnp.where(small, 0.5, X2)) - 1) / us)


class NFW(AbstractMassProfile):
    """Spherical NFW profile (lenstronomy `NFW`).

    **Arguments:** `Rs` (scale radius, arcsec), `alpha_Rs` (deflection at `Rs`, arcsec),
    `center_x`, `center_y` (arcsec). Formulas in the module docstring. Inside
    `X < 10 sqrt(eps)` (1.5e-7 Rs in float64) the radius is floored.
    """

    Rs: FloatScalar = eqx.field(
        converter=as_float, metadata=describe(domain=POSITIVE, bounds=(0.0, math.inf))
    )
    alpha_Rs: FloatScalar = eqx.field(
        converter=as_float, metadata=describe(domain=NON_NEGATIVE, bounds=(0.0, math.inf))
    )
    center_x: FloatScalar = eqx.field(converter=as_float, default=0.0)
    center_y: FloatScalar = eqx.field(converter=as_float, default=0.0)

    def _X2(self, dx: GridArray, dy: GridArray) -> GridArray:
        return floored_x2(dx, dy, self.Rs)

    def deflection(self, x: GridArray, y: GridArray) -> Deflection:
        dx, dy = x - self.center_x, y - self.center_y
        a = self.alpha_Rs / (self.Rs * _ONE_PLUS_LN_HALF) * _nfw_g_over_x2(self._X2(dx, dy))
        return a * dx, a * dy

    def potential(self, x: GridArray, y: GridArray) -> GridArray:
        X2 = self._X2(x - self.center_x, y - self.center_y)
        u = 1 - X2
        G = atanh_ratio(u)
        h = 0.25 * jnp.log(X2 / 4) ** 2 - u * G * G
        return self.alpha_Rs * self.Rs / (2 * _ONE_PLUS_LN_HALF) * h

    def convergence(self, x: GridArray, y: GridArray) -> GridArray:
        X2 = self._X2(x - self.center_x, y - self.center_y)
        return self.alpha_Rs / (2 * self.Rs * _ONE_PLUS_LN_HALF) * _nfw_F(X2)


# Oguri (2021, PASP 133, 074504), Table 1: NFW convergence as a sum of 44 cored steep
# ellipsoids, kappa_NFW(xi) ~ sum_i a_i / (2 (s_i^2 + xi^2)^(3/2)) in units of Rs
# (relative accuracy ~1e-4 over 1e-4 < r/Rs < 1e3).
CSE_S = (
    1.082411e-06,
    8.786566e-06,
    3.292868e-06,
    1.860019e-05,
    3.274231e-05,
    6.232485e-05,
    9.256333e-05,
    1.546762e-04,
    2.097321e-04,
    3.391140e-04,
    5.178790e-04,
    8.636736e-04,
    1.405152e-03,
    2.193855e-03,
    3.179572e-03,
    4.970987e-03,
    7.631970e-03,
    1.119413e-02,
    1.827267e-02,
    2.945251e-02,
    4.562723e-02,
    6.782509e-02,
    1.596987e-01,
    1.127751e-01,
    2.169469e-01,
    3.423835e-01,
    5.194527e-01,
    8.623185e-01,
    1.382737e00,
    2.034929e00,
    3.402979e00,
    5.594276e00,
    8.052345e00,
    1.349045e01,
    2.603825e01,
    4.736823e01,
    6.559320e01,
    1.087932e02,
    1.477673e02,
    2.495341e02,
    4.305999e02,
    7.760206e02,
    2.143057e03,
    1.935749e03,
)
CSE_A = (
    1.648988e-18,
    6.274458e-16,
    3.646620e-17,
    3.459206e-15,
    2.457389e-14,
    1.059319e-13,
    4.211597e-13,
    1.142832e-12,
    4.391215e-12,
    1.556500e-11,
    6.951271e-11,
    3.147466e-10,
    1.379109e-09,
    3.829778e-09,
    1.384858e-08,
    5.370951e-08,
    1.804384e-07,
    5.788608e-07,
    3.205256e-06,
    1.102422e-05,
    4.093971e-05,
    1.282206e-04,
    4.575541e-04,
    7.995270e-04,
    5.013701e-03,
    1.403508e-02,
    5.230727e-02,
    1.898907e-01,
    3.643448e-01,
    7.203734e-01,
    1.717667e00,
    2.217566e00,
    3.187447e00,
    8.194898e00,
    1.765210e01,
    1.974319e01,
    2.783688e01,
    4.482311e01,
    5.598897e01,
    1.426485e02,
    2.279833e02,
    5.401335e02,
    9.743682e02,
    1.775124e03,
)


class EllipticalNFW(AbstractMassProfile):
    """NFW profile elliptical in the convergence (lenstronomy `NFW_ELLIPSE_CSE`).

    The spherical NFW convergence is written as a sum of 44 cored steep ellipsoids (CSE;
    Oguri 2021, Table 1; CSE lensing formulas from Keeton & Kochanek 1998 and Oguri 2021,
    eqs. 16-20), each made elliptical with the product-average radius
    `xi = sqrt(q x'^2 + y'^2/q)`, so the mass inside an isodensity contour does not change
    with `q`. Accurate to ~1e-4 against the exact NFW; exact in `e1, e2` at q = 1.

    **Arguments:** `Rs` (arcsec), `alpha_Rs` (arcsec), `e1`, `e2`, `center_x`, `center_y`.
    """

    Rs: FloatScalar = eqx.field(
        converter=as_float, metadata=describe(domain=POSITIVE, bounds=(0.0, math.inf))
    )
    alpha_Rs: FloatScalar = eqx.field(
        converter=as_float, metadata=describe(domain=NON_NEGATIVE, bounds=(0.0, math.inf))
    )
    e1: FloatScalar = eqx.field(
        converter=as_float, default=0.0, metadata=describe(bounds=(-0.6, 0.6))
    )
    e2: FloatScalar = eqx.field(
        converter=as_float, default=0.0, metadata=describe(bounds=(-0.6, 0.6))
    )
    center_x: FloatScalar = eqx.field(converter=as_float, default=0.0)
    center_y: FloatScalar = eqx.field(converter=as_float, default=0.0)

    def _cse(self, x: GridArray, y: GridArray, want_potential: bool):
        dtype = jnp.result_type(x, self.center_x)
        axes = tuple(range(1, 1 + jnp.ndim(x)))
        s = jnp.expand_dims(jnp.asarray(CSE_S, dtype=dtype), axes)
        a = jnp.expand_dims(jnp.asarray(CSE_A, dtype=dtype), axes)
        norm = self.alpha_Rs * self.Rs / _ONE_PLUS_LN_HALF  # 4 rho0 Rs^3

        def polar(c, cos_phi, sin_phi):
            # the offsets inside the cond (see `SIE.deflection`)
            dx, dy = x - self.center_x, y - self.center_y
            q = (1 - c) / (1 + c)
            xp, yp = rotate(dx, dy, cos_phi, sin_phi)
            # product-average CSE = major-axis CSE at sqrt(q) (x', y') / Rs, amplitude a / q
            root_q = jnp.sqrt(q)
            u = (root_q * xp / self.Rs)[None]
            v = (root_q * yp / self.Rs)[None]
            psi = jnp.sqrt(q * q * (s * s + u * u) + v * v)
            Phi = (psi + s) ** 2 + (1 - q * q) * u * u
            if want_potential:
                pot = (a / q) * (q / (2 * s) * jnp.log(Phi) - q / s * jnp.log((1 + q) * s))
                return norm * pot.sum(axis=0)
            # separate reciprocals: the product s * psi * Phi (~1e-24 at the centre for the
            # smallest cores) underflows in float32, its square in the gradient even sooner
            common = (a / s) * (1 / psi) * (1 / Phi)
            fx = (common * u * (psi + q * q * s)).sum(axis=0) * root_q
            fy = (common * v * (psi + s)).sum(axis=0) * root_q
            fx, fy = unrotate(fx, fy, cos_phi, sin_phi)
            return norm / self.Rs * fx, norm / self.Rs * fy

        return smooth_in_ellipticity(polar, self.e1, self.e2)

    def deflection(self, x: GridArray, y: GridArray) -> Deflection:
        return self._cse(x, y, want_potential=False)

    def potential(self, x: GridArray, y: GridArray) -> GridArray:
        return self._cse(x, y, want_potential=True)
