"""Starting models from data: light moments, and profiles built from their names."""

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from .._lens_system import LensSystem
from ..data import Imaging
from ..light import (
    MGE,
    AbstractLightProfile,
    CoreSersic,
    Gaussian,
    Sersic,
    Shapelets,
)
from ..mass import (
    EPL,
    NFW,
    SIE,
    SIS,
    AbstractMassProfile,
    ConvergenceSheet,
    EllipticalNFW,
    ExternalShear,
    PointMass,
)

#: Names accepted by `start_model` (and `equilens fit --mass/--lens-light/--source`).
MASS_NAMES = {
    "sis": SIS,
    "sie": SIE,
    "epl": EPL,
    "nfw": NFW,
    "enfw": EllipticalNFW,
    "point": PointMass,
    "shear": ExternalShear,
    "sheet": ConvergenceSheet,
}
#: Gaussians of a multi-Gaussian expansion built by `start_model` (widths log-spaced from
#: a pixel to the mask's edge for the lens light; amplitudes solved linearly).
MGE_GAUSSIANS = 20

LIGHT_NAMES = {
    "sersic": Sersic,
    "coresersic": CoreSersic,
    "gaussian": Gaussian,
    "mge": MGE,
    "shapelets": Shapelets,
}


@dataclasses.dataclass(frozen=True)
class LightMoments:
    """Centre (arcsec), ellipticity `(e1, e2)` and circular half-light radius (arcsec) of
    the brightest object in an image, from flux-weighted moments."""

    center_x: float
    center_y: float
    e1: float
    e2: float
    r_half: float
    mask_radius: float


def light_moments(imaging: Imaging, radius: float | None = None) -> LightMoments:
    """Moments of the light in `imaging` (inside the mask).

    The centre is the flux-weighted centroid of the positive flux in the mask (a lensed
    ring or arcs are roughly centred on the lens, so they do not pull it away), refined by
    first moments within `radius` arcsec (default 0.3 of the mask's radius about the
    centroid: small enough for the lens galaxy to outshine the arcs); the ellipticity
    comes from the second moments there; `r_half` is the radius enclosing half of the
    positive flux in the mask; `mask_radius` is the largest distance of a used pixel from
    the centre.
    """
    used = np.asarray(imaging.mask)
    d = np.where(used, np.asarray(imaging.data), 0.0)
    x, y = np.asarray(imaging.grid.x), np.asarray(imaging.grid.y)
    w = np.maximum(d, 0.0)
    if not w.sum() > 0:
        raise ValueError("the image has no positive flux inside the mask")
    cx, cy = float((w * x).sum() / w.sum()), float((w * y).sum() / w.sum())
    if radius is None:
        radius = 0.3 * float(np.sqrt(((x - cx) ** 2 + (y - cy) ** 2)[used].max()))
    for _ in range(5):
        near = (x - cx) ** 2 + (y - cy) ** 2 < radius**2
        ww = w * near
        if not ww.sum() > 0:
            break
        cx, cy = float((ww * x).sum() / ww.sum()), float((ww * y).sum() / ww.sum())
    near = (x - cx) ** 2 + (y - cy) ** 2 < radius**2
    ww = w * near
    dx, dy = x - cx, y - cy
    qxx, qyy, qxy = (ww * dx * dx).sum(), (ww * dy * dy).sum(), (ww * dx * dy).sum()
    # ellipticity of the second moments: chi = (Qxx - Qyy, 2 Qxy) / (Qxx + Qyy + 2 sqrt(det))
    det = max(qxx * qyy - qxy * qxy, 0.0)
    denom = qxx + qyy + 2 * math.sqrt(det)
    e1, e2 = (qxx - qyy) / denom, 2 * qxy / denom
    r = np.hypot(dx, dy)[used]
    flux = w[used]
    order = np.argsort(r)
    cum = np.cumsum(flux[order])
    r_half = float(r[order][np.searchsorted(cum, 0.5 * cum[-1])])
    return LightMoments(
        cx, cy, float(e1), float(e2), max(r_half, imaging.pixel_scale), float(r.max())
    )


def _parse(names: str, table: dict, what: str) -> list[type]:
    out = []
    for token in names.lower().replace(" ", "").split("+"):
        if token not in table:
            raise ValueError(
                f"unknown {what} profile {token!r}; choose from {', '.join(sorted(table))} "
                "(join several with '+')"
            )
        out.append(table[token])
    return out


def _build(cls: type, starts: Mapping[str, Any]) -> Any:
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in starts:
            kwargs[f.name] = starts[f.name]
        elif f.default is dataclasses.MISSING and f.init:
            raise ValueError(f"cannot build a starting {cls.__name__}: no start for {f.name}")
    return cls(**kwargs)


