"""Numba kernels of the tiled "sparse" curvature route (see `equilens.source._sparse`) and
of its host Cholesky solve (`equilens.source._host_linalg`).

Imported only when that route runs (the first call compiles them, or loads them from
Numba's cache). The kernels are private and marked `no_type_check` (the test suite's
jaxtyping import hook would otherwise wrap them, which Numba cannot compile or cache).
"""

import ctypes
import functools
from typing import no_type_check

import numba
import numpy as np


def _blas(name: str):
    """A BLAS routine of SciPy's (Fortran calling convention: every argument a pointer),
    passed to the kernels as an argument (so that Numba can still cache them)."""
    from numba.extending import get_cython_function_address

    ptr = ctypes.c_void_p
    return ctypes.CFUNCTYPE(None, *([ptr] * 10))(
        get_cython_function_address("scipy.linalg.cython_blas", name)
    )


_SYRK = _blas("dsyrk")
# Reassociated sums (vectorised dot products) and fused multiply-adds; no assumptions
# about NaN or infinity.
_REASSOC = {"reassoc", "contract"}


@numba.njit(cache=True, nogil=True)
@no_type_check
def syrk_lower(syrk, ct, g):
    # g (n x n, C order): its lower triangle <- ct ct^T (ct: n x k, C order), by BLAS syrk
    # on the Fortran-order views (ct^T: k x n; g^T's upper triangle is g's lower)
    n, k = ct.shape
    uplo = np.array([ord("U")], np.uint8)
    trans = np.array([ord("T")], np.uint8)
    nn = np.array([n], np.int32)
    kk = np.array([k], np.int32)
    alpha = np.array([1.0])
    beta = np.array([0.0])
    lda = np.array([k], np.int32)
    ldc = np.array([g.shape[1]], np.int32)
    syrk(
        uplo.ctypes,
        trans.ctypes,
        nn.ctypes,
        kk.ctypes,
        alpha.ctypes,
        ct.ctypes,
        lda.ctypes,
        beta.ctypes,
        g.ctypes,
        ldc.ctypes,
    )


@numba.njit(cache=True, nogil=True, fastmath=_REASSOC)
@no_type_check
def build_block(
    t,
    idx,
    w,
    tile_rows,
    input_ptr,
    input_pixel,
    input_offset,
    psf,
    inv_sigma,
    values,
    local,
    members,
    block,
    vt,
):
    # C[tile, S] into block[:n_local] (members: the source pixels of S, ascending, so that
    # the scatters into F walk its rows in order; block[n_s]: the tile's inverse noise) and
    # the tile's rows of `values` into vt (zero where a tile position is not a mask pixel)
    t2 = tile_rows.shape[1]
    k = idx.shape[1]
    n_s = local.shape[0]
    j0 = input_ptr[t]
    j1 = input_ptr[t + 1]
    n_local = 0
    for j in range(j0, j1):
        p = input_pixel[j]
        for i in range(k):
            a = idx[p, i]
            if a >= 0 and a < n_s and local[a] < 0:
                local[a] = 0
                members[n_local] = a
                n_local += 1
    members[:n_local].sort()
    for r in range(n_local):
        local[members[r]] = r
        block[r, :] = 0.0
    for j in range(j0, j1):
        p = input_pixel[j]
        column = psf[input_offset[j]]
        for i in range(k):
            a = idx[p, i]
            if a < 0 or a >= n_s:
                continue
            row = block[local[a]]
            wt = w[p, i]
            for s in range(t2):
                row[s] += wt * column[s]
    sig = block[n_s]
    for s in range(t2):
        r = tile_rows[t, s]
        sig[s] = inv_sigma[r] if r >= 0 else 0.0
        for q in range(values.shape[1]):
            vt[s, q] = values[r, q] if r >= 0 else 0.0
    # rows of C = W^(1/2) B M: each block row times the tile's inverse noise (row-wise, so
    # that the scaling runs along memory)
    for a in range(n_local):
        row = block[a]
        for s in range(t2):
            row[s] *= sig[s]
    return n_local


#: Memory for the extra per-thread accumulators of F in the forward kernel (kept between
#: calls: fresh pages would cost more than the work at 16 threads); fewer threads are used
#: in the tile loop when it would take more.
ACCUMULATOR_BYTES = 128 * 2**20


@functools.lru_cache(maxsize=1)
def _accumulators(n: int, n_s: int) -> np.ndarray:
    return np.empty((n, n_s, n_s))


