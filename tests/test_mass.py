"""Generic and analytic tests of every mass profile."""

import functools

import equinox as eqx
import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.integrate

import equilens as el
from equilens import mass
from helpers import (
    cast_tree,
    default_eps,
    example_mass_profiles,
    fd_grad,
    final_subclasses,
    rel_err,
    sample_points,
)

PROFILES = example_mass_profiles()
NAMES = sorted(PROFILES)

# Tolerances scale with the precision in use (float64 by default, float32 in the x64-off
# session): identities between derivatives hold to a few hundred ulps.
TOL = 2e3 * default_eps()


def test_registry_covers_every_final_mass_profile():
    # (MultiPlane has no potential, which the generic identities below need: its own
    # tests are in test_multiplane.py)
    finals = final_subclasses(mass.AbstractMassProfile) - {"MultiPlane"}
    assert finals <= set(PROFILES), f"missing from the registry: {finals - set(PROFILES)}"


@pytest.mark.parametrize("name", NAMES)
def test_deflection_is_gradient_of_potential(name):
    p = PROFILES[name]
    x, y = sample_points(48, seed=1)
    # (compiled: eagerly, every primitive of the derivative is compiled on its own)
    gx, gy = jax.jit(jax.grad(lambda x, y: p.potential(x, y).sum(), argnums=(0, 1)))(x, y)
    ax, ay = eqx.filter_jit(type(p).deflection)(p, x, y)
    # (the truncated NFW's closed-form potential is a sum of logarithmic terms about ten
    # times its gradient, which loses a digit in differentiation: its deflection is the
    # exact one, checked against mpmath in test_subhalo.py)
    tol = TOL * (10 if name in ("TNFW", "Subhalo") else 1)  # (a Subhalo is a TNFW)
    assert rel_err(gx, ax) < tol
    assert rel_err(gy, ay) < tol


@pytest.mark.parametrize("name", NAMES)
def test_convergence_is_half_trace_of_jacobian(name):
    p = PROFILES[name]
    x, y = sample_points(48, seed=2)
    dax_dx = jax.jit(jax.vmap(jax.grad(lambda x, y: p.deflection(x, y)[0], argnums=0)))(x, y)
    day_dy = jax.jit(jax.vmap(jax.grad(lambda x, y: p.deflection(x, y)[1], argnums=1)))(x, y)
    kappa = eqx.filter_jit(type(p).convergence)(p, x, y)
    expected = 0.5 * (dax_dx + day_dy)
    # relative to the deflection-derivative scale (the sheet-free kappa can cross zero)
    scale = max(float(jnp.max(jnp.abs(dax_dx))), float(jnp.max(jnp.abs(day_dy))))
    assert float(jnp.max(jnp.abs(kappa - expected))) < TOL * scale


@pytest.mark.parametrize("name", NAMES)
def test_hessian_is_symmetric_and_matches_jacobian(name):
    p = PROFILES[name]
    x, y = sample_points(32, seed=3)
    f_xx, f_xy, f_yx, f_yy = eqx.filter_jit(type(p).hessian)(p, x, y)
    jac = jax.jit(jax.vmap(jax.jacrev(lambda x, y: jnp.stack(p.deflection(x, y)), argnums=(0, 1))))(
        x, y
    )
    assert rel_err(f_xy, f_yx) < TOL or float(jnp.max(jnp.abs(f_xy - f_yx))) < TOL
    scale = max(float(jnp.max(jnp.abs(j))) for j in jac)
    for got, want in [(f_xx, jac[0][:, 0]), (f_yy, jac[1][:, 1]), (f_xy, jac[1][:, 0])]:
        assert float(jnp.max(jnp.abs(got - want))) < TOL * scale


@pytest.mark.parametrize("name", NAMES)
def test_jit_equals_eager(name):
    p = PROFILES[name]
    x, y = sample_points(16, seed=4)
    eager = p.deflection(x, y)
    jitted = eqx.filter_jit(lambda p, x, y: p.deflection(x, y))(p, x, y)
    for a, b in zip(eager, jitted, strict=True):
        assert rel_err(a, b) < 10 * default_eps()


