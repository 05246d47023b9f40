"""Numba kernels of the mass profiles: deflection, potential and Hessian per pixel.

Each kernel takes flat float64 coordinate arrays and the profile's parameters as floats,
and runs `prange` over the pixels (no fastmath: the results match the JAX profiles to
round-off). The formulas are those of `equilens.mass` (see each class's docstring);
the Hessians are analytic:

- homogeneous profiles (SIS, SIE, EPL: `psi(s x) = s^(2 - t) psi(x)`, `t = gamma - 1`)
  from Euler's relation `x . grad(alpha_i) = (1 - t) alpha_i` and the trace `2 kappa`,
  which fix the three second derivatives in closed form;
- circular profiles (NFW, point mass) from the mean convergence inside `r`
  (`alpha / r`) and the convergence: `psi_xx = kappa - (kbar - kappa) cos 2phi`, ...;
- the elliptical NFW by differentiating each cored steep ellipsoid's deflection.

Compiled on first use and cached on disk (`cache=True`), with NumPy's error model
(IEEE division: a zero divisor gives inf or NaN, as in JAX, instead of an exception and
a branch per division). The kernels are private and
marked `no_type_check` (the test suite's jaxtyping import hook would otherwise wrap them).
"""

import math
from typing import no_type_check

import numba
import numpy as np

from ._compile_lock import serialise_compilation

_OPTIONS = {"cache": True, "nogil": True, "error_model": "numpy"}
_PARALLEL = {"cache": True, "nogil": True, "parallel": True, "error_model": "numpy"}
_EPS = float(np.finfo(np.float64).eps)
_H = math.sqrt(_EPS)  # the near-round shift of `smooth_in_ellipticity`
_SIE_NEAR_ROUND = _H  # below: G(w) = 1 + w/3 (as `equilens.mass._power_law._sie_g`)
_SERIES_RADIUS = 1e-3
_MAX_TERMS = 2000
_ONE_PLUS_LN_HALF = 1.0 + math.log(0.5)
_X_MIN = 10 * math.sqrt(_EPS)  # NFW: X floored here (as `equilens.mass._nfw._x_min`)


# --------------------------------------------------------------------------------------
# shared scalar helpers
# --------------------------------------------------------------------------------------


@numba.njit(**_OPTIONS)
@no_type_check
def orientation(e1, e2):
    """`(c, cos phi, sin phi)` with `phi = atan2(e2, e1) / 2` (0 at c = 0)."""
    c2 = e1 * e1 + e2 * e2
    if c2 > 0:
        phi = 0.5 * math.atan2(e2, e1)
    else:
        phi = 0.0
    return math.sqrt(c2), math.cos(phi), math.sin(phi)


@numba.njit(**_OPTIONS)
@no_type_check
def elliptical_radius_sq(dx, dy, e1, e2):
    """`q x'^2 + y'^2 / q`, in the angle-free form of `equilens._math`."""
    c2 = e1 * e1 + e2 * e2
    r2 = dx * dx + dy * dy
    return ((1 + c2) * r2 - 2 * e1 * (dx * dx - dy * dy) - 4 * e2 * dx * dy) / (1 - c2)


@numba.njit(**_OPTIONS)
@no_type_check
def _series_atanh_ratio(u):
    out = 1.0 / 17.0
    for k in range(7, -1, -1):
        out = out * u + 1.0 / (2 * k + 1)
    return out


@numba.njit(**_OPTIONS)
@no_type_check
def atanh_ratio(u):
    """`atanh(sqrt u)/sqrt u` for `u > 0`, `atan(sqrt(-u))/sqrt(-u)` for `u < 0`, 1 at 0."""
    if abs(u) < _SERIES_RADIUS:
        return _series_atanh_ratio(u)
    if u > 0:
        s = math.sqrt(u)
        return math.atanh(s) / s
    s = math.sqrt(-u)
    return math.atan(s) / s


@numba.njit(**_OPTIONS)
@no_type_check
def atanh_rel(u):
    """`atanh(u)`, with relative precision for small `u` (as `equilens._math.fast_atanh`)."""
    u2 = u * u
    if u2 < _SERIES_RADIUS:
        return u * _series_atanh_ratio(u2)
    return 0.5 * math.log((1 + u) / (1 - u))


