"""The mask grown to the arcs: lensed light that continues beyond a fit's mask joins it."""

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import scipy.ndimage as ndi
from jaxtyping import Bool

from .._lens_system import LensSystem
from ..data import Imaging
from ..objective import Objective
from ..terms import GaussianLikelihood
from ._fit import fit
from ._pipeline import _image, _positions_term, lens_bounds, mass_anchor
from ._residuals import ARC_DETECTION, matched_filter, with_arc_check
from ._result import FitResult
from ._rivals import with_earlier_rivals
from ._solvers import SolverLike
from ._start import light_moments

#: Beyond the mask, lensed light is where the data minus the lens-light model is above
#: `ARC_DETECTION` in the PSF-matched S/N map and the model's own lensed source is above
#: this too. The lens light extrapolated beyond the mask it was fitted on leaves residuals
#: all around it (on the realistic suite's Euclid lens 2, 1,503 pixels above 3 sigma), so
#: the model's arcs say where to look; at 1 sigma a wide second Sersic source let 394
#: pixels join there, 138 of them where the true arcs are under 0.3 sigma; at 3 sigma 228,
#: 224 of them above 0.3 sigma and all 119 of the true arcs above 1 sigma outside the mask
#: (`validation/realistic_suite.py`, development lenses 0 and 2, tuning 31 and 36).
GROW_SOURCE_DETECTION = ARC_DETECTION
#: At most this many rounds of growing the mask and fitting again.
GROW_ROUNDS = 3
#: Lensed light found in fewer pixels than this beyond the mask is not grown onto (the
#: faint wing of an arc, or noise, at its edge: not worth a new fit).
GROW_MIN_PIXELS = 5


@dataclasses.dataclass(frozen=True)
class MaskGrowth:
    """What `grow_mask` found: `mask` (boolean, the region's shape: the grown mask),
    `added` (pixels added), `beyond` (pixels of lensed light found outside the mask,
    before the one-pixel margin around them)."""

    mask: np.ndarray
    added: int
    beyond: int

    def summary(self) -> str:
        if self.added == 0:
            return "no lensed light beyond the mask"
        return (
            f"lensed light continues beyond the mask ({self.beyond} pixels): "
            f"{self.added} pixels added, {int(self.mask.sum())} in the mask"
        )


def grow_mask(
    region: Imaging,
    mask: Bool[np.ndarray, "ny nx"],
    model: LensSystem,
) -> MaskGrowth:
    """The fit's `mask` (True = used; within `region`'s pixels) grown to the lensed light
    that continues beyond it, under `model` (a fitted `LensSystem` with its lens light
    and its amplitudes filled in).

    `region` is the whole image the mask may grow into: an `Imaging` whose mask holds
    every usable pixel (finite data, positive noise, not excluded by the user: a
    neighbour's patch stays out). In the PSF-matched S/N map of `ArcResiduals`, the
    arcs are the pixels of the data minus `model`'s lens light, or of `model`'s lensed
    source, above `ARC_DETECTION`; outside the mask, a pixel is lensed light when the
    data minus the lens light is above `ARC_DETECTION` there and `model`'s lensed source
    above `GROW_SOURCE_DETECTION` (the lens light extrapolated beyond the mask it was
    fitted on leaves residuals everywhere around it), and it joins the mask when it is
    connected (8-neighbours) to the arcs inside the mask; a margin of one pixel around
    what joins is added too. Fewer than `GROW_MIN_PIXELS` such pixels add nothing.
    Evaluated on the host after a fit (two model images of the region)."""
    used = np.asarray(region.mask, dtype=bool)
    mask = np.asarray(mask, dtype=bool)
    if mask.shape != used.shape:
        raise ValueError(f"mask shape {mask.shape} does not match the region's {used.shape}")
    if not mask.any():
        raise ValueError("mask is empty: no pixel is used")
    if (mask & ~used).any():
        raise ValueError(
            f"mask uses {int((mask & ~used).sum())} pixels outside the region's usable pixels"
        )
    total = np.asarray(_image(model, region), dtype=np.float64)
    source = np.asarray(
        _image(dataclasses.replace(model, lens_light=None), region), dtype=np.float64
    )
    filtered, ok = matched_filter(region, used)
    data = np.asarray(region.data, dtype=np.float64)
    lens_subtracted = filtered(data - (total - source))
    lensed = filtered(source)
    arcs = ok & ((lens_subtracted > ARC_DETECTION) | (lensed > ARC_DETECTION))
    beyond = ok & ~mask & (lens_subtracted > ARC_DETECTION) & (lensed > GROW_SOURCE_DETECTION)
    labels = ndi.label((arcs & mask) | beyond, structure=np.ones((3, 3)))[0]  # pyright: ignore[reportIndexIssue]
    touching = np.unique(labels[arcs & mask])
    joined = beyond & np.isin(labels, touching[touching > 0])
    if joined.sum() < GROW_MIN_PIXELS:
        return MaskGrowth(mask, 0, int(joined.sum()))
    grown = mask | (ndi.binary_dilation(joined, np.ones((3, 3), dtype=bool)) & used)
    return MaskGrowth(grown, int((grown & ~mask).sum()), int(joined.sum()))


