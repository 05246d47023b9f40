"""The searched fits of a subhalo scan (`subhalo_scan(searched_cells=n)`): the `n` cells of
the highest log-evidence fitted once more from a global search of the smooth model's mass
plus the cell's subhalo with a parametric source, as the smooth model's own fit began
(`equilens.solve.fit_lens`'s search); a cell keeps the better of its fits.

A heavy subhalo can move the smooth model far from the truth's macro model: on the suite's
lens 4 (a 10^9.83 Msun subhalo; docs/validation.md) the smooth fit's slope was 1.54 against
the truth's 2.07, every cell fit kept it, and the best one put its subhalo 0.48" from the
truth at +158 over the smooth model, while the truth refitted is about +430. No local fit
reached that mode, not even from the truth's subhalo on the smooth macro model (-404: a
pixelized source follows whatever the lens model does, so a wrong macro model plus the
right subhalo is a poor model) or with the slope set to 2.0 (-1,487). A parametric source
cannot follow the lens model so: the search (`equilens.solve.search`: Einstein radius,
ellipticity, shear, slope, and the subhalo's position and mass screened at `n_screen`
starts, the source placed where each start maps the arcs, the best refined) found the slope
1.99 and the subhalo 0.008" from the truth, and the cell's fit with the scan's objective from
there is the subhalo's mode.

What the search fits: the smooth model's mass (a profile or `MassSum`) plus the subhalo, with
a `Sersic` source in place of a pixelized one (a parametric source is fitted from its own
start), the lens light held, by chi^2 (`GaussianLikelihood`, light amplitudes solved
linearly and positive); its mass is then the start of the cell's fit with the scan's own
objective, source and free parameters.

The search must screen enough starts: on the suite's lens 2 (10^9.81 Msun) 512 starts, the
best 4 refined, ended 0.44" from the truth (slope 1.93, 10^10.37 Msun), and the cell's fit
from there 54 below the smooth model; 2048 starts, the best 8 refined (86 s on 2 cores
beside a scan), found the subhalo 0.014" from the truth and the cell's fit from there
+224.5 (its own +43.5). Where the search ends in another mode, its macro model is a poor
start for the pixelized source, but its subhalo may not be: the cell is also fitted from
the smooth macro model with the searched subhalo, held while the macro model follows it,
then free (`_held.held_then_free`; on lens 2 from the 512 starts' subhalo 0.44" off:
+58.7 where the searched model's fit ended -53.9); the fit that ends lower in the cell's
objective is kept, and the quiet restart (`_no_worse_than_smooth`) starts from the smooth
model.
"""

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import numpy as np

from ..light import Sersic
from ..objective import Objective, select
from ..source import PixelizedSource
from ..terms import GaussianLikelihood
from ._cells import (
    CellRecord,
    CellSetup,
    _better,
    _cell_evidence,
    _cell_fit,
    _in_cell,
    _no_worse_than_smooth,
    keep_better,
    records_of,
)
from ._held import held_then_free

#: `subhalo_scan`'s default `searched_cells`: the cells of the highest log-evidence given a
#: searched fit (as many as the held-mass fits').
SEARCHED_CELLS = 3
#: The starts the search screens (`equilens.solve.search`'s `n_screen`), and the best
#: polished starts it refines (`n_refine`): the suite's lens 2's subhalo was found 0.014"
#: from the truth at 2048 and 8, 0.44" off at `fit_lens`'s 512 and 4 (module docstring).
SEARCH_SCREEN = 2048
SEARCH_REFINE = 8
#: The searched range of the subhalo's `log10_mass` (log10 Msun): a subhalo lighter than
#: 1e8 Msun does not move the macro model, and the cell fits find it.
SEARCH_MASSES = (8.0, 10.5)
#: The searched range of a power-law slope (`gamma`), where the first mass component has
#: one: the smooth fit's slope can be far off (lens 4: 1.54 for 2.07).
SEARCH_SLOPES = (1.5, 2.5)
#: The searched range of the subhalo's `u`, `v` (its position in the cell, in half-widths).
SEARCH_CELL = 0.95
#: The steps of the search's refinement and of its last fit (`fit_lens`'s under the CLI).
SEARCH_STEPS = 300


def check_searched(n: Any) -> None:
    """`ValueError` unless `n` (`searched_cells`) is an integer >= 0."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"searched_cells must be an integer >= 0, got {n!r}")


def _imaging(objective: Objective) -> Any:
    """The dataset of `objective`'s first imaging term."""
    terms = objective.imaging_terms()
    if not terms:
        raise ValueError("a searched fit needs an objective with an imaging term")
    return terms[0].imaging


def searched_model(setup: CellSetup, centre: np.ndarray) -> tuple[Any, Any]:
    """What the search fits: the cell's model (the smooth model plus the subhalo at the
    cell's centre) with a `Sersic` source in place of a pixelized one; and that cell model."""
    dtype = setup.template.mass.components[-1].log10_mass.dtype
    cell = _in_cell(setup.template, centre, np.array([0.0, 0.0, 9.5]), dtype)
    model = cell
    if isinstance(cell.source, PixelizedSource):
        theta_E = float(getattr(cell.mass.components[0], "theta_E", 1.0))  # pyright: ignore[reportAttributeAccessIssue]
        model = eqx.tree_at(
            lambda m: m.source,
            cell,
            Sersic(
                amp=jnp.asarray(1.0, dtype),
                R_sersic=jnp.asarray(0.1 * theta_E, dtype),
                n_sersic=jnp.asarray(1.0, dtype),
            ),
        )
    return model, cell


