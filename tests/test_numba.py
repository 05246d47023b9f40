"""The Numba backend against the JAX one: every profile, every quantity, random parameters.

The backends share no code (the kernels are written out again for Numba, with analytic
Hessians where JAX differentiates), so agreement to 1e-10 checks both. float64 only: the
Numba backend always computes in float64.
"""

import concurrent.futures
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numba
import numpy as np
import pytest

import equilens as el
import equilens.numba as enb
from equilens import light, mass
from equilens.terms import solve_amplitudes
from helpers import example_light_profiles, example_mass_profiles, sample_points, slow_ci

pytestmark = pytest.mark.x64_only

MASS = example_mass_profiles()
LIGHT = example_light_profiles()
TOL = 1e-10


def _finals(root: type) -> list[type]:
    out, stack = [], [root]
    while stack:
        for sub in stack.pop().__subclasses__():
            if not sub.__name__.startswith("Abstract") and sub.__module__.startswith("equilens"):
                out.append(sub)
            stack.append(sub)
    return out


def _randomised(profile, seed: int):
    """`profile` with every floating parameter scaled by a random factor in [0.7, 1.3]
    (seed 0: unchanged), which keeps each inside its bounds for the registry's examples.
    (Seed 0 goes the same way, so that every draw has the same dtypes: one compilation.)"""
    rng = np.random.default_rng(seed)

    def scale(a):
        factor = rng.uniform(0.7, 1.3, np.shape(a)) if seed else np.ones(np.shape(a))
        return a * factor.astype(a.dtype)

    arrays, static = eqx.partition(profile, eqx.is_inexact_array)
    return eqx.combine(jax.tree.map(scale, arrays), static)


def _close(got, want, tol=TOL):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    if got.size == 0:
        return
    scale = max(float(np.max(np.abs(want))), 1e-300)
    err = float(np.max(np.abs(got - want))) / scale
    assert err < tol, f"relative error {err:.2e}"


def test_every_final_class_has_a_numba_evaluation():
    from equilens.regularization import AbstractRegularization
    from equilens.source import AbstractMesh
    from equilens.terms import AbstractTerm

    roots = (
        mass.AbstractMassProfile,
        light.AbstractLightProfile,
        AbstractMesh,
        AbstractRegularization,
        AbstractTerm,
    )
    finals = {root: _finals(root) for root in roots}
    # (the lists are the classes themselves: a root without finals would pass vacuously)
    assert all(len(f) >= 3 for f in finals.values())
    missing = [cls.__name__ for found in finals.values() for cls in found if not enb.supported(cls)]
    assert missing == []


@pytest.mark.parametrize("mesh_name", ["rectangular", "adaptive", "delaunay"])
def test_pixelized_sources_interpolate_as_in_jax(mesh_name):
    from equilens import source

    grid = el.Grid((30, 30), 0.1)
    sie = MASS["SIE"]
    mesh = {
        "rectangular": source.RectangularMesh((12, 14)),
        "adaptive": source.AdaptiveRectangularMesh((12, 14)),
        "delaunay": source.DelaunayMesh.from_mask(grid, np.ones(grid.shape, bool), 150),
    }[mesh_name]
    bx, by = sie.ray_shoot(grid.x.reshape(-1), grid.y.reshape(-1))
    geometry = mesh.geometry(sie, bx, by)
    rng = np.random.default_rng(1)
    values = jnp.asarray(rng.normal(size=mesh.n_pixels))
    src = source.PixelizedSource(mesh, el.ConstantRegularization(1.0), values, geometry)
    # the traced pixels, points around and outside the mesh
    x = jnp.concatenate([bx, jnp.asarray(rng.uniform(-3, 3, 200))])
    y = jnp.concatenate([by, jnp.asarray(rng.uniform(-3, 3, 200))])
    want = src.intensity(x, y)
    got = enb.intensity(src, np.asarray(x), np.asarray(y))
    _close(got, want)
    # and a lensed image of it
    system = el.LensSystem(mass=sie, source=src)
    _close(enb.image(system, grid), system.image(grid))


MASS_METHODS = ["deflection", "potential", "hessian", "convergence", "ray_shoot", "magnification"]


@eqx.filter_jit
def _all_methods(p, x, y, methods=tuple(MASS_METHODS)):
    # one compilation per class, shared by its random draws (eager JAX took ~8 s a test)
    return {m: getattr(p, m)(x, y) for m in methods}


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", sorted(MASS))
def test_mass_profiles_match_jax(name, seed):
    p = _randomised(MASS[name], seed)
    x, y = sample_points(300, seed=10 + seed)
    xn, yn = np.asarray(x), np.asarray(y)
    jax_values = _all_methods(p, x, y)
    for method in MASS_METHODS:
        want = jax_values[method]
        got = getattr(enb, method)(p, xn, yn)
        want = want if isinstance(want, tuple) else (want,)
        got = got if isinstance(got, tuple) else (got,)
        assert len(got) == len(want), method
        for g, w in zip(got, want, strict=True):
            assert isinstance(g, np.ndarray) and g.dtype == np.float64
            _close(g, w)


