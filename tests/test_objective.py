"""Terms, objectives, the linear amplitude solve, and the free-parameter parametrisation."""

import math
import operator

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.optimize

import equilens as el
from equilens import light, mass
from equilens.objective import Parametrisation
from equilens.terms import solve_amplitudes
from helpers import fd_grad, rel_err, slow_ci

X64 = jax.config.read("jax_enable_x64")
needs_x64 = pytest.mark.x64_only


def _system():
    return el.LensSystem(
        mass=mass.SIE(theta_E=1.0, e1=0.08, e2=-0.04) + mass.ExternalShear(0.03, -0.01),
        lens_light=light.Sersic(amp=4.0, R_sersic=0.6, n_sersic=3.0, e1=0.05),
        source=light.Sersic(amp=15.0, R_sersic=0.12, n_sersic=1.2, center_x=0.05, e2=0.1),
    )


@pytest.fixture(scope="module")
def data():
    grid = el.Grid((48, 48), 0.06)
    psf = el.GaussianPSF(0.12, 0.06)
    return el.simulate(
        jax.random.key(3),
        _system(),
        grid,
        psf,
        exposure_time=1500.0,
        sky_level=0.5,
        mask=grid.circular_mask(1.4),
    )


def test_gaussian_likelihood_value_and_residuals(data):
    system = _system()
    term = el.GaussianLikelihood(data, linear=False)
    model = np.asarray(system.image(data.grid, data.psf))
    m = np.asarray(data.mask)
    d, n = np.asarray(data.data)[m], np.asarray(data.noise_map)[m]
    r = (d - model[m]) / n
    expect = 0.5 * np.sum(r**2) + np.sum(np.log(n)) + 0.5 * m.sum() * math.log(2 * math.pi)
    tol = 1e-10 if X64 else 1e-4
    assert rel_err(term.residuals(system), r) < tol
    assert abs(float(term(system)) - expect) / abs(expect) < tol
    assert abs(float(term.chi2(system)) - np.sum(r**2)) / np.sum(r**2) < tol


def test_objective_weights_residuals_and_errors(data):
    system = _system()
    prior = el.GaussianPrior(lambda s: s.mass.components[0].theta_E, 1.1, 0.05)
    obj = el.Objective([el.GaussianLikelihood(data), prior], weights=[1.0, 4.0])
    vals = obj.values(system)
    assert float(obj(system)) == pytest.approx(float(vals[0] + 4 * vals[1]), rel=1e-6)
    r = obj.residuals(system)
    assert float(0.5 * jnp.sum(r * r) + obj.constant()) == pytest.approx(
        float(obj(system)), rel=1e-6
    )
    # the prior's residual is sqrt(weight) (x - mean) / sigma
    assert float(r[-1]) == pytest.approx(2 * (1.0 - 1.1) / 0.05, rel=1e-5)
    poisson = el.PoissonLikelihood(data, exposure_time=1500.0, background=0.5 * 0.06**2)
    mixed = el.Objective([poisson])
    assert not mixed.least_squares
    with pytest.raises(TypeError, match="no least-squares form"):
        mixed.residuals(system)
    with pytest.raises(ValueError, match="least-squares solver"):
        el.fit(mixed, system, "lm")
    with pytest.raises(ValueError, match="at least one term"):
        el.Objective([])
    with pytest.raises(ValueError, match="weights must have shape"):
        el.Objective([prior], weights=[1.0, 2.0])


def test_poisson_likelihood_matches_scipy(data):
    system = _system()
    t, bkg = 1500.0, 0.5 * 0.06**2
    term = el.PoissonLikelihood(data, exposure_time=t, background=bkg)
    m = np.asarray(data.mask)
    lam = (np.asarray(system.image(data.grid, data.psf))[m] + bkg) * t
    c = np.maximum((np.asarray(data.data)[m] + bkg) * t, 0)
    from scipy.special import gammaln

    expect = np.sum(lam - c * np.log(lam) + gammaln(c + 1))
    assert abs(float(term(system)) - expect) / abs(expect) < (1e-10 if X64 else 1e-4)
    with pytest.raises(ValueError, match="non-negative counts"):
        el.PoissonLikelihood(data, exposure_time=t, background=-10.0)


