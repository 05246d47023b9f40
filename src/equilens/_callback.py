"""Pure host callbacks that, on a CPU backend, neither copy their operands nor their results.

`jax.pure_callback` copies every operand into a fresh array before calling the host
function and every result back afterwards: for the sparse pixelized route's host calls
(about 20 operands, a few MiB) that took 1 to 2 ms per call on one core, against 0.05 ms
here. On a CPU backend `host_callback` runs the function on read-only NumPy views of XLA's
own buffers (`jax.experimental.buffer_callback`) and writes its results into XLA's output
buffers; on any other backend it is `jax.pure_callback`.
"""

from collections.abc import Callable
from typing import Any

import jax
import numpy as np


def _views(buffers) -> list[np.ndarray]:
    views = []
    for b in buffers:
        v = np.asarray(b)
        # (XLA's buffers: a host function that wrote into an operand would change it for
        # the rest of the program; read-only views make that an error instead)
        v.flags.writeable = False
        views.append(v)
    return views


def host_callback(
    fn: Callable[..., Any],
    result_shape_dtypes: Any,
    *args: Any,
    vmap_method: str = "sequential",
) -> Any:
    """`fn(*args)` on the host as a pure function, like `jax.pure_callback(fn,
    result_shape_dtypes, *args, vmap_method=vmap_method)`.

    On a CPU backend `fn` receives read-only NumPy views of the operands' buffers, valid
    only during the call (`fn` must copy what it keeps), and its results (a pytree of
    arrays of the shapes of `result_shape_dtypes`, cast to their dtypes) are written into
    the output buffers without a copy to and from JAX arrays. Not differentiable (like
    `jax.pure_callback`: wrap it in a custom derivative rule)."""
    leaves, _ = jax.tree.flatten(result_shape_dtypes)

    def on_buffers(ctx, out, *buffers) -> None:
        del ctx
        got = jax.tree.leaves(fn(*_views(buffers)))
        outs = jax.tree.leaves(out)
        if len(got) != len(outs):
            raise ValueError(f"host callback returned {len(got)} arrays, expected {len(outs)}")
        for o, r, s in zip(outs, got, leaves, strict=True):
            r = np.asarray(r)
            if r.shape != tuple(s.shape):
                raise ValueError(
                    f"host callback returned an array of shape {r.shape}, expected {s.shape}"
                )
            np.asarray(o)[...] = r

    def cpu(*a):
        from jax.experimental.buffer_callback import buffer_callback

        return buffer_callback(on_buffers, result_shape_dtypes, vmap_method=vmap_method)(*a)

    def other(*a):
        return jax.pure_callback(fn, result_shape_dtypes, *a, vmap_method=vmap_method)

    if _partitioned(args):
        return other(*args)
    return jax.lax.platform_dependent(*args, cpu=cpu, default=other)


def _mesh_size(mesh) -> int:
    return 1 if mesh is None or getattr(mesh, "empty", True) else int(mesh.size)


def _partitioned(args) -> bool:
    """Whether the program is visibly partitioned over several devices (a mesh in context,
    or operands sharded over one): there the buffer callback would run once per device,
    where `jax.pure_callback` runs once."""
    get_mesh = getattr(jax.sharding, "get_abstract_mesh", None)
    if get_mesh is not None and _mesh_size(get_mesh()) > 1:
        return True
    for x in jax.tree.leaves(args):
        sharding = getattr(jax.typeof(x), "sharding", None)
        if _mesh_size(getattr(sharding, "mesh", None)) > 1:
            return True
    return False
