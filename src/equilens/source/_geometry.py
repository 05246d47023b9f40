"""Source-plane geometries: where the pixels of a source mesh lie for one lens model, how a
point of the source plane is interpolated from them, and which pixels are neighbours.

A mesh (`equilens.source.RectangularMesh`, ...) is the recipe; its geometry is what the
recipe gives for the traced image grid of a particular mass model. Source values live on the
geometry's nodes: `value(x, y) = sum_v w_v(x, y) values[idx_v(x, y)]`.
"""

import abc
import collections
import functools
import threading
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int, Scalar

from .._callback import host_callback
from .._checks import describe
from .._custom_types import as_float

#: Sparse rows of a linear operator on the source values: `rows @ s = sum_k coef[:, k] *
#: s[idx[:, k]]`.
SparseRows = tuple[Int[Array, "r k"], Float[Array, "r k"]]


class SparseSymmetric(eqx.Module):
    """A symmetric `n x n` matrix by its non-zero entries (coordinate form): entry `e`
    puts `values[e]` at `(rows[e], cols[e])` and, off the diagonal, at `(cols[e],
    rows[e])` too, so each pair of indices is listed once (in either order); repeated
    entries add up. The pattern (`rows`, `cols`) is structure, never differentiated; the
    `values` are. `n` is static."""

    rows: Int[Array, " nnz"]
    cols: Int[Array, " nnz"]
    values: Float[Array, " nnz"]
    n: int = eqx.field(static=True)

    def __init__(
        self,
        rows: Int[Array | np.ndarray, " nnz"],
        cols: Int[Array | np.ndarray, " nnz"],
        values: Float[Array | np.ndarray, " nnz"],
        n: int,
    ):
        self.rows = jax.lax.stop_gradient(jnp.asarray(rows))
        self.cols = jax.lax.stop_gradient(jnp.asarray(cols))
        self.values = as_float(values)
        self.n = int(n)
        if not (self.rows.shape == self.cols.shape == self.values.shape):
            raise ValueError(
                "SparseSymmetric's rows, cols and values must have one shape, got "
                f"{self.rows.shape}, {self.cols.shape}, {self.values.shape}"
            )

    def _off_diagonal(self) -> Float[Array, " nnz"]:
        return jnp.where(self.rows == self.cols, 0.0, self.values)

    def todense(self) -> Float[Array, "n n"]:
        """The dense `n x n` matrix."""
        out = jnp.zeros((self.n, self.n), self.values.dtype)
        out = out.at[self.rows, self.cols].add(self.values)
        return out.at[self.cols, self.rows].add(self._off_diagonal())

    def matvec(self, x: Float[Array, " n"]) -> Float[Array, " n"]:
        """The product with a vector `x`."""
        out = jnp.zeros(self.n, jnp.result_type(self.values, x))
        out = out.at[self.rows].add(self.values * x[self.cols])
        return out.at[self.cols].add(self._off_diagonal() * x[self.rows])

    def quadratic(self, x: Float[Array, " n"]) -> Scalar:
        """The quadratic form `x^T A x`."""
        twice = jnp.where(self.rows == self.cols, 1.0, 2.0)
        return jnp.sum(twice * self.values * x[self.rows] * x[self.cols])


class AbstractGeometry(eqx.Module):
    """The concrete pixels of a source mesh (arcsec, source plane)."""

    @property
    @abc.abstractmethod
    def n_pixels(self) -> int:
        """Number of source pixels (nodes)."""

    @abc.abstractmethod
    def nodes(self) -> Float[Array, "n 2"]:
        """`(x, y)` of every node, in the order of the source values."""

    @abc.abstractmethod
    def interpolation(
        self, x: Float[Array, " m"], y: Float[Array, " m"]
    ) -> tuple[Int[Array, "m v"], Float[Array, "m v"]]:
        """Node indices and interpolation weights of points `(x, y)`: a point's value is
        `sum_v weights[:, v] * values[indices[:, v]]`. Weights are differentiable with respect
        to the points and the nodes; a point outside the mesh gets zero weights (rectangular
        meshes) or its nearest node (Delaunay)."""

    @abc.abstractmethod
    def gradient_rows(self) -> SparseRows:
        """First differences across every pair of neighbouring nodes (one row per pair,
        `s_i - s_j`); padding rows have zero coefficients."""

    @abc.abstractmethod
    def curvature_matrix(self) -> Float[Array, "n n"]:
        """`L^T L` for the geometry's second-difference operator `L` (unit coefficient)."""

    def values_at(
        self, values: Float[Array, " n"], x: Float[Array, "*grid"], y: Float[Array, "*grid"]
    ) -> Float[Array, "*grid"]:
        """The source interpolated at points `(x, y)` (any shape)."""
        idx, w = self.interpolation(x.reshape(-1), y.reshape(-1))
        return jnp.sum(w * values[idx], axis=-1).reshape(x.shape)


