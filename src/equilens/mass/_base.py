"""The mass-profile interface, sums of profiles and batches of identical profiles."""

import abc
import functools

import equinox as eqx
import jax
import jax.numpy as jnp

from .._checks import check_fields
from .._custom_types import GridArray

Deflection = tuple[GridArray, GridArray]
Hessian = tuple[GridArray, GridArray, GridArray, GridArray]


class AbstractMassProfile(eqx.Module):
    """A lensing mass distribution on the sky (thin lens, angles in arcsec).

    Subclasses give the deflection `alpha = grad psi` and the lensing potential `psi`
    (arcsec^2). The convergence `kappa = (psi_xx + psi_yy) / 2` and the Hessian are derived
    here by forward-mode differentiation of the deflection; a subclass may replace them by
    analytic forms.

    All methods take coordinates `x`, `y` (arcsec) of any common shape and return arrays of
    that shape. Profiles add: `SIE(...) + ExternalShear(...)` is a `MassSum`.

    Each parameter is described next to its field, `eqx.field(metadata=equilens.describe(...))` (its
    `domain`, checked when the profile is built with the other floating fields required
    finite and an `(e1, e2)` inside the unit disk; its default fit `bounds`; whether a fit
    holds it `fixed`): see `equilens._checks`.
    """

    def __check_init__(self):
        check_fields(self)

    @abc.abstractmethod
    def deflection(self, x: GridArray, y: GridArray) -> Deflection:
        """Deflection angle `(alpha_x, alpha_y)` in arcsec at `(x, y)`."""

    @abc.abstractmethod
    def potential(self, x: GridArray, y: GridArray) -> GridArray:
        """Lensing potential `psi` in arcsec^2 at `(x, y)`."""

    def hessian(self, x: GridArray, y: GridArray) -> Hessian:
        """`(psi_xx, psi_xy, psi_yx, psi_yy)`, from forward-mode derivatives of the deflection."""
        one, zero = jnp.ones_like(x), jnp.zeros_like(x)
        _, (f_xx, f_yx) = jax.jvp(self.deflection, (x, y), (one, zero))
        _, (f_xy, f_yy) = jax.jvp(self.deflection, (x, y), (zero, one))
        return f_xx, f_xy, f_yx, f_yy

    def convergence(self, x: GridArray, y: GridArray) -> GridArray:
        """Convergence `kappa` (dimensionless surface density in units of the critical one)."""
        f_xx, _, _, f_yy = self.hessian(x, y)
        return 0.5 * (f_xx + f_yy)

    def shear(self, x: GridArray, y: GridArray) -> tuple[GridArray, GridArray]:
        """Shear components `(gamma1, gamma2) = ((psi_xx - psi_yy)/2, psi_xy)`."""
        f_xx, f_xy, _, f_yy = self.hessian(x, y)
        return 0.5 * (f_xx - f_yy), f_xy

    def ray_shoot(self, x: GridArray, y: GridArray) -> Deflection:
        """Source-plane position `beta = theta - alpha(theta)` in arcsec."""
        ax, ay = self.deflection(x, y)
        return x - ax, y - ay

    def jacobian_determinant(self, x: GridArray, y: GridArray) -> GridArray:
        """`det A` with `A = d(beta)/d(theta)`; zero on the critical curves."""
        f_xx, f_xy, f_yx, f_yy = self.hessian(x, y)
        return (1 - f_xx) * (1 - f_yy) - f_xy * f_yx

    def magnification(self, x: GridArray, y: GridArray) -> GridArray:
        """Signed magnification `mu = 1 / det A` (infinite on the critical curves)."""
        return 1 / self.jacobian_determinant(x, y)

    def __add__(self, other: "AbstractMassProfile") -> "MassSum":
        if not isinstance(other, AbstractMassProfile):
            return NotImplemented
        left = self.components if isinstance(self, MassSum) else (self,)
        right = other.components if isinstance(other, MassSum) else (other,)
        return MassSum(left + right)


class MassSum(AbstractMassProfile):
    """A sum of mass profiles (the deflections, potentials and convergences add).

    Built by `+`: `SIE(...) + ExternalShear(...)`. `components` is a tuple of profiles,
    and `jax.grad` of anything computed from the sum has the same structure.
    """

    components: tuple[AbstractMassProfile, ...]

    def __check_init__(self):
        if len(self.components) == 0:
            raise ValueError("MassSum needs at least one component")

    def _sum(self, method: str, x: GridArray, y: GridArray):
        parts = [getattr(c, method)(x, y) for c in self.components]
        return functools.reduce(lambda a, b: jax.tree.map(jnp.add, a, b), parts)

    def deflection(self, x: GridArray, y: GridArray) -> Deflection:
        return self._sum("deflection", x, y)

    def potential(self, x: GridArray, y: GridArray) -> GridArray:
        return self._sum("potential", x, y)

    def convergence(self, x: GridArray, y: GridArray) -> GridArray:
        return self._sum("convergence", x, y)

    def hessian(self, x: GridArray, y: GridArray) -> Hessian:
        return self._sum("hessian", x, y)


class MassBatch(AbstractMassProfile):
    """Many profiles of one class, stored with a leading batch axis and summed.

    Useful for populations of identical components (subhaloes): one module whose array
    fields have shape `(n,)`, evaluated with `eqx.filter_vmap` (one compiled body for all).
    Build it with `MassBatch.stack([NFW(...), NFW(...), ...])`.
    """

    profiles: AbstractMassProfile

    @classmethod
    def stack(cls, profiles: list[AbstractMassProfile]) -> "MassBatch":
        """Stacks profiles of the same class (and the same static fields) along a new axis."""
        if len(profiles) == 0:
            raise ValueError("MassBatch.stack needs at least one profile")
        kinds = {type(p) for p in profiles}
        if len(kinds) != 1:
            raise ValueError(f"MassBatch.stack needs profiles of one class, got {kinds}")
        arrays = [eqx.filter(p, eqx.is_array) for p in profiles]
        static = eqx.filter(profiles[0], eqx.is_array, inverse=True)
        stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *arrays)
        return cls(eqx.combine(stacked, static))

    def _sum(self, fn, x: GridArray, y: GridArray):
        out = eqx.filter_vmap(fn, in_axes=(eqx.if_array(0), None, None))(self.profiles, x, y)
        return jax.tree.map(lambda a: a.sum(axis=0), out)

    def deflection(self, x: GridArray, y: GridArray) -> Deflection:
        return self._sum(lambda p, x, y: p.deflection(x, y), x, y)

    def potential(self, x: GridArray, y: GridArray) -> GridArray:
        return self._sum(lambda p, x, y: p.potential(x, y), x, y)

    def convergence(self, x: GridArray, y: GridArray) -> GridArray:
        return self._sum(lambda p, x, y: p.convergence(x, y), x, y)

    def hessian(self, x: GridArray, y: GridArray) -> Hessian:
        return self._sum(lambda p, x, y: p.hessian(x, y), x, y)
