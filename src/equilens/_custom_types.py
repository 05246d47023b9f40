"""Shared jaxtyping aliases and the typed field converter."""

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Shaped

#: Any scalar given by the user: a Python number or a 0-d array.
ScalarLike = float | int | Shaped[ArrayLike, ""]

#: A scalar parameter held by a module.
FloatScalar = Float[Array, ""]

#: Coordinates or values on an arbitrary grid of points (any shape).
GridArray = Float[Array, "*grid"]


def as_float(x: ScalarLike | Float[ArrayLike, "..."]) -> Float[Array, "..."]:
    """Converts a parameter to a floating JAX array.

    Python numbers become weakly-typed arrays of JAX's default float dtype (float64 when x64
    is enabled), so that they follow the precision of the arrays they meet; floating arrays
    keep their dtype (float32 stays float32); integer arrays become default floats.
    Tracers pass through unchanged, so modules can be built under `jit` and `vmap`.
    """
    arr = jnp.asarray(x)
    if not jnp.issubdtype(arr.dtype, jnp.floating):
        arr = arr.astype(jnp.result_type(float))
    return arr
