"""Multi-plane lensing: against lenstronomy's multi-plane ray shooting (several cosmologies,
halos in front of and behind the main lens), one plane against the single-plane lens, the
planes' scan against a plain loop, the Numba backend, gradients, batches and fits."""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import equilens as el
import equilens.numba as enb
from equilens import light, mass
from equilens.mass import MultiPlane
from equilens.mass._multiplane import _transverse
from equilens.numba._terms import solve_lens_equation
from equilens.terms._positions import source_plane_offsets
from helpers import slow_ci

X64 = jax.config.read("jax_enable_x64")


def _lens():
    comps = [
        mass.SIE(theta_E=1.1, e1=0.1, e2=-0.05),
        mass.TNFW(Rs=0.1, alpha_Rs=0.05, r_trunc=0.5, center_x=0.8, center_y=0.3),
        mass.NFW(Rs=0.3, alpha_Rs=0.1, center_x=-1.0, center_y=0.5),
        mass.PseudoJaffe(sigma0=0.3, Ra=0.01, Rs=0.2, center_x=0.2, center_y=-1.0),
        mass.ExternalShear(gamma1=0.02, gamma2=-0.01),
    ]
    kwargs = [
        dict(theta_E=1.1, e1=0.1, e2=-0.05, center_x=0.0, center_y=0.0),
        dict(Rs=0.1, alpha_Rs=0.05, r_trunc=0.5, center_x=0.8, center_y=0.3),
        dict(Rs=0.3, alpha_Rs=0.1, center_x=-1.0, center_y=0.5),
        dict(sigma0=0.3, Ra=0.01, Rs=0.2, center_x=0.2, center_y=-1.0),
        dict(gamma1=0.02, gamma2=-0.01, ra_0=0.0, dec_0=0.0),
    ]
    # in front of and behind the main lens (0.5); the shear on the main lens's plane
    redshifts = [0.5, 0.5, 0.3, 1.2, 0.5]
    return comps, kwargs, ["SIE", "TNFW", "NFW", "PJAFFE", "SHEAR"], redshifts


def _cosmologies():
    from astropy.cosmology import LambdaCDM, Planck18, wCDM

    return {
        "flat-70-0.3": "flat",
        "Planck18": Planck18,
        "open": LambdaCDM(H0=67.0, Om0=0.3, Ode0=0.6),
        "wCDM": wCDM(H0=72.0, Om0=0.28, Ode0=0.72, w0=-0.9),
    }


@pytest.mark.crosscheck
@pytest.mark.x64_only
@pytest.mark.parametrize("name", sorted(_cosmologies()))
def test_multiplane_matches_lenstronomy_ray_shooting(name):
    pytest.importorskip("lenstronomy")
    from astropy.cosmology import FlatLambdaCDM
    from lenstronomy.LensModel.lens_model import LensModel

    cosmo = _cosmologies()[name]
    cosmo = FlatLambdaCDM(H0=70.0, Om0=0.3) if cosmo == "flat" else cosmo
    comps, kwargs, names, redshifts = _lens()
    mine = MultiPlane(comps, redshifts, 2.0, cosmo)
    with warnings.catch_warnings():  # (lenstronomy reminds that `cosmo` wins over its name)
        warnings.simplefilter("ignore", UserWarning)
        theirs = LensModel(
            names, z_source=2.0, lens_redshift_list=redshifts, multi_plane=True, cosmo=cosmo
        )
    rng = np.random.default_rng(0)
    x, y = rng.uniform(-2, 2, 300), rng.uniform(-2, 2, 300)
    bx, by = theirs.ray_shooting(x, y, kwargs)
    mx, my = mine.trace(jnp.asarray(x), jnp.asarray(y))
    err = float(np.max(np.hypot(np.asarray(mx) - bx, np.asarray(my) - by)))
    print(f"\nMultiPlane vs lenstronomy ({name}): max |beta - beta_ref| = {err:.2e} arcsec")
    assert err < 1e-8
    # the effective deflection too, from both backends
    ax, ay = theirs.alpha(x, y, kwargs)
    for got in (mine.deflection(jnp.asarray(x), jnp.asarray(y)), enb.deflection(mine, x, y)):
        assert float(np.max(np.hypot(np.asarray(got[0]) - ax, np.asarray(got[1]) - ay))) < 1e-8


