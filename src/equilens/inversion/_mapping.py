"""How the source values light the image: the pixels a source is mapped to, the mapping
`M` and its transpose, the blurred mapping `B M` (the "dense" route) and the banded
`W~ = B^T W B` table with `F = M^T W~ M` (the "w_tilde" route).

Notation (Suyu et al. 2006; Dye & Warren 2005; as PyAutoLens): `M` maps source values to
the image pixels they light (sparse: node indices and weights per image pixel), `B` is the
PSF convolution, `W = diag(1/sigma^2)` on the mask.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from ..psf import FFTConvolution


def mapped_pixels(
    mask: Bool[np.ndarray, "ny nx"], kernel_shape: tuple[int, int]
) -> Int[np.ndarray, " p"]:
    """Flat indices of the pixels whose light can reach the mask through the PSF: the mask
    grown by the kernel's half-widths (the pixels a source is mapped to)."""
    from scipy.ndimage import binary_dilation

    m = np.asarray(mask, dtype=bool)
    grown = binary_dilation(m, structure=np.ones(kernel_shape, dtype=bool))
    return np.flatnonzero(grown | m)


def w_tilde_table(
    kernel: Float[np.ndarray, "ky kx"],
    weight: Float[np.ndarray, "ny nx"],
    mapped: Int[np.ndarray, " p"],
) -> tuple[Int[np.ndarray, "p o"], Float[np.ndarray, "p o"]]:
    """`W~ = B^T W B` restricted to the `mapped` pixels, as a banded table: for each mapped
    pixel `p` and each offset `o` within two kernel half-widths, the index (into `mapped`;
    `len(mapped)` where the neighbour is not mapped) of `q = p + o` and
    `W~[p, q] = sum_r weight[r] kernel[r - p] kernel[r - q]`. NumPy/SciPy, once per dataset."""
    from scipy.signal import correlate

    k = np.asarray(kernel, dtype=np.float64)
    ky, kx = k.shape
    hy, hx = ky // 2, kx // 2
    w = np.asarray(weight, dtype=np.float64)
    ny, nx = w.shape
    n_p = mapped.shape[0]
    lookup = np.full(ny * nx, n_p, dtype=np.int64)
    lookup[mapped] = np.arange(n_p)
    pr, pc = np.divmod(mapped, nx)
    offsets = [(dy, dx) for dy in range(-2 * hy, 2 * hy + 1) for dx in range(-2 * hx, 2 * hx + 1)]
    nbr = np.full((n_p, len(offsets)), n_p, dtype=np.int64)
    val = np.zeros((n_p, len(offsets)))
    padded = np.zeros((ky + 2 * ky, kx + 2 * kx))
    for j, (dy, dx) in enumerate(offsets):
        # prod[u] = kernel[u] kernel[u - o] on the kernel's support (u centred)
        shifted = padded.copy()
        shifted[ky + dy : 2 * ky + dy, kx + dx : 2 * kx + dx] = k
        prod = k * shifted[ky : 2 * ky, kx : 2 * kx]
        if not prod.any():
            continue
        # W~_o(p) = sum_u w(p + u) prod(u): a correlation of the weights with prod
        corr = correlate(w, prod, mode="same", method="fft" if ky * kx > 50 else "direct")
        qr, qc = pr + dy, pc + dx
        ok = (qr >= 0) & (qr < ny) & (qc >= 0) & (qc < nx)
        q = np.where(ok, qr * nx + qc, 0)
        idx = np.where(ok, lookup[q], n_p)
        nbr[:, j] = idx
        val[:, j] = np.where(idx < n_p, corr.reshape(-1)[mapped], 0.0)
    keep = np.any(val != 0.0, axis=0)
    return nbr[:, keep], val[:, keep]


def blur_mapping(
    idx: Int[Array, "p k"],
    w: Float[Array, "p k"],
    n_source: int,
    mapped: Int[Array, " p"],
    conv: FFTConvolution,
) -> Float[Array, "n_source ny nx"]:
    """`B M` as `n_source` images (each source pixel at unit value, blurred)."""
    ny, nx = conv.image_shape
    px = conv.fft_shape[1]
    cols = (mapped // nx) * px + mapped % nx
    m = jnp.zeros((n_source, ny * px), w.dtype).at[idx, cols[:, None]].add(w)
    return jax.vmap(conv.convolve_padded)(m.reshape(n_source, ny, px))


def curvature_w_tilde(
    idx: Int[Array, "p k"],
    w: Float[Array, "p k"],
    n_source: int,
    neighbours: Int[Array, "p o"],
    w_tilde: Float[Array, "p o"],
) -> Float[Array, "n_source n_source"]:
    """`F = M^T W~ M` from the banded `W~` table (see `w_tilde_table`)."""
    n_p, k = idx.shape
    idx_pad = jnp.concatenate([idx, jnp.zeros((1, k), idx.dtype)])
    w_pad = jnp.concatenate([w, jnp.zeros((1, k), w.dtype)])
    # H = W~ M (mapped pixels x source pixels), then F = M^T H
    vals = w_tilde[:, :, None] * w_pad[neighbours]
    cols = idx_pad[neighbours]
    rows = jnp.broadcast_to(jnp.arange(n_p)[:, None, None], cols.shape)
    h = jnp.zeros((n_p, n_source), w.dtype).at[rows, cols].add(vals)
    contrib = (w[:, :, None] * h[:, None, :]).reshape(n_p * k, n_source)
    return jax.ops.segment_sum(contrib, idx.reshape(-1), n_source)


def map_to_source(
    idx: Int[Array, "p k"], w: Float[Array, "p k"], values: Float[Array, "p ..."], n_source: int
) -> Float[Array, "n_source ..."]:
    """`M^T v` for values `v` on the mapped pixels."""
    contrib = w.reshape(w.shape + (1,) * (values.ndim - 1)) * values[:, None]
    flat = contrib.reshape((-1, *values.shape[1:]))
    return jax.ops.segment_sum(flat, idx.reshape(-1), n_source)


def map_to_image(
    idx: Int[Array, "p k"], w: Float[Array, "p k"], values: Float[Array, " n_source"]
) -> Float[Array, " p"]:
    """`M s`: the (unblurred) flux of source `s` in each mapped pixel."""
    return jnp.sum(w * values[idx], axis=1)
