"""Numba kernels of the light profiles: basis images per pixel (see `equilens.light`).

Each kernel fills `out[k, i]`, the `k`-th basis function (surface brightness per unit
amplitude) at pixel `i`, with `prange` over the pixels and no fastmath. Private; marked
`no_type_check` (see `_mass_kernels`).
"""

import math
from typing import no_type_check

import numba
import numpy as np

from ._compile_lock import serialise_compilation
from ._mass_kernels import elliptical_radius_sq

_OPTIONS = {"cache": True, "nogil": True, "error_model": "numpy"}
_PARALLEL = {"cache": True, "nogil": True, "parallel": True, "error_model": "numpy"}
_R_MIN = 1e-4  # as `equilens.light._sersic._R_MIN`


@numba.njit(**_PARALLEL)
@no_type_check
def gaussians(x, y, out, sigma, e1, e2, cx, cy):
    """Elliptical Gaussians of total flux 1 and widths `sigma` (shared centre and shape)."""
    for i in numba.prange(x.size):
        r2 = elliptical_radius_sq(x[i] - cx, y[i] - cy, e1, e2)
        for k in range(sigma.size):
            s2 = sigma[k] * sigma[k]
            out[k, i] = math.exp(-r2 / (2 * s2)) / (2 * math.pi * s2)


@numba.njit(**_PARALLEL)
@no_type_check
def sersic(x, y, out, R_sersic, n_sersic, e1, e2, cx, cy):
    b_n = max(1.9992 * n_sersic - 0.3271, 1e-5)
    k = 1 / (2 * n_sersic)
    log_rs2 = 2 * math.log(R_sersic)
    for i in numba.prange(x.size):
        r2 = max(elliptical_radius_sq(x[i] - cx, y[i] - cy, e1, e2), _R_MIN * _R_MIN)
        ratio = math.exp(k * (math.log(r2) - log_rs2))
        out[0, i] = math.exp(-b_n * (ratio - 1))


@numba.njit(**_PARALLEL)
@no_type_check
def core_sersic(x, y, out, R_sersic, Rb, n_sersic, gamma, e1, e2, cx, cy, alpha):
    b_n = max(1.9992 * n_sersic - 0.3271, 1e-5)
    log_rb, log_re = math.log(Rb), math.log(R_sersic)
    a, n = alpha, n_sersic
    rb_a = math.exp(a * log_rb)
    re_a = math.exp(a * log_re)
    for i in numba.prange(x.size):
        r2 = elliptical_radius_sq(x[i] - cx, y[i] - cy, e1, e2)
        log_r = 0.5 * math.log(max(r2, _R_MIN * _R_MIN))
        r_a = math.exp(a * log_r)
        core = math.exp(gamma / a * math.log1p(math.exp(a * (log_rb - log_r))))
        outer = math.exp(math.log((r_a + rb_a) / re_a) / (a * n))
        out[0, i] = core * math.exp(-b_n * (outer - 1))


@numba.njit(**_PARALLEL)
@no_type_check
def shapelets(x, y, out, n_max, beta, cx, cy, n1, n2):
    """Cartesian shapelets `phi_n1(x/beta) phi_n2(y/beta)` in the order of `(n1, n2)`."""
    norm = math.pi**-0.25
    for i in numba.prange(x.size):
        u = (x[i] - cx) / beta
        v = (y[i] - cy) / beta
        hx = np.empty(n_max + 1)
        hy = np.empty(n_max + 1)
        hx[0] = norm * math.exp(-0.5 * u * u)
        hy[0] = norm * math.exp(-0.5 * v * v)
        if n_max >= 1:
            hx[1] = math.sqrt(2.0) * u * hx[0]
            hy[1] = math.sqrt(2.0) * v * hy[0]
        for n in range(1, n_max):
            a, b = math.sqrt(2.0 / (n + 1)), math.sqrt(n / (n + 1))
            hx[n + 1] = a * u * hx[n] - b * hx[n - 1]
            hy[n + 1] = a * v * hy[n] - b * hy[n - 1]
        for k in range(n1.size):
            out[k, i] = hx[n1[k]] * hy[n2[k]]


