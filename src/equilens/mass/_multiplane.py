"""Multi-plane lensing (Blandford & Narayan 1986; McCully et al. 2014), with lenstronomy's
conventions for `MultiPlane`: each component's parameters are those of a single-plane lens
for the final source (its reduced deflection `alpha_red`, arcsec), and a ray is traced from
the observer through the planes in comoving transverse coordinates (Mpc):

    x_i = x_{i-1} + a_{i-1} T(z_{i-1}, z_i),   a_i = a_{i-1} - (T_s / T_is) alpha_red_i(x_i / T_i),

from `x_0 = 0`, `a_0 = theta`, with `T(z1, z2) = (1 + z2) D_A(z1, z2)` the transverse
comoving distance between two redshifts (`T_i = T(0, z_i)`, `T_s = T(0, z_s)`,
`T_is = T(z_i, z_s)`); the source position is `beta = x_s / T_s`. `MultiPlane.deflection` is
the effective deflection `theta - beta`, so a `MultiPlane` is a mass profile like any other
(images, fits, pixelized sources, sampling). It has no lensing potential: the effective
deflection is not a gradient in general (its Jacobian is not symmetric).

The planes are one `jax.lax.scan`: the components of each class (and static fields) are
stacked, one array of shape `(members,)` per parameter (so that every parameter is a leaf
that `jax.grad` differentiates and a fit can free, and none is padding), and gathered by an
integer table of shape `(planes, slots)` into the planes, the empty slots switched off by a
boolean mask. A thousand halos compile once.
"""

from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

from .._custom_types import GridArray
from ._base import AbstractMassProfile, Deflection, MassBatch, MassSum


def default_chunk() -> int:
    """Components of one class on one plane evaluated together (one vmap); more are a scan
    over chunks of this many, so that memory stays `chunk` images per class: 4 on CPUs,
    where XLA's elementwise code is memory-bound and small chunks measured fastest (1,000
    halos, 200x200 points: 1.2 s at 4 against 2.6 s at 32), 32 on accelerators."""
    return 4 if jax.default_backend() == "cpu" else 32


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


def _members(component: AbstractMassProfile) -> list[AbstractMassProfile]:
    """The single profiles a component is made of (sums and batches opened)."""
    if isinstance(component, MultiPlane):
        raise TypeError("a MultiPlane cannot be a component of another MultiPlane")
    if isinstance(component, MassSum):
        return [m for c in component.components for m in _members(c)]
    if isinstance(component, MassBatch):
        profiles = component.profiles
        n = int(jax.tree.leaves(eqx.filter(profiles, eqx.is_array))[0].shape[0])
        return [jax.tree.map(lambda a, i=i: a[i], profiles) for i in range(n)]
    if not isinstance(component, AbstractMassProfile):
        raise TypeError(f"MultiPlane components must be mass profiles, got {type(component)}")
    return [component]


