"""`Subhalo`: a subhalo of a given mass confined to a square cell of the sky, the
perturber of a subhalo scan.

Its free parameters are `log10_mass` (log10 Msun) and `(u, v)`, the position inside the
cell in units of its half-width (`center = cell + half * (u, v)`, `-1 < u, v < 1`), so
the cell's bounds are the parameters' fixed bounds and every cell of a scan is the same
compiled fit with other values (the cell's centre and half-width are fixed fields, not
bounds). The profile follows from the mass and the lens's redshifts:

- `kind="tnfw"` (default): `log10_mass` is `M200` (the untruncated NFW's mass inside the
  radius of 200 times the critical density at the lens), the concentration is Duffy et al.
  (2008)'s relation (NFW, `M200`, full sample: `c = 5.71 (M200 / 2e12 h^-1 Msun)^-0.084
  (1 + z_lens)^-0.47`), and the truncation radius the Jacobi radius of a subhalo on the
  Einstein ring of a singular isothermal host, `r_t = (M200 theta_E / (2 Sigma_crit))^(1/3)`
  (`theta_E` the host's Einstein radius, arcsec; `Sigma_crit` in Msun / arcsec^2).
- `kind="pseudo_jaffe"`: Vegetti et al. (2010)'s perturber: `log10_mass` is the total
  mass, the truncation radius `r_t = sqrt(b theta_E)` with `b` the subhalo's own Einstein
  radius (the tidal radius of a subhalo on the host's Einstein ring), so that
  `M = pi Sigma_crit b r_t`, and a negligible core (`Ra = PSEUDO_JAFFE_CORE` arcsec).
"""

import math
from typing import Literal

import equinox as eqx
import jax.numpy as jnp

from .._checks import POSITIVE, Domain, describe
from .._custom_types import FloatScalar, GridArray, as_float
from ..cosmology import LensCosmology
from ..mass import TNFW, AbstractMassProfile, PseudoJaffe
from ..mass._base import Deflection, Hessian

#: The pseudo-Jaffe subhalo's core radius (arcsec): small against any pixel.
PSEUDO_JAFFE_CORE = 1e-3
#: The bounds of `Subhalo.log10_mass` (log10 Msun): the scan's log-uniform prior.
MASS_RANGE = (6.0, 11.0)

#: Where `log10_mass` is defined (log10 Msun: 1 Msun to 1e16 Msun) and where `u`, `v` are
#: (the cell, edges included).
_LOG10_MASS = Domain(0.0, 16.0)
_IN_CELL = Domain(-1.0, 1.0)

SubhaloKind = Literal["tnfw", "pseudo_jaffe"]
_KINDS = ("tnfw", "pseudo_jaffe")


def duffy_concentration(m200: float | FloatScalar, z: float, h: float) -> FloatScalar:
    """Duffy et al. (2008)'s concentration of an NFW halo of mass `m200` (Msun) at redshift
    `z` (their full sample, `M200` against the critical density), `h = H0 / 100`."""
    return 5.71 * (jnp.asarray(m200) / (2e12 / h)) ** -0.084 * (1.0 + z) ** -0.47


class Subhalo(AbstractMassProfile):
    """A subhalo of mass `10**log10_mass` Msun confined to the square cell of centre
    `(cell_x, cell_y)` and half-width `half` (arcsec): its centre is `(cell_x + half u,
    cell_y + half v)`. See the module docstring for the profiles (`kind`), the mass's
    meaning and the truncation radius, which uses `host_theta_E` (arcsec) and the
    redshifts and distances of `cosmology` (a `LensCosmology`).

    Free in fits: `log10_mass` (bounds `MASS_RANGE`; defined on [0, 16]), `u`, `v` (bounds
    and domain (-1, 1)); the rest is held. `profile()` is the `TNFW` or `PseudoJaffe` it
    stands for; `center` its centre. The Numba backend evaluates it through that
    profile's kernel.
    """

    log10_mass: FloatScalar = eqx.field(
        converter=as_float, metadata=describe(domain=_LOG10_MASS, bounds=MASS_RANGE)
    )
    u: FloatScalar = eqx.field(
        converter=as_float, default=0.0, metadata=describe(domain=_IN_CELL, bounds=(-1.0, 1.0))
    )
    v: FloatScalar = eqx.field(
        converter=as_float, default=0.0, metadata=describe(domain=_IN_CELL, bounds=(-1.0, 1.0))
    )
    cell_x: FloatScalar = eqx.field(converter=as_float, default=0.0, metadata=describe(fixed=True))
    cell_y: FloatScalar = eqx.field(converter=as_float, default=0.0, metadata=describe(fixed=True))
    half: FloatScalar = eqx.field(
        converter=as_float, default=0.5, metadata=describe(domain=POSITIVE, fixed=True)
    )
    host_theta_E: FloatScalar = eqx.field(
        converter=as_float, default=1.0, metadata=describe(domain=POSITIVE, fixed=True)
    )
    cosmology: LensCosmology = eqx.field(default=None)  # pyright: ignore[reportAssignmentType]
    kind: str = eqx.field(static=True, default="tnfw")

    def __check_init__(self):
        if self.kind not in _KINDS:
            raise ValueError(f"Subhalo.kind must be one of {_KINDS}, got {self.kind!r}")
        if not isinstance(self.cosmology, LensCosmology):
            raise TypeError(
                "Subhalo needs cosmology=LensCosmology(z_lens, z_source): its mass sets its "
                "profile through the lens's distances"
            )

    @property
    def center(self) -> tuple[FloatScalar | float, FloatScalar | float]:
        """The subhalo's centre (arcsec; NumPy scalars where the Numba backend has set
        the fields)."""
        return self.cell_x + self.half * self.u, self.cell_y + self.half * self.v

    def profile(self) -> TNFW | PseudoJaffe:
        """The `TNFW` or `PseudoJaffe` of this mass at this centre (traceable)."""
        lc = self.cosmology
        m = 10.0**self.log10_mass
        x, y = self.center
        if self.kind == "tnfw":
            c = duffy_concentration(m, lc.z_lens, lc.h)
            rs, alpha_rs = lc.nfw_angles(m, c)
            r_t = (m * self.host_theta_E / (2.0 * lc.sigma_crit)) ** (1.0 / 3.0)
            return TNFW(Rs=rs, alpha_Rs=alpha_rs, r_trunc=r_t, center_x=x, center_y=y)
        b = (m / (math.pi * lc.sigma_crit * jnp.sqrt(self.host_theta_E))) ** (2.0 / 3.0)
        r_t = jnp.sqrt(b * self.host_theta_E)
        sigma0 = m / (2.0 * math.pi * PSEUDO_JAFFE_CORE * r_t * lc.sigma_crit)
        return PseudoJaffe(sigma0=sigma0, Ra=PSEUDO_JAFFE_CORE, Rs=r_t, center_x=x, center_y=y)

    def mass_within(self, radius_kpc: float = 1.0) -> float:
        """The projected mass (Msun) inside `radius_kpc` physical kpc of its centre."""
        lc = self.cosmology
        return lc.mass_within(self.profile(), radius_kpc / lc.kpc_per_arcsec())

    def deflection(self, x: GridArray, y: GridArray) -> Deflection:
        return self.profile().deflection(x, y)

    def potential(self, x: GridArray, y: GridArray) -> GridArray:
        return self.profile().potential(x, y)

    def convergence(self, x: GridArray, y: GridArray) -> GridArray:
        return self.profile().convergence(x, y)

    def hessian(self, x: GridArray, y: GridArray) -> Hessian:
        return self.profile().hessian(x, y)
