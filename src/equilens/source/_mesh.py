"""Source meshes: recipes that place the pixels of a pixelized source for a lens model.

`mesh.geometry(mass, x, y)` takes the mass model and the traced source-plane positions
`(x, y)` of the image (sub-)pixels that the source is mapped to, and returns the concrete
`AbstractGeometry` (node positions, interpolation, neighbours). Everything is differentiable
with respect to the mass parameters except the discrete choices (which cell or triangle
holds a point, the triangulation itself).
"""

import abc
import math
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float

from .._checks import describe
from .._custom_types import as_float
from .._grid import Grid
from ..mass import AbstractMassProfile
from ._geometry import AbstractGeometry, RectilinearGeometry, TriangulationGeometry


def _check_shape(name: str, shape: tuple[int, int]) -> tuple[int, int]:
    if len(shape) != 2 or any(not isinstance(n, int | np.integer) or n < 2 for n in shape):
        raise ValueError(f"{name}.shape must be two integers >= 2 (rows, columns), got {shape!r}")
    return (int(shape[0]), int(shape[1]))


class AbstractMesh(eqx.Module):
    """A recipe for the pixels of a pixelized source (see the module docstring)."""

    @property
    @abc.abstractmethod
    def n_pixels(self) -> int:
        """Number of source pixels (static)."""

    @abc.abstractmethod
    def geometry(
        self, mass: AbstractMassProfile, x: Float[Array, " m"], y: Float[Array, " m"]
    ) -> AbstractGeometry:
        """The mesh for `mass`, given the traced source-plane positions `(x, y)` (arcsec)
        of the image (sub-)pixels mapped to the source."""

    @abc.abstractmethod
    def placeholder(self) -> AbstractGeometry:
        """A geometry of the right shapes (zeros), for a source not yet solved."""


#: Where a `RectangularMesh` puts its nodes in its box.
NODE_PLACEMENTS = ("corners", "centres")
#: How far (arcsec) a `RectangularMesh(nodes="centres")` widens the traced pixels' bounding
#: box on each side, as PyAutoLens's `RectangularUniform` (its `overlay_grid_from` buffer).
CENTRES_MARGIN = 1e-8


def quantile(xp: Any, v: Any, q: Any) -> Any:
    """The quantiles `q` (in [0, 1]) of `v` by linear interpolation between order
    statistics (`jnp.quantile`'s "linear" method, in one arithmetic for `xp` = `jax.numpy`
    or NumPy, whose own quantile rounds differently)."""
    s = xp.sort(v)
    pos = q * (v.shape[0] - 1)
    low = xp.floor(pos)
    frac = pos - low
    lo = s[low.astype(int)]
    hi = s[xp.ceil(pos).astype(int)]
    return lo * (1.0 - frac) + hi * frac


