"""Numba kernels of the tiled "sparse" curvature route (see `equilens.numba._sparse_route`): the
curvature matrix `F = C^T C` and `E = C^T V` built tile by tile in parallel, and their
reverse pass (the cotangents of the mapping's weights and values); the Cholesky solve of
the system they make is the host linear algebra's (`_envelope_kernels`).

Imported only when that route runs (the first call compiles them, or loads them from
Numba's cache). The kernels are private and marked `no_type_check` (the test suite's
jaxtyping import hook would otherwise wrap them, which Numba cannot compile or cache).
"""

import functools
from typing import no_type_check

import numba
import numpy as np

from ._blas_kernels import _REASSOC, _SYMM, _SYRK, _symm, _syrk
from ._compile_lock import serialise_compilation
from ._operands import kernel_operands


@numba.njit(cache=True, nogil=True)
@no_type_check
def syrk_upper(syrk, ct, g):
    # g (n x n, C order): its upper triangle <- ct ct^T (ct: n x k, C order), by BLAS syrk
    # on the Fortran-order views (ct^T: k x n; g^T's lower triangle is g's upper, so that
    # the scatter into F reads g's rows along memory)
    n, k = ct.shape
    _syrk(syrk, ord("L"), ord("T"), n, k, 1.0, ct, k, 0.0, g, g.shape[1])


@numba.njit(cache=True, nogil=True)
@no_type_check
def symm_upper(symm, g, b, c):
    # c <- g b (C order: g n x n symmetric, its upper triangle read; b and c n x k), by BLAS
    # symm on the Fortran-order views (c^T = b^T g, g's upper triangle its lower)
    n, k = b.shape
    _symm(symm, ord("R"), ord("L"), k, n, 1.0, g, n, b, k, 0.0, c, k)


@numba.njit(cache=True, nogil=True)
@no_type_check
def tile_members(t, idx, input_ptr, input_pixel, local, members):
    # S, the source pixels that tile t's inputs map to, ascending (so that the scatters
    # into F walk its rows in order), into members[:n_local]; local[a] <- a's position in
    # S (callers set it back to -1). Marked, then collected by a scan over their range (a
    # tile's source pixels lie close together on the mesh: cheaper than sorting them).
    k = idx.shape[1]
    n_s = local.shape[0]
    lo = n_s
    hi = -1
    for j in range(input_ptr[t], input_ptr[t + 1]):
        p = input_pixel[j]
        for i in range(k):
            a = idx[p, i]
            if a >= 0 and a < n_s:
                local[a] = 0
                lo = min(lo, a)
                hi = max(hi, a)
    n_local = 0
    for a in range(lo, hi + 1):
        if local[a] == 0:
            local[a] = n_local
            members[n_local] = a
            n_local += 1
    return n_local


@numba.njit(cache=True, nogil=True)
@no_type_check
def tile_noise(t, tile_rows, inv_sigma, values, sig, vt):
    # the tile's inverse noise into sig and its rows of `values` into vt (zero where a
    # tile position is not a mask pixel)
    for s in range(tile_rows.shape[1]):
        r = tile_rows[t, s]
        sig[s] = inv_sigma[r] if r >= 0 else 0.0
        for q in range(values.shape[1]):
            vt[s, q] = values[r, q] if r >= 0 else 0.0


