"""A lens of the validation suite (`validation/simulated_suite.py`), end to end.

The suite simulates its lenses with lenstronomy (not with equilens's forward model) and fits
each with the `equilens fit` command a user would run, from the generic start. Its full table
(20 lenses, parametric and pixelized columns) is in docs/validation.md; this test runs one of
those lenses, the parametric column, so that a change that breaks the recovery on
independently simulated data fails CI. Run by the `slow` nox session, which installs
lenstronomy.
"""

import importlib.util
import pathlib

import numpy as np
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.crosscheck, pytest.mark.x64_only]

SUITE = pathlib.Path(__file__).parents[1] / "validation" / "simulated_suite.py"
LENS = 6  # theta_E 1.605", q 0.86, shear 0.063: neither round nor shear-free


def _suite():
    spec = importlib.util.spec_from_file_location("simulated_suite", SUITE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_suite_lens_recovers_the_einstein_radius_from_the_cli(tmp_path):
    # inside the test, so that sessions without lenstronomy deselect it (it is slow)
    # instead of reporting the module skipped
    pytest.importorskip("lenstronomy")
    suite = _suite()
    rng = np.random.default_rng(2026)  # the script's default seed: the same 20 lenses
    lenses = [suite.draw_lens(rng) for _ in range(suite.N_LENSES)]
    row = suite.fit_one(LENS, lenses[LENS], str(tmp_path), "sersic")
    assert row["exit"] == 0, row
    assert row["status"] == "successful", row
    assert abs(row["error"]) < 0.01, row
    assert 0.8 < row["reduced_chi2"] < 1.3, row
