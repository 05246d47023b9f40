"""`equilens demo`: the shipped HST image of SDSS J0946+1006 fitted as `equilens fit` fits."""

import os
from typing import Any

from ._data import _load
from ._fit import run_fit
from ._partial import Partial

DEMO_MASK_RADIUS = 3.0  # arcsec: the lens and the inner ring of SDSS J0946+1006
DEMO_SUPERSAMPLING = 2  # the source is compact (R ~ 0.1"): 2x2 sub-pixels per pixel


def demo_imaging(mask_radius: float = DEMO_MASK_RADIUS):
    """The demo's data: the shipped HST image of SDSS J0946+1006 with its noise map and
    PSF, 0.05" pixels, its mask of other galaxies, a circular mask (3" by default), 2x2
    supersampling."""
    from importlib.resources import files

    folder = files("equilens") / "_data" / "SDSSJ0946+1006"
    return _load(
        str(folder / "image.fits"),
        str(folder / "noise_map.fits"),
        str(folder / "psf.fits"),
        0.05,
        str(folder / "mask_extra_galaxies.fits"),
        mask_radius,
        DEMO_SUPERSAMPLING,
    )


def run_demo(output: str, solver: str = "lm", partial: Partial | None = None) -> dict[str, str]:
    """Fits the shipped HST image of SDSS J0946+1006; returns the output paths."""
    imaging = demo_imaging()
    out = run_fit(
        imaging,
        os.path.join(output, "demo.json"),
        "sie+shear",
        "mge",
        "sersic",
        solver,
        title="SDSS J0946+1006 (HST F814W): SIE + shear, MGE lens light, Sersic source",
        extra={
            "data": "SDSS J0946+1006, HST ACS F814W (see equilens/_data/SDSSJ0946+1006)",
            "published_theta_E": 1.38,
        },
        partial=partial,
    )
    return out


#: The subhalo demo's mask radius (arcsec): the inner ring (1.4") and its arcs, not the
#: outer ring of the second source (2.1"), which a one-source-plane model cannot fit (a
#: subhalo near it absorbs its residuals: false detections)
SUBHALO_MASK_RADIUS = 1.9
#: The Jackpot's redshifts (Bolton et al. 2008; Gavazzi et al. 2008).
JACKPOT_Z_LENS, JACKPOT_Z_SOURCE = 0.222, 0.609


def run_demo_subhalo(
    output: str, partial: Partial | None = None, client: Any = None
) -> dict[str, str]:
    """Scans the shipped HST image of SDSS J0946+1006 for a subhalo (`equilens subhalo`
    with a pixelized source and Vegetti et al. 2010's pseudo-Jaffe, 5x5 cells); writes
    `subhalo.json` and `subhalo.png` in `output`. With a Dask `client`, the cells run on
    its workers."""
    from ._subhalo import run_subhalo

    return run_subhalo(
        demo_imaging(SUBHALO_MASK_RADIUS),
        os.path.join(output, "subhalo.json"),
        JACKPOT_Z_LENS,
        JACKPOT_Z_SOURCE,
        source="pixelized",
        kind="pseudo_jaffe",
        grid=5,
        partial=partial,
        client=client,
        title="SDSS J0946+1006 (HST F814W): subhalo scan, pseudo-Jaffe, pixelized source",
        extra={
            "data": "SDSS J0946+1006, HST ACS F814W (see equilens/_data/SDSSJ0946+1006)",
            "published": {
                "reference": "Vegetti et al. 2010 (arXiv:0910.0760)",
                "center": [-0.651, 1.040],
                "center_error": [0.038, 0.034],
                "mass": 3.51e9,
                "mass_error": 0.15e9,
                "delta_log_evidence": 128.0,
            },
        },
    )