def fit_to_arcs(
    region: Imaging,
    imaging: Imaging,
    result: FitResult,
    *,
    solver: SolverLike = "lm",
    max_steps: int = 300,
    positions: Any = None,
    positions_sigma: float | None = None,
    log: Callable[[str], None] | None = print,
    progress: bool = False,
) -> tuple[FitResult, Imaging, list[MaskGrowth]]:
    """`result` (a `fit_lens` result on `imaging`) fitted again on its mask grown to the
    arcs (`grow_mask` within `region`, the whole image's usable pixels, on the same sky
    grid as `imaging`, which may be cropped from it), as often as the mask grows (at most
    `GROW_ROUNDS` times). Each refit starts at the previous one, everything free, within
    `fit_lens`'s `lens_bounds` for the radius of the mask as given (those `result` was
    fitted within), with the same likelihood (non-negative amplitudes) and `positions`
    term, and is checked for arcs left (`with_arc_check`); rival minima that `result`
    named (`with_rival_minima`) stay named (`with_earlier_rivals`). A user's hand-drawn
    circle often cuts an arc: the part left out still constrains the mass and the source.

    Returns the last fit, its data (the grown mask, cropped) and each round's
    `MaskGrowth`; when the mask does not grow, `result` and `imaging` unchanged."""
    say = log or (lambda _: None)
    if region.pixel_scale != imaging.pixel_scale:
        raise ValueError(
            f"region pixel scale {region.pixel_scale} differs from the data's {imaging.pixel_scale}"
        )
    mask = _on_region(region, imaging)
    # the bounds `result` was fitted within (those of the mask as given): its start holds
    radius = light_moments(imaging).mask_radius
    anchor = mass_anchor(imaging, result.model)
    rounds: list[MaskGrowth] = []
    r = result
    for _ in range(GROW_ROUNDS):
        growth = grow_mask(region, mask, r.model)
        rounds.append(growth)
        say(f"  mask: {growth.summary()}")
        if growth.added == 0:
            break
        mask = growth.mask
        imaging = _with_mask(region, mask).cropped()
        terms: list[Any] = [GaussianLikelihood(imaging, nonnegative=True)]
        if positions is not None:
            terms.append(_positions_term(positions, positions_sigma, imaging.pixel_scale))
        r = fit(
            Objective(terms),
            r.model,
            solver,
            bounds=lens_bounds(r.model, radius, *anchor),
            max_steps=max_steps,
            throw=False,
            progress=progress,
        )
        r, _ = with_arc_check(imaging, r, say)
        say(
            f"  refit on the grown mask: reduced chi2 {float(r.reduced_chi2):.3f}, "
            f"{r.message()} ({float(r.wall_time):.1f} s)"
        )
    if r is not result:  # its rival minima, if any, stay named
        r = with_earlier_rivals(r, result, "the fit on the mask as given")
    return r, imaging, rounds


def _with_mask(region: Imaging, mask: np.ndarray) -> Imaging:
    """`region`'s data with `mask` (a subset of its usable pixels)."""
    return Imaging(
        region.data,
        region.noise_map,
        region.psf,
        region.pixel_scale,
        mask=mask,
        supersampling=region.grid.supersampling,
        origin=region.grid.origin,
    )


def _on_region(region: Imaging, imaging: Imaging) -> np.ndarray:
    """`imaging`'s mask placed on `region`'s pixels (`imaging` on the same sky grid,
    e.g. cropped from it); `ValueError` when it is not."""
    ps = region.pixel_scale
    ry, rx = region.shape
    iy, ix = imaging.shape
    # the column and row of imaging's first pixel in region's array
    c0 = (imaging.grid.origin[0] - region.grid.origin[0]) / ps + (rx - 1) / 2 - (ix - 1) / 2
    r0 = (imaging.grid.origin[1] - region.grid.origin[1]) / ps + (ry - 1) / 2 - (iy - 1) / 2
    c, r = round(c0), round(r0)
    if abs(c - c0) > 1e-6 or abs(r - r0) > 1e-6 or c < 0 or r < 0 or c + ix > rx or r + iy > ry:
        raise ValueError("the data's grid is not a part of the region's pixel grid")
    out = np.zeros(region.shape, dtype=bool)
    out[r : r + iy, c : c + ix] = np.asarray(imaging.mask, dtype=bool)
    if (out & ~np.asarray(region.mask, dtype=bool)).any():
        raise ValueError("the data's mask uses pixels that the region does not")
    return out
