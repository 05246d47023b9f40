"""The realistic validation suite's lenses (`validation/realistic_suite.py`).

The suite's table (docs/validation.md) is only as good as its lenses: these tests check that
they are what the script says, against lenstronomy where it has the same thing. Run by the
`crosscheck` session, which installs lenstronomy and scikit-image (the HDF galaxies).
"""

import importlib.util
import pathlib

import numpy as np
import pytest

pytestmark = [pytest.mark.crosscheck]

SUITE = pathlib.Path(__file__).parents[1] / "validation" / "realistic_suite.py"


@pytest.fixture(scope="module")
def suite():
    pytest.importorskip("lenstronomy")
    pytest.importorskip("skimage")
    spec = importlib.util.spec_from_file_location("realistic_suite", SUITE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def stamps(suite):
    return suite.hdf_galaxies()


def test_the_sources_are_the_deep_fields_galaxies_without_its_stars(suite, stamps):
    assert len(stamps) == 72
    for s in stamps:
        assert np.isclose(s.sum(), 1.0) and (s >= 0).all()
    # no stamp is one of the two stars: a star's stamp is (nearly) point-symmetric about
    # its peak and concentrated; the galaxies' half-light radii are several pixels
    radii = np.array([suite.half_light_radius(s) for s in stamps])
    assert radii.min() > 1.5, radii.min()


def test_parts_are_fixed_disjoint_and_drawn_apart(suite, stamps):
    parts = [set(suite.DEV), set(suite.HELD_OUT), set(suite.TUNING)]
    assert sum(map(len, parts)) == len(set().union(*parts))  # disjoint
    assert len(suite.DEV) == 10 and len(suite.HELD_OUT) == 20 and len(suite.TUNING) == 20
    assert suite.draw_lens(31, len(stamps))["part"] == "tuning"
    a = suite.draw_lens(12, len(stamps))
    b = suite.draw_lens(12, len(stamps))
    assert a == b and a["part"] == "held-out"
    # each lens has its own random stream: lens 12 does not depend on the ones before it
    assert suite.draw_lens(11, len(stamps))["mass"] != a["mass"]
    instruments = {suite.draw_lens(i, len(stamps))["instrument"] for i in suite.HELD_OUT}
    assert instruments == {"hst", "jwst", "euclid"}


def test_lens_light_reduces_to_lenstronomys_sersic_without_its_features(suite):
    from lenstronomy.LightModel.light_model import LightModel

    p = {
        "center_x": 0.03,
        "center_y": -0.02,
        "pa": 0.4,
        "twist": 0.0,
        "q_in": 0.7,
        "q_out": 0.7,
        "r_t": 0.5,
        "c": 2.0,
        "n": 4.0,
        "r_e": 0.8,
        "envelope": 0.0,
        "r_env": 1.0,
        "dust": None,
    }
    x, y = np.meshgrid(np.linspace(-2, 2, 41), np.linspace(-2, 2, 41))
    e = (1 - 0.7) / (1 + 0.7)
    kw = {
        "amp": 1.0,
        "R_sersic": 0.8,
        "n_sersic": 4.0,
        "e1": e * np.cos(0.8),
        "e2": e * np.sin(0.8),
        "center_x": 0.03,
        "center_y": -0.02,
    }
    ref = LightModel(["SERSIC_ELLIPSE"]).surface_brightness(x, y, [kw])
    ours = suite.lens_light_profile(x, y, p)
    # lenstronomy's b_n is its own series; the shapes agree to its accuracy
    np.testing.assert_allclose(ours, ref, rtol=2e-3)
    # the features change it: a twist, boxiness and a dust lane each move the light
    for key, value in (("twist", 0.5), ("c", 2.5)):
        assert np.abs(suite.lens_light_profile(x, y, {**p, key: value}) - ours).max() > 0.05
    dust = {"pa": 0.4, "offset": 0.0, "width": 0.05, "length": 0.8, "tau": 0.8}
    dimmed = suite.lens_light_profile(x, y, {**p, "dust": dust})
    assert (dimmed <= ours + 1e-15).all() and (dimmed < 0.7 * ours).any()


def test_simulated_arcs_lie_on_the_einstein_ring_with_the_drawn_regime(suite, stamps):
    for i in (0, 1, 2):  # one lens per instrument
        lens = suite.draw_lens(i, len(stamps))
        sim = suite.simulate(lens, stamps)
        image, noise = sim["image"], sim["noise"]
        assert np.isfinite(image).all() and (noise > 0).all()
        spec = suite.INSTRUMENTS[lens["instrument"]]
        x, y = suite._grid(spec, 1)
        m = lens["mass"][0]
        r = np.hypot(x - m["center_x"], y - m["center_y"])
        # the lensed light (traced by lenstronomy) is centred on the Einstein ring: its
        # flux-weighted radius within a source size of theta_E, all of it inside the mask
        arcs = sim["arcs"]
        mean_r = (arcs * r).sum() / arcs.sum()
        assert abs(mean_r - m["theta_E"]) < 0.2 * m["theta_E"], (i, mean_r, m["theta_E"])
        assert arcs[r > lens["mask_radius"]].sum() < 0.05 * arcs.sum()
        # the regime as drawn: the lens galaxy's peak over the arcs' peak exactly, the
        # arcs' peak S/N near its target (the target counts the noise at the arcs'
        # brightest pixel with the lens light at theta_E; the measured peak is where
        # arcs/noise is largest), the lens's peak S/N as in real data (60-1000)
        ratio = sim["galaxy"].max() / sim["arcs"].max()
        assert np.isclose(ratio, lens["regime"]["lens_to_arc"], rtol=1e-6)
        assert 50 < sim["lens_peak_snr"] < 1000
        snr = lens["regime"]["arc_snr"]
        assert 0.8 * snr < sim["arc_peak_snr"] < 1.6 * snr, (i, sim["arc_peak_snr"], snr)
        # the noise map is the image's: (data - model) / noise is unit normal
        pull = (image - arcs - sim["galaxy"]) / noise
        if lens["companion"] is None:
            assert 0.9 < pull.std() < 1.1


@pytest.mark.slow
@pytest.mark.x64_only
def test_a_development_lens_is_recovered_by_the_command(suite, stamps, tmp_path):
    """One development lens of the realistic suite (HST, faint arcs of a real galaxy under
    a twisted, boxy lens light), fitted by `equilens fit` with its defaults as the suite
    fits it: theta_E within 1% (it gets -0.54%), successful, no arcs left."""
    lens = suite.draw_lens(3, len(stamps))
    paths = suite.write_lens(lens, suite.simulate(lens, stamps), str(tmp_path))
    row = suite.fit_one(lens, paths, str(tmp_path), "sersic")
    assert row["exit"] == 0 and row["status"] == "successful", row
    assert abs(row["error"]) < 0.01, row
    assert row["arc_excess"] < 2.0 and 0.9 < row["reduced_chi2"] < 1.3, row
