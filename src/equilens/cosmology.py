"""Physical units for a lens: halo masses to profile parameters and back, masses within
apertures.

`LensCosmology(z_lens, z_source, cosmology=None)` (an astropy cosmology, Planck18 by
default) holds the angular-diameter distances `D_d`, `D_s`, `D_ds` (Mpc) and the critical
surface density `Sigma_crit = c^2 D_s / (4 pi G D_d D_ds)`. Conventions: angles in arcsec,
masses in Msun (physical, no little h), lengths in physical kpc unless said; `M200` is
the mass inside the radius `r200` within which the mean density is 200 times the critical
density at the lens redshift, `c = r200 / Rs`, as in lenstronomy's `LensCosmo`.
"""

import math
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import scipy.optimize
from astropy import units

# (astropy makes its constants at run time: pyright cannot see them)
from astropy.constants import (
    G as GRAVITATIONAL_CONSTANT,  # pyright: ignore
    c as SPEED_OF_LIGHT,  # pyright: ignore
)

from ._checks import is_traced
from .mass import NFW, TNFW, AbstractMassProfile, PseudoJaffe
from .mass._multiplane import angular_diameter_distance

_ARCSEC = math.pi / (180.0 * 3600.0)  # radians
_LN_HALF_PLUS_ONE = 1.0 + math.log(0.5)


def _mu(c: float) -> float:
    """`ln(1 + c) - c / (1 + c)`: the NFW mass inside `c Rs` over `4 pi rho0 Rs^3`."""
    return math.log1p(c) - c / (1.0 + c)