def _loop_trace(components, redshifts, z_source, cosmology, x, y):
    """The recursion as a plain loop over planes (no stacking, no masks, no scan)."""
    from astropy.cosmology import Planck18

    cosmology = cosmology or Planck18
    t_s = _transverse(cosmology, 0.0, z_source)
    px, py, ax, ay, z_prev = 0.0 * x, 0.0 * y, x, y, 0.0
    for z in sorted(set(redshifts)):
        dt = _transverse(cosmology, z_prev, z)
        px, py = px + ax * dt, py + ay * dt
        t_i = _transverse(cosmology, 0.0, z)
        f = t_s / _transverse(cosmology, z, z_source)
        for c, zc in zip(components, redshifts, strict=True):
            if zc == z:
                dx, dy = c.deflection(px / t_i, py / t_i)
                ax, ay = ax - f * dx, ay - f * dy
        z_prev = z
    dt = _transverse(cosmology, z_prev, z_source)
    return (px + ax * dt) / t_s, (py + ay * dt) / t_s


def _halos(n: int, seed: int, zs=(0.2, 0.5, 0.9)):
    rng = np.random.default_rng(seed)
    halos = [
        mass.TNFW(
            Rs=rng.uniform(0.02, 0.1),
            alpha_Rs=rng.uniform(0.002, 0.02),
            r_trunc=rng.uniform(0.2, 0.6),
            center_x=rng.uniform(-2, 2),
            center_y=rng.uniform(-2, 2),
        )
        for _ in range(n)
    ]
    return halos, [float(z) for z in rng.choice(zs, n)]


def test_the_scan_over_planes_equals_a_loop_and_the_numba_backend():
    # more halos of one class on one plane than a chunk: the chunked scan and its padding
    sie = mass.SIE(theta_E=1.0, e1=0.05, e2=0.02) + mass.ExternalShear(0.02, 0.01)
    chunk = 8
    many, z_many = _halos(2 * chunk + 7, seed=1, zs=(0.9,))
    few, z_few = _halos(5, seed=6, zs=(0.2, 0.5))
    halos = many + few
    comps, redshifts = [sie, *halos], [0.5, *z_many, *z_few]
    lens = MultiPlane(comps, redshifts, 1.5, chunk=chunk)
    # the planes' steps: as many as each plane's most populous class needs (0.9: three)
    assert [int(np.sum(np.asarray(lens.plane) == i)) for i in range(3)] == [1, 1, 3]
    assert max(p.shape[1] for p in lens.present) == chunk
    assert sum(int(np.sum(p)) for p in lens.present) == len(halos) + 2
    x, y = np.meshgrid(np.linspace(-2, 2, 23), np.linspace(-1.8, 2.1, 19))
    x, y = jnp.asarray(x), jnp.asarray(y)
    bx, by = eqx.filter_jit(MultiPlane.trace)(lens, x, y)
    rx, ry = _loop_trace(comps, redshifts, 1.5, None, x, y)
    tol = 1e-12 if X64 else 2e-5
    assert float(jnp.max(jnp.abs(bx - rx))) < tol and float(jnp.max(jnp.abs(by - ry))) < tol
    if X64:
        nx, ny = enb.deflection(lens, x, y)
        ax, ay = lens.deflection(x, y)
        np.testing.assert_allclose(nx, ax, rtol=0, atol=1e-10)
        np.testing.assert_allclose(ny, ay, rtol=0, atol=1e-10)
        np.testing.assert_allclose(enb.ray_shoot(lens, x, y)[0], bx, rtol=0, atol=1e-10)
    # the components come back, plane by plane
    planes = lens.components()
    assert [z for z, _ in planes] == sorted(set(redshifts))
    assert sum(len(members) for _, members in planes) == len(halos) + 2


