"""The searched fits of a subhalo scan (`subhalo_scan(searched_cells=n)`,
`equilens.subhalo._searched`): which cells get one, when a cell keeps it, what the search
fits, its checkpoint record read back, bad settings refused."""

import json
import math

import numpy as np
import pytest

import equilens as el
from equilens.light import Sersic
from equilens.subhalo import _cells, _searched, subhalo_scan
from helpers import slow_ci
from test_subhalo_scan import LC, _lens


@pytest.mark.precision_independent
def test_searched_settings_are_checked():
    _searched.check_searched(0)
    _searched.check_searched(3)
    for bad in (-1, True, 1.5, "3", None):
        with pytest.raises(ValueError, match="searched_cells must be an integer >= 0"):
            _searched.check_searched(bad)


@pytest.mark.precision_independent
def test_the_best_cells_get_a_searched_fit_and_keep_it_only_where_it_is_better():
    """`searched_fits`: the `n` cells of the highest finite log-evidence, through the scan's
    `run` under the key "searched" and `searched_task`; a cell's result replaced exactly
    where the searched fit's is higher; the checkpoint's records of those cells (matched
    by centre and size) passed as done."""
    log_e = np.array([5.0, np.nan, 9.0, 7.0, 1.0])
    cells = (log_e, ["ok"] * 5, ["fit"] * 5, [{}] * 5)
    centres = np.arange(10.0).reshape(5, 2)
    seen = {}

    def run(setup, chosen, half, starts, done, key, task):
        seen.update(chosen=chosen, done=done, key=key, task=task, half=half, starts=starts)
        return np.array([8.0, 12.0]), ["s a", "s b"], ["A", "B"], [{"u": 1.0}, {"u": 2.0}]

    records = [
        {"searched": 0, "center": [6.0, 7.0], "half": 0.4},  # (cell 4's, another index)
        {"searched": 0, "center": [0.0, 1.0], "half": 0.4},  # (another cell's: not)
        {"searched": 1, "center": [4.0, 5.0], "half": 0.3},  # (cell 3's centre, another size)
        {"held": 0, "center": [4.0, 5.0], "half": 0.4},  # (a held-mass fit's: not)
    ]
    lines = []
    setup = _cells.CellSetup(*(None,) * 9)
    out = _searched.searched_fits(cells, setup, centres, 0.4, run, 2, records, lines.append)
    np.testing.assert_array_equal(seen["chosen"], centres[[2, 3]])
    assert seen["starts"].shape == (2, 1, 3)
    assert seen["key"] == "searched" and seen["task"] is _searched.searched_task
    assert seen["half"] == 0.4 and list(seen["done"]) == [1]
    new_e, status, fits, errors = out
    np.testing.assert_array_equal(new_e, [5.0, np.nan, 9.0, 12.0, 1.0])
    assert status == ["ok", "ok", "ok", "s b", "ok"]
    assert fits == ["fit", "fit", "fit", "B", "fit"] and errors[3] == {"u": 2.0}
    assert log_e[3] == 7.0  # (the input left as it was)
    assert any("cell 4: the searched fit kept" in line for line in lines)
    assert not any("cell 3:" in line for line in lines)
    none = (np.full(2, np.nan), ["failed"] * 2, [None] * 2, [{}] * 2)
    assert _searched.searched_fits(none, setup, centres[:2], 0.4, run, 3, [], print) is none


def test_the_search_fits_a_parametric_source_and_searches_the_slope_and_the_subhalo():
    """`searched_model` puts a `Sersic` in place of a pixelized source (a parametric one
    stays) and the subhalo at the cell's centre; `searched_space` adds the slope where the
    first mass component has one, and the subhalo's u, v and mass."""
    objective, start = _lens(False)
    epl = el.mass.EPL(theta_E=0.9, gamma=2.1, e1=0.05, e2=-0.03)
    pix = el.LensSystem(
        mass=epl + el.mass.ExternalShear(gamma1=0.0, gamma2=0.0),
        source=el.PixelizedSource(
            el.AdaptiveRectangularMesh((6, 6)), el.ConstantRegularization(1.0)
        ),
    )
    for smooth, parametric in ((start, True), (pix, False)):
        template = subhalo_template(smooth)
        setup = _cells.CellSetup(objective, objective, template, *(None,) * 6)
        model, cell = _searched.searched_model(setup, np.array([0.3, -0.6]))
        sub = cell.mass.components[-1]
        assert float(sub.cell_x) == pytest.approx(0.3) and float(sub.cell_y) == pytest.approx(-0.6)
        assert float(sub.u) == 0.0 and float(sub.v) == 0.0
        assert isinstance(model.source, Sersic)
        assert (model.source is cell.source) is parametric
        space = _searched.searched_space(model, 1.5)
        ranges = sorted(space.values())
        assert _searched.SEARCH_MASSES in ranges
        assert ranges.count((-_searched.SEARCH_CELL, _searched.SEARCH_CELL)) == 2
        assert (_searched.SEARCH_SLOPES in ranges) is not parametric  # (an SIE: no slope)


