"""The cells of a subhalo scan: a square grid over the mask's pixels."""

import numpy as np
from jaxtyping import Bool, Float


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
