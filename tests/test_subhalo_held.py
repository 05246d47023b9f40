"""The held-mass fits of a subhalo scan (`subhalo_scan(held_cells=n)`,
`equilens.subhalo._held`): which cells get one, when a cell keeps it, its first phase with
the subhalo's mass held, its checkpoint record read back, bad settings refused."""

import json
import math

import numpy as np
import pytest

import equilens as el
from equilens.subhalo import _cells, _held, subhalo_scan
from helpers import slow_ci
from test_subhalo_scan import LC, _lens


@pytest.mark.precision_independent
def test_held_settings_are_checked():
    _held.check_held(0, 9.5, (6.0, 11.0))
    _held.check_held(3, 10.9, (6.0, 11.0))
    for bad in (-1, True, 1.5, "3"):
        with pytest.raises(ValueError, match="held_cells must be an integer >= 0"):
            _held.check_held(bad, 9.5, (6.0, 11.0))
    for bad in (6.0, 11.0, 12.0, math.nan):
        with pytest.raises(ValueError, match="held_log10_mass must lie inside mass_range"):
            _held.check_held(3, bad, (6.0, 11.0))


@pytest.mark.precision_independent
def test_the_best_cells_get_a_held_mass_fit_and_keep_it_only_where_it_is_better():
    """`held_fits`: the `n` cells of the highest finite log-evidence, each started at its
    centre with the held mass, through the scan's `run` under the key "held" and
    `held_task`; a cell's result replaced exactly where the held-mass fit's is higher;
    the checkpoint's records of those cells (matched by centre and size) passed as done."""
    log_e = np.array([5.0, np.nan, 9.0, 7.0, 1.0])
    cells = (log_e, ["ok"] * 5, ["fit"] * 5, [{}] * 5)
    centres = np.arange(10.0).reshape(5, 2)
    seen = {}

    def run(setup, chosen, half, starts, done, key, task):
        seen.update(chosen=chosen, starts=starts, done=done, key=key, task=task, half=half)
        return np.array([8.0, 12.0]), ["held a", "held b"], ["A", "B"], [{"u": 1.0}, {"u": 2.0}]

    records = [
        {"held": 0, "center": [6.0, 7.0], "half": 0.4},  # (cell 4's, another index: done)
        {"held": 0, "center": [0.0, 1.0], "half": 0.4},  # (another cell's: not)
        {"held": 1, "center": [4.0, 5.0], "half": 0.3},  # (cell 3's centre, another size)
        {"cell": 0},
    ]
    lines = []
    setup = _cells.CellSetup(*(None,) * 9)
    out = _held.held_fits(
        cells, setup, centres, 0.4, run, 2, 9.5, records, lines.append, smooth=0.0
    )
    np.testing.assert_array_equal(seen["chosen"], centres[[2, 3]])
    np.testing.assert_array_equal(seen["starts"], [[[0.0, 0.0, 9.5]]] * 2)
    assert seen["key"] == "held" and seen["task"] is _held.held_task and seen["half"] == 0.4
    assert list(seen["done"]) == [1]
    new_e, status, fits, errors = out
    np.testing.assert_array_equal(new_e, [5.0, np.nan, 9.0, 12.0, 1.0])
    assert status == ["ok", "ok", "ok", "held b", "ok"]
    assert fits == ["fit", "fit", "fit", "B", "fit"] and errors[3] == {"u": 2.0}
    assert log_e[3] == 7.0  # (the input left as it was)
    assert any("cell 4: the held-mass fit kept" in line for line in lines)
    assert not any("cell 3:" in line for line in lines)
    # no cell with a finite evidence: nothing to fit
    none = (np.full(2, np.nan), ["failed"] * 2, [None] * 2, [{}] * 2)
    assert (
        _held.held_fits(none, setup, centres[:2], 0.4, run, 3, 9.5, [], print, smooth=0.0) is none
    )


def test_cells_far_above_the_smooth_model_get_no_held_mass_fit():
    """`held_fits(below=...)`: of the `n` best cells, those at least `below` over the smooth
    model's log-evidence are left as they are (said), the others fitted; none fitted (and
    `run` not called) where all are."""
    log_e = np.array([130.0, 20.0, 150.0, 5.0, 119.0])
    cells = (log_e, ["ok"] * 5, ["fit"] * 5, [{}] * 5)
    centres = np.arange(10.0).reshape(5, 2)
    seen = {}

    def run(setup, chosen, half, starts, done, key, task):
        seen.update(chosen=chosen)
        return np.full(len(chosen), 1e3), ["held"] * len(chosen), ["H"] * len(chosen), [{}] * 2

    lines = []
    setup = _cells.CellSetup(*(None,) * 9)
    # Delta log E 130, 110, 99 for the three best: only the last is under 105
    out = _held.held_fits(
        cells, setup, centres, 0.4, run, 3, 9.5, [], lines.append, smooth=20.0, below=105.0
    )
    np.testing.assert_array_equal(seen["chosen"], centres[[4]])
    np.testing.assert_array_equal(out[0], [130.0, 20.0, 150.0, 5.0, 1e3])
    assert any("cell 1: Delta log E 110.00, at least 105: no held-mass fit" in x for x in lines)
    assert any("cell 3: Delta log E 130.00" in x for x in lines)
    assert any("held-mass fits of 1 of the 3 best cells" in x for x in lines)
    seen.clear()
    out = _held.held_fits(cells, setup, centres, 0.4, run, 2, 9.5, [], print, smooth=0.0)
    assert out is cells and not seen  # (the default 100: both cells over it)
    with pytest.raises(ValueError, match="held_below must be a number > 0"):
        _held.check_held(3, 9.5, (6.0, 11.0), 0.0)
    with pytest.raises(ValueError, match="held_below must be a number > 0"):
        _held.check_held(3, 9.5, (6.0, 11.0), math.nan)
    _held.check_held(3, 9.5, (6.0, 11.0), math.inf)


