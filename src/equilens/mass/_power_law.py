"""Isothermal and power-law mass profiles: SIS, SIE, EPL.

Parameters and normalisations follow lenstronomy (profiles `SIS`, `SIE`, `EPL`): the
Einstein radius `theta_E` is in the intermediate-axis (product-average) convention, in which
the convergence is `kappa = (3 - gamma)/2 * (theta_E / R)^(gamma - 1)` with
`R = sqrt(q x'^2 + y'^2 / q)`, and `(e1, e2) = (1-q)/(1+q) (cos 2phi, sin 2phi)`.
"""

import math
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp

from .._checks import NON_NEGATIVE, Domain
from .._custom_types import FloatScalar, GridArray, as_float
from .._math import (
    elliptical_radius_sq,
    fast_arctan,
    fast_atanh,
    inv_sqrt_or_zero,
    rotate,
    safe_sqrt,
    smooth_in_ellipticity,
    unrotate,
)
from ._base import AbstractMassProfile, Deflection


class SIS(AbstractMassProfile):
    """Singular isothermal sphere (lenstronomy `SIS`).

    `kappa = theta_E / (2 r)`, `psi = theta_E r`, `alpha = theta_E (x, y) / r`.

    **Arguments:** `theta_E` (Einstein radius, arcsec), `center_x`, `center_y` (arcsec).
    """

    bounds: ClassVar[dict[str, tuple[float, float]]] = {"theta_E": (0.0, math.inf)}

    domain: ClassVar[dict[str, Domain]] = {"theta_E": NON_NEGATIVE}

    theta_E: FloatScalar = eqx.field(converter=as_float)
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
    `psi = x alpha_x + y alpha_y`. At and near q = 1 the value is exact to round-off and the
    gradients with respect to `e1`, `e2` are the true ones (see `smooth_in_ellipticity`).
    The arctangent is `fast_arctan` (1 ulp), one log gives the atanh.

    **Arguments:** `theta_E` (arcsec), `e1`, `e2` (ellipticity components), `center_x`,
    `center_y` (arcsec).
    """

    bounds: ClassVar[dict[str, tuple[float, float]]] = {
        "theta_E": (0.0, math.inf),
        "e1": (-0.6, 0.6),
        "e2": (-0.6, 0.6),
    }

    domain: ClassVar[dict[str, Domain]] = {"theta_E": NON_NEGATIVE}

    theta_E: FloatScalar = eqx.field(converter=as_float)
    e1: FloatScalar = eqx.field(converter=as_float, default=0.0)
    e2: FloatScalar = eqx.field(converter=as_float, default=0.0)
    center_x: FloatScalar = eqx.field(converter=as_float, default=0.0)
    center_y: FloatScalar = eqx.field(converter=as_float, default=0.0)

    def deflection(self, x: GridArray, y: GridArray) -> Deflection:
        def closed_form(c, cos_phi, sin_phi):
            # Keeton (2001) for c > 0: one atan and one log per pixel. The offsets from
            # the centre are taken inside the `lax.cond` of `smooth_in_ellipticity`: taken
            # outside, a forward-mode derivative materialises their tangents (the centre's,
            # one constant per tangent) over the whole grid as the cond's operands
            dx, dy = x - self.center_x, y - self.center_y
            q = (1 - c) / (1 + c)
            e_prime = jnp.sqrt((1 - q) * (1 + q))
            xp, yp = rotate(dx, dy, cos_phi, sin_phi)
            inv_w = inv_sqrt_or_zero(q * q * xp * xp + yp * yp)
            b_e = self.theta_E * jnp.sqrt(q) / e_prime
            u = e_prime * yp * inv_w
            ax = b_e * fast_arctan(e_prime * xp * inv_w)
            # fast_atanh keeps relative precision for small u, which the derivative with
            # respect to q near q = 1 needs
            ay = b_e * fast_atanh(u)
            return unrotate(ax, ay, cos_phi, sin_phi)

        return smooth_in_ellipticity(closed_form, self.e1, self.e2)

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
    # F: c^(n+1)/(1-c); derivatives carry an extra factor ~ n (and log n).
    one_minus_c = 1 - c
    if with_derivatives:
        m = (n + 2).astype(c.dtype)
        return m * m * cn * c / (one_minus_c * one_minus_c)
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
        # With derivatives, at least one term: dF/dw at w = 0 is a_1, not 0.
        going = _stop_bound(n, cn, c, with_derivatives) > eps
        if with_derivatives:
            going = going | (n < 1)
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

    bounds: ClassVar[dict[str, tuple[float, float]]] = {
        "theta_E": (0.0, math.inf),
        "gamma": (1.1, 2.9),
        "e1": (-0.6, 0.6),
        "e2": (-0.6, 0.6),
    }

    domain: ClassVar[dict[str, Domain]] = {
        "theta_E": NON_NEGATIVE,
        "gamma": Domain(1.0, 3.0, True, True),
    }

    theta_E: FloatScalar = eqx.field(converter=as_float)
    gamma: FloatScalar = eqx.field(converter=as_float, default=2.0)
    e1: FloatScalar = eqx.field(converter=as_float, default=0.0)
    e2: FloatScalar = eqx.field(converter=as_float, default=0.0)
    center_x: FloatScalar = eqx.field(converter=as_float, default=0.0)
    center_y: FloatScalar = eqx.field(converter=as_float, default=0.0)

    def deflection(self, x: GridArray, y: GridArray) -> Deflection:
        dx, dy = x - self.center_x, y - self.center_y
        e1, e2, t = self.e1, self.e2, self.gamma - 1
        c2 = e1 * e1 + e2 * e2
        c = safe_sqrt(c2)
        # W = z - eps conj(z)
        wr = dx - e1 * dx - e2 * dy
        wi = dy - e2 * dx + e1 * dy
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
        return jnp.where(r2 > 0, k, jnp.inf)
