"""Posterior sampling (`equilens.sample`, NUTS from blackjax) against analytic posteriors:
a linear-Gaussian problem (the amplitudes of an imaging likelihood, sampled rather than
solved) and a Gaussian prior truncated by a parameter's bounds (which checks the
log-Jacobian of the bounded map)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import equilens as el
from equilens import light, mass
from helpers import slow_ci

pytest.importorskip("blackjax")

pytestmark = pytest.mark.x64_only


def _amplitude_problem():
    truth = el.LensSystem(
        mass=mass.SIE(theta_E=1.0, e1=0.05),
        lens_light=light.Sersic(amp=3.0, R_sersic=0.6, n_sersic=3.0),
        source=light.Sersic(amp=10.0, R_sersic=0.2, n_sersic=1.0, center_x=0.05),
    )
    grid = el.Grid((30, 30), 0.1)
    data = el.simulate(
        jax.random.key(3), truth, grid, el.GaussianPSF(0.15, 0.1), exposure_time=200.0,
        sky_level=0.5, mask=grid.circular_mask(1.45),
    )  # fmt: skip
    term = el.GaussianLikelihood(data, linear=False)
    free = jax.tree.map(
        lambda a, b: a or b,
        el.select(truth, lambda s: s.lens_light.amp),
        el.select(truth, lambda s: s.source.amp),
    )
    return truth, term, free


def _analytic(term, truth):
    """The Gaussian posterior of the two amplitudes (flat prior): the model is linear in
    them, so the whitened residuals are r(a) = r(0) - B a."""

    def residuals(a_lens, a_src):
        m = truth.__class__(
            mass=truth.mass,
            lens_light=light.Sersic(amp=a_lens, R_sersic=0.6, n_sersic=3.0),
            source=light.Sersic(amp=a_src, R_sersic=0.2, n_sersic=1.0, center_x=0.05),
        )
        return np.asarray(term.residuals(m))

    r0 = residuals(0.0, 0.0)
    basis = np.stack([r0 - residuals(1.0, 0.0), r0 - residuals(0.0, 1.0)], axis=1)
    cov = np.linalg.inv(basis.T @ basis)
    return cov @ basis.T @ r0, cov


def truncated_normal(mu, sigma, lo, hi):
    """The mean and standard deviation of N(mu, sigma^2) truncated to (lo, hi)."""
    a, b = (lo - mu) / sigma, (hi - mu) / sigma
    pdf = lambda x: math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    cdf = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))
    z = cdf(b) - cdf(a)
    mean = mu + sigma * (pdf(a) - pdf(b)) / z
    sd = sigma * math.sqrt(1 + (a * pdf(a) - b * pdf(b)) / z - ((pdf(a) - pdf(b)) / z) ** 2)
    return mean, sd


@pytest.mark.slow
def test_nuts_matches_a_linear_gaussian_posterior():
    truth, term, free = _amplitude_problem()
    mean, cov = _analytic(term, truth)
    objective = el.Objective(term)
    start = el.fit(objective, truth, free=free)
    post = el.sample(jax.random.key(0), objective, start, free=free, n_warmup=300)
    assert set(post.names) == {"lens_light.amp", "source.amp"}
    order = [0, 1] if post.names[0] == "lens_light.amp" else [1, 0]
    mean, cov = mean[order], cov[np.ix_(order, order)]
    assert post.samples.shape == (4, 1000, 2)
    assert np.all(np.asarray(post.rhat()) < 1.01)
    assert int(np.sum(np.asarray(post.divergent))) == 0
    sd = np.sqrt(np.diagonal(cov))
    ess = np.asarray(post.ess())
    assert np.all(ess > 400)
    # the mean within 4 Monte-Carlo standard errors, the spread and correlation to
    # what some 1000 effective draws allow
    np.testing.assert_array_less(np.abs(np.asarray(post.mean()) - mean), 4 * sd / np.sqrt(ess))
    np.testing.assert_allclose(np.asarray(post.std()), sd, rtol=0.1)
    got = np.asarray(post.covariance())
    corr = cov[0, 1] / (sd[0] * sd[1])
    assert got[0, 1] / np.sqrt(got[0, 0] * got[1, 1]) == pytest.approx(corr, abs=0.08)
    # the log posterior is minus the objective at each draw
    draw = post.model(1, 7)
    assert float(post.log_posterior[1, 7]) == pytest.approx(-float(objective(draw)), rel=1e-12)


@slow_ci
def test_bounds_enter_through_the_jacobian_and_the_summaries():
    """A Gaussian prior N(0.3, 0.2) on a Sersic e1, whose class bounds are (-0.6, 0.6): the
    posterior is that normal truncated to the bounds (mean 0.2722, sd 0.1758), which the
    chains reach only with the log-Jacobian of the logistic map included. The same draws
    (and those of the amplitude, N(2, 0.3) on (0, inf)) check the summaries."""
    model = light.Sersic(amp=2.0, R_sersic=0.5, n_sersic=2.0, e1=0.1)
    objective = el.Objective(
        [el.GaussianPrior(lambda s: s.e1, 0.3, 0.2), el.GaussianPrior(lambda s: s.amp, 2.0, 0.3)]
    )
    free = el.select(model, lambda s: (s.amp, s.e1))
    post = el.sample(
        jax.random.key(1), objective, model, free=free, n_chains=2, n_warmup=300,
        n_samples=1500,
    )  # fmt: skip
    assert post.names == ("amp", "e1")
    lo, hi = -0.6, 0.6
    mean, sd = truncated_normal(0.3, 0.2, lo, hi)
    ess = float(post.ess()[1])
    assert abs(float(post.mean()[1]) - mean) < 4 * sd / math.sqrt(ess)
    assert float(post.std()[1]) == pytest.approx(sd, rel=0.08)
    assert float(jnp.max(post.samples[..., 1])) < hi and float(jnp.min(post.samples[..., 1])) > lo

    d = post.to_dict()
    assert set(d["parameters"]) == {"amp", "e1"} and d["sampler"] == "nuts"
    p = d["parameters"]["amp"]
    assert p["p16"] < p["p50"] < p["p84"] and p["rhat"] is not None
    assert p["std"] == pytest.approx(0.3, rel=0.1)
    assert d["chains"] == 2 and d["draws"] == 1500
    text = post.summary()
    assert "e1" in text and "r_hat" in text and "divergent" in text
    pytest.importorskip("arviz")
    data = post.to_arviz()
    values = np.asarray(data["posterior"]["amp"])
    np.testing.assert_array_equal(values, np.asarray(post.samples[..., 0]))
    assert values.shape == (2, 1500)


def _prior_problem():
    model = light.Sersic(amp=2.0, R_sersic=0.5, n_sersic=2.0, e1=0.1)
    objective = el.Objective(
        [el.GaussianPrior(lambda s: s.e1, 0.3, 0.2), el.GaussianPrior(lambda s: s.amp, 2.0, 0.3)]
    )
    return model, objective, el.select(model, lambda s: (s.amp, s.e1))


@slow_ci
def test_draws_in_chunks_are_those_of_one_run(monkeypatch, capsys):
    """The draws are made in chunks (one compiled program reused): cut into 1 or 8 chunks,
    the same key gives the same chains; progress reports the draws and the time left."""
    from equilens.solve import _sample

    model, objective, free = _prior_problem()
    runs = []
    for chunks in (1, 8):
        monkeypatch.setattr(_sample, "DRAW_CHUNKS", chunks)
        runs.append(
            el.sample(
                jax.random.key(4),
                objective,
                model,
                free=free,
                n_chains=2,
                n_warmup=100,
                n_samples=160,
                progress=True,
            )
        )
    one, eight = runs
    assert one.samples.shape == eight.samples.shape == (2, 160, 2)
    np.testing.assert_allclose(np.asarray(eight.samples), np.asarray(one.samples), rtol=1e-12)
    np.testing.assert_array_equal(np.asarray(eight.tree_steps), np.asarray(one.tree_steps))
    assert eight.status == "finished" and eight.to_dict()["status"] == "finished"
    out = capsys.readouterr().out
    assert "NUTS: warm-up of 100 steps per chain done" in out
    assert "160/160 draws per chain (2 chains)" in out and "s left" in out


@slow_ci
def test_ctrl_c_during_nuts_keeps_the_draws_so_far(monkeypatch):
    """A SIGINT while the draws are made (sent when the first chunk has finished, through
    the module's clock) ends the run after that chunk with `SamplingInterrupted` (a
    KeyboardInterrupt) carrying its draws, the first of an uninterrupted run's."""
    import os
    import signal
    import types

    from equilens.solve import _sample

    model, objective, free = _prior_problem()
    kwargs = dict(free=free, n_chains=2, n_warmup=100, n_samples=200)
    whole = el.sample(jax.random.key(5), objective, model, **kwargs)
    calls = []

    def clock():
        calls.append(None)
        if len(calls) == 3:  # the warm-up's start, the draws' start, the first chunk's end
            os.kill(os.getpid(), signal.SIGINT)
        return float(len(calls))

    handler = signal.getsignal(signal.SIGINT)
    monkeypatch.setattr(_sample, "time", types.SimpleNamespace(perf_counter=clock))
    with pytest.raises(el.SamplingInterrupted) as stop:
        el.sample(jax.random.key(5), objective, model, **kwargs)
    assert isinstance(stop.value, KeyboardInterrupt)
    post = stop.value.posterior
    assert post.status == "interrupted" and post.to_dict()["status"] == "interrupted"
    assert post.samples.shape == (2, 10, 2)  # one chunk of 200 / 20 draws
    np.testing.assert_allclose(
        np.asarray(post.samples), np.asarray(whole.samples[:, :10]), rtol=1e-12
    )
    assert "interrupted" in post.summary()
    assert signal.getsignal(signal.SIGINT) is handler
    assert issubclass(el.NestedInterrupted, el.SamplingInterrupted)


def test_bad_arguments_are_refused():
    model = light.Sersic(amp=2.0, R_sersic=0.5, n_sersic=2.0)
    objective = el.Objective(el.GaussianPrior(lambda s: s.amp, 2.0, 0.3))
    free = el.select(model, lambda s: s.amp)
    key = jax.random.key(0)
    with pytest.raises(ValueError, match="n_chains"):
        el.sample(key, objective, model, free=free, n_chains=0)
    with pytest.raises(ValueError, match="n_samples"):
        el.sample(key, objective, model, free=free, n_samples=-3)
    with pytest.raises(ValueError, match="target_acceptance"):
        el.sample(key, objective, model, free=free, target_acceptance=1.0)
    with pytest.raises(ValueError, match="chain_method"):
        el.sample(key, objective, model, free=free, chain_method="parallel")
    with pytest.raises(TypeError, match="Objective"):
        el.sample(key, objective.terms[0], model, free=free)
