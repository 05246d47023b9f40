"""The "sparse" route of the curvature matrix: `F = C^T C` and `E = C^T V` with
`C = W^(1/2) B M`, computed tile by tile on the host CPU by Numba kernels (a JAX
host callback, `equilens._callback.host_callback`, with a custom vector-Jacobian product).

The image is cut into `T x T` tiles. For one tile, the rows of `C` (its mask pixels) are
lit only by the mapped pixels within a PSF half-width of it, which map to a small set `S`
of source pixels: the block `C[tile, S]` is built densely (one axpy of a tabulated PSF
column, over the span of its non-zero tile positions, per interpolation weight), then
`F[S, S] += C_t C_t^T` (BLAS `syrk`, into `F`'s upper triangle, mirrored once at the end)
and `E[S] += C_t V_t`. The cost is
`O(n_mask ((T + 2h)^2 k + |S|^2))`: it never touches the `n_mask x n_source` product of
the "dense" route nor the `(2K-1)^2` neighbours per pixel of the "w_tilde" route. The
backward pass takes each block from the forward call (the whole system's host solve keeps
them, about `8 T^2 sum |S|` bytes, 9 MiB for the benchmark's 32x32 mesh) or builds it
again, and forms `dC = (Fbar + Fbar^T)[S, S] C + Ebar V^T` (BLAS `symm` on the small
block's upper triangle), then `wbar[p, i] = <dC[a_pi], psf column>` and
`Vbar = C^T Ebar`.

Tiles are split into one chunk per Numba thread, each chunk with its own accumulator
(`numba.set_num_threads` or `NUMBA_NUM_THREADS` sets how many cores are used); BLAS runs
single-threaded inside the kernels (threadpoolctl), the threads being Numba's.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from .._callback import host_callback

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


def _callback(name: str, shapes, *operands, extra: tuple = ()):
    """Runs kernel `name` on the host: `kernel(n_threads, *extra, *operands)` with integer
    operands as int64 and floating ones as float64; outputs in the dtype of `shapes`."""

    def host(*arrays):
        from ..numba._runtime import host64, run_kernel

        out = run_kernel(name, *extra, *host64(*arrays))
        return tuple(o.astype(s.dtype, copy=False) for o, s in zip(out, shapes, strict=True))

    arrays = (*operands[:-1], *table_arrays(operands[-1]))
    return host_callback(host, shapes, *arrays, vmap_method="sequential")


def _forward(idx, w, values, inv_sigma, n_s, tables):
    shapes = (
        jax.ShapeDtypeStruct((n_s, n_s), w.dtype),
        jax.ShapeDtypeStruct((n_s, values.shape[1]), w.dtype),
    )
    return _callback("forward", shapes, idx, w, values, inv_sigma, tables, extra=(n_s,))


@eqx.filter_custom_vjp
def _sparse_gram(diff, idx, inv_sigma, n_s, tables):
    w, values = diff
    return _forward(idx, w, values, inv_sigma, n_s, tables)


@_sparse_gram.def_fwd
def _sparse_gram_fwd(perturbed, diff, idx, inv_sigma, n_s, tables):
    del perturbed
    w, values = diff
    return _forward(idx, w, values, inv_sigma, n_s, tables), None


@_sparse_gram.def_bwd
def _sparse_gram_bwd(residuals, g, perturbed, diff, idx, inv_sigma, n_s, tables):
    del residuals, perturbed
    w, values = diff
    f_bar, e_bar = g
    # a symbolic-zero cotangent arrives as None (or a scalar): materialise it
    f_bar = jnp.broadcast_to(0.0 if f_bar is None else f_bar, (n_s, n_s)).astype(w.dtype)
    e_bar = jnp.broadcast_to(0.0 if e_bar is None else e_bar, (n_s, values.shape[1]))
    shapes = (jax.ShapeDtypeStruct(w.shape, w.dtype), jax.ShapeDtypeStruct(values.shape, w.dtype))
    return _callback(
        "backward",
        shapes,
        idx,
        w,
        values,
        inv_sigma,
        f_bar,
        e_bar.astype(w.dtype),
        tables,
    )


def sparse_gram(
    idx: Int[Array, "p k"],
    w: Float[Array, "p k"],
    values: Float[Array, "n m"],
    inv_sigma: Float[Array, " n"],
    n_source: int,
    tables: SparseTables,
) -> tuple[Float[Array, "n_source n_source"], Float[Array, "n_source m"]]:
    """`F = C^T C` and `E = C^T V` with `C = W^(1/2) B M` (`n` mask pixels x `n_source`),
    for the interpolation `idx`, `w` over the mapped pixels and `V = values` on the mask
    pixels; differentiable (reverse mode) in `w` and `values`, not in the noise or the
    PSF (data). Runs on the host CPU (Numba)."""
    fixed = jax.lax.stop_gradient((inv_sigma, tables))
    return _sparse_gram((w, values), idx, fixed[0], n_source, fixed[1])
