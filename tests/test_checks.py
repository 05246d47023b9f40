"""Parameters checked where they enter: every profile's fields against its domain, eagerly
(a ValueError naming the class, the field, the value and the range) and under `jit`
(`eqx.error_if`); and, property-based, that a profile either refuses its parameters or
evaluates to finite numbers."""

import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import equilens as el
from equilens import light, mass
from equilens._checks import POSITIVE, Domain
from equilens._custom_types import FloatScalar, as_float
from equilens.regularization import (
    AdaptiveBrightness,
    ConstantRegularization,
    CurvatureRegularization,
    ExponentialKernel,
    MaternKernel,
)
from helpers import default_eps, example_light_profiles, example_mass_profiles, sample_points

NAN, INF = math.nan, math.inf


@pytest.mark.parametrize(
    ("build", "words"),
    [
        (lambda: mass.SIE(theta_E=1.0, e1=1.5), "SIE: the ellipticity e = sqrt(e1^2 + e2^2)"),
        (lambda: mass.SIE(theta_E=1.0, e1=0.8, e2=0.7), "must be < 1"),
        (lambda: mass.SIE(theta_E=-1.2), "SIE.theta_E must be finite and in [0, inf), got -1.2"),
        (lambda: mass.SIS(theta_E=NAN), "SIS.theta_E must be finite and in [0, inf), got nan"),
        (lambda: mass.EPL(theta_E=1.0, gamma=3.5), "EPL.gamma must be finite and in (1, 3), got"),
        (lambda: mass.EPL(theta_E=1.0, gamma=1.0), "EPL.gamma must be finite and in (1, 3)"),
        (lambda: mass.NFW(Rs=0.0, alpha_Rs=1.0), "NFW.Rs must be finite and in (0, inf), got 0"),
        (lambda: mass.EllipticalNFW(Rs=1.0, alpha_Rs=-1.0), "EllipticalNFW.alpha_Rs"),
        (lambda: mass.PointMass(theta_E=-0.1), "PointMass.theta_E"),
        (lambda: mass.ExternalShear(gamma1=INF, gamma2=0.0), "ExternalShear.gamma1 must be finite"),
        (lambda: mass.ConvergenceSheet(kappa=NAN), "ConvergenceSheet.kappa must be finite"),
        (lambda: mass.Multipole(m=4, a_m=0.1, r_E=0.0), "Multipole.r_E must be finite and in (0"),
        (lambda: light.Sersic(1.0, R_sersic=-0.1, n_sersic=2.0), "Sersic.R_sersic"),
        (lambda: light.Sersic(1.0, R_sersic=0.5, n_sersic=0.1), "Sersic.n_sersic"),
        (lambda: light.Sersic(NAN, R_sersic=0.5, n_sersic=2.0), "Sersic.amp must be finite"),
        (
            lambda: light.CoreSersic(1.0, R_sersic=0.5, Rb=-0.1, n_sersic=2.0, gamma=0.3),
            "CoreSersic.Rb",
        ),
        (lambda: light.Gaussian(1.0, sigma=0.0), "Gaussian.sigma must be finite and in (0, inf)"),
        (lambda: light.Gaussian(1.0, sigma=0.3, e2=-1.0), "Gaussian: the ellipticity"),
        (lambda: light.MGE(jnp.ones(2), jnp.array([0.1, -0.2])), "MGE.sigma must be finite"),
        (lambda: light.Shapelets(amp=jnp.ones(3), n_max=1, beta=-1.0), "Shapelets.beta"),
        (
            lambda: ConstantRegularization(-1.0),
            "ConstantRegularization.coefficient must be finite and in (0, inf)",
        ),
        (lambda: CurvatureRegularization(0.0), "CurvatureRegularization.coefficient"),
        (lambda: AdaptiveBrightness(1.0, -1.0), "AdaptiveBrightness.outer_coefficient"),
        (
            lambda: AdaptiveBrightness(1.0, 1.0, signal_floor=1.0),
            "AdaptiveBrightness.signal_floor must be in [0, 1)",
        ),
        (lambda: AdaptiveBrightness(signal_floor=-1e-4), "AdaptiveBrightness.signal_floor"),
        (lambda: AdaptiveBrightness(signal_floor=NAN), "AdaptiveBrightness.signal_floor"),
        (
            lambda: MaternKernel(1.0, scale=-0.1),
            "MaternKernel.scale must be finite and in (0, inf)",
        ),
        (lambda: ExponentialKernel(NAN), "ExponentialKernel.coefficient must be finite"),
    ],
)
def test_a_bad_value_is_refused_with_its_class_field_value_and_range(build, words):
    with pytest.raises(ValueError) as err:
        build()
    assert words in str(err.value)


