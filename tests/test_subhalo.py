"""Subhalo profiles against independent references: the truncated NFW's closed forms
against a 50-digit evaluation (mpmath), its limits (the NFW for a far truncation, a finite
total mass), and finite derivatives at the centre and at the truncation radius; the
pseudo-Jaffe's symmetry in its radii, its smoothness at Ra = Rs and at the centre, its
central convergence and total mass (the lenstronomy comparisons are in
test_crosscheck.py)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from equilens import mass
from equilens.mass._subhalo import _tnfw_F, _tnfw_g_over_x2
from helpers import default_eps, rel_err

X64 = jax.config.read("jax_enable_x64")


def _reference(X, t):
    """`g(X) / X^2` and the convergence over `2 rho0 Rs` (module docstring of
    equilens.mass._subhalo), in 50-digit arithmetic."""
    mp = pytest.importorskip("mpmath")
    mp.mp.dps = 50
    X, t = mp.mpf(X), mp.mpf(t)
    u = 1 - X * X
    if u > 0:
        G = mp.atanh(mp.sqrt(u)) / mp.sqrt(u)
    elif u < 0:
        G = mp.atan(mp.sqrt(-u)) / mp.sqrt(-u)
    else:
        G = mp.mpf(1)
    s = mp.sqrt(t * t + X * X)
    L = mp.log(X / (t + s))
    pre = t * t / (t * t + 1) ** 2
    g = pre * (
        (t * t + 1 + 2 * (X * X - 1)) * G
        + mp.pi * t
        + (t * t - 1) * mp.log(t)
        + s * (-mp.pi + (t * t - 1) * L / t)
    )
    nfw_F = (1 - G) / (X * X - 1) if u != 0 else mp.mpf(1) / 3
    F = pre * ((t * t + 1) * nfw_F + 2 * G - mp.pi / s + (t * t - 1) * L / (t * s))
    return float(g / (X * X)), float(F)


@pytest.mark.x64_only
@pytest.mark.parametrize("t", [0.1, 1.0, 7.0, 300.0])
def test_tnfw_closed_forms_match_a_50_digit_evaluation(t):
    # from 1e-6 Rs (where the terms of g cancel to X^2 ln X) to 1e3 Rs, through X = 1/2
    # (the two forms of g) and X = 1 (the NFW function's series)
    xs = [1e-6, 1e-3, 0.05, 0.4999999, 0.5, 0.5000001, 0.9999999, 1.0, 1.0000001, 3.0, 1e3]
    for X in xs:
        g_ref, F_ref = _reference(X, t)
        X2, tt = jnp.asarray(X * X), jnp.asarray(t)
        assert float(_tnfw_g_over_x2(X2, tt)) == pytest.approx(g_ref, rel=1e-13), X
        # (the convergence's terms cancel to X^-4 far outside the truncation: relative
        # precision eps X^3 there)
        assert float(_tnfw_F(X2, tt)) == pytest.approx(F_ref, rel=1e-13 * max(1.0, X**3)), X


def test_tnfw_far_truncation_is_the_nfw_and_its_mass_is_finite():
    Rs, alpha_Rs = 0.5, 0.2
    x = jnp.linspace(0.05, 2.0, 40)
    y = 0.3 * x
    nfw = mass.NFW(Rs=Rs, alpha_Rs=alpha_Rs)
    far = mass.TNFW(Rs=Rs, alpha_Rs=alpha_Rs, r_trunc=1e4 * Rs)
    # the truncation's effect inside R ~ Rs is of order (R / r_trunc)^2 ln (r_trunc / R)
    near = 1e-6 if X64 else 5e-5
    assert rel_err(far.deflection(x, y)[0], nfw.deflection(x, y)[0]) < near
    assert rel_err(far.convergence(x, y), nfw.convergence(x, y)) < near
    # a truncated halo's deflection falls as M / (pi R): alpha R tends to the total mass
    # over pi (Baltz et al. 2009: 4 pi rho0 Rs^3 t^2 ((t^2 - 1) ln t + pi t - (t^2 + 1))
    # / (t^2 + 1)^2, here in units of Sigma_crit arcsec^2)
    t = 2.0
    p = mass.TNFW(Rs=Rs, alpha_Rs=alpha_Rs, r_trunc=t * Rs)
    # (far out the deflection's terms cancel to eps R / Rs: float32 stops at 100 Rs)
    r = jnp.asarray([1e3, 1e4] if X64 else [1e1, 1e2]) * Rs
    alpha_r = p.deflection(r, jnp.zeros_like(r))[0] * r
    rho0 = alpha_Rs / (4 * Rs**2 * (1 + math.log(0.5)))
    m = 4 * rho0 * Rs**3 * t**2 * ((t**2 - 1) * math.log(t) + math.pi * t - (t**2 + 1))
    m = m / (t**2 + 1) ** 2
    tol = 1e-5 if X64 else 2e-3
    assert float(alpha_r[1]) == pytest.approx(m, rel=tol)
    assert abs(float(m - alpha_r[1])) < abs(float(m - alpha_r[0]))


@pytest.mark.parametrize("where", ["centre", "truncation"])
def test_tnfw_derivatives_are_finite_at_the_centre_and_the_truncation_radius(where):
    p = mass.TNFW(Rs=0.3, alpha_Rs=0.1, r_trunc=0.9, center_x=0.1, center_y=-0.2)
    r = 0.0 if where == "centre" else 0.9
    x0, y0 = jnp.asarray(0.1 + r), jnp.asarray(-0.2)

    def total(profile, x, y):
        ax, ay = profile.deflection(x, y)
        h = profile.hessian(x, y)
        return ax + ay + profile.potential(x, y) + profile.convergence(x, y) + sum(h)

    value = total(p, x0, y0)
    grads = jax.grad(total, argnums=(0, 1, 2))(p, x0, y0)
    leaves = [value, *jax.tree.leaves(grads)]
    assert all(bool(jnp.all(jnp.isfinite(v))) for v in leaves)
    # the derivatives with respect to the parameters against finite differences (away
    # from the centre's floored radius)
    if where == "truncation":
        g = grads[0]
        for name in ("Rs", "alpha_Rs", "r_trunc"):
            h = 1e-6 if X64 else 1e-2
            v = float(getattr(p, name))
            up = p.__class__(**{**_fields(p), name: v * (1 + h)})
            down = p.__class__(**{**_fields(p), name: v * (1 - h)})
            fd = (float(total(up, x0, y0)) - float(total(down, x0, y0))) / (2 * h * v)
            tol = 1e-6 if X64 else 5e-2
            assert float(getattr(g, name)) == pytest.approx(fd, rel=tol, abs=tol), name


def _fields(p):
    return {n: float(getattr(p, n)) for n in ("Rs", "alpha_Rs", "r_trunc", "center_x", "center_y")}


def test_tnfw_values_are_checked_where_they_enter():
    with pytest.raises(ValueError, match=r"TNFW\.r_trunc must be finite and in \(0, inf\)"):
        mass.TNFW(Rs=0.3, alpha_Rs=0.1, r_trunc=0.0)
    with pytest.raises(ValueError, match=r"TNFW\.Rs must be finite and in \(0, inf\)"):
        mass.TNFW(Rs=-0.3, alpha_Rs=0.1, r_trunc=1.0)
    # a profile of no mass is allowed (a subhalo switched off), and deflects nothing
    zero = mass.TNFW(Rs=0.3, alpha_Rs=0.0, r_trunc=1.0)
    assert float(jnp.max(jnp.abs(zero.deflection(jnp.ones(3), jnp.ones(3))[0]))) == 0.0
    assert np.isfinite(default_eps())


def test_pseudo_jaffe_is_symmetric_smooth_at_ra_equal_rs_and_has_its_total_mass():
    x = jnp.asarray([0.0, 0.01, 0.3, 2.0, -5.0])
    y = jnp.asarray([0.0, 0.0, 0.1, -1.0, 3.0])
    p = mass.PseudoJaffe(sigma0=0.7, Ra=0.1, Rs=0.8, center_x=0.0, center_y=0.0)
    swapped = mass.PseudoJaffe(sigma0=0.7, Ra=0.8, Rs=0.1, center_x=0.0, center_y=0.0)
    for fn in ("deflection", "potential", "convergence", "hessian"):
        a, b = getattr(p, fn)(x, y), getattr(swapped, fn)(x, y)
        for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            assert rel_err(u, v) < 1e3 * default_eps(), fn
    # the central convergence is sigma0; the total mass 2 pi sigma0 Ra Rs (alpha R -> M/pi)
    assert float(p.convergence(jnp.zeros(()), jnp.zeros(()))) == pytest.approx(0.7, rel=1e-6)
    far = jnp.asarray(1e4 if X64 else 1e2)
    alpha_r = float(p.deflection(far, jnp.zeros(()))[0] * far)
    # (the mass outside R falls as Rs / R)
    assert alpha_r == pytest.approx(2 * 0.7 * 0.1 * 0.8, rel=2 * 0.8 / float(far))
    # Ra = Rs has no division by Rs - Ra: continuous with its neighbours
    equal = mass.PseudoJaffe(sigma0=0.7, Ra=0.3, Rs=0.3)
    near = mass.PseudoJaffe(sigma0=0.7, Ra=0.3, Rs=0.3 * (1 + 1e-6))
    for fn in ("deflection", "potential", "convergence", "hessian"):
        a, b = getattr(equal, fn)(x, y), getattr(near, fn)(x, y)
        for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            assert bool(jnp.all(jnp.isfinite(u))), fn
            assert rel_err(u, v) < (1e-5 if X64 else 1e-3), fn


@pytest.mark.parametrize("Rs", [0.3, 0.6])
def test_pseudo_jaffe_derivatives_are_finite_at_the_centre_and_match_the_jacobian(Rs):
    p = mass.PseudoJaffe(sigma0=0.5, Ra=0.3, Rs=Rs, center_x=0.1, center_y=-0.2)
    x0, y0 = jnp.asarray(0.1), jnp.asarray(-0.2)

    def total(profile, x, y):
        ax, ay = profile.deflection(x, y)
        return ax + ay + profile.potential(x, y) + profile.convergence(x, y)

    grads = jax.grad(total, argnums=(0, 1, 2))(p, x0, y0)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
    # the analytic Hessian at the centre (a divided difference of the radii, written
    # out) against forward-mode derivatives of the deflection
    jac = jax.jacfwd(lambda v: jnp.stack(p.deflection(v[0], v[1])))(jnp.stack([x0, y0]))
    f_xx, f_xy, _, f_yy = p.hessian(x0, y0)
    got = jnp.asarray([[f_xx, f_xy], [f_xy, f_yy]])
    assert rel_err(got, jac) < 1e2 * default_eps()


def test_pseudo_jaffe_values_are_checked_where_they_enter():
    with pytest.raises(ValueError, match=r"PseudoJaffe\.Ra must be finite and in \(0, inf\)"):
        mass.PseudoJaffe(sigma0=0.5, Ra=0.0, Rs=1.0)
    with pytest.raises(ValueError, match=r"PseudoJaffe\.sigma0 must be finite and in \[0, inf\)"):
        mass.PseudoJaffe(sigma0=-0.5, Ra=0.1, Rs=1.0)
