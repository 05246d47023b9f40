"""Point mass, external shear, convergence sheet and multipoles (lenstronomy conventions)."""

import math

import equinox as eqx
import jax.numpy as jnp

from .._checks import NON_NEGATIVE, POSITIVE, describe
from .._custom_types import FloatScalar, GridArray, as_float
from .._math import inv_sqrt_or_zero, safe_sqrt
from ._base import AbstractMassProfile, Deflection, Hessian


class PointMass(AbstractMassProfile):
    """Point mass (lenstronomy `POINT_MASS`): `psi = theta_E^2 ln r`,
    `alpha = theta_E^2 (x, y) / r^2`, `kappa = 0` away from the centre.

    **Arguments:** `theta_E` (Einstein radius, arcsec), `center_x`, `center_y` (arcsec).
    At the exact centre the deflection is set to 0 (finite gradients).
    """

    theta_E: FloatScalar = eqx.field(
        converter=as_float, metadata=describe(domain=NON_NEGATIVE, bounds=(0.0, math.inf))
    )
    center_x: FloatScalar = eqx.field(converter=as_float, default=0.0)
    center_y: FloatScalar = eqx.field(converter=as_float, default=0.0)

    def deflection(self, x: GridArray, y: GridArray) -> Deflection:
        dx, dy = x - self.center_x, y - self.center_y
        inv_r = inv_sqrt_or_zero(dx * dx + dy * dy)
        k = self.theta_E * self.theta_E * inv_r * inv_r
        return k * dx, k * dy

    def potential(self, x: GridArray, y: GridArray) -> GridArray:
        dx, dy = x - self.center_x, y - self.center_y
        r2 = jnp.maximum(dx * dx + dy * dy, jnp.finfo(jnp.result_type(dx)).tiny)
        return 0.5 * self.theta_E * self.theta_E * jnp.log(r2)

    def convergence(self, x: GridArray, y: GridArray) -> GridArray:
        return jnp.zeros_like(x - self.center_x)


class ExternalShear(AbstractMassProfile):
    """External shear (lenstronomy `SHEAR`): `psi = (gamma1 (x^2 - y^2) + 2 gamma2 x y) / 2`
    about `(ra_0, dec_0)`. Shear strength `sqrt(gamma1^2 + gamma2^2)`, angle
    `atan2(gamma2, gamma1) / 2`.

    **Arguments:** `gamma1`, `gamma2` (dimensionless), `ra_0`, `dec_0` (arcsec, expansion
    point; it changes only the potential's constant and the deflection's constant offset).
    """

    gamma1: FloatScalar = eqx.field(converter=as_float, metadata=describe(bounds=(-0.5, 0.5)))
    gamma2: FloatScalar = eqx.field(converter=as_float, metadata=describe(bounds=(-0.5, 0.5)))
    ra_0: FloatScalar = eqx.field(converter=as_float, default=0.0, metadata=describe(fixed=True))
    dec_0: FloatScalar = eqx.field(converter=as_float, default=0.0, metadata=describe(fixed=True))

    def deflection(self, x: GridArray, y: GridArray) -> Deflection:
        dx, dy = x - self.ra_0, y - self.dec_0
        return self.gamma1 * dx + self.gamma2 * dy, self.gamma2 * dx - self.gamma1 * dy

    def potential(self, x: GridArray, y: GridArray) -> GridArray:
        dx, dy = x - self.ra_0, y - self.dec_0
        return 0.5 * (self.gamma1 * (dx * dx - dy * dy) + 2 * self.gamma2 * dx * dy)

    def hessian(self, x: GridArray, y: GridArray) -> Hessian:
        one = jnp.ones_like(x - self.ra_0)
        return self.gamma1 * one, self.gamma2 * one, self.gamma2 * one, -self.gamma1 * one

    def convergence(self, x: GridArray, y: GridArray) -> GridArray:
        return jnp.zeros_like(x - self.ra_0)


