"""Numerically safe elementary functions and the ellipticity conventions.

Everything here is differentiable with finite gradients at the points where the naive
formula has a removable singularity (r = 0, q = 1).
"""

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from ._custom_types import FloatScalar


def safe_sqrt(x: Float[Array, "*s"], floor: float = 0.0) -> Float[Array, "*s"]:
    """`sqrt(max(x, floor))` with a finite (zero) gradient where `x <= floor`."""
    positive = x > floor
    safe_x = jnp.where(positive, x, jnp.ones_like(x))
    return jnp.where(positive, jnp.sqrt(safe_x), jnp.sqrt(jnp.full_like(x, floor)))


def ellipticity_from_q_phi(q: float, phi: float) -> tuple[float, float]:
    """`(e1, e2) = (1 - q) / (1 + q) * (cos 2 phi, sin 2 phi)`; `phi` in radians, CCW from +x."""
    c = (1.0 - q) / (1.0 + q)
    return c * math.cos(2 * phi), c * math.sin(2 * phi)


def q_phi_from_ellipticity(e1: float, e2: float) -> tuple[float, float]:
    """Axis ratio `q = (1 - c)/(1 + c)`, `c = sqrt(e1^2 + e2^2)`, and position angle
    `phi = atan2(e2, e1) / 2` (radians, CCW from +x): the inverse of `ellipticity_from_q_phi`."""
    c = math.hypot(e1, e2)
    return (1.0 - c) / (1.0 + c), 0.5 * math.atan2(e2, e1)


def orientation(e1: FloatScalar, e2: FloatScalar) -> tuple[FloatScalar, FloatScalar, FloatScalar]:
    """`(c, cos phi, sin phi)` of the major axis, phi = atan2(e2, e1) / 2.

    At `c = 0` the angle is undefined; it is then taken as 0 with zero gradient, which is
    correct for every quantity that is smooth in (e1, e2) once multiplied by a power of `c`.
    Callers that need exact gradients at `c = 0` must use the smooth (e1, e2) forms instead.
    """
    c2 = e1 * e1 + e2 * e2
    nonzero = c2 > 0
    e1s = jnp.where(nonzero, e1, jnp.ones_like(e1))
    e2s = jnp.where(nonzero, e2, jnp.zeros_like(e2))
    phi = 0.5 * jnp.arctan2(e2s, e1s)
    c = safe_sqrt(c2)
    return c, jnp.cos(phi), jnp.sin(phi)


def elliptical_radius_sq(
    dx: Float[Array, "*s"], dy: Float[Array, "*s"], e1: FloatScalar, e2: FloatScalar
) -> Float[Array, "*s"]:
    """`R^2 = q x'^2 + y'^2 / q` (lenstronomy's product-average radius), smooth in (e1, e2).

    With `x', y'` the coordinates along the major and minor axes, `q = (1-c)/(1+c)` and
    `(e1, e2) = c (cos 2phi, sin 2phi)`, this equals

        R^2 = [(1 + c^2) (x^2 + y^2) - 2 e1 (x^2 - y^2) - 4 e2 x y] / (1 - c^2),

    a form with no angle in it: exact gradients at q = 1 and no trigonometric functions.
    """
    c2 = e1 * e1 + e2 * e2
    r2 = dx * dx + dy * dy
    return ((1 + c2) * r2 - 2 * e1 * (dx * dx - dy * dy) - 4 * e2 * dx * dy) / (1 - c2)


def inv_sqrt_or_zero(x: Float[Array, "*s"]) -> Float[Array, "*s"]:
    """`1 / sqrt(x)` for `x > 0`, and 0 (with zero gradient) at `x = 0`.

    Used for unit vectors `d / |d|` at profile centres: the deflection of a cusp is then 0
    at the exact centre (the average over directions) with a finite gradient.
    """
    positive = x > 0
    safe_x = jnp.where(positive, x, jnp.ones_like(x))
    return jnp.where(positive, jax.lax.rsqrt(safe_x), jnp.zeros_like(x))


def _series_atanh_ratio(u: Float[Array, "*s"]) -> Float[Array, "*s"]:
    # sum_k u^k / (2k + 1), k = 0..8: error < |u|^9 / 19 (< 1e-28 for |u| < 1e-3).
    out = jnp.full_like(u, 1.0 / 17.0)
    for k in range(7, -1, -1):
        out = out * u + 1.0 / (2 * k + 1)
    return out


_SERIES_RADIUS = 1e-3


