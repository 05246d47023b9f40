"""The mask grown to the arcs (`grow_mask`, `fit_to_arcs`): lensed light that continues
beyond a hand-drawn circle joins the mask; the lens light's residuals and the user's
excluded pixels do not."""

import dataclasses

import jax
import numpy as np
import pytest

import equilens as el
from equilens import light, mass
from equilens.solve import fit_to_arcs, grow_mask
from equilens.solve._mask import _on_region
from helpers import slow_ci

THETA_E = 1.0


@pytest.fixture(scope="module")
def lens():
    """A lens whose arcs (theta_E 1", a source of 0.12") straddle a circle of 1.05"."""
    truth = el.LensSystem(
        mass=mass.SIE(theta_E=THETA_E, e1=0.08, e2=-0.04) + mass.ExternalShear(0.03, -0.01),
        lens_light=light.Sersic(amp=3.0, R_sersic=0.5, n_sersic=3.0, e1=0.05),
        source=light.Sersic(amp=15.0, R_sersic=0.12, n_sersic=1.2, center_x=0.05, e2=0.1),
    )
    grid = el.Grid((60, 60), 0.06)
    psf = el.GaussianPSF(0.12, 0.06)
    data = el.simulate(jax.random.key(0), truth, grid, psf, exposure_time=1500.0, sky_level=0.5)
    region = el.Imaging(data.data, data.noise_map, data.psf, 0.06)
    lensed = dataclasses.replace(truth, lens_light=None).image(grid, psf)
    # where the noise-free arcs are above a third of the noise
    arcs = np.asarray(lensed) / np.asarray(data.noise_map) > 0.33
    return truth, region, arcs


def _dilated(a: np.ndarray, n: int) -> np.ndarray:
    import scipy.ndimage as ndi

    return ndi.binary_dilation(a, np.ones((3, 3), dtype=bool), iterations=n)


def test_a_circle_that_cuts_the_arcs_grows_onto_them_alone(lens):
    truth, region, arcs = lens
    mask = np.asarray(region.grid.circular_mask(1.05))
    assert (arcs & ~mask).sum() > 40  # the arcs continue beyond the circle
    growth = grow_mask(region, mask, truth)
    added = growth.mask & ~mask
    assert growth.added == int(added.sum()) > 20 and (growth.mask >= mask).all()
    # what joins is the arcs (and the margin around them), nothing else
    assert not (added & ~_dilated(arcs, 2)).any()
    assert (added & arcs).sum() >= 0.5 * (arcs & ~mask).sum()
    assert "pixels added" in growth.summary()


def test_the_lens_lights_residuals_do_not_grow_the_mask(lens):
    """A lens light too faint by 20% leaves its residual all around the circle, far above
    the noise: only the arcs join (the model's own lensed source says where they go)."""
    truth, region, arcs = lens
    mask = np.asarray(region.grid.circular_mask(1.05))
    faint = dataclasses.replace(
        truth, lens_light=dataclasses.replace(truth.lens_light, amp=0.8 * truth.lens_light.amp)
    )
    growth = grow_mask(region, mask, faint)
    added = growth.mask & ~mask
    assert growth.added > 20 and not (added & ~_dilated(arcs, 2)).any()


def test_excluded_pixels_and_a_mask_that_holds_the_arcs_stay_as_they_are(lens):
    truth, region, _ = lens
    # the user's exclusion over the lower half: nothing is added there
    usable = np.ones(region.shape, dtype=bool)
    usable[:30] = False
    half = el.Imaging(region.data, region.noise_map, region.psf, 0.06, mask=usable)
    mask = np.asarray(region.grid.circular_mask(1.05)) & usable
    growth = grow_mask(half, mask, truth)
    assert growth.added > 0 and not (growth.mask & ~usable).any()
    # a circle around the whole ring: nothing beyond it to add
    wide = np.asarray(region.grid.circular_mask(1.6))
    assert grow_mask(region, wide, truth).added == 0
    with pytest.raises(ValueError, match="outside the region"):
        grow_mask(half, wide, truth)
    with pytest.raises(ValueError, match="shape"):
        grow_mask(region, wide[1:], truth)


def test_the_data_are_placed_on_the_regions_pixels(lens):
    _, region, _ = lens
    circle = region.grid.circular_mask(1.05)
    cut = el.Imaging(region.data, region.noise_map, region.psf, 0.06, mask=circle)
    assert (_on_region(region, cut.cropped()) == np.asarray(circle)).all()
    off = el.Imaging(
        region.data[:40, :40], region.noise_map[:40, :40], region.psf, 0.06, origin=(0.03, 0.0)
    )
    with pytest.raises(ValueError, match="not a part of the region"):
        _on_region(region, off)


@slow_ci
def test_fit_to_arcs_refits_on_the_grown_mask(lens):
    """From a fit on the cut circle, the mask grows once onto the arcs (then no more), the
    refit is successful and theta_E stays at the truth."""
    truth, region, _ = lens
    cut = el.Imaging(
        region.data, region.noise_map, region.psf, 0.06, mask=region.grid.circular_mask(1.05)
    ).cropped()
    start = el.fit(
        el.Objective([el.GaussianLikelihood(cut, nonnegative=True)]),
        truth,
        "lm",
        throw=False,
        covariance=False,
    )
    # a rival minimum that the fit on the circle named stays named after the refit
    note = "a rival minimum fits as well: theta_E 1.2000 against 1.0000 (objective +1.00)"
    start = dataclasses.replace(start, notes=(note,))
    r, grown, rounds = fit_to_arcs(region, cut, start, log=None)
    # (ambiguous only from a successful refit: `with_earlier_rivals` keeps another status)
    assert r.result == el.solve.RESULTS.ambiguous and note in r.message()
    assert rounds[0].added > 20 and rounds[-1].added == 0 and len(rounds) <= 3
    assert int(np.asarray(grown.mask).sum()) == int(np.asarray(cut.mask).sum()) + sum(
        g.added for g in rounds
    )
    te = float(r.model.mass.components[0].theta_E)
    assert abs(te - THETA_E) < 5 * float(np.sqrt(r.covariance[0, 0])) + 2e-3
    assert r.n_data == int(np.asarray(grown.mask).sum())
