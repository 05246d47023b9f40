"""Halo populations: realisations of subhalos and line-of-sight halos drawn with pyHalo
(Gilman et al. 2020; PyPI `pyhalo`, the extra `substructure`) as an equilens `MultiPlane`.

`population(z_lens, z_source, dark_matter="CDM", seed=..., macro=...)` draws one realisation
and returns it, with the macro model at the lens redshift, as a `MultiPlane` in pyHalo's own
cosmology; `from_pyhalo(realization, macro=...)` converts one drawn by the user. The halos
keep pyHalo's lenstronomy parametrisation (`TNFW`: `Rs`, `alpha_Rs`, `r_trunc`, arcsec), and
pyHalo's negative convergence sheets, one per plane, take away the mean mass the halos add
(without them a population rescales the macro model's Einstein radius).
"""

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .mass import (
    EPL,
    NFW,
    SIE,
    SIS,
    TNFW,
    AbstractMassProfile,
    ConvergenceSheet,
    ExternalShear,
    MultiPlane,
    PointMass,
    PseudoJaffe,
)

#: lenstronomy's names of the profiles equilens shares with it (keyword arguments verbatim).
LENSTRONOMY_MASS: dict[str, type[AbstractMassProfile]] = {
    "SIS": SIS,
    "SIE": SIE,
    "EPL": EPL,
    "NFW": NFW,
    "TNFW": TNFW,
    "PJAFFE": PseudoJaffe,
    "POINT_MASS": PointMass,
    "SHEAR": ExternalShear,
    "CONVERGENCE": ConvergenceSheet,
}

_MODELS = ("CDM", "WDM")


def from_lenstronomy(
    names: Sequence[str], kwargs: Sequence[Mapping[str, Any]]
) -> list[AbstractMassProfile]:
    """Mass profiles from lenstronomy's model names and keyword arguments (the profiles of
    `LENSTRONOMY_MASS`; a `ValueError` names any other)."""
    out = []
    for name, kw in zip(names, kwargs, strict=True):
        cls = LENSTRONOMY_MASS.get(name)
        if cls is None:
            raise ValueError(
                f"lenstronomy profile {name!r} has no equilens counterpart "
                f"(known: {sorted(LENSTRONOMY_MASS)})"
            )
        out.append(cls(**{k: float(v) for k, v in kw.items()}))
    return out


def from_pyhalo(
    realization: Any,
    macro: AbstractMassProfile | None = None,
    z_source: float | None = None,
    mass_sheets: bool = True,
) -> MultiPlane:
    """A pyHalo `Realization` (with `macro`, the main lens, at the realisation's lens
    redshift, if given) as a `MultiPlane` in the realisation's cosmology.

    `z_source` defaults to the realisation's; `mass_sheets=False` leaves out pyHalo's
    negative convergence sheets (the mean mass of the halos then stays in)."""
    names, redshifts, kwargs, interp = realization.lensing_quantities(
        add_mass_sheet_correction=mass_sheets
    )
    if interp is not None:
        raise ValueError(
            "the realisation has numerically tabulated profiles, which equilens cannot "
            "evaluate (draw it with halo_mass_profile='TNFW' or 'NFW')"
        )
    geometry = realization.lens_cosmo
    z_lens = float(geometry.z_lens)
    z_source = float(geometry.z_source if z_source is None else z_source)
    components = from_lenstronomy(list(names), list(kwargs))
    zs = [float(z) for z in np.asarray(redshifts, float)]
    if macro is not None:
        components.insert(0, macro)
        zs.insert(0, z_lens)
    return MultiPlane(components, zs, z_source, geometry.cosmo.astropy)


def population(
    z_lens: float,
    z_source: float,
    dark_matter: str = "CDM",
    *,
    seed: int | None = None,
    macro: AbstractMassProfile | None = None,
    mass_sheets: bool = True,
    **pyhalo_kwargs: Any,
) -> MultiPlane:
    """One realisation of subhalos and line-of-sight halos drawn by pyHalo's preset
    `dark_matter` model (`"CDM"`, or `"WDM"` with its `log_mc`, the log10 half-mode mass in
    Msun), as a `MultiPlane` with `macro` at `z_lens` (see `from_pyhalo`).

    `seed` makes the draw reproducible (pyHalo draws from NumPy's global generator, whose
    state is restored afterwards); `pyhalo_kwargs` go to the preset (e.g. `sigma_sub`, the
    subhalo mass function's normalisation in kpc^-2; `log_mlow`, `log_mhigh`, the mass range
    in log10 Msun; `cone_opening_angle_arcsec`; `LOS_normalization`)."""
    if dark_matter not in _MODELS:
        raise ValueError(f"dark_matter must be one of {_MODELS}, got {dark_matter!r}")
    if not 0.0 < z_lens < z_source:
        raise ValueError(f"need 0 < z_lens < z_source, got {z_lens} and {z_source}")
    if dark_matter == "WDM" and "log_mc" not in pyhalo_kwargs:
        raise ValueError("the WDM model needs log_mc (log10 of the half-mode mass in Msun)")
    try:
        if dark_matter == "CDM":
            from pyHalo.PresetModels.cdm import CDM as preset
        else:
            from pyHalo.PresetModels.wdm import WDM as preset
    except ImportError as e:
        raise ImportError(
            "halo populations need pyHalo: pip install 'equilens[substructure]'"
        ) from e
    # (pyHalo draws from NumPy's global generator)
    state = np.random.get_state()  # noqa: NPY002
    try:
        with warnings.catch_warnings():
            # (pyHalo 1.4.6 calls astropy's deprecated angular_diameter_distance_z1z2)
            warnings.filterwarnings("ignore", message=r".*angular_diameter_distance\(z1, z2\)")
            if seed is not None:
                np.random.seed(seed)  # noqa: NPY002
            realization = preset(z_lens, z_source, **pyhalo_kwargs)
            # (inside the seeded block: pyHalo draws some halo properties, e.g. infall
            # redshifts and truncations, only when their lensing parameters are first read)
            return from_pyhalo(realization, macro, mass_sheets=mass_sheets)
    finally:
        np.random.set_state(state)  # noqa: NPY002