@pytest.mark.parametrize("name", ["SIE", "EPL", "EllipticalNFW"])
@pytest.mark.parametrize("e1", [0.0, 1e-10, 1e-6])
def test_elliptical_profiles_match_jax_at_and_near_round(name, e1):
    p = eqx.tree_at(lambda p: (p.e1, p.e2), MASS[name], (jnp.asarray(e1), jnp.asarray(0.0)))
    x, y = sample_points(100, seed=5)
    jax_values = _all_methods(p, x, y, ("deflection", "potential", "hessian"))
    for method in ("deflection", "potential", "hessian"):
        want = jax_values[method]
        got = getattr(enb, method)(p, np.asarray(x), np.asarray(y))
        for g, w in zip(
            got if isinstance(got, tuple) else (got,),
            want if isinstance(want, tuple) else (want,),
            strict=True,
        ):
            _close(g, w)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", sorted(LIGHT))
def test_light_profiles_match_jax(name, seed):
    p = _randomised(LIGHT[name], seed)
    x, y = sample_points(300, seed=20 + seed)
    _close(enb.intensity(p, np.asarray(x), np.asarray(y)), p.intensity(x, y))
    if isinstance(p, light.AbstractLinearLightProfile):
        _close(enb.basis(p, np.asarray(x), np.asarray(y)), p.basis(x, y))


def test_grids_keep_their_shape_and_broadcast():
    p = MASS["MassSum"]
    x, y = sample_points(60, seed=3)
    xg, yg = np.asarray(x).reshape(6, 10), np.asarray(y).reshape(6, 10)
    ax, ay = enb.deflection(p, xg, yg)
    assert ax.shape == ay.shape == (6, 10)
    _close(ax, p.deflection(x, y)[0].reshape(6, 10))
    # a scalar y broadcasts against the grid of x
    psi = enb.potential(p, xg, 0.3)
    _close(psi, p.potential(x, jax.numpy.full_like(x, 0.3)).reshape(6, 10))


def test_one_and_two_threads_give_identical_results():
    p, source = MASS["EPL"], LIGHT["MGE"]
    x, y = sample_points(4000, seed=7)
    xn, yn = np.asarray(x), np.asarray(y)
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = (*enb.deflection(p, xn, yn), enb.intensity(source, xn, yn))
        numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
        two = (*enb.deflection(p, xn, yn), enb.intensity(source, xn, yn))
    finally:
        numba.set_num_threads(before)
    for a, b in zip(one, two, strict=True):
        np.testing.assert_array_equal(a, b)


def test_calls_from_several_threads_give_the_serial_results():
    profiles = [MASS[n] for n in ("SIE", "EPL", "NFW", "MassSum")]
    x, y = (np.asarray(a) for a in sample_points(2000, seed=8))
    serial = [enb.deflection(p, x, y) for p in profiles]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        threaded = list(pool.map(lambda p: enb.deflection(p, x, y), profiles * 3))
    for i, got in enumerate(threaded):
        for a, b in zip(got, serial[i % len(profiles)], strict=True):
            np.testing.assert_array_equal(a, b)


def test_a_class_without_a_kernel_is_named():
    class Custom(mass.AbstractMassProfile):
        def deflection(self, x, y):
            return x, y

        def potential(self, x, y):
            return x * y

    with pytest.raises(NotImplementedError, match="Custom"):
        enb.deflection(Custom(), np.zeros(3), np.zeros(3))

    # a subclass of a registered class does not inherit its kernel (it may change the physics)
    class MySIS(mass.SIS):
        pass

    assert not enb.supported(MySIS)
    with pytest.raises(NotImplementedError, match="MySIS"):
        enb.potential(MySIS(theta_E=1.0), np.zeros(3), np.zeros(3))


def test_registered_kernels_are_used_for_new_classes():
    class Twice(mass.AbstractMassProfile):
        inner: mass.SIS

        def deflection(self, x, y):
            ax, ay = self.inner.deflection(x, y)
            return 2 * ax, 2 * ay

        def potential(self, x, y):
            return 2 * self.inner.potential(x, y)

    from equilens.numba._api import mass_rows
    from equilens.numba._registry import _MASS

    enb.register_mass(Twice)(lambda p, x, y, what: 2 * mass_rows(p.inner, x, y, what))
    try:
        p = Twice(mass.SIS(theta_E=0.8, center_x=0.1))
        x, y = sample_points(50, seed=9)
        _close(enb.deflection(p, np.asarray(x), np.asarray(y))[0], p.deflection(x, y)[0])
    finally:
        del _MASS[Twice]


def test_non_scalar_parameters_and_tracers_are_refused():
    with pytest.raises(ValueError, match=r"SIE\.theta_E must be a scalar"):
        mass.SIE(theta_E=np.ones(3))
    # a model changed past its constructor (tree_at, as tree manipulations do): the Numba
    # backend's own check
    bad = eqx.tree_at(lambda p: p.theta_E, mass.SIE(theta_E=1.0), jnp.ones(3))
    with pytest.raises(ValueError, match=r"SIE\.theta_E must be a scalar"):
        enb.deflection(bad, np.zeros(3), np.zeros(3))
    with pytest.raises(TypeError, match="tracer"):
        jax.jit(lambda t: enb.potential(mass.SIS(theta_E=t), np.zeros(2), np.zeros(2)))(1.0)


def _system():
    return el.LensSystem(
        mass=MASS["MassSum"],
        source=light.Sersic(amp=20.0, R_sersic=0.15, n_sersic=1.5, e1=0.1, center_x=0.05),
        lens_light=LIGHT["MGE"] + light.Sersic(amp=3.0, R_sersic=0.8, n_sersic=4.0),
    )


