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

The rays are traced by one `jax.lax.scan` over steps: the components of each class (and
static fields) are stacked, one array per parameter of shape `(members,)` (so that every
parameter is a leaf that `jax.grad` differentiates and a fit can free, and none is
padding); each step evaluates up to `chunk` members of each class on one plane (one vmap,
gathered by an integer table, empty slots masked, a class with none on the step skipped),
and a plane takes as many steps as its most populous class needs, the first of them moving
the rays to the plane. A thousand halos compile once, and a plane with one halo costs one
halo, however many another plane holds.
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


def angular_diameter_distance(cosmology: Any, z1: float, z2: float) -> float:
    """`D_A(z1, z2)` in Mpc from an astropy cosmology (any curvature; astropy >= 7 takes
    two redshifts, before it a method of its own)."""
    from astropy import units

    try:
        d = cosmology.angular_diameter_distance(z1, z2)
    except TypeError:
        d = cosmology.angular_diameter_distance_z1z2(z1, z2)
    return float(d.to_value(units.Mpc))


def _transverse(cosmology: Any, z1: float, z2: float) -> float:
    """`T(z1, z2)` in Mpc: `(1 + z2) D_A(z1, z2)` (any curvature)."""
    from astropy import units

    if z1 == 0.0:
        return float(cosmology.comoving_transverse_distance(z2).to_value(units.Mpc))
    return (1.0 + z2) * angular_diameter_distance(cosmology, z1, z2)


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


class _Cosmology:
    """An astropy cosmology held by a static field: equal (and hashed) by its `repr`, which
    lists every parameter, so that equal cosmologies built apart compile once."""

    def __init__(self, value: Any):
        self.value = value
        self._key = repr(value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Cosmology) and other._key == self._key

    def __hash__(self) -> int:
        return hash(self._key)


def _kind_key(profile: Any) -> tuple[str, str]:
    return type(profile).__name__, str(jax.tree.structure(profile))


