"""Multi-plane lensing (work in progress, issue 49): against lenstronomy's multi-plane ray
shooting, and one plane against the single-plane lens."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import equilens as el
from equilens.mass._multiplane import MultiPlane

X64 = jax.config.read("jax_enable_x64")


def _lens():
    comps = [
        el.mass.SIE(theta_E=1.1, e1=0.1, e2=-0.05),
        el.mass.TNFW(Rs=0.1, alpha_Rs=0.05, r_trunc=0.5, center_x=0.8, center_y=0.3),
        el.mass.NFW(Rs=0.3, alpha_Rs=0.1, center_x=-1.0, center_y=0.5),
        el.mass.PseudoJaffe(sigma0=0.3, Ra=0.01, Rs=0.2, center_x=0.2, center_y=-1.0),
    ]
    kwargs = [
        dict(theta_E=1.1, e1=0.1, e2=-0.05, center_x=0.0, center_y=0.0),
        dict(Rs=0.1, alpha_Rs=0.05, r_trunc=0.5, center_x=0.8, center_y=0.3),
        dict(Rs=0.3, alpha_Rs=0.1, center_x=-1.0, center_y=0.5),
        dict(sigma0=0.3, Ra=0.01, Rs=0.2, center_x=0.2, center_y=-1.0),
    ]
    return comps, kwargs, ["SIE", "TNFW", "NFW", "PJAFFE"]


@pytest.mark.x64_only
def test_multiplane_matches_lenstronomy_ray_shooting():
    pytest.importorskip("lenstronomy")
    from astropy.cosmology import FlatLambdaCDM
    from lenstronomy.LensModel.lens_model import LensModel

    cosmo = FlatLambdaCDM(H0=70.0, Om0=0.3)
    comps, kwargs, names = _lens()
    redshifts = [0.5, 0.5, 0.3, 1.2]  # in front of and behind the main lens
    mine = MultiPlane(comps, redshifts, 2.0, cosmo)
    with warnings.catch_warnings():  # (lenstronomy reminds that `cosmo` wins over its name)
        warnings.simplefilter("ignore", UserWarning)
        theirs = LensModel(
            names, z_source=2.0, lens_redshift_list=redshifts, multi_plane=True, cosmo=cosmo
        )
    rng = np.random.default_rng(0)
    x, y = rng.uniform(-2, 2, 200), rng.uniform(-2, 2, 200)
    bx, by = theirs.ray_shooting(x, y, kwargs)
    mx, my = mine.trace(jnp.asarray(x), jnp.asarray(y))
    assert float(np.max(np.hypot(np.asarray(mx) - bx, np.asarray(my) - by))) < 1e-8


def test_one_plane_is_the_single_plane_lens():
    comps, _, _ = _lens()
    one = MultiPlane([comps[0]], [0.5], 2.0)
    x, y = jnp.linspace(-2.0, 2.0, 50), jnp.linspace(1.5, -1.0, 50)
    sx, sy = one.trace(x, y)
    rx, ry = comps[0].ray_shoot(x, y)
    tol = 1e-14 if X64 else 1e-5
    assert float(jnp.max(jnp.abs(sx - rx))) < tol and float(jnp.max(jnp.abs(sy - ry))) < tol