@pytest.mark.parametrize("name", NAMES)
def test_vmap_over_parameters(name):
    p = PROFILES[name]
    x, y = sample_points(16, seed=5)
    # a batch of two models: the example and the example with every parameter scaled
    params, static = eqx.partition(p, eqx.is_inexact_array)
    params2 = jax.tree.map(lambda a: a * 0.9, params)
    batch = jax.tree.map(lambda a, b: jnp.stack([a, b]), params, params2)
    out = jax.jit(jax.vmap(lambda pr: eqx.combine(pr, static).deflection(x, y)))(batch)
    single = eqx.filter_jit(type(p).deflection)(eqx.combine(params2, static), x, y)
    assert rel_err(out[0][1], single[0]) < 10 * default_eps()
    assert rel_err(out[1][1], single[1]) < 10 * default_eps()


@pytest.mark.x64_only
@pytest.mark.parametrize("name", NAMES)
def test_float32_close_to_float64(name):
    p64 = PROFILES[name]
    x, y = sample_points(48, seed=6)
    p32 = cast_tree(p64, jnp.float32)
    for fn in ("deflection", "potential"):
        method = eqx.filter_jit(getattr(type(p64), fn))
        out64 = method(p64, x, y)
        out32 = method(p32, x.astype(jnp.float32), y.astype(jnp.float32))
        for a, b in zip(jax.tree.leaves(out32), jax.tree.leaves(out64), strict=True):
            assert a.dtype == jnp.float32
            assert rel_err(a, b) < 1e-5, fn


def _round_version(p):
    """The profile with its ellipticity set to exactly zero (q = 1), where it has one."""
    for field in ("e1", "e2"):
        if hasattr(p, field):
            p = eqx.tree_at(lambda q, f=field: getattr(q, f), p, jnp.zeros_like(getattr(p, field)))
    return p


@pytest.mark.parametrize("name", NAMES)
def test_finite_gradients_at_centre_and_at_q_equal_one(name):
    p = _round_version(PROFILES[name])
    # a grid containing the exact centre of the example profiles
    centres = [jnp.asarray(0.0)]
    for leaf in ("center_x", "ra_0"):
        if hasattr(p, leaf):
            centres = [getattr(p, leaf)]
    cx = centres[0]
    cy = getattr(p, "center_y", getattr(p, "dec_0", jnp.asarray(0.0)))
    x = jnp.stack([cx, cx + 0.3, cx - 0.7]).astype(jnp.result_type(float))
    y = jnp.stack([cy, cy - 0.2, cy + 0.5]).astype(jnp.result_type(float))

    def loss(p):
        ax, ay = p.deflection(x, y)
        return jnp.sum(ax**2 + ay**2) + jnp.sum(p.potential(x[1:], y[1:]))

    grads = eqx.filter_jit(eqx.filter_grad(loss))(p)
    for leaf in jax.tree.leaves(grads):
        assert bool(jnp.all(jnp.isfinite(leaf)))
    values = eqx.filter_jit(type(p).deflection)(p, x, y)
    assert all(bool(jnp.all(jnp.isfinite(v))) for v in values)


@pytest.mark.x64_only
@pytest.mark.parametrize("cls", [mass.SIE, mass.EPL, mass.EllipticalNFW])
def test_ellipticity_gradient_at_q_equal_one_is_the_true_derivative(cls):
    kwargs = {
        "SIE": dict(theta_E=1.1),
        "EPL": dict(theta_E=1.1, gamma=2.3),
        "EllipticalNFW": dict(Rs=1.3, alpha_Rs=0.6),
    }[cls.__name__]
    x, y = sample_points(24, seed=7)

    def f(e):
        ax, ay = cls(**kwargs, e1=e[0], e2=e[1]).deflection(x, y)
        return jnp.sum(ax * jnp.cos(x)) + jnp.sum(ay * jnp.sin(3 * y))

    f = jax.jit(f)
    g = jax.jit(jax.grad(f))(jnp.zeros(2))
    g_fd = fd_grad(lambda e: f(jnp.asarray(e)), np.zeros(2), h=1e-6)
    assert np.all(np.abs(np.asarray(g)) > 1e-3)  # the ellipticity matters at q = 1
    np.testing.assert_allclose(np.asarray(g), g_fd, rtol=1e-6)