@numba.njit(**_OPTIONS)
@no_type_check
def homogeneous_hessian(dx, dy, ax, ay, kappa, t):
    """`(psi_xx, psi_xy, psi_yy)` of a potential homogeneous of degree `2 - t` about the
    centre, from its deflection and convergence (Euler's relation); 0 at the centre."""
    r2 = dx * dx + dy * dy
    if r2 == 0:
        return 0.0, 0.0, 0.0
    s = 1 - t
    b = s * ay - 2 * kappa * dy
    f_xx = (dx * s * ax - dy * b) / r2
    f_xy = (dy * s * ax + dx * b) / r2
    return f_xx, f_xy, 2 * kappa - f_xx


@numba.njit(**_OPTIONS)
@no_type_check
def circular_hessian(dx, dy, kbar, kappa):
    """`(psi_xx, psi_xy, psi_yy)` of a circular profile from the mean convergence inside
    `r` (`kbar = alpha / r`) and the convergence at `r`."""
    r2 = dx * dx + dy * dy
    if r2 == 0:
        return 0.0, 0.0, 0.0
    g = kbar - kappa
    cos2 = (dx * dx - dy * dy) / r2
    sin2 = 2 * dx * dy / r2
    return kappa - g * cos2, -g * sin2, kappa + g * cos2


# --------------------------------------------------------------------------------------
# SIS
# --------------------------------------------------------------------------------------


@numba.njit(**_PARALLEL)
@no_type_check
def sis(x, y, out, theta_E, cx, cy, what):
    """`what`: 0 deflection (out[0:2]), 1 potential (out[0]), 2 Hessian (out[0:3])."""
    for i in numba.prange(x.size):
        dx, dy = x[i] - cx, y[i] - cy
        r2 = dx * dx + dy * dy
        r = math.sqrt(r2)
        inv_r = 1 / r if r2 > 0 else 0.0
        if what == 0:
            out[0, i] = theta_E * dx * inv_r
            out[1, i] = theta_E * dy * inv_r
        elif what == 1:
            out[0, i] = theta_E * r
        else:
            k = theta_E * inv_r * inv_r * inv_r
            out[0, i] = k * dy * dy
            out[1, i] = -k * dx * dy
            out[2, i] = k * dx * dx


# --------------------------------------------------------------------------------------
# SIE (Keeton 2001 closed form; its angle-free limit next to q = 1)
# --------------------------------------------------------------------------------------


@numba.njit(**_OPTIONS)
@no_type_check
def _sie_constants(theta_E, c):
    # (q, e' = sqrt(1 - q^2), theta_E sqrt(q) / e') of the closed form (c > 0)
    q = (1 - c) / (1 + c)
    e_prime = math.sqrt((1 - q) * (1 + q))
    return q, e_prime, theta_E * math.sqrt(q) / e_prime


@numba.njit(**_OPTIONS)
@no_type_check
def _sie_polar(dx, dy, q, e_prime, b_e, cp, sp):
    xp = cp * dx + sp * dy
    yp = -sp * dx + cp * dy
    w2 = q * q * xp * xp + yp * yp
    inv_w = 1 / math.sqrt(w2) if w2 > 0 else 0.0
    ax = b_e * math.atan(e_prime * xp * inv_w)
    ay = b_e * atanh_rel(e_prime * yp * inv_w)
    return cp * ax - sp * ay, sp * ax + cp * ay


@numba.njit(**_OPTIONS)
@no_type_check
def _sie_near_round(dx, dy, theta_E, e1, e2):
    # the angle-free form of `equilens.mass.SIE` at c < sqrt(eps), where G(w) = 1 + w/3
    wr = dx - e1 * dx - e2 * dy
    wi = dy - e2 * dx + e1 * dy
    m2 = wr * wr + wi * wi
    inv_m = 1 / math.sqrt(m2) if m2 > 0 else 0.0
    ur, ui = wr * inv_m, wi * inv_m
    pr, pi = ur * ur - ui * ui, 2 * ur * ui
    ar = -(e1 * pr + e2 * pi)
    ai = -(e1 * pi - e2 * pr)
    gr, gi = 1 + ar / 3, ai / 3
    amp = theta_E * math.sqrt(1 - (e1 * e1 + e2 * e2))
    return amp * (ur * gr - ui * gi), amp * (ur * gi + ui * gr)