@numba.njit(cache=True, nogil=True, fastmath=_REASSOC)
@no_type_check
def _add_inputs4(t, idx, w, input_ptr, input_pixel, input_offset, psf, psf_span, local, block):
    # `fill_block`'s sums for four weights per input (`idx` n x 4), in one pass over each
    # PSF column; an entry outside the mesh goes to a scratch row
    n_s = local.shape[0]
    dummy = np.empty(block.shape[1])
    for j in range(input_ptr[t], input_ptr[t + 1]):
        p = input_pixel[j]
        o = input_offset[j]
        lo = psf_span[o, 0]
        hi = psf_span[o, 1]
        column = psf[o, lo:hi]
        a0 = idx[p, 0]
        a1 = idx[p, 1]
        a2 = idx[p, 2]
        a3 = idx[p, 3]
        r0 = block[local[a0], lo:hi] if 0 <= a0 < n_s else dummy[lo:hi]
        r1 = block[local[a1], lo:hi] if 0 <= a1 < n_s else dummy[lo:hi]
        r2 = block[local[a2], lo:hi] if 0 <= a2 < n_s else dummy[lo:hi]
        r3 = block[local[a3], lo:hi] if 0 <= a3 < n_s else dummy[lo:hi]
        w0 = w[p, 0]
        w1 = w[p, 1]
        w2 = w[p, 2]
        w3 = w[p, 3]
        for s in range(column.shape[0]):
            c = column[s]
            r0[s] += w0 * c
            r1[s] += w1 * c
            r2[s] += w2 * c
            r3[s] += w3 * c


@numba.njit(cache=True, nogil=True, fastmath=_REASSOC)
@no_type_check
def _add_inputs3(t, idx, w, input_ptr, input_pixel, input_offset, psf, psf_span, local, block):
    # `_add_inputs4` for three weights per input (`idx` n x 3)
    n_s = local.shape[0]
    dummy = np.empty(block.shape[1])
    for j in range(input_ptr[t], input_ptr[t + 1]):
        p = input_pixel[j]
        o = input_offset[j]
        lo = psf_span[o, 0]
        hi = psf_span[o, 1]
        column = psf[o, lo:hi]
        a0 = idx[p, 0]
        a1 = idx[p, 1]
        a2 = idx[p, 2]
        r0 = block[local[a0], lo:hi] if 0 <= a0 < n_s else dummy[lo:hi]
        r1 = block[local[a1], lo:hi] if 0 <= a1 < n_s else dummy[lo:hi]
        r2 = block[local[a2], lo:hi] if 0 <= a2 < n_s else dummy[lo:hi]
        w0 = w[p, 0]
        w1 = w[p, 1]
        w2 = w[p, 2]
        for s in range(column.shape[0]):
            c = column[s]
            r0[s] += w0 * c
            r1[s] += w1 * c
            r2[s] += w2 * c


@numba.njit(cache=True, nogil=True, fastmath=_REASSOC)
@no_type_check
def fill_block(t, idx, w, input_ptr, input_pixel, input_offset, psf, psf_span, local, sig, block):
    # C[tile, S] into block[:n_local] (rows in the order of `local`; block's other rows
    # untouched): each input's PSF column times each of its interpolation weights added to
    # that source pixel's row, over the span of tile positions where the column is
    # non-zero, then each row times the tile's inverse noise (row-wise, so that the
    # scaling runs along memory). With four or three weights per input (bilinear,
    # Delaunay), one pass over each column serves all of them (one load of it for all
    # rows: 0.3-0.8 ms less than a pass per weight on the benchmark's 32x32 mesh). Every
    # entry of the block gets its terms in the same order either way (inputs, then
    # weights): the same block to the bit.
    k = idx.shape[1]
    n_s = local.shape[0]
    n_local = block.shape[0]
    for r in range(n_local):
        block[r, :] = 0.0
    if k == 4:
        _add_inputs4(t, idx, w, input_ptr, input_pixel, input_offset, psf, psf_span, local, block)
    elif k == 3:
        _add_inputs3(t, idx, w, input_ptr, input_pixel, input_offset, psf, psf_span, local, block)
    else:
        for j in range(input_ptr[t], input_ptr[t + 1]):
            p = input_pixel[j]
            o = input_offset[j]
            lo = psf_span[o, 0]
            hi = psf_span[o, 1]
            column = psf[o, lo:hi]
            for i in range(k):
                a = idx[p, i]
                if a < 0 or a >= n_s:
                    continue
                row = block[local[a], lo:hi]
                wt = w[p, i]
                for s in range(row.shape[0]):
                    row[s] += wt * column[s]
    for a in range(n_local):
        row = block[a]
        for s in range(row.shape[0]):
            row[s] *= sig[s]