@pytest.mark.parametrize("method", ["fft", "direct"])
@pytest.mark.parametrize(
    "case", ["none", "psf_binned", "psf_supersampled", "fft_operator", "gaussian"]
)
def test_images_match_jax(case, method):
    system = _system()
    grid = el.Grid((24, 30), 0.08, origin=(0.03, -0.02), supersampling=2)
    kernel = np.asarray(el.GaussianPSF(0.15, 0.08).kernel())
    psf = {
        "none": None,
        "psf_binned": el.PixelPSF(kernel),
        "psf_supersampled": el.PixelPSF(np.asarray(el.GaussianPSF(0.15, 0.04).kernel()), 2),
        "fft_operator": el.PixelPSF(kernel).fft_operator(grid.shape),
        "gaussian": el.GaussianPSF(0.2, 0.08),
    }[case]
    want = _jax_image(system, grid, psf)
    got = enb.image(system, grid, psf, method=method)
    assert got.shape == grid.shape
    _close(got, want)


def test_convolution_routes_agree_and_keep_zero_padding():
    rng = np.random.default_rng(3)
    image = rng.normal(size=(17, 23))
    kernel = rng.uniform(size=(5, 7))
    fft = enb.convolve(image, kernel, method="fft")
    direct = enb.convolve(image, kernel, method="direct")
    _close(direct, fft, 1e-12)
    # an independent reference: scipy's direct 'same' convolution (zero padded)
    import scipy.signal

    _close(direct, scipy.signal.convolve2d(image, kernel, mode="same"), 1e-12)


def test_image_and_convolution_errors_are_those_of_jax():
    system, grid = _system(), el.Grid((10, 10), 0.1, supersampling=2)
    with pytest.raises(ValueError, match="odd side lengths"):
        enb.convolve(np.ones((5, 5)), np.ones((4, 3)))
    with pytest.raises(ValueError, match="method"):
        enb.convolve(np.ones((5, 5)), np.ones((3, 3)), method="spectral")
    psf3 = el.PixelPSF(np.ones((3, 3)), supersampling=3)
    with pytest.raises(ValueError, match="supersampling 3 must be 1 or equal"):
        enb.image(system, grid, psf3)
    with pytest.raises(ValueError, match="FFTConvolution prepared for shape"):
        enb.image(system, grid, el.PixelPSF(np.ones((3, 3))).fft_operator((12, 12)))


def test_the_documented_snippet_gives_the_jax_image():
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "numba.md").read_text()
    code = re.findall(r"```python\n(.*?)```", text, flags=re.S)[0]
    ns: dict = {}
    exec(compile(code, "<docs/numba.md>", "exec"), ns)
    want = _jax_image(ns["system"], ns["grid"], ns["psf"])
    _close(ns["image"], want)
    _close(ns["kappa"], ns["system"].mass.convergence(ns["grid"].x, ns["grid"].y))


# --------------------------------------------------------------------------------------
# terms and objectives
# --------------------------------------------------------------------------------------


# (compiled once per structure and shared by the tests: the JAX references)
_jax_image = eqx.filter_jit(lambda s, g, p: s.image(g, p))
_jax_value = eqx.filter_jit(lambda t, m: t(m))
_jax_linear = eqx.filter_jit(
    lambda m, imaging, pixels, nonneg: (
        m.linear_images(imaging.grid, imaging.convolution),
        solve_amplitudes(m, imaging, nonnegative=nonneg, pixels=pixels),
    )
)


@functools.cache
def _dataset(supersampling: int = 2):
    truth = _system()
    grid = el.Grid((36, 36), 0.1, supersampling=supersampling)
    psf = el.GaussianPSF(0.2, 0.1)
    mask = np.asarray(grid.circular_mask(1.6))
    imaging = el.simulate(
        jax.random.key(4), truth, grid, psf, exposure_time=800.0, sky_level=2.0, mask=mask
    )
    return truth, imaging


def _linear_model(truth):
    # the truth with a linear MGE lens light of 8 Gaussians (some amplitudes go negative
    # in an unconstrained solve) and a linear Sersic source
    return el.LensSystem(
        mass=truth.mass,
        source=truth.source,
        lens_light=light.MGE(amp=jnp.ones(8), sigma=jnp.geomspace(0.02, 3.0, 8), e1=0.2, e2=-0.1),
    )


@pytest.mark.parametrize("nonnegative", [False, True])
def test_linear_images_and_amplitudes_match_jax(nonnegative):
    truth, imaging = _dataset()
    model = _linear_model(truth)
    images, fixed = enb.linear_images(model, imaging.grid, imaging.convolution)
    pixels = jnp.asarray(np.flatnonzero(np.asarray(imaging.mask)))
    jax_linear = _jax_linear(model, imaging, pixels, nonnegative)
    (want_images, want_fixed), (want_system, want_image) = jax_linear
    _close(images, want_images)
    assert fixed is None and want_fixed is None
    amps, image = enb.solve_amplitudes(model, imaging, nonnegative=nonnegative)
    # the amplitudes of a nearly degenerate basis (8 Gaussians) are determined only to
    # cond(G) eps by any solver: that, not 1e-10, is the agreement to expect of them and of
    # the image they make (where large amplitudes of opposite sign cancel)
    used = np.asarray(imaging.mask).reshape(-1)
    a = (
        images.reshape(images.shape[0], -1)[:, used]
        / np.asarray(imaging.noise_map).reshape(-1)[used]
    )
    g = a @ a.T
    d = 1 / np.sqrt(np.diagonal(g))
    tol = max(TOL, 100 * np.linalg.cond(g * d[:, None] * d[None, :]) * np.finfo(float).eps)
    assert tol < 1e-8
    _close(amps, want_system.amplitudes(), tol)
    _close(image, want_image, tol)
    if nonnegative:
        assert np.all(amps >= 0) and np.any(amps == 0)  # the constraint is active
    else:
        assert np.any(amps < 0)