class LensCosmology(eqx.Module):
    """Distances and critical density for a lens at `z_lens` and a source at `z_source`
    (`cosmology`: an astropy cosmology, default `astropy.cosmology.Planck18`). See the
    module docstring for units and conventions.

    - `nfw(m200, c)`, `tnfw(m200, c, r_trunc_kpc)`: the profiles of a halo of mass `m200`
      (Msun) and concentration `c` (`TNFW`: truncated at `r_trunc_kpc`, physical kpc);
      `nfw_mass(profile)`: `(m200, c)` of an `NFW` or `TNFW`'s parameters (the inverse);
      `nfw_angles(m200, c)`: the `(Rs, alpha_Rs)` those profiles take (traceable);
    - `pseudo_jaffe(mass, Ra, Rs)`: the `PseudoJaffe` of total mass `mass` (Msun) with radii
      `Ra`, `Rs` (arcsec); `mass_within(profile, radius)`: any profile's projected mass (Msun)
      inside a circle of `radius` arcsec about `center` (default the profile's centre).

    `h` is the cosmology's `H0 / (100 km/s/Mpc)` (for relations quoted in `Msun / h`).
    """

    z_lens: float = eqx.field(static=True)
    z_source: float = eqx.field(static=True)
    d_d: float = eqx.field(static=True)
    d_s: float = eqx.field(static=True)
    d_ds: float = eqx.field(static=True)
    rho_crit: float = eqx.field(static=True)
    sigma_crit: float = eqx.field(static=True)
    h: float = eqx.field(static=True)

    def __init__(self, z_lens: float, z_source: float, cosmology: Any = None):
        if not 0.0 < float(z_lens) < float(z_source):
            raise ValueError(
                f"LensCosmology needs 0 < z_lens < z_source, got z_lens={z_lens}, "
                f"z_source={z_source}"
            )
        if cosmology is None:
            from astropy.cosmology import Planck18 as cosmology
        self.z_lens, self.z_source = float(z_lens), float(z_source)
        self.d_d = float(cosmology.angular_diameter_distance(z_lens).to_value(units.Mpc))
        self.d_s = float(cosmology.angular_diameter_distance(z_source).to_value(units.Mpc))
        self.d_ds = angular_diameter_distance(cosmology, self.z_lens, self.z_source)
        rho = cosmology.critical_density(z_lens).to(units.Msun / units.Mpc**3)
        self.rho_crit = float(rho.value)
        self.h = float(cosmology.H0.to_value(units.km / units.s / units.Mpc)) / 100.0
        # c^2 / (4 pi G) in Msun / Mpc, times D_s / (D_d D_ds): Msun / Mpc^2, then per
        # arcsec^2 at the lens
        factor = SPEED_OF_LIGHT**2 / (4 * math.pi * GRAVITATIONAL_CONSTANT)
        factor = factor.to(units.Msun / units.Mpc)
        per_mpc2 = float(factor.value) * self.d_s / (self.d_d * self.d_ds)
        self.sigma_crit = per_mpc2 * (self.d_d * _ARCSEC) ** 2

    def kpc_per_arcsec(self) -> float:
        """Physical kpc per arcsec at the lens."""
        return 1e3 * self.d_d * _ARCSEC

    def nfw_angles(self, m200: Any, c: Any) -> tuple[Any, Any]:
        """`(Rs, alpha_Rs)` (arcsec) of the NFW of mass `m200` (Msun) and concentration `c`;
        traceable (arrays in, arrays out: what a fit that varies the mass differentiates)."""
        if not is_traced(m200) and not is_traced(c):
            if not (float(m200) > 0 and float(c) > 0):
                raise ValueError(f"m200 and c must be > 0, got m200={m200}, c={c}")
        r200 = (3.0 * m200 / (800.0 * math.pi * self.rho_crit)) ** (1.0 / 3.0)
        rs = r200 / c  # Mpc
        mu = jnp.log1p(c) - c / (1.0 + c)
        rho0 = 200.0 / 3.0 * self.rho_crit * c**3 / mu  # Msun / Mpc^3
        # the deflection at Rs of the NFW: 4 rho0 Rs^2 (1 + ln 1/2) / Sigma_crit, in Mpc at
        # the lens, over D_d
        sigma_crit_mpc = self.sigma_crit / (self.d_d * _ARCSEC) ** 2
        alpha = 4.0 * rho0 * rs**2 * _LN_HALF_PLUS_ONE / sigma_crit_mpc / self.d_d
        return rs / self.d_d / _ARCSEC, alpha / _ARCSEC

    def nfw(self, m200: float, c: float, center_x: float = 0.0, center_y: float = 0.0) -> NFW:
        """The `NFW` of a halo of mass `m200` (Msun) and concentration `c`."""
        rs, alpha_rs = (float(v) for v in self.nfw_angles(float(m200), float(c)))
        return NFW(Rs=rs, alpha_Rs=alpha_rs, center_x=center_x, center_y=center_y)

    def tnfw(
        self,
        m200: float,
        c: float,
        r_trunc_kpc: float,
        center_x: float = 0.0,
        center_y: float = 0.0,
    ) -> TNFW:
        """The `TNFW` of a halo of mass `m200` (Msun, of the untruncated NFW) and
        concentration `c`, truncated at `r_trunc_kpc` (physical kpc)."""
        if not float(r_trunc_kpc) > 0:
            raise ValueError(f"r_trunc_kpc must be > 0, got {r_trunc_kpc}")
        rs, alpha_rs = (float(v) for v in self.nfw_angles(float(m200), float(c)))
        r_trunc = float(r_trunc_kpc) / self.kpc_per_arcsec()
        return TNFW(Rs=rs, alpha_Rs=alpha_rs, r_trunc=r_trunc, center_x=center_x, center_y=center_y)

    def nfw_mass(self, profile: NFW | TNFW) -> tuple[float, float]:
        """`(m200, c)` (Msun, concentration) of the NFW whose parameters `profile` (an
        `NFW` or `TNFW`, the latter's untruncated NFW) has."""
        if not isinstance(profile, NFW | TNFW):
            raise TypeError(f"nfw_mass needs an NFW or TNFW, got {type(profile).__name__}")
        rs = float(profile.Rs) * _ARCSEC * self.d_d  # Mpc
        sigma_crit_mpc = self.sigma_crit / (self.d_d * _ARCSEC) ** 2
        alpha = float(profile.alpha_Rs) * _ARCSEC * self.d_d  # Mpc
        rho0 = alpha * sigma_crit_mpc / (4.0 * rs**2 * _LN_HALF_PLUS_ONE)
        if not rho0 > 0:
            raise ValueError("nfw_mass needs alpha_Rs > 0")
        # rho0 / rho_crit = (200 / 3) c^3 / mu(c): increasing in c
        target = rho0 / self.rho_crit

        def excess(log_c: float) -> float:
            c = math.exp(log_c)
            return math.log(200.0 / 3.0 * c**3 / _mu(c)) - math.log(target)

        root = scipy.optimize.brentq(excess, math.log(1e-3), math.log(1e4), xtol=1e-14)
        c = math.exp(float(root))  # pyright: ignore[reportArgumentType]
        r200 = c * rs
        return 800.0 / 3.0 * math.pi * self.rho_crit * r200**3, c

    def pseudo_jaffe(
        self, mass: float, Ra: float, Rs: float, center_x: float = 0.0, center_y: float = 0.0
    ) -> PseudoJaffe:
        """The `PseudoJaffe` of total mass `mass` (Msun) with radii `Ra`, `Rs` (arcsec): its
        total mass is `2 pi sigma0 Ra Rs Sigma_crit`."""
        sigma0 = float(mass) / (2.0 * math.pi * float(Ra) * float(Rs) * self.sigma_crit)
        return PseudoJaffe(sigma0=sigma0, Ra=Ra, Rs=Rs, center_x=center_x, center_y=center_y)

    def mass_within(
        self,
        profile: AbstractMassProfile,
        radius: float,
        center: tuple[float, float] | None = None,
        n: int = 1024,
    ) -> float:
        """The projected mass (Msun) of `profile` inside a circle of `radius` arcsec about
        `center` (default the profile's `(center_x, center_y)`, else the origin): by the
        divergence theorem, `Sigma_crit / 2` times the flux of the deflection through the
        circle (`div alpha = 2 kappa`), on `n` points (the trapezoid rule: spectrally
        accurate for a deflection smooth on the circle; a mass concentration on or very
        near it needs more points)."""
        if not float(radius) > 0:
            raise ValueError(f"radius must be > 0 arcsec, got {radius}")
        if center is None:
            center = (
                float(getattr(profile, "center_x", 0.0)),
                float(getattr(profile, "center_y", 0.0)),
            )
        phi = np.arange(n) * (2.0 * math.pi / n)
        nx, ny = np.cos(phi), np.sin(phi)
        x = jnp.asarray(center[0] + float(radius) * nx)
        y = jnp.asarray(center[1] + float(radius) * ny)
        ax, ay = (np.asarray(a, np.float64) for a in profile.deflection(x, y))
        flux = float(np.mean(ax * nx + ay * ny)) * 2.0 * math.pi * float(radius)
        return 0.5 * flux * self.sigma_crit

    def with_mass_within(
        self, profile: NFW | TNFW | PseudoJaffe, mass: float, radius: float
    ) -> NFW | TNFW | PseudoJaffe:
        """`profile` with its amplitude (`alpha_Rs` of an `NFW` or `TNFW`, `sigma0` of a
        `PseudoJaffe`; the deflection is linear in it) scaled so that its projected mass
        inside `radius` arcsec about its centre is `mass` (Msun): e.g. a subhalo of 1e9
        Msun within 1 kpc, `radius = 1 / kpc_per_arcsec()`. Its radii are kept."""
        fields = {NFW: "alpha_Rs", TNFW: "alpha_Rs", PseudoJaffe: "sigma0"}
        name = fields.get(type(profile))
        if name is None:
            raise TypeError(
                f"with_mass_within takes an NFW, TNFW or PseudoJaffe, got {type(profile).__name__}"
            )
        if not float(mass) > 0:
            raise ValueError(f"mass must be > 0 Msun, got {mass}")
        now = self.mass_within(profile, radius)
        if not now > 0:
            raise ValueError(f"the profile has no mass within {radius} arcsec to scale")
        scaled = float(getattr(profile, name)) * float(mass) / now
        return eqx.tree_at(lambda p: getattr(p, name), profile, jnp.asarray(scaled))
