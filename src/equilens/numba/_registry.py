"""The Numba backend's registry of kernels, keyed by final class (`register_mass`,
`register_basis`, `register_intensity`), the dispatch through it, and the conversions of a
module's fields to the kernels' operands. Nothing here loads a kernel: `_api` loads the
built-in ones (`_profiles`) on the first call that needs them, and `_profiles` registers
them here."""

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import numpy as np

from .._custom_types import FloatScalar

#: What a mass kernel computes: the rows of its output. `JACOBIAN` is the deflection's
#: Jacobian in full, `(d alpha_x/dx, d alpha_x/dy, d alpha_y/dx, d alpha_y/dy)`: the JAX
#: `hessian`'s `(psi_xx, psi_xy, psi_yx, psi_yy)`, which `kernel_rows` makes from a kernel's
#: symmetric Hessian rows unless the kernel computes it (`register_mass(full_jacobian=True)`:
#: a lens mapping that is not a potential's gradient, `MultiPlane`).
DEFLECTION, POTENTIAL, HESSIAN, JACOBIAN = 0, 1, 2, 3
_ROWS = {DEFLECTION: 2, POTENTIAL: 1, HESSIAN: 3, JACOBIAN: 4}

#: `fn(profile, x, y, what) -> out` with `x`, `y` flat float64 and `out` of shape
#: `(rows, x.size)`: deflection `(alpha_x, alpha_y)`, potential `(psi,)` or Hessian
#: `(psi_xx, psi_xy, psi_yy)` (and `JACOBIAN`'s four rows for a `full_jacobian` kernel).
MassKernel = Callable[[Any, np.ndarray, np.ndarray, int], np.ndarray]
#: `fn(profile, x, y) -> out` with `out` of shape `(n_basis, x.size)` (a linear profile's
#: basis images) or `(x.size,)` (a light profile's intensity).
LightKernel = Callable[[Any, np.ndarray, np.ndarray], np.ndarray]

_MASS: dict[type, MassKernel] = {}
_FULL_JACOBIAN: set[type] = set()
_BASIS: dict[type, LightKernel] = {}
_INTENSITY: dict[type, LightKernel] = {}


def register_mass(cls: type, *, full_jacobian: bool = False) -> Callable[[MassKernel], MassKernel]:
    """Registers the Numba kernel of the mass profile class `cls` (that class only, not its
    subclasses): `fn(profile, x, y, what)` as `MassKernel` describes. `full_jacobian`: the
    kernel computes `JACOBIAN`'s four rows itself (a mapping whose Jacobian is not
    symmetric); by default they are made from its `HESSIAN` rows."""

    def decorate(fn: MassKernel) -> MassKernel:
        _MASS[cls] = fn
        if full_jacobian:
            _FULL_JACOBIAN.add(cls)
        else:
            _FULL_JACOBIAN.discard(cls)
        return fn

    return decorate


def register_basis(cls: type) -> Callable[[LightKernel], LightKernel]:
    """Registers the basis-image kernel of the linear light profile class `cls`; its
    intensity is then `amp . basis`."""

    def decorate(fn: LightKernel) -> LightKernel:
        _BASIS[cls] = fn
        return fn

    return decorate


def register_intensity(cls: type) -> Callable[[LightKernel], LightKernel]:
    """Registers the intensity kernel of the (non-linear) light profile class `cls`."""

    def decorate(fn: LightKernel) -> LightKernel:
        _INTENSITY[cls] = fn
        return fn

    return decorate


def _not_implemented(obj: Any) -> NotImplementedError:
    return NotImplementedError(
        f"the Numba backend has no kernel for {type(obj).__name__} "
        f"({type(obj).__module__}); register one with equilens.numba.register_mass, "
        "register_basis or register_intensity"
    )