def test_nonnegative_solve_kernel_is_the_jax_active_set():
    """The compiled Lawson-Hanson solve of the Numba backend against JAX's (same
    algorithm) and SciPy's `nnls`, on the Jacobi-scaled Gram matrices of nearly degenerate
    multi-Gaussian bases with the constraint active, and on one that is not positive
    definite (NaN, as JAX's Cholesky gives)."""
    import scipy.optimize

    from equilens.numba._solve_kernels import nnls, solve_on
    from equilens.terms._imaging import _nnls

    rng = np.random.default_rng(5)
    r = np.linspace(0.0, 3.0, 400)
    active = 0
    for trial in range(12):
        k = 6 + trial
        widths = np.geomspace(0.02, 2.5, k) * rng.uniform(0.9, 1.1, k)
        basis = np.exp(-0.5 * (r[None, :] / widths[:, None]) ** 2)
        target = basis.T @ rng.normal(0.5, 1.0, k) + 0.01 * rng.normal(size=r.size)
        g, h = basis @ basis.T, basis @ target
        d = 1 / np.sqrt(np.diagonal(g))
        g, h = g * d[:, None] * d[None, :], h * d
        got = solve_on(g, h, nnls(g, h) > 0)
        want = np.asarray(_nnls(jnp.asarray(g), jnp.asarray(h)))
        np.testing.assert_array_equal(got > 0, want > 0)  # the same active set
        _close(got, want, 100 * np.linalg.cond(g) * np.finfo(float).eps)
        chol = np.linalg.cholesky(g)
        ref, _ = scipy.optimize.nnls(chol.T, np.linalg.solve(chol, h), maxiter=10_000)
        assert np.all(got >= 0) and np.max(np.abs(got - ref)) < 1e-6 * (1 + np.max(ref))
        active += int(np.sum(got == 0))
    assert active > 0  # the constraint mattered
    singular = np.ones((3, 3))
    assert np.all(np.isnan(solve_on(singular, np.ones(3), np.ones(3, dtype=bool))))


def _terms(truth, imaging):
    from equilens.terms import (
        GaussianPrior,
        LogisticPrior,
        PoissonLikelihood,
        PositionsTerm,
        PositionsThreshold,
        UniformPrior,
    )

    xs, ys = jnp.array([1.1, -1.0, 0.2]), jnp.array([0.3, -0.5, 1.2])
    return {
        "gaussian_linear": el.GaussianLikelihood(imaging),
        "gaussian_nonnegative": el.GaussianLikelihood(imaging, nonnegative=True),
        "gaussian_fitted": el.GaussianLikelihood(imaging, linear=False),
        "poisson": PoissonLikelihood(imaging, exposure_time=800.0, background=0.02),
        "positions": PositionsTerm(xs, ys, sigma=0.01),
        "positions_threshold": PositionsThreshold(xs, ys, threshold=0.05, sigma=0.001),
        "gaussian_prior": GaussianPrior(lambda m: m.mass.components[1].gamma1, 0.01, 0.05),
        "uniform_prior": UniformPrior(lambda m: m.mass.components[0].theta_E, 0.5, 2.0),
        "logistic_prior": LogisticPrior(lambda m: m.mass.components[0].theta_E, 0.5, 2.0),
    }


@pytest.mark.parametrize(
    "name",
    [
        "gaussian_linear",
        "gaussian_nonnegative",
        "gaussian_fitted",
        "poisson",
        "positions",
        "positions_threshold",
        "gaussian_prior",
        "uniform_prior",
        "logistic_prior",
    ],
)
def test_term_values_match_jax(name):
    truth, imaging = _dataset()
    term = _terms(truth, imaging)[name]
    model = _linear_model(truth) if name.startswith("gaussian_") and "prior" not in name else truth
    want = float(_jax_value(term, model))
    got = enb.value(term, model)
    assert isinstance(got, float)
    assert got == pytest.approx(want, rel=1e-10, abs=1e-8)


def test_image_plane_positions_match_jax():
    from equilens.lensing import image_positions
    from equilens.terms import PositionsTerm

    truth, _ = _dataset()
    images = image_positions(truth.mass, 0.05, 0.02, el.Grid((60, 60), 0.1))
    assert images.shape[0] >= 2
    # observed positions: the true images, off by a few milliarcseconds
    pos = images + np.random.default_rng(2).normal(0.0, 0.003, images.shape)
    term = PositionsTerm(jnp.asarray(pos[:, 0]), jnp.asarray(pos[:, 1]), 0.005, plane="image")
    want = float(_jax_value(term, truth))
    assert np.isfinite(want)
    assert enb.value(term, truth) == pytest.approx(want, rel=TOL)
    assert enb.value(term, truth.mass) == pytest.approx(want, rel=TOL)
    # the lens equation solved from the observed positions reaches the model's images
    sx, sy = 0.05, 0.02
    x, y, ok = enb._terms.solve_lens_equation(truth.mass, pos[:, 0], pos[:, 1], sx, sy)
    assert np.all(ok)
    bx, by = enb.ray_shoot(truth.mass, x, y)
    assert np.max(np.hypot(bx - sx, by - sy)) < 1e-12
    _close(np.stack([x, y], axis=1), images, 1e-9)


