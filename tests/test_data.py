"""The lens system, imaging datasets, FITS loading and simulation."""

import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import equilens as el
from equilens import light, mass
from helpers import default_eps, rel_err

DATA = os.path.join(os.path.dirname(__file__), "..", "src", "equilens", "_data", "SDSSJ0946+1006")


def make_system():
    return el.LensSystem(
        mass=mass.SIE(theta_E=1.2, e1=0.1, e2=-0.05) + mass.ExternalShear(0.03, -0.01),
        lens_light=light.Sersic(amp=3.0, R_sersic=0.8, n_sersic=3.5, e1=0.05, e2=0.02),
        source=light.Sersic(amp=5.0, R_sersic=0.15, n_sersic=1.5, center_x=0.05, center_y=0.02),
    )


def test_image_is_flux_per_pixel():
    # A source-free, unlensed Gaussian: total image flux = the Gaussian's total flux.
    system = el.LensSystem(
        mass=mass.ConvergenceSheet(0.0),
        source=light.Gaussian(amp=0.0, sigma=1.0),
        lens_light=light.Gaussian(amp=7.0, sigma=0.3),
    )
    img = system.image(el.Grid((81, 81), 0.05, supersampling=3))
    np.testing.assert_allclose(float(img.sum()), 7.0, rtol=1e-6)


def test_supersampling_converges():
    system = make_system()
    fine = system.image(el.Grid((40, 40), 0.1, supersampling=12))
    coarse = system.image(el.Grid((40, 40), 0.1, supersampling=1))
    mid = system.image(el.Grid((40, 40), 0.1, supersampling=4))
    assert rel_err(mid, fine) < rel_err(coarse, fine)


def test_image_with_psf_conserves_flux_inside(getkey):
    system = make_system()
    grid = el.Grid((64, 64), 0.05)
    psf = el.GaussianPSF(fwhm=0.1, pixel_scale=0.05)
    raw = system.image(grid)
    conv = system.image(grid, psf)
    op = system.image(grid, psf.fft_operator(grid.shape))
    assert rel_err(conv, op) < 10 * default_eps()
    # the PSF moves light only a few pixels: totals agree to the edge losses
    np.testing.assert_allclose(float(conv.sum()), float(raw.sum()), rtol=0.02)


def test_supersampled_psf_path():
    system = make_system()
    grid = el.Grid((32, 32), 0.1, supersampling=2)
    psf2 = el.GaussianPSF(fwhm=0.2, pixel_scale=0.1, supersampling=2)
    img = system.image(grid, psf2)
    assert img.shape == (32, 32)
    with pytest.raises(ValueError, match="supersampling"):
        system.image(el.Grid((32, 32), 0.1, supersampling=3), psf2)


def test_simulate_is_deterministic_and_has_the_right_noise(getkey):
    system = make_system()
    grid = el.Grid((60, 60), 0.05)
    psf = el.GaussianPSF(fwhm=0.1, pixel_scale=0.05)
    key = jax.random.key(42)
    a = el.simulate(key, system, grid, psf, exposure_time=1000.0, sky_level=2.0)
    b = el.simulate(key, system, grid, psf, exposure_time=1000.0, sky_level=2.0)
    np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))
    c = el.simulate(jax.random.key(43), system, grid, psf, exposure_time=1000.0, sky_level=2.0)
    assert not np.array_equal(np.asarray(a.data), np.asarray(c.data))
    model = system.image(grid, psf)
    pulls = (a.data - model) / a.noise_map
    assert abs(float(pulls.mean())) < 0.05
    np.testing.assert_allclose(float(pulls.std()), 1.0, atol=0.05)