@slow_ci
@needs_x64
def test_linear_solve_recovers_amplitudes_exactly():
    # noise-free data: the weighted least-squares amplitudes are the true ones
    system = _system()
    grid = el.Grid((40, 40), 0.06, supersampling=2)
    psf = el.GaussianPSF(0.12, 0.06)
    image = system.image(grid, psf)
    data = el.Imaging(np.asarray(image), np.full(image.shape, 0.01), psf, 0.06, supersampling=2)
    start = system.with_amplitudes(jnp.array([1.0, 1.0]))
    solved, model = solve_amplitudes(start, data)
    assert rel_err(solved.amplitudes(), system.amplitudes()) < 1e-9
    assert rel_err(model, image) < 1e-9


class _Ring(light.AbstractLightProfile):
    """A non-linear light profile (no `basis`): exercises the fixed-light path."""

    radius: jax.Array

    def intensity(self, x, y):
        return jnp.exp(-((jnp.hypot(x, y) - self.radius) ** 2) / 0.02)


@needs_x64
def test_linear_solve_with_a_nonlinear_component():
    system = _system()
    system = eqx.tree_at(
        lambda s: s.lens_light, system, system.lens_light + _Ring(jnp.asarray(0.5))
    )
    grid = el.Grid((40, 40), 0.06)
    psf = el.GaussianPSF(0.12, 0.06)
    image = system.image(grid, psf)
    data = el.Imaging(np.asarray(image), np.full(image.shape, 0.01), psf, 0.06)
    solved, model = solve_amplitudes(system.with_amplitudes(jnp.array([3.0, 2.0])), data)
    assert rel_err(solved.amplitudes(), system.amplitudes()) < 1e-9
    assert rel_err(model, image) < 1e-9


@needs_x64
def test_nonnegative_solve_matches_scipy_nnls(data):
    # a source far from the data's source: its best unconstrained amplitude is negative
    system = eqx.tree_at(lambda s: s.source.center_x, _system(), jnp.asarray(0.6))
    images, _ = system.linear_images(data.grid, data.convolution)
    m = np.asarray(data.mask)
    w = 1 / np.asarray(data.noise_map)[m]
    a = np.asarray(images)[:, m].T * w[:, None]
    b = np.asarray(data.data)[m] * w
    unconstrained = np.linalg.lstsq(a, b, rcond=None)[0]
    expect = scipy.optimize.nnls(a, b)[0]
    solved, _ = solve_amplitudes(system, data, nonnegative=True)
    got = np.asarray(solved.amplitudes())
    assert np.all(got >= 0)
    assert rel_err(got, expect) < 1e-8
    free_solved, _ = solve_amplitudes(system, data)
    assert rel_err(free_solved.amplitudes(), unconstrained) < 1e-8


