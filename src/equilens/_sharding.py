"""Placing datasets, terms, objectives and batches of models on a device mesh
(`jax.sharding`, the global view: one program, partitioned by XLA).

What is split, by type:

- a dataset (`Imaging`, `MultiBandImaging`), a term, an `Objective` (anything holding
  `Grid`s): the **image-pixel axis**. Every grid's rows are split over the mesh axis, so
  that under `jit` the per-pixel work (the sub-pixel coordinates, ray shooting, light
  profiles, the rows of a pixelized source's mapping matrix) runs on all devices; the
  FFT convolution, the masked sums and the source-plane solve of a pixelized source run on
  the gathered (replicated) arrays. Rows need not divide the device count (XLA pads the
  last shard and masks the padding: sums are exact, not approximated). The arrays the
  object holds (data, noise, kernels, parameters) are replicated on the mesh. A multi-band
  term splits every band's pixels over all devices (its bands differ in shape, so the band
  axis itself is not split).
- a batch of models (`batch=True`: every array leaf has a leading batch axis, as for
  `fit_batch`): the **batch axis**, which must divide the device count (`fit_batch(...,
  mesh=)` pads a batch itself: copies of its last element, dropped afterwards).

Nothing is changed behind the user's back: a mesh whose axes are not `AxisType.Auto`, a
batch that does not divide, or a term whose pixelized route runs on the host (a callback,
which cannot be split) raise `ValueError` with the reason.

jaxlib 0.10 (the newest jax on Python 3.11) runs a batched CPU LAPACK kernel (QR,
Cholesky, LU, ...) by handing the batch's matrices to XLA's intra-op thread pool and
waiting for them on a pool thread. When several CPU devices of one process run such a
kernel at the same time (a vmapped batch split over devices, two or more elements per
device: every Levenberg-Marquardt step factorises a batch of Jacobians) every pool thread
waits and the program deadlocks. jaxlib 0.11 builds that parallel path out. On the
affected jaxlib, `fit_batch(mesh=)` therefore solves one element per device at a time
(same results), and `shard(batch=True)` warns when it places more than one element per
CPU device (`lapack_batches_deadlock`).
"""

import importlib.metadata
import warnings
from typing import Any, TypeVar

import equinox as eqx
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from ._grid import Grid

T = TypeVar("T")

#: the installed jaxlib's version (major, minor)
JAXLIB_VERSION = tuple(int(p) for p in importlib.metadata.version("jaxlib").split(".")[:2])


def device_mesh(n_devices: int | None = None, axis: str = "devices") -> Mesh:
    """A one-axis `Mesh` of the first `n_devices` devices (default all of
    `jax.devices()`), with an automatic (`AxisType.Auto`) axis named `axis`: the mesh
    `shard` expects. Raises `ValueError` when fewer devices exist."""
    devices = jax.devices()
    n = len(devices) if n_devices is None else int(n_devices)
    if not 1 <= n <= len(devices):
        raise ValueError(
            f"device_mesh: n_devices must be between 1 and the {len(devices)} devices "
            f"available, got {n_devices!r}"
        )
    return Mesh(np.asarray(devices[:n]), (axis,), axis_types=(AxisType.Auto,))


def check_mesh(mesh: Mesh, axis: str | None) -> str:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"shard needs a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis is None:
        if len(mesh.axis_names) != 1:
            raise ValueError(
                f"the mesh has axes {mesh.axis_names}: pass axis= to say which one to split"
            )
        axis = str(mesh.axis_names[0])
    if axis not in mesh.axis_names:
        raise ValueError(f"axis {axis!r} is not one of the mesh's axes {mesh.axis_names}")
    kinds = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    if kinds[axis] != AxisType.Auto:
        raise ValueError(
            f"mesh axis {axis!r} is {kinds[axis]}: equilens partitions with sharding "
            "constraints in the global view, which needs an automatic axis (make the mesh "
            "with equilens.device_mesh, or jax.make_mesh(..., axis_types=(AxisType.Auto,)))"
        )
    return axis


