"""The subhalo scan: the `Subhalo` perturber against `LensCosmology`'s own conversions (its
mass and concentration recovered by `nfw_mass`, the pseudo-Jaffe's total mass by the flux
of its deflection), the Numba backend, finite differences; the Laplace evidence against
closed forms; the cells over a mask; and a small scan that finds a subhalo injected on an
arc (and none where there is none), resumed from its checkpoint to the same numbers."""

import dataclasses
import json
import math
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import equilens as el
from equilens import light, mass
from equilens.solve import laplace_evidence
from equilens.subhalo import Subhalo, duffy_concentration, scan_cells, subhalo_scan
from equilens.terms import LogisticPrior
from helpers import slow_ci

X64 = jax.config.read("jax_enable_x64")
LC = el.LensCosmology(0.222, 0.609)


def _sub(kind="tnfw", log10_mass=9.5, **kw):
    args = dict(u=0.3, v=-0.2, cell_x=0.1, cell_y=0.4, half=0.2, host_theta_E=1.3)
    args.update(kw)
    return Subhalo(log10_mass=log10_mass, cosmology=LC, kind=kind, **args)


@pytest.mark.x64_only
@pytest.mark.parametrize("log10_mass", [7.0, 9.0, 10.5])
def test_tnfw_subhalo_has_its_mass_and_duffy_concentration(log10_mass):
    sub = _sub(log10_mass=log10_mass)
    p = sub.profile()
    assert isinstance(p, mass.TNFW)
    m200, c = LC.nfw_mass(p)  # the inverse conversion, by root finding
    assert m200 == pytest.approx(10.0**log10_mass, rel=1e-9)
    assert c == pytest.approx(float(duffy_concentration(m200, 0.222, LC.h)), rel=1e-9)
    # Duffy et al. (2008): c ~ 5.71 at 2e12 / h Msun and z = 0, falling slowly with mass
    assert float(duffy_concentration(2e12 / LC.h, 0.0, LC.h)) == pytest.approx(5.71)
    x, y = (float(v) for v in sub.center)
    assert (x, y) == pytest.approx((0.1 + 0.2 * 0.3, 0.4 - 0.2 * 0.2))
    # the Jacobi radius grows as the cube root of the mass
    other = _sub(log10_mass=log10_mass + 3).profile()
    assert float(other.r_trunc) / float(p.r_trunc) == pytest.approx(10.0, rel=1e-9)


@pytest.mark.x64_only
def test_pseudo_jaffe_subhalo_has_its_total_mass_and_tidal_radius():
    sub = _sub(kind="pseudo_jaffe", log10_mass=9.5)
    p = sub.profile()
    assert isinstance(p, mass.PseudoJaffe)
    # total mass 2 pi sigma0 Ra Rs Sigma_crit; the mass inside 200 Rs by the deflection's
    # flux (within Ra Rs / 200 Rs = 0.5% of the total for Ra << Rs)
    total = 2 * math.pi * float(p.sigma0) * float(p.Ra) * float(p.Rs) * LC.sigma_crit
    assert total == pytest.approx(10.0**9.5, rel=1e-12)
    assert LC.mass_within(p, 200 * float(p.Rs)) == pytest.approx(10.0**9.5, rel=6e-3)
    # r_t = sqrt(b theta_E) with M = pi Sigma_crit b r_t
    b = float(p.Rs) ** 2 / 1.3
    assert math.pi * LC.sigma_crit * b * float(p.Rs) == pytest.approx(10.0**9.5, rel=1e-9)


def test_subhalo_derivatives_match_finite_differences_and_numba():
    x, y = jnp.linspace(-0.8, 0.9, 7), jnp.linspace(0.5, -0.4, 7)
    for kind in ("tnfw", "pseudo_jaffe"):

        def f(p, kind=kind):
            s = _sub(kind=kind, log10_mass=p[0], u=p[1], v=p[2])
            return jnp.sum(s.deflection(x, y)[0] + 2 * s.deflection(x, y)[1])

        p0 = jnp.asarray([9.3, 0.2, -0.4])
        g = np.asarray(jax.grad(f)(p0))
        assert np.all(np.isfinite(g))
        if X64:
            h = 1e-6
            fd = [(f(p0.at[i].add(h)) - f(p0.at[i].add(-h))) / (2 * h) for i in range(3)]
            np.testing.assert_allclose(g, np.asarray(fd), rtol=1e-6, atol=1e-10)
            s = _sub(kind=kind)
            mine = np.asarray(s.deflection(x, y))
            numba = el.numba.deflection(s, np.asarray(x), np.asarray(y))
            np.testing.assert_allclose(np.asarray(numba), mine, rtol=1e-12, atol=1e-15)


def test_subhalo_values_are_checked_where_they_enter():
    with pytest.raises(ValueError, match="kind"):
        _sub(kind="nfw")
    with pytest.raises(TypeError, match="LensCosmology"):
        Subhalo(log10_mass=9.0)
    with pytest.raises(ValueError, match="half"):
        _sub(half=-0.1)


def test_logistic_prior_is_the_jacobian_of_the_bounded_map():
    lo, hi = -1.0, 3.0
    z = jnp.asarray([-30.0, -5.0, -1e-4, 0.0, 1e-5, 0.7, 12.0])
    theta = lo + (hi - lo) * jax.nn.sigmoid(z)
    for zi, t in zip(z, theta, strict=True):
        term = LogisticPrior(lambda m: m, lo, hi)
        s = jax.nn.sigmoid(zi)
        expected = -float(jnp.log(s) + jnp.log1p(-s))
        # (theta holds z to its own rounding: 1e-16 / e^-|z| relative near a bound)
        tol = (1e-9 if abs(float(zi)) < 15 else 1e-4) if X64 else 2e-3
        if abs(float(zi)) < 10 or X64:
            assert float(term(t)) == pytest.approx(expected, rel=tol, abs=tol)
    g = jax.grad(lambda t: LogisticPrior(lambda m: m, lo, hi)(t))(jnp.asarray(1.0))
    assert np.isfinite(float(g)) and abs(float(g)) < 1e-6  # the middle: the mode


def _one_parameter(sigma, mean=0.3):
    model = mass.SIS(theta_E=1.0)
    prior = el.GaussianPrior(lambda m: m.theta_E, mean, sigma)
    return el.Objective(prior), model


@pytest.mark.x64_only
def test_laplace_evidence_of_a_normal_likelihood_in_a_uniform_prior():
    # a normalised Gaussian likelihood well inside a uniform prior on (0, 4): E = 1 / 4
    objective, model = _one_parameter(0.01, mean=1.7)
    bounds = {lambda m: m.theta_E: (0.0, 4.0)}
    free = el.select(model, lambda m: m.theta_E)
    start = el.fit(objective, model, free=free, bounds=bounds, covariance=False).model
    ev = laplace_evidence(objective, start, free=free, bounds=bounds)
    assert ev.log_evidence == pytest.approx(-math.log(4.0), abs=2e-3)
    assert ev.covariance[0, 0] == pytest.approx(0.01**2, rel=2e-2)
    assert ev.floored == 0
    # a likelihood that does not depend on the parameter: the prior's own integral, 1
    # (the logistic density's Laplace approximation: log(sqrt(2 pi) sqrt(2) / 4) = -0.121)
    flat, _ = _one_parameter(1e6, mean=0.0)
    ev = laplace_evidence(flat, model, free=el.select(model, lambda m: m.theta_E), bounds=bounds)
    norm = -math.log(1e6 * math.sqrt(2 * math.pi))  # the likelihood's constant value
    assert ev.log_evidence - norm == pytest.approx(math.log(math.sqrt(4 * math.pi) / 4), abs=1e-3)