@numba.njit(**_OPTIONS)
@no_type_check
def _cell(edges, v, uniform, extrapolate):
    # (cell index clipped to the mesh, fractional position in it, clipped to [0, 1] unless
    # `extrapolate`): `_cell` and `_uniform_cell` of `equilens.source._geometry`
    n = edges.size - 1
    if uniform:
        span = edges[n] - edges[0]
        u = (v - edges[0]) * (n / (span if span > 0 else 1.0))
        if math.isnan(u):
            return 0, 0.0
        i = min(max(math.floor(u), 0.0), n - 1.0)
        return int(i), (u - i) if extrapolate else min(max(u - i, 0.0), 1.0)
    i = np.searchsorted(edges, v, side="right") - 1
    i = min(max(i, 0), n - 1)
    lo, hi = edges[i], edges[i + 1]
    width = hi - lo
    t = (v - lo) / (width if width > 0 else 1.0)
    return i, t if extrapolate else min(max(t, 0.0), 1.0)


@numba.njit(**_OPTIONS)
@no_type_check
def _reach(edges, slack, extrapolate):
    # (the interval a rectilinear axis covers, widened by `slack` round-off units):
    # `_on_edges` of `equilens.source._geometry`
    n = edges.size - 1
    lo, hi = edges[0], edges[n]
    if extrapolate:
        lo, hi = lo - 0.5 * (edges[1] - edges[0]), hi + 0.5 * (edges[n] - edges[n - 1])
    s = slack * np.finfo(np.float64).eps * (abs(lo) + abs(hi))
    return lo - s, hi + s


@numba.njit(**_OPTIONS)
@no_type_check
def _bilinear(xs, ys, xi, yi, uniform, extrapolate, rx, ry):
    # (the index of the cell's lower-left node, the weights of its four corners: zero
    # outside the reaches `rx`, `ry` of `_reach`): `RectilinearGeometry.interpolation`
    inside = (xi >= rx[0]) and (xi <= rx[1]) and (yi >= ry[0]) and (yi <= ry[1])
    ix, tx = _cell(xs, xi, uniform, extrapolate)
    iy, ty = _cell(ys, yi, uniform, extrapolate)
    b = iy * xs.size + ix
    if not inside:
        return b, 0.0, 0.0, 0.0, 0.0
    return b, (1 - tx) * (1 - ty), tx * (1 - ty), (1 - tx) * ty, tx * ty


@numba.njit(**_PARALLEL)
@no_type_check
def rectilinear_values(x, y, out, xs, ys, values, uniform, extrapolate, slack):
    """A rectilinear mesh's values interpolated bilinearly at `(x, y)` (0 outside the
    mesh, beyond `slack` times round-off of its edges: `EDGE_SLACK`; extrapolated half a
    spacing beyond its outer nodes if `extrapolate`)."""
    nx = xs.size
    rx, ry = _reach(xs, slack, extrapolate), _reach(ys, slack, extrapolate)
    for i in numba.prange(x.size):
        b, w0, w1, w2, w3 = _bilinear(xs, ys, x[i], y[i], uniform, extrapolate, rx, ry)
        if w0 == 0.0 and w1 == 0.0 and w2 == 0.0 and w3 == 0.0:
            out[0, i] = 0.0
            continue
        out[0, i] = (
            w0 * values[b] + w1 * values[b + 1] + w2 * values[b + nx] + w3 * values[b + nx + 1]
        )


@numba.njit(**_PARALLEL)
@no_type_check
def rectilinear_weights(x, y, idx, w, xs, ys, uniform, extrapolate, slack):
    """The node indices `idx` (`(m, 4)`) and bilinear weights `w` of points `(x, y)` on a
    rectilinear mesh, as `RectilinearGeometry.interpolation` (zero weights outside)."""
    nx = xs.size
    rx, ry = _reach(xs, slack, extrapolate), _reach(ys, slack, extrapolate)
    for i in numba.prange(x.size):
        b, w0, w1, w2, w3 = _bilinear(xs, ys, x[i], y[i], uniform, extrapolate, rx, ry)
        idx[i, 0], idx[i, 1], idx[i, 2], idx[i, 3] = b, b + 1, b + nx, b + nx + 1
        w[i, 0], w[i, 1], w[i, 2], w[i, 3] = w0, w1, w2, w3


serialise_compilation(globals())
