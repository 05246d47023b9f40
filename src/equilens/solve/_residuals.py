"""Residuals left where the arcs are: whether a fitted lens model has modelled the lensed light."""

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np
from jaxtyping import Float
from scipy.signal import fftconvolve

from .._lens_system import LensSystem
from ..data import Imaging, MultiBandImaging
from ._plausible import with_plausibility
from ._result import FitResult

#: A fit has left arcs in its residuals when the mean squared matched-filter S/N of its
#: residuals over the arcs exceeds `ARC_RESIDUAL_LIMIT` times the noise level elsewhere in
#: the mask (estimated robustly, and at least 1: a noise map that overstates the noise does
#: not make a modelled ring look unmodelled). Set on the development lenses of
#: validation/realistic_suite.py (fits that model their arcs: 1.2-1.8; Sersic sources on
#: bright real galaxies, or a wrong mass: 5.5-32) and the shipped HST lens (its Sersic
#: source: 3.0): see docs/validation.md.
ARC_RESIDUAL_LIMIT = 4.0
#: The arcs: the pixels where the data minus the lens-light model, or the model's lensed
#: source, has a matched-filter S/N above `ARC_DETECTION`.
ARC_DETECTION = 3.0
#: The median of a chi2 variable of one degree of freedom (the robust noise level's scale).
_CHI2_1_MEDIAN = 0.454936


@dataclasses.dataclass(frozen=True)
class ArcResiduals:
    """The residuals of a fit where its arcs are, against elsewhere.

    Images are matched-filtered by the PSF (`sum(r k) / sqrt(sum(k^2))` over the used
    pixels under the kernel `k`, of `r` = image / noise): noise alone gives a
    unit-variance map, and light the model misses (an arc, a clump of the source) stands
    out by the S/N it would have as a point source. The arcs are the used pixels where the
    data minus the lens-light model, or the model's lensed source, is above
    `ARC_DETECTION` in that map. `arcs` is the mean square of the filtered residuals
    `(data - model) / noise` over them; `elsewhere` the noise level of the other used
    pixels (the median of the square over the chi2 median: a few pixels of a galaxy's core
    the lens light misses do not raise it). Both are 1 for a model that leaves only
    noise."""

    arcs: float
    elsewhere: float
    n_arcs: int
    n_elsewhere: int

    @property
    def excess(self) -> float:
        """`arcs / max(elsewhere, 1)`: above `ARC_RESIDUAL_LIMIT`, arcs are left."""
        return self.arcs / max(self.elsewhere, 1.0)

    @property
    def left(self) -> bool:
        """Whether the arcs hold residuals that the rest of the mask does not."""
        return self.n_arcs > 0 and self.excess > ARC_RESIDUAL_LIMIT

    def note(self) -> str:
        """The reason, in words, for a result's notes."""
        return (
            f"arcs left in the residuals: their matched-filter chi2 per pixel over the "
            f"{self.n_arcs} pixels of the arcs is {self.arcs:.1f}, {self.excess:.1f} times "
            f"the noise level elsewhere ({self.elsewhere:.2f}; at most {ARC_RESIDUAL_LIMIT:g}): "
            "the model misses lensed light (a source model too simple for it: a parametric "
            "profile on a real galaxy, where a pixelized source can describe it; a lens light "
            "that took part of it; or a wrong mass)"
        )

    def summary(self) -> str:
        """One line for a fit's log."""
        return (
            f"matched-filter chi2 per pixel {self.arcs:.2f} over the arcs ({self.n_arcs} "
            f"pixels), noise level {self.elsewhere:.2f} elsewhere"
            + (" (arcs left)" if self.left else "")
        )

    def to_dict(self) -> dict[str, float | int]:
        return {
            "arcs": self.arcs,
            "elsewhere": self.elsewhere,
            "excess": self.excess,
            "n_arcs": self.n_arcs,
            "n_elsewhere": self.n_elsewhere,
        }


def arc_residuals(
    imaging: Imaging,
    model_image: Float[np.ndarray, "ny nx"],
    lensed_source: Float[np.ndarray, "ny nx"],
) -> ArcResiduals:
    """`ArcResiduals` of a fit whose model image is `model_image` and whose lensed source
    (the model without its lens light) is `lensed_source` (both flux per pixel, the
    shape of `imaging`). Evaluated on the host (numpy), after a fit."""
    used = np.asarray(imaging.mask, dtype=bool)
    model = np.asarray(model_image, dtype=np.float64)
    source = np.asarray(lensed_source, dtype=np.float64)
    if model.shape != used.shape or source.shape != used.shape:
        raise ValueError(
            f"model_image {model.shape} and lensed_source {source.shape} must have the "
            f"data's shape {used.shape}"
        )
    data = np.asarray(imaging.data, dtype=np.float64)
    filtered, ok = matched_filter(imaging, used)
    residual = filtered(data - model)
    lens_subtracted = filtered(data - (model - source))
    arcs = ok & ((lens_subtracted > ARC_DETECTION) | (filtered(source) > ARC_DETECTION))
    other = ok & ~arcs
    s2 = residual**2
    return ArcResiduals(
        arcs=float(s2[arcs].mean()) if arcs.any() else 0.0,
        elsewhere=float(np.median(s2[other]) / _CHI2_1_MEDIAN) if other.any() else 1.0,
        n_arcs=int(arcs.sum()),
        n_elsewhere=int(other.sum()),
    )