@pytest.mark.parametrize(
    "build",
    [
        lambda: mass.SIE(theta_E=jnp.ones(3)),
        lambda: mass.ExternalShear(gamma1=jnp.zeros((2, 2)), gamma2=0.0),
        lambda: light.Sersic(amp=1.0, R_sersic=jnp.ones(2), n_sersic=2.0),
    ],
)
def test_a_scalar_field_refuses_an_array(build):
    with pytest.raises(ValueError, match="must be a scalar, got shape"):
        build()
    # a regularization's __init__ is annotated as a scalar, which beartype checks in these
    # tests (a TypeError); without it, its own check (a ValueError)
    with pytest.raises((ValueError, TypeError), match=r"f(32|64)\[2\]|shape \(2,\)"):
        ConstantRegularization(jnp.ones(2))


def test_many_profiles_at_once_go_through_a_batch():
    # the refusal of an array says where to go, for mass profiles (the only batch)
    with pytest.raises(ValueError, match=r"MassBatch\.stack"):
        mass.SIS(jnp.ones(2))
    with pytest.raises(ValueError, match=r"MassBatch\.stack"):  # a user's mass profile too
        _Cored(theta_E=jnp.ones(2), s=0.1)
    with pytest.raises(ValueError, match=r"got shape \(2,\)$"):
        light.Gaussian(1.0, jnp.ones(2))
    batch = mass.MassBatch.stack([mass.SIS(1.0), mass.SIS(0.5, 0.1, 0.2)])
    x, y = sample_points(8)
    ax, _ = batch.deflection(x, y)
    ax1, _ = mass.SIS(1.0).deflection(x, y)
    ax2, _ = mass.SIS(0.5, 0.1, 0.2).deflection(x, y)
    np.testing.assert_allclose(ax, ax1 + ax2, rtol=1e-12)


def test_under_jit_a_bad_value_raises_at_run_time_and_a_good_one_is_unchanged():
    x, y = sample_points(8)

    @eqx.filter_jit
    def deflect(theta_e, e1):
        return mass.SIE(theta_E=theta_e, e1=e1).deflection(x, y)[0]

    eager = mass.SIE(1.1, e1=0.2).deflection(x, y)[0]
    np.testing.assert_allclose(deflect(1.1, 0.2), eager, rtol=10 * default_eps())
    with pytest.raises(Exception, match=r"SIE.theta_E must be finite and in \[0, inf\)"):
        jax.block_until_ready(deflect(-1.1, 0.2))
    with pytest.raises(Exception, match=r"SIE: the ellipticity"):
        jax.block_until_ready(deflect(1.1, 1.2))
    # and under vmap: the good values pass
    out = jax.vmap(deflect)(jnp.array([1.0, 1.2]), jnp.array([0.1, -0.1]))
    assert out.shape == (2, 8) and bool(jnp.all(jnp.isfinite(out)))

    @eqx.filter_jit
    def strength(c):
        return ConstantRegularization(c).coefficient

    assert float(strength(2.0)) == 2.0
    with pytest.raises(
        Exception, match=r"ConstantRegularization\.coefficient must be finite and in \(0, inf\)"
    ):
        jax.block_until_ready(strength(-1.0))


def test_domain_reads_as_an_interval():
    assert str(POSITIVE) == "(0, inf)"
    assert str(Domain(0.2, 3.0)) == "[0.2, 3]"
    assert str(Domain(1.0, 3.0, True, True)) == "(1, 3)"
    assert str(Domain()) == "(-inf, inf)"
    assert not bool(Domain(1.0, 3.0, True, True).contains(1.0))
    assert bool(Domain(1.0, 3.0).contains(1.0))


# -- property: refused with a clear error, or finite ------------------------------------

#: realistic magnitudes (1e-6 to 1e3 in arcsec or flux units), the edges, and non-finite
VALUES = st.one_of(
    st.floats(-1e3, 1e3).filter(lambda v: v == 0 or abs(v) > 1e-6),
    st.sampled_from([0.0, 1.0, -1.0, 0.999, 1.001, NAN, INF, -INF]),
)

PROFILES = {**example_mass_profiles(), **example_light_profiles()}
#: final profiles with parameters of their own (sums, batches and wrappers hold others)
SIMPLE = sorted(n for n in PROFILES if n not in ("MassSum", "MassBatch", "LightSum", "FixedLight"))
X, Y = sample_points(32, seed=3)
# the centres themselves too: singular points of many profiles
X = jnp.concatenate([X, jnp.array([0.0, 0.05, 0.1, -0.1])])
Y = jnp.concatenate([Y, jnp.array([0.0, -0.03, 0.1, 0.05])])