def test_one_plane_is_the_single_plane_lens():
    main = mass.SIE(theta_E=1.1, e1=0.1, e2=-0.05) + mass.ExternalShear(0.03, 0.0)
    one = MultiPlane([main], [0.5], 2.0)
    x, y = jnp.linspace(-2.0, 2.0, 50), jnp.linspace(1.5, -1.0, 50)
    sx, sy = one.trace(x, y)
    rx, ry = main.ray_shoot(x, y)
    tol = 1e-14 if X64 else 1e-5
    assert float(jnp.max(jnp.abs(sx - rx))) < tol and float(jnp.max(jnp.abs(sy - ry))) < tol
    # the convergence of the effective mapping, and images through LensSystem
    k1, k0 = one.convergence(x, y), main.convergence(x, y)
    assert float(jnp.max(jnp.abs(k1 - k0))) < (1e-12 if X64 else 1e-4)
    src = light.Sersic(amp=10.0, R_sersic=0.2, n_sersic=1.5, center_x=0.05)
    grid, psf = el.Grid((40, 40), 0.08), el.GaussianPSF(0.15, 0.08)
    im1 = el.LensSystem(mass=one, source=src).image(grid, psf)
    im0 = el.LensSystem(mass=main, source=src).image(grid, psf)
    assert float(jnp.max(jnp.abs(im1 - im0)) / jnp.max(im0)) < (1e-12 if X64 else 1e-5)


@pytest.mark.x64_only
def test_gradients_with_respect_to_every_halo_parameter():
    halos, zs = _halos(5, seed=2)
    comps = [mass.SIE(theta_E=1.0, e1=0.05, e2=0.0), *halos]
    lens = MultiPlane(comps, [0.5, *zs], 1.5)
    x, y = jnp.linspace(-1.5, 1.5, 40), jnp.linspace(1.2, -1.3, 40)

    def loss(m):
        bx, by = m.trace(x, y)
        return jnp.sum(bx**2 + by * x)

    g = eqx.filter_jit(eqx.filter_grad(loss))(lens)
    compiled = eqx.filter_jit(loss)
    # every parameter of every component is a leaf (no padding), with a finite, non-zero
    # derivative
    n = 0
    for gk in g.kinds:
        for leaf in jax.tree.leaves(eqx.filter(gk, eqx.is_inexact_array)):
            grad = np.asarray(leaf)
            assert np.isfinite(grad).all() and np.all(grad != 0.0)
            n += grad.size
    assert n == 5 * 5 + 5  # TNFW's five fields for five halos; the SIE's five
    # the derivatives against central differences
    tnfw = next(i for i, k in enumerate(lens.kinds) if isinstance(k, mass.TNFW))
    for name in ("alpha_Rs", "r_trunc", "center_y"):
        for member in (0, 3):

            def moved(h, name=name, member=member):
                a = getattr(lens.kinds[tnfw], name).at[member].add(h)
                return compiled(eqx.tree_at(lambda m: getattr(m.kinds[tnfw], name), lens, a))

            fd = (float(moved(1e-6)) - float(moved(-1e-6))) / 2e-6
            ad = float(getattr(g.kinds[tnfw], name)[member])
            assert abs(ad - fd) < 1e-6 * max(1.0, abs(fd))


