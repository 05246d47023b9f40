"""The brightness-adaptive rectangular mesh (`AdaptiveRectangularMesh(weight_floor=...)`):
its weighted quantiles, its bad input, where it puts its nodes, and what it does to the
evidence of a compact, bright source. (Its log-evidence against the dense NumPy reference
and its gradients: tests/test_pixelized.py; against the Numba backend: tests/test_numba.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import equilens as el
from equilens import light, mass
from equilens.source._mesh import quantile, weighted_quantile
from helpers import slow_ci

PS = 0.05


def test_weighted_quantiles_are_one_formula_on_both_backends_and_follow_the_weights():
    rng = np.random.default_rng(0)
    v = rng.uniform(0.0, 1.0, 400)
    q = np.linspace(0.0, 1.0, 9)
    w = np.where((v > 0.4) & (v < 0.5), 1.0, 0.01)
    got_np = weighted_quantile(np, v, w, q)
    got_jax = np.asarray(weighted_quantile(jnp, jnp.asarray(v), jnp.asarray(w), jnp.asarray(q)))
    np.testing.assert_allclose(got_jax, got_np, rtol=0, atol=1e-6)
    # the ends are the extreme values (the mesh covers every traced pixel), in order
    assert got_np[0] == v.min() and got_np[-1] == v.max()
    assert np.all(np.diff(got_np) > 0)
    # the heavy tenth of the values takes most of the quantiles
    inside = (got_np > 0.4) & (got_np < 0.5)
    assert inside.sum() >= 5
    # equal weights: order statistics, within one rank of the plain quantiles
    even = weighted_quantile(np, v, np.ones_like(v), q)
    rank = np.searchsorted(np.sort(v), even)
    assert np.all(np.isin(even, v))
    assert np.max(np.abs(rank - q * (v.size - 1))) <= 1.0
    assert np.max(np.abs(even - quantile(np, v, q))) < 0.02
    # continuous in the values: two values of different weights trading places move the
    # quantiles by no more than they moved (interpolating at the cumulative weights would
    # jump by a share of the gap to the neighbours)
    u = np.array([0.0, 1.0, 1.0, 2.0, 3.0])
    wu = np.array([1.0, 5.0, 0.2, 1.0, 1.0])
    qs = np.linspace(0.0, 1.0, 11)
    before = weighted_quantile(np, u + np.array([0, -1e-9, 1e-9, 0, 0]), wu, qs)
    after = weighted_quantile(np, u + np.array([0, 1e-9, -1e-9, 0, 0]), wu, qs)
    assert np.max(np.abs(before - after)) <= 3e-9


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"weight_floor": 0.0}, "weight_floor"),
        ({"weight_floor": -0.1}, "weight_floor"),
        ({"weight_floor": float("nan")}, "weight_floor"),
        ({"weight_floor": 0.1, "weight_power": 0.0}, "weight_power"),
        ({"weight_floor": 0.1, "weight_power": float("inf")}, "weight_power"),
    ],
)
def test_bad_weights_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"AdaptiveRectangularMesh.{field}"):
        el.AdaptiveRectangularMesh((8, 8), **kwargs)


def _lens_and_data():
    lens = mass.SIE(theta_E=0.9, e1=0.08, e2=-0.04) + mass.ExternalShear(gamma1=0.03, gamma2=0.0)
    # a faint, extended galaxy with a compact, bright clump off its centre
    source = light.Sersic(amp=4.0, R_sersic=0.25, n_sersic=1.0, center_x=0.03) + light.Sersic(
        amp=150.0, R_sersic=0.02, n_sersic=1.0, center_x=0.08, center_y=-0.03
    )
    truth = el.LensSystem(mass=lens, source=source)
    grid = el.Grid((52, 52), pixel_scale=PS, supersampling=2)
    psf = el.GaussianPSF(fwhm=0.08, pixel_scale=PS, truncation=3.0)
    data = el.simulate(
        jax.random.key(7),
        truth,
        grid,
        psf,
        exposure_time=2000.0,
        sky_level=0.5,
        mask=grid.circular_mask(1.3),
    )
    # the brightness estimate: the noise-free lensed source (a chain's adapt round's)
    adapt = np.asarray(truth.image(grid, psf))
    return truth, data, adapt


def test_the_nodes_crowd_where_the_source_is_bright_and_the_mesh_needs_its_brightness():
    truth, data, adapt = _lens_and_data()
    term = el.LogEvidence(data, adapt_image=adapt)
    bx, by = truth.mass.ray_shoot(term.sub_x.reshape(-1), term.sub_y.reshape(-1))
    signal = jnp.repeat(term.adapt, term.sub_x.shape[1])
    plain = el.AdaptiveRectangularMesh((16, 16))
    bright = el.AdaptiveRectangularMesh((16, 16), weight_floor=0.1)
    assert bright.uses_signal and not plain.uses_signal
    with pytest.raises(ValueError, match="pass signal"):
        bright.geometry(truth.mass, bx, by)
    g_plain = plain.geometry(truth.mass, bx, by)
    g_bright = bright.geometry(truth.mass, bx, by, signal)
    for a, b in ((g_plain.xs, g_bright.xs), (g_plain.ys, g_bright.ys)):
        # both cover every traced pixel
        assert float(a[0]) == float(b[0]) == pytest.approx(float(jnp.min(a)))
        assert float(a[-1]) == float(b[-1])
    # more nodes within 0.05" of the clump in each direction
    near = lambda xs, c: int(jnp.sum(jnp.abs(xs - c) < 0.05))
    assert near(g_bright.xs, 0.08) > near(g_plain.xs, 0.08)
    assert near(g_bright.ys, -0.03) > near(g_plain.ys, -0.03)


def _best_log_evidence(term, model):
    # the best regularization strength of a grid (the evidence sets it)
    values = []
    for c in 10.0 ** np.arange(-4.0, 2.5, 0.5):
        m = el.LensSystem(
            mass=model.mass,
            source=el.PixelizedSource(model.source.mesh, el.ConstantRegularization(c)),
        )
        values.append(-float(term(m)))
    return max(values)


@slow_ci
def test_a_compact_clump_is_fitted_better_with_the_same_number_of_source_pixels():
    # the evidence of the true mass with an 18x18 source: weighting the quantiles by the
    # brightness resolves the clump the magnification-adaptive mesh smears out
    truth, data, adapt = _lens_and_data()
    term = el.LogEvidence(data, adapt_image=adapt)
    reg = el.ConstantRegularization(1.0)
    plain = el.LensSystem(
        mass=truth.mass, source=el.PixelizedSource(el.AdaptiveRectangularMesh((18, 18)), reg)
    )
    bright = el.LensSystem(
        mass=truth.mass,
        source=el.PixelizedSource(el.AdaptiveRectangularMesh((18, 18), weight_floor=0.1), reg),
    )
    gain = _best_log_evidence(term, bright) - _best_log_evidence(term, plain)
    assert gain > 100.0  # (535 when written; a 26x26 unweighted mesh: +261)


@slow_ci
def test_the_evidence_chain_adapts_a_brightness_mesh_to_its_last_reconstruction():
    # with a constant regularization the mesh alone uses the brightness: the chain still
    # runs its adapt rounds (the estimate becomes the lensed source, not the data), and
    # the result's summary names the weights
    from equilens.solve import fit_pixelized, result_to_dict

    truth, data, _ = _lens_and_data()
    mesh = el.AdaptiveRectangularMesh((14, 14), weight_floor=0.1)
    start = el.LensSystem(
        mass=truth.mass, source=el.PixelizedSource(mesh, el.ConstantRegularization(1.0))
    )
    result, inversion, stages = fit_pixelized(
        data, start, rounds=2, light_rounds=0, max_steps=40, log=None
    )
    names = [s["stage"] for s in stages]
    assert any("adapted to the source" in n for n in names), names
    # the brightness estimate is no longer the data
    assert not np.allclose(np.asarray(inversion.adapt_image), np.asarray(data.data))
    source = result_to_dict(result)["components"][-1]
    assert source["mesh_weights"] == {"weight_floor": 0.1, "weight_power": 1.0}


def test_brightness_weights_are_smooth_where_the_signal_power_is_tiny():
    """`AdaptiveBrightness`'s weights `(inner S^p + outer (1 - S^p))^2` at the corner a fit
    of the hyperparameters reached on the subhalo suite's lens 2 (`p` 6.6e-16, `outer`
    3.3e13: `outer (1 - S^p)` ~ `outer p |log S|`): `1 - S^p` taken as `1 - S^p` was a
    multiple of the machine epsilon there, the weights a staircase in the brightness
    (and the log-evidence jumped by up to 1.9 between mass models 0.05 sigma apart); now
    they follow the first-order series `outer p |log S|` (exact to `p^2`) and fall
    strictly with the brightness, on both backends (one formula)."""
    from equilens.regularization._regularization import brightness_weights

    inner, outer, power = 9.0e-10, 3.3e13, 6.6e-16
    signal = np.linspace(0.01, 0.99, 2001)
    series = (inner + outer * power * -np.log(signal)) ** 2
    for xp in (np, jnp):
        w = np.asarray(brightness_weights(xp, xp.asarray(signal), inner, outer, power))
        rtol = 1e-10 if xp is np or jax.config.read("jax_enable_x64") else 1e-5
        np.testing.assert_allclose(w, series, rtol=rtol)
        assert np.all(np.diff(w) < 0)
    # the unlit (0) and the brightest (1) pixels: outer^2 and inner^2, as before
    ends = np.asarray(brightness_weights(np, np.array([0.0, 1.0]), inner, outer, power))
    np.testing.assert_allclose(ends, [outer**2, inner**2], rtol=1e-12)
    # an ordinary power: the formula as written, to round-off
    s = np.array([0.0, 0.2, 0.7, 1.0])
    plain = (0.5 * np.where(s > 0, s**1.2, 0) + 3.0 * (1 - np.where(s > 0, s**1.2, 0))) ** 2
    np.testing.assert_allclose(brightness_weights(np, s, 0.5, 3.0, 1.2), plain, rtol=1e-14)


def test_the_signal_floor_removes_the_weights_step_at_zero_brightness():
    """With `signal_floor` (`AdaptiveBrightness`'s default 1e-4) a source pixel whose
    brightness estimate reaches exactly 0 keeps the weight of an estimate at the floor: at
    lens 2's fitted hyperparameters (`signal_scale -> 0`) the weight of an estimate of 0
    was `outer^2`, 1e27 times that of an estimate of 1e-7 (the log-evidence jumped by
    0.7-1.8 when the mass moved a pixel's estimate to 0). For an ordinary power the floor
    changes no weight by more than a relative `2 floor^power |inner - outer| / outer`;
    the estimates above the floor keep their weights exactly; both backends share the
    formula."""
    from equilens.regularization._regularization import SIGNAL_FLOOR, brightness_weights

    assert el.AdaptiveBrightness().signal_floor == SIGNAL_FLOOR == 1e-4
    inner, outer, power = 9.0e-10, 3.3e13, 6.6e-16
    faint = np.array([0.0, 1e-300, 1e-7, 5e-5, SIGNAL_FLOOR])
    for xp in (np, jnp):
        w = np.asarray(brightness_weights(xp, xp.asarray(faint), inner, outer, power, 1e-4))
        at_floor = (inner + outer * power * -np.log(1e-4)) ** 2
        rtol = 1e-10 if xp is np or jax.config.read("jax_enable_x64") else 1e-5
        np.testing.assert_allclose(w, at_floor, rtol=rtol)
    # without it (PyAutoLens's formula), the step
    w0 = brightness_weights(np, faint[:3], inner, outer, power, 0.0)
    assert w0[0] == pytest.approx(outer**2) and w0[0] / w0[2] > 1e26
    # an ordinary power: at most 2 floor^power |inner - outer| / outer relative at and
    # below the floor (inner above outer too), nothing above it
    s = np.array([0.0, 1e-6, 1e-4, 1e-3, 0.5, 1.0])
    for inner, outer in ((0.5, 3.0), (6.0, 1.0)):
        with_floor = brightness_weights(np, s, inner, outer, 1.2, 1e-4)
        without = brightness_weights(np, s, inner, outer, 1.2, 0.0)
        change = np.abs(with_floor / without - 1)
        bound = 2 * 1e-4**1.2 * abs(inner - outer) / outer
        assert np.all(change[:3] <= 1.001 * bound) and change[0] > 0.5 * bound
        np.testing.assert_array_equal(with_floor[3:], without[3:])


def test_a_fits_summary_names_the_signal_floor():
    from equilens.solve import RESULTS, FitResult, result_to_dict

    reg = el.AdaptiveBrightness(1.0, 2.0, 0.5, signal_floor=1e-3)
    system = el.LensSystem(
        mass=mass.SIE(theta_E=1.0), source=el.PixelizedSource(el.RectangularMesh((6, 6)), reg)
    )
    names = ("source.regularization.inner_coefficient",)
    r = FitResult(
        model=system,
        value=jnp.zeros(()),
        term_values=jnp.zeros(1),
        chi2=jnp.zeros(()),
        num_steps=jnp.zeros((), int),
        result=RESULTS.successful,
        covariance=jnp.full((1, 1), jnp.nan),
        names=names,
        n_data=100,
        n_linear=0,
        solver="bfgs",
    )
    source = result_to_dict(r)["components"][-1]
    assert source["regularization"] == "AdaptiveBrightness"
    assert source["signal_floor"] == 1e-3
    assert source["parameters"]["regularization.signal_scale"]["value"] == 0.5