# -- rectilinear: nodes on the crossings of sorted x and y coordinates ------------------------


@functools.cache
def rect_rows(ny: int, nx: int, order: int) -> tuple[np.ndarray, np.ndarray]:
    """The neighbour pairs of an `ny x nx` rectilinear mesh (row-major pixel indices):
    adjacent pixels for `order` 1, and for order 2 the three-pixel runs whose second
    difference the curvature regularization takes (shared by both backends)."""
    ids = np.arange(ny * nx).reshape(ny, nx)
    if order == 1:
        pairs = [np.stack([ids[:, :-1].ravel(), ids[:, 1:].ravel()], 1)]
        pairs.append(np.stack([ids[:-1, :].ravel(), ids[1:, :].ravel()], 1))
        idx = np.concatenate(pairs)
        return idx, np.tile([1.0, -1.0], (idx.shape[0], 1))
    rows = [np.stack([ids[:, :-2].ravel(), ids[:, 1:-1].ravel(), ids[:, 2:].ravel()], 1)]
    rows.append(np.stack([ids[:-2, :].ravel(), ids[1:-1, :].ravel(), ids[2:, :].ravel()], 1))
    idx = np.concatenate(rows)
    return idx, np.tile([1.0, -2.0, 1.0], (idx.shape[0], 1))


@functools.cache
def rect_operator_matrix(ny: int, nx: int, order: int) -> np.ndarray:
    """`G^T G` (dense NumPy, float64) of the first (`order=1`) or second (`order=2`)
    differences along the rows and columns of an `ny x nx` rectilinear mesh."""
    idx, coef = rect_rows(ny, nx, order)
    out = np.zeros((ny * nx, ny * nx))
    for a in range(idx.shape[1]):
        for b in range(idx.shape[1]):
            np.add.at(out, (idx[:, a], idx[:, b]), coef[:, a] * coef[:, b])
    return out


class RectilinearGeometry(AbstractGeometry):
    """Nodes at the crossings of increasing coordinates `xs` (columns) and `ys` (rows);
    values in row-major order (`values.reshape(ny, nx)` is an image with x along columns).
    Points are interpolated bilinearly from the four corners of their cell; points outside
    `[xs[0], xs[-1]] x [ys[0], ys[-1]]` (beyond round-off: `EDGE_SLACK`) get zero weights.

    With `extrapolate=True` the geometry reaches half a node spacing beyond its outer nodes
    (the nodes are then the centres of cells that tile a box, as PyAutoLens's
    `RectangularUniform`): a point there is extrapolated linearly from the outermost cell
    (weights outside `[0, 1]` that still sum to one); beyond, zero weights.

    With `uniform=True` (a `RectangularMesh`'s geometry) the coordinates are evenly spaced,
    `xs[i] = xs[0] + i (xs[-1] - xs[0]) / (nx - 1)` (likewise `ys`): a point's cell and its
    position in it are then computed from the first and last coordinates alone (no search,
    no gathers: 3x faster on a CPU), and the weights depend on those two (their gradient
    with respect to the coordinates in between is zero)."""

    xs: Float[Array, " nx"] = eqx.field(metadata=describe(fixed=True))
    ys: Float[Array, " ny"] = eqx.field(metadata=describe(fixed=True))
    uniform: bool = eqx.field(static=True, default=False)
    extrapolate: bool = eqx.field(static=True, default=False)

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.ys.shape[0]), int(self.xs.shape[0]))

    @property
    def n_pixels(self) -> int:
        return self.shape[0] * self.shape[1]

    def nodes(self) -> Float[Array, "n 2"]:
        y, x = jnp.meshgrid(self.ys, self.xs, indexing="ij")
        return jnp.stack([x.reshape(-1), y.reshape(-1)], axis=1)

    def interpolation(
        self, x: Float[Array, " m"], y: Float[Array, " m"]
    ) -> tuple[Int[Array, "m 4"], Float[Array, "m 4"]]:
        _ny, nx = self.shape
        cell = _uniform_cell if self.uniform else _cell
        ix, tx = cell(self.xs, x, self.extrapolate)
        iy, ty = cell(self.ys, y, self.extrapolate)
        inside = _on_edges(self.xs, x, self.extrapolate) & _on_edges(self.ys, y, self.extrapolate)
        base = iy * nx + ix
        idx = jnp.stack([base, base + 1, base + nx, base + nx + 1], axis=1)
        w = jnp.stack([(1 - tx) * (1 - ty), tx * (1 - ty), (1 - tx) * ty, tx * ty], axis=1)
        return idx, jnp.where(inside[:, None], w, 0.0)

    def gradient_rows(self) -> SparseRows:
        idx, coef = rect_rows(*self.shape, 1)
        return jnp.asarray(idx), jnp.asarray(coef, dtype=self.xs.dtype)

    def curvature_matrix(self) -> Float[Array, "n n"]:
        return jnp.asarray(rect_operator_matrix(*self.shape, 2), dtype=self.xs.dtype)


