"""Pixel grids, supersampling and masks.

Conventions (used throughout equilens): angles are in arcseconds; an image array `a[i, j]`
has x growing with the column `j` and y growing with the row `i` (plot with
`origin="lower"`); a grid is centred on the array centre unless an `origin` is given, which
is then the (x, y) position of the array centre.
"""

import functools
import math

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, Bool, Float, Int

#: `Grid.bin` adds the strided sub-images up to this supersampling factor (s^2 of them),
#: and takes the reshaped mean above it
STRIDED_BIN_MAX = 4


def _check_positive_int(name: str, value: int) -> None:
    if not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


class Grid(eqx.Module):
    """A regular pixel grid on the sky.

    **Arguments:**

    - `shape`: `(ny, nx)`, the number of pixel rows and columns.
    - `pixel_scale`: pixel side in arcsec.
    - `origin`: `(x, y)` position of the array centre in arcsec (default `(0, 0)`).
    - `supersampling`: integer factor; each pixel is evaluated on `supersampling^2`
      sub-pixels and binned back by averaging (default 1: pixel centres only).

    - `split`: `(mesh, axis)`, a `jax.sharding.Mesh` and one of its axis names, or None
      (default): under `jit`, arrays computed per pixel of this grid (its coordinates, the
      ray-traced sub-pixels, the rows of a pixelized source's mapping) have their rows
      split over that mesh axis (`jax.lax.with_sharding_constraint`; rows need not divide
      the device count). Set by `equilens.shard`; it changes where the work runs, never
      the numbers beyond rounding.

    `grid.x`, `grid.y` are the pixel-centre coordinates, each of shape `(ny, nx)`.
    """

    shape: tuple[int, int] = eqx.field(static=True)
    pixel_scale: float = eqx.field(static=True)
    origin: tuple[float, float] = eqx.field(static=True, default=(0.0, 0.0))
    supersampling: int = eqx.field(static=True, default=1)
    split: tuple[Mesh, str] | None = eqx.field(static=True, default=None)

    def __check_init__(self):
        if len(self.shape) != 2:
            raise ValueError(f"Grid.shape must be (ny, nx), got {self.shape!r}")
        for n in self.shape:
            _check_positive_int("Grid.shape entries", n)
        if not (
            isinstance(self.pixel_scale, float | int)
            and math.isfinite(self.pixel_scale)
            and self.pixel_scale > 0
        ):
            raise ValueError(
                f"Grid.pixel_scale must be a positive number, got {self.pixel_scale!r}"
            )
        _check_positive_int("Grid.supersampling", self.supersampling)

    def __init__(
        self,
        shape: tuple[int, int],
        pixel_scale: float,
        origin: tuple[float, float] = (0.0, 0.0),
        supersampling: int = 1,
        split: tuple[Mesh, str] | None = None,
    ):
        if len(shape) != 2:
            raise ValueError(f"Grid.shape must be (ny, nx), got {tuple(shape)!r}")
        for n in shape:
            _check_positive_int("Grid.shape entries", n)
        self.shape = (int(shape[0]), int(shape[1]))
        self.pixel_scale = float(pixel_scale)
        self.origin = (float(origin[0]), float(origin[1]))
        self.supersampling = int(supersampling)
        if split is not None and not (
            isinstance(split, tuple)
            and len(split) == 2
            and isinstance(split[0], Mesh)
            and split[1] in split[0].axis_names
        ):
            raise ValueError(f"Grid.split must be (mesh, one of its axis names), got {split!r}")
        self.split = split

    def split_rows(self, a: Float[Array, "rows ..."]) -> Float[Array, "rows ..."]:
        """`a` with its first axis split over the devices of `split` (a sharding
        constraint, under `jit`); `a` itself when the grid is not split or outside a trace
        (eager values stay where JAX puts them)."""
        if self.split is None or not isinstance(a, jax.core.Tracer):
            return a
        mesh, axis = self.split
        spec = PartitionSpec(axis, *([None] * (a.ndim - 1)))
        return jax.lax.with_sharding_constraint(a, NamedSharding(mesh, spec))

    def gathered(self, a: Float[Array, "..."]) -> Float[Array, "..."]:
        """`a` replicated on every device of `split` (under `jit`): what an FFT
        convolution of a split image needs (XLA's partitioning of an FFT along a split
        axis is not used: in complex128 it fails to compile); `a` itself when the grid is
        not split or outside a trace."""
        if self.split is None or not isinstance(a, jax.core.Tracer):
            return a
        return jax.lax.with_sharding_constraint(a, NamedSharding(self.split[0], PartitionSpec()))

    @property
    def pixel_area(self) -> float:
        """Area of one pixel in arcsec^2."""
        return self.pixel_scale**2

    def _axes(self, factor: int) -> tuple[Float[Array, " nx"], Float[Array, " ny"]]:
        ny, nx = self.shape
        dtype = jnp.result_type(float)
        # Sub-pixel centres: offsets (k + 1/2)/factor - 1/2 around each pixel centre.
        jx = (jnp.arange(nx * factor, dtype=dtype) + 0.5) / factor - 0.5
        iy = (jnp.arange(ny * factor, dtype=dtype) + 0.5) / factor - 0.5
        xs = (jx - (nx - 1) / 2) * self.pixel_scale + self.origin[0]
        ys = (iy - (ny - 1) / 2) * self.pixel_scale + self.origin[1]
        return xs, ys

    def coordinates(
        self, supersampled: bool = False
    ) -> tuple[Float[Array, "rows cols"], Float[Array, "rows cols"]]:
        """`(x, y)` of pixel centres, or of sub-pixel centres if `supersampled` (shape
        `(ny * s, nx * s)`)."""
        xs, ys = self._axes(self.supersampling if supersampled else 1)
        y, x = jnp.meshgrid(ys, xs, indexing="ij")
        return self.split_rows(x), self.split_rows(y)

    @property
    def x(self) -> Float[Array, "ny nx"]:
        """x coordinate (arcsec) of each pixel centre; grows with the column index."""
        return self.coordinates()[0]

    @property
    def y(self) -> Float[Array, "ny nx"]:
        """y coordinate (arcsec) of each pixel centre; grows with the row index."""
        return self.coordinates()[1]

    def bin(self, image: Float[Array, "rows cols"]) -> Float[Array, "ny nx"]:
        """Averages a supersampled array `(ny * s, nx * s)` back to `(ny, nx)`."""
        s = self.supersampling
        ny, nx = self.shape
        if image.shape != (ny * s, nx * s):
            raise ValueError(f"bin expects an array of shape {(ny * s, nx * s)}, got {image.shape}")
        if s == 1:
            return image
        if s <= STRIDED_BIN_MAX:
            # the s^2 strided sub-images added elementwise: on a CPU 2x faster than the
            # reshaped mean (and 1.7x under forward-mode derivatives), whose reduction over
            # the interleaved axes XLA does not vectorise
            parts = [image[i::s, j::s] for i in range(s) for j in range(s)]
            return functools.reduce(jnp.add, parts) / (s * s)
        return image.reshape(ny, s, nx, s).mean(axis=(1, 3))

    def padded(self, shape: tuple[int, int]) -> "Grid":
        """A larger grid of `shape` (>= this one's) whose first `(ny, nx)` pixels (rows and
        columns from 0) coincide with this grid's pixels; used to evaluate a model directly
        on the zero-padded domain of an FFT convolution."""
        ny, nx = self.shape
        if shape[0] < ny or shape[1] < nx:
            raise ValueError(f"padded shape {shape} is smaller than the grid {self.shape}")
        ox = self.origin[0] + 0.5 * (shape[1] - nx) * self.pixel_scale
        oy = self.origin[1] + 0.5 * (shape[0] - ny) * self.pixel_scale
        return Grid(shape, self.pixel_scale, (ox, oy), self.supersampling, self.split)

    def with_supersampling(self, supersampling: int) -> "Grid":
        """The same grid with another supersampling factor."""
        return Grid(self.shape, self.pixel_scale, self.origin, supersampling, self.split)

    def with_split(self, split: tuple[Mesh, str] | None) -> "Grid":
        """The same grid with its rows split over `split` (`(mesh, axis)`) or not (None)."""
        return Grid(self.shape, self.pixel_scale, self.origin, self.supersampling, split)

    def circular_mask(
        self, radius: float, center: tuple[float, float] = (0.0, 0.0)
    ) -> Bool[np.ndarray, "ny nx"]:
        """Boolean array, True for pixels whose centre lies within `radius` arcsec of
        `center` (True = pixel used)."""
        x, y = np.asarray(self.x), np.asarray(self.y)
        return (x - center[0]) ** 2 + (y - center[1]) ** 2 <= float(radius) ** 2

    def annular_mask(
        self,
        inner_radius: float,
        outer_radius: float,
        center: tuple[float, float] = (0.0, 0.0),
    ) -> Bool[np.ndarray, "ny nx"]:
        """Boolean array, True for pixels with `inner_radius <= r <= outer_radius` (arcsec)."""
        if float(inner_radius) >= float(outer_radius):
            raise ValueError(
                f"annular_mask needs inner_radius < outer_radius, got {inner_radius}, "
                f"{outer_radius}"
            )
        x, y = np.asarray(self.x), np.asarray(self.y)
        r2 = (x - center[0]) ** 2 + (y - center[1]) ** 2
        return (r2 >= float(inner_radius) ** 2) & (r2 <= float(outer_radius) ** 2)

    def masked(self, mask: Bool[np.ndarray, "ny nx"]) -> "MaskedGrid":
        """The unmasked pixels of this grid as a flat list (see `MaskedGrid`)."""
        return MaskedGrid(self, mask)