def test_scan_cells_cover_the_mask():
    grid = el.Grid((40, 40), pixel_scale=0.1)
    x, y = np.asarray(grid.x), np.asarray(grid.y)
    r = np.hypot(x, y)
    mask = (r > 0.8) & (r < 1.6)
    centres, half = scan_cells(x, y, mask, 4, 0.1)
    assert half == pytest.approx(3.2 / 8, rel=1e-6)  # the square about the annulus, in 4
    assert centres.shape == (16, 2)  # every cell holds part of the ring
    inside = np.zeros(mask.shape, bool)
    for cx, cy in centres:
        inside |= (np.abs(x - cx) <= half) & (np.abs(y - cy) <= half)
    assert inside[mask].all()
    centres, _ = scan_cells(x, y, mask, 9, 0.1)
    assert centres.shape[0] < 81  # the cells inside the hole and the corners are dropped
    with pytest.raises(ValueError, match="positive"):
        scan_cells(x, y, mask, 0, 0.1)
    # a cell's refinement: 3 x 3 sub-cells of a third of its width tile it, row by row
    from equilens.subhalo._grid import tile

    sub = tile((0.3, -0.6), 0.3, 3)
    np.testing.assert_allclose(sub[:3], [[0.1, -0.8], [0.3, -0.8], [0.5, -0.8]], atol=1e-15)
    np.testing.assert_allclose(sub[4], [0.3, -0.6], atol=1e-15)
    assert sub.shape == (9, 2) and np.all(np.abs(sub - (0.3, -0.6)) <= 0.2 + 1e-15)


def _lens(with_subhalo: bool, seed=1):
    grid = el.Grid((56, 56), pixel_scale=0.05)
    psf = el.GaussianPSF(fwhm=0.1, pixel_scale=0.05)
    macro = mass.SIE(theta_E=0.9, e1=0.05, e2=-0.03) + mass.ExternalShear(gamma1=0.02, gamma2=0.01)
    src = light.Sersic(amp=20.0, R_sersic=0.15, n_sersic=1.0, center_x=0.05, center_y=0.02, e1=0.1)
    lens = macro
    if with_subhalo:
        sub = Subhalo(
            log10_mass=9.7,
            cell_x=0.0,
            cell_y=0.9,
            half=0.3,
            host_theta_E=0.9,
            cosmology=LC,
            kind="pseudo_jaffe",
        )
        lens = macro + sub.profile()
    truth = el.LensSystem(mass=lens, source=src)
    r = np.hypot(np.asarray(grid.x), np.asarray(grid.y))
    mask = (r > 0.4) & (r < 1.35)
    data = el.simulate(
        jax.random.key(seed), truth, grid, psf, exposure_time=2000.0, sky_level=1.0, mask=mask
    )
    return el.Objective(el.GaussianLikelihood(data)), el.LensSystem(mass=macro, source=src)


@slow_ci
def test_scan_finds_an_injected_subhalo_refines_its_cell_and_resumes_from_its_checkpoint(
    tmp_path,
):
    objective, start = _lens(True)
    smooth = el.fit(objective, start, covariance=False)
    path = tmp_path / "cells.jsonl"
    # the cell holding (0, 0.9) and one far from it; the best refined by 2 x 2 sub-cells
    centres = np.asarray([[0.1, 0.8], [-0.8, -0.6]])
    # (held_below=inf: the subhalo's cell, over the default 100, gets its held-mass fit too)
    kw = dict(grid=centres, half=0.3, kind="pseudo_jaffe", checkpoint=path, progress=False)
    # (searched_cells=0: the searched fits have their own tests, test_subhalo_searched.py)
    kw.update(polish=0, held_below=math.inf, searched_cells=0)
    scan = subhalo_scan(objective, smooth, LC, refine=2, **kw)
    assert scan.failed == 0
    assert scan.best_index == 0
    coarse = float(scan.delta_log_evidence[0])
    assert coarse > 10
    # the refinement tiles the best cell: 4 sub-cells of half-width 0.15"
    sub = scan.refinement
    assert sub is not None and sub.failed == 0 and sub.half == pytest.approx(0.15)
    np.testing.assert_allclose(
        sub.centres, [[-0.05, 0.65], [0.25, 0.65], [-0.05, 0.95], [0.25, 0.95]], atol=1e-12
    )
    # the cell's evidence is the mean of its sub-cells' (a uniform position prior over the
    # cell is the mean of the uniform priors over its quarters)
    m = np.max(sub.log_evidence)
    cell = m + math.log(np.mean(np.exp(sub.log_evidence - m))) - scan.smooth_log_evidence
    assert scan.best["cell_delta_log_evidence"] == pytest.approx(cell, rel=1e-12)
    # the two estimates of the cell's evidence agree to the Laplace approximation's few units
    assert abs(cell - coarse) < 5
    # best: the best sub-cell's subhalo, the one holding the truth (0, 0.9)
    assert scan.best["cell"] == 0 and scan.best["sub_cell"] == 2
    assert scan.best["delta_log_evidence"] == pytest.approx(float(np.max(sub.delta_log_evidence)))
    assert scan.best_fit is sub.fits[2]
    assert math.hypot(scan.best["center_x"] - 0.0, scan.best["center_y"] - 0.9) < 0.1
    assert abs(scan.best["log10_mass"] - 9.7) < 0.3
    assert scan.best["mass_within_1kpc"] > 0
    out = scan.to_dict()
    json.dumps(out)  # JSON-ready
    assert out["cells"][0]["delta_log_evidence"] == pytest.approx(coarse)
    assert out["refinement"]["cell"] == 0 and len(out["refinement"]["sub_cells"]) == 4
    lines = path.read_text().splitlines()
    # the header, two cells, their held-mass fits (held_cells=3: both), four sub-cells and
    # the smooth model's refits from the two cells' best fits (smooth_starts=3: all there are)
    assert len(lines) == 11 and sum('"refit"' in line for line in lines) == 2
    assert sum('"held"' in line for line in lines[1:]) == 2
    again = subhalo_scan(objective, smooth, LC, refine=2, **kw)
    assert again.resumed == 2 and again.refinement is not None
    assert again.refinement.resumed == 4
    assert len(path.read_text().splitlines()) == 11  # (the refits resumed too)
    assert again.smooth_log_evidence == scan.smooth_log_evidence
    np.testing.assert_array_equal(again.log_evidence, scan.log_evidence)
    np.testing.assert_array_equal(again.refinement.log_evidence, sub.log_evidence)
    assert again.best["center_x"] == pytest.approx(scan.best["center_x"], rel=1e-12)
    # another refinement reuses the coarse cells and fits its own sub-cells
    finer = subhalo_scan(objective, smooth, LC, refine=3, **kw)
    assert finer.resumed == 2 and finer.refinement is not None
    assert finer.refinement.resumed == 0 and finer.refinement.failed == 0
    lines = path.read_text().splitlines()
    assert sum('"sub"' in line for line in lines) == 4 + 9
    # (a refit from one of the new sub-cells' fits, if one is the refined cell's best)
    assert sum('"refit"' in line for line in lines) in (2, 3)
    with pytest.raises(ValueError, match="another start_grid"):
        subhalo_scan(objective, smooth, LC, refine=3, start_grid=2, **kw)
    # a checkpoint written before the start grid existed (its header without it: every
    # cell from its centre) resumes as start_grid=0
    lines = path.read_text().splitlines()
    head = json.loads(lines[0])
    for key in ("start_grid", "start_masses", "second_start"):
        del head["header"][key]
    path.write_text("\n".join([json.dumps(head), *lines[1:]]) + "\n")
    older = subhalo_scan(objective, smooth, LC, refine=3, start_grid=0, **kw)
    assert older.resumed == 2 and older.refinement is not None
    assert older.refinement.resumed == 9
    with pytest.raises(ValueError, match="another"):
        subhalo_scan(objective, smooth, LC, **{**kw, "kind": "tnfw"})
    with pytest.raises(ValueError, match="refine must be"):
        subhalo_scan(objective, smooth, LC, refine=1, **kw)