class RectangularMesh(AbstractMesh):
    """A uniform rectangular mesh of `shape = (rows, columns)` nodes (values in row-major
    order, x along the columns), interpolated bilinearly.

    **Arguments:** `shape`; `bounds` (`(x_min, x_max, y_min, y_max)` in arcsec, fixed), or
    None (default) for the bounding box of the traced image pixels, recomputed for every
    mass model (so every mapped pixel lands on the mesh). With fixed bounds, image pixels
    traced outside them carry no source light. `nodes`: "corners" (default) puts the outer
    nodes on the box's edges; "centres" divides the box into `shape` cells with a node at
    each cell's centre (PyAutoLens's `RectangularUniform`): points between the outer nodes
    and the box's edges are extrapolated linearly from the outermost cells
    (`RectilinearGeometry(extrapolate=True)`), and the bounding box of the traced pixels is
    widened by `CENTRES_MARGIN` (1e-8 arcsec) on each side, as in PyAutoLens.
    """

    shape: tuple[int, int] = eqx.field(static=True)
    bounds: tuple[float, float, float, float] | None = eqx.field(static=True)
    nodes: str = eqx.field(static=True)

    def __init__(
        self,
        shape: tuple[int, int],
        bounds: tuple[float, float, float, float] | None = None,
        nodes: str = "corners",
    ):
        self.shape = _check_shape("RectangularMesh", shape)
        if nodes not in NODE_PLACEMENTS:
            raise ValueError(
                f"RectangularMesh.nodes must be one of {NODE_PLACEMENTS}, got {nodes!r}"
            )
        self.nodes = nodes
        if bounds is not None:
            b = tuple(float(v) for v in bounds)
            if len(b) != 4 or not (b[0] < b[1] and b[2] < b[3]):
                raise ValueError(
                    f"RectangularMesh.bounds must be (x_min, x_max, y_min, y_max) with "
                    f"min < max, got {bounds!r}"
                )
            bounds = b  # pyright: ignore[reportAssignmentType]
        self.bounds = bounds

    @property
    def n_pixels(self) -> int:
        return self.shape[0] * self.shape[1]

    def geometry(
        self, mass: AbstractMassProfile, x: Float[Array, " m"], y: Float[Array, " m"]
    ) -> RectilinearGeometry:
        del mass
        xs, ys = self.node_positions(jnp, x, y)
        return RectilinearGeometry(xs=xs, ys=ys, uniform=True, extrapolate=self.nodes == "centres")

    def node_positions(self, xp: Any, x: Any, y: Any) -> tuple[Any, Any]:
        """The nodes' x and y (arcsec) for traced positions `x`, `y`: the fixed `bounds`,
        or the positions' bounding box (widened by `CENTRES_MARGIN` for "centres"), at
        `node_fractions`; `xp` the array namespace (`jax.numpy`, or NumPy on the Numba
        backend: one formula for both)."""
        if self.bounds is None:
            x0, x1, y0, y1 = xp.min(x), xp.max(x), xp.min(y), xp.max(y)
            if self.nodes == "centres":
                x0, x1, y0, y1 = (
                    x0 - CENTRES_MARGIN,
                    x1 + CENTRES_MARGIN,
                    y0 - CENTRES_MARGIN,
                    y1 + CENTRES_MARGIN,
                )
        else:
            x0, x1, y0, y1 = (xp.asarray(b, dtype=x.dtype) for b in self.bounds)
        tx, ty = (xp.asarray(t, x.dtype) for t in self.node_fractions())
        return x0 + (x1 - x0) * tx, y0 + (y1 - y0) * ty

    def node_fractions(self) -> tuple[Float[np.ndarray, " nx"], Float[np.ndarray, " ny"]]:
        """Where the nodes sit along the box's x and y, as fractions of its sides."""
        ny, nx = self.shape
        if self.nodes == "centres":
            return (np.arange(nx) + 0.5) / nx, (np.arange(ny) + 0.5) / ny
        return np.linspace(0.0, 1.0, nx), np.linspace(0.0, 1.0, ny)

    def placeholder(self) -> RectilinearGeometry:
        dtype = jnp.result_type(float)
        tx, ty = self.node_fractions()
        return RectilinearGeometry(
            xs=jnp.asarray(tx, dtype),
            ys=jnp.asarray(ty, dtype),
            uniform=True,
            extrapolate=self.nodes == "centres",
        )


class AdaptiveRectangularMesh(AbstractMesh):
    """A magnification-adaptive rectangular mesh: `shape = (rows, columns)` nodes whose x
    (y) coordinates are the evenly spaced quantiles of the traced image pixels' x (y), so
    the node density follows the density of traced pixels (high where the magnification is
    high). Bilinear interpolation; the mesh always covers every mapped pixel. The quantiles
    are differentiable with respect to the mass parameters.
    """

    shape: tuple[int, int] = eqx.field(static=True)

    def __init__(self, shape: tuple[int, int]):
        self.shape = _check_shape("AdaptiveRectangularMesh", shape)

    @property
    def n_pixels(self) -> int:
        return self.shape[0] * self.shape[1]

    def geometry(
        self, mass: AbstractMassProfile, x: Float[Array, " m"], y: Float[Array, " m"]
    ) -> RectilinearGeometry:
        del mass
        xs, ys = self.node_positions(jnp, x, y)
        return RectilinearGeometry(xs=xs, ys=ys)

    def node_positions(self, xp: Any, x: Any, y: Any) -> tuple[Any, Any]:
        """The nodes' x and y (arcsec): evenly spaced quantiles (0 to 1) of the traced
        positions `x`, `y` (`quantile`); `xp` the array namespace (`jax.numpy`, or NumPy
        on the Numba backend)."""
        ny, nx = self.shape
        qx = xp.linspace(0.0, 1.0, nx, dtype=x.dtype)
        qy = xp.linspace(0.0, 1.0, ny, dtype=y.dtype)
        return quantile(xp, x, qx), quantile(xp, y, qy)

    def placeholder(self) -> RectilinearGeometry:
        # (not marked uniform: the same structure as the geometry of a solved model)
        even = RectangularMesh(self.shape).placeholder()
        return RectilinearGeometry(xs=even.xs, ys=even.ys)


