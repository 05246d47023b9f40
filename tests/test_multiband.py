"""Several bands of one lens: the multi-band model, dataset and joint term."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import equilens as el
from equilens import light, mass
from equilens.objective._params import Parametrisation, linear_leaves

X64 = jax.config.read("jax_enable_x64")
RTOL = 1e-12 if X64 else 2e-5
MASS = mass.SIE(theta_E=1.0, e1=0.08, e2=-0.04) + mass.ExternalShear(0.03, -0.01)
SHAPE = dict(R_sersic=0.15, n_sersic=1.2, center_x=0.05, e2=0.1)
# (pixel scale, PSF FWHM, source amplitude, lens-light amplitude) of each band
BANDS = [(0.08, 0.1, 15.0, 4.0), (0.1, 0.25, 8.0, 9.0)]


@functools.cache
def _bands(n: int = 2, size: int = 28) -> tuple[el.Imaging, ...]:
    out = []
    for k, (ps, fwhm, amp, lens_amp) in enumerate(BANDS[:n]):
        grid = el.Grid((size, size), ps)
        truth = el.LensSystem(
            MASS,
            light.Sersic(amp=amp, **SHAPE),
            light.Sersic(amp=lens_amp, R_sersic=0.5, n_sersic=3.0),
        )
        psf = el.GaussianPSF(fwhm, ps)
        image = np.asarray(truth.image(grid, psf))
        noise = np.sqrt(0.5 * ps**2 / 1500.0 + np.maximum(image, 0.0) / 1500.0)
        data = image + noise * np.random.default_rng(k).standard_normal(image.shape)
        out.append(el.Imaging(data, noise, psf, ps, mask=np.asarray(grid.circular_mask(1.1))))
    return tuple(out)


def _model(n: int = 2, **kwargs) -> el.MultiBandLensSystem:
    return el.MultiBandLensSystem(
        mass.SIE(theta_E=0.97, e1=0.05) + mass.ExternalShear(0.01, 0.0),
        source=light.Sersic(amp=1.0, R_sersic=0.2, n_sersic=1.0),
        lens_light=kwargs.pop(
            "lens_light", light.Sersic(amp=1.0, R_sersic=0.4, n_sersic=2.5, e1=0.05)
        ),
        bands=n,
        **kwargs,
    )


def test_shared_shape_per_band_amplitudes():
    m = _model()
    m = el.MultiBandLensSystem(
        m.mass,
        source=(m.source[0], light.Sersic(amp=7.0, R_sersic=0.9, n_sersic=4.0)),
        lens_light=m.lens_light[0],
        bands=2,
        shared=("source", "lens_light"),
    )
    b1 = m.band(1)
    # shape from band 0, amplitude from band 1
    assert b1.source.R_sersic == m.source[0].R_sersic and float(b1.source.n_sersic) == 1.0
    assert float(b1.source.amp) == 7.0
    assert b1.mass is m.mass
    # the tied leaves are the shape parameters of bands >= 1 of the shared fields
    tied = m.tied()
    assert tied.source[1].R_sersic and tied.source[1].center_y and not tied.source[1].amp
    assert not tied.source[0].R_sersic and not tied.mass.components[0].theta_E
    assert tied.lens_light[1].n_sersic and not tied.lens_light[1].amp
    # with_bands writes band 0's shape into every band's copy
    done = m.with_bands(m.bands())
    assert done.source[1].R_sersic == m.source[0].R_sersic and float(done.source[1].amp) == 7.0


@pytest.mark.precision_independent
def test_per_band_light_is_independent_and_fit_holds_tied_leaves():
    per_band = el.MultiBandLensSystem(
        MASS,
        source=(light.Sersic(amp=1.0, R_sersic=r, n_sersic=1.0) for r in (0.1, 0.3)),
    )
    assert per_band.shared == () and per_band.n_bands == 2
    assert float(per_band.band(1).source.R_sersic) == 0.3
    shared = _model()
    obj = el.Objective(el.MultiBandTerm([el.GaussianLikelihood(b) for b in _bands()]))
    param = Parametrisation.build(shared, linear_leaves(shared, obj))
    names = param.paths(shared)
    # one mass, one shared source shape and one shared lens-light shape; amplitudes solved
    assert "source[0].R_sersic" in names and "lens_light[0].n_sersic" in names
    assert not any(n.startswith(("source[1]", "lens_light[1]")) for n in names)
    assert not any(n.endswith(".amp") for n in names)
    assert len(names) == 7 + 6 + 6
    # with the amplitudes fitted (linear=False) each band's amplitude is free
    obj = el.Objective(el.MultiBandTerm([el.GaussianLikelihood(b, linear=False) for b in _bands()]))
    names = Parametrisation.build(shared, linear_leaves(shared, obj)).paths(shared)
    assert {"source[0].amp", "source[1].amp", "lens_light[1].amp"} <= set(names)


def test_joint_term_is_the_sum_of_the_bands():
    data = _bands()
    term = el.MultiBandTerm([el.GaussianLikelihood(b) for b in data], names=["g", "r"])
    model = _model()
    singles = [el.GaussianLikelihood(b) for b in data]
    obj = el.Objective(term)
    assert obj.least_squares

    @eqx.filter_jit
    def evaluate(term, singles, obj, model):
        bands = model.bands()
        return (
            (term.values(model), term(model), term.chi2(model), obj.residuals(model)),
            (obj(model), obj.constant()),
            [(t(s), t.chi2(s), t.residuals(s)) for t, s in zip(singles, bands, strict=True)],
        )

    (values, total, chi2, r), (value, constant), parts = evaluate(term, singles, obj, model)
    expected = [float(p[0]) for p in parts]
    np.testing.assert_allclose(np.asarray(values), expected, rtol=RTOL)
    np.testing.assert_allclose(float(total), sum(expected), rtol=RTOL)
    np.testing.assert_allclose(float(chi2), sum(float(p[1]) for p in parts), rtol=RTOL)
    assert term.n_data == sum(t.n_data for t in singles)
    # residuals: the bands' whitened residuals in band order (least-squares)
    np.testing.assert_allclose(
        np.asarray(r), np.concatenate([np.asarray(p[2]) for p in parts]), rtol=RTOL
    )
    np.testing.assert_allclose(
        float(0.5 * jnp.sum(r * r) + constant), float(value), rtol=1e-9 if X64 else 1e-4
    )

    # the gradient with respect to the shared mass is the sum of the bands' gradients
    @eqx.filter_jit
    def gradients(mass):
        def joint(m):
            return term(
                el.MultiBandLensSystem(
                    m, model.source, model.lens_light, shared=("source", "lens_light")
                )
            )

        def single(m, k):
            band = model.band(k)
            return singles[k](el.LensSystem(m, band.source, band.lens_light))

        return jax.grad(joint)(mass), [jax.grad(single)(mass, k) for k in range(2)]

    g, (g0, g1) = gradients(model.mass)
    for a, b0, b1 in zip(jax.tree.leaves(g), jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True):
        np.testing.assert_allclose(float(a), float(b0) + float(b1), rtol=1e-9 if X64 else 1e-3)


def test_complete_solves_each_band():
    data = _bands()
    term = el.MultiBandTerm.build(el.MultiBandImaging(data, names=["g", "r"]))
    assert term.names == ("g", "r")
    model = _model()
    done = el.Objective(term).complete(model)
    for k, b in enumerate(data):
        single = el.GaussianLikelihood(b).complete(model.band(k))
        np.testing.assert_allclose(float(done.source[k].amp), float(single.source.amp), rtol=RTOL)
        np.testing.assert_allclose(
            float(done.lens_light[k].amp), float(single.lens_light.amp), rtol=RTOL
        )
    # bands see different amplitudes (the simulated colours differ)
    assert float(done.source[0].amp) > 1.3 * float(done.source[1].amp)
    images = term.model_images(done)
    assert [i.shape for i in images] == [b.shape for b in data]


@pytest.mark.slow
@pytest.mark.x64_only
def test_pixelized_source_per_band_shared_mesh():
    data = _bands(size=24)
    term = el.MultiBandTerm.build(el.MultiBandImaging(data), el.LogEvidence)
    src = el.PixelizedSource(el.RectangularMesh((10, 10)), el.ConstantRegularization(0.5))
    model = el.MultiBandLensSystem(MASS, source=src, bands=2)
    invs, done, values = eqx.filter_jit(lambda t, m: (t.invert(m), t.complete(m), t.values(m)))(
        term, model
    )
    evaluate = eqx.filter_jit(lambda t, s: t(s))
    for k, b in enumerate(data):
        np.testing.assert_allclose(
            float(values[k]), float(evaluate(el.LogEvidence(b), model.band(k)))
        )
        np.testing.assert_allclose(
            np.asarray(done.source[k].values), np.asarray(invs[k].values), rtol=1e-10
        )
    assert not np.allclose(np.asarray(done.source[0].values), np.asarray(done.source[1].values))
    # the mesh of each band is traced through its own grid
    assert done.source[0].geometry != done.source[1].geometry

    # gradient of the joint evidence in the regularization strength: finite differences
    def f(c):
        reg = el.ConstantRegularization(c)
        s = el.PixelizedSource(src.mesh, reg)
        return term(el.MultiBandLensSystem(MASS, source=s, bands=2))

    c = jnp.asarray(0.5)
    h = 1e-5
    value_and_grad = eqx.filter_jit(jax.value_and_grad(f))
    fd = (value_and_grad(c + h)[0] - value_and_grad(c - h)[0]) / (2 * h)
    np.testing.assert_allclose(float(value_and_grad(c)[1]), float(fd), rtol=1e-5)


@pytest.mark.precision_independent
def test_multiband_errors():
    data = _bands()
    with pytest.raises(ValueError, match="unique"):
        el.MultiBandImaging(data, names=["a", "a"])
    with pytest.raises(ValueError, match="at least one band"):
        el.MultiBandImaging([])
    with pytest.raises(TypeError, match=r"imaging term|AbstractImagingTerm"):
        el.MultiBandTerm([el.GaussianLikelihood(data[0]), el.UniformPrior(lambda m: m, 0.0, 1.0)])
    with pytest.raises(ValueError, match="3 entries for 2 bands"):
        el.MultiBandLensSystem(MASS, source=[light.Sersic(1.0, 0.1, 1.0)] * 3, bands=2)
    with pytest.raises(ValueError, match="bands=N"):
        el.MultiBandLensSystem(MASS, source=light.Sersic(1.0, 0.1, 1.0))
    with pytest.raises(ValueError, match="same profile"):
        el.MultiBandLensSystem(
            MASS,
            source=[light.Sersic(1.0, 0.1, 1.0), light.Gaussian(1.0, 0.1)],
            shared=("source",),
        )
    term = el.MultiBandTerm([el.GaussianLikelihood(b) for b in data])
    with pytest.raises(ValueError, match="3 bands and the term 2"):
        term(_model(3))
    with pytest.raises(TypeError, match="MultiBandLensSystem"):
        term(_model().band(0))
    with pytest.raises(TypeError, match="not LogEvidence"):
        term.invert(_model())
    # a joint term with an evidence band has no least-squares form
    mixed = el.MultiBandTerm([el.GaussianLikelihood(data[0]), el.LogEvidence(data[1])])
    assert not el.Objective(mixed).least_squares
    with pytest.raises(ValueError, match="MultiBandTerm has no whitened"):
        el.fit(el.Objective(mixed), _model(), "lm")


@pytest.mark.precision_independent
def test_band_offsets_move_the_grid():
    data = _bands()
    shifted = el.MultiBandImaging(data, offsets=[(0.0, 0.0), (0.3, -0.2)])
    np.testing.assert_allclose(
        np.asarray(shifted[1].grid.x) - np.asarray(data[1].grid.x), 0.3, atol=1e-12
    )
    np.testing.assert_allclose(
        np.asarray(shifted[1].grid.y) - np.asarray(data[1].grid.y), -0.2, atol=1e-12
    )
    assert shifted[0].grid.origin == data[0].grid.origin and len(shifted) == 2


def test_positions_term_reads_the_shared_mass():
    model = _model()
    x, y = jnp.asarray([1.0, -0.9]), jnp.asarray([0.2, -0.3])
    term = el.PositionsTerm(x, y, sigma=0.01)
    np.testing.assert_allclose(float(term(model)), float(term(model.band(1))), rtol=RTOL)


@pytest.mark.slow
@pytest.mark.x64_only
def test_joint_fit_recovers_the_shared_lens():
    data = _bands(size=36)
    obj = el.Objective(el.MultiBandTerm([el.GaussianLikelihood(b) for b in data]))
    r = el.fit(obj, _model(), "lm", max_steps=300)
    assert r.success, r.message()
    assert 0.8 < float(r.reduced_chi2) < 1.25
    sie = r.model.mass.components[0]
    assert abs(float(sie.theta_E) - 1.0) < 4 * float(r.errors[0])
    assert abs(float(r.model.source[0].R_sersic) - 0.15) < 0.02
    # the recovered colours: per-band amplitudes near the simulated ones
    for k, (_, _, amp, lens_amp) in enumerate(BANDS):
        assert abs(float(r.model.source[k].amp) / amp - 1) < 0.1
        assert abs(float(r.model.lens_light[k].amp) / lens_amp - 1) < 0.1


@pytest.mark.slow
@pytest.mark.x64_only
def test_numba_backend_gives_the_joint_value():
    enb = pytest.importorskip("equilens.numba")
    data = _bands(size=24)
    model = _model()
    src = el.PixelizedSource(el.RectangularMesh((8, 8)), el.ConstantRegularization(0.5))
    pixelized = el.MultiBandLensSystem(model.mass, source=src, lens_light=model.lens_light)
    cases = [
        (el.MultiBandTerm([el.GaussianLikelihood(b) for b in data]), model),
        (el.MultiBandTerm([el.LogEvidence(b) for b in data]), pixelized),
    ]
    for term, m in cases:
        positions = el.PositionsTerm(jnp.asarray([1.0, -0.9]), jnp.asarray([0.1, -0.2]), 0.05)
        obj = el.Objective([term, positions])
        np.testing.assert_allclose(enb.value(obj, m), float(eqx.filter_jit(obj)(m)), rtol=1e-10)
    density = enb.log_density(el.Objective(cases[0][0]), model, backend="numba")
    assert density.backend == "numba" and not any(n.startswith("source[1]") for n in density.names)
    np.testing.assert_allclose(density.f(density.x0), -float(cases[0][0](model)), rtol=1e-10)
