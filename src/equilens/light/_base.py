"""The light-profile interface and sums of profiles."""

import abc
import functools

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._custom_types import GridArray


class AbstractLightProfile(eqx.Module):
    """A surface-brightness distribution on the sky.

    `intensity(x, y)` is the surface brightness per arcsec^2 (in the user's flux unit, e.g.
    electrons/s/arcsec^2) at positions `x, y` in arcsec. Profiles add: `Sersic(...) +
    Gaussian(...)` is a `LightSum`.
    """

    @abc.abstractmethod
    def intensity(self, x: GridArray, y: GridArray) -> GridArray:
        """Surface brightness per arcsec^2 at `(x, y)`."""

    def __add__(self, other: "AbstractLightProfile") -> "LightSum":
        if not isinstance(other, AbstractLightProfile):
            return NotImplemented
        left = self.components if isinstance(self, LightSum) else (self,)
        right = other.components if isinstance(other, LightSum) else (other,)
        return LightSum(left + right)


class AbstractLinearLightProfile(AbstractLightProfile):
    """A light profile linear in its amplitudes: `I(x, y) = sum_k amp_k B_k(x, y)`.

    `basis(x, y)` returns the basis images `B_k` (shape `(n_basis, *grid)`); a linear solve
    (weighted least squares) can fill `amp` in from data instead of fitting it.
    """

    amp: eqx.AbstractVar[Float[Array, " n_basis"]]

    @abc.abstractmethod
    def basis(self, x: GridArray, y: GridArray) -> Float[Array, "n_basis *grid"]:
        """The basis functions (surface brightness per unit amplitude) at `(x, y)`."""

    def intensity(self, x: GridArray, y: GridArray) -> GridArray:
        return jnp.tensordot(self.amp, self.basis(x, y), axes=1)


class LightSum(AbstractLightProfile):
    """A sum of light profiles; built by `+`."""

    components: tuple[AbstractLightProfile, ...]

    def __check_init__(self):
        if len(self.components) == 0:
            raise ValueError("LightSum needs at least one component")

    def intensity(self, x: GridArray, y: GridArray) -> GridArray:
        return functools.reduce(jnp.add, [c.intensity(x, y) for c in self.components])