@pytest.mark.x64_only
@pytest.mark.parametrize("name", ["SIE", "EPL", "NFW", "EllipticalNFW", "Multipole", "MassSum"])
def test_parameter_gradients_match_finite_differences(name):
    p = PROFILES[name]
    x, y = sample_points(24, seed=8)
    params, static = eqx.partition(p, eqx.is_inexact_array)
    flat, unravel = jax.flatten_util.ravel_pytree(params)

    def f(v):
        ax, ay = eqx.combine(unravel(v), static).deflection(x, y)
        return jnp.sum(ax * x) + jnp.sum(ay * y**2)

    f = jax.jit(f)
    g = jax.jit(jax.grad(f))(flat)
    g_fd = fd_grad(lambda v: f(jnp.asarray(v)), np.asarray(flat), h=1e-6)
    np.testing.assert_allclose(np.asarray(g), g_fd, rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------- analytic


def test_sis_deflection_is_theta_E_everywhere():
    x, y = sample_points(32, seed=9)
    ax, ay = mass.SIS(theta_E=1.3).deflection(x, y)
    np.testing.assert_allclose(np.hypot(ax, ay), 1.3, rtol=10 * default_eps())


@pytest.mark.parametrize("e1, e2", [(0.0, 0.0), (0.2, -0.1), (-0.3, 0.25)])
def test_sie_mean_convergence_inside_einstein_ellipse_is_one(e1, e2):
    # Gauss: the mass inside a closed curve is (1/2) of the outward flux of alpha. For the SIE,
    # the ellipse q x'^2 + y'^2/q = theta_E^2 encloses mass pi theta_E^2 (mean kappa = 1).
    theta_E = 1.2
    p = mass.SIE(theta_E=theta_E, e1=e1, e2=e2)
    c = np.hypot(e1, e2)
    q, phi = (1 - c) / (1 + c), 0.5 * np.arctan2(e2, e1)
    t = np.linspace(0, 2 * np.pi, 4001)[:-1]
    xp, yp = theta_E * np.cos(t) / np.sqrt(q), theta_E * np.sqrt(q) * np.sin(t)
    dxp, dyp = -theta_E * np.sin(t) / np.sqrt(q), theta_E * np.sqrt(q) * np.cos(t)
    rot = lambda a, b: (a * np.cos(phi) - b * np.sin(phi), a * np.sin(phi) + b * np.cos(phi))
    x, y = rot(xp, yp)
    dx, dy = rot(dxp, dyp)
    ax, ay = p.deflection(jnp.asarray(x), jnp.asarray(y))
    flux = np.sum(np.asarray(ax) * dy - np.asarray(ay) * dx) * (t[1] - t[0])
    np.testing.assert_allclose(0.5 * flux, np.pi * theta_E**2, rtol=max(1e-9, 10 * default_eps()))


def test_epl_at_gamma_2_is_the_sie():
    x, y = sample_points(48, seed=10)
    kw = dict(theta_E=1.1, e1=0.2, e2=-0.15, center_x=0.1, center_y=-0.05)
    a = mass.EPL(gamma=2.0, **kw).deflection(x, y)
    b = mass.SIE(**kw).deflection(x, y)
    assert rel_err(a[0], b[0]) < 100 * default_eps()
    assert rel_err(a[1], b[1]) < 100 * default_eps()


@pytest.mark.x64_only
@pytest.mark.parametrize(
    "e1, e2",
    [(0.0, 0.0), (1e-12, 0.0), (0.0, 1e-9), (-2e-8, 1e-8), (2e-3, 1e-3), (0.0185, 0.0), (0.3, 0.2)],
)
def test_sie_ellipticity_derivatives_are_the_epl_series_at_gamma_2(e1, e2):
    # The SIE (Keeton's closed form, with a custom JVP in the ellipticity) against the EPL at
    # gamma = 2 (the hypergeometric series): first and second derivatives with respect to
    # (e1, e2) at, next to and away from q = 1, across the SIE's switch to its series for
    # the derivative (c = eps^(1/9) = 0.0183) and its tiny-c value (c = 1.5e-8)
    e = jnp.asarray([e1, e2])
    for order in (jax.grad, jax.hessian):
        sie, epl = _ellipticity_derivatives(order)
        assert rel_err(sie(e), epl(e)) < 1e-11, order.__name__


@functools.cache
def _ellipticity_derivatives(order):
    """The SIE's and the EPL's (gamma = 2) `order` derivative of a deflection functional
    with respect to (e1, e2), compiled once for every ellipticity (one program each, not
    one per parametrisation)."""
    x, y = sample_points(64, seed=12)
    kw = dict(theta_E=1.2, center_x=0.1, center_y=-0.05)

    def f(e, cls, **extra):
        ax, ay = cls(**kw, **extra, e1=e[0], e2=e[1]).deflection(x, y)
        return jnp.sum(ax * jnp.cos(x)) + jnp.sum(ay * jnp.sin(3 * y))

    sie = functools.partial(f, cls=mass.SIE)
    epl = functools.partial(f, cls=mass.EPL, gamma=2.0)
    return jax.jit(order(sie)), jax.jit(order(epl))


@pytest.mark.parametrize("gamma", [1.4, 2.0, 2.6])
def test_round_epl_deflection_is_the_power_law(gamma):
    x, y = sample_points(48, seed=11)
    ax, ay = mass.EPL(theta_E=1.3, gamma=gamma).deflection(x, y)
    r = np.hypot(x, y)
    np.testing.assert_allclose(
        np.hypot(ax, ay),
        1.3 * (r / 1.3) ** (2 - gamma),
        rtol=1e-12 if default_eps() < 1e-10 else 1e-5,
    )


@pytest.mark.x64_only
def test_nfw_enclosed_mass_from_convergence_matches_deflection():
    # m(<R) = int_0^R kappa 2 pi r dr must equal pi R alpha(R) (Gauss's law).
    p = mass.NFW(Rs=1.3, alpha_Rs=0.9)
    for R in (0.2, 1.3, 4.0):
        inner = scipy.integrate.quad(
            lambda r: float(p.convergence(jnp.asarray(r), jnp.asarray(0.0))) * 2 * np.pi * r,
            0,
            R,
            limit=200,
            epsabs=0,
            epsrel=1e-11,
        )[0]
        ax, _ = p.deflection(jnp.asarray(R), jnp.asarray(0.0))
        np.testing.assert_allclose(inner, np.pi * R * float(ax), rtol=1e-8)
    # normalisation: the deflection at Rs is alpha_Rs
    ax, _ = p.deflection(jnp.asarray(1.3), jnp.asarray(0.0))
    np.testing.assert_allclose(float(ax), 0.9, rtol=1e-13)


def test_elliptical_nfw_at_q_one_approximates_nfw():
    x, y = sample_points(64, seed=12, half_width=5.0)
    a = mass.EllipticalNFW(Rs=1.5, alpha_Rs=0.8).deflection(x, y)
    b = mass.NFW(Rs=1.5, alpha_Rs=0.8).deflection(x, y)
    # Oguri (2021) table 1 reproduces the NFW to ~1e-4
    assert rel_err(a[0], b[0]) < 3e-4 and rel_err(a[1], b[1]) < 3e-4


def test_mass_sheet_and_point_mass():
    ax, ay = mass.ConvergenceSheet(kappa=0.2).deflection(jnp.asarray(1.5), jnp.asarray(-1.0))
    np.testing.assert_allclose([float(ax), float(ay)], [0.3, -0.2], rtol=10 * default_eps())
    p = mass.PointMass(theta_E=0.8)
    bx, by = p.ray_shoot(jnp.asarray(0.8 * np.cos(0.3)), jnp.asarray(0.8 * np.sin(0.3)))
    assert abs(float(bx)) < 10 * default_eps() and abs(float(by)) < 10 * default_eps()


def test_sum_and_batch_compose():
    a, b = mass.SIS(0.5, 0.3, 0.0), mass.SIS(0.4, -0.3, 0.1)
    s = a + b + mass.ExternalShear(0.01, 0.02)
    assert isinstance(s, mass.MassSum) and len(s.components) == 3
    x, y = sample_points(8)
    batch = mass.MassBatch.stack([a, b])
    for fn in ("deflection", "potential", "convergence"):
        got = jax.tree.leaves(getattr(batch, fn)(x, y))
        want = jax.tree.leaves(getattr(a + b, fn)(x, y))
        for g, w in zip(got, want, strict=True):
            assert rel_err(g, w) < 10 * default_eps()
    with pytest.raises(ValueError, match="one class"):
        mass.MassBatch.stack([a, mass.PointMass(0.1)])


def test_grad_of_composed_model_has_model_structure():
    model = mass.SIE(1.2, 0.1, 0.0) + mass.ExternalShear(0.02, 0.0)
    x, y = sample_points(8)
    g = eqx.filter_grad(lambda m: jnp.sum(m.deflection(x, y)[0]))(model)
    assert isinstance(g, mass.MassSum)
    assert isinstance(g.components[0], mass.SIE)


def test_magnification_and_critical_curves_of_sis():
    p = mass.SIS(theta_E=1.0)
    grid = el.Grid((101, 101), 0.04)
    curves = el.lensing.critical_curves(p, grid)
    # the SIS tangential critical curve is the circle r = theta_E (the longest contour; the
    # singular centre pixel may add a tiny one)
    pts = max(curves, key=len)
    assert len(pts) > 100
    np.testing.assert_allclose(np.hypot(pts[:, 0], pts[:, 1]), 1.0, atol=2e-3)
    caustic = max(el.lensing.caustics(p, grid), key=len)
    assert np.max(np.hypot(caustic[:, 0], caustic[:, 1])) < 5e-3  # degenerate point caustic
    mu = p.magnification(jnp.asarray(2.0), jnp.asarray(0.0))
    np.testing.assert_allclose(float(mu), 2.0, rtol=100 * default_eps())  # 1/(1 - 1/r)


def test_multipole_rejects_bad_order():
    with pytest.raises(ValueError, match=r"Multipole\.m"):
        mass.Multipole(m=0, a_m=0.1)


def test_image_positions_of_sis_are_analytic():
    # an SIS images a source at beta (0 < beta < theta_E) at theta_E + beta and beta - theta_E
    p = mass.SIS(theta_E=1.0)
    grid = el.Grid((101, 101), 0.05)  # out to 2.5"
    found = el.lensing.image_positions(p, 0.1, 0.0, grid)
    assert found.shape == (2, 2)
    # ordered by |magnification|: 1 / |1 - 1/|theta||, larger for the outer image
    np.testing.assert_allclose(found[:, 0], [1.1, -0.9], atol=1e3 * default_eps())
    np.testing.assert_allclose(found[:, 1], 0.0, atol=1e3 * default_eps())
    # a source outside the (point) caustic's reach: one image, theta_E + beta
    found = el.lensing.image_positions(p, 1.3, 0.0, grid)
    np.testing.assert_allclose(found, [[2.3, 0.0]], atol=1e3 * default_eps())


def test_image_positions_of_a_quad_trace_back_to_the_source():
    p = mass.SIE(theta_E=1.2, e1=0.15, e2=-0.05, center_x=0.02) + mass.ExternalShear(
        gamma1=0.03, gamma2=0.02
    )
    grid = el.Grid((100, 100), 0.05)
    found = el.lensing.image_positions(p, 0.03, 0.02, grid)
    # a source near the centre of an elliptical lens: four images (the fifth, central one
    # is absent for a singular profile), around the Einstein ring
    assert found.shape == (4, 2)
    bx, by = p.ray_shoot(jnp.asarray(found[:, 0]), jnp.asarray(found[:, 1]))
    np.testing.assert_allclose(np.asarray(bx), 0.03, atol=1e3 * default_eps())
    np.testing.assert_allclose(np.asarray(by), 0.02, atol=1e3 * default_eps())
    r = np.hypot(found[:, 0] - 0.02, found[:, 1])
    assert np.all((r > 0.8) & (r < 1.6))
    # no image lies outside a grid that holds none: a tiny grid far from the lens
    far = el.Grid((10, 10), 0.05, origin=(3.0, 3.0))
    assert el.lensing.image_positions(p, 0.03, 0.02, far).shape == (0, 2)