class MaskedGrid(eqx.Module):
    """The pixels of a `Grid` where `mask` is True, as flat arrays.

    `x`, `y` have shape `(n,)` with `n = mask.sum()`, in row-major order; `scatter` puts
    `n` values back into a full `(ny, nx)` image (zero outside the mask).
    """

    grid: Grid
    indices: Int[Array, " n"]
    n_pixels: int = eqx.field(static=True)

    def __init__(self, grid: Grid, mask: Bool[np.ndarray, "ny nx"]):
        mask = np.asarray(mask, dtype=bool)
        if mask.shape != grid.shape:
            raise ValueError(f"mask shape {mask.shape} does not match grid shape {grid.shape}")
        if not mask.any():
            raise ValueError("mask selects no pixel (it is empty)")
        self.grid = grid
        self.indices = jnp.asarray(np.flatnonzero(mask))
        self.n_pixels = int(mask.sum())

    @property
    def x(self) -> Float[Array, " n"]:
        return self.grid.x.reshape(-1)[self.indices]

    @property
    def y(self) -> Float[Array, " n"]:
        return self.grid.y.reshape(-1)[self.indices]

    def scatter(self, values: Float[Array, " n"]) -> Float[Array, "ny nx"]:
        full = jnp.zeros(self.grid.shape[0] * self.grid.shape[1], dtype=values.dtype)
        return full.at[self.indices].set(values).reshape(self.grid.shape)
