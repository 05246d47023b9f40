"""Where the pixelized chain starts: the parametric fit's minima ranked by the evidence
(`rank_starts`), the commands' `_pixelized_stage(alternatives=...)` and
`fit_lens(on_minima=...)`."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import equilens as el
from equilens import light, mass
from equilens.solve._chain_start import COEFFICIENT_GRID

PSF = el.GaussianPSF(0.12, 0.1)
#: the same evidence evaluated twice (jitted or not): round-off of the precision
RTOL = 1e-10 if jax.config.jax_enable_x64 else 1e-5


def _truth(lens_light=False):
    return el.LensSystem(
        mass=mass.EPL(theta_E=1.0, gamma=2.1, e1=0.05, e2=-0.03) + mass.ExternalShear(0.02, 0.01),
        lens_light=light.Sersic(amp=2.0, R_sersic=0.4, n_sersic=3.0) if lens_light else None,
        # two clumps: a source no single Sersic describes
        source=light.Sersic(amp=12.0, R_sersic=0.08, n_sersic=1.0, center_x=0.05)
        + light.Sersic(amp=8.0, R_sersic=0.06, n_sersic=1.0, center_x=-0.1, center_y=0.08),
    )


@pytest.fixture(scope="module")
def data():
    grid = el.Grid((40, 40), 0.1)
    return el.simulate(
        jax.random.key(11),
        _truth(),
        grid,
        PSF,
        exposure_time=2000.0,
        sky_level=0.3,
        mask=grid.circular_mask(1.8),
    )


def _mesh_reg():
    return el.RectangularMesh((12, 12)), el.ConstantRegularization(1.0)


def _wrong(model):
    """`model` with a steeper, flatter mass: a wrong macro model."""
    return eqx.tree_at(
        lambda s: (s.mass.components[0].gamma, s.mass.components[0].e1),
        model,
        (jnp.asarray(2.6), jnp.asarray(0.35)),
    )


def test_rank_starts_is_each_start_s_evidence_at_its_best_strength(data):
    mesh, reg = _mesh_reg()
    truth = el.solve.pixelized_model(_truth(), mesh, reg)
    wrong = _wrong(truth)
    ranked = el.solve.rank_starts(data, [wrong, truth])
    assert ranked.shape == (2,)
    assert ranked[1] > ranked[0] + 10, ranked  # the true mass far ahead
    # each the best over the strength grid of the evidence itself (the data its brightness)
    term = el.LogEvidence(data)
    for model, got in zip((wrong, truth), ranked, strict=True):
        values = [
            -float(
                term(
                    eqx.tree_at(
                        lambda s: s.source.regularization.coefficient, model, jnp.asarray(c)
                    )
                )
            )
            for c in COEFFICIENT_GRID
        ]
        np.testing.assert_allclose(got, max(values), rtol=RTOL)
    # without the strength fitted: the evidence at the model's own strength (1.0)
    held = el.solve.rank_starts(data, [wrong, truth], fit_strength=False)
    np.testing.assert_allclose(held, [-float(term(wrong)), -float(term(truth))], rtol=RTOL)
    assert np.all(held <= ranked + 1e-6 * np.abs(ranked))


def test_rank_starts_holds_the_lens_light_and_refuses_a_parametric_source(data):
    mesh, reg = _mesh_reg()
    lit = el.solve.pixelized_model(_truth(lens_light=True), mesh, reg)
    fixed = eqx.tree_at(lambda s: s.lens_light, lit, light.FixedLight(lit.lens_light))
    held, solved = (
        el.solve.rank_starts(data, [lit], fit_strength=False, lens_light=how)[0]
        for how in ("fixed", "solved")
    )
    term = el.LogEvidence(data)
    np.testing.assert_allclose(held, -float(term(fixed)), rtol=RTOL)
    np.testing.assert_allclose(solved, -float(term(lit)), rtol=RTOL)
    assert held != solved  # the amplitude solved with the source, or held as it is
    with pytest.raises(TypeError, match="PixelizedSource"):
        el.solve.rank_starts(data, [_truth()])
    with pytest.raises(ValueError, match="lens_light"):
        el.solve.rank_starts(data, [lit], lens_light="free")


def test_the_commands_chain_starts_from_the_minimum_of_the_highest_evidence(
    data, monkeypatch, capsys
):
    """`_pixelized_stage(alternatives=...)`: the chain starts from the mass of the
    alternative with the highest log evidence, its positions that model's images; with no
    alternative better, from the parametric fit's."""
    import equilens.solve
    from equilens.cli import _source

    class Stop(Exception):
        pass

    seen = {}

    def recorded(imaging, start, **kw):
        seen["start"], seen["positions"] = start, kw["positions"]
        raise Stop

    monkeypatch.setattr(equilens.solve, "fit_pixelized", recorded)
    mesh, reg = _mesh_reg()
    truth = _truth()
    parametric = _wrong(truth)
    fits = [SimpleResult(parametric), SimpleResult(truth)]
    for alternatives, want in (((fits[0], fits[1]), truth), ((fits[0],), parametric)):
        with pytest.raises(Stop):
            _source._pixelized_stage(
                data,
                fits[0],
                mesh,
                reg,
                None,
                "lm",
                None,
                None,
                False,
                alternatives=alternatives,
            )
        got = seen["start"].mass.components[0]
        assert float(got.gamma) == float(want.mass.components[0].gamma)
        assert isinstance(seen["start"].source, el.PixelizedSource)
        expected = el.solve.auto_positions(data, want)
        if expected is None:
            assert seen["positions"] is None
        else:
            np.testing.assert_allclose(seen["positions"], expected)
    out = capsys.readouterr().out
    assert "chain starts from the search's minimum 2" in out
    assert out.count("chain start by the log evidence") == 2


class SimpleResult:
    """What `_pixelized_stage` reads of a `FitResult`: its model."""

    def __init__(self, model):
        self.model = model