def test_objective_value_is_the_weighted_sum_as_in_jax():
    truth, imaging = _dataset()
    terms = _terms(truth, imaging)
    objective = el.Objective(
        [terms["gaussian_linear"], terms["positions"], terms["gaussian_prior"]],
        weights=[1.0, 0.5, 2.0],
    )
    model = _linear_model(truth)
    want = eqx.filter_jit(lambda o, m: (o(m), o.values(m)))(objective, model)
    assert enb.value(objective, model) == pytest.approx(float(want[0]), rel=1e-10)
    _close(enb.values(objective, model), want[1])
    # outside a uniform prior: infinite on both backends
    outside = eqx.tree_at(lambda m: m.mass.components[0].theta_E, truth, jnp.asarray(2.5))
    assert enb.value(terms["uniform_prior"], outside) == float("inf")
    assert float(terms["uniform_prior"](outside)) == float("inf")


def test_terms_the_numba_backend_cannot_evaluate_say_so():
    from equilens.terms import AbstractTerm

    truth, imaging = _dataset(supersampling=1)

    class MyTerm(AbstractTerm):
        def __call__(self, model):
            return jnp.zeros(())

    with pytest.raises(NotImplementedError, match="MyTerm"):
        enb.value(MyTerm(), truth)
    pixelized = eqx.tree_at(
        lambda m: m.source,
        truth,
        el.PixelizedSource(el.RectangularMesh((8, 8)), el.ConstantRegularization(1.0)),
    )
    with pytest.raises(TypeError, match="LogEvidence"):
        enb.value(el.GaussianLikelihood(imaging), pixelized)


def test_log_density_is_minus_the_objective_over_the_fit_parameters(monkeypatch):
    from equilens.objective import functions

    truth, imaging = _dataset()
    terms = _terms(truth, imaging)
    objective = el.Objective([terms["gaussian_linear"], terms["gaussian_prior"]])
    model = _linear_model(truth)
    dens = enb.log_density(objective, model)
    fns = functions(objective, model)
    param = fns.parametrisation
    assert dens.names == param.paths(model)
    assert dens.x0.shape == (len(dens.names),) and dens.bounds.shape == (len(dens.names), 2)
    # the linear amplitudes are not parameters; theta_E is, bounded below by 0
    assert not any("amp" in n for n in dens.names)
    k = dens.names.index("mass.components[0].theta_E")
    assert dens.bounds[k, 0] == 0.0 and dens.bounds[k, 1] == np.inf
    jax_objective = _jax_value
    assert dens.f(dens.x0) == pytest.approx(-float(jax_objective(objective, model)), rel=1e-10)
    rng = np.random.default_rng(0)
    vectors = [dens.x0 * rng.uniform(0.97, 1.03, dens.x0.shape) for _ in range(4)]
    for v in vectors:
        moved = _moved(model, param, v)
        assert dens.f(v) == pytest.approx(-float(jax_objective(objective, moved)), rel=1e-10)
    # outside the bounds: -inf; from threads: the serial values
    bad = dens.x0.copy()
    bad[k] = -0.1
    assert dens.f(bad) == -np.inf
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        threaded = list(pool.map(dens.f, vectors * 2))
    assert threaded == [dens.f(v) for v in vectors] * 2
    with pytest.raises(ValueError, match="parameters"):
        dens.f(dens.x0[:-1])
    # the backends: "auto" is Numba on a CPU; the JAX function gives the same numbers, and
    # is what "auto" takes for an objective the Numba backend cannot evaluate
    assert dens.backend == "numba"
    on_jax = enb.log_density(objective, model, backend="jax")
    assert on_jax.backend == "jax" and on_jax.names == dens.names
    for v in vectors:
        assert on_jax.f(v) == pytest.approx(dens.f(v), rel=1e-10)
    assert on_jax.f(bad) == -np.inf

    class Ridge(el.terms.AbstractTerm):
        def __call__(self, model):
            return 0.5 * jnp.sum(model.mass.components[1].gamma1 ** 2)

    custom = el.Objective([terms["gaussian_linear"], Ridge()])
    auto = enb.log_density(custom, model)
    assert auto.backend == "jax"
    assert auto.f(vectors[0]) == pytest.approx(
        -float(_jax_value(custom, _moved(model, param, vectors[0]))), rel=1e-10
    )
    with pytest.raises(ValueError, match="backend"):
        enb.log_density(objective, model, backend="cuda")
    # "auto" leaves a parametric image of more than AUTO_MAX_PIXELS (supersampled) to JAX
    grid = imaging.grid
    assert grid.shape[0] * grid.shape[1] * grid.supersampling**2 <= enb._terms.AUTO_MAX_PIXELS
    monkeypatch.setattr(enb._terms, "AUTO_MAX_PIXELS", grid.shape[0] * grid.shape[1])
    assert enb.log_density(objective, model).backend == "jax"


def _moved(model, param, v):
    values, start = [], 0
    for leaf in param.values(model):
        n = int(np.size(leaf))
        values.append(jnp.asarray(v[start : start + n]).reshape(np.shape(leaf)))
        start += n
    return param.with_values(tuple(values), model)


