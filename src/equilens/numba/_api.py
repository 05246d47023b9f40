"""The Numba backend's entry points (the JAX methods' signatures on NumPy inputs), through its
registry of kernels (`_registry`).

Nothing here imports Numba: the kernels are compiled (or loaded from Numba's disk cache)
on the first call that needs them (`_load`).
"""

import functools
from typing import Any

import numpy as np
from jaxtyping import ArrayLike, Float

from ..light import AbstractLightProfile, AbstractLinearLightProfile
from ..mass import AbstractMassProfile
from ._registry import (
    DEFLECTION,
    JACOBIAN,
    POTENTIAL,
    _flat,
    kernel_basis,
    kernel_intensity,
    kernel_rows,
)


@functools.cache
def _load() -> None:
    from . import _profiles  # noqa: F401  (registers the kernels)


def mass_rows(profile: AbstractMassProfile, x: np.ndarray, y: np.ndarray, what: int) -> np.ndarray:
    """`(rows, x.size)` of `profile` at flat float64 `x`, `y` (sums and batches summed)."""
    _load()
    return kernel_rows(profile, x, y, what)


def light_basis(light: Any, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """`(n_basis, x.size)` basis images of a linear light profile at flat `x`, `y`."""
    _load()
    return kernel_basis(light, x, y)


def light_intensity(light: Any, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """`(x.size,)` surface brightness of any light profile at flat `x`, `y`."""
    _load()
    return kernel_intensity(light, x, y)


# --------------------------------------------------------------------------------------
# public entry points (same signatures and tuple layouts as the JAX methods)
# --------------------------------------------------------------------------------------


def deflection(
    profile: AbstractMassProfile, x: Float[ArrayLike, "*grid"], y: Float[ArrayLike, "*grid"]
) -> tuple[Float[np.ndarray, "*grid"], Float[np.ndarray, "*grid"]]:
    """Deflection `(alpha_x, alpha_y)` in arcsec at `(x, y)` (arcsec), as
    `profile.deflection(x, y)`, computed by the Numba kernels (float64 NumPy arrays)."""
    xf, yf, shape = _flat(x, y)
    out = mass_rows(profile, xf, yf, DEFLECTION)
    return out[0].reshape(shape), out[1].reshape(shape)


def potential(
    profile: AbstractMassProfile, x: Float[ArrayLike, "*grid"], y: Float[ArrayLike, "*grid"]
) -> Float[np.ndarray, "*grid"]:
    """Lensing potential `psi` in arcsec^2, as `profile.potential(x, y)`."""
    xf, yf, shape = _flat(x, y)
    return mass_rows(profile, xf, yf, POTENTIAL)[0].reshape(shape)


def hessian(
    profile: AbstractMassProfile, x: Float[ArrayLike, "*grid"], y: Float[ArrayLike, "*grid"]
) -> tuple[
    Float[np.ndarray, "*grid"],
    Float[np.ndarray, "*grid"],
    Float[np.ndarray, "*grid"],
    Float[np.ndarray, "*grid"],
]:
    """`(psi_xx, psi_xy, psi_yx, psi_yy)`, as `profile.hessian(x, y)` (analytic here;
    0 at the exact centre of a cusp, where it is infinite): the deflection's Jacobian,
    `psi_xy = d alpha_x / dy` and `psi_yx = d alpha_y / dx` (equal but for a `MultiPlane`)."""
    xf, yf, shape = _flat(x, y)
    out = mass_rows(profile, xf, yf, JACOBIAN)
    return tuple(row.reshape(shape) for row in out)  # pyright: ignore[reportReturnType]


def convergence(
    profile: AbstractMassProfile, x: Float[ArrayLike, "*grid"], y: Float[ArrayLike, "*grid"]
) -> Float[np.ndarray, "*grid"]:
    """Convergence `kappa = (psi_xx + psi_yy) / 2`, as `profile.convergence(x, y)`."""
    xf, yf, shape = _flat(x, y)
    out = mass_rows(profile, xf, yf, JACOBIAN)
    return (0.5 * (out[0] + out[3])).reshape(shape)


def ray_shoot(
    profile: AbstractMassProfile, x: Float[ArrayLike, "*grid"], y: Float[ArrayLike, "*grid"]
) -> tuple[Float[np.ndarray, "*grid"], Float[np.ndarray, "*grid"]]:
    """Source-plane position `beta = theta - alpha(theta)`, as `profile.ray_shoot(x, y)`."""
    xf, yf, shape = _flat(x, y)
    out = mass_rows(profile, xf, yf, DEFLECTION)
    return (xf - out[0]).reshape(shape), (yf - out[1]).reshape(shape)


def magnification(
    profile: AbstractMassProfile, x: Float[ArrayLike, "*grid"], y: Float[ArrayLike, "*grid"]
) -> Float[np.ndarray, "*grid"]:
    """Signed magnification `1 / det A`, as `profile.magnification(x, y)`."""
    xf, yf, shape = _flat(x, y)
    f_xx, f_xy, f_yx, f_yy = mass_rows(profile, xf, yf, JACOBIAN)
    with np.errstate(divide="ignore"):
        return (1 / ((1 - f_xx) * (1 - f_yy) - f_xy * f_yx)).reshape(shape)


def intensity(
    light: AbstractLightProfile, x: Float[ArrayLike, "*grid"], y: Float[ArrayLike, "*grid"]
) -> Float[np.ndarray, "*grid"]:
    """Surface brightness per arcsec^2 at `(x, y)`, as `light.intensity(x, y)`."""
    xf, yf, shape = _flat(x, y)
    return light_intensity(light, xf, yf).reshape(shape)


def basis(
    light: AbstractLinearLightProfile, x: Float[ArrayLike, "*grid"], y: Float[ArrayLike, "*grid"]
) -> Float[np.ndarray, "n_basis *grid"]:
    """The basis images of a linear light profile, as `light.basis(x, y)`."""
    xf, yf, shape = _flat(x, y)
    b = light_basis(light, xf, yf)
    return b.reshape((b.shape[0], *shape))