@slow_ci
def test_nonnegative_solve_is_exact_for_a_multi_gaussian_lens_light():
    """Twenty overlapping Gaussians (a pixel to the mask radius) make a nearly degenerate
    basis: the solve must still reach SciPy's non-negative solution, never a negative
    amplitude (the coordinate descent used before stopped with a wrong active set here,
    and the re-solve on it gave amplitudes down to -245 with a chi2 below the
    constrained minimum, which a fit then exploited)."""
    grid = el.Grid((80, 80), 0.1)
    psf = el.GaussianPSF(0.16, 0.1)
    truth = el.LensSystem(
        mass=mass.SIE(theta_E=1.0, e1=0.1),
        lens_light=light.Sersic(amp=3.0, R_sersic=0.6, n_sersic=4.0, e1=0.05)
        + light.Sersic(amp=0.5, R_sersic=2.0, n_sersic=1.0),
        source=light.Sersic(amp=3.0, R_sersic=0.1, n_sersic=1.0, center_x=0.05),
    )
    data = el.simulate(
        jax.random.key(1),
        truth,
        grid,
        psf,
        exposure_time=500.0,
        sky_level=0.2,
        mask=grid.circular_mask(4.0),
    )
    lens = light.MGE(np.ones(20), np.geomspace(0.1, 4.0, 20), e1=0.03, e2=-0.05, center_x=0.04)
    system = el.LensSystem(
        mass=mass.SIE(theta_E=2.0, e1=0.2),
        lens_light=lens,
        source=light.Sersic(1.0, 0.16, 1.0, center_x=1.8, center_y=-1.3),
    )
    images, _ = system.linear_images(data.grid, data.convolution)
    m = np.asarray(data.mask)
    w = 1 / np.asarray(data.noise_map, dtype=float)[m]
    a = np.asarray(images, dtype=float)[:, m].T * w[:, None]
    b = np.asarray(data.data, dtype=float)[m] * w
    expect = scipy.optimize.nnls(a, b, maxiter=10_000)[0]
    solved, _ = solve_amplitudes(system, data, nonnegative=True)
    got = np.asarray(solved.amplitudes(), dtype=float)
    assert np.all(got >= 0)
    chi2 = lambda x: float(np.sum((a @ x - b) ** 2))
    # the constrained minimum, not below it (no negative amplitude), not above it
    assert abs(chi2(got) - chi2(expect)) <= (1e-9 if X64 else 1e-3) * chi2(expect)
    if X64:
        assert rel_err(got, expect) < 1e-6


def _flat_objective(obj, system, param):
    from jax.flatten_util import ravel_pytree

    vals, unravel = ravel_pytree(param.values(system))

    @jax.jit
    def f(p):
        return obj(param.with_values(unravel(jnp.asarray(p, dtype=vals.dtype)), system))

    return f, np.asarray(vals)


@needs_x64
@pytest.mark.parametrize(
    "which",
    [
        "gaussian-linear",
        "gaussian-nonneg",
        "poisson",
        # (the two of 13-17 s: in slow-ci, which CI runs)
        pytest.param("positions-source", marks=[pytest.mark.slow, pytest.mark.ci]),
        pytest.param("positions-image", marks=[pytest.mark.slow, pytest.mark.ci]),
        "positions-threshold",
    ],
)
def test_objective_gradients_match_finite_differences(data, which):
    system = _system()
    if which.startswith("gaussian"):
        term = el.GaussianLikelihood(data, nonnegative=which.endswith("nonneg"))
    elif which == "poisson":
        term = el.PoissonLikelihood(data, exposure_time=1500.0, background=0.5 * 0.06**2)
    else:
        # images of one source point under the true lens, slightly perturbed
        x = jnp.array([1.05, -0.9, 0.2, -0.1])
        y = jnp.array([0.1, -0.35, 1.0, -0.95])
        if which == "positions-threshold":
            # a threshold between the images' traced distances: some inside, some outside
            term = el.PositionsThreshold(x, y, threshold=0.05, sigma=0.01)
        else:
            term = el.PositionsTerm(x, y, 0.01, plane=which.split("-")[1])
    obj = el.Objective([term])
    lin = el.objective._params.linear_leaves(system, obj)
    param = Parametrisation.build(system, lin)
    f, p0 = _flat_objective(obj, system, param)
    grad = np.asarray(jax.grad(f)(jnp.asarray(p0)))
    fd = fd_grad(f, p0, h=1e-6)
    assert np.all(np.isfinite(grad))
    assert rel_err(grad, fd) < 1e-5, (grad, fd)