def _pixelized_lens(with_subhalo: bool):
    """`_lens`'s images with a pixelized source (16 x 16 magnification-adaptive mesh,
    constant regularization) modelled by the source-marginalised evidence, fitted smooth."""
    objective, start = _lens(with_subhalo)
    pixelized = el.Objective(el.LogEvidence(objective.terms[0].imaging))
    mesh, reg = el.AdaptiveRectangularMesh((16, 16)), el.ConstantRegularization(1.0)
    start = el.LensSystem(mass=start.mass, source=el.PixelizedSource(mesh, reg))
    return pixelized, el.fit(pixelized, start, "bfgs", covariance=False)


@slow_ci
@pytest.mark.x64_only  # (in float32 the null image's sub-cells scatter from -34 to +14)
def test_a_pixelized_scan_finds_an_injected_subhalo_and_none_where_there_is_none():
    """The scan on a pixelized source's evidence, end to end (its defaults: the
    regularization held, the smoothed Laplace evidence, the fits' plateau rule, the start
    grid, the refinement, the smooth model's refits; no polishing fit): the
    subhalo injected on the arc found in its cell (Delta log E > 10 and the best cell,
    within 0.1" of (0, 0.9)", its mass to 0.3 dex); nothing above 5 in either cell of the
    same lens without the subhalo, nor in the sub-cells of its best."""
    centres = np.asarray([[0.1, 0.8], [-0.8, -0.6]])
    kw = dict(grid=centres, half=0.3, kind="pseudo_jaffe", progress=False, polish=0)
    objective, smooth = _pixelized_lens(True)
    scan = subhalo_scan(objective, smooth, LC, **kw)
    assert scan.held == ("source.regularization.coefficient",)
    assert scan.failed == 0 and scan.best_index == 0
    # (the far cell can gain too: a subhalo elsewhere absorbs part of an unmodelled one)
    assert scan.delta_log_evidence[0] > max(10, scan.delta_log_evidence[1])
    assert math.hypot(scan.best["center_x"] - 0.0, scan.best["center_y"] - 0.9) < 0.1
    assert abs(scan.best["log10_mass"] - 9.7) < 0.3
    objective, smooth = _pixelized_lens(False)
    null = subhalo_scan(objective, smooth, LC, **kw)
    assert null.failed == 0 and null.refinement is not None
    assert np.all(null.delta_log_evidence < 5)
    assert np.all(null.refinement.delta_log_evidence < 5)


@slow_ci
def test_scan_of_a_lens_without_subhalo_finds_none():
    objective, start = _lens(False)
    smooth = el.fit(objective, start, covariance=False)
    centres = np.asarray([[0.1, 0.8], [-0.8, -0.6]])
    # (each cell also from the best of its start grid: a second start does not make a
    # detection where there is no subhalo)
    scan = subhalo_scan(
        objective,
        smooth,
        LC,
        grid=centres,
        half=0.3,
        kind="pseudo_jaffe",
        progress=False,
        start_grid=3,
    )
    assert scan.failed == 0
    assert np.all(scan.delta_log_evidence < 5)
    # nor does the refinement of the best cell find one in its sub-cells, nor the polishing
    # fit over that cell from the best of its 7 x 7 x 8 grid
    assert scan.refinement is not None and scan.refinement.failed == 0
    assert np.all(scan.refinement.delta_log_evidence < 5)
    assert scan.polished is not None and scan.polished.failed == 0
    assert scan.polished.delta_log_evidence[0] < 5


@slow_ci
def test_a_cell_fit_that_ends_worse_than_the_smooth_model_is_redone_from_a_quiet_subhalo():
    # cells started at 10^10.8 Msun and given 3 steps end far worse than the smooth model
    # (the subhalo still massive); each is then fitted again from a negligible subhalo,
    # where the cell model is the smooth model, and the better fit kept: no cell loses more
    # than its Occam factor (the subhalo's prior volume), where the first fits lost hundreds
    objective, start = _lens(False)
    smooth = el.fit(objective, start, covariance=False)
    centres = np.asarray([[0.1, 0.8], [-0.8, -0.6]])
    kw = dict(
        grid=centres, half=0.3, kind="pseudo_jaffe", progress=False, max_steps=3, refine=0, polish=0
    )
    kw.update(searched_cells=0)  # (a searched fit takes its own steps: this is about the cells')
    # (start_grid=0: the fits start at 10^10.8 Msun, not at the best of the start grid)
    scan = subhalo_scan(objective, smooth, LC, start_log10_mass=10.8, start_grid=0, **kw)
    assert scan.failed == 0
    assert np.all(scan.delta_log_evidence > -15), scan.delta_log_evidence
    assert all(fit.mass.components[-1].log10_mass < 9.0 for fit in scan.fits)


@slow_ci
def test_a_smooth_model_short_of_its_mode_is_fitted_again_from_the_best_cell():
    # a smooth "fit" far from its optimum (theta_E 0.75 against 0.9) and not refitted: each
    # cell fit (the macro model refitted with the subhalo) reaches the smooth optimum and
    # would gain hundreds; the smooth model fitted again from the best cell's fit, its
    # subhalo removed, takes that gain back: no cell above 5 in a lens without a subhalo
    objective, start = _lens(False)
    off = eqx.tree_at(lambda s: s.mass.components[0].theta_E, start, jnp.asarray(0.75))
    scan = subhalo_scan(
        objective,
        off,
        LC,
        grid=np.asarray([[0.1, 0.8]]),
        half=0.3,
        kind="pseudo_jaffe",
        refit_smooth=False,
        refine=0,
        polish=0,
        progress=False,
        # (the start grid scores a cell's starts with the macro model held where the smooth
        # model is, here far from its mode: a heavy subhalo there stands in for the missing
        # Einstein radius and leads the fit to another mode; the scan's default refits the
        # smooth model first)
        start_grid=0,
    )
    assert scan.smooth_gain > 100
    assert np.all(scan.delta_log_evidence < 5), scan.delta_log_evidence
    assert scan.best["delta_log_evidence"] == pytest.approx(float(scan.delta_log_evidence[0]))
    assert float(scan.smooth.mass.components[0].theta_E) == pytest.approx(0.9, abs=0.02)
    assert scan.to_dict()["smooth_gain"] == scan.smooth_gain


@pytest.mark.precision_independent
def test_laplace_evidence_refuses_a_hessian_that_is_not_finite(monkeypatch):
    from equilens.solve import _laplace

    objective, start = _lens(False)
    parts = _laplace._parts

    def nan_hessian(*args, **kw):
        f, g, h = parts(*args, **kw)
        h = np.array(h)
        h[1, 1] = np.nan
        return f, g, h

    monkeypatch.setattr(_laplace, "_parts", nan_hessian)
    with pytest.raises(ValueError, match="Hessian at the mode is not finite in"):
        laplace_evidence(objective, start, newton_steps=0)


def _recorded_evidences(monkeypatch) -> list:
    """The scan's `laplace_evidence` calls, recorded as `(keywords, LaplaceEvidence)` in
    the list returned as they are made."""
    from equilens.subhalo import _scan

    calls = []
    real = _scan.laplace_evidence

    def recorded(*args, **kw):
        ev = real(*args, **kw)
        calls.append((kw, ev))
        return ev

    monkeypatch.setattr(_scan, "laplace_evidence", recorded)
    return calls