def test_imaging_validation():
    psf = el.PixelPSF(np.ones((3, 3)))
    d = np.ones((10, 10))
    with pytest.raises(ValueError, match="noise_map shape"):
        el.Imaging(d, np.ones((9, 10)), psf, 0.1)
    with pytest.raises(ValueError, match="noise_map must be > 0"):
        el.Imaging(d, -np.ones((10, 10)), psf, 0.1)
    bad = d.copy()
    bad[3, 3] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        el.Imaging(bad, np.ones((10, 10)), psf, 0.1)
    noise_nan = np.ones((10, 10))
    noise_nan[2, 2] = np.nan
    with pytest.raises(ValueError, match="noise_map has 1 NaN"):
        el.Imaging(d, noise_nan, psf, 0.1)
    with pytest.raises(ValueError, match="empty"):
        el.Imaging(d, np.ones((10, 10)), psf, 0.1, mask=np.zeros((10, 10), bool))
    with pytest.raises(ValueError, match="2-d"):
        el.Imaging(np.ones(10), np.ones(10), psf, 0.1)
    # NaN outside the mask is allowed and zeroed
    m = np.ones((10, 10), bool)
    m[3, 3] = False
    ok = el.Imaging(bad, np.ones((10, 10)), psf, 0.1, mask=m)
    assert float(ok.data[3, 3]) == 0.0
    assert ok.ignored_bad_pixels == 1
    assert el.Imaging(d, np.ones((10, 10)), psf, 0.1).ignored_bad_pixels == 0
    # a PSF kernel larger than the image
    with pytest.raises(ValueError, match=r"PSF kernel \(11x11 image pixels\) is larger"):
        el.Imaging(d, np.ones((10, 10)), el.PixelPSF(np.ones((11, 11))), 0.1)


def test_a_crop_is_never_smaller_than_the_psf_kernel():
    psf = el.PixelPSF(np.ones((9, 9)))
    mask = np.zeros((30, 30), bool)
    mask[0:2, 0:2] = True  # in a corner: the default margin (4) gives a 6x6 crop
    cut = el.Imaging(np.ones((30, 30)), np.ones((30, 30)), psf, 0.1, mask=mask).cropped()
    assert cut.shape == (9, 9)
    assert int(cut.mask.sum()) == 4
    # the used pixels keep their sky positions
    full = el.Grid((30, 30), 0.1)
    x_used = np.sort(np.asarray(full.x)[mask])
    np.testing.assert_allclose(np.sort(np.asarray(cut.grid.x)[np.asarray(cut.mask)]), x_used)


def test_with_supersampling_is_the_dataset_built_at_that_factor():
    rng = np.random.default_rng(1)
    d, n = rng.normal(size=(24, 28)), 0.5 + rng.random((24, 28))
    mask = np.ones((24, 28), bool)
    mask[:3] = False
    psf = el.GaussianPSF(fwhm=0.25, pixel_scale=0.1)
    kw = dict(mask=mask, origin=(0.03, -0.1))
    fine = el.Imaging(d, n, psf, 0.1, supersampling=3, **kw)
    coarse = fine.with_supersampling(1)
    assert eqx.tree_equal(coarse, el.Imaging(d, n, psf, 0.1, supersampling=1, **kw))
    assert eqx.tree_equal(coarse.with_supersampling(3), fine)
    system = el.LensSystem(mass.SIE(theta_E=0.8, e1=0.1), source=light.Sersic(2.0, 0.2, 1.5))
    image = system.image(coarse.grid, coarse.convolution)
    np.testing.assert_array_equal(image, system.image(el.Grid((24, 28), 0.1, (0.03, -0.1)), psf))
    with pytest.raises(ValueError, match="supersampling"):
        fine.with_supersampling(0)
    psf2 = el.GaussianPSF(fwhm=0.25, pixel_scale=0.1, supersampling=3)
    with pytest.raises(ValueError, match="PSF supersampling 3 must be 1"):
        el.Imaging(d, n, psf2, 0.1, supersampling=3).with_supersampling(2)