@numba.njit(**_PARALLEL)
@no_type_check
def sie(x, y, out, theta_E, e1, e2, cx, cy, what):
    # Keeton's closed form, and next to q = 1 its angle-free limit (as `equilens.mass.SIE`)
    c, cp, sp = orientation(e1, e2)
    near_round = c < _SIE_NEAR_ROUND
    if near_round:
        c, cp, sp = 0.5, 1.0, 0.0  # unused
    q, e_prime, b_e = _sie_constants(theta_E, c)
    for i in numba.prange(x.size):
        dx, dy = x[i] - cx, y[i] - cy
        if near_round:
            ax, ay = _sie_near_round(dx, dy, theta_E, e1, e2)
        else:
            ax, ay = _sie_polar(dx, dy, q, e_prime, b_e, cp, sp)
        if what == 0:
            out[0, i] = ax
            out[1, i] = ay
        elif what == 1:
            out[0, i] = dx * ax + dy * ay
        else:
            r2 = elliptical_radius_sq(dx, dy, e1, e2)
            kappa = 0.5 * theta_E / math.sqrt(r2) if r2 > 0 else 0.0
            out[0, i], out[1, i], out[2, i] = homogeneous_hessian(dx, dy, ax, ay, kappa, 1.0)


# --------------------------------------------------------------------------------------
# EPL (Tessore & Metcalf 2015 series, in the angle-free form of `equilens.mass.EPL`)
# --------------------------------------------------------------------------------------


@numba.njit(**_OPTIONS)
@no_type_check
def _epl_hyp2f1(wr, wi, t, c):
    eps = 0.25 * _EPS
    tr, ti = 1.0, 0.0
    fr, fi = 1.0, 0.0
    cn = 1.0
    n = 0
    one_minus_c = 1 - c
    while n < _MAX_TERMS and cn * c / one_minus_c > eps:
        ratio = (2 * n + t) / (2 * n + 4 - t)
        tr, ti = ratio * (tr * wr - ti * wi), ratio * (tr * wi + ti * wr)
        fr += tr
        fi += ti
        cn *= c
        n += 1
    return fr, fi


@numba.njit(**_OPTIONS)
@no_type_check
def epl_deflection_at(dx, dy, theta_E, t, e1, e2):
    c2 = e1 * e1 + e2 * e2
    c = math.sqrt(c2)
    wr = dx - e1 * dx - e2 * dy
    wi = dy - e2 * dx + e1 * dy
    w2 = wr * wr + wi * wi
    if w2 <= 0:
        return 0.0, 0.0
    pr, pi = wr * wr - wi * wi, 2 * wr * wi
    ar = -(e1 * pr + e2 * pi) / w2
    ai = -(e1 * pi - e2 * pr) / w2
    fr, fi = _epl_hyp2f1(ar, ai, t, c)
    log_amp = t * (math.log(theta_E) + 0.5 * math.log1p(-c2))
    scale = math.exp(log_amp - 0.5 * t * math.log(w2))
    return scale * (wr * fr - wi * fi), scale * (wr * fi + wi * fr)


@numba.njit(**_PARALLEL)
@no_type_check
def epl(x, y, out, theta_E, gamma, e1, e2, cx, cy, what):
    t = gamma - 1
    for i in numba.prange(x.size):
        dx, dy = x[i] - cx, y[i] - cy
        ax, ay = epl_deflection_at(dx, dy, theta_E, t, e1, e2)
        if what == 0:
            out[0, i] = ax
            out[1, i] = ay
        elif what == 1:
            out[0, i] = (dx * ax + dy * ay) / (3 - gamma)
        else:
            r2 = elliptical_radius_sq(dx, dy, e1, e2)
            kappa = 0.0
            if r2 > 0:
                kappa = (2 - t) / 2 * math.exp(t * (math.log(theta_E) - 0.5 * math.log(r2)))
            out[0, i], out[1, i], out[2, i] = homogeneous_hessian(dx, dy, ax, ay, kappa, t)


# --------------------------------------------------------------------------------------
# NFW (spherical)
# --------------------------------------------------------------------------------------