def atanh_ratio_pos(u: Float[Array, "*s"]) -> Float[Array, "*s"]:
    """`G(u) = atanh(sqrt(u)) / sqrt(u)` for `0 <= u < 1`, smooth at `u = 0` (G(0) = 1)."""
    small = u < _SERIES_RADIUS
    us = jnp.where(small, jnp.full_like(u, 0.5), u)
    s = jnp.sqrt(us)
    return jnp.where(small, _series_atanh_ratio(u), jnp.arctanh(s) / s)


def atanh_ratio_neg(u: Float[Array, "*s"]) -> Float[Array, "*s"]:
    """`G(u) = atan(sqrt(-u)) / sqrt(-u)` for `u <= 0`, smooth at `u = 0` (G(0) = 1)."""
    small = u > -_SERIES_RADIUS
    us = jnp.where(small, jnp.full_like(u, -0.5), u)
    s = jnp.sqrt(-us)
    return jnp.where(small, _series_atanh_ratio(u), fast_arctan(s) / s)


def atanh_ratio(u: Float[Array, "*s"]) -> Float[Array, "*s"]:
    """`G(u) = atanh(sqrt(u))/sqrt(u)` for `0 < u < 1`, `atan(sqrt(-u))/sqrt(-u)` for
    `u < 0`: one analytic function of `u` (the hypergeometric 2F1(1/2, 1; 3/2; u))."""
    return jnp.where(u >= 0, atanh_ratio_pos(jnp.maximum(u, 0)), atanh_ratio_neg(jnp.minimum(u, 0)))


def smooth_in_ellipticity(fn, e1: FloatScalar, e2: FloatScalar):
    """Evaluates an elliptical formula written in polar ellipticity `(c, phi)` so that it is
    exact and differentiable in `(e1, e2)` everywhere, including `q = 1`.

    `fn(c, cos_phi, sin_phi)` may assume `c > 0` (closed forms such as `atan(e' t)/e'` with
    `e' = sqrt(1 - q^2)` are then fine). Any such quantity is smooth in `(e1, e2)`, but the
    polar angle is undefined at `c = 0`, where autodiff through `(c, phi)` gives 0 * inf. For
    `c < h/10` (`h = sqrt(eps)`, 1.5e-8 in float64) the result is instead the average of the
    formula at `(e1 + h, e2)` and `(e1 - h, e2)`: equal to the value at `(e1, e2)` to
    `O(h^2)` (round-off) and with gradients with respect to `e1`, `e2` correct to `O(h)`
    (~1e-8 relative), rather than zero or NaN. The choice is a `lax.cond` on the scalar `c`.
    """
    c, cos_phi, sin_phi = orientation(e1, e2)
    h = math.sqrt(float(jnp.finfo(jnp.result_type(c)).eps))

    def polar(_):
        return fn(c, cos_phi, sin_phi)

    def near_round(_):
        # both shifted points have c >= 0.9 h: far from the polar singularity (two calls
        # of fn: batched by vmap over the two shifts, XLA on a CPU ran the SIE's
        # deflection 4x slower, and compiled it no faster)
        plus = fn(*orientation(e1 + h, e2))
        minus = fn(*orientation(e1 - h, e2))
        return jax.tree.map(lambda a, b: 0.5 * (a + b), plus, minus)

    return jax.lax.cond(c >= 0.1 * h, polar, near_round, None)


def rotate(
    x: Float[Array, "*s"], y: Float[Array, "*s"], cos_phi: FloatScalar, sin_phi: FloatScalar
) -> tuple[Float[Array, "*s"], Float[Array, "*s"]]:
    """Coordinates in the frame rotated by `phi` (counter-clockwise): major axis along x'."""
    return cos_phi * x + sin_phi * y, -sin_phi * x + cos_phi * y


def unrotate(
    x: Float[Array, "*s"], y: Float[Array, "*s"], cos_phi: FloatScalar, sin_phi: FloatScalar
) -> tuple[Float[Array, "*s"], Float[Array, "*s"]]:
    """Inverse of `rotate`: vectors from the major-axis frame back to the sky frame."""
    return cos_phi * x - sin_phi * y, sin_phi * x + cos_phi * y


# atan(sqrt(z))/sqrt(z) on 0 <= z <= tan(pi/8)^2: degree-10 polynomial (Chebyshev
# interpolation, computed in 40-digit arithmetic); 1 ulp in float64.
_ATAN_COEFFS = (
    1.0,
    -0.3333333333332844,
    0.1999999999885511,
    -0.14285714180976467,
    0.11111106180455946,
    -0.09090773074808414,
    0.07689953496306857,
    -0.06640233930429408,
    0.056883492268090106,
    -0.04348052215716462,
    0.021135373157693246,
)
_TAN_3PI_8 = 2.414213562373095
_TAN_PI_8 = 0.41421356237309503