def subhalo_template(smooth):
    from equilens.subhalo import Subhalo
    from equilens.subhalo._scan import _as_sum, with_subhalo

    sub = Subhalo(
        log10_mass=9.0,
        cell_x=0.0,
        cell_y=0.0,
        half=0.3,
        host_theta_E=0.9,
        cosmology=LC,
        kind="pseudo_jaffe",
    )
    return with_subhalo(_as_sum(smooth), sub)


@slow_ci
def test_a_searched_fit_finds_the_subhalo_and_is_resumed(monkeypatch, tmp_path):
    """The scan's searched fit (`searched_task`) of the best cell: two fits with the scan's
    objective, one from the searched model, one from the searched subhalo on the smooth
    macro model with the subhalo held first; its record in the checkpoint, the cell's
    evidence the higher of its own fit's and the searched fit's, the subhalo within 0.1" of
    the truth's; read back by a scan run again (no fit)."""
    objective, start = _lens(True)
    smooth = el.fit(objective, start, covariance=False)
    kw = dict(
        grid=np.asarray([[0.1, 0.8], [-0.8, -0.6]]),
        half=0.3,
        kind="pseudo_jaffe",
        progress=False,
        refine=0,
        polish=0,
        smooth_starts=0,
        start_grid=0,
        held_cells=0,
    )
    plain = subhalo_scan(objective, smooth, LC, searched_cells=0, **kw)
    calls = []
    real = _cells._fit

    def spy(objective, start, solver, free, *args, **kwargs):
        sub = free.mass.components[-1]
        held = not any(bool(getattr(sub, c)) for c in ("u", "v", "log10_mass"))
        calls.append((held, start.mass.components[0]))
        return real(objective, start, solver, free, *args, **kwargs)

    monkeypatch.setattr(_cells, "_fit", spy)
    path = tmp_path / "cells.jsonl"
    lines = []
    scan = subhalo_scan(
        objective, smooth, LC, searched_cells=1, checkpoint=path, log=lines.append, **kw
    )
    # the cells' fits (subhalo free), then the searched fit's two: from the searched model
    # (subhalo free, another macro model), and from the smooth macro model with the
    # searched subhalo held, then free
    macro = calls[0][1]  # (the first cell's start: the scan's smooth macro model)
    held = [k for k, (h, _) in enumerate(calls) if h]
    assert len(held) == 1
    k = held[0]
    assert float(calls[k][1].theta_E) == float(macro.theta_E)  # (the smooth macro model)
    assert not calls[k + 1][0]  # (then everything free)
    assert float(calls[k - 1][1].theta_E) != float(macro.theta_E)  # (the searched model's)
    monkeypatch.setattr(_cells, "_fit", real)
    best = int(np.nanargmax(plain.log_evidence))
    records = [json.loads(line) for line in path.read_text().splitlines()]
    searched = [r for r in records if "searched" in r]
    assert len(searched) == 1 and searched[0]["center"] == pytest.approx(kw["grid"][best].tolist())
    assert math.isfinite(searched[0]["log_evidence"])
    expected = max(plain.log_evidence[best], searched[0]["log_evidence"])
    assert scan.log_evidence[best] == pytest.approx(expected, rel=1e-12)
    assert scan.log_evidence[1 - best] == pytest.approx(plain.log_evidence[1 - best], rel=1e-12)
    assert any(line.startswith("searched fit 1 at") for line in lines)
    # the search reaches the subhalo's mode (this lens's cell fit finds it too), and the
    # cell's subhalo lies where the truth's is, (0, 0.9)
    assert searched[0]["log_evidence"] > plain.log_evidence[best] - 1.0
    x, y = (float(c) for c in scan.fits[best].mass.components[-1].center)
    assert math.hypot(x - 0.0, y - 0.9) < 0.1
    again = subhalo_scan(objective, smooth, LC, searched_cells=1, checkpoint=path, **kw)
    np.testing.assert_array_equal(again.log_evidence, scan.log_evidence)