def matched_filter(
    imaging: Imaging, used: np.ndarray
) -> tuple[Callable[[np.ndarray], np.ndarray], np.ndarray]:
    """The PSF-matched filter of `ArcResiduals` over the pixels `used` (boolean, the shape
    of `imaging`): a function from an image (flux per pixel) to its matched-filter S/N
    map `sum(r k) / sqrt(sum(k^2))` (`r` = image / noise over the used pixels under the
    kernel `k`; 0 elsewhere), and the pixels where that map is defined (used, with enough
    of the kernel's weight on used pixels)."""
    noise = np.where(used, np.asarray(imaging.noise_map, dtype=np.float64), 1.0)
    k = _data_kernel(imaging)[::-1, ::-1]  # (a correlation: the flipped kernel convolved)
    weight = fftconvolve(used.astype(np.float64), k**2, mode="same")
    ok = used & (weight > 1e-3 * (k**2).sum())
    norm = np.sqrt(np.where(ok, weight, 1.0))

    def filtered(image: np.ndarray) -> np.ndarray:
        image = np.asarray(image, dtype=np.float64)
        convolved = fftconvolve(np.where(used, image / noise, 0.0), k, mode="same")
        return np.where(ok, convolved, 0.0) / norm

    return filtered, ok


def _data_kernel(imaging: Imaging) -> np.ndarray:
    """The PSF at the data's pixels (a supersampled kernel summed over blocks), unit sum."""
    k = np.asarray(imaging.psf.kernel(), dtype=np.float64)
    s = imaging.psf.supersampling
    if s > 1:
        ny, nx = (-(-n // s) * s for n in k.shape)
        padded = np.zeros((ny, nx))
        oy, ox = (ny - k.shape[0]) // 2, (nx - k.shape[1]) // 2
        padded[oy : oy + k.shape[0], ox : ox + k.shape[1]] = k
        k = padded.reshape(ny // s, s, nx // s, s).sum(axis=(1, 3))
    return k / k.sum()


def lens_arc_residuals(imaging: Imaging, system: LensSystem) -> ArcResiduals:
    """`arc_residuals` of a fitted `system` (a `LensSystem` with its amplitudes and, for a
    pixelized source, its source values filled in)."""
    model = np.asarray(system.image(imaging.grid, imaging.convolution))
    lensed = dataclasses.replace(system, lens_light=None)
    source = np.asarray(lensed.image(imaging.grid, imaging.convolution))
    return arc_residuals(imaging, model, source)


def with_arc_check(
    imaging: Imaging,
    result: FitResult,
    log: Callable[[str], None] | None = None,
    system: LensSystem | None = None,
) -> tuple[FitResult, ArcResiduals]:
    """`result` checked for arcs left in its residuals (`lens_arc_residuals` of `system`,
    default `result.model`: give the completed system when the model's linear parts are
    not filled in): when they are, the reason joins its notes and a successful status
    becomes `RESULTS.implausible`. Returns the result and the check."""
    check = lens_arc_residuals(imaging, result.model if system is None else system)
    if log is not None:
        log(f"  residuals: {check.summary()}")
    result = dataclasses.replace(result, arc_residuals=check)
    if check.left:
        result = with_plausibility(result, (*result.notes, check.note()))
    return result, check


def with_band_arc_checks(
    data: MultiBandImaging,
    result: FitResult,
    systems: Sequence[LensSystem],
    log: Callable[[str], None] | None = None,
) -> FitResult:
    """`with_arc_check` for a joint multi-band fit: each band's `lens_arc_residuals` of
    its `systems[i]` (the band's completed `LensSystem`); a band that leaves arcs adds its
    note (naming the band), and `result.arc_residuals` is the band with the largest
    excess."""
    checks = [lens_arc_residuals(b, s) for b, s in zip(data.bands, systems, strict=True)]
    notes = list(result.notes)
    for name, check in zip(data.names, checks, strict=True):
        if log is not None:
            log(f"  band {name} residuals: {check.summary()}")
        if check.left:
            notes.append(f"band {name}: {check.note()}")
    worst = max(checks, key=lambda c: c.excess)
    result = dataclasses.replace(result, arc_residuals=worst)
    return with_plausibility(result, tuple(notes)) if len(notes) > len(result.notes) else result
