"""Isothermal and power-law mass profiles: SIS, SIE, EPL.

Parameters and normalisations follow lenstronomy (profiles `SIS`, `SIE`, `EPL`): the
Einstein radius `theta_E` is in the intermediate-axis (product-average) convention, in which
the convergence is `kappa = (3 - gamma)/2 * (theta_E / R)^(gamma - 1)` with
`R = sqrt(q x'^2 + y'^2 / q)`, and `(e1, e2) = (1-q)/(1+q) (cos 2phi, sin 2phi)`.
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp

from .._checks import NON_NEGATIVE, Domain, describe
from .._custom_types import FloatScalar, GridArray, as_float
from .._math import (
    elliptical_radius_sq,
    fast_arctan,
    fast_atanh,
    inv_sqrt_or_zero,
    orientation,
    safe_sqrt,
)
from ._base import AbstractMassProfile, Deflection

# ---------------------------------------------------------------------------------------
# SIE without a near-round branch.
#
# With z = x + i y (relative to the centre), eps = e1 + i e2, W = z - eps conj(z) and the
# unit vector u = W / |W|, the SIE's deflection is (the EPL's form below at gamma = 2)
#     alpha = theta_E sqrt(1 - |eps|^2) u G(w),   w = -conj(eps) u^2,
#     G(w) = atanh(sqrt w) / sqrt w = 2F1(1, 1/2; 3/2; w) = sum_k w^k / (2k + 1),
# and |w| = |eps| = c for every pixel. With sigma = sqrt(c) e^{-i phi} (phi the major axis'
# angle), s = i sigma u is a square root of w and Keeton's (2001) closed form is
#     atanh(s) = atanh(2 Re s / (1 + c)) / 2 + i atan(2 Im s / (1 - c)) / 2:
# one atan and one log per pixel, G = atanh(s) conj(s) / c. That value is exact to
# round-off down to c = 0 (G = 1 + w/3 below c = sqrt(eps)), but its derivative through
# (c, phi) is 0 * inf at c = 0; a custom JVP supplies dG = G'(w) dw instead, with dw
# smooth in (e1, e2) and G'(w) = (1/(1 - w) - G) / (2w), or its series for small c. One
# formula for every ellipticity: no branch of the program (a `lax.cond` on c traced,
# compiled and differentiated the profile three times).
# ---------------------------------------------------------------------------------------

_DG_TERMS = 8  # terms of the series of G'(w), used for c < eps^(1 / (_DG_TERMS + 1))


def _sky_frame_w(dx: GridArray, dy: GridArray, e1: FloatScalar, e2: FloatScalar):
    """Real and imaginary parts of `W = z - eps conj(z)` (`z = dx + i dy`, `eps = e1 + i e2`):
    the SIE's and the EPL's angle-free coordinate."""
    return dx - e1 * dx - e2 * dy, dy - e2 * dx + e1 * dy


def _sie_w(ur, ui, e1, e2):
    # w = -conj(eps) u^2
    pr, pi = ur * ur - ui * ui, 2 * ur * ui
    return -(e1 * pr + e2 * pi), -(e1 * pi - e2 * pr)


@jax.custom_jvp
def _sie_g(ur: GridArray, ui: GridArray, e1: FloatScalar, e2: FloatScalar):
    """Real and imaginary parts of `G(w)`, `w = -conj(eps) u^2`, `|u| = 1` (or `u = 0`)."""
    c, cos_phi, sin_phi = orientation(e1, e2)
    tiny = c < math.sqrt(float(jnp.finfo(jnp.result_type(c)).eps))
    c = jnp.where(tiny, 0.25, c)
    root_c = jnp.sqrt(c)
    sr = root_c * (sin_phi * ur - cos_phi * ui)
    si = root_c * (cos_phi * ur + sin_phi * ui)
    # fast_atanh keeps relative precision for small arguments
    a = 0.5 * fast_atanh(2 * sr / (1 + c))
    b = 0.5 * fast_arctan(2 * si / (1 - c))
    inv_c = 1 / c
    wr, wi = _sie_w(ur, ui, e1, e2)
    gr = jnp.where(tiny, 1 + wr / 3, (a * sr + b * si) * inv_c)
    gi = jnp.where(tiny, wi / 3, (b * sr - a * si) * inv_c)
    return gr, gi


@_sie_g.defjvp
def _sie_g_jvp(primals, tangents):
    ur, ui, e1, e2 = primals
    dur, dui, de1, de2 = tangents
    gr, gi = _sie_g(ur, ui, e1, e2)
    wr, wi = _sie_w(ur, ui, e1, e2)
    # dw = -conj(d eps) u^2 - 2 conj(eps) u du
    pr, pi = ur * ur - ui * ui, 2 * ur * ui
    dpr, dpi = 2 * (ur * dur - ui * dui), 2 * (ur * dui + ui * dur)
    dwr = -(de1 * pr + de2 * pi) - (e1 * dpr + e2 * dpi)
    dwi = -(de1 * pi - de2 * pr) - (e1 * dpi - e2 * dpr)
    c2 = e1 * e1 + e2 * e2
    small = c2 < float(jnp.finfo(jnp.result_type(c2)).eps) ** (2 / (_DG_TERMS + 1))
    # small c: G'(w) = sum_k (k + 1) w^k / (2k + 3), error ~ c^_DG_TERMS
    sr = jnp.full_like(wr, _DG_TERMS / (2 * _DG_TERMS + 1))
    si = jnp.zeros_like(wr)
    for k in range(_DG_TERMS - 2, -1, -1):
        sr, si = sr * wr - si * wi + (k + 1) / (2 * k + 3), sr * wi + si * wr
    # otherwise (1/(1 - w) - G) / (2w), error ~ eps / c (w = 0 only at the centre, dw = 0)
    wrs, wis = jnp.where(small, 0.5, wr), jnp.where(small, 0.0, wi)
    m = (1 - wrs) ** 2 + wis * wis
    hr, hi = (1 - wrs) / m - gr, wis / m - gi
    m2 = 2 * (wrs * wrs + wis * wis)
    m2 = jnp.where(m2 > 0, m2, 1)
    dgr = jnp.where(small, sr, (hr * wrs + hi * wis) / m2)
    dgi = jnp.where(small, si, (hi * wrs - hr * wis) / m2)
    return (gr, gi), (dgr * dwr - dgi * dwi, dgr * dwi + dgi * dwr)


class SIS(AbstractMassProfile):
    """Singular isothermal sphere (lenstronomy `SIS`).

    `kappa = theta_E / (2 r)`, `psi = theta_E r`, `alpha = theta_E (x, y) / r`.

    **Arguments:** `theta_E` (Einstein radius, arcsec), `center_x`, `center_y` (arcsec).
    """

    theta_E: FloatScalar = eqx.field(
        converter=as_float, metadata=describe(domain=NON_NEGATIVE, bounds=(0.0, math.inf))
    )
    center_x: FloatScalar = eqx.field(converter=as_float, default=0.0)
    center_y: FloatScalar = eqx.field(converter=as_float, default=0.0)

    def deflection(self, x: GridArray, y: GridArray) -> Deflection:
        dx, dy = x - self.center_x, y - self.center_y
        inv_r = inv_sqrt_or_zero(dx * dx + dy * dy)
        return self.theta_E * dx * inv_r, self.theta_E * dy * inv_r

    def potential(self, x: GridArray, y: GridArray) -> GridArray:
        dx, dy = x - self.center_x, y - self.center_y
        return self.theta_E * safe_sqrt(dx * dx + dy * dy)

    def convergence(self, x: GridArray, y: GridArray) -> GridArray:
        dx, dy = x - self.center_x, y - self.center_y
        return 0.5 * self.theta_E * inv_sqrt_or_zero(dx * dx + dy * dy)


class SIE(AbstractMassProfile):
    """Singular isothermal ellipsoid (lenstronomy `SIE`; Kormann et al. 1994, Keeton 2001).

    `kappa = theta_E / (2 sqrt(q x'^2 + y'^2/q))`: `theta_E` is the Einstein radius in the
    intermediate-axis convention. In the major-axis frame, with `b = theta_E sqrt(q)`,
    `e' = sqrt(1 - q^2)` and `w = sqrt(q^2 x'^2 + y'^2)`:
    `alpha_x' = b/e' atan(e' x'/w)`, `alpha_y' = b/e' atanh(e' y'/w)`, and
    `psi = x alpha_x + y alpha_y`, evaluated in the sky frame without angles (see the
    comment above `_sie_g`): exact to round-off at every ellipticity including q = 1, with
    the true gradients with respect to `e1`, `e2` there (1e-13), and no branch of the
    program. The arctangent is `fast_arctan` (1 ulp), one log gives the atanh.
    """

    theta_E: FloatScalar = eqx.field(
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

    def deflection(self, x: GridArray, y: GridArray) -> Deflection:
        dx, dy = x - self.center_x, y - self.center_y
        e1, e2 = self.e1, self.e2
        # u = W / |W| (0 at the centre)
        wr, wi = _sky_frame_w(dx, dy, e1, e2)
        inv_m = inv_sqrt_or_zero(wr * wr + wi * wi)
        ur, ui = wr * inv_m, wi * inv_m
        gr, gi = _sie_g(ur, ui, e1, e2)
        amp = self.theta_E * jnp.sqrt(1 - (e1 * e1 + e2 * e2))
        return amp * (ur * gr - ui * gi), amp * (ur * gi + ui * gr)

    def potential(self, x: GridArray, y: GridArray) -> GridArray:
        ax, ay = self.deflection(x, y)
        return (x - self.center_x) * ax + (y - self.center_y) * ay

    def convergence(self, x: GridArray, y: GridArray) -> GridArray:
        r2 = elliptical_radius_sq(x - self.center_x, y - self.center_y, self.e1, self.e2)
        return 0.5 * self.theta_E * inv_sqrt_or_zero(r2)


# ---------------------------------------------------------------------------------------
# EPL: Tessore & Metcalf (2015) hypergeometric series, written without angles.
#
# With z = x + i y (relative to the centre), eps = e1 + i e2 and W = z - eps conj(z), the
# deflection of the elliptical power law of lenstronomy's EPL is
#     alpha = (theta_E sqrt(1 - |eps|^2) / |W|)^t  W  F(-conj(eps) W / conj(W)),
#     F(w) = 2F1(1, t/2; 2 - t/2; w),      t = gamma - 1,
# which is the Tessore & Metcalf (2015) eq. (13) result rotated to the sky frame (their
# R e^{i phi} = q x' + i y' becomes (1+q)/2 e^{-i phi_G} W). Every quantity is a smooth
# function of (e1, e2), so q = 1 needs no special case. |w| = |eps| = c for every pixel,
# so the series converges geometrically with ratio c; it is summed until the remainder
# bound is below float precision (custom JVP supplies dF/dw and dF/dt from the same loop).
# ---------------------------------------------------------------------------------------

_MAX_TERMS = 2000


def _stop_bound(n, cn, c, with_derivatives: bool):
    # Terms are bounded by c^n (coefficients <= 1 for 0 < t < 2). Remainder after n terms:
    # F: c^(n+1)/(1-c). With derivatives, dF/dw has summed only up to w^(n-1) (remainder
    # ~ (n+1) c^n), dF/dt carries an extra factor ~ log n, and the second derivatives
    # (the JVP of the JVP rule: Hessians) up to w^(n-2), remainder ~ n^2 c^(n-1): the
    # bound is compared with eps * c (see `cond`).
    one_minus_c = 1 - c
    if with_derivatives:
        m = (n + 2).astype(c.dtype)
        return m * m * m * cn / (one_minus_c * one_minus_c * one_minus_c)
    return cn * c / one_minus_c


def _hyp_series(wr, wi, t, c, with_derivatives: bool):
    eps = 0.25 * jnp.finfo(wr.dtype).eps
    zero = jnp.zeros_like(wr)
    one = jnp.ones_like(wr)
    s0 = jnp.zeros_like(t)
    init = (
        jnp.asarray(0),
        jnp.ones_like(c),  # c^n
        (one, zero),  # term a_n w^n
        (one, zero),  # F
        (zero, zero),  # dF/dw
        s0,  # s_n = d log a_n / dt
        (zero, zero),  # dF/dt
    )

    def cond(state):
        n, cn = state[0], state[1]
        if with_derivatives:
            # at least three terms: dF/dw at w = 0 is a_1 and d2F/dw2 is 2 a_2, not 0
            going = (_stop_bound(n, cn, c, with_derivatives) > eps * c) | (n < 3)
        else:
            going = _stop_bound(n, cn, c, with_derivatives) > eps
        return (n < _MAX_TERMS) & going

    def body(state):
        n, cn, (tr, ti), (fr, fi), (dr, di), s, (gr, gi) = state
        nf = n.astype(t.dtype)
        ratio = (2 * nf + t) / (2 * nf + 4 - t)
        if with_derivatives:
            k = (nf + 1) * ratio
            dr, di = dr + k * tr, di + k * ti
            s = s + 1 / (2 * nf + t) + 1 / (2 * nf + 4 - t)
        tr, ti = ratio * (tr * wr - ti * wi), ratio * (tr * wi + ti * wr)
        fr, fi = fr + tr, fi + ti
        if with_derivatives:
            gr, gi = gr + s * tr, gi + s * ti
        return n + 1, cn * c, (tr, ti), (fr, fi), (dr, di), s, (gr, gi)

    _, _, _, f, df_dw, _, df_dt = jax.lax.while_loop(cond, body, init)
    return f, df_dw, df_dt


@jax.custom_jvp
def _epl_hyp2f1(wr, wi, t, c):
    """Real and imaginary parts of 2F1(1, t/2; 2 - t/2; w), |w| <= c < 1."""
    f, _, _ = _hyp_series(wr, wi, t, c, with_derivatives=False)
    return f


@_epl_hyp2f1.defjvp
def _epl_hyp2f1_jvp(primals, tangents):
    wr, wi, t, c = primals
    wr_dot, wi_dot, t_dot, _ = tangents
    (fr, fi), (dr, di), (gr, gi) = _hyp_series(wr, wi, t, c, with_derivatives=True)
    out_r = dr * wr_dot - di * wi_dot + gr * t_dot
    out_i = dr * wi_dot + di * wr_dot + gi * t_dot
    return (fr, fi), (out_r, out_i)


class EPL(AbstractMassProfile):
    """Elliptical power-law mass profile (lenstronomy `EPL`; Tessore & Metcalf 2015).

    `kappa = (3 - gamma)/2 (theta_E / sqrt(q x'^2 + y'^2/q))^(gamma - 1)`, with slope
    `1 < gamma < 3` (gamma = 2 is the SIE). The deflection is the Tessore & Metcalf (2015)
    hypergeometric series, summed to float precision (the number of terms adapts to the
    ellipticity: about 40 at q = 0.5 in float64), in an angle-free form that is exact and
    differentiable at q = 1. `psi = (x alpha_x + y alpha_y) / (3 - gamma)`.

    **Arguments:** `theta_E` (arcsec), `gamma` (3D density slope), `e1`, `e2`,
    `center_x`, `center_y` (arcsec).
    """

    theta_E: FloatScalar = eqx.field(
        converter=as_float, metadata=describe(domain=NON_NEGATIVE, bounds=(0.0, math.inf))
    )
    gamma: FloatScalar = eqx.field(
        converter=as_float,
        default=2.0,
        metadata=describe(domain=Domain(1.0, 3.0, True, True), bounds=(1.1, 2.9)),
    )
    e1: FloatScalar = eqx.field(
        converter=as_float, default=0.0, metadata=describe(bounds=(-0.6, 0.6))
    )
    e2: FloatScalar = eqx.field(
        converter=as_float, default=0.0, metadata=describe(bounds=(-0.6, 0.6))
    )
    center_x: FloatScalar = eqx.field(converter=as_float, default=0.0)
    center_y: FloatScalar = eqx.field(converter=as_float, default=0.0)

    def deflection(self, x: GridArray, y: GridArray) -> Deflection:
        dx, dy = x - self.center_x, y - self.center_y
        e1, e2, t = self.e1, self.e2, self.gamma - 1
        c2 = e1 * e1 + e2 * e2
        c = safe_sqrt(c2)
        wr, wi = _sky_frame_w(dx, dy, e1, e2)
        w2 = wr * wr + wi * wi
        inv_w2 = jnp.where(w2 > 0, 1 / jnp.where(w2 > 0, w2, 1), 0)
        # argument -conj(eps) W^2 / |W|^2
        pr, pi = wr * wr - wi * wi, 2 * wr * wi
        ar = -(e1 * pr + e2 * pi) * inv_w2
        ai = -(e1 * pi - e2 * pr) * inv_w2
        fr, fi = _epl_hyp2f1(ar, ai, t, c)
        # (theta_E sqrt(1 - c^2))^t |W|^(-t), written with one exp and one log
        log_amp = t * (jnp.log(self.theta_E) + 0.5 * jnp.log1p(-c2))
        safe_w2 = jnp.where(w2 > 0, w2, 1)
        scale = jnp.where(w2 > 0, jnp.exp(log_amp - 0.5 * t * jnp.log(safe_w2)), 0)
        return scale * (wr * fr - wi * fi), scale * (wr * fi + wi * fr)

    def potential(self, x: GridArray, y: GridArray) -> GridArray:
        ax, ay = self.deflection(x, y)
        return ((x - self.center_x) * ax + (y - self.center_y) * ay) / (3 - self.gamma)

    def convergence(self, x: GridArray, y: GridArray) -> GridArray:
        r2 = elliptical_radius_sq(x - self.center_x, y - self.center_y, self.e1, self.e2)
        t = self.gamma - 1
        safe_r2 = jnp.where(r2 > 0, r2, 1)
        k = (2 - t) / 2 * jnp.exp(t * (jnp.log(self.theta_E) - 0.5 * jnp.log(safe_r2)))
        # at the exact centre, where the cusp's convergence is infinite, 0 as the SIE's
        # (`inv_sqrt_or_zero`): finite values everywhere (inf there made the property test
        # of test_checks fail once hypothesis drew a centre on a sample point)
        return jnp.where(r2 > 0, k, 0.0)
