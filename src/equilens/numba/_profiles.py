"""The registered kernels of every final mass and light profile (imported on first use)."""

import functools

import numpy as np

from .. import light as lt, mass as ms
from ..light._shapelets import shapelet_indices
from ..mass._nfw import CSE_A, CSE_S
from ..source import PixelizedSource, RectilinearGeometry, TriangulationGeometry
from ..source._geometry import EDGE_SLACK, barycentric_weights, locate_host
from ..subhalo import Subhalo
from . import _light_kernels as lk, _mass_kernels as mk
from ._registry import (
    _ROWS,
    DEFLECTION,
    HESSIAN,
    JACOBIAN,
    _writable,
    batch_members,
    kernel_intensity,
    kernel_rows,
    register_basis,
    register_intensity,
    register_mass,
    scalar,
    scalar_fields,
    vector,
)
from ._runtime import _LOCK


def _run(kernel, x, y, rows: int, *params) -> np.ndarray:
    # (writable points, whatever the caller traced them with: one compilation per kernel)
    x, y = _writable(x), _writable(y)
    out = np.empty((rows, x.size))
    # Numba's default threading layer must not be entered from two threads at once
    with _LOCK:
        kernel(x, y, out, *params)
    return out


def _mass(cls, kernel):
    # (the kernel takes the class's scalar parameters in the order the class declares them)
    names = scalar_fields(cls)

    def fn(profile, x, y, what):
        params = [scalar(profile, n) for n in names]
        return _run(kernel, x, y, _ROWS[what], *params, what)

    register_mass(cls)(fn)


_mass(ms.SIS, mk.sis)
_mass(ms.SIE, mk.sie)
_mass(ms.EPL, mk.epl)
_mass(ms.NFW, mk.nfw)
_mass(ms.TNFW, mk.tnfw)
_mass(ms.PseudoJaffe, mk.pseudo_jaffe)
_mass(ms.PointMass, mk.point_mass)
_mass(ms.ExternalShear, mk.shear)
_mass(ms.ConvergenceSheet, mk.sheet)

_CSE = (np.asarray(CSE_S, np.float64), np.asarray(CSE_A, np.float64))
_ELLIPTICAL_NFW = scalar_fields(ms.EllipticalNFW)
_MULTIPOLE = scalar_fields(ms.Multipole)


@register_mass(ms.EllipticalNFW)
def _elliptical_nfw(profile, x, y, what):
    params = [scalar(profile, n) for n in _ELLIPTICAL_NFW]
    return _run(mk.elliptical_nfw, x, y, _ROWS[what], *params, *_CSE, what)


@register_mass(ms.Multipole)
def _multipole(profile, x, y, what):
    params = [scalar(profile, n) for n in _MULTIPOLE]
    return _run(mk.multipole, x, y, _ROWS[what], int(profile.m), *params, what)


@register_mass(Subhalo)
def _subhalo(profile, x, y, what):
    # the TNFW or pseudo-Jaffe its mass and cell stand for, by that profile's kernel
    return kernel_rows(profile.profile(), x, y, what)


@register_mass(ms.MassSum)
def _mass_sum(profile, x, y, what):
    return functools.reduce(np.add, [kernel_rows(c, x, y, what) for c in profile.components])


@register_mass(ms.MassBatch)
def _mass_batch(profile, x, y, what):
    members = batch_members(profile)
    if not members:
        return np.zeros((_ROWS[what], x.size))
    return functools.reduce(np.add, [kernel_rows(p, x, y, what) for p in members])