def searched_space(model: Any, radius: float) -> dict[Any, tuple[float, float]]:
    """The search's space (`lens_search_space` with the source placed by the arcs) plus the
    first mass component's slope (`SEARCH_SLOPES`, where it has one) and the subhalo's
    position in its cell (`SEARCH_CELL`) and mass (`SEARCH_MASSES`)."""
    from ..solve._pipeline import THETA_E_SEARCH
    from ..solve._search import has_field, lens_search_space

    space = lens_search_space(
        model,
        theta_E=(THETA_E_SEARCH[0] * radius, THETA_E_SEARCH[1] * radius),
        source_position=False,
    )
    if has_field(model.mass.components[0], "gamma"):
        space[lambda m: m.mass.components[0].gamma] = SEARCH_SLOPES
    k = len(model.mass.components) - 1
    space[lambda m: m.mass.components[k].u] = (-SEARCH_CELL, SEARCH_CELL)
    space[lambda m: m.mass.components[k].v] = (-SEARCH_CELL, SEARCH_CELL)
    space[lambda m: m.mass.components[k].log10_mass] = SEARCH_MASSES
    return space


def searched_task(
    setup: CellSetup, centre: np.ndarray, at: np.ndarray, pool: np.ndarray | None = None
) -> CellRecord:
    """One cell's searched fit (`_cells._cell_task`'s signature; `at`, `pool` unused): the
    search of `searched_model` by chi^2 (module docstring), then two fits of the cell with
    the scan's objective, from the searched mass and from the smooth macro model with the
    searched subhalo (held first), the one that ends lower kept; the fit from the smooth
    model (the quiet start) instead where it ends better (`_no_worse_than_smooth`); its
    evidence. A search that fails is the cell's failed record (NaN evidence: the cell keeps
    its own fit)."""
    from ..solve import fit, search
    from ..solve._pipeline import lens_bounds, mass_anchor
    from ..solve._search import arc_placement
    from ..solve._start import light_moments

    del at, pool
    imaging = _imaging(setup.objective)
    model, cell = searched_model(setup, centre)
    placement = arc_placement(imaging, model)
    radius = light_moments(imaging).mask_radius
    center, center_range = mass_anchor(imaging, model, placement)
    bounds = lens_bounds(model, radius, center, center_range)
    objective = Objective([GaussianLikelihood(imaging, nonnegative=True)])
    free = select(model, lambda m: (m.mass, m.source))
    found = search(
        objective,
        model,
        searched_space(model, radius),
        n_screen=SEARCH_SCREEN,
        n_refine=SEARCH_REFINE,
        solver="lm",
        free=free,
        bounds=bounds,
        max_steps=SEARCH_STEPS,
        prepare=placement,
        covariance=False,
    )
    r = fit(
        objective,
        found.best.model,
        "lm",
        free=free,
        bounds=bounds,
        max_steps=SEARCH_STEPS,
        throw=False,
        covariance=False,
    )
    best = r if math.isfinite(float(r.value)) else found.best
    if not math.isfinite(float(best.value)):
        return math.nan, f"search failed: {best.message()}", None, {}
    sub = best.model.mass.components[-1]
    inside = [jnp.clip(getattr(sub, c), -SEARCH_CELL, SEARCH_CELL) for c in "uv"]
    mass = eqx.tree_at(lambda m: (m.components[-1].u, m.components[-1].v), best.model.mass, inside)
    searched = eqx.tree_at(lambda m: m.mass, cell, mass)
    # the searched subhalo on the smooth macro model: held while the macro model follows it
    on_smooth = eqx.tree_at(lambda m: m.mass.components[-1], cell, mass.components[-1])
    tried = [
        (_cell_fit(setup, searched), searched),
        (held_then_free(setup, on_smooth, ("u", "v", "log10_mass")), on_smooth),
    ]
    fitted, _ = _better(tried)
    fitted = _no_worse_than_smooth(fitted, on_smooth, setup)
    return _cell_evidence(setup.objective, fitted, setup.free, setup.bounds, setup.evidence)


def searched_fits(
    cells: tuple[np.ndarray, list[str], list[Any], list[dict[str, float]]],
    setup: CellSetup,
    centres: np.ndarray,
    half: float,
    run: Callable[..., Any],
    n: int,
    records: Sequence[Mapping[str, Any]],
    say: Callable[[str], None],
) -> tuple[np.ndarray, list[str], list[Any], list[dict[str, float]]]:
    """The cells' results (`_run_cells`'s) with those of the `n` of the highest
    log-evidence fitted again by `searched_task` (`run`: the scan's `_run_cells`), a cell's
    result replaced where the searched fit's evidence is higher; a record in the
    checkpoint's `records` is read back instead of fitted."""
    log_e = cells[0]
    finite = [i for i in range(len(log_e)) if math.isfinite(float(log_e[i]))]
    top = sorted(finite, key=lambda i: -float(log_e[i]))[:n]
    if not top:
        return cells
    chosen = centres[top]
    starts = np.tile([0.0, 0.0, SEARCH_MASSES[0]], (len(top), 1))[:, None, :]
    done = records_of(records, "searched", chosen, half)
    say(f"searched fits of the {len(top)} best cells (mass, slope and subhalo searched)")
    again = run(setup, chosen, half, starts, done, "searched", task=searched_task)
    return keep_better(cells, top, again, say, "the searched fit")
