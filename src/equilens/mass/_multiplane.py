"""Multi-plane lensing (Blandford & Narayan 1986; McCully et al. 2014), as lenstronomy's
`MultiPlane`: each component's parameters are those of a single-plane lens for the final
source (its reduced deflection `alpha_red`), and a ray is traced from the observer through
the planes in comoving transverse coordinates:

    x_i = x_{i-1} + a_{i-1} T(z_{i-1}, z_i),   a_i = a_{i-1} - (T_s / T_is) alpha_red_i(x_i / T_i),

from `x_0 = 0`, `a_0 = theta`, with `T(z1, z2)` the transverse comoving distance between
two redshifts (`T_i = T(0, z_i)`, `T_s = T(0, z_s)`, `T_is = T(z_i, z_s)`); the source
position is `beta = x_s / T_s`. `MultiPlane.deflection` is the effective deflection
`theta - beta`, so a `MultiPlane` is a mass profile like any other (images, fits,
pixelized sources). Work in progress (issue 49): a Python loop over planes, no potential.
"""

from collections.abc import Sequence
from typing import Any

import equinox as eqx

from .._custom_types import GridArray
from ._base import AbstractMassProfile, Deflection, MassSum


def _transverse(cosmology: Any, z1: float, z2: float) -> float:
    """`T(z1, z2)` in Mpc: `(1 + z2) D_A(z1, z2)` (any curvature)."""
    from astropy import units

    if z1 == 0.0:
        return float(cosmology.comoving_transverse_distance(z2).to_value(units.Mpc))
    try:  # (astropy >= 7)
        d = cosmology.angular_diameter_distance(z1, z2)
    except TypeError:
        d = cosmology.angular_diameter_distance_z1z2(z1, z2)
    return float((1.0 + z2) * d.to_value(units.Mpc))


class MultiPlane(AbstractMassProfile):
    """Mass components at several redshifts, traced plane by plane (module docstring).

    **Arguments:** `components` (mass profiles), `redshifts` (one per component; equal
    redshifts share a plane), `z_source` (above every plane), `cosmology` (astropy;
    `Planck18` by default).
    """

    planes: tuple[AbstractMassProfile, ...]
    plane_redshifts: tuple[float, ...] = eqx.field(static=True)
    z_source: float = eqx.field(static=True)
    steps: tuple[float, ...] = eqx.field(static=True)
    to_observer: tuple[float, ...] = eqx.field(static=True)
    factors: tuple[float, ...] = eqx.field(static=True)
    last_step: float = eqx.field(static=True)
    to_source: float = eqx.field(static=True)

    def __init__(
        self,
        components: Sequence[AbstractMassProfile],
        redshifts: Sequence[float],
        z_source: float,
        cosmology: Any = None,
    ):
        if len(components) == 0 or len(components) != len(redshifts):
            raise ValueError(
                f"MultiPlane needs one redshift per component, got {len(components)} "
                f"components and {len(redshifts)} redshifts"
            )
        zs = [float(z) for z in redshifts]
        if not all(0.0 < z < float(z_source) for z in zs):
            raise ValueError(f"every redshift must be in (0, z_source={z_source}), got {zs}")
        if cosmology is None:
            from astropy.cosmology import Planck18 as cosmology
        unique = sorted(set(zs))
        planes = []
        for z in unique:
            members = [c for c, zc in zip(components, zs, strict=True) if zc == z]
            planes.append(members[0] if len(members) == 1 else MassSum(tuple(members)))
        self.planes = tuple(planes)
        self.plane_redshifts = tuple(unique)
        self.z_source = float(z_source)
        t_s = _transverse(cosmology, 0.0, self.z_source)
        edges = [0.0, *unique]
        self.steps = tuple(
            _transverse(cosmology, a, b) for a, b in zip(edges, unique, strict=False)
        )
        self.to_observer = tuple(_transverse(cosmology, 0.0, z) for z in unique)
        self.factors = tuple(t_s / _transverse(cosmology, z, self.z_source) for z in unique)
        self.last_step = _transverse(cosmology, unique[-1], self.z_source)
        self.to_source = t_s

    def trace(self, x: GridArray, y: GridArray) -> tuple[GridArray, GridArray]:
        """The source-plane position `beta` (arcsec) of the rays seen at `(x, y)`."""
        px, py = 0.0 * x, 0.0 * y
        ax, ay = x, y
        for plane, dt, t_i, f in zip(
            self.planes, self.steps, self.to_observer, self.factors, strict=True
        ):
            px, py = px + ax * dt, py + ay * dt
            dx, dy = plane.deflection(px / t_i, py / t_i)
            ax, ay = ax - f * dx, ay - f * dy
        px, py = px + ax * self.last_step, py + ay * self.last_step
        return px / self.to_source, py / self.to_source

    def deflection(self, x: GridArray, y: GridArray) -> Deflection:
        bx, by = self.trace(x, y)
        return x - bx, y - by

    def potential(self, x: GridArray, y: GridArray) -> GridArray:
        raise NotImplementedError(
            "a multi-plane lens has no single lensing potential (its deflection is not a "
            "gradient in general)"
        )