def test_from_fits_ignores_a_nan_border_outside_the_mask_radius(tmp_path):
    from astropy.io import fits

    image = np.ones((40, 40))
    image[:, :3] = np.nan  # a cutout's NaN border
    noise = np.ones((40, 40))
    noise[-2:, :] = 0.0
    paths = {}
    for name, arr in [("image", image), ("noise", noise), ("psf", np.ones((5, 5)))]:
        paths[name] = str(tmp_path / f"{name}.fits")
        fits.PrimaryHDU(arr).writeto(paths[name])
    with pytest.raises(ValueError, match="NaN/inf pixels inside the mask"):
        el.Imaging.from_fits(paths["image"], paths["noise"], paths["psf"], 0.1)
    ds = el.Imaging.from_fits(paths["image"], paths["noise"], paths["psf"], 0.1, mask_radius=1.5)
    assert ds.ignored_bad_pixels == 40 * 3 + 2 * 37
    assert int(ds.mask.sum()) == int(el.Grid((40, 40), 0.1).circular_mask(1.5).sum())
    with pytest.raises(ValueError, match="mask_radius must be > 0"):
        el.Imaging.from_fits(paths["image"], paths["noise"], paths["psf"], 0.1, mask_radius=0.0)
    # exclude_bad: every usable pixel of the whole image (where `equilens fit` grows a mask)
    every = el.Imaging.from_fits(
        paths["image"], paths["noise"], paths["psf"], 0.1, exclude_bad=True
    )
    assert int(every.mask.sum()) == 37 * 38 and every.ignored_bad_pixels == 40 * 3 + 2 * 37


def test_float32_is_announced_and_float64_is_silent():
    import warnings

    psf = el.PixelPSF(np.ones((3, 3)))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        el.Imaging(np.ones((8, 8)), np.ones((8, 8)), psf, 0.1)
    found = [w for w in seen if issubclass(w.category, el.PrecisionWarning)]
    if jax.config.jax_enable_x64:  # pyright: ignore[reportAttributeAccessIssue]
        assert found == []
    else:
        assert len(found) == 1 and "x64 flag is off" in str(found[0].message)


def test_imaging_from_fits_real_data():
    ds = el.Imaging.from_fits(
        os.path.join(DATA, "image.fits"),
        os.path.join(DATA, "noise_map.fits"),
        os.path.join(DATA, "psf.fits"),
        pixel_scale=0.05,
        exclude_mask=os.path.join(DATA, "mask_extra_galaxies.fits"),
    )
    assert ds.shape == (281, 281)
    assert ds.psf.kernel().shape == (21, 21)
    assert 0 < int(ds.mask.sum()) < 281 * 281
    # the lens galaxy is the brightest thing near the centre
    assert float(ds.data[140, 140]) > float(jnp.median(ds.data))
    with pytest.raises(ValueError, match="not found"):
        el.Imaging.from_fits("nope.fits", "nope.fits", "nope.fits", pixel_scale=0.05)


def test_lens_system_gradients_are_finite():
    system = make_system()
    grid = el.Grid((30, 30), 0.1)
    psf = el.GaussianPSF(fwhm=0.1, pixel_scale=0.1)
    g = eqx.filter_jit(eqx.filter_grad(lambda s: jnp.sum(s.image(grid, psf) ** 2)))(system)
    assert all(bool(jnp.all(jnp.isfinite(leaf))) for leaf in jax.tree.leaves(g))


def test_source_plane_image():
    system = make_system()
    sp = system.source_plane_image(el.Grid((21, 21), 0.02, origin=(0.05, 0.02)))
    assert sp.shape == (21, 21) and int(jnp.argmax(sp)) == 10 * 21 + 10


