"""`block_integral` and `laplace_evidence(block=...)`: a block of bounded parameters whose
integrand the Laplace approximation's Gaussian misdescribes (flat, bounded on one side,
its curvature the objective's roughness), against integrals known in closed form or by
quadrature."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.integrate import quad
from scipy.special import i0

import equilens as el
from equilens.solve._block import block_integral
from equilens.solve._laplace import laplace_evidence


def _log_logistic(z):
    z = np.asarray(z, np.float64)
    return -np.logaddexp(0.0, z) - np.logaddexp(0.0, -z)


def _prior_f(points, idx):
    """`F` of a flat likelihood: the logistic priors of the coordinates `idx` alone."""
    return -np.sum(_log_logistic(np.atleast_2d(points)[:, idx]), axis=1)


def _gauss_log(h):
    k = h.shape[0]
    return 0.5 * k * math.log(2 * math.pi) - 0.5 * np.linalg.slogdet(h)[1]


def test_a_flat_block_gets_its_priors_mass_whatever_the_curvature_it_was_given():
    """A likelihood flat along two bounded parameters: the slice's integral is
    `1 / prior(z*)` (the logistic densities integrate to 1), whatever the Hessian's block
    (here 1e4 and 4e3, as a roughness would give)."""
    z = np.array([0.7, 0.3, -0.5])  # the block: 1 and 2; 0 held
    hess = np.diag([50.0, 1e4, 4e3])
    hess[1, 2] = hess[2, 1] = 100.0
    out = block_integral(lambda p: _prior_f(p, [1, 2]), z, hess, [1, 2])
    exact = -float(np.sum(_log_logistic(z[1:]))) - _gauss_log(hess[1:, 1:])
    assert exact > 5  # the premise: the Gaussian is far too narrow
    assert out.log_ratio == pytest.approx(exact, abs=max(3 * out.error, 0.02))
    assert out.error < 0.08 and out.effective > 100  # (half the points on the prior)
    # the same points for every call
    assert block_integral(lambda p: _prior_f(p, [1, 2]), z, hess, [1, 2]) == out


def test_a_gaussian_block_is_left_as_the_laplace_approximation_has_it():
    """A narrow Gaussian likelihood (errors 0.01 and 0.02 in z) inside the logistic
    priors: the Laplace approximation is right to 1e-4, and the correction is 0 to its
    error."""
    a = np.array([[1e4, 2e3], [2e3, 2.5e3]])
    m = np.array([0.2, -1.0])
    hess = a + np.diag(np.exp(_log_logistic(m)) * 2)  # (about the prior's curvature)

    def f(p):
        d = np.atleast_2d(p) - m[None, :]
        return 0.5 * np.einsum("ni,ij,nj->n", d, a, d) + _prior_f(p, [0, 1])

    out = block_integral(f, m, hess, [0, 1])
    assert abs(out.log_ratio) < max(3 * out.error, 0.01)
    assert out.error < 0.02


def test_a_block_bounded_on_one_side_gets_the_priors_mass_below_the_bound():
    """A subhalo's mass as the data see it at a lens's centre: free below a limit,
    excluded above it (`F` rising by 0.5 per 0.01 in z past it). The slice's integral is
    the prior's mass below the limit over the prior density at the mode, to the
    sampling's error, however steep the curvature the Gaussian took from the wall."""
    limit, z0 = 0.5, 0.4

    def f(p):
        x = np.atleast_2d(p)[:, 0]
        return _prior_f(p, [0]) + np.where(x > limit, 50.0 * (x - limit), 0.0)

    hess = np.array([[2500.0]])
    out = block_integral(f, np.array([z0]), hess, [0])
    # the prior's mass below the limit plus the wall's tail (1/50 of the density there)
    s = lambda x: 1 / (1 + math.exp(-x))
    mass = s(limit) + math.exp(_log_logistic(limit)) / 50.0
    exact = math.log(mass) - float(_log_logistic(z0)) - _gauss_log(hess)
    assert out.log_ratio == pytest.approx(exact, abs=max(3 * out.error, 0.05))