class DelaunayMesh(AbstractMesh):
    """Nodes at the traced positions of fixed image-plane points (usually a subset of the
    masked image pixels), joined by their Delaunay triangulation in the source plane and
    interpolated barycentrically; the node positions, and so the weights, follow the mass
    model, the triangulation is recomputed on the host (scipy) for every model.

    **Arguments:** `image_x`, `image_y`: image-plane positions (arcsec) of the nodes. Use
    `DelaunayMesh.from_mask(grid, mask, n_nodes)` to pick about `n_nodes` of them evenly
    over a mask.
    """

    image_x: Float[Array, " n"] = eqx.field(metadata=describe(fixed=True))
    image_y: Float[Array, " n"] = eqx.field(metadata=describe(fixed=True))

    def __init__(self, image_x: Float[Array, " n"], image_y: Float[Array, " n"]):
        ix, iy = as_float(image_x), as_float(image_y)
        if ix.ndim != 1 or ix.shape != iy.shape or ix.shape[0] < 3:
            raise ValueError(
                f"DelaunayMesh needs 1-d image_x, image_y of equal length >= 3, got shapes "
                f"{ix.shape} and {iy.shape}"
            )
        self.image_x, self.image_y = ix, iy

    @classmethod
    def from_mask(
        cls, grid: Grid, mask: Bool[np.ndarray, "ny nx"] | Bool[Array, "ny nx"], n_nodes: int
    ) -> "DelaunayMesh":
        """About `n_nodes` pixel centres of `grid` inside `mask`, on a regular lattice of
        rows and columns (so the nodes sample the mask evenly in the image plane)."""
        m = np.asarray(mask, dtype=bool)
        if m.shape != grid.shape:
            raise ValueError(f"mask shape {m.shape} does not match grid shape {grid.shape}")
        n_mask = int(m.sum())
        if not 3 <= int(n_nodes) <= n_mask:
            raise ValueError(
                f"n_nodes must be between 3 and the {n_mask} mask pixels, got {n_nodes}"
            )
        step = math.sqrt(n_mask / int(n_nodes))
        pick = np.zeros_like(m)
        for _ in range(50):  # shrink the lattice step until enough pixels are picked
            rows = np.unique(np.round(np.arange(0.0, m.shape[0], step)).astype(int))
            cols = np.unique(np.round(np.arange(0.0, m.shape[1], step)).astype(int))
            pick = np.zeros_like(m)
            pick[np.ix_(rows[rows < m.shape[0]], cols[cols < m.shape[1]])] = True
            pick &= m
            if pick.sum() >= 0.95 * n_nodes or step <= 1.0:
                break
            step = max(1.0, step * 0.97)
        x, y = np.asarray(grid.x)[pick], np.asarray(grid.y)[pick]
        return cls(jnp.asarray(x), jnp.asarray(y))

    @property
    def n_pixels(self) -> int:
        return int(self.image_x.shape[0])

    def geometry(
        self, mass: AbstractMassProfile, x: Float[Array, " m"], y: Float[Array, " m"]
    ) -> TriangulationGeometry:
        del x, y
        bx, by = mass.ray_shoot(self.image_x, self.image_y)
        return TriangulationGeometry.triangulate(jnp.stack([bx, by], axis=1))

    def placeholder(self) -> TriangulationGeometry:
        n = self.n_pixels
        return TriangulationGeometry(
            points=jnp.zeros((n, 2), self.image_x.dtype),
            edges=jnp.zeros((3 * n, 2), jnp.int32),
            edge_weight=jnp.zeros((3 * n,), jnp.int32),
        )
