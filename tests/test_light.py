"""Generic and analytic tests of every light profile."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from equilens import light
from helpers import (
    cast_tree,
    default_eps,
    example_light_profiles,
    final_subclasses,
    rel_err,
    sample_points,
)

PROFILES = example_light_profiles()
NAMES = sorted(PROFILES)


def test_registry_covers_every_final_light_profile():
    # a PixelizedSource is solved, not evaluated from parameters: tests/test_pixelized.py
    finals = final_subclasses(light.AbstractLightProfile) - {"PixelizedSource"}
    assert finals <= set(PROFILES), f"missing from the registry: {finals - set(PROFILES)}"


@pytest.mark.parametrize("name", NAMES)
def test_jit_equals_eager_and_shape(name):
    p = PROFILES[name]
    x, y = sample_points(16, seed=1)
    eager = p.intensity(x, y)
    assert eager.shape == x.shape
    jitted = eqx.filter_jit(lambda p, x, y: p.intensity(x, y))(p, x, y)
    assert rel_err(jitted, eager) < 10 * default_eps()


@pytest.mark.parametrize("name", NAMES)
def test_vmap_over_parameters(name):
    p = PROFILES[name]
    x, y = sample_points(16, seed=2)
    params, static = eqx.partition(p, eqx.is_inexact_array)
    params2 = jax.tree.map(lambda a: a * 1.1, params)
    batch = jax.tree.map(lambda a, b: jnp.stack([a, b]), params, params2)
    out = jax.jit(jax.vmap(lambda pr: eqx.combine(pr, static).intensity(x, y)))(batch)
    assert rel_err(out[1], eqx.combine(params2, static).intensity(x, y)) < 10 * default_eps()


@pytest.mark.x64_only
@pytest.mark.parametrize("name", NAMES)
def test_float32_close_to_float64(name):
    p64 = PROFILES[name]
    x, y = sample_points(48, seed=3)
    out64 = p64.intensity(x, y)
    out32 = cast_tree(p64, jnp.float32).intensity(x.astype(jnp.float32), y.astype(jnp.float32))
    assert out32.dtype == jnp.float32
    assert rel_err(out32, out64) < 1e-5


def _round(p):
    for field in ("e1", "e2"):
        if hasattr(p, field):
            p = eqx.tree_at(lambda m, f=field: getattr(m, f), p, jnp.asarray(0.0))
    return p


@pytest.mark.parametrize("name", NAMES)
def test_finite_gradients_at_centre_and_at_q_equal_one(name):
    p = PROFILES[name]
    # round (q = 1) versions of every elliptical component
    if isinstance(p, light.LightSum):
        p = light.LightSum(tuple(_round(c) for c in p.components))
    else:
        p = _round(p)
    cx = float(getattr(p, "center_x", 0.0)) if hasattr(p, "center_x") else 0.0
    x = jnp.asarray([cx, cx + 0.2, cx - 0.5])
    y = jnp.asarray([0.0, 0.1, -0.3])
    grads = eqx.filter_jit(eqx.filter_grad(lambda m: jnp.sum(m.intensity(x, y) ** 2)))(p)
    for leaf in jax.tree.leaves(grads):
        assert bool(jnp.all(jnp.isfinite(leaf)))


def test_sersic_amp_is_brightness_at_R_sersic_and_half_light():
    p = light.Sersic(amp=2.5, R_sersic=0.8, n_sersic=4.0, e1=0.2, e2=0.0)
    # on the major axis (phi = 0), R = sqrt(q) x', so R = R_sersic at x' = R_sersic / sqrt(q)
    q = (1 - 0.2) / (1 + 0.2)
    i = p.intensity(jnp.asarray(0.8 / np.sqrt(q)), jnp.asarray(0.0))
    np.testing.assert_allclose(float(i), 2.5, rtol=100 * default_eps())
    # R_sersic encloses half the light (b_n approximation: to ~1e-3)
    r = jnp.linspace(1e-4, 60.0, 200_001)
    rp = light.Sersic(amp=1.0, R_sersic=0.8, n_sersic=4.0)
    ring = rp.intensity(r, jnp.zeros_like(r)) * 2 * jnp.pi * r
    cum = jnp.cumsum(ring) * (r[1] - r[0])
    half = float(r[jnp.searchsorted(cum, cum[-1] / 2)])
    np.testing.assert_allclose(half, 0.8, rtol=3e-3)


def test_gaussian_amp_is_total_flux():
    p = light.Gaussian(amp=4.0, sigma=0.3, e1=0.3, e2=-0.1)
    xs = jnp.linspace(-4, 4, 801)
    yy, xx = jnp.meshgrid(xs, xs, indexing="ij")
    total = float(p.intensity(xx, yy).sum() * (xs[1] - xs[0]) ** 2)
    np.testing.assert_allclose(total, 4.0, rtol=max(1e-6, 1e3 * default_eps()))


def test_shapelets_basis_is_orthonormal():
    n_max = 4
    p = light.Shapelets(amp=jnp.ones(15), n_max=n_max, beta=1.0)
    xs = jnp.linspace(-12, 12, 481)
    yy, xx = jnp.meshgrid(xs, xs, indexing="ij")
    b = p.basis(xx, yy).reshape(15, -1)
    gram = np.asarray(b @ b.T) * float(xs[1] - xs[0]) ** 2
    np.testing.assert_allclose(gram, np.eye(15), atol=1e-8 if default_eps() < 1e-10 else 1e-4)
    assert light.shapelet_indices(2) == [(0, 0), (1, 0), (0, 1), (2, 0), (1, 1), (0, 2)]


def test_linear_profiles_are_linear_in_amp():
    x, y = sample_points(16, seed=4)
    for name in ("MGE", "Shapelets"):
        p = PROFILES[name]
        basis = p.basis(x, y)
        assert basis.shape == (p.amp.shape[0], *x.shape)
        assert rel_err(p.intensity(x, y), jnp.tensordot(p.amp, basis, axes=1)) < 10 * default_eps()


def test_bad_linear_profile_shapes_raise():
    with pytest.raises(ValueError, match=r"Shapelets\.amp"):
        light.Shapelets(amp=jnp.ones(5), n_max=2, beta=1.0)
    with pytest.raises(ValueError, match=r"MGE\.amp"):
        light.MGE(amp=jnp.ones(3), sigma=jnp.ones(4))