def test_positions_term_is_zero_for_exact_images():
    # four images of one source point: solve the lens equation from guesses
    lens = mass.SIE(theta_E=1.0, e1=0.1, e2=0.0)
    beta = jnp.array([0.03, 0.02])
    guesses = [(1.0, 0.1), (-1.0, -0.1), (0.1, 0.9), (-0.1, -0.9)]
    import optimistix as optx

    def lens_eq(t, _):
        bx, by = lens.ray_shoot(t[0], t[1])
        return jnp.stack([bx - beta[0], by - beta[1]])

    tol = 1e-12 if X64 else 1e-6
    solve = jax.jit(lambda g: optx.root_find(lens_eq, optx.Newton(tol, tol), g).value)
    sols = [solve(jnp.array(g, dtype=beta.dtype)) for g in guesses]
    x = jnp.stack([s[0] for s in sols])
    y = jnp.stack([s[1] for s in sols])
    tol = 1e-8 if X64 else 2e-2
    for plane in ("source", "image"):
        term = el.PositionsTerm(x, y, 0.005, plane=plane)
        assert float(jnp.max(jnp.abs(eqx.filter_jit(term.residuals)(lens)))) < tol
    moved = el.PositionsTerm(x.at[0].add(0.01), y, 0.005, plane="image")
    r = eqx.filter_jit(moved.residuals)(lens)
    assert 0.5 < float(jnp.max(jnp.abs(r))) < 3.0  # ~ a 0.01" offset over sigma 0.005"
    with pytest.raises(ValueError, match="same length"):
        el.PositionsTerm(jnp.zeros(3), jnp.zeros(2), 0.01)


def test_positions_threshold_is_zero_inside_and_quadratic_outside():
    lens = mass.SIS(theta_E=1.0)
    # an SIS maps x = 1.1 and x = -0.9 to beta = 0.1; the third image is off by 0.3
    x = jnp.array([1.1, -0.9, 1.4])
    y = jnp.zeros(3)
    bx = np.array([0.1, 0.1, 0.4])
    d = np.abs(bx - bx.mean())  # traced distances from the mean: 0.1, 0.1, 0.2
    for threshold, inside in ((0.25, True), (0.15, False)):
        term = el.PositionsThreshold(x, y, threshold=threshold, sigma=0.01)
        value = float(eqx.filter_jit(term)(lens))
        expect = 0.5 * np.sum((np.maximum(d - threshold, 0) / 0.01) ** 2)
        assert value == pytest.approx(expect, rel=1e-4, abs=1e-6)
        assert (value == 0.0) == inside
        grad = eqx.filter_grad(lambda m, t=term: t(m))(lens)
        assert np.isfinite(float(grad.theta_E))
        assert (float(grad.theta_E) == 0.0) == inside
    with pytest.raises(ValueError, match="same length"):
        el.PositionsThreshold(jnp.zeros(1), jnp.zeros(1), threshold=0.1, sigma=0.01)


def test_priors():
    system = _system()
    g = el.GaussianPrior(lambda s: s.mass.components[0].theta_E, 1.2, 0.1)
    expect = 0.5 * ((1.0 - 1.2) / 0.1) ** 2 + math.log(0.1 * math.sqrt(2 * math.pi))
    assert float(g(system)) == pytest.approx(expect, rel=1e-5)
    u = el.UniformPrior(lambda s: s.mass.components[0].theta_E, 0.5, 2.0)
    assert float(u(system)) == pytest.approx(math.log(1.5), rel=1e-5)
    outside = el.UniformPrior(lambda s: s.mass.components[0].theta_E, 1.5, 2.0)
    assert not np.isfinite(float(outside(system)))
    # a vector parameter: one sigma per element, each normalised (a scalar sigma, which
    # the normalisation would count once, is refused)
    both = lambda s: jnp.stack([s.mass.components[0].theta_E, s.source.center_x])
    v = el.GaussianPrior(both, jnp.asarray([1.2, 0.0]), jnp.asarray([0.1, 0.2]))
    x0 = float(system.source.center_x)
    expect2 = expect + 0.5 * (x0 / 0.2) ** 2 + math.log(0.2 * math.sqrt(2 * math.pi))
    assert float(v(system)) == pytest.approx(expect2, rel=1e-5, abs=1e-5)
    with pytest.raises(ValueError, match="the parameter has 2 elements but sigma has 1"):
        el.GaussianPrior(both, 0.0, 0.1)(system)