@slow_ci  # (20 s of compiles on the 2-core machine: out of the README's 12 minutes)
def test_stacked_realisations_vmap_as_each_alone():
    sie = mass.SIE(theta_E=1.0, e1=0.05, e2=0.0)
    lenses = []
    for seed, n in ((3, 3), (4, 5), (5, 9)):
        halos, _ = _halos(n, seed)
        zs = [(0.2, 0.5, 0.9)[i % 3] for i in range(n)]  # every realisation: every plane
        lenses.append(MultiPlane([sie, *halos], [0.5, *zs], 1.5))
    batch = MultiPlane.stack(lenses)
    x, y = jnp.linspace(-1.5, 1.5, 30), jnp.linspace(1.0, -1.0, 30)
    bx, by = eqx.filter_vmap(lambda m: m.trace(x, y))(batch)
    for i, lens in enumerate(lenses):
        rx, ry = lens.trace(x, y)
        tol = 1e-13 if X64 else 1e-5
        assert float(jnp.max(jnp.abs(bx[i] - rx))) < tol
        assert float(jnp.max(jnp.abs(by[i] - ry))) < tol
    # simulated in one call: each entry as `simulate` of that lens with its own key
    grid, psf = el.Grid((24, 24), 0.12), el.GaussianPSF(0.25, 0.12)
    src = light.Sersic(amp=10.0, R_sersic=0.2, n_sersic=1.5, center_x=0.05)

    def system(m):
        return el.LensSystem(mass=m, source=src)

    data, noise = el.simulate_batch(
        jax.random.key(1), system, batch, grid, psf, exposure_time=500.0, sky_level=1.0,
        batch_size=2,
    )  # fmt: skip
    assert data.shape == noise.shape == (3, 24, 24)
    keys = jax.random.split(jax.random.key(1), 3)
    for i in (0, 2):  # (the smallest lens, padded, and the largest)
        one = el.simulate(keys[i], system(lenses[i]), grid, psf, exposure_time=500.0, sky_level=1.0)
        tol = 1e-10 if X64 else 1e-4
        assert float(jnp.max(jnp.abs(data[i] - one.data))) < tol * float(jnp.max(one.data))
        assert float(jnp.max(jnp.abs(noise[i] - one.noise_map))) < tol * float(
            jnp.max(one.noise_map)
        )
    with pytest.raises(ValueError, match="leading axis"):
        el.simulate_batch(
            jax.random.key(1), system, (jnp.zeros(3), jnp.zeros(4)), grid, psf,
            exposure_time=1.0,
        )  # fmt: skip
    with pytest.raises(ValueError, match="exposure_time"):
        el.simulate_batch(jax.random.key(1), system, batch, grid, psf, exposure_time=0.0)
    other = MultiPlane([sie], [0.4], 1.5)
    with pytest.raises(ValueError, match="same planes"):
        MultiPlane.stack([lenses[0], other])


def test_bad_input_and_no_potential():
    sie = mass.SIE(theta_E=1.0)
    with pytest.raises(ValueError, match="one redshift per component"):
        MultiPlane([sie], [0.5, 0.6], 2.0)
    with pytest.raises(ValueError, match="z_source"):
        MultiPlane([sie], [2.5], 2.0)
    lens = MultiPlane([sie], [0.5], 2.0)
    with pytest.raises(TypeError, match="MultiPlane"):
        MultiPlane([lens], [0.5], 2.0)
    with pytest.raises(NotImplementedError, match="no single lensing potential"):
        lens.potential(jnp.zeros(2), jnp.zeros(2))
    with pytest.raises(NotImplementedError, match="no lensing potential"):
        enb.potential(lens, np.zeros(2), np.ones(2))


