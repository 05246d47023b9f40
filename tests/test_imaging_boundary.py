"""Property-based tests of the dataset boundary: `Imaging` from arrays and from FITS files,
and `PixelPSF` kernels. The property: a `ValueError` exactly when a pixel the fit uses is
bad (NaN or infinite data or noise, noise <= 0), the mask is empty, or the PSF cannot be
used; otherwise a dataset whose used pixels are the given ones, whose other pixels are
neutral, whose bad unused pixels are counted, and whose likelihood is finite."""

import math
import tempfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from astropy.io import fits
from hypothesis import HealthCheck, event, given, settings, strategies as st

import equilens as el
from equilens import light, mass
from helpers import slow_ci

SETTINGS = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
BAD = st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -1.0, -0.0])


@st.composite
def _dataset(draw):
    """Finite data and positive noise, in half the cases a few pixels of either made bad
    (NaN, inf, zero or negative noise), a random, full or empty mask, and a PSF kernel of
    1 to 9 pixels."""
    ny, nx = draw(st.integers(3, 9)), draw(st.integers(3, 9))
    size = ny * nx
    data = np.array(draw(st.lists(st.floats(-1e3, 1e3), min_size=size, max_size=size)))
    noise = np.array(draw(st.lists(st.floats(1e-3, 1e3), min_size=size, max_size=size)))
    corrupt = draw(st.booleans())
    for target in (data, noise) if corrupt else ():
        for i, v in draw(st.lists(st.tuples(st.integers(0, size - 1), BAD), max_size=2)):
            target[i] = v
    kind = draw(st.sampled_from(["random", "random", "random", "full", "empty"]))
    if kind == "random":
        mask = np.array(draw(st.lists(st.booleans(), min_size=size, max_size=size)))
    else:
        mask = np.full(size, kind == "full")
    k = draw(st.sampled_from([1, 3, 3, 5, 9]))
    kernel = np.exp(-0.5 * (np.arange(k) - k // 2) ** 2)
    shape = (ny, nx)
    return data.reshape(shape), noise.reshape(shape), mask.reshape(shape), np.outer(kernel, kernel)


def _expected_error(data, noise, mask, kernel, from_fits: bool = False) -> str | None:
    """What `Imaging` must refuse, from the arrays alone (None: nothing); `from_fits`: also
    what `Imaging.from_fits` refuses besides (a kernel as large as the image: the wrong
    file)."""
    bad = ~(np.isfinite(data) & np.isfinite(noise) & (np.nan_to_num(noise) > 0))
    if not mask.any():
        return "mask is empty"
    if bad[mask].any():
        return "inside the mask"
    if kernel.shape[0] > data.shape[0] or kernel.shape[1] > data.shape[1]:
        return "larger than"
    if from_fits and (kernel.shape[0] >= data.shape[0] or kernel.shape[1] >= data.shape[1]):
        return "is as large as the image"
    return None


def _check(make, data, noise, mask, kernel, from_fits: bool = False):
    expected = _expected_error(data, noise, mask, kernel, from_fits)
    try:
        imaging = make()
    except ValueError as err:
        event("refused")
        assert expected is not None, f"refused a valid dataset: {err}"
        assert expected in str(err), (expected, str(err))
        return
    event("accepted")
    assert expected is None, f"accepted a dataset with a problem ({expected})"
    used = np.asarray(imaging.mask)
    np.testing.assert_array_equal(used, mask)
    got = np.asarray(imaging.data)
    np.testing.assert_array_equal(got[mask], data[mask].astype(got.dtype))  # (float32: rounded)
    # unused pixels are neutral (0 data, unit noise), and the bad ones among them counted
    assert np.all(np.asarray(imaging.data)[~mask] == 0.0)
    assert np.all(np.asarray(imaging.noise_map)[~mask] == 1.0)
    bad = ~(np.isfinite(data) & np.isfinite(noise) & (np.nan_to_num(noise) > 0))
    assert imaging.ignored_bad_pixels == int((bad & ~mask).sum())
    system = el.LensSystem(mass=mass.SIS(theta_E=0.2), source=light.Gaussian(amp=1.0, sigma=0.1))
    value = el.GaussianLikelihood(imaging, linear=False)(system)
    assert np.isfinite(float(value))


@SETTINGS
@given(case=_dataset())
def test_imaging_from_arrays_refuses_exactly_the_bad_datasets(case):
    data, noise, mask, kernel = case
    psf = el.PixelPSF(kernel)
    _check(lambda: el.Imaging(data, noise, psf, 0.1, mask=mask), data, noise, mask, kernel)


@slow_ci
@pytest.mark.precision_independent
@SETTINGS
@given(case=_dataset())
def test_imaging_from_fits_refuses_exactly_the_bad_datasets(case):
    """The same through FITS files, in big-endian float32 as telescopes write them (the
    values are first rounded to float32, so the expectations are computed from those);
    the mask is given by the FITS file of pixels to exclude (non-zero = excluded)."""
    data, noise, mask, kernel = case
    data, noise = data.astype(">f4"), noise.astype(">f4")
    with tempfile.TemporaryDirectory() as tmp:
        paths = {name: Path(tmp) / f"{name}.fits" for name in ("image", "noise", "psf", "bad")}
        fits.PrimaryHDU(data).writeto(paths["image"])
        fits.PrimaryHDU(noise).writeto(paths["noise"])
        fits.PrimaryHDU(kernel.astype(">f8")).writeto(paths["psf"])
        fits.PrimaryHDU((~mask).astype(np.int16)).writeto(paths["bad"])

        def make():
            return el.Imaging.from_fits(
                paths["image"], paths["noise"], paths["psf"], 0.1, exclude_mask=paths["bad"]
            )

        with np.errstate(over="ignore", invalid="ignore"):
            as64 = data.astype(np.float64), noise.astype(np.float64)
        _check(make, *as64, mask, kernel, from_fits=True)


@pytest.mark.precision_independent
@SETTINGS
@given(
    side=st.integers(1, 8),
    values=st.lists(st.floats(-1.0, 1.0, allow_nan=False), min_size=64, max_size=64),
    special=st.sampled_from([None, math.nan, math.inf]),
)
def test_a_pixel_psf_refuses_its_kernel_or_is_normalised(side, values, special):
    kernel = np.array(values[: side * side]).reshape(side, side)
    if special is not None:
        kernel[0, 0] = special
    try:
        psf = el.PixelPSF(kernel)
    except ValueError as err:
        ok = side % 2 == 1 and np.all(np.isfinite(kernel)) and kernel.sum() > 0
        assert not ok, f"refused a usable kernel: {err}"
        return
    assert side % 2 == 1 and np.all(np.isfinite(kernel)) and kernel.sum() > 0
    k = np.asarray(psf.kernel())
    assert np.all(np.isfinite(k)) and abs(float(k.sum()) - 1.0) < 1e-5
    # convolving a point gives the normalised kernel's flux
    image = jnp.zeros((9, 9)).at[4, 4].set(1.0)
    out = psf.fft_operator((9, 9))(image)
    assert abs(float(jnp.sum(out)) - 1.0) < 1e-4