# -- the pixelized evidence ---------------------------------------------------------------


def _pixelized_term(nonnegative: bool = False):
    truth, imaging = _dataset()
    return truth, el.LogEvidence(imaging, nonnegative=nonnegative)


def _mesh(name: str, imaging):
    from equilens import source

    return {
        "rectangular": source.RectangularMesh((10, 10)),
        "adaptive": source.AdaptiveRectangularMesh((10, 10)),
        "delaunay": source.DelaunayMesh.from_mask(imaging.grid, np.asarray(imaging.mask), 80),
    }[name]


def _regularization(name: str):
    from equilens import regularization as reg

    return {
        "constant": reg.ConstantRegularization(1.3),
        "curvature": reg.CurvatureRegularization(0.7),
        "adaptive": reg.AdaptiveBrightness(0.5, 3.0, 1.2),
        "matern": reg.MaternKernel(2.0, 0.25, 1.5),
        "exponential": reg.ExponentialKernel(1.5, 0.2),
    }[name]


def _pixelized(truth, imaging, mesh: str, reg: str, lens_light=True):
    ll = light.Sersic(amp=1.0, R_sersic=0.5, n_sersic=2.5, e1=0.05) if lens_light else None
    source = el.PixelizedSource(_mesh(mesh, imaging), _regularization(reg))
    return el.LensSystem(mass=truth.mass, lens_light=ll, source=source)


_JAX_INVERT = eqx.filter_jit(lambda t, s: (t(s), t.invert(s)))


def _check_inversion(term, system):
    want, inv = _JAX_INVERT(term, system)
    got = enb.invert(term, system)
    assert enb.value(term, system) == pytest.approx(float(want), rel=TOL)
    assert got.log_evidence == pytest.approx(-float(want), rel=TOL)
    # (an adaptive regularization's log det sums the logs of weights computed from the
    # data traced to the source plane: each backend's round-off in those positions enters
    # every weight. Measured 1.3e-10 relative on a Delaunay mesh with XLA's optimisation
    # level 0, the fast suite's, on 2026-11-27 with the code before and after that day's
    # change alike; 1e-9 keeps it a round-off check)
    adaptive = isinstance(system.source.regularization, el.AdaptiveBrightness)
    for name in ("log_det_curvature", "log_det_regularization", "noise_normalisation"):
        tol = 1e-9 if adaptive and name == "log_det_regularization" else TOL
        assert getattr(got, name) == pytest.approx(float(getattr(inv, name)), rel=tol), name
    assert got.fit == pytest.approx(float(inv.chi2 + inv.regularization_term), rel=1e-9)
    # the solution of (F + H) s = D: determined to cond(F + H) eps by any solver (up to
    # ~1e7 here), so its agreement is checked to 1e-7 of the source's peak
    _close(got.values, inv.values, 1e-7)
    _close(got.amplitudes, inv.amplitudes, 1e-7)
    _close(got.geometry.nodes(), inv.geometry.nodes())


@pytest.mark.parametrize("reg", ["constant", "curvature", "adaptive", "matern", "exponential"])
@pytest.mark.parametrize("mesh", ["rectangular", "adaptive", "delaunay"])
def test_log_evidence_matches_jax_for_every_mesh_and_regularization(mesh, reg):
    truth, term = _pixelized_term()
    _check_inversion(term, _pixelized(truth, term.imaging, mesh, reg))


@pytest.mark.parametrize("reg", ["constant", "adaptive"])
def test_log_evidence_matches_jax_on_a_brightness_adaptive_mesh(reg):
    # the nodes at quantiles weighted by the adapt image (here the lensed source, as a
    # chain's adapt round sets it), on both backends
    from equilens import source

    truth, imaging = _dataset()
    adapt = np.asarray(el.LensSystem(mass=truth.mass, source=truth.source).image(imaging.grid))
    term = el.LogEvidence(imaging, adapt_image=adapt)
    system = eqx.tree_at(
        lambda s: s.source.mesh,
        _pixelized(truth, imaging, "adaptive", reg),
        source.AdaptiveRectangularMesh((10, 10), weight_floor=0.1, weight_power=1.5),
    )
    _check_inversion(term, system)
    # (and the nodes differ from the unweighted mesh's: the weights were used)
    plain = enb.invert(term, _pixelized(truth, imaging, "adaptive", reg))
    assert not np.allclose(enb.invert(term, system).geometry.nodes(), plain.geometry.nodes())


@pytest.mark.parametrize("mesh", ["rectangular", "delaunay"])
def test_log_evidence_matches_jax_positive_only_and_without_lens_light(mesh):
    truth, term = _pixelized_term(nonnegative=True)
    _check_inversion(term, _pixelized(truth, term.imaging, mesh, "constant"))
    _, term = _pixelized_term()
    _check_inversion(term, _pixelized(truth, term.imaging, mesh, "curvature", lens_light=False))