@slow_ci
def test_a_held_mass_fit_holds_the_mass_first_and_is_resumed(monkeypatch, tmp_path):
    """The scan's held-mass fit (`held_task`): a first fit with the subhalo's `log10_mass`
    not free (it ends at the held value) and a second with it free from there; the cell's
    evidence the higher of its own fit's and the held-mass fit's; one "held" record in the
    checkpoint, read back by a scan run again (no fit)."""
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
        searched_cells=0,
    )
    plain = subhalo_scan(objective, smooth, LC, held_cells=0, **kw)
    calls = []
    real = _cells._fit

    def spy(objective, start, solver, free, *args, **kwargs):
        r = real(objective, start, solver, free, *args, **kwargs)
        held = free.mass.components[-1].log10_mass
        calls.append((bool(held), float(r.model.mass.components[-1].log10_mass)))
        return r

    monkeypatch.setattr(_cells, "_fit", spy)
    path = tmp_path / "cells.jsonl"
    lines = []
    scan = subhalo_scan(
        objective,
        smooth,
        LC,
        held_cells=1,
        held_log10_mass=9.2,
        held_below=math.inf,  # (this lens's best cell is a detection: fitted all the same)
        checkpoint=path,
        log=lines.append,
        **kw,
    )
    held_calls = [k for k, (free_mass, _) in enumerate(calls) if not free_mass]
    assert len(held_calls) == 1  # (one held-mass fit: its first phase)
    k = held_calls[0]
    assert calls[k][1] == pytest.approx(9.2, abs=1e-12)  # (the mass held)
    assert calls[k + 1][0] is True  # (then everything free)
    best = int(np.nanargmax(plain.log_evidence))
    records = [json.loads(line) for line in path.read_text().splitlines()]
    held = [r for r in records if "held" in r]
    assert len(held) == 1 and held[0]["center"] == pytest.approx(kw["grid"][best].tolist())
    assert records[0]["header"]["held"] == [1, 9.2]
    expected = max(plain.log_evidence[best], held[0]["log_evidence"])
    assert scan.log_evidence[best] == pytest.approx(expected, rel=1e-12)
    other = 1 - best
    assert scan.log_evidence[other] == pytest.approx(plain.log_evidence[other], rel=1e-12)
    assert any(line.startswith("held-mass fit 1 at") for line in lines)
    calls.clear()
    held = dict(held_cells=1, held_log10_mass=9.2, checkpoint=path)
    again = subhalo_scan(objective, smooth, LC, held_below=math.inf, **held, **kw)
    assert calls == []
    np.testing.assert_array_equal(again.log_evidence, scan.log_evidence)
    # with `held_below` under the best cell's Delta log E (a detection): no held-mass fit,
    # the cells as without one (the held record is not read)
    delta = plain.delta_log_evidence[best]
    assert delta > 10
    lines.clear()
    skipped = subhalo_scan(
        objective, smooth, LC, held_below=delta / 2, log=lines.append, **held, **kw
    )
    assert calls == []
    np.testing.assert_array_equal(skipped.log_evidence, plain.log_evidence)
    assert any("no held-mass fit" in line for line in lines)
    with pytest.raises(ValueError, match="another held_cells or held_log10_mass"):
        subhalo_scan(objective, smooth, LC, held_cells=2, checkpoint=path, **kw)


@pytest.mark.precision_independent
def test_the_first_phase_holds_the_named_subhalo_fields_and_drops_their_scale():
    """`_held_free`: the cell's free parameters less the subhalo's fields named (its mass
    alone for a held-mass fit; position and mass for a searched fit's second start), and
    the cell's `scale` without their entries, the others in order."""
    from equilens.solve._parametrise import parametrisation
    from equilens.subhalo._scan import _free_with_subhalo
    from test_subhalo_searched import subhalo_template

    objective, start = _lens(False)
    template = subhalo_template(start)
    free = _free_with_subhalo(objective, start, None, None, template)
    names = parametrisation(objective, template, free, None).paths(template)
    k = len(template.mass.components) - 1
    scale = np.arange(1.0, len(names) + 1.0)
    setup = _cells.CellSetup(objective, objective, template, "lm", free, {}, 10, None, 7.0, scale)
    for held in (("log10_mass",), ("u", "v", "log10_mass")):
        flags, kept = _held._held_free(setup, held)
        sub = flags.mass.components[-1]
        for c in ("u", "v", "log10_mass"):
            assert bool(getattr(sub, c)) is (c not in held)
        assert bool(flags.mass.components[0].theta_E)  # (the macro model free)
        out = {f"mass.components[{k}].{c}" for c in held}
        expected = [scale[j] for j, n in enumerate(names) if n not in out]
        assert len(expected) == len(names) - len(held)
        np.testing.assert_array_equal(kept, expected)
    no_scale = setup._replace(scale=None)
    assert _held._held_free(no_scale, ("u",))[1] is None