@numba.njit(**_OPTIONS)
@no_type_check
def _nfw_g_over_x2(X2):
    if X2 < 0.25:
        su = math.sqrt(1 - X2)
        return -0.5 * math.log(X2 / 4) / (su * (1 + su)) + math.log1p(-X2 / (2 * (1 + su))) / (
            su * X2
        )
    return (0.5 * math.log(X2 / 4) + atanh_ratio(1 - X2)) / X2


@numba.njit(**_OPTIONS)
@no_type_check
def _nfw_G(X2):
    """`G(1 - X^2)` with full relative precision at small `X` (as `equilens.mass._nfw`)."""
    if X2 < 0.25:
        su = math.sqrt(1 - X2)
        return (math.log1p(su) - 0.5 * math.log(X2)) / su
    return atanh_ratio(1 - X2)


@numba.njit(**_OPTIONS)
@no_type_check
def _nfw_F(X2):
    u = 1 - X2
    if abs(u) < 1e-3:
        series = 1.0 / 15.0
        for k in range(6, 0, -1):
            series = series * u + 1.0 / (2 * k + 1)
        return series
    return (_nfw_G(X2) - 1) / u


@numba.njit(**_PARALLEL)
@no_type_check
def nfw(x, y, out, Rs, alpha_Rs, cx, cy, what):
    amp = alpha_Rs / (Rs * _ONE_PLUS_LN_HALF)
    for i in numba.prange(x.size):
        dx, dy = x[i] - cx, y[i] - cy
        X2 = max((dx * dx + dy * dy) / (Rs * Rs), _X_MIN * _X_MIN)
        if what == 0:
            a = amp * _nfw_g_over_x2(X2)
            out[0, i] = a * dx
            out[1, i] = a * dy
        elif what == 1:
            u = 1 - X2
            G = atanh_ratio(u)
            h = 0.25 * math.log(X2 / 4) ** 2 - u * G * G
            out[0, i] = alpha_Rs * Rs / (2 * _ONE_PLUS_LN_HALF) * h
        else:
            kbar = amp * _nfw_g_over_x2(X2)
            kappa = 0.5 * amp * _nfw_F(X2)
            out[0, i], out[1, i], out[2, i] = circular_hessian(dx, dy, kbar, kappa)


# --------------------------------------------------------------------------------------
# Truncated NFW (Baltz, Marshall & Oguri 2009), as equilens.mass._subhalo
# --------------------------------------------------------------------------------------

_LN2 = math.log(2.0)


@numba.njit(**_OPTIONS)
@no_type_check
def _tnfw_g_over_x2(X2, t):
    t2 = t * t
    pre = t2 / ((t2 + 1) * (t2 + 1))
    if X2 < 0.25:
        su = math.sqrt(1 - X2)
        s = math.sqrt(t2 + X2)
        c = (t2 - 1) / (t * (s + t)) - (t2 - 1) / (su * (1 + su)) - 2 / su
        d = (
            math.log1p(-X2 / (2 * (1 + su))) / (su * X2)
            + _LN2 / (su * (1 + su))
            - math.log1p(X2 / (2 * t * (s + t))) / X2
            - math.log(t + s) / (t * (s + t))
        )
        small = 0.5 * math.log(X2) * c + (t2 - 1) * d + 2 * math.log1p(su) / su
        return pre * (small - math.pi / (t + s))
    s = math.sqrt(t2 + X2)
    L = 0.5 * math.log(X2) - math.log(t + s)
    g = (
        (t2 + 1 + 2 * (X2 - 1)) * atanh_ratio(1 - X2)
        + math.pi * t
        + (t2 - 1) * math.log(t)
        + s * (-math.pi + (t2 - 1) * L / t)
    )
    return pre * g / X2


@numba.njit(**_OPTIONS)
@no_type_check
def _tnfw_F(X2, t):
    t2 = t * t
    s = math.sqrt(t2 + X2)
    L = 0.5 * math.log(X2) - math.log(t + s)
    inner = (t2 + 1) * _nfw_F(X2) + 2 * _nfw_G(X2) - math.pi / s + (t2 - 1) * L / (t * s)
    return t2 / ((t2 + 1) * (t2 + 1)) * inner