#: Points this many round-off units (of the edge coordinates) outside a rectangular mesh
#: still count as on it: a mesh fitted to the traced pixels has the outermost ones on its
#: edges, and the same rays traced again by another computation (rendering a completed
#: model) may land an ulp or two outside.
EDGE_SLACK = 64


def _on_edges(
    edges: Float[Array, " k"], v: Float[Array, " m"], extrapolate: bool = False
) -> Bool[Array, " m"]:
    """Whether `v` lies within `[edges[0], edges[-1]]` (widened by half the first and last
    spacings if `extrapolate`), to round-off (`EDGE_SLACK`)."""
    lo, hi = edges[0], edges[-1]
    if extrapolate:
        lo, hi = lo - 0.5 * (edges[1] - edges[0]), hi + 0.5 * (edges[-1] - edges[-2])
    slack = EDGE_SLACK * jnp.finfo(edges.dtype).eps * (jnp.abs(lo) + jnp.abs(hi))
    return (v >= lo - slack) & (v <= hi + slack)


def _cell(
    edges: Float[Array, " k"], v: Float[Array, " m"], extrapolate: bool = False
) -> tuple[Int[Array, " m"], Array]:
    """Cell index (clipped to the mesh) and fractional position in the cell (clipped to
    `[0, 1]` unless `extrapolate`)."""
    i = jnp.clip(jnp.searchsorted(edges, v, side="right") - 1, 0, edges.shape[0] - 2)
    lo, hi = edges[i], edges[i + 1]
    width = hi - lo
    t = (v - lo) / jnp.where(width > 0, width, 1.0)
    return i, t if extrapolate else jnp.clip(t, 0.0, 1.0)


def _uniform_cell(
    edges: Float[Array, " k"], v: Float[Array, " m"], extrapolate: bool = False
) -> tuple[Int[Array, " m"], Array]:
    """`_cell` for evenly spaced `edges`, from `edges[0]` and `edges[-1]` only."""
    n = edges.shape[0] - 1
    span = edges[-1] - edges[0]
    u = (v - edges[0]) * (n / jnp.where(span > 0, span, 1.0))
    # (a NaN point, e.g. from a solver's trial step, gets cell 0: it is outside the mesh)
    i = jnp.where(jnp.isnan(u), 0.0, jnp.clip(jnp.floor(u), 0, n - 1))
    t = u - i
    return i.astype(jnp.int32), t if extrapolate else jnp.clip(t, 0.0, 1.0)


# -- Delaunay: triangulation on the host (scipy), barycentric weights in JAX -------------------


def _delaunay(pts: np.ndarray):
    """scipy's Delaunay triangulation, or None for nodes it cannot triangulate (non-finite
    or degenerate positions, e.g. from a solver's trial step far outside the data). A
    model's triangulation and its point location (two host calls, in either order)
    triangulate the same nodes: the first call keeps its triangulation under the nodes'
    bytes and the second takes it (so a repeated model is triangulated again, as a new
    one would be); at most a few wait. The nodes are copied: scipy's triangulation keeps a
    reference to its input (and computes `transform`, which `find_simplex` reads, from it
    on first use), and a host callback's operands are views of buffers that JAX may reuse
    as soon as the call returns."""
    pts = np.array(pts, dtype=np.float64, order="C")
    key = (pts.shape, pts.tobytes())
    with _TRIANGULATIONS_LOCK:
        if key in _TRIANGULATIONS:
            return _TRIANGULATIONS.pop(key)
    tri = _triangulate_nodes(pts)
    with _TRIANGULATIONS_LOCK:
        _TRIANGULATIONS[key] = tri
        while len(_TRIANGULATIONS) > _TRIANGULATIONS_KEPT:
            _TRIANGULATIONS.popitem(last=False)
    return tri


