"""Physical units of a lens (`equilens.LensCosmology`) against lenstronomy's `LensCosmo`
(its constants rescaled to astropy's: it carries G and the solar mass of CODATA 2010,
2.8e-4 apart in Sigma_crit), and masses within apertures against closed forms."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import equilens as el
from equilens import mass

X64 = jax.config.read("jax_enable_x64")


def _cosmologies():
    from astropy.cosmology import FlatLambdaCDM, Planck18

    return [Planck18, FlatLambdaCDM(H0=70.0, Om0=0.3)]


@pytest.mark.crosscheck
@pytest.mark.x64_only
@pytest.mark.parametrize("which", [0, 1])
def test_sigma_crit_and_nfw_parameters_match_lenstronomy(which):
    pytest.importorskip("lenstronomy")
    import astropy.constants as ac
    import lenstronomy.Util.constants as lc_const
    from lenstronomy.Cosmo.lens_cosmo import LensCosmo

    cosmo = _cosmologies()[which]
    mine = el.LensCosmology(0.222, 0.609, cosmo)
    theirs = LensCosmo(0.222, 0.609, cosmo=cosmo)
    # Sigma_crit ~ c^2 Mpc / (G M_sun): lenstronomy's own constants, rescaled
    rescale = (lc_const.G * lc_const.M_sun / lc_const.Mpc) / (
        ac.G.value * ac.M_sun.value / 3.085677581491367e22
    )
    assert mine.sigma_crit == pytest.approx(theirs.sigma_crit_angle * rescale, rel=1e-9)
    for m200, c in [(1e8, 20.0), (3.5e9, 12.0), (1e12, 6.0)]:
        p = mine.nfw(m200, c)
        rs, alpha_rs = theirs.nfw_physical2angle(m200, c)
        assert float(p.Rs) == pytest.approx(rs, rel=1e-8)
        # (alpha_Rs is over Sigma_crit: the same constants' ratio)
        assert float(p.alpha_Rs) == pytest.approx(alpha_rs / rescale, rel=1e-8)
        back = mine.nfw_mass(p)
        assert back[0] == pytest.approx(m200, rel=1e-10)
        assert back[1] == pytest.approx(c, rel=1e-10)
        t = mine.tnfw(m200, c, r_trunc_kpc=2.0)
        assert float(t.r_trunc) * mine.kpc_per_arcsec() == pytest.approx(2.0, rel=1e-12)
        assert mine.nfw_mass(t) == pytest.approx(back, rel=1e-12)


def test_mass_within_matches_closed_forms():
    lc = el.LensCosmology(0.5, 2.0)
    tol = 1e-10 if X64 else 1e-5
    # SIS: kappa = theta_E / (2 R), so M(<R) = pi theta_E R Sigma_crit, about its centre
    sis = el.mass.SIS(theta_E=1.2, center_x=0.1, center_y=-0.2)
    expect = math.pi * 1.2 * 0.7 * lc.sigma_crit
    assert lc.mass_within(sis, 0.7) == pytest.approx(expect, rel=tol)
    # pseudo-Jaffe: M(<R) = 2 pi sigma0 Ra Rs / (Rs - Ra) (sqrt(Ra^2+R^2) - Ra
    # - sqrt(Rs^2+R^2) + Rs) Sigma_crit, built from its total mass
    pj = lc.pseudo_jaffe(3.5e9, 0.02, 0.6, center_x=-0.3, center_y=0.4)
    a, b, r = 0.02, 0.6, 0.8
    frac = (math.sqrt(a * a + r * r) - a - math.sqrt(b * b + r * r) + b) / (b - a)
    assert lc.mass_within(pj, r) == pytest.approx(3.5e9 * frac, rel=tol)
    # an elliptical profile, a circle off its centre: the flux of the deflection against
    # a direct integral of the convergence over the disc (Gauss-Legendre in radius, the
    # trapezoid rule in angle: the convergence is smooth on the disc)
    sie = el.mass.SIE(theta_E=1.0, e1=0.2, e2=-0.1, center_x=0.05, center_y=0.0)
    centre, R = (0.8, 0.5), 0.4
    nodes, weights = np.polynomial.legendre.leggauss(48)
    rho = 0.5 * R * (nodes + 1.0)
    phi = np.arange(256) * (2 * math.pi / 256)
    xx = centre[0] + rho[:, None] * np.cos(phi)[None, :]
    yy = centre[1] + rho[:, None] * np.sin(phi)[None, :]
    k = np.asarray(sie.convergence(jnp.asarray(xx), jnp.asarray(yy)))
    direct = float(np.sum(0.5 * R * weights[:, None] * rho[:, None] * k) * (2 * math.pi / 256))
    got = lc.mass_within(sie, R, center=centre) / lc.sigma_crit
    assert got == pytest.approx(direct, rel=1e-10 if X64 else 1e-4)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="0 < z_lens < z_source"):
        el.LensCosmology(1.0, 0.5)
    lc = el.LensCosmology(0.3, 1.0)
    with pytest.raises(ValueError, match="m200 and c must be > 0"):
        lc.nfw(-1e9, 10.0)
    with pytest.raises(ValueError, match="radius must be > 0"):
        lc.mass_within(el.mass.SIS(1.0), 0.0)
    with pytest.raises(TypeError, match="NFW"):  # (beartype in the tests, or its own check)
        lc.nfw_mass(el.mass.SIS(1.0))


@pytest.mark.x64_only
def test_a_profile_scaled_to_a_mass_within_a_radius():
    lc = el.LensCosmology(0.222, 0.609)
    kpc = 1.0 / lc.kpc_per_arcsec()
    tnfw = lc.with_mass_within(mass.TNFW(Rs=0.05, alpha_Rs=1.0, r_trunc=0.4), 2e9, kpc)
    pj = lc.with_mass_within(mass.PseudoJaffe(sigma0=1.0, Ra=0.001, Rs=0.6), 3.5e9, kpc)
    assert abs(lc.mass_within(tnfw, kpc) / 2e9 - 1.0) < 1e-10
    assert abs(lc.mass_within(pj, kpc) / 3.5e9 - 1.0) < 1e-10
    assert float(tnfw.Rs) == 0.05 and float(tnfw.r_trunc) == 0.4 and float(pj.Rs) == 0.6
    with pytest.raises(TypeError, match="NFW"):  # (beartype in the tests, or its own check)
        lc.with_mass_within(mass.SIS(theta_E=1.0), 1e9, kpc)
    with pytest.raises(ValueError, match="mass must be > 0"):
        lc.with_mass_within(tnfw, -1.0, kpc)