class ConvergenceSheet(AbstractMassProfile):
    """Uniform mass sheet (lenstronomy `CONVERGENCE`): `psi = kappa r^2 / 2` about
    `(ra_0, dec_0)`, `alpha = kappa (x, y)`.

    **Arguments:** `kappa` (dimensionless), `ra_0`, `dec_0` (arcsec).
    """

    kappa: FloatScalar = eqx.field(converter=as_float)
    ra_0: FloatScalar = eqx.field(converter=as_float, default=0.0, metadata=describe(fixed=True))
    dec_0: FloatScalar = eqx.field(converter=as_float, default=0.0, metadata=describe(fixed=True))

    def deflection(self, x: GridArray, y: GridArray) -> Deflection:
        return self.kappa * (x - self.ra_0), self.kappa * (y - self.dec_0)

    def potential(self, x: GridArray, y: GridArray) -> GridArray:
        dx, dy = x - self.ra_0, y - self.dec_0
        return 0.5 * self.kappa * (dx * dx + dy * dy)

    def convergence(self, x: GridArray, y: GridArray) -> GridArray:
        return self.kappa * jnp.ones_like(x - self.ra_0)


class Multipole(AbstractMassProfile):
    """Circular multipole of order `m` (lenstronomy `MULTIPOLE`; Xu et al. 2013, App. B3).

    For `m >= 2`: `psi = a_m r / (1 - m^2) cos(m (phi - phi_m))`,
    `kappa = a_m cos(m (phi - phi_m)) / (2 r)`.
    For `m = 1`: `psi = a_m / 2 r ln(r / r_E) cos(phi - phi_m)`.

    **Arguments:** `m` (static integer >= 1), `a_m` (strength, dimensionless), `phi_m`
    (orientation, radians CCW from +x), `center_x`, `center_y` (arcsec), `r_E` (arcsec,
    only used for m = 1; default 1).
    """

    m: int = eqx.field(static=True)
    a_m: FloatScalar = eqx.field(converter=as_float)
    phi_m: FloatScalar = eqx.field(converter=as_float, default=0.0)
    center_x: FloatScalar = eqx.field(converter=as_float, default=0.0)
    center_y: FloatScalar = eqx.field(converter=as_float, default=0.0)
    r_E: FloatScalar = eqx.field(
        converter=as_float,
        default=1.0,
        metadata=describe(domain=POSITIVE, bounds=(0.0, math.inf), fixed=True),
    )

    def __check_init__(self):
        if not isinstance(self.m, int) or self.m < 1:
            raise ValueError(f"Multipole.m must be an integer >= 1, got {self.m!r}")

    def _polar(self, x: GridArray, y: GridArray):
        dx, dy = x - self.center_x, y - self.center_y
        r2 = dx * dx + dy * dy
        inv_r = inv_sqrt_or_zero(r2)
        cos1 = jnp.where(r2 > 0, dx * inv_r, 1.0)
        sin1 = dy * inv_r
        # cos(m phi), sin(m phi) by repeated complex multiplication (no atan2 at r = 0)
        cm, sm = cos1, sin1
        for _ in range(self.m - 1):
            cm, sm = cm * cos1 - sm * sin1, cm * sin1 + sm * cos1
        cpm, spm = jnp.cos(self.m * self.phi_m), jnp.sin(self.m * self.phi_m)
        cos_m = cm * cpm + sm * spm  # cos(m (phi - phi_m))
        sin_m = sm * cpm - cm * spm  # sin(m (phi - phi_m))
        return safe_sqrt(r2), inv_r, cos1, sin1, cos_m, sin_m

    def deflection(self, x: GridArray, y: GridArray) -> Deflection:
        r, _, c1, s1, cos_m, sin_m = self._polar(x, y)
        m = self.m
        if m == 1:
            log_r = jnp.log(jnp.maximum(r, 1e-6) / self.r_E)
            ax = self.a_m / 2 * (jnp.cos(self.phi_m) * log_r + cos_m * c1)
            ay = self.a_m / 2 * (jnp.sin(self.phi_m) * log_r + cos_m * s1)
            return ax, ay
        k = self.a_m / (1 - m * m)
        return k * (c1 * cos_m + m * s1 * sin_m), k * (s1 * cos_m - m * c1 * sin_m)

    def potential(self, x: GridArray, y: GridArray) -> GridArray:
        r, _, _, _, cos_m, _ = self._polar(x, y)
        if self.m == 1:
            log_r = jnp.log(jnp.maximum(r, 1e-6) / self.r_E)
            return self.a_m / 2 * r * log_r * cos_m
        return self.a_m / (1 - self.m**2) * r * cos_m

    def convergence(self, x: GridArray, y: GridArray) -> GridArray:
        _, inv_r, _, _, cos_m, _ = self._polar(x, y)
        if self.m == 1:
            return self.a_m / 2 * inv_r * cos_m
        return 0.5 * self.a_m * inv_r * cos_m