def test_a_block_coupled_to_the_others_is_integrated_along_their_conditional_mode():
    """A parameter `a` tied to the block's `b` (`a = c b` to an error of 0.05, as a
    subhalo's mass is traded against the host's Einstein radius), `b` flat under its
    logistic prior, and a Hessian whose `b` curvature a roughness inflated by 1e3: the
    profile over `a` is the prior along `b`, so the integral over the Gaussian of the
    marginal curvature is `4 sqrt(1e3 / 2 pi)` (the logistic's density 1/4 at the mode).
    The others held at the mode see only a narrow slice of the valley."""
    c, s = 1.0, 0.05

    def f(p):
        p = np.atleast_2d(p)
        return 0.5 * ((p[:, 0] - c * p[:, 1]) / s) ** 2 + _prior_f(p, [1])

    hess = np.array([[1 / s**2, -c / s**2], [-c / s**2, c**2 / s**2 + 1e3]])
    exact = math.log(4.0) - 0.5 * math.log(2 * math.pi / 1e3)
    out = block_integral(f, np.zeros(2), hess, [1])
    assert out.log_ratio == pytest.approx(exact, abs=max(3 * out.error, 0.02))
    held = block_integral(f, np.zeros(2), hess, [1], follow=False)
    assert held.log_ratio < exact - 2.0  # (the slice: 0.6 against 3.9)


def test_a_response_linear_in_the_blocks_size_is_followed_from_an_anchor():
    """`a` responds to the block `b` as a macro model to a subhalo's mass, `a = c e^b`
    (linear in the mass, `b` its log), to an error of 0.05; the data exclude `b > 0.5`
    (`F` rising by 50 a unit past it), and the Hessian's `b` curvature is a roughness's.
    The profile over `a` is the prior below the wall: its integral by quadrature. The
    conditional mode (linear in `b`) and the anchor `a = 0` (where the subhalo is too light
    to matter) each miss most of the valley; the line from the anchor through the mode,
    as far as `e^b` over its value at the mode, is the valley."""
    c, s = 1.0, 0.05

    def wall(b):
        return np.where(b > 0.5, 50.0 * (b - 0.5), 0.0)

    def f(p):
        p = np.atleast_2d(p)
        return 0.5 * ((p[:, 0] - c * np.exp(p[:, 1])) / s) ** 2 + _prior_f(p, [1]) + wall(p[:, 1])

    hess = np.array([[1 / s**2, -c / s**2], [-c / s**2, c**2 / s**2 + 1e3]])
    mass = quad(lambda b: math.exp(float(_log_logistic(b) - wall(b))), -40, 40, points=[0.5])[0]
    exact = math.log(4.0 * mass) - 0.5 * math.log(2 * math.pi / 1e3)
    z, anchor = np.array([c, 0.0]), np.array([0.0, 0.0])
    path = block_integral(
        f, z, hess, [1], samples=1024, anchors=[anchor], response=lambda b: np.exp(b[:, 0])
    )
    assert path.log_ratio == pytest.approx(exact, abs=max(3 * path.error, 0.1))
    # (the premise: without the line, a lower bound well below it)
    fixed = block_integral(f, z, hess, [1], samples=1024, anchors=[anchor])
    assert fixed.log_ratio < exact - 0.8


def test_block_integral_refuses_what_it_cannot_integrate():
    z, hess = np.zeros(2), np.eye(2)
    with pytest.raises(ValueError, match="positive definite"):
        block_integral(lambda p: _prior_f(p, [0]), z, -hess, [0])
    with pytest.raises(ValueError, match="samples"):
        block_integral(lambda p: _prior_f(p, [0]), z, hess, [0], samples=1)
    with pytest.raises(ValueError, match="not finite"):
        block_integral(lambda p: np.full(len(p), np.inf), z, hess, [0])


class _Pair(eqx.Module):
    a: jax.Array
    b: jax.Array


#: The ripple of `_FlatRipple` along `b` (its period 1/40 of `b`'s prior, (0, 1)).
_R, _K = 0.5, 2 * math.pi * 40


class _FlatRipple(el.terms.AbstractTerm):
    """`200 a^2` (an error of 0.05) and, along `b`, a ripple alone: the data leave `b`
    flat, but its values are rough on a scale of 1/40 of its prior."""

    def __call__(self, model):
        return 200.0 * model.a**2 - _R * jnp.cos(_K * model.b)


class _Valley(el.terms.AbstractTerm):
    """`_FlatRipple` with `a` tied to `b` along a valley straight in the fit's coordinates
    (`a = logit(b) / 2`, to an error of 0.05)."""

    def __call__(self, model):
        logit = jnp.log(model.b) - jnp.log1p(-model.b)
        return 200.0 * (model.a - 0.5 * logit) ** 2 - _R * jnp.cos(_K * model.b)


