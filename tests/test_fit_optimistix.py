"""`fit` on optimistix's entry points: the solver's `postprocess`, `options` and `adjoint`
(implicit differentiation through a fit, against the analytic solution and finite
differences), `throw` inside a transformation, `covariance=False`, and results whose
statistics are leaves."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optimistix as optx
import pytest

import equilens as el
from equilens import light, mass

X64 = jax.config.read("jax_enable_x64")


class _Line(eqx.Module):
    """A straight line `y = a + b x`: the model of the linear least-squares problems."""

    a: jax.Array
    b: jax.Array


class _LinearData(el.terms.AbstractLeastSquaresTerm):
    """Gaussian data `y` at `x` with unit errors: `0.5 |M p - y|^2`, whose minimum is
    `p* = (M^T M)^-1 M^T y`, a linear function of the data."""

    x: jax.Array
    y: jax.Array

    def residuals(self, model):
        return model.a + model.b * self.x - self.y

    def constant(self):
        return jnp.zeros((), self.y.dtype)


def _line_problem():
    x = jnp.linspace(-1.0, 2.0, 7)
    y = 0.4 - 1.3 * x + jnp.array([0.1, -0.05, 0.02, 0.0, -0.08, 0.03, 0.06])
    start = _Line(jnp.asarray(0.0), jnp.asarray(0.0))
    return x, y, start


class _ScaledDescent(optx.AbstractMinimiser):
    """Gradient descent with its rate read from `options["rate"]`: shows that `fit`'s
    `options` reach the solver. With `options["moving"] = k` only its first k steps move."""

    rtol: float = 1e-12
    atol: float = 1e-12
    norm = staticmethod(optx.max_norm)

    def init(self, fn, y, args, options, f_struct, aux_struct, tags):
        return jnp.array(0)

    def step(self, fn, y, args, options, state, tags):
        grad, aux = jax.grad(fn, has_aux=True)(y, args)
        rate = jnp.where(state < options.get("moving", 10**6), options["rate"], 0.0)
        return jax.tree.map(lambda p, g: p - rate * g, y, grad), state + 1, aux

    def terminate(self, fn, y, args, options, state, tags):
        return jnp.array(False), optx.RESULTS.successful

    def postprocess(self, fn, y, aux, args, options, state, tags, result):
        return y, aux, {}


@pytest.mark.precision_independent
def test_the_solvers_postprocess_gives_the_result():
    """`optx.BestSoFarMinimiser` returns the best point it saw: gradient descent with a
    step too long for the steepest direction ends far above where it passed, and the
    wrapped solver returns the best of the iterates (computed here by hand)."""
    x, y, start = _line_problem()
    objective = el.Objective(_LinearData(x, y))
    climbing = optx.GradientDescent(learning_rate=0.2, rtol=1e-8, atol=1e-8)
    bare = el.fit(objective, start, climbing, max_steps=8, throw=False)
    best = el.fit(objective, start, optx.BestSoFarMinimiser(climbing), max_steps=8, throw=False)
    assert int(bare.num_steps) == int(best.num_steps) == 8
    assert float(bare.value) > 10 * float(objective(start))  # the premise: it climbs
    # the iterates y_0 .. y_7 (the value a fit minimises has n_data = 1 here)
    m = np.stack([np.ones(x.shape), np.asarray(x)], axis=1)
    p, seen = np.zeros(2), []
    for _ in range(8):
        seen.append((0.5 * np.sum((m @ p - np.asarray(y)) ** 2), p))
        p = p - 0.2 * m.T @ (m @ p - np.asarray(y))
    value, point = min(seen, key=lambda s: s[0])
    assert value < float(objective(start)) and 10 * value < float(bare.value)
    np.testing.assert_allclose([float(best.model.a), float(best.model.b)], point, rtol=1e-5)
    assert float(best.value) == pytest.approx(value, rel=1e-5)


@pytest.mark.precision_independent
def test_options_reach_the_solver_and_rejected_steps_end_the_fit():
    x, y, start = _line_problem()
    objective = el.Objective(_LinearData(x, y))
    moving = el.fit(
        objective, start, _ScaledDescent(), options={"rate": 0.05}, max_steps=50, throw=False
    )
    assert float(moving.value) < 0.1 * float(objective(start))
    # after a step that moved, 20 unchanged steps in a row end the fit, converged
    once = {"rate": 0.05, "moving": 1}
    stalled = el.fit(objective, start, _ScaledDescent(), options=once, max_steps=100)
    assert stalled.success and int(stalled.num_steps) == 21
    # before any step moved (a line search still halving its first step), 64 do
    still = el.fit(objective, start, _ScaledDescent(), options={"rate": 0.0}, max_steps=100)
    assert still.success and int(still.num_steps) == 64
    assert float(still.model.a) == 0.0 and float(still.model.b) == 0.0
    # (beartype, on in the tests, names the parameter first; the check holds without it)
    with pytest.raises(TypeError, match="options"):
        el.fit(objective, start, "bfgs", options=[("rate", 0.1)])  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match="adjoint"):
        el.fit(objective, start, "bfgs", adjoint="implicit")  # pyright: ignore[reportArgumentType]


@pytest.mark.x64_only
@pytest.mark.parametrize("solver", ["lm", "bfgs"])
def test_implicit_gradient_of_a_fit_is_the_analytic_one(solver):
    """The fitted line is `(M^T M)^-1 M^T y`: its Jacobian with respect to the data is that
    matrix, and `jax.jacrev` through `fit` (optimistix's implicit adjoint) gives it."""
    x, y, start = _line_problem()
    m = np.stack([np.ones_like(x), np.asarray(x)], axis=1)
    expected = np.linalg.solve(m.T @ m, m.T)

    def fitted(data):
        objective = el.Objective(_LinearData(x, data))
        r = el.fit(objective, start, solver, rtol=1e-12, atol=1e-12, throw=False)
        return jnp.stack([r.model.a, r.model.b])

    np.testing.assert_allclose(np.asarray(fitted(y)), expected @ np.asarray(y), atol=1e-9)
    np.testing.assert_allclose(np.asarray(jax.jacrev(fitted)(y)), expected, atol=1e-8)
    # forward mode too, and under jit
    np.testing.assert_allclose(np.asarray(jax.jit(jax.jacfwd(fitted))(y)), expected, atol=1e-8)


@pytest.mark.slow
@pytest.mark.x64_only
def test_gradient_of_a_fitted_einstein_radius_matches_finite_differences():
    """A lens fit differentiated by the implicit function theorem: the derivative of the
    fitted Einstein radius along a direction in data space and with respect to a fixed
    parameter of the model (the source's Sersic index, held) match central differences
    of refits."""
    grid = el.Grid((32, 32), 0.08)
    psf = el.GaussianPSF(0.12, 0.08)
    truth = el.LensSystem(
        mass=mass.SIE(theta_E=0.9, e1=0.05, e2=-0.03),
        source=light.Sersic(amp=10.0, R_sersic=0.15, n_sersic=1.5, center_x=0.05),
    )
    data = el.simulate(jax.random.key(7), truth, grid, psf, exposure_time=1000.0, sky_level=0.5)
    objective = el.Objective(el.GaussianLikelihood(data))
    free = el.select(truth, lambda s: (s.mass, s.source.R_sersic, s.source.center_x))

    def theta_e(obj, model):
        r = el.fit(obj, model, "lm", free=free, rtol=1e-12, atol=1e-12, throw=False)
        return r.model.mass.theta_E

    direction = jax.random.normal(jax.random.key(1), data.data.shape) * data.noise_map

    def along(t):
        moved = eqx.tree_at(lambda o: o.terms[0].imaging.data, objective, data.data + t * direction)
        return theta_e(moved, truth)

    def with_index(n):
        return theta_e(objective, eqx.tree_at(lambda s: s.source.n_sersic, truth, n))

    # The steps move the fitted radius by ~1e-6, far more than the ~1e-10 to which a fit
    # determines it (chi2 ~ 4000 is flat to its round-off within ~1e-10 of the minimum:
    # with h = 1e-3 two refits landed 1e-10 apart and the difference was 9e-4 off; the
    # truncation error at these steps is ~2e-5 relative).
    for f, at, h in ((along, 0.0, 0.02), (with_index, 1.5, 0.01)):
        grad = float(jax.grad(f)(jnp.asarray(at)))
        fd = (float(f(jnp.asarray(at + h))) - float(f(jnp.asarray(at - h)))) / (2 * h)
        assert abs(fd) > 1e-5  # the premise: the fitted radius does depend on it
        assert grad == pytest.approx(fd, rel=2e-4, abs=1e-8)


@pytest.mark.precision_independent
def test_throw_inside_a_transformation_raises_from_the_device():
    x, y, start = _line_problem()

    @jax.jit
    def value(data):
        return el.fit(el.Objective(_LinearData(x, data)), start, "bfgs", max_steps=1).value

    with pytest.raises(Exception, match="maximum number of steps"):
        jax.block_until_ready(value(y))


@pytest.mark.precision_independent
def test_covariance_false_skips_it_and_results_are_pytrees_of_statistics():
    x, y, start = _line_problem()
    objective = el.Objective(_LinearData(x, y))
    with_cov = el.fit(objective, start, "lm")
    without = el.fit(objective, start, "lm", covariance=False)
    assert without.success and without.covariance.shape == (2, 2)
    assert np.all(np.isnan(np.asarray(without.covariance)))
    assert np.all(np.isfinite(np.asarray(with_cov.covariance)))
    assert float(without.model.a) == float(with_cov.model.a)
    # the status prints in words (optimistix's `successful` has an empty message)
    assert "RESULTS<successful>" in repr(with_cov) and with_cov.message() == "successful"
    batch = el.fit_batch(
        objective, jax.tree.map(lambda v: jnp.stack([v, v + 1]), start), "lm", covariance=False
    )
    assert batch.covariance.shape == (2, 2, 2) and np.all(np.isnan(np.asarray(batch.covariance)))
    assert batch.wall_time.shape == (2,)
    assert float(el.solve.pick(batch, 1).wall_time) > 0
    # two results of one fit: the statistics (wall time included) are leaves, so the
    # results tree-map together and pass through jit without compiling again
    moved = eqx.tree_at(lambda m: m.a, start, jnp.asarray(1.0))
    other = el.fit(objective, moved, "lm")
    assert float(other.wall_time) > 0
    diff = jax.tree.map(lambda a, b: a - b, with_cov, other)
    assert abs(float(diff.model.a)) < 1e-4

    @eqx.filter_jit
    @eqx.debug.assert_max_traces(max_traces=1)
    def reduced(result):
        return result.reduced_chi2

    assert float(reduced(with_cov)) == pytest.approx(float(reduced(other)), rel=1e-3)
