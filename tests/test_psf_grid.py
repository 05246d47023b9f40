"""Grids, masks, PSFs and convolution."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.signal

import equilens as el
from equilens.psf import fast_fft_size, fft_padded_shape
from helpers import default_eps, rel_err


def test_grid_conventions():
    g = el.Grid((3, 4), 0.5, origin=(1.0, -2.0))
    # x grows with the column, y with the row, centred on the array centre + origin
    np.testing.assert_allclose(g.x[0], [0.25, 0.75, 1.25, 1.75])
    np.testing.assert_allclose(g.y[:, 0], [-2.5, -2.0, -1.5])
    assert g.pixel_area == 0.25


def test_supersampled_grid_bins_back_to_pixel_centres():
    g = el.Grid((5, 6), 0.1, supersampling=3)
    xs, ys = g.coordinates(supersampled=True)
    assert xs.shape == (15, 18)
    np.testing.assert_allclose(g.bin(xs), g.x, atol=10 * default_eps())
    np.testing.assert_allclose(g.bin(ys), g.y, atol=10 * default_eps())


def test_masks():
    g = el.Grid((41, 41), 0.1)
    m = g.circular_mask(1.0)
    assert m.dtype == bool and m[20, 20] and not m[0, 0]
    assert abs(m.sum() * 0.01 - np.pi) < 0.1
    a = g.annular_mask(0.5, 1.0)
    assert not a[20, 20] and a[20, 30]
    with pytest.raises(ValueError, match="inner_radius"):
        g.annular_mask(1.0, 0.5)
    mg = g.masked(m)
    assert mg.x.shape == (int(m.sum()),)
    img = mg.scatter(jnp.ones(mg.n_pixels))
    np.testing.assert_array_equal(np.asarray(img) > 0, m)
    with pytest.raises(ValueError, match="empty"):
        g.masked(np.zeros((41, 41), bool))


def test_bad_grids_raise():
    with pytest.raises(ValueError, match="pixel_scale"):
        el.Grid((3, 3), -0.1)
    with pytest.raises(ValueError, match="supersampling"):
        el.Grid((3, 3), 0.1, supersampling=0)
    with pytest.raises(ValueError, match="pixel_scale"):
        el.Grid((3, 3), float("inf"))
    # a third axis is refused, not cut off (by the annotation where beartype checks it, as
    # in these tests, else by Grid's own check)
    with pytest.raises((ValueError, TypeError), match=r"\(10, 10, 3\)"):
        el.Grid((10, 10, 3), 0.1)
    with pytest.raises((ValueError, TypeError), match=r"2\.5"):
        el.Grid((10, 2.5), 0.1)


@pytest.mark.parametrize("shape, ksize", [((100, 100), 21), ((37, 52), 9), ((20, 20), 31)])
def test_fft_convolution_equals_direct_and_scipy(shape, ksize, getkey):
    img = jax.random.normal(getkey(), shape, dtype=jnp.result_type(float))
    ker = jax.random.uniform(getkey(), (ksize, ksize), dtype=jnp.result_type(float))
    psf = el.PixelPSF(ker)
    fft = psf.convolve(img, method="fft")
    direct = psf.convolve(img, method="direct")
    ref = scipy.signal.convolve2d(np.asarray(img), np.asarray(psf.kernel()), mode="same")
    assert rel_err(fft, ref) < 100 * default_eps()
    assert rel_err(direct, ref) < 100 * default_eps()
    op = psf.fft_operator(shape)
    assert rel_err(op(img), fft) < 10 * default_eps()


def test_fft_padding_is_minimal_and_fast():
    assert fft_padded_shape((100, 100), (21, 21)) == (112, 112)  # >= 110, 7-smooth
    assert fast_fft_size(121) == 125
    assert fast_fft_size(11) == 12


def test_psf_validation():
    with pytest.raises(ValueError, match="odd"):
        el.PixelPSF(np.ones((4, 5)))
    with pytest.raises(ValueError, match="NaN"):
        el.PixelPSF(np.full((3, 3), np.nan))
    with pytest.raises(ValueError, match="2-d"):
        el.PixelPSF(np.ones(3))
    k = el.PixelPSF(np.ones((3, 3))).kernel()
    np.testing.assert_allclose(float(k.sum()), 1.0)


def test_gaussian_psf_matches_its_fwhm():
    psf = el.GaussianPSF(fwhm=0.2, pixel_scale=0.02)
    k = np.asarray(psf.kernel())
    assert k.shape[0] % 2 == 1
    np.testing.assert_allclose(k.sum(), 1.0, rtol=10 * default_eps())
    c = k.shape[0] // 2
    xs = (np.arange(k.shape[0]) - c) * 0.02
    var = float((k.sum(axis=0) * xs**2).sum())
    sigma = 0.2 / (2 * np.sqrt(2 * np.log(2)))
    np.testing.assert_allclose(var, sigma**2 + 0.02**2 / 12, rtol=1e-3)  # + pixel boxcar
