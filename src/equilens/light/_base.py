"""The light-profile interface and sums of profiles."""

import abc
import functools

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from .._checks import check_fields, describe
from .._custom_types import GridArray


class AbstractLightProfile(eqx.Module):
    """A surface-brightness distribution on the sky.

    `intensity(x, y)` is the surface brightness per arcsec^2 (in the user's flux unit, e.g.
    electrons/s/arcsec^2) at positions `x, y` in arcsec. Profiles add: `Sersic(...) +
    Gaussian(...)` is a `LightSum`.

    Each parameter is described next to its field, `eqx.field(metadata=equilens.describe(...))` (its
    `domain`, checked when the profile is built; its default fit `bounds`; whether a fit
    holds it `fixed`): see `equilens._checks`.
    """

    def __check_init__(self):
        check_fields(self)

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

    `amp` is a scalar for a parametric profile (one basis function: the profile at unit
    amplitude, e.g. `Sersic`) or a vector for a basis set (`Shapelets`, `MGE`).
    `basis(x, y)` returns the basis images `B_k` (shape `(n_basis, *grid)`), so a linear
    solve (weighted least squares) can fill `amp` in from data instead of fitting it
    (`equilens.terms.GaussianLikelihood(..., linear=True)`).
    """

    amp: eqx.AbstractVar[Float[Array, "*n_basis"]]

    @abc.abstractmethod
    def basis(self, x: GridArray, y: GridArray) -> Float[Array, "n_basis *grid"]:
        """The basis functions (surface brightness per unit amplitude) at `(x, y)`."""

    @property
    def n_basis(self) -> int:
        """Number of linear amplitudes (`amp.size`)."""
        return int(np.prod(jnp.shape(self.amp)))

    def intensity(self, x: GridArray, y: GridArray) -> GridArray:
        amp = jnp.reshape(self.amp, (-1,))
        basis = self.basis(x, y)
        if basis.shape[0] == 1:
            return amp[0] * basis[0]
        return jnp.tensordot(amp, basis, axes=1)


class LightSum(AbstractLightProfile):
    """A sum of light profiles; built by `+`."""

    components: tuple[AbstractLightProfile, ...]

    def __check_init__(self):
        if len(self.components) == 0:
            raise ValueError("LightSum needs at least one component")

    def intensity(self, x: GridArray, y: GridArray) -> GridArray:
        return functools.reduce(jnp.add, [c.intensity(x, y) for c in self.components])


class FixedLight(AbstractLightProfile):
    """`profile` held as it is: a linear solve does not fill its amplitudes in (it is part
    of the fixed light of `LensSystem.linear_images`), and `equilens.fit` varies none of its
    parameters (unless `free=` picks them directly).

    Used to carry a lens light fitted in one stage into the next one unchanged, e.g. a
    multi-Gaussian lens light into a pixelized-source fit (`equilens.solve.fit_pixelized`),
    as PyAutoLens's chained pipelines do.

    **Arguments:** `profile` (any light profile, amplitudes included).
    """

    profile: AbstractLightProfile = eqx.field(metadata=describe(fixed=True))

    def intensity(self, x: GridArray, y: GridArray) -> GridArray:
        return self.profile.intensity(x, y)
