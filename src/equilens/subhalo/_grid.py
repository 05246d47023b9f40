"""The cells of a subhalo scan: a square grid over the mask's pixels, and a model's
subhalo placed in one (`place`)."""

from typing import Any

import equinox as eqx
import numpy as np
from jaxtyping import Bool, Float

from .._lens_system import LensSystem


def tile(
    centre: tuple[float, float] | Float[np.ndarray, " 2"], half: float, n: int
) -> Float[np.ndarray, "cells 2"]:
    """The centres (arcsec) of the `n` x `n` square cells of half-width `half / n` that
    tile the square of half-width `half` about `centre`, ordered by row (y), then column
    (x): a scan's grid, and a refinement's sub-cells of one cell."""
    offsets = (np.arange(n) + 0.5) * 2 * (half / n) - half
    cx, cy = (float(v) for v in centre)
    return np.asarray([(cx + ox, cy + oy) for oy in offsets for ox in offsets], np.float64)


def scan_cells(
    x: Float[np.ndarray, "ny nx"],
    y: Float[np.ndarray, "ny nx"],
    mask: Bool[np.ndarray, "ny nx"],
    n: int,
    pixel_scale: float,
) -> tuple[Float[np.ndarray, "cells 2"], float]:
    """The centres `(x, y)` (arcsec) and the half-width (arcsec) of the cells of an `n` x
    `n` grid of square cells over the square that holds every pixel of `mask` (pixel
    centres `x`, `y`), keeping the cells that hold at least one of them: the subhalo
    scan's cells over the arcs. Cells are ordered by row (y), then column (x)."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"the scan's grid must be a positive number of cells, got {n!r}")
    mask = np.asarray(mask, bool)
    if not mask.any():
        raise ValueError("the scan's mask holds no pixels")
    xs, ys = np.asarray(x)[mask], np.asarray(y)[mask]
    lo_x, hi_x = xs.min() - pixel_scale / 2, xs.max() + pixel_scale / 2
    lo_y, hi_y = ys.min() - pixel_scale / 2, ys.max() + pixel_scale / 2
    side = max(hi_x - lo_x, hi_y - lo_y)
    cx, cy = (lo_x + hi_x) / 2, (lo_y + hi_y) / 2
    half = side / (2 * n)
    centres = [
        c
        for c in tile((float(cx), float(cy)), float(side / 2), n)
        if ((np.abs(xs - c[0]) <= half) & (np.abs(ys - c[1]) <= half)).any()
    ]
    return np.asarray(centres, np.float64).reshape(-1, 2), float(half)


def grid_cells(objective: Any, grid: Any, half: float | None) -> tuple[np.ndarray, float]:
    """`subhalo_scan`'s cells: `(centres, half)` of an `n` x `n` grid over the mask of
    `objective`'s first imaging term (`scan_cells`) when `grid` is an int `n`, else
    `grid`'s `(m, 2)` centres (arcsec) with `half`, checked."""
    if isinstance(grid, int):
        terms = objective.imaging_terms()
        if not terms:
            raise ValueError("subhalo_scan: the objective has no imaging term to lay a grid on")
        im = terms[0].imaging
        x, y = (np.asarray(a) for a in im.grid.coordinates())
        return scan_cells(x, y, np.asarray(im.mask), grid, im.pixel_scale)
    centres = np.asarray(grid, np.float64)
    if centres.ndim != 2 or centres.shape[1] != 2 or centres.shape[0] < 1:
        raise ValueError(f"grid must be an int or an (m, 2) array of centres, got {centres.shape}")
    if half is None or not float(half) > 0:
        raise ValueError("a grid of centres needs half (the cells' half-width, arcsec) > 0")
    return centres, float(half)


def place(template: LensSystem, cell: Any, at: Any) -> LensSystem:
    """`template` with its subhalo's (its last mass component's) cell centred at `cell`
    (`(x, y)`, arcsec) and the subhalo at `at` (`(u, v, log10_mass)`: cell units, log10
    Msun): arrays or scalars of the subhalo's dtype, so it traces under `jit` and
    `lax.map`."""
    return eqx.tree_at(
        lambda s: (
            s.mass.components[-1].cell_x,
            s.mass.components[-1].cell_y,
            s.mass.components[-1].u,
            s.mass.components[-1].v,
            s.mass.components[-1].log10_mass,
        ),
        template,
        (cell[0], cell[1], at[0], at[1], at[2]),
    )