def _triangulate_nodes(pts: np.ndarray):
    from scipy.spatial import Delaunay, QhullError

    if not np.all(np.isfinite(pts)):
        return None
    try:
        return Delaunay(pts)
    except (QhullError, ValueError):
        return None


#: How many triangulations wait in `_delaunay` for their second use (a batch of models
#: interleaves them; an evicted one is computed again).
_TRIANGULATIONS_KEPT = 4
_TRIANGULATIONS: collections.OrderedDict = collections.OrderedDict()
_TRIANGULATIONS_LOCK = threading.Lock()


def triangulate_host(nodes: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """The edges of the Delaunay triangulation of `nodes` (`(n, 2)`, on the host), padded to
    `3 n` rows, and a weight per row (1 for an edge, 0 for padding; all 0 when the nodes
    cannot be triangulated). Shared by both backends."""
    pts = np.asarray(nodes, dtype=np.float64)
    n = pts.shape[0]
    edges = np.zeros((3 * n, 2), np.int32)
    weight = np.zeros(3 * n, np.int32)
    tri = _delaunay(pts)
    if tri is None:
        return edges, weight
    simplices = tri.simplices.astype(np.int32)
    e = np.concatenate([simplices[:, [0, 1]], simplices[:, [1, 2]], simplices[:, [2, 0]]])
    e = np.sort(e, axis=1).astype(np.int64)
    # (unique pairs, in the order of np.unique(..., axis=0), through one integer key each:
    # ten times faster)
    key = np.unique(e[:, 0] * n + e[:, 1])
    e = np.stack([key // n, key % n], axis=1)
    edges[: e.shape[0]] = e
    weight[: e.shape[0]] = 1
    return edges, weight


def locate_host(nodes: ArrayLike, x: ArrayLike, y: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """For each point `(x, y)`, the node indices of the Delaunay triangle of `nodes` that
    holds it (on the host; the nearest node three times for a point outside the convex
    hull), the rows `barycentric_weights` takes, and a flag (0 when the nodes cannot be
    triangulated or a point is not finite: the rows are then zeros). Shared by both
    backends."""
    from scipy.spatial import KDTree

    pts = np.asarray(nodes, dtype=np.float64)
    q = np.stack([np.asarray(x, np.float64), np.asarray(y, np.float64)], axis=1)
    tri = _delaunay(pts)
    if tri is None or not np.all(np.isfinite(q)):
        return np.zeros((q.shape[0], 3), np.int32), np.zeros((), np.int32)
    s = tri.find_simplex(q)
    verts = tri.simplices[np.maximum(s, 0)].astype(np.int32)
    out = s < 0
    if out.any():
        nearest = np.asarray(KDTree(pts).query(q[out])[1], dtype=np.int32)
        verts[out] = nearest[:, None]
    return verts, np.ones((), np.int32)


def barycentric_weights(xp, p, verts, x, y):
    """Barycentric weights `(m, 3)` of points `(x, y)` in the triangles of vertices `p`
    (`(m, 3, 2)`, node indices `verts`); a point located at a single node (outside the
    convex hull: `verts` repeats it) or in a degenerate triangle gets `(1, 0, 0)`. `xp` is
    the array namespace (`jax.numpy`, or NumPy for the Numba backend)."""
    x0, y0 = p[:, 0, 0], p[:, 0, 1]
    ax, ay = p[:, 1, 0] - x0, p[:, 1, 1] - y0
    bx, by = p[:, 2, 0] - x0, p[:, 2, 1] - y0
    det = ax * by - ay * bx
    single = (verts[:, 0] == verts[:, 1]) | (det == 0)
    safe = xp.where(single, 1.0, det)
    dx, dy = x - x0, y - y0
    u = (dx * by - dy * bx) / safe
    v = (ax * dy - ay * dx) / safe
    w = xp.stack([1 - u - v, u, v], axis=1)
    return xp.where(single[:, None], xp.asarray([1.0, 0.0, 0.0], dtype=w.dtype), w)


class TriangulationGeometry(AbstractGeometry):
    """Nodes at arbitrary source-plane positions, joined by their Delaunay triangulation
    (computed on the host with `scipy.spatial.Delaunay` in a host callback, so it
    is exact for the current nodes and has fixed-shape outputs: `edges` holds the
    triangulation's `<= 3n` edges padded with `(0, 0)`, marked by `edge_weight` 0).

    Points are interpolated with barycentric weights in their triangle (differentiable with
    respect to the points and the nodes); points outside the convex hull take the value of
    their nearest node. Nodes that cannot be triangulated (non-finite or degenerate, as a
    solver's trial step far from the data can give) yield NaN weights, so the inversion
    reports an invalid (`-inf`) evidence instead of raising."""

    points: Float[Array, "n 2"] = eqx.field(metadata=describe(fixed=True))
    edges: Int[Array, "e 2"] = eqx.field(metadata=describe(fixed=True))
    edge_weight: Int[Array, " e"] = eqx.field(metadata=describe(fixed=True))

    @classmethod
    def triangulate(cls, nodes: Float[Array, "n 2"]) -> "TriangulationGeometry":
        """The Delaunay triangulation of `nodes` (source-plane `(x, y)`, arcsec)."""
        n = nodes.shape[0]
        shapes = (
            jax.ShapeDtypeStruct((3 * n, 2), jnp.int32),
            jax.ShapeDtypeStruct((3 * n,), jnp.int32),
        )
        edges, weight = host_callback(
            triangulate_host, shapes, jax.lax.stop_gradient(nodes), vmap_method="sequential"
        )
        return cls(points=nodes, edges=edges, edge_weight=weight)

    @property
    def n_pixels(self) -> int:
        return int(self.points.shape[0])

    def nodes(self) -> Float[Array, "n 2"]:
        return self.points

    def interpolation(
        self, x: Float[Array, " m"], y: Float[Array, " m"]
    ) -> tuple[Int[Array, "m 3"], Float[Array, "m 3"]]:
        shapes = (
            jax.ShapeDtypeStruct((x.shape[0], 3), jnp.int32),
            jax.ShapeDtypeStruct((), jnp.int32),
        )
        verts, ok = host_callback(
            locate_host,
            shapes,
            jax.lax.stop_gradient(self.points),
            jax.lax.stop_gradient(x),
            jax.lax.stop_gradient(y),
            vmap_method="sequential",
        )
        w = barycentric_weights(jnp, self.points[verts], verts, x, y)
        # nodes the host could not triangulate: NaN weights make the evidence invalid
        return verts, jnp.where(ok > 0, w, jnp.nan)

    def gradient_rows(self) -> SparseRows:
        w = self.edge_weight.astype(self.points.dtype)
        return self.edges, jnp.stack([w, -w], axis=1)

    def curvature_matrix(self) -> Float[Array, "n n"]:
        # the graph Laplacian L = D - A of the triangulation; curvature = L^T L
        lap = gram_entries(self.gradient_rows(), self.n_pixels).todense()
        return lap.T @ lap


def gram_entries(
    rows: SparseRows, n: int, weights: Float[Array, " r"] | None = None
) -> SparseSymmetric:
    """`G^T diag(weights) G` (`n x n`) by its entries, for sparse rows `G`: each pair of a
    row's entries once (a pair on one index counted twice, as the product does)."""
    return SparseSymmetric(*gram_values(jnp, *rows, weights), n)


def gram_values(xp, idx, coef, weights=None) -> tuple[Any, Any, Any]:
    """The entries of `gram_entries` (rows, columns, values; flat), for sparse rows `(idx,
    coef)` and optional row `weights`; `xp` is the array namespace (`jax.numpy`, or NumPy
    for the Numba backend)."""
    a, b = np.triu_indices(idx.shape[1])
    ia, ib = idx[:, a], idx[:, b]
    twice = xp.where((ia == ib) & (a < b)[None, :], 2.0, 1.0)
    v = coef[:, a] * coef[:, b] * twice
    if weights is not None:
        v = v * weights[:, None]
    return ia.reshape(-1), ib.reshape(-1), v.reshape(-1)