@pytest.mark.parametrize("nonnegative", [False, True])
@pytest.mark.parametrize("mesh", ["rectangular", "delaunay"])
def test_log_evidence_matches_jax_with_the_pyautolens_options(mesh, nonnegative):
    from equilens import source

    truth, imaging = _dataset()
    term = el.LogEvidence(
        imaging, nonnegative=nonnegative, map_outside_mask=False, marginalise_amplitudes=False
    )
    system = _pixelized(truth, imaging, mesh, "constant")
    if mesh == "rectangular":
        system = eqx.tree_at(
            lambda s: s.source.mesh, system, source.RectangularMesh((10, 10), nodes="centres")
        )
    reg = el.ConstantRegularization.from_pyautolens(0.8, float(imaging.grid.pixel_scale))
    _check_inversion(term, eqx.tree_at(lambda s: s.source.regularization, system, reg))


def test_log_evidence_of_a_singular_system_is_minus_infinity_on_both_backends():
    truth, term = _pixelized_term()
    same = light.Sersic(amp=1.0, R_sersic=0.5, n_sersic=2.5)
    system = eqx.tree_at(
        lambda s: s.lens_light,
        _pixelized(truth, term.imaging, "rectangular", "constant"),
        same + same,
    )
    assert float(_JAX_INVERT(term, system)[0]) == float("inf")
    assert enb.value(term, system) == float("inf")
    assert enb.invert(term, system).log_evidence == -float("inf")


def test_bad_input_is_treated_alike_by_both_backends():
    sie = mass.SIE(theta_E=1.0, e1=0.1)
    x, y = jnp.linspace(-1.0, 1.0, 3), jnp.linspace(-0.5, 0.5, 4)
    # mismatched grids: a TypeError naming the shapes (JAX's from its arithmetic, or from
    # the shape annotations when jaxtyping checks them, as in these tests)
    with pytest.raises(TypeError, match=r"\(3,\)"):
        sie.deflection(x, y)
    with pytest.raises(TypeError, match=r"\(3,\)"):
        enb.deflection(sie, np.asarray(x), np.asarray(y))
    # (without the annotations' check, the Numba backend's own: JAX's words)
    with pytest.raises(TypeError, match=r"incompatible shapes for broadcasting: \(3,\), \(4,\)"):
        enb._registry._flat(np.asarray(x), np.asarray(y))
    # a PSF of even size is refused where it is made, for both backends
    with pytest.raises(ValueError, match="odd side lengths"):
        el.PixelPSF(np.ones((4, 4)))
    # a NaN parameter is refused where it is made; set past the constructor (tree_at): NaN
    # on both backends (never a finite number), and an infinite likelihood
    with pytest.raises(ValueError, match=r"SIE\.theta_E must be finite"):
        mass.SIE(theta_E=float("nan"), e1=0.1)
    bad = eqx.tree_at(lambda p: p.theta_E, mass.SIE(theta_E=1.0, e1=0.1), jnp.asarray(jnp.nan))
    assert np.all(np.isnan(enb.deflection(bad, np.asarray(x), np.asarray(x))))
    assert np.all(np.isnan(np.asarray(bad.deflection(x, x))))
    truth, imaging = _dataset()
    model = eqx.tree_at(lambda m: m.mass.components[0], truth, bad)
    term = el.GaussianLikelihood(imaging)
    want = float(_jax_value(term, model))
    got = enb.value(term, model)
    assert not np.isfinite(want) and not np.isfinite(got)


def test_log_evidence_errors_are_those_of_jax():
    from equilens import source

    truth, term = _pixelized_term()
    with pytest.raises(TypeError, match="PixelizedSource, got Sersic"):
        term.invert(truth)
    with pytest.raises(TypeError, match="PixelizedSource, got Sersic"):
        enb.value(term, truth)
    big = el.LensSystem(
        mass=truth.mass,
        source=el.PixelizedSource(source.RectangularMesh((40, 40)), el.ConstantRegularization()),
    )
    with pytest.raises(ValueError, match="1600 pixels but the mask only"):
        term.invert(big)
    with pytest.raises(ValueError, match="1600 pixels but the mask only"):
        enb.value(term, big)

    class MyMesh(source.RectangularMesh):
        pass

    class MyRegularization(el.ConstantRegularization):
        pass

    mine = _pixelized(truth, term.imaging, "rectangular", "constant")
    mine = eqx.tree_at(lambda s: s.source.mesh, mine, MyMesh((10, 10)))
    with pytest.raises(NotImplementedError, match="MyMesh"):
        enb.value(term, mine)
    mine = _pixelized(truth, term.imaging, "rectangular", "constant")
    mine = eqx.tree_at(lambda s: s.source.regularization, mine, MyRegularization(1.0))
    with pytest.raises(NotImplementedError, match="MyRegularization"):
        enb.value(term, mine)
    # registered, the new classes are used
    enb.register_mesh(MyMesh)(
        lambda m, mass, x, y: enb.Rectilinear(
            np.linspace(x.min(), x.max(), 10), np.linspace(y.min(), y.max(), 10), True
        )
    )
    enb.register_regularization(MyRegularization)(
        lambda r, g, s: enb.regularization_matrix(el.ConstantRegularization(r.coefficient), g, s)
    )
    try:
        mine = eqx.tree_at(lambda s: s.source.mesh, mine, MyMesh((10, 10)))
        base = _pixelized(truth, term.imaging, "rectangular", "constant")
        base = eqx.tree_at(lambda s: s.source.regularization, base, el.ConstantRegularization(1.0))
        assert enb.value(term, mine) == pytest.approx(enb.value(term, base), rel=1e-13)
    finally:
        from equilens.numba import _evidence

        _evidence._MESHES.pop(MyMesh)
        _evidence._REGULARIZATIONS.pop(MyRegularization)