@numba.njit(**_OPTIONS)
@no_type_check
def _tnfw_h(X2, t):
    t2 = t * t
    s = math.sqrt(t2 + X2)
    L = 0.5 * math.log(X2) - math.log(t + s)
    u = 1 - X2
    G = _nfw_G(X2)
    ln_t = math.log(t)
    h = (
        2 * t2 * math.pi * (t - s + t * math.log(t + s))
        + 2 * (t2 - 1) * t * s * L
        + t2 * (t2 - 1) * L * L
        + 4 * t2 * (X2 - 1) * G
        - t2 * (t2 - 1) * u * G * G
        + t2 * ((t2 - 1) * ln_t - t2 - 1) * math.log(X2)
        - t2
        * (
            (t2 - 1) * ln_t * math.log(4 * t)
            + 2 * math.log(0.5 * t)
            - 2 * t * (t - math.pi) * math.log(2 * t)
        )
    )
    return h / ((t2 + 1) * (t2 + 1))


@numba.njit(**_PARALLEL)
@no_type_check
def tnfw(x, y, out, Rs, alpha_Rs, r_trunc, cx, cy, what):
    amp = alpha_Rs / (Rs * _ONE_PLUS_LN_HALF)
    t = r_trunc / Rs
    for i in numba.prange(x.size):
        dx, dy = x[i] - cx, y[i] - cy
        X2 = max((dx * dx + dy * dy) / (Rs * Rs), _X_MIN * _X_MIN)
        if what == 0:
            a = amp * _tnfw_g_over_x2(X2, t)
            out[0, i] = a * dx
            out[1, i] = a * dy
        elif what == 1:
            out[0, i] = alpha_Rs * Rs / (2 * _ONE_PLUS_LN_HALF) * _tnfw_h(X2, t)
        else:
            # (the radius floored as in the JAX profile: the convergence at the centre)
            kappa = 0.5 * amp * _tnfw_F(X2, t)
            gamma = (amp * _tnfw_g_over_x2(X2, t) - kappa) / (X2 * Rs * Rs)
            out[0, i] = kappa + gamma * (dy * dy - dx * dx)
            out[1, i] = -2 * gamma * dx * dy
            out[2, i] = kappa - gamma * (dy * dy - dx * dx)


# --------------------------------------------------------------------------------------
# Pseudo-Jaffe sphere, as equilens.mass._subhalo (divided differences written out)
# --------------------------------------------------------------------------------------


@numba.njit(**_PARALLEL)
@no_type_check
def pseudo_jaffe(x, y, out, sigma0, a, b, cx, cy, what):
    for i in numba.prange(x.size):
        dx, dy = x[i] - cx, y[i] - cy
        r2 = dx * dx + dy * dy
        sa, sb = math.sqrt(a * a + r2), math.sqrt(b * b + r2)
        d1 = (a + b) / (sa + sb)
        if what == 0:
            k = 2 * sigma0 * a * b * (1 + d1) / ((a + sa) * (b + sb))
            out[0, i] = k * dx
            out[1, i] = k * dy
        elif what == 1:
            w = (1 + d1) / (a + sa)
            z = (b - a) * w
            ratio = 1 - z / 2 + z * z / 3 if abs(z) < 1e-4 else math.log1p(z) / z
            out[0, i] = -2 * sigma0 * a * b * (d1 - a * w * ratio - math.log(b + sb))
        else:
            du = (
                b * b * d1
                + sa * (a + b)
                + 2 * b * (a + b)
                + 2 * sa * sa
                + d1 * (sb * sb + sa * sb + sa * sa)
            )
            g = sigma0 * a * b * du / (sa * (a + sa) ** 2 * sb * (b + sb) ** 2)
            kappa = sigma0 * a * b * d1 / (sa * sb)
            out[0, i] = kappa + g * (dy * dy - dx * dx)
            out[1, i] = -2 * g * dx * dy
            out[2, i] = kappa - g * (dy * dy - dx * dx)


# --------------------------------------------------------------------------------------
# Elliptical NFW: a sum of cored steep ellipsoids (Oguri 2021)
# --------------------------------------------------------------------------------------