@slow_ci
def test_the_cells_evidences_start_their_smoothing_from_the_smooth_models_errors(
    monkeypatch, tmp_path
):
    """With a smoothed evidence, the smooth model's is `laplace_evidence`'s default (first
    steps from the gradient's differences, 3 rounds); every later one (the cells', the
    smooth refits') starts from the smooth model's errors and takes `SMOOTHING_ROUNDS`;
    the checkpoint's header says so (a checkpoint from before is refused)."""
    from equilens.subhalo import _scan

    objective, start = _lens(True)
    smooth = el.fit(objective, start, covariance=False)
    calls = _recorded_evidences(monkeypatch)
    path = tmp_path / "cells.jsonl"
    kw = dict(grid=np.asarray([[0.1, 0.8]]), half=0.3, kind="pseudo_jaffe", progress=False)
    kw.update(refine=0, polish=0, smooth_starts=1, start_grid=0, smoothed=True, checkpoint=path)
    kw.update(searched_cells=0)
    scan = subhalo_scan(objective, smooth, LC, held_below=math.inf, **kw)
    # the smooth model, the cell, its held-mass fit (held_cells=3 and held_below=inf: the one
    # cell, a detection), one refit
    assert scan.failed == 0 and len(calls) == 4
    first, ev = calls[0]
    assert "smoothing_start" not in first and "smoothing_rounds" not in first
    errors = dict(zip(ev.names, np.asarray(ev.raw_errors).tolist(), strict=True))
    for later, _ in calls[1:]:
        assert later["smoothing_start"] == errors
        assert later["smoothing_rounds"] == _scan.SMOOTHING_ROUNDS
    # the smooth model's errors are its Laplace evidence's (`equilens subhalo` reports them
    # instead of the chain's)
    sigma = np.sqrt(np.diagonal(np.asarray(ev.covariance)))
    assert scan.smooth_errors == dict(zip(ev.names, sigma.tolist(), strict=True))
    assert np.all(sigma > 0) and scan.to_dict()["smooth_errors"] == scan.smooth_errors
    header = json.loads(path.read_text().splitlines()[0])["header"]
    assert header["smoothing_start"] == _scan.SMOOTHING_ROUNDS
    header.pop("smoothing_start")
    lines = path.read_text().splitlines()
    path.write_text("\n".join([json.dumps({"header": header}), *lines[1:]]) + "\n")
    with pytest.raises(ValueError, match="another evidence"):
        subhalo_scan(objective, smooth, LC, **kw)


@slow_ci
def test_nested_sampling_of_the_best_cell_agrees_with_the_laplace_evidence():
    pytest.importorskip("nautilus")
    objective, start = _lens(True)
    smooth = el.fit(objective, start, covariance=False)
    scan = subhalo_scan(
        objective,
        smooth,
        LC,
        grid=np.asarray([[0.1, 0.8]]),
        half=0.3,
        kind="pseudo_jaffe",
        progress=False,
        refine=0,
        polish=0,
        searched_cells=0,
    )
    nested = el.subhalo_evidence(scan, objective, n_live=300, n_eff=600, n_networks=1)
    assert nested.cell == 0 and nested.laplace_delta_log_evidence == scan.best["delta_log_evidence"]
    err = nested.delta_log_evidence_error
    assert 0 < err < 0.3
    # the two integrals of the same posteriors: the Laplace approximation is good to a few
    # units on a difference of about a thousand (the subhalo's mass posterior is near
    # normal in log10 mass)
    assert nested.delta_log_evidence > 100
    assert abs(nested.delta_log_evidence - nested.laplace_delta_log_evidence) < 5 + 3 * err
    sub = nested.subhalo
    for key in ("center_x", "center_y", "log10_mass", "mass_within_1kpc"):
        assert sub[key][0] < sub[key][1] < sub[key][2]
    # the truth (0, 0.9), 10^9.7 Msun inside the posterior's 16-84% (widened by 0.02" and
    # 0.05 dex for the one noise draw's scatter)
    assert sub["center_x"][0] - 0.02 < 0.0 < sub["center_x"][2] + 0.02
    assert sub["center_y"][0] - 0.02 < 0.9 < sub["center_y"][2] + 0.02
    assert sub["log10_mass"][0] - 0.05 < 9.7 < sub["log10_mass"][2] + 0.05
    d = nested.to_dict()
    json.dumps(d)
    assert d["with_subhalo"]["n_eff"] >= 600
    # the shared parameters' priors are the same intervals in both runs
    names = set(nested.smooth.names)
    for k, name in enumerate(nested.with_subhalo.names):
        if name in names:
            j = nested.smooth.names.index(name)
            np.testing.assert_array_equal(nested.with_subhalo.box[k], nested.smooth.box[j])
    with pytest.raises(ValueError, match="cell must be"):
        el.subhalo_evidence(scan, objective, cell=3)


@slow_ci
def test_scan_on_a_dask_cluster_of_two_workers_equals_the_scan_in_one_process():
    distributed = pytest.importorskip("distributed")
    objective, start = _lens(True)
    smooth = el.fit(objective, start, covariance=False)
    centres = np.asarray([[0.1, 0.8], [-0.8, -0.6], [0.8, -0.6]])
    kw = dict(grid=centres, half=0.3, kind="pseudo_jaffe", progress=False, refine=2)
    said_here, said_there = [], []
    here = subhalo_scan(objective, smooth, LC, log=said_here.append, **kw)
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True) as cluster:
        with distributed.Client(cluster) as client:
            there = subhalo_scan(objective, smooth, LC, client=client, log=said_there.append, **kw)
    # the start grids scored here, and in the cells' tasks on the workers: the same starts
    assert sum("get a second start" in line for line in said_here) == 2  # cells, sub-cells
    assert sum("on the workers" in line for line in said_there) == 2
    # the same programs on the same CPU: equal to round-off (XLA may split reductions
    # over another number of threads in a worker)
    np.testing.assert_allclose(there.log_evidence, here.log_evidence, rtol=1e-9, atol=1e-6)
    assert there.status == here.status and there.best_index == here.best_index
    assert there.best["center_x"] == pytest.approx(here.best["center_x"], abs=1e-6)
    # and the refinement's sub-cells, started from the best cell's fit
    assert there.refinement is not None and here.refinement is not None
    np.testing.assert_allclose(
        there.refinement.log_evidence, here.refinement.log_evidence, rtol=1e-9, atol=1e-6
    )
    assert there.best["sub_cell"] == here.best["sub_cell"]
    # the smooth model's refits from the best cells' fits, side by side on the workers
    assert there.smooth_gain == pytest.approx(here.smooth_gain, rel=1e-9, abs=1e-6)
    assert there.smooth_log_evidence == pytest.approx(here.smooth_log_evidence, rel=1e-12)