_COMPILE_ONCE = """
import pathlib, sys, time
import numpy as np
from equilens.numba import _solve_kernels as k
folder = pathlib.Path(sys.argv[1])
(folder / f"ready{sys.argv[2]}").touch()
while not (folder / "go").exists():
    time.sleep(0.002)
x = k.nnls(np.eye(3), np.array([1.0, -1.0, 2.0]))
assert np.allclose(x, [1.0, 0.0, 2.0])
stats = k.nnls.stats
print(sum(stats.cache_misses.values()), sum(stats.cache_hits.values()))
"""


@slow_ci
@pytest.mark.precision_independent
def test_processes_started_together_compile_a_kernel_once(tmp_path):
    """Two processes that call one kernel at the same moment on an empty Numba cache: one
    compiles it and the other loads what that one wrote (the kernel's compilation is held
    under a file lock: without it both compile, and their cache files can mix, numba#10128)."""
    import os
    import subprocess
    import sys
    import time

    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _COMPILE_ONCE, str(tmp_path), str(i)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"ready{i}").exists() for i in range(2)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), [
            p.communicate() for p in procs if p.poll() is not None
        ]
        time.sleep(0.01)
    (tmp_path / "go").touch()
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    counts = sorted(tuple(int(v) for v in out.split()) for out, _ in outs)
    # (misses, hits): one process compiled, the other loaded the cached kernel
    assert counts == [(0, 1), (1, 0)], outs


@pytest.mark.precision_independent
def test_a_compile_lock_held_too_long_is_passed_by(tmp_path, monkeypatch):
    """A kernel's compile lock that another holder never releases (a soft lock file left by
    a killed process) delays a compilation by `WAIT_SECONDS`, then the kernel compiles
    without it; a free lock is taken and released around the compilation."""
    import filelock

    from equilens.numba import _compile_lock

    monkeypatch.setattr(_compile_lock, "WAIT_SECONDS", 0.3)
    path = str(tmp_path / "kernel.lock")
    seen = []

    def compile_(sig):
        seen.append(_compile_lock._lock_for(path).is_locked)
        return sig

    locked = _compile_lock._locked(compile_, path)
    holder = filelock.FileLock(path, thread_local=False)
    holder.acquire()
    try:
        assert locked("f8(f8)") == "f8(f8)" and seen == [False]
    finally:
        holder.release()
    assert locked("i8(i8)") == "i8(i8)" and seen == [False, True]
    assert not _compile_lock._lock_for(path).is_locked


def _laplace_case():
    # the pixelized evidence with a held lens light (fixed Sersic) over the SIE's theta_E,
    # e1 and e2: the values of a Laplace evidence over the mass, as in a subhalo scan
    truth, term = _pixelized_term()
    system = _pixelized(truth, term.imaging, "adaptive", "constant")
    free = jax.tree.map(lambda _: False, system)
    free = eqx.tree_at(
        lambda s: (s.mass.components[0].theta_E, s.mass.components[0].e1, s.mass.components[0].e2),
        free,
        (True, True, True),
    )
    bounds = {lambda s: s.mass.components[0].theta_E: (0.5, 1.5)}
    return el.Objective(term), system, free, bounds


@pytest.mark.parametrize("smoothing", ["differences", "importance"])
def test_laplace_evidence_takes_its_values_from_either_backend_alike(smoothing):
    from equilens.solve import laplace_evidence

    objective, system, free, bounds = _laplace_case()
    kw = dict(free=free, bounds=bounds, smoothed=True, smoothing=smoothing, smoothing_rounds=2)
    by_jax = laplace_evidence(objective, system, backend="jax", **kw)
    by_numba = laplace_evidence(objective, system, backend="numba", **kw)
    auto = laplace_evidence(objective, system, **kw)
    assert (by_jax.backend, by_numba.backend, auto.backend) == ("jax", "numba", "numba")
    assert np.isfinite(by_jax.log_evidence)
    # the same values to round-off (1e-10 relative on each), so the same differences, the
    # same steps and the same evidence
    assert by_numba.log_evidence == pytest.approx(by_jax.log_evidence, abs=1e-6)
    assert auto.log_evidence == by_numba.log_evidence
    np.testing.assert_allclose(by_numba.covariance, by_jax.covariance, rtol=1e-5)
    assert by_numba.names == by_jax.names
    if smoothing == "differences":
        assert by_numba.smoothing_step == by_jax.smoothing_step
    # (a `Literal`: jaxtyping's check refuses it first where it is on, as in the tests)
    with pytest.raises((ValueError, TypeError), match="backend"):
        laplace_evidence(objective, system, free=free, smoothed=True, backend="cuda")  # pyright: ignore[reportArgumentType]


def test_the_kept_lens_light_images_follow_the_lens_light():
    # the Numba evidence keeps the last lens light's images: a call with another lens
    # light (or another term) must not be served them
    truth, term = _pixelized_term()
    system = _pixelized(truth, term.imaging, "rectangular", "constant")
    wider = eqx.tree_at(lambda s: s.lens_light.R_sersic, system, 0.8)
    other = _pixelized(truth, term.imaging, "rectangular", "constant", lens_light=False)
    for model in (system, wider, system, other, wider):
        assert enb.value(term, model) == pytest.approx(float(_JAX_INVERT(term, model)[0]), rel=TOL)
    assert enb.value(term, system) != enb.value(term, wider)