def _slots(n: int, chunk: int) -> int:
    return n if n <= chunk else -(-n // chunk) * chunk


def _kind_key(profile: Any) -> tuple[str, str]:
    return type(profile).__name__, str(jax.tree.structure(profile))


def _stack_kind(per_plane: list[list[Any]], n_slots: int) -> tuple[Any, np.ndarray, np.ndarray]:
    """One class's members: a module whose leaves have shape `(members,)`, and the
    `(planes, n_slots)` table of member indices with its mask (padding points at member 0)."""
    flat = [m for plane in per_plane for m in plane]
    treedef = jax.tree.structure(flat[0])
    columns = [[np.asarray(leaf) for leaf in jax.tree.leaves(m)] for m in flat]
    stacked = [jnp.asarray(np.stack(c)) for c in zip(*columns, strict=True)]
    index = np.zeros((len(per_plane), n_slots), np.int32)
    present = np.zeros((len(per_plane), n_slots), bool)
    k = 0
    for i, plane in enumerate(per_plane):
        index[i, : len(plane)] = np.arange(k, k + len(plane))
        present[i, : len(plane)] = True
        k += len(plane)
    return jax.tree.unflatten(treedef, stacked), index, present


def _kind_deflection(
    kind: Any, present: Bool[Array, " slots"], x: GridArray, y: GridArray, size: int
):
    """The summed deflection of one class's members on one plane."""

    def one(profile, on, x, y):
        ax, ay = profile.deflection(x, y)
        return jnp.where(on, ax, 0.0), jnp.where(on, ay, 0.0)

    def chunk(kind, on):
        ax, ay = eqx.filter_vmap(one, in_axes=(eqx.if_array(0), 0, None, None))(kind, on, x, y)
        return ax.sum(axis=0), ay.sum(axis=0)

    def evaluate():
        n = present.shape[0]
        if n <= size:
            ax, ay = chunk(kind, present)
            return ax.astype(x.dtype), ay.astype(y.dtype)
        arrays, static = eqx.partition(kind, eqx.is_array)
        split = jax.tree.map(lambda a: a.reshape(n // size, size, *a.shape[1:]), arrays)

        def step(total, xs):
            part, on = xs
            ax, ay = chunk(eqx.combine(part, static), on)
            return (total[0] + ax.astype(x.dtype), total[1] + ay.astype(y.dtype)), None

        zero = jnp.zeros_like(x)
        total, _ = jax.lax.scan(step, (zero, zero), (split, present.reshape(-1, size)))
        return total

    # (a plane without members of this class costs nothing, but under vmap, where the
    # condition becomes a select)
    return jax.lax.cond(present.any(), evaluate, lambda: (jnp.zeros_like(x), jnp.zeros_like(y)))


class MultiPlane(AbstractMassProfile):
    """Mass components at several redshifts, traced plane by plane (see the module's
    docstring for the equations and the units).

    **Arguments:**

    - `components`: mass profiles (a `MassSum` or a `MassBatch` counts as its members), each
      parametrised as a single-plane lens for a source at `z_source`.
    - `redshifts`: one per component; components at equal redshifts share a plane.
    - `z_source`: the source redshift, above every plane.
    - `cosmology`: an astropy cosmology (`astropy.cosmology.Planck18` by default).
    - `chunk`: components of one class on one plane evaluated together (`default_chunk()`:
      4 on CPUs, 32 on accelerators).

    `deflection(x, y)` is `theta - beta(theta)`; `trace(x, y)` is `beta`; `hessian` and
    `convergence` are those of the effective lens mapping (forward-mode derivatives;
    `psi_xy != psi_yx` in general). `components()` gives the profiles back.
    """

    kinds: tuple[AbstractMassProfile, ...]
    index: tuple[Int[Array, "planes slots"], ...]
    present: tuple[Bool[Array, "planes slots"], ...]
    plane_redshifts: tuple[float, ...] = eqx.field(static=True)
    z_source: float = eqx.field(static=True)
    steps: tuple[float, ...] = eqx.field(static=True)
    to_observer: tuple[float, ...] = eqx.field(static=True)
    factors: tuple[float, ...] = eqx.field(static=True)
    last_step: float = eqx.field(static=True)
    to_source: float = eqx.field(static=True)
    chunk: int = eqx.field(static=True)

    def __init__(
        self,
        components: Sequence[AbstractMassProfile],
        redshifts: Sequence[float],
        z_source: float,
        cosmology: Any = None,
        chunk: int | None = None,
    ):
        chunk = default_chunk() if chunk is None else int(chunk)
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        if len(components) == 0 or len(components) != len(redshifts):
            raise ValueError(
                f"MultiPlane needs one redshift per component, got {len(components)} "
                f"components and {len(redshifts)} redshifts"
            )
        zs = [float(z) for z in redshifts]
        z_source = float(z_source)
        if not all(0.0 < z < z_source for z in zs):
            raise ValueError(f"every redshift must be in (0, z_source={z_source}), got {zs}")
        if cosmology is None:
            from astropy.cosmology import Planck18 as cosmology
        unique = sorted(set(zs))
        members = [[] for _ in unique]
        for c, z in zip(components, zs, strict=True):
            members[unique.index(z)].extend(_members(c))
        keys = sorted({_kind_key(m) for plane in members for m in plane})
        kinds, index, present = [], [], []
        for key in keys:
            per_plane = [[m for m in plane if _kind_key(m) == key] for plane in members]
            kind, idx, mask = _stack_kind(per_plane, _slots(max(map(len, per_plane)), chunk))
            kinds.append(kind)
            index.append(jnp.asarray(idx))
            present.append(jnp.asarray(mask))
        self.kinds = tuple(kinds)
        self.index = tuple(index)
        self.present = tuple(present)
        self.plane_redshifts = tuple(unique)
        self.z_source = z_source
        t_s = _transverse(cosmology, 0.0, z_source)
        edges = [0.0, *unique]
        self.steps = tuple(
            _transverse(cosmology, a, b) for a, b in zip(edges, unique, strict=False)
        )
        self.to_observer = tuple(_transverse(cosmology, 0.0, z) for z in unique)
        self.factors = tuple(t_s / _transverse(cosmology, z, z_source) for z in unique)
        self.last_step = _transverse(cosmology, unique[-1], z_source)
        self.to_source = t_s
        self.chunk = chunk

    def trace(self, x: GridArray, y: GridArray) -> tuple[GridArray, GridArray]:
        """The source-plane position `beta` (arcsec) of the rays seen at `(x, y)`."""
        x, y = jnp.broadcast_arrays(x, y)
        dtype = jnp.result_type(x, y, float)
        table = jnp.asarray(np.array([self.steps, self.to_observer, self.factors]).T, dtype)
        # (each class's members gathered into its planes' slots)
        arrays, static = eqx.partition(self.kinds, eqx.is_array)
        arrays = tuple(
            jax.tree.map(lambda a, i=i: a[i], kind)
            for kind, i in zip(arrays, self.index, strict=True)
        )

        def plane(carry, xs):
            px, py, ax, ay = carry
            kind_arrays, present, (dt, t_i, f) = xs
            px, py = px + ax * dt, py + ay * dt
            dx, dy = jnp.zeros_like(px), jnp.zeros_like(py)
            for kind, on in zip(eqx.combine(kind_arrays, static), present, strict=True):
                kx, ky = _kind_deflection(kind, on, px / t_i, py / t_i, self.chunk)
                dx, dy = dx + kx, dy + ky
            return (px, py, ax - f * dx, ay - f * dy), None

        zero = jnp.zeros_like(x, dtype)
        start = (zero, zero, x.astype(dtype), y.astype(dtype))
        (px, py, ax, ay), _ = jax.lax.scan(plane, start, (arrays, self.present, table))
        px, py = px + ax * self.last_step, py + ay * self.last_step
        return px / self.to_source, py / self.to_source

    def deflection(self, x: GridArray, y: GridArray) -> Deflection:
        bx, by = self.trace(x, y)
        return x - bx, y - by

    def potential(self, x: GridArray, y: GridArray) -> GridArray:
        raise NotImplementedError(
            "a multi-plane lens has no single lensing potential (its effective deflection "
            "is not a gradient in general)"
        )

    def components(self) -> list[tuple[float, list[AbstractMassProfile]]]:
        """`[(redshift, [profiles on that plane]), ...]`, nearest plane first (the profiles
        sliced out of the stacked arrays as NumPy-backed modules)."""
        out = []
        for i, z in enumerate(self.plane_redshifts):
            plane = []
            for kind, index, present in zip(self.kinds, self.index, self.present, strict=True):
                host = jax.tree.map(np.asarray, kind)
                for k in np.asarray(index)[i][np.asarray(present)[i]]:
                    plane.append(jax.tree.map(lambda a, k=k: a[k], host))
            out.append((z, plane))
        return out

    @classmethod
    def stack(cls, lenses: Sequence["MultiPlane"]) -> "MultiPlane":
        """Many lenses with the same planes (redshifts and distances) and the same classes
        of components as one `MultiPlane` whose arrays have a leading batch axis (members
        and slots padded to the largest lens; a padded member is in no slot): for
        `eqx.filter_vmap` over realisations, e.g. of `equilens.simulate`. It is not
        evaluated directly."""
        if len(lenses) == 0:
            raise ValueError("MultiPlane.stack needs at least one lens")
        first = lenses[0]

        def keys(lens):
            return [_kind_key(jax.tree.map(lambda a: a[0], k)) for k in lens.kinds]

        for lens in lenses[1:]:
            if (lens.plane_redshifts, lens.steps, lens.factors, lens.z_source, lens.chunk) != (
                first.plane_redshifts,
                first.steps,
                first.factors,
                first.z_source,
                first.chunk,
            ):
                raise ValueError("MultiPlane.stack needs lenses with the same planes")
            if keys(lens) != keys(first):
                raise ValueError("MultiPlane.stack needs lenses with the same component classes")

        def pad(a, n, axis):
            # (with copies of the first entry; the mask with False)
            fill = jnp.repeat(jnp.take(a, jnp.array([0]), axis=axis), n - a.shape[axis], axis)
            return jnp.concatenate([a, jnp.zeros_like(fill) if a.dtype == bool else fill], axis)

        kinds, index, present = [], [], []
        for i in range(len(first.kinds)):
            n_members = max(int(jax.tree.leaves(lens.kinds[i])[0].shape[0]) for lens in lenses)
            n_slots = _slots(max(int(lens.present[i].shape[1]) for lens in lenses), first.chunk)
            kinds.append(
                jax.tree.map(
                    lambda *a, n=n_members: jnp.stack([pad(b, n, 0) for b in a]),
                    *[lens.kinds[i] for lens in lenses],
                )
            )
            index.append(jnp.stack([pad(lens.index[i], n_slots, 1) for lens in lenses]))
            present.append(jnp.stack([pad(lens.present[i], n_slots, 1) for lens in lenses]))
        return eqx.tree_at(
            lambda m: (m.kinds, m.index, m.present),
            first,
            (tuple(kinds), tuple(index), tuple(present)),
        )