@slow_ci  # (10 s a precision)
def test_a_cells_fit_starts_from_the_best_of_its_start_grid():
    """The start grid's candidates tile the cell and keep the masses inside the prior; on a
    lens with a 10^9.7 Msun subhalo at (0, 0.9)" in a cell centred at (0.2, 0.7)" (half-width
    0.3"), the best start is the candidate nearest the subhalo, with a mass near its own,
    far better than the default start at the cell's centre; a cell without a subhalo keeps
    a small mass (or the default)."""
    from equilens.subhalo._scan import _as_sum, with_subhalo
    from equilens.subhalo._seed import (
        best_starts,
        cell_starts,
        start_candidates,
        start_pool,
        task_starts,
    )

    cand = start_candidates(3, (6.0, 8.0, 9.5, 10.0, 11.0), (6.0, 11.0))
    assert cand.shape == (27, 3)  # 9 positions x the 3 masses strictly inside the bounds
    np.testing.assert_allclose(sorted(set(cand[:, 0])), [-2 / 3, 0.0, 2 / 3], atol=1e-15)
    assert set(cand[:, 2]) == {8.0, 9.5, 10.0}
    with pytest.raises(ValueError, match="start_grid"):
        start_candidates(0, (9.0,), (6.0, 11.0))
    with pytest.raises(ValueError, match="inside mass_range"):
        start_candidates(2, (12.0,), (6.0, 11.0))

    objective, start = _lens(True)
    smooth = _as_sum(el.fit(objective, start, covariance=False).model)
    template = with_subhalo(
        smooth,
        Subhalo(log10_mass=9.0, half=0.3, host_theta_E=0.9, cosmology=LC, kind="pseudo_jaffe"),
    )
    centres = np.asarray([[0.2, 0.7], [-0.8, -0.6]])
    defaults = np.asarray([[0.0, 0.0, 9.0], [0.0, 0.0, 9.0]])
    cand = start_candidates(3, (7.0, 8.0, 9.0, 9.5, 10.0, 10.5), (6.0, 11.0))
    starts, values = best_starts(objective, template, centres, cand, defaults)
    u, v, m = starts[0]
    assert (u, v) == pytest.approx((-2 / 3, 2 / 3))  # the sub-square holding (0, 0.9)
    assert 9.0 <= m <= 10.5
    assert starts[1][2] <= 9.0  # no subhalo there: no heavy one preferred
    # the values are the objective's at those starts; the default start's is worse
    at = lambda c, s: with_subhalo(
        smooth,
        Subhalo(
            log10_mass=s[2], u=s[0], v=s[1], cell_x=c[0], cell_y=c[1], half=0.3,
            host_theta_E=0.9, cosmology=LC, kind="pseudo_jaffe",
        ),
    )  # fmt: skip
    tol = 1e-9 if X64 else 1e-4
    assert values[0] == pytest.approx(float(objective(at(centres[0], starts[0]))), rel=tol)
    assert float(objective(at(centres[0], defaults[0]))) > values[0] + 10

    # as the scan takes them (`cell_starts`): the default start first, the grid's best as a
    # second start where it beats the default and the quiet start (the smooth model), NaN
    # where not; one start a cell without a grid, and none added to a cell already done
    lines = []
    both = cell_starts(objective, template, centres, cand, defaults, 6.5, {}, lines.append)
    assert both.shape == (2, 2, 3)
    np.testing.assert_array_equal(both[:, 0], defaults)
    np.testing.assert_array_equal(both[0, 1], starts[0])
    quiet = float(objective(at(centres[1], [0.0, 0.0, 6.5])))
    if values[1] < quiet and not np.array_equal(starts[1], defaults[1]):
        np.testing.assert_array_equal(both[1, 1], starts[1])
    else:
        assert np.all(np.isnan(both[1, 1]))
    assert "second start" in lines[0]
    one = cell_starts(objective, template, centres, cand[:0], defaults, 6.5, {}, lines.append)
    np.testing.assert_array_equal(one, defaults[:, None, :])
    done = cell_starts(objective, template, centres, cand, defaults, 6.5, {0: {}}, lines.append)
    assert np.all(np.isnan(done[0, 1]))
    # with Dask's workers each cell's task scores its own grid (`cell_starts(in_tasks=True)`
    # gives the first starts, `task_starts` runs in the task on `start_pool`): the same
    firsts = cell_starts(
        objective, template, centres, cand, defaults, 6.5, {}, lines.append, in_tasks=True
    )
    np.testing.assert_array_equal(firsts, defaults[:, None, :])
    assert "in each cell's task, on the workers" in lines[-1]
    pool = start_pool(cand, 6.5)
    assert pool.shape == (1 + len(cand), 3) and pool[0].tolist() == [0.0, 0.0, 6.5]
    for i in range(len(centres)):
        np.testing.assert_array_equal(
            task_starts(objective, template, centres[i], defaults[i], pool), both[i]
        )


@slow_ci
def test_the_polishing_fit_starts_from_the_best_two_of_its_grid_over_the_cell():
    """`polish_start`: the two lowest of the `n` x `n` x masses candidates over the cell, in
    the cell objective with the rest of the template held (brute force), the template's own
    subhalo not among them; `check_polish` refuses what is not 0 or >= 2."""
    from equilens.subhalo._cells import CellSetup, _value, place
    from equilens.subhalo._polish import cell_template, check_polish, polish_start
    from equilens.subhalo._scan import _as_sum, with_subhalo
    from equilens.subhalo._seed import start_candidates

    objective, start = _lens(True)
    smooth = _as_sum(el.fit(objective, start, covariance=False).model)
    # a "best fit" whose subhalo sits in a sub-cell of half-width 0.1" far from the truth
    best = with_subhalo(
        smooth,
        Subhalo(
            log10_mass=8.0,
            u=0.5,
            v=-0.5,
            cell_x=0.3,
            cell_y=0.6,
            half=0.1,
            host_theta_E=0.9,
            cosmology=LC,
            kind="pseudo_jaffe",
        ),
    )
    template = cell_template(best, 0.3)
    sub = template.mass.components[-1]
    assert float(sub.half) == pytest.approx(0.3) and float(sub.u) == float(sub.v) == 0.0
    setup = CellSetup(objective, objective, template, "bfgs", None, {}, 10, laplace_evidence, 6.5)
    centre = np.asarray([0.2, 0.7])
    masses = (8.0, 9.0, 10.0)
    rows = polish_start(setup, centre, 3, masses, (6.0, 11.0))
    cand = start_candidates(3, masses, (6.0, 11.0))
    dtype = sub.log10_mass.dtype
    cell = jnp.asarray(centre, dtype)
    values = [float(_value(objective, place(template, cell, jnp.asarray(c, dtype)))) for c in cand]
    # (the two lowest, to the round-off between the batched and the single evaluations)
    index = [int(np.flatnonzero(np.all(cand == r, axis=1))[0]) for r in rows]
    assert index[0] != index[1]
    tol = 1e-9 if X64 else 1e-4
    np.testing.assert_allclose(
        [values[k] for k in index], np.sort(values)[:2], rtol=tol, atol=tol * abs(values[0])
    )
    assert tuple(rows[0, :2]) == pytest.approx((-2 / 3, 2 / 3))  # the candidate at (0, 0.9)
    with pytest.raises(ValueError, match="polish must be"):
        check_polish(1)
    with pytest.raises(ValueError, match="polish must be"):
        check_polish(True)
    assert check_polish(0) == 0 and check_polish(7) == 7


@slow_ci
def test_the_best_subhalo_model_is_polished_over_its_cell_and_resumed(tmp_path):
    """`subhalo_scan(polish=n)`: the best sub-cell's model fitted again over the whole best
    cell from its grid's best; `best` is its subhalo exactly when its evidence is higher;
    written to the checkpoint and read back."""
    objective, start = _lens(True)
    smooth = el.fit(objective, start, covariance=False)
    path = tmp_path / "cells.jsonl"
    kw = dict(
        grid=np.asarray([[0.1, 0.8]]),
        half=0.3,
        kind="pseudo_jaffe",
        checkpoint=path,
        progress=False,
        refine=2,
        polish=3,
        smooth_starts=0,
        searched_cells=0,
    )
    lines = []
    scan = subhalo_scan(objective, smooth, LC, log=lines.append, **kw)
    p, sub = scan.polished, scan.refinement
    assert p is not None and sub is not None and p.failed == 0
    np.testing.assert_array_equal(p.centres, [[0.1, 0.8]])
    assert p.half == 0.3
    fitted = p.fits[0].mass.components[-1]
    assert float(fitted.half) == pytest.approx(0.3)  # free over the whole cell
    x, y = (float(c) for c in fitted.center)
    assert math.hypot(x - 0.0, y - 0.9) < 0.1
    polished, refined = float(p.delta_log_evidence[0]), float(np.max(sub.delta_log_evidence))
    assert polished > 10
    assert scan.best["polished"] == (polished > refined)
    assert scan.best["delta_log_evidence"] == pytest.approx(max(polished, refined))
    if scan.best["polished"]:
        assert scan.best_fit is p.fits[0] and scan.best["sub_cell"] is None
        assert scan.best["center_x"] == pytest.approx(x)
    else:
        assert scan.best_fit is sub.fits[scan.best["sub_cell"]]
    assert scan.best["cell_delta_log_evidence"] == pytest.approx(sub.delta_log_evidence_grid)
    out = scan.to_dict()
    json.dumps(out)
    assert out["polished"]["chosen"] == scan.best["polished"]
    assert out["polished"]["delta_log_evidence"] == pytest.approx(polished)
    assert sum(line.startswith("polished cell 1") for line in lines) == 1
    text = path.read_text().splitlines()
    assert sum('"polish"' in line for line in text) == 1
    again = subhalo_scan(objective, smooth, LC, **kw)
    assert again.polished is not None and again.polished.resumed == 1
    assert again.polished.log_evidence[0] == p.log_evidence[0]
    assert again.best["polished"] == scan.best["polished"]
    assert again.best["center_x"] == pytest.approx(scan.best["center_x"], rel=1e-12)
    assert len(path.read_text().splitlines()) == len(text)