@pytest.mark.x64_only
def test_the_laplace_evidence_of_a_rough_block_coupled_to_an_other_parameter():
    """`laplace_evidence(block=["b"])` where `a` follows `b` along a valley: the integral
    over `a` is the same at every `b`, so the evidence is `_FlatRipple`'s, to 0.05."""
    objective = el.Objective(_Valley())
    point = _Pair(jnp.asarray(0.0), jnp.asarray(0.5))
    bounds = {lambda m: m.b: (0.0, 1.0)}
    exact = 0.5 * math.log(math.pi / 200.0) + math.log(i0(_R))
    plain = laplace_evidence(objective, point, bounds=bounds, smoothed=True)
    assert plain.log_evidence < exact - 2.0  # the premise
    ev = laplace_evidence(objective, point, bounds=bounds, smoothed=True, block=["b"])
    assert ev.log_evidence == pytest.approx(exact, abs=0.05)
    assert ev.log_evidence_error < 0.1
    # anchored at `a = 0` (no better than the valley itself) and on the line from it,
    # `b`'s response 1 throughout: the same integral
    anchor = _Pair(jnp.asarray(0.0), jnp.asarray(0.5))
    lined = laplace_evidence(
        objective,
        point,
        bounds=bounds,
        smoothed=True,
        block=["b"],
        block_anchors=[anchor],
        block_response=lambda b: np.ones(len(b)),
    )
    assert lined.log_evidence == pytest.approx(exact, abs=0.05)
    with pytest.raises(ValueError, match="needs block_anchors"):
        laplace_evidence(
            objective, point, bounds=bounds, block=["b"], block_response=lambda b: b[:, 0]
        )
    with pytest.raises(ValueError, match="need a block"):
        laplace_evidence(objective, point, bounds=bounds, block_anchors=[anchor])
    with pytest.raises(ValueError, match="at the mode"):
        laplace_evidence(
            objective,
            point,
            bounds=bounds,
            block=["b"],
            block_anchors=[anchor],
            block_response=lambda b: np.zeros(len(b)),
        )


@pytest.mark.x64_only
def test_the_laplace_evidence_of_a_flat_rough_parameter_with_its_block_corrected():
    """`laplace_evidence(block=["b"])` on a likelihood flat along `b` up to a fine
    ripple, `b`'s prior uniform on (0, 1), at the ripple's dip `b = 0.5`: the evidence
    integrates the prior, `log E = log int exp(-200 a^2) da + log I0(r)`, to 0.05; the
    smoothed Laplace approximation alone, its curvature along `b` the ripple's, charges
    an Occam penalty of several."""
    objective = el.Objective(_FlatRipple())
    point = _Pair(jnp.asarray(0.0), jnp.asarray(0.5))
    bounds = {lambda m: m.b: (0.0, 1.0)}
    exact = 0.5 * math.log(math.pi / 200.0) + math.log(i0(_R))
    assert math.log(quad(lambda b: math.exp(_R * math.cos(_K * b)), 0, 1, limit=400)[0]) == (
        pytest.approx(math.log(i0(_R)), abs=1e-6)
    )
    plain = laplace_evidence(objective, point, bounds=bounds, smoothed=True)
    assert plain.log_evidence < exact - 2.0  # the premise
    assert math.isnan(plain.block_correction)
    ev = laplace_evidence(objective, point, bounds=bounds, smoothed=True, block=["b"])
    assert ev.log_evidence == pytest.approx(exact, abs=0.05)
    assert ev.block_correction == pytest.approx(ev.log_evidence - plain.log_evidence)
    assert ev.log_evidence_error < 0.1 and ev.effective_samples > 50
    # without the smoothing too (the autodiff curvature: the ripple's at its dip)
    direct = laplace_evidence(objective, point, bounds=bounds, block=["b"])
    assert direct.log_evidence == pytest.approx(exact, abs=0.05)
    # refused: a parameter without two-sided bounds, a name that is not free, too few
    # points, the importance smoothing
    with pytest.raises(ValueError, match="two-sided"):
        laplace_evidence(objective, point, bounds=bounds, smoothed=True, block=["a"])
    with pytest.raises(ValueError, match="not a free parameter"):
        laplace_evidence(objective, point, bounds=bounds, smoothed=True, block=["c"])
    with pytest.raises(ValueError, match="block_samples"):
        laplace_evidence(
            objective, point, bounds=bounds, smoothed=True, block=["b"], block_samples=1
        )
    with pytest.raises(ValueError, match="differences"):
        laplace_evidence(
            objective, point, bounds=bounds, smoothed=True, block=["b"], smoothing="importance"
        )
