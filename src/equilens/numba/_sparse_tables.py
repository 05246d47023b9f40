"""The tables of the "sparse" route's tiles (NumPy, once per dataset): which mask pixels
each `T x T` tile holds, which mapped pixels light it and through which PSF column (see
`equilens.numba._sparse_route` for the route itself)."""

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

#: Tile side (pixels) of the sparse route; 8 measured fastest on one CPU core for 21x21
#: PSFs (benchmarks/bench_pixelized.py).
TILE = 8


class SparseTables(eqx.Module):
    """Per-dataset tables of the tiled route (built once, NumPy): for each tile the mask
    pixel (row of `C`, index into the mask pixels; -1 for none) at each of its `T^2`
    positions, and the mapped pixels (rows of the interpolation arrays) that light it with
    the index of their offset in `psf_columns` (`(n_offsets, T^2)`: the PSF weight of a
    mapped pixel at that offset from the tile's corner on each tile position), with the
    span `[first, last + 1)` of each column's non-zero positions (`psf_span`)."""

    tile_rows: Int[Array, "n_tiles t2"]
    input_ptr: Int[Array, " n_tiles_plus_1"]
    input_pixel: Int[Array, " n_inputs"]
    input_offset: Int[Array, " n_inputs"]
    psf_columns: Float[Array, "n_offsets t2"]
    psf_span: Int[Array, "n_offsets 2"]


def sparse_tables(
    kernel: Float[np.ndarray, "ky kx"],
    shape: tuple[int, int],
    pixels: Int[np.ndarray, " n"],
    mapped: Int[np.ndarray, " p"],
    tile: int = TILE,
) -> SparseTables:
    """Builds the tiled route's tables for a `kernel` on an image of `shape`, mask pixels
    `pixels` (flat indices; the rows of `C`) and mapped pixels `mapped` (flat indices; the
    rows of the interpolation arrays)."""
    k = np.asarray(kernel, dtype=np.float64)
    ky, kx = k.shape
    hy, hx = ky // 2, kx // 2
    ny, nx = shape
    wy, wx = tile + 2 * hy, tile + 2 * hx
    # psf[o, s]: weight of a mapped pixel at offset o = (dy, dx) (from the tile corner
    # minus the half-widths) on tile position s = (sy, sx): kernel[sy - dy + 2hy, ...]
    # (a convolution: out(r) = sum_q kernel(r - q + h) in(q)).
    dy, dx = np.divmod(np.arange(wy * wx), wx)
    sy, sx = np.divmod(np.arange(tile * tile), tile)
    ry = sy[None, :] - dy[:, None] + 2 * hy
    rx = sx[None, :] - dx[:, None] + 2 * hx
    inside = (ry >= 0) & (ry < ky) & (rx >= 0) & (rx < kx)
    psf = np.where(inside, k[np.clip(ry, 0, ky - 1), np.clip(rx, 0, kx - 1)], 0.0)
    used = np.any(psf != 0.0, axis=1)
    compact = np.full(wy * wx, -1, dtype=np.int64)
    compact[used] = np.arange(int(used.sum()))
    psf = psf[used]
    nonzero = psf != 0.0
    span = np.stack(
        [np.argmax(nonzero, axis=1), tile * tile - np.argmax(nonzero[:, ::-1], axis=1)], axis=1
    )

    row_of = np.full(ny * nx, -1, dtype=np.int64)
    row_of[pixels] = np.arange(pixels.shape[0])
    input_of = np.full(ny * nx, -1, dtype=np.int64)
    input_of[mapped] = np.arange(mapped.shape[0])
    rows_2d = row_of.reshape(ny, nx)
    inputs_2d = input_of.reshape(ny, nx)

    tile_rows, ptr, pix, off = [], [0], [], []
    for r0 in range(0, ny, tile):
        for c0 in range(0, nx, tile):
            rows = np.full((tile, tile), -1, dtype=np.int64)
            block = rows_2d[r0 : r0 + tile, c0 : c0 + tile]
            rows[: block.shape[0], : block.shape[1]] = block
            if np.all(rows < 0):
                continue
            qy0, qx0 = r0 - hy, c0 - hx
            ya, xa = max(qy0, 0), max(qx0, 0)
            window = inputs_2d[ya : qy0 + wy, xa : qx0 + wx]
            wyy, wxx = np.nonzero(window >= 0)
            o = compact[(wyy + ya - qy0) * wx + (wxx + xa - qx0)]
            keep = o >= 0
            tile_rows.append(rows.reshape(-1))
            pix.append(window[wyy, wxx][keep])
            off.append(o[keep])
            ptr.append(ptr[-1] + int(keep.sum()))
    return SparseTables(
        tile_rows=jnp.asarray(np.stack(tile_rows)),
        input_ptr=jnp.asarray(np.asarray(ptr, dtype=np.int64)),
        input_pixel=jnp.asarray(np.concatenate(pix)),
        input_offset=jnp.asarray(np.concatenate(off)),
        psf_columns=jnp.asarray(psf),
        psf_span=jnp.asarray(span.astype(np.int64)),
    )


def table_arrays(tables: SparseTables) -> tuple:
    """The arrays of `tables`, in the kernels' order."""
    return (
        tables.tile_rows,
        tables.input_ptr,
        tables.input_pixel,
        tables.input_offset,
        tables.psf_columns,
        tables.psf_span,
    )