def forward(n_threads, n_s, *arrays):
    """`F = C^T C` and `E = C^T V` (see `equilens.source._sparse`)."""
    n_tiles = arrays[4].shape[0]
    n_chunks = max(1, min(n_threads, n_tiles, 1 + ACCUMULATOR_BYTES // (8 * n_s * n_s)))
    return _forward(n_chunks, _SYRK, _accumulators(n_chunks - 1, n_s), n_s, *arrays)


@numba.njit(cache=True, nogil=True, parallel=True)
@no_type_check
def _forward(
    n_chunks,
    syrk,
    parts,
    n_s,
    idx,
    w,
    values,
    inv_sigma,
    tile_rows,
    input_ptr,
    input_pixel,
    input_offset,
    psf,
):
    # tiles in n_chunks chunks, one per thread, each accumulating the upper triangle of F
    # (chunk 0 into the output, the others into `parts`), summed in parallel at the end
    n_tiles, t2 = tile_rows.shape
    m = values.shape[1]
    out = np.empty((n_s, n_s))
    e_parts = np.zeros((n_chunks, n_s, m))
    for c in numba.prange(n_chunks):
        f = out if c == 0 else parts[c - 1]
        for i in range(n_s):
            f[i, i:] = 0.0
        local = np.full(n_s, -1, dtype=np.int64)
        members = np.empty(n_s, dtype=np.int64)
        block = np.empty((n_s + 1, t2))
        vt = np.empty((t2, m))
        e = e_parts[c]
        for t in range(c * n_tiles // n_chunks, (c + 1) * n_tiles // n_chunks):
            n_local = build_block(
                t,
                idx,
                w,
                tile_rows,
                input_ptr,
                input_pixel,
                input_offset,
                psf,
                inv_sigma,
                values,
                local,
                members,
                block,
                vt,
            )
            if n_local == 0:
                continue
            ct = block[:n_local]
            g = np.empty((n_local, n_local))
            syrk_lower(syrk, ct, g)
            ev = np.dot(ct, vt)
            # F's upper triangle (members ascending: F[mb, ma] with mb <= ma)
            for b in range(n_local):
                row = f[members[b]]
                for a in range(b, n_local):
                    row[members[a]] += g[a, b]
            for a in range(n_local):
                ma = members[a]
                for q in range(m):
                    e[ma, q] += ev[a, q]
                local[ma] = -1
    e = e_parts[0]
    if n_chunks > 1:
        # rows h and n_s - 1 - h together: balanced halves of the upper triangle
        for h in numba.prange((n_s + 1) // 2):
            for c in range(n_chunks - 1):
                out[h, h:] += parts[c, h, h:]
            i = n_s - 1 - h
            if i != h:
                for c in range(n_chunks - 1):
                    out[i, i:] += parts[c, i, i:]
        for c in range(1, n_chunks):
            e += e_parts[c]
    mirror_upper(out)
    return out, e


@numba.njit(cache=True, nogil=True)
@no_type_check
def mirror_upper(a):
    # a's strict lower triangle <- its upper one, in blocks (cache-friendly transpose)
    n = a.shape[0]
    nb = 64
    for i0 in range(0, n, nb):
        for j0 in range(0, i0 + 1, nb):
            for i in range(i0, min(i0 + nb, n)):
                for j in range(j0, min(j0 + nb, i)):
                    a[i, j] = a[j, i]


@numba.njit(cache=True, nogil=True, parallel=True, fastmath=_REASSOC)
@no_type_check
def backward(
    n_threads,
    idx,
    w,
    values,
    inv_sigma,
    f_bar,
    e_bar,
    tile_rows,
    input_ptr,
    input_pixel,
    input_offset,
    psf,
):
    n_tiles, t2 = tile_rows.shape
    n_s = f_bar.shape[0]
    m = values.shape[1]
    k = idx.shape[1]
    w_bar = np.zeros(w.shape)
    v_bar = np.zeros(values.shape)
    n_chunks = max(1, min(n_threads, n_tiles))
    w_parts = np.zeros((n_chunks, w.shape[0], k))
    for c in numba.prange(n_chunks):
        local = np.full(n_s, -1, dtype=np.int64)
        members = np.empty(n_s, dtype=np.int64)
        block = np.empty((n_s + 1, t2))
        vt = np.empty((t2, m))
        wb = w_parts[c]
        for t in range(c * n_tiles // n_chunks, (c + 1) * n_tiles // n_chunks):
            n_local = build_block(
                t,
                idx,
                w,
                tile_rows,
                input_ptr,
                input_pixel,
                input_offset,
                psf,
                inv_sigma,
                values,
                local,
                members,
                block,
                vt,
            )
            if n_local == 0:
                continue
            fl = np.empty((n_local, n_local))
            el = np.empty((n_local, m))
            for a in range(n_local):
                row = f_bar[members[a]]
                for b in range(n_local):
                    fl[a, b] = row[members[b]]
                for q in range(m):
                    el[a, q] = e_bar[members[a], q]
            # (Fbar + Fbar^T)[S, S], symmetrised on the small block
            for a in range(n_local):
                for b in range(a + 1, n_local):
                    v = fl[a, b] + fl[b, a]
                    fl[a, b] = v
                    fl[b, a] = v
                fl[a, a] *= 2.0
            ct = block[:n_local]
            # dC (n_local x t2) = (Fbar + Fbar^T)[S, S] C + Ebar[S] V^T
            dc = np.dot(fl, ct) + np.dot(el, vt.T)
            # Vbar rows of this tile (each mask pixel is in exactly one tile)
            vb = np.dot(ct.T, el)
            for s in range(t2):
                r = tile_rows[t, s]
                if r >= 0:
                    for q in range(m):
                        v_bar[r, q] += vb[s, q]
                sig = inv_sigma[r] if r >= 0 else 0.0
                for a in range(n_local):
                    dc[a, s] *= sig
            for j in range(input_ptr[t], input_ptr[t + 1]):
                p = input_pixel[j]
                column = psf[input_offset[j]]
                for i in range(k):
                    a = idx[p, i]
                    if a < 0 or a >= n_s:
                        continue
                    row = dc[local[a]]
                    acc = 0.0
                    for s in range(t2):
                        acc += row[s] * column[s]
                    wb[p, i] += acc
            for a in range(n_local):
                local[members[a]] = -1
    for c in range(n_chunks):
        w_bar += w_parts[c]
    return w_bar, v_bar


@numba.njit(cache=True, nogil=True)
@no_type_check
def jacobi_upper(a, scale):
    # symmetric Jacobi scaling of the upper triangle of `a` in place:
    # a_ij <- a_ij s_i s_j with s_i = 1 / sqrt(a_ii) (1 where a_ii <= 0), into `scale`
    n = a.shape[0]
    for i in range(n):
        d = a[i, i]
        scale[i] = 1.0 / np.sqrt(d) if d > 0.0 else 1.0
    for i in range(n):
        si = scale[i]
        for j in range(i, n):
            a[i, j] *= si * scale[j]


@numba.njit(cache=True, nogil=True)
@no_type_check
def solve_cotangent(upper, scale, x, x_bar, l_bar, b_bar):
    # The cotangents of x = a^-1 b and log det a, from `upper` (the upper triangle of the
    # inverse of the scaled S a S, so a^-1 = S upper S): b_bar = a^-1 x_bar,
    # a_bar = l_bar a^-1 - b_bar x^T (in blocks, so that the transposed reads of the lower
    # half stay in cache).
    n = x.shape[0]
    for i in range(n):
        for j in range(i, n):
            upper[i, j] *= scale[i] * scale[j]
    for i in range(n):
        b_bar[i] = 0.0
    for i in range(n):
        acc = upper[i, i] * x_bar[i]
        xi = x_bar[i]
        for j in range(i + 1, n):
            v = upper[i, j]
            acc += v * x_bar[j]
            b_bar[j] += v * xi
        b_bar[i] += acc
    a_bar = np.empty((n, n))
    nb = 64
    for i0 in range(0, n, nb):
        i1 = min(i0 + nb, n)
        for j0 in range(0, n, nb):
            j1 = min(j0 + nb, n)
            for i in range(i0, i1):
                bi = b_bar[i]
                for j in range(j0, j1):
                    v = upper[i, j] if i <= j else upper[j, i]
                    a_bar[i, j] = l_bar * v - bi * x[j]
    return a_bar


@numba.njit(cache=True, nogil=True)
@no_type_check
def zero_lower(a):
    # zeroes the strict lower triangle of `a` in place and returns it
    for i in range(a.shape[0]):
        for j in range(i):
            a[i, j] = 0.0
    return a