def test_the_numba_backend_gives_a_multiplane_lens_jacobian_and_positions():
    """The Numba backend's Jacobian of a MultiPlane (its recursion, forward mode) is the JAX
    hessian's four components, unequal off the diagonal; convergence, magnification and
    the positions terms (both planes) through it equal JAX's; and the positions' offsets
    `A^-1 (beta_i - beta)` for a non-symmetric `A` equal a direct linear solve."""
    sie = mass.SIE(theta_E=1.0, e1=0.05, e2=0.02) + mass.ExternalShear(0.02, 0.01)
    halos = [mass.SIS(theta_E=0.15, center_x=0.7, center_y=0.2), mass.SIS(0.1, -0.5, -0.6)]
    lens = MultiPlane([sie, *halos], [0.5, 0.2, 0.9], 1.5)
    x, y = np.meshgrid(np.linspace(-1.9, 2.0, 17), np.linspace(-1.7, 1.8, 13))
    jx, jy = jnp.asarray(x), jnp.asarray(y)
    tol = 1e-10 if X64 else 1e-4
    expected = eqx.filter_jit(MultiPlane.hessian)(lens, jx, jy)
    got = enb.hessian(lens, x, y)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, np.asarray(e), rtol=0, atol=tol)
    assert float(np.max(np.abs(got[1] - got[2]))) > 1e-3  # (not a potential's Hessian)
    kappa = np.asarray(eqx.filter_jit(MultiPlane.convergence)(lens, jx, jy))
    np.testing.assert_allclose(enb.convergence(lens, x, y), kappa, rtol=0, atol=tol)
    mu = np.asarray(eqx.filter_jit(MultiPlane.magnification)(lens, jx, jy))
    np.testing.assert_allclose(enb.magnification(lens, x, y), mu, rtol=10 * tol, atol=0)
    # the source-plane positions term of four points near the Einstein ring, and the Numba
    # lens-equation solve (Newton with the full Jacobian) from two points: two images
    px, py = np.array([1.02, -0.95, 0.1, -0.2]), np.array([0.43, -0.4, 1.05, -0.98])
    term = el.PositionsTerm(jnp.asarray(px), jnp.asarray(py), 0.01)
    value = float(eqx.filter_jit(lambda t, m: t(m))(term, lens))
    assert abs(enb.value(term, lens) - value) < (1e-8 if X64 else 1e-3) * abs(value)
    tx, ty, ok = solve_lens_equation(lens, px[:2], py[:2], 0.04, 0.02)
    assert ok.all() and np.hypot(tx[0] - tx[1], ty[0] - ty[1]) > 0.5
    bx, by = enb.ray_shoot(lens, tx, ty)
    np.testing.assert_allclose(np.stack([bx, by]), [[0.04, 0.04], [0.02, 0.02]], atol=1e-9)
    # the offsets' formula against a direct solve, A non-symmetric
    rng = np.random.default_rng(3)
    f = rng.normal(0.0, 0.3, (4, 5))  # fxx, fxy, fyx, fyy at 5 images
    bx, by = rng.normal(0.0, 0.1, 5), rng.normal(0.0, 0.1, 5)
    (rx, ry), (beta_x, beta_y) = source_plane_offsets(bx, by, *f)
    a = np.stack([np.stack([1 - f[0], -f[1]]), np.stack([-f[2], 1 - f[3]])]).transpose(2, 0, 1)
    inv = np.linalg.inv(a)
    # beta minimises sum |A_i^-1 (b_i - beta)|^2: the stacked least-squares problem
    beta = np.linalg.lstsq(
        inv.reshape(-1, 2), np.einsum("nij,nj->ni", inv, np.stack([bx, by], 1)).ravel()
    )[0]
    np.testing.assert_allclose([beta_x, beta_y], beta, rtol=1e-12, atol=1e-14)
    r = np.einsum("nij,nj->ni", inv, np.stack([bx - beta[0], by - beta[1]], 1))
    np.testing.assert_allclose(np.stack([rx, ry], 1), r, rtol=1e-12, atol=1e-14)


@slow_ci
@pytest.mark.x64_only
def test_a_fit_through_a_multiplane_lens():
    """A MultiPlane drops into LensSystem for a fit: the main lens's Einstein radius is
    recovered with a line-of-sight halo held fixed, and the JAX and Numba likelihoods agree."""
    grid, psf = el.Grid((40, 40), 0.07), el.GaussianPSF(0.14, 0.07)
    halo = mass.NFW(Rs=0.2, alpha_Rs=0.08, center_x=0.9, center_y=0.4)

    def system(theta_e):
        lens = MultiPlane([mass.SIE(theta_E=theta_e, e1=0.05, e2=0.0), halo], [0.5, 0.3], 2.0)
        src = light.Sersic(amp=15.0, R_sersic=0.15, n_sersic=1.2, center_x=0.05)
        return el.LensSystem(mass=lens, source=src)

    truth = system(1.0)
    data = el.simulate(jax.random.key(0), truth, grid, psf, exposure_time=1500.0, sky_level=0.5)
    obj = el.Objective(el.GaussianLikelihood(data))
    assert abs(float(obj(truth)) - enb.value(obj, truth)) < 1e-8 * abs(float(obj(truth)))
    start = system(0.9)
    free = jax.tree.map(lambda _: False, start)
    sie = next(i for i, k in enumerate(start.mass.kinds) if isinstance(k, mass.SIE))
    free = eqx.tree_at(lambda s: s.mass.kinds[sie].theta_E, free, True)
    r = el.fit(obj, start, "lm", free=free)
    assert r.success
    assert r.names == ("mass.kinds[1].theta_E[0]",)
    assert abs(float(r.model.mass.kinds[sie].theta_E[0]) - 1.0) < 2e-3


