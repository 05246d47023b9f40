"""Rival minima (`equilens.solve.with_rival_minima`): other minima that fit as well with
another Einstein radius are reported, never dropped silently."""

import dataclasses

import pytest

import equilens as el
from equilens import light, mass
from equilens.solve import RESULTS, RIVAL_TOLERANCE


def _model(theta_E):
    return el.LensSystem(
        mass=mass.SIE(theta_E=theta_E) + mass.ExternalShear(0.0, 0.0),
        source=light.Sersic(amp=1.0, R_sersic=0.1, n_sersic=1.0),
    )


def _theta(m):
    return m.mass.components[0].theta_E


def _objective(tilt_sigma=None):
    # two minima, at theta_E = 1.0 and 1.3, of equal depth: a residual that vanishes at
    # both; an optional Gaussian prior centred on the second deepens it by
    # 0.3^2 / (2 tilt_sigma^2)
    terms = [el.GaussianPrior(lambda m: (_theta(m) - 1.0) * (_theta(m) - 1.3), 0.0, 0.001)]
    if tilt_sigma is not None:
        terms.append(el.GaussianPrior(_theta, 1.3, tilt_sigma))
    return el.Objective(terms)


def _fit(objective, theta_E):
    model = _model(theta_E)
    free = el.select(model, _theta)
    return el.solve.fit(objective, model, "lm", free=free, throw=False), free


@pytest.mark.parametrize("tilt", [None, 1.0])
def test_an_equally_good_minimum_makes_the_fit_ambiguous(tilt):
    objective = _objective(tilt)
    chosen, free = _fit(objective, 0.97)
    assert chosen.success and float(_theta(chosen.model)) == pytest.approx(1.0, abs=1e-3)
    rival, _ = _fit(objective, 1.33)
    near, _ = _fit(objective, 1.02)  # the same minimum: no rival
    result, rivals = el.solve.with_rival_minima(
        objective, chosen, [near, rival], solver="lm", free=free
    )
    assert len(rivals) == 1
    # equally deep: the chosen one stays, with its rival named; the candidate deeper (by
    # 0.045): it is chosen, and the first one is its rival
    kept, other = (1.0, 1.3) if tilt is None else (1.3, 1.0)
    assert float(_theta(result.model)) == pytest.approx(kept, abs=1e-3)
    assert float(_theta(rivals[0].model)) == pytest.approx(other, abs=1e-3)
    assert result.covariance.shape == (1, 1)
    assert result.result == RESULTS.ambiguous and not result.success
    assert result.message().startswith("ambiguous: a rival minimum fits as well")
    assert "theta_E 1.3000" in result.message() or "theta_E 1.0000" in result.message()


def test_a_much_better_minimum_is_chosen_and_a_much_worse_one_ignored():
    # the minimum at 1.3 deeper by 0.3^2 / (2 0.09^2) = 5.6 > RIVAL_TOLERANCE
    objective = _objective(0.09)
    chosen, free = _fit(objective, 0.97)
    rival, _ = _fit(objective, 1.33)
    gap = float(chosen.value) - float(rival.value)
    assert gap > RIVAL_TOLERANCE
    result, rivals = el.solve.with_rival_minima(objective, chosen, [rival], free=free)
    assert rivals == () and result.success
    assert float(_theta(result.model)) == pytest.approx(1.3, abs=1e-3)
    # from the deep one, the shallow one is too far above to be refitted at all
    result, rivals = el.solve.with_rival_minima(objective, rival, [chosen], free=free)
    assert rivals == () and result is rival


def test_a_candidate_far_above_is_not_refitted():
    objective = _objective()
    chosen, free = _fit(objective, 0.97)
    rival, _ = _fit(objective, 1.33)
    # the candidates' values from a cheaper objective: far above the chosen one there
    far = dataclasses.replace(rival, value=rival.value + 3 * RIVAL_TOLERANCE)
    result, rivals = el.solve.with_rival_minima(objective, chosen, [far], free=free)
    assert rivals == () and result is chosen
    result, rivals = el.solve.with_rival_minima(
        objective, chosen, [far], free=free, candidates_reference=float(far.value)
    )
    assert len(rivals) == 1 and result.result == RESULTS.ambiguous


def test_a_later_stage_keeps_the_rivals_of_the_fit_it_started_from():
    """The pixelized chain starts from `fit_lens`'s chosen minimum: the rivals that fit
    found stay named in the chain's result (`with_earlier_rivals`), its status ambiguous."""
    objective = _objective()
    chosen, free = _fit(objective, 0.97)
    rival, _ = _fit(objective, 1.33)
    earlier, _ = el.solve.with_rival_minima(objective, chosen, [rival], free=free)
    later = el.solve.with_earlier_rivals(chosen, earlier, "parametric fit")
    assert later.result == RESULTS.ambiguous and not later.success
    assert later.message().startswith("ambiguous: parametric fit: a rival minimum fits as well")
    assert "started from its chosen minimum only" in later.message()
    # no rivals earlier: nothing changes; an unsuccessful later fit keeps its status
    assert el.solve.with_earlier_rivals(chosen, chosen, "parametric fit") is chosen
    stopped = dataclasses.replace(chosen, result=RESULTS.nonlinear_max_steps_reached)
    kept = el.solve.with_earlier_rivals(stopped, earlier, "parametric fit")
    assert kept.result == RESULTS.nonlinear_max_steps_reached and len(kept.notes) == 1