#: Memory for the extra per-thread accumulators of F in the forward kernel (kept between
#: calls: fresh pages would cost more than the work at 16 threads); fewer threads are used
#: in the tile loop when it would take more.
ACCUMULATOR_BYTES = 128 * 2**20


@functools.lru_cache(maxsize=1)
def _accumulators(n: int, n_s: int) -> np.ndarray:
    return np.empty((n, n_s, n_s))


def forward(n_threads, n_s, *arrays):
    """`F = C^T C` and `E = C^T V` (see `equilens.numba._sparse_route`)."""
    out = np.empty((n_s, n_s))
    e, _, _, _ = forward_into(n_threads, out, 0, n_s, *arrays)
    mirror_upper(out)
    return out, e


def forward_into(n_threads, out, o, n_s, *arrays, keep=False):
    """The upper triangle of `F` (`n_s x n_s`) into `out[o:o + n_s, o:o + n_s]` (`out`
    square, C order; nothing else of it is written), `E`, `F`'s structure (for each
    source pixel `j`, the smallest source pixel that shares a tile with it: `F[i, j]` is
    structurally zero above that row; an entry can still be zero inside it), its envelope
    (for each `j`, the smallest `i` with a non-zero `C_t C_t^T` entry at `(i, j)` in some
    tile `t`: `F[i, j]` is exactly zero above that row; no later than the structure's) and,
    with `keep`, the tile blocks for the reverse pass (`backward_inverse`): `(ptr, members,
    rows)`, tile `t`'s block `C[tile, S]` in `rows[ptr[t]:ptr[t + 1]]` and its source
    pixels `S` in `members[ptr[t]:ptr[t + 1]]` (without, three empty arrays)."""
    n_tiles = arrays[4].shape[0]
    n_chunks = max(1, min(n_threads, n_tiles, 1 + ACCUMULATOR_BYTES // (8 * n_s * n_s)))
    parts = _accumulators(n_chunks - 1, n_s)
    arrays = kernel_operands(*arrays)
    e, first, nonzero, *blocks = _forward(n_chunks, _SYRK, parts, out, o, n_s, keep, *arrays)
    return e, first, nonzero, tuple(blocks)


@numba.njit(cache=True, nogil=True, parallel=True)
@no_type_check
def _tile_sets(n_chunks, n_s, idx, input_ptr, input_pixel):
    # every tile's S: tile t's source pixels in found[bound[t]:bound[t] + count[t]]
    # (bound: at most min(n_s, k * inputs) each)
    n_tiles = input_ptr.shape[0] - 1
    k = idx.shape[1]
    bound = np.empty(n_tiles + 1, np.int64)
    bound[0] = 0
    for t in range(n_tiles):
        bound[t + 1] = bound[t] + min(n_s, k * (input_ptr[t + 1] - input_ptr[t]))
    found = np.empty(bound[n_tiles], np.int64)
    count = np.empty(n_tiles, np.int64)
    for c in numba.prange(n_chunks):
        local = np.full(n_s, -1, dtype=np.int64)
        for t in range(c * n_tiles // n_chunks, (c + 1) * n_tiles // n_chunks):
            members = found[bound[t] : bound[t + 1]]
            n_local = tile_members(t, idx, input_ptr, input_pixel, local, members)
            count[t] = n_local
            for r in range(n_local):
                local[members[r]] = -1
    return bound, found, count


@numba.njit(cache=True, nogil=True, parallel=True)
@no_type_check
def _forward(
    n_chunks,
    syrk,
    parts,
    out,
    o,
    n_s,
    keep,
    idx,
    w,
    values,
    inv_sigma,
    tile_rows,
    input_ptr,
    input_pixel,
    input_offset,
    psf,
    psf_span,
):
    # tiles in n_chunks chunks, one per thread, each accumulating the upper triangle of F
    # (chunk 0 into out[o:, o:], the others into `parts`), summed in parallel at the end;
    # the tiles' S first (so that kept blocks can be laid out one after another)
    n_tiles, t2 = tile_rows.shape
    m = values.shape[1]
    bound, found, count = _tile_sets(n_chunks, n_s, idx, input_ptr, input_pixel)
    most = 0  # the largest S (the scratch blocks' size: allocated once per chunk, as a
    # fresh block per tile could be fresh pages too)
    for t in range(n_tiles):
        most = max(most, count[t])
    ptr = np.zeros(n_tiles + 1 if keep else 0, np.int64)
    if keep:
        for t in range(n_tiles):
            ptr[t + 1] = ptr[t] + count[t]
    n_kept = ptr[n_tiles] if keep else 0
    kept = np.empty((n_kept, t2))
    kept_members = np.empty(n_kept, np.int64)
    e_parts = np.zeros((n_chunks, n_s, m))
    first_parts = np.empty((n_chunks, n_s), np.int64)
    nonzero_parts = np.empty((n_chunks, n_s), np.int64)
    for c in numba.prange(n_chunks):
        f = out if c == 0 else parts[c - 1]
        d = o if c == 0 else 0
        for i in range(d, d + n_s):
            f[i, i : d + n_s] = 0.0
        local = np.full(n_s, -1, dtype=np.int64)
        scratch = np.empty((0 if keep else most, t2))
        g_scratch = np.empty(most * most)
        runs = np.empty(most + 1, np.int64)
        sig = np.empty(t2)
        vt = np.empty((t2, m))
        e = e_parts[c]
        first = first_parts[c]
        nonzero = nonzero_parts[c]
        for j in range(n_s):
            first[j] = j
            nonzero[j] = j
        for t in range(c * n_tiles // n_chunks, (c + 1) * n_tiles // n_chunks):
            n_local = count[t]
            if n_local == 0:
                continue
            members = found[bound[t] : bound[t] + n_local]
            for r in range(n_local):
                local[members[r]] = r
            if keep:
                ct = kept[ptr[t] : ptr[t + 1]]
                kept_members[ptr[t] : ptr[t + 1]] = members
            else:
                ct = scratch[:n_local]
            tile_noise(t, tile_rows, inv_sigma, values, sig, vt)
            fill_block(
                t, idx, w, input_ptr, input_pixel, input_offset, psf, psf_span, local, sig, ct
            )
            g = g_scratch[: n_local * n_local].reshape((n_local, n_local))
            syrk_upper(syrk, ct, g)
            ev = np.dot(ct, vt)
            # F's upper triangle (members ascending: F[mb, ma] with mb <= ma), by runs of
            # consecutive members (contiguous in F's rows: 7.5 long on average on the
            # benchmark's 32x32 mesh)
            n_runs = 0
            for a in range(n_local):
                if a == 0 or members[a] != members[a - 1] + 1:
                    runs[n_runs] = a
                    n_runs += 1
            runs[n_runs] = n_local
            k0 = 0  # the run that holds b
            for b in range(n_local):
                row = f[d + members[b]]
                gb = g[b]
                if runs[k0 + 1] <= b:
                    k0 += 1
                for q in range(k0, n_runs):
                    a0 = max(runs[q], b)
                    a1 = runs[q + 1]
                    dst = row[d + members[a0] : d + members[a0] + a1 - a0]
                    src = gb[a0:a1]
                    for a in range(a1 - a0):
                        dst[a] += src[a]
            # the envelope: in each column of g, the first non-zero (most often the first
            # row: the members' rows of C overlap within the tile)
            for a in range(n_local):
                b = 0
                while b < a and g[b, a] == 0.0:
                    b += 1
                ma = members[a]
                nonzero[ma] = min(nonzero[ma], members[b])
            m0 = members[0]
            for a in range(n_local):
                ma = members[a]
                for q in range(m):
                    e[ma, q] += ev[a, q]
                local[ma] = -1
                first[ma] = min(first[ma], m0)
    e = e_parts[0]
    first = first_parts[0]
    nonzero = nonzero_parts[0]
    if n_chunks > 1:
        # rows h and n_s - 1 - h together: balanced halves of the upper triangle
        for h in numba.prange((n_s + 1) // 2):
            for c in range(n_chunks - 1):
                out[o + h, o + h : o + n_s] += parts[c, h, h:]
            i = n_s - 1 - h
            if i != h:
                for c in range(n_chunks - 1):
                    out[o + i, o + i : o + n_s] += parts[c, i, i:]
        for c in range(1, n_chunks):
            e += e_parts[c]
            for j in range(n_s):
                first[j] = min(first[j], first_parts[c, j])
                nonzero[j] = min(nonzero[j], nonzero_parts[c, j])
    return e, first, nonzero, ptr, kept_members, kept


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


def backward(n_threads, idx, w, values, inv_sigma, f_bar, e_bar, *tables):
    """The cotangents of `w` and `V` from those of `F` and `E` (any `f_bar`)."""
    n_s = f_bar.shape[0]
    zeros = np.zeros(n_s)
    g = f_bar + f_bar.T
    none = (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, tables[0].shape[1])))
    args = (idx, w, values, inv_sigma, e_bar, *none, *tables)
    return backward_inverse(n_threads, g, np.ones(n_s), zeros, zeros, 0.5, 0, n_s, *args)


def backward_inverse(n_threads, *args):
    """The cotangents of `w` and `V` from the inverse of a system that holds `F` (see
    `_backward_inverse`, which writes none of its operands: all are passed read-only)."""
    return _backward_inverse(n_threads, _SYMM, *kernel_operands(*args))


@numba.njit(cache=True, nogil=True, parallel=True, fastmath=_REASSOC)
@no_type_check
def _backward_inverse(
    n_threads,
    symm,
    z,
    scale,
    b_bar,
    x,
    l_bar,
    o,
    n_s,
    idx,
    w,
    values,
    inv_sigma,
    e_bar,
    ptr,
    kept_members,
    kept,
    tile_rows,
    input_ptr,
    input_pixel,
    input_offset,
    psf,
    psf_span,
):
    # The cotangents of w and V for f_bar = l_bar S Z S - b_bar x^T on the source block
    # (`z`: the upper triangle of Z in z[o:o + n_s, o:o + n_s], S = diag(scale[o:]), b_bar
    # and x offset by o likewise): the cotangent of x = a^-1 b and l = log det a with
    # respect to the a = F + ... that has F in a[o:o + n_s, o:o + n_s] (a^-1 = S Z S; see
    # `_host_linalg`). Each tile reads (f_bar + f_bar^T)[S, S] off Z and the two vectors
    # (entries of F's structure: a selected inverse on its envelope suffices). The blocks
    # C[tile, S] are the forward call's (`forward_into` with `keep`), or rebuilt when
    # `ptr` is empty.
    n_tiles, t2 = tile_rows.shape
    m = values.shape[1]
    k = idx.shape[1]
    cached = ptr.shape[0] > 0
    w_bar = np.zeros(w.shape)
    v_bar = np.zeros(values.shape)
    n_chunks = max(1, min(n_threads, n_tiles))
    w_parts = np.zeros((n_chunks, w.shape[0], k))
    most = n_s  # the largest S (known when the blocks are kept): the scratch's size
    if cached:
        most = 0
        for t in range(n_tiles):
            most = max(most, ptr[t + 1] - ptr[t])
    for c in numba.prange(n_chunks):
        local = np.full(n_s, -1, dtype=np.int64)
        scratch_members = np.empty(0 if cached else n_s, dtype=np.int64)
        block = np.empty((0 if cached else n_s, t2))
        sig = np.empty(t2)
        vt = np.empty((t2, m))
        # (per-tile scratch, allocated once: fresh blocks per tile could be fresh pages)
        g_scratch = np.empty(most * most)
        cs_scratch = np.empty((most, t2))
        dc_scratch = np.empty((most, t2))
        el_scratch = np.empty((most, m))
        wb = w_parts[c]
        for t in range(c * n_tiles // n_chunks, (c + 1) * n_tiles // n_chunks):
            if cached:
                n_local = ptr[t + 1] - ptr[t]
                members = kept_members[ptr[t] : ptr[t + 1]]
                for r in range(n_local):
                    local[members[r]] = r
                ct = kept[ptr[t] : ptr[t + 1]]
                tile_noise(t, tile_rows, inv_sigma, values, sig, vt)
            else:
                n_local = tile_members(t, idx, input_ptr, input_pixel, local, scratch_members)
                members = scratch_members[:n_local]
                ct = block[:n_local]
                tile_noise(t, tile_rows, inv_sigma, values, sig, vt)
                fill_block(
                    t, idx, w, input_ptr, input_pixel, input_offset, psf, psf_span, local, sig, ct
                )
            if n_local == 0:
                continue
            # (Fbar + Fbar^T)[S, S] = 2 l_bar S Z[S, S] S - b_bar x^T - x b_bar^T: Z[S, S]
            # gathered from the upper triangle (one read per pair), the scales applied to
            # C's rows, the rank-two part as two vectors
            g = g_scratch[: n_local * n_local].reshape((n_local, n_local))
            cs = cs_scratch[:n_local]
            el = el_scratch[:n_local]
            xc = np.zeros(t2)
            bc = np.zeros(t2)
            for a in range(n_local):
                za = o + members[a]
                zrow = z[za]
                grow = g[a]
                for b in range(a, n_local):
                    grow[b] = zrow[o + members[b]]
                sa = scale[za]
                xa = x[za]
                ba = b_bar[za]
                row = ct[a]
                for s in range(t2):
                    cs[a, s] = sa * row[s]
                    xc[s] += xa * row[s]
                    bc[s] += ba * row[s]
                for q in range(m):
                    el[a, q] = e_bar[members[a], q]
            # dC (n_local x t2) = (Fbar + Fbar^T)[S, S] C + Ebar[S] V^T, each column times
            # the tile's inverse noise
            dc = dc_scratch[:n_local]
            symm_upper(symm, g, cs, dc)
            for a in range(n_local):
                za = o + members[a]
                sa = 2.0 * l_bar * scale[za]
                xa = x[za]
                ba = b_bar[za]
                row = dc[a]
                for s in range(t2):
                    v = sa * row[s] - ba * xc[s] - xa * bc[s]
                    for q in range(m):
                        v += el[a, q] * vt[s, q]
                    row[s] = v * sig[s]
            # Vbar rows of this tile (each mask pixel is in exactly one tile)
            vb = np.dot(ct.T, el)
            for s in range(t2):
                r = tile_rows[t, s]
                if r >= 0:
                    for q in range(m):
                        v_bar[r, q] += vb[s, q]
            # wbar: each input's PSF column against dC's rows, over the column's span
            for j in range(input_ptr[t], input_ptr[t + 1]):
                p = input_pixel[j]
                off = input_offset[j]
                lo = psf_span[off, 0]
                hi = psf_span[off, 1]
                column = psf[off, lo:hi]
                for i in range(k):
                    a = idx[p, i]
                    if a < 0 or a >= n_s:
                        continue
                    row = dc[local[a], lo:hi]
                    acc = 0.0
                    for s in range(row.shape[0]):
                        acc += row[s] * column[s]
                    wb[p, i] += acc
            for a in range(n_local):
                local[members[a]] = -1
    for c in range(n_chunks):
        w_bar += w_parts[c]
    return w_bar, v_bar


serialise_compilation(globals())