def test_parametrisation_bounds_round_trip_and_errors():
    system = _system()
    param = Parametrisation.build(system)
    raw = param.to_raw(system)
    back = param.to_model(raw, system)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(system), strict=True):
        assert rel_err(a, b) < (1e-12 if X64 else 1e-5)
    names = param.paths(system)
    # default: no shear expansion point (class-fixed); amplitudes free when nothing solves them
    assert "mass.components[1].ra_0" not in names
    assert "mass.components[0].theta_E" in names and "source.amp" in names
    # far-away raw values map inside the bounds
    wild = tuple(r + 50.0 for r in raw)
    far = param.to_model(wild, system)
    assert 0 < float(far.mass.components[0].theta_E)
    assert abs(float(far.mass.components[0].e1)) <= 0.6 + 1e-6
    bad = eqx.tree_at(lambda s: s.source.n_sersic, system, jnp.asarray(12.0))
    with pytest.raises(ValueError, match=r"source\.n_sersic = 12\.0 is outside its bounds"):
        Parametrisation.build(bad)
    ok = Parametrisation.build(bad, bounds={lambda s: s.source.n_sersic: (0.5, 15.0)})
    assert ok.bounds[ok.leaf_paths.index(".source.n_sersic")] == (0.5, 15.0)
    # a value exactly at a bound (as a fit that ran onto it returns it) starts just inside,
    # with finite raw values: chaining a fit from such a result works
    at = eqx.tree_at(
        lambda s: (s.source.n_sersic, s.mass.components[0].e1),
        system,
        (jnp.asarray(8.0), jnp.asarray(-0.6)),
    )
    p_at = Parametrisation.build(at)
    raw = p_at.to_raw(at)
    assert all(bool(jnp.all(jnp.isfinite(r))) for r in raw)
    back = p_at.to_model(raw, at)
    step = 1e-6 if X64 else 1e-4  # 1e-9 of the interval; 4 ulps in float32
    assert 8.0 - step < float(back.source.n_sersic) < 8.0
    assert -0.6 < float(back.mass.components[0].e1) < -0.6 + step


def test_a_start_close_to_a_bound_but_inside_it_is_kept():
    # A fit of the evidence can run a hyperparameter it does not constrain far towards a
    # bound (a coefficient of 1e-30 over (0, inf), a signal scale of 1e-14 over (0, 10));
    # the next stage, started there, must start there: moving such values to 1e-9 of
    # their bound changed a pixelized fit's log-evidence from 8,165 to -55,263
    reg = el.AdaptiveBrightness(1e-30, 2.0, 1e-14)
    param = Parametrisation.build(reg)
    back = param.to_model(param.to_raw(reg), reg)
    tol = 1e-12 if X64 else 1e-4
    for name in ("inner_coefficient", "outer_coefficient", "signal_scale"):
        assert rel_err(getattr(back, name), getattr(reg, name)) < tol, name
    # at the bound itself, the start is moved inside (as the test above)
    at = el.AdaptiveBrightness(1.0, 2.0, 10.0)
    p_at = Parametrisation.build(at)
    raw = p_at.to_raw(at)
    assert all(bool(jnp.all(jnp.isfinite(r))) for r in raw)
    assert 10.0 - (1e-7 if X64 else 1e-4) < float(p_at.to_model(raw, at).signal_scale) < 10.0


def test_free_selection():
    system = _system()
    obj = el.Objective([el.GaussianPrior(lambda s: s.source.amp, 1.0, 1.0)])
    lin = None
    mask = el.select(system, lambda s: (s.mass, s.source.center_x))
    param = Parametrisation.build(system, lin, free=mask)
    names = param.paths(system)
    assert "source.center_x" in names and "mass.components[0].theta_E" in names
    assert "mass.components[1].ra_0" not in names  # class-fixed inside a picked module
    assert "source.R_sersic" not in names
    direct = Parametrisation.build(
        system, free=el.select(system, lambda s: s.mass.components[1].ra_0)
    )
    assert direct.paths(system) == ("mass.components[1].ra_0",)
    by_predicate = Parametrisation.build(system, free=lambda leaf: leaf.ndim == 0)
    assert by_predicate.n_free == len(jax.tree.leaves(system))
    both = jax.tree.map(operator.or_, mask, el.select(system, lambda s: s.lens_light.n_sersic))
    assert "lens_light.n_sersic" in Parametrisation.build(system, free=both).paths(system)
    del obj