@jax.custom_jvp
def fast_arctan(t: Float[Array, "*s"]) -> Float[Array, "*s"]:
    """`arctan(t)` to 1 ulp (float64), several times faster than `jnp.arctan` on CPU.

    Range reduction to |u| <= tan(pi/8) (Cephes-style: t > tan(3pi/8) -> pi/2 + atan(-1/t),
    t > tan(pi/8) -> pi/4 + atan((t-1)/(t+1))), then a degree-10 polynomial in u^2.
    The derivative is `1/(1 + t^2)` (custom JVP, so the branches never leak NaN).
    """
    a = jnp.abs(t)
    big = a > _TAN_3PI_8
    mid = a > _TAN_PI_8
    # one division: u = num / den with the numerator and denominator of the branch
    num = jnp.where(big, -1.0, jnp.where(mid, a - 1, a))
    den = jnp.where(big, a, jnp.where(mid, a + 1, 1.0))
    u = num / den
    y0 = jnp.where(big, 0.5 * math.pi, jnp.where(mid, 0.25 * math.pi, 0.0))
    z = u * u
    p = jnp.full_like(z, _ATAN_COEFFS[-1])
    for c in _ATAN_COEFFS[-2::-1]:
        p = p * z + c
    r = y0 + u * p
    return jnp.where(t < 0, -r, r)


@fast_arctan.defjvp
def _fast_arctan_jvp(primals, tangents):
    (t,), (t_dot,) = primals, tangents
    return fast_arctan(t), t_dot / (1 + t * t)


# 2 atanh(sqrt(z))/sqrt(z) on 0 <= z <= ((sqrt2 - 1)/(sqrt2 + 1))^2: degree-8 polynomial
# (Chebyshev interpolation in 40-digit arithmetic).
_LOG_COEFFS = (
    2.0,
    0.6666666666666666,
    0.40000000000007496,
    0.2857142856881913,
    0.2222222267692954,
    0.18181773738016305,
    0.1538716092613408,
    0.13248763083460116,
    0.13262103674021808,
)
_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10


@jax.custom_jvp
def fast_log(x: Float[Array, "*s"]) -> Float[Array, "*s"]:
    """Natural log of positive, finite, normal `x` to 2 ulp (float64); vectorises on CPU,
    where XLA's float64 `log` does not.

    `x = m 2^e` with `m` in `[sqrt(1/2), sqrt(2))`, `log m = 2 atanh(s)` with
    `s = (m - 1)/(m + 1)` as a polynomial in `s^2`, plus `e ln 2` in two parts. Zero,
    negative, infinite and subnormal inputs are not supported (callers floor their
    arguments). The derivative is `1/x` (custom JVP).
    """
    m, e = jnp.frexp(x)
    low = m < math.sqrt(0.5)
    m = jnp.where(low, 2 * m, m)
    ef = jnp.where(low, e - 1, e).astype(x.dtype)
    s = (m - 1) / (m + 1)
    z = s * s
    p = jnp.full_like(z, _LOG_COEFFS[-1])
    for c in _LOG_COEFFS[-2::-1]:
        p = p * z + c
    return (ef * _LN2_HI + s * p) + ef * _LN2_LO


@fast_log.defjvp
def _fast_log_jvp(primals, tangents):
    (x,), (x_dot,) = primals, tangents
    return fast_log(x), x_dot / x


@jax.custom_jvp
def fast_atanh(u: Float[Array, "*s"]) -> Float[Array, "*s"]:
    """`atanh(u)` for `|u| < 1`: `u sum_k u^(2k)/(2k+1)` for `u^2 < 1e-3` (exact to round-off,
    relative precision for small `u`) and `log((1+u)/(1-u))/2` with `fast_log` otherwise
    (a few ulp). The derivative is `1/(1 - u^2)` (custom JVP)."""
    u2 = u * u
    small = u2 < _SERIES_RADIUS
    us = jnp.where(small, jnp.full_like(u, 0.5), u)
    return jnp.where(small, u * _series_atanh_ratio(u2), 0.5 * fast_log((1 + us) / (1 - us)))


@fast_atanh.defjvp
def _fast_atanh_jvp(primals, tangents):
    (u,), (u_dot,) = primals, tangents
    return fast_atanh(u), u_dot / (1 - u * u)