@pytest.mark.precision_independent
def test_a_cell_with_two_starts_keeps_the_fit_that_ends_lower():
    """`_cell_task`'s choice between a cell's fits (`_better`): the lowest cell objective,
    a fit whose value is not finite never chosen while another is (`_lowest`); a cell's
    starts are its finite rows (a NaN row is no start; one row is one start)."""
    from equilens.subhalo._cells import _lowest, _rows

    nan = float("nan")
    assert _lowest([3.0, 1.0, nan]) == 1
    assert _lowest([nan, 1.0, 3.0]) == 1
    assert _lowest([nan, 5.0]) == 1
    assert _lowest([float("inf"), 5.0]) == 1
    assert _lowest([nan]) == 0
    rows = _rows(np.array([[0.0, 0.1, 9.0], [np.nan] * 3]))
    assert len(rows) == 1 and rows[0].tolist() == [0.0, 0.1, 9.0]
    assert len(_rows(np.array([0.5, -0.5, 8.0]))) == 1


@slow_ci
def test_the_vectorised_scan_equals_the_loop_with_two_starts_a_cell():
    """The cells' vectorised route (`route="vmap"`: every cell's fits from all its starts as
    one `fit_batch`) gives the loop's Delta log E and subhalo, with the start grid's second
    starts (the cell holding the injected subhalo gets one)."""
    objective, start = _lens(True)
    smooth = el.fit(objective, start, covariance=False)
    centres = np.asarray([[0.1, 0.8], [-0.8, -0.6]])
    kw = dict(
        grid=centres,
        half=0.3,
        kind="pseudo_jaffe",
        refine=0,
        polish=0,
        smooth_starts=0,
        searched_cells=0,
        progress=False,
    )
    lines = []
    loop = subhalo_scan(objective, smooth, LC, route="loop", log=lines.append, **kw)
    vmap = subhalo_scan(objective, smooth, LC, route="vmap", **kw)
    assert any("second start" in line and not line.startswith("start grid: 0") for line in lines)
    tol = 1e-6 if X64 else 1e-2
    np.testing.assert_allclose(vmap.delta_log_evidence, loop.delta_log_evidence, atol=tol)
    for key in ("center_x", "center_y", "log10_mass"):
        assert vmap.best[key] == pytest.approx(loop.best[key], abs=tol)


def test_scan_free_holds_a_pixelized_sources_hyperparameters_alone():
    """A scan's default free parameters are `fit`'s less the pixelized source's mesh and
    regularization parameters (named in `held`); a parametric source, or a `free` given,
    is left as it is."""
    from equilens.subhalo import scan_free
    from equilens.subhalo._scan import _as_sum

    objective, start = _lens(False)
    assert scan_free(objective, start, None, None) == (None, ())
    given = lambda leaf: True
    assert scan_free(objective, start, given, None) == (given, ())
    pix = _as_sum(
        el.LensSystem(
            mass=start.mass,
            source=el.PixelizedSource(el.RectangularMesh((8, 8)), el.AdaptiveBrightness(2.0, 0.5)),
        )
    )
    term = el.LogEvidence(objective.terms[0].imaging)
    free, held = scan_free(el.Objective(term), pix, None, None)
    assert held == (
        "source.regularization.inner_coefficient",
        "source.regularization.outer_coefficient",
        "source.regularization.signal_scale",
    )
    from equilens.solve._parametrise import parametrisation

    every = parametrisation(el.Objective(term), pix, None, None)
    ours = parametrisation(el.Objective(term), pix, free, None)
    names = [p.lstrip(".") for p, f in zip(every.leaf_paths, every.free, strict=True) if f]
    kept = [p.lstrip(".") for p, f in zip(ours.leaf_paths, ours.free, strict=True) if f]
    assert kept == [n for n in names if n not in held] and len(kept) == len(names) - 3
    assert all(n.startswith("mass.") for n in kept)


@slow_ci
def test_dask_tasks_of_two_scans_with_one_set_up_have_keys_of_their_own(monkeypatch):
    """Every task a scan submits has a key of its own, also for a second scan (or a
    refinement) whose set-up object is the same one, or a new one at the freed one's
    address: a key submitted again while Dask forgets it can wait for ever
    (dask/distributed#7356); and the set-up is scattered under random keys, not its
    content's hash, which a refinement's scatter of the same parts reused while the
    scheduler forgot them (its tasks cancelled for lost dependencies, in CI)."""
    distributed = pytest.importorskip("distributed")
    from equilens.subhalo import _cells

    keys = []

    class Client:
        def run(self, *args):
            pass

        def scatter(self, setup, broadcast, hash=True):
            assert broadcast and hash is False
            return setup

        def submit(self, fn, shared, centre, uv, pool, key):
            keys.append(key)
            return Done(key)

    class Done:
        def __init__(self, key):
            self.key = key

        def result(self):
            return self.key

    monkeypatch.setattr(distributed, "as_completed", lambda futures: list(futures))
    setup = _cells.CellSetup(*("the set-up",) * 9)
    centres, uv = np.zeros((3, 2)), np.zeros((3, 2))
    for _ in range(2):
        done = dict(_cells._on_dask(Client(), setup, centres, uv, [0, 1, 2]))
        assert sorted(done) == [0, 1, 2] and [done[i] for i in range(3)] == keys[-3:]
    assert len(set(keys)) == 6


@pytest.mark.precision_independent
def _old_header() -> dict:
    """A checkpoint's header with the keys it had before the preconditioner."""
    from equilens.subhalo import _cells

    return {
        "format": _cells.CHECKPOINT_FORMAT,
        "kind": "tnfw",
        "mass_range": [6.0, 11.0],
        "half": 0.5,
        "centres": [[0.0, 0.0]],
        "smooth_log_evidence": 1.0,
        "start_grid": 0,
        "start_masses": [],
    }


def test_cells_are_fitted_in_units_of_the_smooth_models_errors(tmp_path):
    """The cell fit's preconditioner (`cell_scale`): the smooth model's errors in the fit's
    coordinates for the parameters both share (at most `MAX_SCALE`: a direction the
    evidence leaves flat), `SUBHALO_SCALE` for the subhalo's; a checkpoint written by a
    scan of the other kind (or before the preconditioner, without the key) is refused."""
    from equilens.solve._laplace import LaplaceEvidence
    from equilens.subhalo import _cells

    ev = LaplaceEvidence(
        log_evidence=0.0,
        model=None,
        covariance=np.eye(2),
        names=(".mass.theta_E", ".mass.e1"),
        newton_steps=0,
        floored=0,
        negative=0,
        gradient_norm=0.0,
        raw_errors=np.array([1e-4, 50.0]),
    )
    names = (".mass.theta_E", ".mass.e1", ".sub.log10_mass", ".sub.u")
    scale = _cells.cell_scale(ev, names)
    np.testing.assert_array_equal(
        scale, [1e-4, _cells.MAX_SCALE, _cells.SUBHALO_SCALE, _cells.SUBHALO_SCALE]
    )
    header = _old_header()
    path = tmp_path / "cells.jsonl"
    path.write_text(json.dumps({"header": header}) + "\n")  # (no "preconditioned")
    now = {
        **header,
        "preconditioned": False,
        "second_start": False,
        "fit_plateau": None,
        "smoothing_start": None,
        "subhalo_samples": 0,
        "held": None,
    }
    assert _cells._read_checkpoint(path, now) == []
    with pytest.raises(ValueError, match="another preconditioned"):
        _cells._read_checkpoint(path, {**now, "preconditioned": True})
    # a start grid's checkpoint from before its best became a second start (it replaced the
    # cell's default start) is refused by a scan with the grid now
    grid = {**header, "start_grid": 3, "start_masses": [9.0]}
    path.write_text(json.dumps({"header": grid}) + "\n")
    with pytest.raises(ValueError, match="another second_start"):
        _cells._read_checkpoint(
            path,
            {
                **grid,
                "preconditioned": False,
                "second_start": True,
                "fit_plateau": None,
                "smoothing_start": None,
                "subhalo_samples": 0,
                "held": None,
            },
        )