@numba.njit(**_OPTIONS)
@no_type_check
def _cse_polar(dx, dy, Rs, norm, c, cp, sp, s_all, a_all, what):
    q = (1 - c) / (1 + c)
    xp = cp * dx + sp * dy
    yp = -sp * dx + cp * dy
    root_q = math.sqrt(q)
    u = root_q * xp / Rs
    v = root_q * yp / Rs
    q2 = q * q
    f0 = 0.0
    f1 = 0.0
    f2 = 0.0
    for k in range(s_all.size):
        s, a = s_all[k], a_all[k]
        psi = math.sqrt(q2 * (s * s + u * u) + v * v)
        Phi = (psi + s) ** 2 + (1 - q2) * u * u
        if what == 1:
            f0 += (a / q) * (q / (2 * s) * math.log(Phi) - q / s * math.log((1 + q) * s))
            continue
        common = (a / s) * (1 / psi) * (1 / Phi)
        nu = psi + q2 * s
        nv = psi + s
        if what == 0:
            f0 += common * u * nu
            f1 += common * v * nv
            continue
        # second derivatives of fu = K u nu / (psi Phi), fv = K v nv / (psi Phi)
        psi_u, psi_v = q2 * u / psi, v / psi
        phi_u = 2 * nv * psi_u + 2 * (1 - q2) * u
        phi_v = 2 * nv * psi_v
        d_u = psi_u / psi + phi_u / Phi  # d log(psi Phi) / du
        d_v = psi_v / psi + phi_v / Phi
        f0 += common * (nu + u * psi_u - u * nu * d_u)  # d fu / du
        f1 += common * u * (psi_v - nu * d_v)  # d fu / dv
        f2 += common * (nv + v * psi_v - v * nv * d_v)  # d fv / dv
    if what == 1:
        return norm * f0, 0.0, 0.0
    if what == 0:
        fx = norm / Rs * root_q * f0
        fy = norm / Rs * root_q * f1
        return cp * fx - sp * fy, sp * fx + cp * fy, 0.0
    k = norm * q / (Rs * Rs)
    hxx, hxy, hyy = k * f0, k * f1, k * f2
    # H = R H' R^T with R the rotation by phi
    c2, s2, cs = cp * cp, sp * sp, cp * sp
    return (
        c2 * hxx - 2 * cs * hxy + s2 * hyy,
        cs * (hxx - hyy) + (c2 - s2) * hxy,
        s2 * hxx + 2 * cs * hxy + c2 * hyy,
    )


@numba.njit(**_PARALLEL)
@no_type_check
def elliptical_nfw(x, y, out, Rs, alpha_Rs, e1, e2, cx, cy, s_all, a_all, what):
    norm = alpha_Rs * Rs / _ONE_PLUS_LN_HALF
    c, cp, sp = orientation(e1, e2)
    round_ = c < 0.1 * _H
    c_p, cp_p, sp_p = orientation(e1 + _H, e2)
    c_m, cp_m, sp_m = orientation(e1 - _H, e2)
    n_out = 2 if what == 0 else (1 if what == 1 else 3)
    for i in numba.prange(x.size):
        dx, dy = x[i] - cx, y[i] - cy
        if round_:
            a0, a1, a2 = _cse_polar(dx, dy, Rs, norm, c_p, cp_p, sp_p, s_all, a_all, what)
            b0, b1, b2 = _cse_polar(dx, dy, Rs, norm, c_m, cp_m, sp_m, s_all, a_all, what)
            r = (0.5 * (a0 + b0), 0.5 * (a1 + b1), 0.5 * (a2 + b2))
        else:
            r = _cse_polar(dx, dy, Rs, norm, c, cp, sp, s_all, a_all, what)
        for j in range(n_out):
            out[j, i] = r[j]


# --------------------------------------------------------------------------------------
# point mass, shear, sheet, multipole
# --------------------------------------------------------------------------------------


@numba.njit(**_PARALLEL)
@no_type_check
def point_mass(x, y, out, theta_E, cx, cy, what):
    t2 = theta_E * theta_E
    tiny = np.finfo(np.float64).tiny
    for i in numba.prange(x.size):
        dx, dy = x[i] - cx, y[i] - cy
        r2 = dx * dx + dy * dy
        inv_r2 = 1 / r2 if r2 > 0 else 0.0
        if what == 0:
            out[0, i] = t2 * inv_r2 * dx
            out[1, i] = t2 * inv_r2 * dy
        elif what == 1:
            out[0, i] = 0.5 * t2 * math.log(max(r2, tiny))
        else:
            out[0, i], out[1, i], out[2, i] = circular_hessian(dx, dy, t2 * inv_r2, 0.0)