def start_model(
    imaging: Imaging,
    mass: str = "sie+shear",
    lens_light: str | None = "mge",
    source: str = "sersic",
    *,
    theta_E: float | None = None,
) -> LensSystem:
    """A starting `LensSystem` for `imaging`, built from profile names (`+` joins several:
    `"sie+shear"`; `"sersic+sersic"` a double Sersic, the second one three times wider
    with n = 1), with every starting value taken from the data: the lens centre and the
    lens light's ellipticity and size from `light_moments` (an `"mge"` lens light has
    `MGE_GAUSSIANS` Gaussians log-spaced in width from a pixel to the mask radius;
    `"mge+mge"` two such groups, the second starting round), the
    Einstein radius (unless given) as 0.4 of the mask radius, the source at the lens centre
    with a radius of a tenth of the Einstein radius, round profiles, no shear, Sersic
    indices 4 (lens) and 1 (source), unit amplitudes (solved linearly in fits). Raises
    `ValueError` for an unknown name."""
    mom = light_moments(imaging)
    te = 0.4 * mom.mask_radius if theta_E is None else float(theta_E)
    centre = {"center_x": mom.center_x, "center_y": mom.center_y}
    mass_starts = {
        **centre,
        "theta_E": te,
        "gamma": 2.0,
        "gamma1": 0.0,
        "gamma2": 0.0,
        "ra_0": mom.center_x,
        "dec_0": mom.center_y,
        "kappa": 0.0,
        "Rs": 10 * te,
        "alpha_Rs": te,
    }
    lens_starts = {
        **centre,
        "e1": float(np.clip(mom.e1, -0.3, 0.3)),
        "e2": float(np.clip(mom.e2, -0.3, 0.3)),
        "amp": 1.0,
        "R_sersic": mom.r_half,
        "n_sersic": 4.0,
        "sigma": mom.r_half,
        "Rb": 0.1 * mom.r_half,
        "gamma": 0.5,
    }
    src_size = 0.1 * te
    src_starts = {
        "center_x": mom.center_x + 0.02,
        "center_y": mom.center_y + 0.02,
        "amp": 1.0,
        "R_sersic": src_size,
        "n_sersic": 1.0,
        "sigma": src_size,
        "Rb": 0.1 * src_size,
        "gamma": 0.5,
        "beta": src_size,
    }

    def light(names: str, starts: dict, what: str, lens: bool) -> AbstractLightProfile:
        comps = []
        seen: dict[type, int] = {}
        for cls in _parse(names, LIGHT_NAMES, what):
            k = seen[cls] = seen.get(cls, -1) + 1
            if cls is MGE:
                if lens:  # the lens galaxy: from a pixel to the mask's edge
                    lo, hi = imaging.pixel_scale, max(mom.mask_radius, 2 * imaging.pixel_scale)
                else:
                    lo, hi = 0.05 * starts["sigma"], 3.0 * starts["sigma"]
                # a second group ("mge+mge", as PyAutoLens's two MGE bases) starts round,
                # its widths between the first group's (never two identical Gaussians):
                # the two follow an ellipticity that changes with radius
                step = (hi / lo) ** (1.0 / (MGE_GAUSSIANS - 1))
                sig = np.geomspace(lo, hi, MGE_GAUSSIANS) * step ** (0.5 * min(k, 1))
                comps.append(
                    MGE(
                        np.ones(MGE_GAUSSIANS),
                        sig,
                        e1=0.0 if k else starts.get("e1", 0.0),
                        e2=0.0 if k else starts.get("e2", 0.0),
                        center_x=starts["center_x"],
                        center_y=starts["center_y"],
                    )
                )
            elif cls is Shapelets:
                n_max = 6
                comps.append(
                    Shapelets(
                        np.ones((n_max + 1) * (n_max + 2) // 2),
                        n_max,
                        **{k: starts[k] for k in ("beta", "center_x", "center_y")},
                    )
                )
            elif k:
                # a second profile of a kind (a double Sersic: bulge + envelope) starts
                # larger and less concentrated, so the two are not degenerate
                wider = {**starts, "R_sersic": starts["R_sersic"] * 3.0**k, "n_sersic": 1.0}
                wider["sigma"] = starts["sigma"] * 3.0**k
                comps.append(_build(cls, wider))
            else:
                comps.append(_build(cls, starts))
        out = comps[0]
        for c in comps[1:]:
            out = out + c
        return out

    mass_comps: list[AbstractMassProfile] = [
        _build(cls, mass_starts) for cls in _parse(mass, MASS_NAMES, "mass")
    ]
    m = mass_comps[0]
    for c in mass_comps[1:]:
        m = m + c
    return LensSystem(
        mass=m,
        source=light(source, src_starts, "source", False),
        lens_light=None
        if lens_light is None
        else light(lens_light, lens_starts, "lens-light", True),
    )