@pytest.mark.parametrize("supersampling", [1, 3])
def test_padded_domain_image_equals_pad_then_convolve(supersampling):
    # LensSystem.image evaluates the model on the FFT's padded domain (zeros outside); it must
    # equal binning on the grid, zero-padding and convolving, and a direct convolution.
    system = make_system()
    grid = el.Grid((47, 60), 0.07, origin=(0.1, -0.05), supersampling=supersampling)
    psf = el.PixelPSF(np.asarray(el.GaussianPSF(fwhm=0.2, pixel_scale=0.07).kernel()))
    fast = system.image(grid, psf)
    x, y = grid.coordinates(supersampled=True)
    binned = grid.bin(system.surface_brightness(x, y) * grid.pixel_area)
    reference = psf.fft_operator(grid.shape)(binned)
    direct = psf.convolve(binned, method="direct")
    assert rel_err(fast, reference) < 100 * default_eps()
    assert rel_err(fast, direct) < 100 * default_eps()


def test_padded_grid_shares_pixels():
    g = el.Grid((5, 7), 0.1, origin=(0.3, -0.2), supersampling=2)
    p = g.padded((9, 12))
    np.testing.assert_allclose(p.x[:5, :7], g.x, atol=10 * default_eps())
    np.testing.assert_allclose(p.y[:5, :7], g.y, atol=10 * default_eps())
    with pytest.raises(ValueError, match="smaller"):
        g.padded((4, 7))


def test_outputs_are_replaced_in_one_step_or_not_at_all(tmp_path):
    from equilens._files import atomic_path

    target = tmp_path / "out.json"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        with open(tmp, "w") as f:
            f.write("half of the new")
        raise RuntimeError("interrupted")
    assert target.read_text() == "old"  # untouched, and no temporary file left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]
    with atomic_path(target) as tmp:
        assert tmp.endswith(".json") and os.path.dirname(tmp) == str(tmp_path)
        with open(tmp, "w") as f:
            f.write("new")
    assert target.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]
    # the permissions of a file written the ordinary way
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    assert (target.stat().st_mode & 0o777) == (plain.stat().st_mode & 0o777)


def _compact_lens(psf, grid):
    """A lens with a bright compact source and a sharp lens core, seen through `psf`."""
    truth = el.LensSystem(
        mass=mass.SIE(theta_E=0.8, e1=0.05),
        lens_light=light.Sersic(amp=40.0, R_sersic=0.3, n_sersic=4.0),
        source=light.Sersic(amp=400.0, R_sersic=0.03, n_sersic=1.0, center_x=0.05),
    )
    return el.simulate(jax.random.key(2), truth, grid, psf, exposure_time=3000.0, sky_level=1.0)


@pytest.mark.precision_independent
def test_psf_much_wider_than_the_data_is_warned_about():
    """The data are the sky convolved with the PSF, so a kernel more than twice as wide
    as the data's narrowest bright feature is not theirs: a `DataWarning`; the data's own
    PSF (and the shipped HST lens's) passes silently (the suite turns warnings into
    errors)."""
    grid = el.Grid((60, 60), 0.05)
    own = el.GaussianPSF(fwhm=0.1, pixel_scale=0.05)
    data = _compact_lens(own, grid)
    args = (np.asarray(data.data), np.asarray(data.noise_map))
    el.Imaging(*args, own, 0.05)  # no warning
    wider = el.GaussianPSF(fwhm=0.3, pixel_scale=0.05)  # 3x: e.g. another band's
    finer = el.PixelPSF(el.GaussianPSF(fwhm=0.1, pixel_scale=0.015).kernel())  # 0.015"/pixel
    flat = el.PixelPSF(np.ones((15, 15)))
    for psf in (wider, finer, flat):
        with pytest.warns(el.DataWarning, match="more than twice as wide"):
            el.Imaging(*args, psf, 0.05)
    # at low S/N nothing can be told apart: no warning
    faint = np.asarray(data.data) * 0.02
    el.Imaging(faint, args[1], flat, 0.05)
    el.Imaging.from_fits(
        os.path.join(DATA, "image.fits"),
        os.path.join(DATA, "noise_map.fits"),
        os.path.join(DATA, "psf.fits"),
        0.05,
    )