def test_the_scans_fit_tolerance_is_its_fits_plateau_and_in_its_checkpoint(tmp_path):
    """`fit_plateau`: `(PLATEAU_STEPS, fit_tolerance)`, by default `FIT_TOLERANCE` for a
    rough (pixelized) evidence and no rule otherwise; bad values refused; the scan's fits
    get it (`_fit` passes it to `fit`: the same fit as `fit`'s own with it); a checkpoint
    from before the key (no rule) is refused by a scan with one."""
    from equilens.subhalo import _cells

    assert _cells.fit_plateau(None, True) == (_cells.PLATEAU_STEPS, _cells.FIT_TOLERANCE)
    assert _cells.fit_plateau(None, False) is None
    assert _cells.fit_plateau(2.0, False) == (_cells.PLATEAU_STEPS, 2.0)
    assert _cells.fit_plateau(0.0, True) is None  # (0: no rule)
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="fit_tolerance must be >= 0"):
            _cells.fit_plateau(bad, True)
    objective, start = _lens(False)
    off = eqx.tree_at(lambda s: s.mass.components[0].theta_E, start, jnp.asarray(0.85))
    rule = (3, 1e6)  # (every step misses it: the fit ends 3 accepted steps after its first)
    mine = _cells._fit(objective, off, "bfgs", None, None, 300, plateau=rule)
    ref = el.fit(objective, off, "bfgs", max_steps=300, covariance=False, plateau=rule)
    plain = _cells._fit(objective, off, "bfgs", None, None, 300)
    assert float(mine.value) == float(ref.value) and int(mine.num_steps) == int(ref.num_steps)
    assert int(mine.num_steps) < int(plain.num_steps)
    header = {
        **_old_header(),
        "preconditioned": True,
        "second_start": False,
        "smoothing_start": None,
        "subhalo_samples": 0,
        "held": None,
    }
    rule = [_cells.PLATEAU_STEPS, _cells.FIT_TOLERANCE]
    path = tmp_path / "cells.jsonl"
    path.write_text(json.dumps({"header": header}) + "\n")  # (no "fit_plateau")
    assert _cells._read_checkpoint(path, {**header, "fit_plateau": None}) == []
    with pytest.raises(ValueError, match="another fit_tolerance"):
        _cells._read_checkpoint(path, {**header, "fit_plateau": rule})
    path.write_text(json.dumps({"header": {**header, "fit_plateau": rule}}) + "\n")
    assert _cells._read_checkpoint(path, {**header, "fit_plateau": rule}) == []


@pytest.mark.precision_independent
def test_the_smooth_models_refits_are_written_to_the_checkpoint_and_resumed(monkeypatch, tmp_path):
    """Each refit of the smooth model is appended to the checkpoint as it finishes (its
    start's tag, log-evidence and free parameters); a scan resumed with the file's records
    runs none again and rebases on the same smooth model; a record of another start (a
    refinement with other sub-cells) is not taken for this one's."""
    from equilens.solve._laplace import LaplaceEvidence
    from equilens.subhalo import _smooth
    from equilens.subhalo._scan import SubhaloScan

    objective, start = _lens(False)
    smooth = _smooth._as_sum(start)
    fits = [
        eqx.tree_at(lambda s: s.mass.components[0].theta_E, smooth, jnp.asarray(t))
        for t in (1.01, 1.02, 1.03)
    ]
    log_e = np.asarray([120.0, 135.0, 128.0])
    scan = SubhaloScan(
        centres=np.zeros((3, 2)),
        half=0.3,
        log_evidence=log_e,
        delta_log_evidence=log_e - 10.0,
        smooth_log_evidence=10.0,
        status=("successful",) * 3,
        fits=tuple(fits),
        best_index=1,
        best={"delta_log_evidence": 125.0},
        delta_log_evidence_grid=0.0,
        smooth=smooth,
        cosmology=LC,
        wall_time=0.0,
        resumed=0,
    )
    gains = {1.02: 125.0, 1.03: 131.0, 1.01: None}
    seen = []

    def again(objective, start, *fit):
        t = round(float(start.mass.components[0].theta_E), 2)
        seen.append(t)
        if gains[t] is None:
            return None
        return LaplaceEvidence(10.0 + gains[t], start, np.zeros((0, 0)), (), 0, 0, 0, 0.0)

    monkeypatch.setattr(_smooth, "_smooth_again", again)
    path = tmp_path / "cells.jsonl"
    fit = ("bfgs", None, None, 10, None)  # (solver, free, bounds, max_steps, evidence)
    out = _smooth.smooth_refits(scan, 3, print, objective, *fit, checkpoint=path)
    assert seen == [1.02, 1.03, 1.01] and out.smooth_gain == 131.0
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["refit"] for r in records] == ["cell 2", "cell 3", "cell 1"]
    assert records[2]["log_evidence"] is None and records[2]["values"] is None
    seen.clear()
    lines = []
    back = _smooth.smooth_refits(
        scan, 3, lines.append, objective, *fit, checkpoint=path, records=records
    )
    assert seen == [] and back.smooth_gain == 131.0 and back.smooth_log_evidence == 141.0
    assert float(back.smooth.mass.components[0].theta_E) == 1.03
    assert all(line.endswith("(resumed)") for line in lines[:3]) and "failed" in lines[2]
    assert len(path.read_text().splitlines()) == 3  # nothing written again
    # a record under another start's tag is not this start's
    other = [{**r, "refit": r["refit"].replace("cell", "sub-cell 0 of 4 of cell")} for r in records]
    _smooth.smooth_refits(scan, 3, print, objective, *fit, records=other)
    assert seen == [1.02, 1.03, 1.01]


def _stand_in_scan(log_e, fits, smooth_log_e, refinement=None):
    """A `SubhaloScan` of the cells' log-evidences `log_e` and stand-in `fits` (for the smooth
    refits' bookkeeping)."""
    from equilens.subhalo._scan import SubhaloScan

    log_e = np.asarray(log_e, np.float64)
    return SubhaloScan(
        centres=np.zeros((len(fits), 2)),
        half=0.3,
        log_evidence=log_e,
        delta_log_evidence=log_e - smooth_log_e,
        smooth_log_evidence=smooth_log_e,
        status=("successful",) * len(fits),
        fits=tuple(fits),
        best_index=int(np.nanargmax(log_e)),
        best={"delta_log_evidence": float(np.nanmax(log_e)) - smooth_log_e},
        delta_log_evidence_grid=0.0,
        smooth="first smooth",
        cosmology=LC,
        wall_time=0.0,
        resumed=0,
        refinement=refinement,
    )


def _stand_in_evidence(log_evidence, model):
    from equilens.solve._laplace import LaplaceEvidence

    return LaplaceEvidence(log_evidence, model, np.zeros((0, 0)), (), 0, 0, 0, 0.0)