@pytest.mark.x64_only
def test_the_substructure_page_snippets_run():
    import pathlib
    import re

    page = pathlib.Path(__file__).resolve().parents[1] / "docs" / "substructure.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
    assert len(blocks) == 3  # (the third, pyHalo's, runs in test_substructure.py)
    ns: dict = {}
    exec(compile("\n".join(blocks[:2]), "<substructure.md>", "exec"), ns)
    lens, image = ns["lens"], ns["image"]
    assert isinstance(lens, MultiPlane) and lens.plane_redshifts == (0.222, 0.4)
    assert image.shape == (100, 100) and bool(jnp.all(jnp.isfinite(image)))
    assert float(image.max()) > 0.0


@slow_ci  # (20 s: the Numba evidence and its JAX program)
def test_the_pixelized_evidence_through_a_one_plane_lens_is_the_single_plane_one():
    """A MultiPlane in the pixelized source's evidence: one plane gives the single-plane
    lens's log-evidence (JAX and Numba), and a halo behind the lens changes it."""
    grid, psf = el.Grid((30, 30), 0.1), el.GaussianPSF(0.2, 0.1)
    main = mass.SIE(theta_E=1.0, e1=0.05, e2=0.0) + mass.ExternalShear(0.02, 0.0)
    src = light.Sersic(amp=15.0, R_sersic=0.2, n_sersic=1.2, center_x=0.05)
    data = el.simulate(
        jax.random.key(2), el.LensSystem(mass=main, source=src), grid, psf,
        exposure_time=1000.0, sky_level=0.5, mask=grid.circular_mask(1.4),
    )  # fmt: skip
    pixelized = el.PixelizedSource(el.RectangularMesh((12, 12)), el.ConstantRegularization(1.0))
    term = el.LogEvidence(data)
    values = {}
    for name, lens in (
        ("single", main),
        ("one plane", MultiPlane([main], [0.5], 2.0)),
        ("halo behind", MultiPlane([main, mass.SIS(theta_E=0.1, center_x=0.8)], [0.5, 0.9], 2.0)),
    ):
        system = el.LensSystem(mass=lens, source=pixelized)
        values[name] = enb.value(term, system)
        if name == "one plane":  # (JAX too)
            jax_value = float(eqx.filter_jit(lambda t, s: t(s))(term, system))
            assert abs(jax_value - values[name]) < 1e-9 * abs(values[name])
    assert abs(values["one plane"] - values["single"]) < 1e-10 * abs(values["single"])
    assert abs(values["halo behind"] - values["single"]) > 1e-3


@pytest.mark.slow
@pytest.mark.x64_only
def test_nuts_through_a_multiplane_lens():
    """NUTS samples the main lens's Einstein radius through a MultiPlane (a halo behind the
    lens held fixed): the posterior covers the truth."""
    pytest.importorskip("blackjax")
    grid, psf = el.Grid((32, 32), 0.08), el.GaussianPSF(0.16, 0.08)
    halo = mass.NFW(Rs=0.2, alpha_Rs=0.08, center_x=0.9, center_y=0.4)
    src = light.Sersic(amp=15.0, R_sersic=0.15, n_sersic=1.2, center_x=0.05)

    def system(theta_e):
        lens = MultiPlane([mass.SIE(theta_E=theta_e, e1=0.05, e2=0.0), halo], [0.5, 0.9], 2.0)
        return el.LensSystem(mass=lens, source=src)

    data = el.simulate(
        jax.random.key(3), system(1.0), grid, psf, exposure_time=1500.0, sky_level=0.5
    )
    obj = el.Objective(el.GaussianLikelihood(data))
    start = system(0.98)
    sie = next(i for i, k in enumerate(start.mass.kinds) if isinstance(k, mass.SIE))
    held = jax.tree.map(lambda _: False, start)
    free = eqx.tree_at(lambda s: s.mass.kinds[sie].theta_E, held, True)
    post = el.sample(
        jax.random.key(0), obj, start, free=free, n_chains=2, n_warmup=150, n_samples=200
    )
    assert post.names == ("mass.kinds[1].theta_E[0]",)
    mean, sd = float(post.mean()[0]), float(post.std()[0])
    assert 0.0 < sd < 0.01 and abs(mean - 1.0) < 4 * sd