def _schedule(
    counts: np.ndarray, chunk: int
) -> tuple[np.ndarray, np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """The steps for `counts[plane, kind]` members (numbered plane by plane within each
    class): each step's plane, whether it is its plane's first, and per class the member
    indices and mask of its `width` slots."""
    n_planes, n_kinds = counts.shape
    widths = [max(1, min(chunk, int(counts[:, k].max()))) for k in range(n_kinds)]
    per_plane = [
        max(1, *(-(-int(counts[i, k]) // widths[k]) for k in range(n_kinds)))
        for i in range(n_planes)
    ]
    n_steps = sum(per_plane)
    plane = np.repeat(np.arange(n_planes, dtype=np.int32), per_plane)
    first = np.zeros(n_steps, bool)
    first[np.cumsum([0, *per_plane[:-1]])] = True
    index = [np.zeros((n_steps, w), np.int32) for w in widths]
    present = [np.zeros((n_steps, w), bool) for w in widths]
    start = np.concatenate([np.zeros((1, n_kinds), int), np.cumsum(counts, axis=0)])
    step = 0
    for i in range(n_planes):
        for s in range(per_plane[i]):
            for k, w in enumerate(widths):
                lo = s * w
                hi = min(int(counts[i, k]), lo + w)
                if hi > lo:
                    index[k][step, : hi - lo] = start[i, k] + np.arange(lo, hi)
                    present[k][step, : hi - lo] = True
            step += 1
    return plane, first, index, present


def _chunk_deflection(kind: Any, on: Bool[Array, " width"], x: GridArray, y: GridArray):
    """The summed deflection of the masked members of one class (a vmap over slots),
    nothing computed when no slot is on (outside vmap, where the condition is a branch)."""

    def one(profile, on):
        ax, ay = profile.deflection(x, y)
        return jnp.where(on, ax, 0.0).astype(x.dtype), jnp.where(on, ay, 0.0).astype(y.dtype)

    def evaluate():
        ax, ay = eqx.filter_vmap(one, in_axes=(eqx.if_array(0), 0))(kind, on)
        return ax.sum(axis=0), ay.sum(axis=0)

    return jax.lax.cond(on.any(), evaluate, lambda: (jnp.zeros_like(x), jnp.zeros_like(y)))


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
    `psi_xy != psi_yx` in general). `components()` gives the profiles back, `cosmology`
    the astropy cosmology.
    """

    kinds: tuple[AbstractMassProfile, ...]
    index: tuple[Int[Array, "steps width"], ...]
    present: tuple[Bool[Array, "steps width"], ...]
    plane: Int[Array, " steps"]
    first: Bool[Array, " steps"]
    plane_redshifts: tuple[float, ...] = eqx.field(static=True)
    z_source: float = eqx.field(static=True)
    steps: tuple[float, ...] = eqx.field(static=True)
    to_observer: tuple[float, ...] = eqx.field(static=True)
    factors: tuple[float, ...] = eqx.field(static=True)
    last_step: float = eqx.field(static=True)
    to_source: float = eqx.field(static=True)
    chunk: int = eqx.field(static=True)
    held_cosmology: _Cosmology = eqx.field(static=True)

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
        by_kind = [[[m for m in plane if _kind_key(m) == key] for plane in members] for key in keys]
        counts = np.array([[len(p[i]) for p in by_kind] for i in range(len(unique))], int)
        plane, first, index, present = _schedule(counts, chunk)
        self.kinds = tuple(
            MassBatch.stack([m for p in kind for m in p]).profiles for kind in by_kind
        )
        self.index = tuple(jnp.asarray(i) for i in index)
        self.present = tuple(jnp.asarray(p) for p in present)
        self.plane = jnp.asarray(plane)
        self.first = jnp.asarray(first)
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
        self.held_cosmology = _Cosmology(cosmology)

    @property
    def cosmology(self) -> Any:
        """The astropy cosmology of the distances."""
        return self.held_cosmology.value

    def trace(self, x: GridArray, y: GridArray) -> tuple[GridArray, GridArray]:
        """The source-plane position `beta` (arcsec) of the rays seen at `(x, y)`."""
        x, y = jnp.broadcast_arrays(x, y)
        dtype = jnp.result_type(x, y, float)
        dist = jnp.asarray(np.array([self.steps, self.to_observer, self.factors]), dtype)
        arrays, static = eqx.partition(self.kinds, eqx.is_array)

        # (checkpointed: reverse mode keeps the rays of each step, not every intermediate
        # of every halo's profile)
        @jax.checkpoint
        def step(carry, xs):
            px, py, ax, ay = carry
            plane, first, index, present = xs
            dt = jnp.where(first, dist[0, plane], 0.0)
            t_i, f = dist[1, plane], dist[2, plane]
            px, py = px + ax * dt, py + ay * dt
            u, v = px / t_i, py / t_i
            for kind, stat, idx, on in zip(arrays, static, index, present, strict=True):
                chunk = eqx.combine(jax.tree.map(lambda a, i=idx: a[i], kind), stat)
                dx, dy = _chunk_deflection(chunk, on, u, v)
                ax, ay = ax - f * dx, ay - f * dy
            return (px, py, ax, ay), None

        zero = jnp.zeros_like(x, dtype)
        start = (zero, zero, x.astype(dtype), y.astype(dtype))
        xs = (self.plane, self.first, self.index, self.present)
        (px, py, ax, ay), _ = jax.lax.scan(step, start, xs)
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
        out = [(z, []) for z in self.plane_redshifts]
        plane = np.asarray(self.plane)
        for kind, index, present in zip(self.kinds, self.index, self.present, strict=True):
            host = jax.tree.map(np.asarray, kind)
            idx, on = np.asarray(index), np.asarray(present)
            for s in range(plane.size):
                for k in idx[s][on[s]]:
                    out[plane[s]][1].append(jax.tree.map(lambda a, k=k: a[k], host))
        return out

    @classmethod
    def stack(cls, lenses: Sequence["MultiPlane"]) -> "MultiPlane":
        """Many lenses with the same planes (redshifts and distances) and the same classes
        of components as one `MultiPlane` whose arrays have a leading batch axis (members,
        steps and slots padded to the largest lens; padding is masked): for
        `eqx.filter_vmap` over realisations, e.g. `el.simulate_batch`. It is not evaluated
        directly. (Under vmap every step evaluates a chunk of every class.)"""
        if len(lenses) == 0:
            raise ValueError("MultiPlane.stack needs at least one lens")
        first = lenses[0]

        def keys(lens):
            return [_kind_key(jax.tree.map(lambda a: a[0], k)) for k in lens.kinds]

        planes = (first.plane_redshifts, first.steps, first.factors, first.z_source, first.chunk)
        for lens in lenses[1:]:
            if (
                lens.plane_redshifts,
                lens.steps,
                lens.factors,
                lens.z_source,
                lens.chunk,
            ) != planes:
                raise ValueError("MultiPlane.stack needs lenses with the same planes")
            if keys(lens) != keys(first):
                raise ValueError("MultiPlane.stack needs lenses with the same component classes")

        def pad(a, n, axis, value=None):
            # (with copies of the first entry, or with `value`)
            fill = jnp.repeat(jnp.take(a, jnp.array([0]), axis=axis), n - a.shape[axis], axis)
            fill = fill if value is None else jnp.full_like(fill, value)
            return jnp.concatenate([a, fill], axis)

        n_steps = max(int(lens.plane.shape[0]) for lens in lenses)
        last = len(first.plane_redshifts) - 1
        kinds, index, present = [], [], []
        for i in range(len(first.kinds)):
            n_members = max(int(jax.tree.leaves(lens.kinds[i])[0].shape[0]) for lens in lenses)
            width = max(int(lens.present[i].shape[1]) for lens in lenses)
            kinds.append(
                jax.tree.map(
                    lambda *a, n=n_members: jnp.stack([pad(b, n, 0) for b in a]),
                    *[lens.kinds[i] for lens in lenses],
                )
            )
            index.append(
                jnp.stack([pad(pad(le.index[i], width, 1, 0), n_steps, 0, 0) for le in lenses])
            )
            present.append(
                jnp.stack(
                    [pad(pad(le.present[i], width, 1, False), n_steps, 0, False) for le in lenses]
                )
            )
        # (padding steps: on the last plane, not its first step, every slot off: no-ops)
        plane = jnp.stack([pad(le.plane, n_steps, 0, last) for le in lenses])
        firsts = jnp.stack([pad(le.first, n_steps, 0, False) for le in lenses])
        return eqx.tree_at(
            lambda m: (m.kinds, m.index, m.present, m.plane, m.first),
            first,
            (tuple(kinds), tuple(index), tuple(present), plane, firsts),
        )