@numba.njit(**_PARALLEL)
@no_type_check
def shear(x, y, out, gamma1, gamma2, ra_0, dec_0, what):
    for i in numba.prange(x.size):
        dx, dy = x[i] - ra_0, y[i] - dec_0
        if what == 0:
            out[0, i] = gamma1 * dx + gamma2 * dy
            out[1, i] = gamma2 * dx - gamma1 * dy
        elif what == 1:
            out[0, i] = 0.5 * (gamma1 * (dx * dx - dy * dy) + 2 * gamma2 * dx * dy)
        else:
            out[0, i] = gamma1
            out[1, i] = gamma2
            out[2, i] = -gamma1


@numba.njit(**_PARALLEL)
@no_type_check
def sheet(x, y, out, kappa, ra_0, dec_0, what):
    for i in numba.prange(x.size):
        dx, dy = x[i] - ra_0, y[i] - dec_0
        if what == 0:
            out[0, i] = kappa * dx
            out[1, i] = kappa * dy
        elif what == 1:
            out[0, i] = 0.5 * kappa * (dx * dx + dy * dy)
        else:
            out[0, i] = kappa
            out[1, i] = 0.0
            out[2, i] = kappa


@numba.njit(**_PARALLEL)
@no_type_check
def multipole(x, y, out, m, a_m, phi_m, cx, cy, r_E, what):
    cpm, spm = math.cos(m * phi_m), math.sin(m * phi_m)
    c_phi, s_phi = math.cos(phi_m), math.sin(phi_m)
    for i in numba.prange(x.size):
        dx, dy = x[i] - cx, y[i] - cy
        r2 = dx * dx + dy * dy
        r = math.sqrt(r2)
        inv_r = 1 / r if r2 > 0 else 0.0
        c1 = dx * inv_r if r2 > 0 else 1.0
        s1 = dy * inv_r
        cm, sm = c1, s1
        for _ in range(m - 1):
            cm, sm = cm * c1 - sm * s1, cm * s1 + sm * c1
        cos_m = cm * cpm + sm * spm
        sin_m = sm * cpm - cm * spm
        if m == 1:
            log_r = math.log(max(r, 1e-6) / r_E)
            if what == 0:
                out[0, i] = a_m / 2 * (c_phi * log_r + cos_m * c1)
                out[1, i] = a_m / 2 * (s_phi * log_r + cos_m * s1)
            elif what == 1:
                out[0, i] = a_m / 2 * r * log_r * cos_m
            elif r2 > 0:
                # psi = a/2 ln(r/r_E) L, L = x cos(phi_m) + y sin(phi_m)
                lin = dx * c_phi + dy * s_phi
                inv_r4 = inv_r * inv_r * inv_r * inv_r
                h = a_m / 2
                out[0, i] = h * (
                    (2 * c_phi * dx + lin) * inv_r * inv_r - 2 * lin * dx * dx * inv_r4
                )
                out[1, i] = h * (
                    (s_phi * dx + c_phi * dy) * inv_r * inv_r - 2 * lin * dx * dy * inv_r4
                )
                out[2, i] = h * (
                    (2 * s_phi * dy + lin) * inv_r * inv_r - 2 * lin * dy * dy * inv_r4
                )
            else:
                out[0, i] = 0.0
                out[1, i] = 0.0
                out[2, i] = 0.0
        else:
            k = a_m / (1 - m * m)
            if what == 0:
                out[0, i] = k * (c1 * cos_m + m * s1 * sin_m)
                out[1, i] = k * (s1 * cos_m - m * c1 * sin_m)
            elif what == 1:
                out[0, i] = k * r * cos_m
            else:
                # psi = r F(phi): the Hessian is (F + F'') / r e_phi e_phi^T
                g = a_m * cos_m * inv_r
                out[0, i] = g * s1 * s1
                out[1, i] = -g * s1 * c1
                out[2, i] = g * c1 * c1


serialise_compilation(globals())
