"""The check for arcs left in a fit's residuals (`equilens.solve.arc_residuals`)."""

import dataclasses

import jax
import numpy as np
import pytest

import equilens as el
from equilens import light, mass
from equilens.objective import select
from equilens.solve import ArcResiduals, arc_residuals, lens_arc_residuals
from equilens.solve._residuals import ARC_RESIDUAL_LIMIT, _data_kernel, with_arc_check

TRUTH = el.LensSystem(
    mass=mass.SIE(theta_E=1.0, e1=0.08, e2=-0.04) + mass.ExternalShear(0.03, -0.01),
    lens_light=light.Sersic(amp=3.0, R_sersic=0.5, n_sersic=3.0, e1=0.05),
    source=light.Sersic(amp=15.0, R_sersic=0.12, n_sersic=1.2, center_x=0.05, e2=0.1),
)


@pytest.fixture(scope="module")
def data():
    grid = el.Grid((50, 50), 0.06)
    psf = el.GaussianPSF(0.12, 0.06)
    return el.simulate(jax.random.key(3), TRUTH, grid, psf, exposure_time=1500.0, sky_level=0.5)


def _images(system, imaging):
    model = np.asarray(system.image(imaging.grid, imaging.convolution))
    lensed = dataclasses.replace(system, lens_light=None)
    return model, np.asarray(lensed.image(imaging.grid, imaging.convolution))


def test_the_true_model_leaves_noise_over_the_arcs_and_elsewhere(data):
    check = lens_arc_residuals(data, TRUTH)
    assert isinstance(check, ArcResiduals)
    # the arcs are found (the source's ring, hundreds of pixels), and the filtered
    # residuals of pure noise have unit variance there and elsewhere
    assert check.n_arcs > 100 and check.n_elsewhere > 100
    assert 0.7 < check.arcs < 1.4, check
    assert 0.7 < check.elsewhere < 1.4, check
    assert not check.left


def test_a_model_without_the_arcs_leaves_them(data):
    # the lens light alone: the arcs are in the data minus the lens light, not in the model
    dim = dataclasses.replace(TRUTH, source=light.Sersic(amp=0.0, R_sersic=0.12, n_sersic=1.2))
    check = lens_arc_residuals(data, dim)
    assert check.left and check.excess > 10 * ARC_RESIDUAL_LIMIT, check
    assert "arcs left in the residuals" in check.note()
    # half the source's flux: still left
    half = dataclasses.replace(TRUTH, source=dataclasses.replace(TRUTH.source, amp=7.5))
    assert lens_arc_residuals(data, half).left


def test_an_overstated_noise_map_does_not_hide_or_invent_arcs(data):
    # (Euclid's resampled mosaics: an RMS map 1.4x the pixel noise): the noise level
    # elsewhere drops below 1 and is floored there, so a good model is not flagged...
    loud = el.Imaging(data.data, 1.4 * data.noise_map, el.GaussianPSF(0.12, 0.06), 0.06)
    good = lens_arc_residuals(loud, TRUTH)
    assert good.elsewhere < 0.8 and not good.left
    # ...and a missing source is still found
    dim = dataclasses.replace(TRUTH, source=light.Sersic(amp=0.0, R_sersic=0.12, n_sersic=1.2))
    assert lens_arc_residuals(loud, dim).left


def test_arc_check_marks_a_successful_fit_implausible(data):
    objective = el.Objective([el.GaussianLikelihood(data)])
    # (the amplitudes are solved linearly: a source in the wrong place misses the arcs)
    off = light.Sersic(amp=1.0, R_sersic=0.12, n_sersic=1.2, center_x=0.3, center_y=0.2)
    dim = dataclasses.replace(TRUTH, source=off)
    free = select(dim, lambda s: s.lens_light.R_sersic)
    result = el.solve.fit(objective, dim, "lm", free=free, max_steps=50, throw=False)
    assert result.success, result.message()
    checked, check = with_arc_check(data, result)
    assert check.left and checked.arc_residuals is check
    assert checked.message().startswith("implausible: arcs left in the residuals")
    d = el.solve.result_to_dict(checked)
    assert d["arc_residuals"]["excess"] == pytest.approx(check.excess)
    # a good model keeps its status, with the numbers attached
    kept, check = with_arc_check(data, dataclasses.replace(result, model=TRUTH))
    assert kept.success and not check.left and kept.arc_residuals is check


def test_inputs_are_checked_and_a_supersampled_psf_is_binned(data):
    model, source = _images(TRUTH, data)
    with pytest.raises(ValueError, match="shape"):
        arc_residuals(data, model[:-1], source[:-1])
    # a PSF given at 3x the data's resolution is summed over 3x3 blocks
    fine = el.GaussianPSF(0.12, 0.06, supersampling=3)
    sup = el.Imaging(data.data, data.noise_map, fine, 0.06, supersampling=3)
    k = _data_kernel(sup)
    coarse = np.asarray(el.GaussianPSF(0.12, 0.06).kernel())
    assert k.shape == (9, 9) and k.sum() == pytest.approx(1.0)
    # (both integrate the Gaussian over the data's pixels: the same kernel, cut to 9x9)
    np.testing.assert_allclose(k, coarse[1:-1, 1:-1] / coarse[1:-1, 1:-1].sum(), atol=1e-6)


def test_band_checks_name_the_band_that_leaves_arcs(data):
    from equilens.solve._residuals import with_band_arc_checks

    objective = el.Objective([el.GaussianLikelihood(data)])
    free = select(TRUTH, lambda s: s.lens_light.R_sersic)
    result = el.solve.fit(objective, TRUTH, "lm", free=free, max_steps=50, throw=False)
    assert result.success, result.message()
    both = el.MultiBandImaging([data, data], names=["g", "r"])
    off = light.Sersic(amp=1.0, R_sersic=0.12, n_sersic=1.2, center_x=0.3, center_y=0.2)
    missing = dataclasses.replace(TRUTH, source=off)
    checked = with_band_arc_checks(both, result, [TRUTH, missing])
    assert not checked.success and len(checked.notes) == 1
    assert checked.notes[0].startswith("band r: arcs left in the residuals")
    assert checked.arc_residuals == lens_arc_residuals(data, missing)  # the worst band
    kept = with_band_arc_checks(both, result, [TRUTH, TRUTH])
    assert kept.success and not kept.notes and not kept.arc_residuals.left