def _scalar_fields(profile) -> list[str]:
    return [
        f.name
        for f in dataclasses.fields(profile)
        if eqx.is_inexact_array(getattr(profile, f.name)) and getattr(profile, f.name).ndim == 0
    ]


@eqx.filter_jit
def _evaluate(profile):
    if isinstance(profile, mass.AbstractMassProfile):
        return jnp.stack([*profile.deflection(X, Y), profile.convergence(X, Y)])
    return profile.intensity(X, Y)


@pytest.mark.parametrize("name", SIMPLE)
@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(data=st.data())
def test_a_profile_refuses_its_parameters_or_evaluates_finite(name, data):
    base = PROFILES[name]
    fields = _scalar_fields(base)
    chosen = data.draw(st.lists(st.sampled_from(fields), min_size=1, max_size=3, unique=True))
    values = {f: data.draw(VALUES, label=f) for f in chosen}
    try:
        profile = dataclasses.replace(base, **values)
    except ValueError as err:
        assert str(err).startswith(name), err  # the class named first
        return
    out = np.asarray(_evaluate(profile))
    assert np.all(np.isfinite(out)), f"{name}({values}) evaluates to non-finite numbers"


# -- a parameter described once, next to its field --------------------------------------


class _Cored(mass.AbstractMassProfile):
    # a user's profile: each parameter described next to its field
    theta_E: FloatScalar = eqx.field(
        converter=as_float, metadata=el.describe(domain=el.NON_NEGATIVE, bounds=(0.0, 4.0))
    )
    s: FloatScalar = eqx.field(
        converter=as_float, metadata=el.describe(domain=el.POSITIVE, bounds=(0.01, 1.0))
    )
    center_x: FloatScalar = eqx.field(converter=as_float, default=0.0)
    center_y: FloatScalar = eqx.field(
        converter=as_float, default=0.0, metadata=el.describe(fixed=True)
    )

    def deflection(self, x, y):
        dx, dy = x - self.center_x, y - self.center_y
        r2 = dx * dx + dy * dy
        k = self.theta_E * (jnp.sqrt(r2 + self.s**2) - self.s) / r2
        return k * dx, k * dy

    def potential(self, x, y):
        return jnp.zeros_like(x)


def test_a_parameter_described_next_to_its_field_is_checked_bounded_and_held():
    from equilens._checks import default_bounds, parameters
    from equilens.objective._params import Parametrisation

    with pytest.raises(ValueError, match=r"_Cored\.s must be finite and in \(0, inf\), got 0"):
        _Cored(theta_E=1.0, s=0.0)
    described = parameters(_Cored)
    assert described["s"].domain == el.POSITIVE and described["center_y"].fixed
    assert not described["center_x"].fixed and described["center_x"].bounds is None
    assert default_bounds(_Cored) == {"theta_E": (0.0, 4.0), "s": (0.01, 1.0)}
    # the fit's parametrisation reads the same descriptions
    param = Parametrisation.build(_Cored(theta_E=1.0, s=0.1))
    by_path = dict(zip(param.leaf_paths, zip(param.free, param.bounds, strict=True), strict=True))
    assert by_path[".theta_E"] == (True, (0.0, 4.0))
    assert by_path[".s"] == (True, (0.01, 1.0))
    assert by_path[".center_x"] == (True, None)
    assert by_path[".center_y"][0] is False
    # and the built-in profiles' (a shear's expansion point is held; EPL's slope bounded)
    assert parameters(mass.ExternalShear)["ra_0"].fixed
    assert default_bounds(mass.EPL)["gamma"] == (1.1, 2.9)
    with pytest.raises(ValueError, match="lower < upper"):
        el.describe(bounds=(1.0, 1.0))


def test_a_class_level_table_of_the_old_form_is_refused_not_ignored():
    from typing import ClassVar

    from equilens._checks import parameters

    class OldStyle(mass.AbstractMassProfile):
        bounds: ClassVar[dict[str, tuple[float, float]]] = {"theta_E": (0.0, 2.0)}
        theta_E: FloatScalar = eqx.field(converter=as_float)

        def deflection(self, x, y):
            return self.theta_E * x, self.theta_E * y

        def potential(self, x, y):
            return self.theta_E * x * y

    with pytest.raises(TypeError, match=r"OldStyle\.bounds is a class-level table"):
        OldStyle(theta_E=1.0)
    with pytest.raises(TypeError, match="describe"):
        parameters(OldStyle)