def scalar_fields(cls: type, but: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The names of the scalar parameters (`FloatScalar` fields) of module class `cls`, in
    the order the class declares them, except those in `but`: the order a profile's
    kernel takes them in (a kernel written for it follows the class)."""
    return tuple(
        f.name for f in dataclasses.fields(cls) if f.type is FloatScalar and f.name not in but
    )


def scalar(module: Any, name: str) -> float:
    """The field `name` of `module` as a Python float; a ValueError unless it is a scalar."""
    try:
        # (object.__getattribute__: a field read without equinox's method wrapping, which
        # took half the Python time of a likelihood call)
        arr = np.asarray(object.__getattribute__(module, name))
    except jax.errors.TracerArrayConversionError:
        raise TypeError(
            f"{type(module).__name__}.{name} is a JAX tracer: the Numba backend runs on "
            "concrete NumPy values, outside jit/grad/vmap"
        ) from None
    if arr.shape != ():
        raise ValueError(
            f"{type(module).__name__}.{name} must be a scalar, got shape {arr.shape} "
            "(a batch of profiles is a MassBatch)"
        )
    return float(arr)


def vector(module: Any, name: str) -> np.ndarray:
    """The field `name` of `module` as a contiguous float64 vector."""
    value = object.__getattribute__(module, name)
    return _writable(np.asarray(value, np.float64).reshape(-1))


def _writable(a: np.ndarray) -> np.ndarray:
    # Numba compiles a separate specialisation for read-only arrays (NumPy views of JAX
    # arrays are read-only): the kernels always get writable C-contiguous float64 ones
    if a.flags.writeable and a.flags.c_contiguous:
        return a
    return np.array(a, order="C")


def _flat(x: Any, y: Any) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    try:
        shape = np.broadcast_shapes(x.shape, y.shape)
    except ValueError:
        # (the JAX methods' error: a TypeError from their first arithmetic)
        raise TypeError(
            f"x and y got incompatible shapes for broadcasting: {x.shape}, {y.shape}"
        ) from None
    if x.shape != shape or y.shape != shape:
        x, y = np.broadcast_to(x, shape).copy(), np.broadcast_to(y, shape).copy()
    return _writable(x.reshape(-1)), _writable(y.reshape(-1)), shape


def kernel_rows(profile: Any, x: np.ndarray, y: np.ndarray, what: int) -> np.ndarray:
    """`(rows, x.size)` of `profile` at flat float64 `x`, `y` (sums and batches summed), by
    its registered kernel (`_api.mass_rows` loads the built-in kernels first)."""
    kernel = _MASS.get(type(profile))
    if kernel is None:
        raise _not_implemented(profile)
    if what == JACOBIAN and type(profile) not in _FULL_JACOBIAN:
        f_xx, f_xy, f_yy = kernel(profile, x, y, HESSIAN)
        return np.stack([f_xx, f_xy, f_xy, f_yy])
    return kernel(profile, x, y, what)


def batch_members(batch: Any) -> list[Any]:
    """The profiles of a `MassBatch`, one per index of its leading axis."""
    # (sliced as NumPy arrays: indexing a JAX array dispatches a device op per leaf)
    profiles = object.__getattribute__(batch, "profiles")
    host = jax.tree.map(lambda a: np.asarray(a) if eqx.is_array(a) else a, profiles)
    leaves = [leaf for leaf in jax.tree.leaves(host) if isinstance(leaf, np.ndarray)]
    n = int(leaves[0].shape[0]) if leaves else 0
    return [
        jax.tree.map(lambda a, i=i: a[i] if isinstance(a, np.ndarray) else a, host)
        for i in range(n)
    ]


def kernel_basis(light: Any, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """`(n_basis, x.size)` basis images of a linear light profile at flat `x`, `y`, by its
    registered kernel."""
    kernel = _BASIS.get(type(light))
    if kernel is None:
        raise _not_implemented(light)
    return kernel(light, x, y)


def kernel_intensity(light: Any, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """`(x.size,)` surface brightness of any light profile at flat `x`, `y`, by its
    registered kernels (its intensity, or its amplitudes times its basis)."""
    kernel = _INTENSITY.get(type(light))
    if kernel is not None:
        return kernel(light, x, y)
    if type(light) in _BASIS:
        amp = vector(light, "amp")
        b = _BASIS[type(light)](light, x, y)
        return amp[0] * b[0] if b.shape[0] == 1 else amp @ b
    raise _not_implemented(light)