def lapack_batches_deadlock(mesh: Mesh) -> bool:
    """Whether batched LAPACK kernels can deadlock on `mesh`: jaxlib 0.10.x and more than
    one CPU device of this process in it (see the module docstring)."""
    me = jax.process_index()
    local = [d for d in mesh.devices.flat if d.process_index == me and d.platform == "cpu"]
    return JAXLIB_VERSION == (0, 10) and len(local) > 1


def _check_host_routes(x: Any, mesh: Mesh) -> None:
    """Refuses a pixelized-evidence term whose solve runs on the host (the "sparse" route's
    callback sees whole arrays: it cannot be split over devices)."""
    from .inversion import solves_on_host
    from .terms import LogEvidence

    if mesh.size == 1:
        return
    for node in jax.tree.leaves(x, is_leaf=lambda n: isinstance(n, LogEvidence)):
        if isinstance(node, LogEvidence) and solves_on_host(node.solver):
            raise ValueError(
                "this LogEvidence term solves on the host (route 'sparse', the default on "
                "CPU with Numba), through a callback that sees whole arrays and cannot be "
                "split over devices: build it with route='dense' (or 'w_tilde') to shard it"
            )


def shard(x: T, mesh: Mesh, *, axis: str | None = None, batch: bool = False) -> T:
    """`x` placed on `mesh` (a `jax.sharding.Mesh`, e.g. `equilens.device_mesh()`), of the
    same type: a dataset, term or objective has its image-pixel axis split over the mesh
    axis `axis` (default: the mesh's only axis) and its arrays replicated; with
    `batch=True`, a batch of models (array leaves with a leading batch axis) has that axis
    split. Fits and objectives run unchanged on the result and give the single-device
    numbers (to rounding: sums are split). See the module docstring for what is split.

    Raises `ValueError` for a mesh axis that is not automatic, a batch that the device
    count does not divide, or a term that solves on the host (the "sparse" pixelized
    route) with more than one device."""
    name = check_mesh(mesh, axis)
    if batch:
        n_dev = mesh.shape[name]
        leaves = [leaf for leaf in jax.tree.leaves(x) if eqx.is_array(leaf)]
        if not leaves:
            raise ValueError("shard(batch=True): the batch has no array leaves")
        for leaf in leaves:
            if leaf.ndim == 0 or leaf.shape[0] % n_dev:
                raise ValueError(
                    f"shard(batch=True): a leaf of shape {leaf.shape} does not divide over "
                    f"{n_dev} devices along its batch axis (pass the batch to "
                    "fit_batch(..., mesh=mesh), which pads it)"
                )
        if leaves[0].shape[0] > n_dev and lapack_batches_deadlock(mesh):
            warnings.warn(
                f"shard(batch=True): {leaves[0].shape[0] // n_dev} elements per CPU device "
                f"with jaxlib {importlib.metadata.version('jaxlib')}, whose batched LAPACK "
                "kernels (QR, Cholesky, ...) deadlock when several CPU devices run them at "
                "once: vmap no linear algebra over this batch, place one element per "
                "device, or use jaxlib >= 0.11 (Python >= 3.12); fit_batch(mesh=) does the "
                "second itself",
                RuntimeWarning,
                stacklevel=2,
            )

        def put_batch(leaf):
            if not eqx.is_array(leaf):
                return leaf
            spec = PartitionSpec(name, *([None] * (leaf.ndim - 1)))
            return jax.device_put(leaf, NamedSharding(mesh, spec))

        return jax.tree.map(put_batch, x)

    _check_host_routes(x, mesh)
    replicated = NamedSharding(mesh, PartitionSpec())

    def put(node):
        if isinstance(node, Grid):
            return node.with_split((mesh, name))
        if eqx.is_array(node):
            return jax.device_put(node, replicated)
        return node

    return jax.tree.map(put, x, is_leaf=lambda n: isinstance(n, Grid))


def replicate(x: T, mesh: Mesh) -> T:
    """`x` with every array leaf replicated on `mesh` (grids left as they are)."""
    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.tree.map(lambda a: jax.device_put(a, replicated) if eqx.is_array(a) else a, x)


def split_grids(x: Any) -> bool:
    """Whether `x` holds a `Grid` whose rows are split over devices (`shard`)."""
    grids = jax.tree.leaves(x, is_leaf=lambda n: isinstance(n, Grid))
    return any(isinstance(g, Grid) and g.split is not None for g in grids)