@pytest.mark.precision_independent
def test_the_refits_the_coarse_cells_decide_start_beside_the_refinement(monkeypatch):
    """With a Dask client, the smooth refits from the best cells other than the best one
    are submitted as soon as the coarse cells are done (`early_refits`: the refinement
    and the polishing fit only raise the best cell's entry, so the same cells stay the
    best); `smooth_refits` takes their futures instead of fitting them again, submits the
    best cell's, and gives what the refits one after another give. Refits the checkpoint
    holds are not submitted; a submitted one no longer wanted is cancelled."""
    distributed = pytest.importorskip("distributed")
    from equilens.subhalo import _smooth

    gains = {"sub b": 125.0, "c3": 131.0, "c0": 2.0, "c2": 1.0}
    seen = []

    def again(objective, start, *fit):
        seen.append(start)
        return _stand_in_evidence(10.0 + gains[start], start)

    monkeypatch.setattr(_smooth, "_smooth_again", again)
    objective, _ = _lens(False)
    coarse = _stand_in_scan([120.0, np.nan, 135.0, 128.0], ["c0", None, "c2", "c3"], 10.0)
    refined = dataclasses.replace(
        coarse, refinement=_stand_in_scan([130.0, 141.0], ["sub a", "sub b"], 10.0)
    )
    here = _smooth.smooth_refits(refined, 3, print, objective)
    assert seen == ["sub b", "c3", "c0"]
    submitted = []
    submit = _smooth._submit

    def recorded(todo, *args):
        submitted.append([tag for tag, _ in todo])
        return submit(todo, *args)

    monkeypatch.setattr(_smooth, "_submit", recorded)
    with distributed.Client(processes=False, n_workers=1, threads_per_worker=1) as client:
        assert _smooth.early_refits(coarse, 3, objective, client=None) == {}
        assert _smooth.early_refits(coarse, 1, objective, client=client) == {}
        kept = [{"refit": "cell 4", "log_evidence": None, "values": None}]
        only = _smooth.early_refits(coarse, 3, objective, client=client, records=kept)
        assert list(only) == ["cell 1"] and only["cell 1"].result().model == "c0"
        pending = _smooth.early_refits(coarse, 3, objective, client=client)
        assert {tag: f.result().model for tag, f in pending.items()} == {
            "cell 4": "c3",
            "cell 1": "c0",
        }
        submitted.clear()
        there = _smooth.smooth_refits(refined, 3, print, objective, client=client, pending=pending)
        assert submitted == [["sub-cell 2 of 2 of cell 3"]]  # (only the best cell's)
        assert there.smooth_gain == here.smooth_gain and there.smooth == here.smooth
        np.testing.assert_array_equal(there.delta_log_evidence, here.delta_log_evidence)
        # a refit the final ranking does not name is cancelled, not waited for (this one
        # asks for a resource no worker has: it would wait for ever)
        extra = {"cell 9": client.submit(time.sleep, 30, resources={"absent": 1})}
        _smooth.smooth_refits(refined, 3, print, objective, client=client, pending=extra)
        assert extra["cell 9"].cancelled()


@pytest.mark.precision_independent
def test_the_smooth_model_is_fitted_again_from_the_best_subhalo_fits_and_the_best_kept(
    monkeypatch,
):
    """After the cells, the smooth model is refitted from the subhalo fits of the
    `smooth_starts` best cells (one fit a cell, the refined cell's the best of its own and
    its sub-cells', failed ones skipped), and the scan is rebased on the best refit when it
    beats the first smooth fit."""
    from equilens.subhalo import _smooth

    scan = _stand_in_scan

    # one start a cell, the refined cell (2, the best) the best of its fit and sub-cells'
    sub = scan([130.0, 141.0], ["sub a", "sub b"], 10.0)
    coarse = scan([120.0, np.nan, 135.0, 128.0], ["c0", None, "c2", "c3"], 10.0, sub)
    assert _smooth._best_fits(coarse, 2) == ["sub b", "c3"]
    assert _smooth._best_fits(coarse, 9) == ["sub b", "c3", "c0"]
    assert _smooth._best_fits(coarse, 0) == []
    worse = scan([130.0, 131.0], ["sub a", "sub b"], 10.0)
    assert _smooth._best_fits(scan([120.0, 135.0], ["c0", "c1"], 10.0, worse), 1) == ["c1"]
    # each start's refit: the second start reaches the best smooth mode, the third fails
    gains = {"sub b": 125.0, "c3": 131.0, "c0": None}
    seen = []

    def again(objective, start, *fit):
        seen.append(start)
        g = gains[start]
        if g is None:
            return None
        return _stand_in_evidence(10.0 + g, start)

    monkeypatch.setattr(_smooth, "_smooth_again", again)
    lines = []
    objective, _ = _lens(False)
    out = _smooth.smooth_refits(coarse, 3, lines.append, objective)
    assert seen == ["sub b", "c3", "c0"]
    assert out.smooth_gain == 131.0 and out.smooth == "c3" and out.smooth_log_evidence == 141.0
    np.testing.assert_allclose(out.delta_log_evidence, [-21.0, np.nan, -6.0, -13.0])
    assert out.refinement is not None and out.refinement.smooth_gain == 131.0
    np.testing.assert_allclose(out.refinement.delta_log_evidence, [-11.0, 0.0])
    assert out.best["delta_log_evidence"] == pytest.approx(135.0 - 141.0)
    assert "failed" in lines[2] and lines[-1].endswith("+131.00")
    # refits below the first smooth fit leave the scan as it was; none asked for, none run
    gains.update({"sub b": -1.0, "c3": -3.0})
    assert _smooth.smooth_refits(coarse, 3, lines.append, objective) is coarse
    seen.clear()
    assert _smooth.smooth_refits(coarse, 0, lines.append, objective) is coarse and seen == []


def test_the_cells_evidences_are_corrected_along_the_subhalo_when_asked(monkeypatch, tmp_path):
    """`subhalo_scan(subhalo_samples=n)`: each cell's Laplace evidence (not the smooth
    model's) is corrected by importance sampling along the subhalo's `u`, `v` and
    `log10_mass` (`laplace_evidence(block=...)`), the cell's log-evidence the corrected
    one; the checkpoint's header says how many points (a checkpoint without, 0, is
    refused); bad values are refused; the default is the Laplace approximation alone."""

    objective, start = _lens(False)
    smooth = el.fit(objective, start, covariance=False)
    calls = _recorded_evidences(monkeypatch)
    path = tmp_path / "cells.jsonl"
    kw = dict(grid=np.asarray([[0.1, 0.8]]), half=0.3, kind="pseudo_jaffe", progress=False)
    kw.update(refine=0, polish=0, smooth_starts=0, start_grid=0, held_cells=0, checkpoint=path)
    kw.update(searched_cells=0)
    scan = subhalo_scan(objective, smooth, LC, subhalo_samples=64, **kw)
    assert scan.failed == 0 and len(calls) == 2  # the smooth model, the cell
    (first, _), (cell, ev) = calls
    assert "block" not in first
    sub = f"mass.components[{len(scan.fits[0].mass.components) - 1}]."
    assert cell["block"] == (sub + "u", sub + "v", sub + "log10_mass")
    assert cell["block_samples"] == 64
    assert math.isfinite(ev.block_correction) and ev.effective_samples > 1
    assert scan.log_evidence[0] == ev.log_evidence
    header = json.loads(path.read_text().splitlines()[0])["header"]
    assert header["subhalo_samples"] == 64
    with pytest.raises(ValueError, match="another subhalo_samples"):
        subhalo_scan(objective, smooth, LC, **kw)  # (the default: 0)
    for bad in (1, -2):
        with pytest.raises(ValueError, match="subhalo_samples"):
            subhalo_scan(objective, smooth, LC, subhalo_samples=bad, **kw)
    for bad in (2.5, True):  # (the type check refuses them first where it is on)
        with pytest.raises((ValueError, TypeError), match="subhalo_samples"):
            subhalo_scan(objective, smooth, LC, subhalo_samples=bad, **kw)  # pyright: ignore[reportArgumentType]