@register_mass(ms.MultiPlane, full_jacobian=True)
def _multi_plane(profile, x, y, what):
    # (the planes' recursion in NumPy, each plane's profiles by their kernels; the module
    # docstring of equilens.mass._multiplane has the equations. The Jacobian is carried
    # through it, forward mode: d(position)/d(theta) and d(angle)/d(theta), 2 x 2 a pixel)
    if what not in (DEFLECTION, JACOBIAN):
        raise NotImplementedError(
            "a MultiPlane has no lensing potential, and its Jacobian is not symmetric: the "
            "Numba backend gives its deflection and its full Jacobian (the JAX hessian's "
            "four components)"
        )
    jacobian = what == JACOBIAN
    px, py = np.zeros_like(x), np.zeros_like(y)
    ax, ay = x.copy(), y.copy()
    # dp[i, j] = d p_i / d theta_j, da likewise (rows x, y; columns by x, by y)
    dp = np.zeros((2, 2, x.size))
    da = np.zeros((2, 2, x.size))
    da[0, 0] = da[1, 1] = 1.0
    planes = profile.components()
    for (_, members), dt, t_i, f in zip(
        planes, profile.steps, profile.to_observer, profile.factors, strict=True
    ):
        px, py = px + ax * dt, py + ay * dt
        xs, ys = px / t_i, py / t_i
        d = np.zeros((2, x.size))
        for m in members:
            d += kernel_rows(m, xs, ys, DEFLECTION)
        ax, ay = ax - f * d[0], ay - f * d[1]
        if jacobian:
            dp += da * dt
            h = np.zeros((3, x.size))
            for m in members:
                h += kernel_rows(m, xs, ys, HESSIAN)
            hm = np.stack([np.stack([h[0], h[1]]), np.stack([h[1], h[2]])])
            # d alpha(p / t_i) = H (dp / t_i)
            da -= (f / t_i) * np.einsum("ikn,kjn->ijn", hm, dp)
    px, py = px + ax * profile.last_step, py + ay * profile.last_step
    if not jacobian:
        return np.stack([x - px / profile.to_source, y - py / profile.to_source])
    dp += da * profile.last_step
    # the deflection theta - beta, beta = p / to_source: its Jacobian I - dp / to_source
    jac = -dp / profile.to_source
    jac[0, 0] += 1.0
    jac[1, 1] += 1.0
    return np.stack([jac[0, 0], jac[0, 1], jac[1, 0], jac[1, 1]])


# (each kernel takes the class's scalar parameters but the amplitude in the order the
# class declares them)
_GAUSSIAN = scalar_fields(lt.Gaussian, but=("amp",))
_MGE = scalar_fields(lt.MGE, but=("amp",))
_SERSIC = scalar_fields(lt.Sersic, but=("amp",))
_CORE_SERSIC = scalar_fields(lt.CoreSersic, but=("amp",))
_SHAPELETS = scalar_fields(lt.Shapelets, but=("amp",))


@register_basis(lt.Gaussian)
def _gaussian(light, x, y):
    sigma, *params = [scalar(light, n) for n in _GAUSSIAN]
    return _run(lk.gaussians, x, y, 1, np.array([sigma]), *params)


@register_basis(lt.MGE)
def _mge(light, x, y):
    sigma = vector(light, "sigma")
    params = [scalar(light, n) for n in _MGE]
    return _run(lk.gaussians, x, y, sigma.size, sigma, *params)


@register_basis(lt.Sersic)
def _sersic(light, x, y):
    return _run(lk.sersic, x, y, 1, *[scalar(light, n) for n in _SERSIC])


@register_basis(lt.CoreSersic)
def _core_sersic(light, x, y):
    return _run(lk.core_sersic, x, y, 1, *[scalar(light, n) for n in _CORE_SERSIC])


@register_basis(lt.Shapelets)
def _shapelets(light, x, y):
    idx = np.asarray(shapelet_indices(light.n_max), np.int64).reshape(-1, 2)
    n1, n2 = np.ascontiguousarray(idx[:, 0]), np.ascontiguousarray(idx[:, 1])
    params = [scalar(light, n) for n in _SHAPELETS]
    return _run(lk.shapelets, x, y, len(idx), int(light.n_max), *params, n1, n2)


@register_intensity(lt.LightSum)
def _light_sum(light, x, y):
    return functools.reduce(np.add, [kernel_intensity(c, x, y) for c in light.components])


@register_intensity(lt.FixedLight)
def _fixed_light(light, x, y):
    return kernel_intensity(light.profile, x, y)


@register_intensity(PixelizedSource)
def _pixelized(light, x, y):
    geometry = object.__getattribute__(light, "geometry")
    values = vector(light, "values")
    if isinstance(geometry, RectilinearGeometry):
        xs, ys = vector(geometry, "xs"), vector(geometry, "ys")
        flags = bool(geometry.uniform), bool(geometry.extrapolate)
        return _run(lk.rectilinear_values, x, y, 1, xs, ys, values, *flags, EDGE_SLACK)[0]
    if isinstance(geometry, TriangulationGeometry):
        # barycentric weights in the triangle (scipy's point location, as the JAX side's
        # host callback); the nearest node outside the convex hull
        points = np.asarray(object.__getattribute__(geometry, "points"), np.float64)
        verts, ok = locate_host(points, x, y)
        w = barycentric_weights(np, points[verts], verts, x, y)
        if int(ok) == 0:
            w = np.full_like(w, np.nan)
        return np.sum(w * values[verts], axis=1)
    raise NotImplementedError(
        f"the Numba backend cannot interpolate a {type(geometry).__name__} source geometry"
    )
