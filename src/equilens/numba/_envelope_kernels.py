"""Numba kernels of the host linear algebra (`equilens.numba._host_linalg`): the Cholesky
factor of a symmetric positive definite matrix over its envelope (block rows, LAPACK on
the dense blocks), its solves, the selected inverse on the envelope, the system's
assembly from a regularization's entries, and the cotangents of the solve and the log
determinant. Imported when the sparse route or the host solve runs (the first call
compiles them, or loads them from Numba's cache); private and marked `no_type_check`, as
every kernel of this package."""

from typing import no_type_check

import numba
import numpy as np

from ._blas_kernels import (
    _GEMM,
    _LAUUM,
    _POTRF,
    _REASSOC,
    _SYMM,
    _SYRK,
    _TRSM,
    _TRTRI,
    _gemm,
    _symm,
    _syrk,
    _trsm,
)
from ._compile_lock import serialise_compilation

#: Block rows of `envelope_cholesky` (96 measured fastest on one core, 32 to 192 tried).
ENVELOPE_BLOCK = 96


#: Block columns of `envelope_inverse` (its rows gathered per block: 32 to 96 measured
#: within noise of each other on one core, against 96-row blocks of whole blocks' rows).
INVERSE_BLOCK = 64


#: The envelope is factored by block rows only when that costs at most this fraction of
#: the dense factorisation's multiply-adds; otherwise by LAPACK's `potrf` at once (on one
#: core, the 32x32 mesh's system at 0.36 of the dense cost took 0.6 of its time, a
#: shuffled one at 0.87 took 1.8 times).
ENVELOPE_MAX_COST = 0.5


@numba.njit(cache=True, nogil=True)
@no_type_check
def inverse_cotangent(z, scale, b_bar, x, l_bar, o, n):
    # a_bar[o:o + n, o:o + n] = l_bar S Z S - b_bar x^T (n x n, from the upper triangle of
    # z[o:o + n, o:o + n], S = diag(scale), vectors offset by o likewise): the cotangent of
    # a in x = a^-1 b, l = log det a, with a^-1 = S Z S (in blocks, so that the transposed
    # reads of the lower half stay in cache)
    a_bar = np.empty((n, n))
    nb = 64
    for i0 in range(0, n, nb):
        i1 = min(i0 + nb, n)
        for j0 in range(0, n, nb):
            j1 = min(j0 + nb, n)
            for i in range(i0, i1):
                bi = b_bar[o + i]
                si = l_bar * scale[o + i]
                for j in range(j0, j1):
                    v = z[o + i, o + j] if i <= j else z[o + j, o + i]
                    a_bar[i, j] = si * v * scale[o + j] - bi * x[o + j]
    return a_bar


@numba.njit(cache=True, nogil=True)
@no_type_check
def zero_lower(a):
    # zeroes the strict lower triangle of `a` in place and returns it
    for i in range(a.shape[0]):
        for j in range(i):
            a[i, j] = 0.0
    return a


@numba.njit(cache=True, nogil=True, fastmath=_REASSOC)
@no_type_check
def envelope_solve(u, start, b, forward=True):
    # x = (U^T U)^-1 b for the upper factor U in the upper triangle of `u` (C order; its
    # lower triangle not read) whose column j is zero above row start[j] (the envelope of
    # `envelope_cholesky`): U^T y = b, then U x = y, both along U's rows and only over
    # their envelope (LAPACK's potrs reads the whole triangle); without `forward`, b is
    # already y (`envelope_cholesky` solved it) and only U x = y is left
    n = u.shape[0]
    end = np.zeros(n, np.int64)  # end[i]: 1 + the last column of row i's envelope
    for j in range(n):
        end[start[j]] = max(end[start[j]], j + 1)
    for i in range(1, n):
        end[i] = max(end[i], end[i - 1], i + 1)
    x = b.copy()
    for i in range(n if forward else 0):
        row = u[i]
        xi = x[i] / row[i]
        x[i] = xi
        for j in range(i + 1, end[i]):
            x[j] -= row[j] * xi
    for i in range(n - 1, -1, -1):
        row = u[i]
        acc = x[i]
        for j in range(i + 1, end[i]):
            acc -= row[j] * x[j]
        x[i] = acc / row[i]
    return x


@numba.njit(cache=True, nogil=True)
@no_type_check
def add_upper(a, o, b, start):
    # the upper triangle of a[o:, o:] += that of b, and start[o + j] <- min(start[o + j],
    # o + i) for each non-zero b[i, j], i <= j (the envelope holds b's non-zeros)
    for i in range(b.shape[0]):
        row = a[o + i]
        src = b[i]
        for j in range(i, b.shape[0]):
            v = src[j]
            row[o + j] += v
            if v != 0.0 and start[o + j] > o + i:
                start[o + j] = o + i


@numba.njit(cache=True, nogil=True)
@no_type_check
def add_entries(a, start, rows, cols, values):
    # the upper triangle of `a` += a symmetric matrix's entries (each pair of indices once,
    # in either order; repeats add up), and start[j] <- min(start[j], i) for each entry
    # (i, j), i <= j: the envelope holds the pattern whatever its values
    for e in range(values.shape[0]):
        i = rows[e]
        j = cols[e]
        if i > j:
            i, j = j, i
        a[i, j] += values[e]
        if start[j] > i:
            start[j] = i


@numba.njit(cache=True, nogil=True)
@no_type_check
def entries_cotangent(z, scale, b_bar, x, l_bar, rows, cols):
    # the cotangents of the entries of `add_entries`: a_bar[i, j] + a_bar[j, i] off the
    # diagonal, a_bar[i, i] on it, with a_bar = l_bar S Z S - b_bar x^T (Z's upper triangle)
    out = np.empty(rows.shape[0])
    for e in range(rows.shape[0]):
        i = rows[e]
        j = cols[e]
        if i > j:
            i, j = j, i
        v = l_bar * scale[i] * z[i, j] * scale[j]
        if i == j:
            out[e] = v - b_bar[i] * x[i]
        else:
            out[e] = 2.0 * v - b_bar[i] * x[j] - b_bar[j] * x[i]
    return out


@numba.njit(cache=True, nogil=True)
@no_type_check
def jacobi_envelope(a, scale, start):
    # symmetric Jacobi scaling of the upper triangle of `a` in place, a_ij <- a_ij s_i s_j
    # with s_i = 1 / sqrt(a_ii) (1 where a_ii <= 0) into `scale`, and in the same pass
    # start[j] <- the first row with a non-zero in column j of the upper triangle, if
    # above the given start[j] (the caller's structure; j itself for none)
    n = a.shape[0]
    for i in range(n):
        d = a[i, i]
        scale[i] = 1.0 / np.sqrt(d) if d > 0.0 else 1.0
    for i in range(n):
        row = a[i]
        si = scale[i]
        for j in range(i + 1, n):
            v = row[j]
            if v != 0.0:
                row[j] = v * si * scale[j]
                if start[j] > i:
                    start[j] = i
        row[i] *= si * si


#: Each level of a block row's early-starting rows (`envelope_cholesky`) is charged this
#: many multiply-adds more (for its BLAS calls and copies) when the levels are chosen.
LEVEL_OVERHEAD = 300000


@numba.njit(cache=True, nogil=True)
@no_type_check
def _levels(start, i0, i1, cuts):
    # For block row [i0, i1) of `envelope_cholesky`: the columns where its levels begin,
    # ascending, into cuts[:K + 1] (cuts[K] is the window that all rows share; K = 0: one
    # window, that of the earliest start); returns K and the multiply-adds. Level k solves
    # the columns [cuts[k], cuts[k + 1]) of the g_k rows that start before cuts[k + 1],
    # chosen by dynamic programming over the rows' starts for the fewest multiply-adds:
    # with d = cuts[k + 1] - cuts[k] and e = i0 - cuts[k + 1], g d^2 / 2 + g d e + g^2 d / 2
    # (+ LEVEL_OVERHEAD) per level, m e^2 / 2 + m^2 e / 2 for the shared window.
    m = i1 - i0
    order = np.sort(start[i0:i1])
    c = np.empty(m + 1, np.int64)  # candidate columns: the distinct starts (< i0), then i0
    nc = 0
    for r in range(m):
        v = min(order[r], i0)
        if nc == 0 or v != c[nc - 1]:
            c[nc] = v
            nc += 1
    if c[nc - 1] != i0:
        c[nc] = i0
        nc += 1
    below = np.zeros(nc, np.int64)  # rows starting before candidate j
    r = 0
    for j in range(nc):
        while r < m and order[r] < c[j]:
            r += 1
        below[j] = r
    best = np.full(nc, np.inf)  # best[j]: columns [c[0], c[j]) done for the rows before
    back = np.zeros(nc, np.int64)
    best[0] = 0.0
    for j in range(1, nc):
        e = i0 - c[j]
        g = below[j]
        for i in range(j):
            d = c[j] - c[i]
            cost = best[i] + g * d * d / 2 + g * d * e + g * g * d / 2 + LEVEL_OVERHEAD
            if cost < best[j]:
                best[j] = cost
                back[j] = i
    # the shared window at candidate j: total best[j] + m e^2 / 2 + m^2 e / 2 (j = 0: all
    # rows share the earliest window, no level)
    j_best = 0
    total = np.inf
    for j in range(nc):
        e = i0 - c[j]
        cost = best[j] + m * e * e / 2 + m * m * e / 2
        if cost < total:
            total = cost
            j_best = j
    k = 0
    j = j_best
    while j > 0:
        k += 1
        j = back[j]
    j = j_best
    for q in range(k, -1, -1):
        cuts[q] = c[j]
        j = back[j]
    return k, total


@numba.njit(cache=True, nogil=True)
@no_type_check
def envelope_cholesky(trsm, syrk, gemm, potrf, a, start, bounds, y):
    # The Cholesky factor of the symmetric positive-definite matrix whose upper triangle is
    # in `a` (C order), in place: the lower factor L of the Fortran-order view M = a^T
    # (= the upper factor of a), by block rows of M restricted to its envelope. Row i of L
    # is zero left of start[i] (the first non-zero of row i of M's lower triangle; the
    # envelope keeps no fill outside it), so block row I = [i0, i1) (consecutive `bounds`)
    # only needs the window s = min start[I]: L[I, s:i0] = M[I, s:i0] L[s:i0, s:i0]^-T
    # (trsm), then M[I, I] -= L[I, s:i0] L[I, s:i0]^T (syrk) and its own factor (potrf):
    # the dense algorithm's result (the entries outside the envelope stay exact zeros) in
    # sum_I |I| (i0 - s)^2 / 2 multiply-adds instead of n^3 / 6. A few early-starting rows
    # would widen the whole block's window, so the window is solved in levels (`_levels`):
    # level k takes the columns [c_k, c_k+1) of the rows W that start before c_k+1, on a
    # copy (trsm; then gemm for their effect on the columns [c_k+1, i0) and syrk for that
    # on M[W, W]), and all rows share the last window [c_K, i0) (the other rows' entries
    # left of it are zeros). With y of size n (not 0), also L y' = y in place, block row
    # by block row as its entries of L are final, while they are still in cache (each
    # level's solved columns, then the shared window, then the diagonal block): the forward
    # half of a solve, without reading the factor again. Returns LAPACK's info (0, or the
    # first row at which M is not positive definite, from 1; y is then not solved).
    n = a.shape[0]
    R, L, T, N = ord("R"), ord("L"), ord("T"), ord("N")
    ld = np.array([n], np.int32)
    uplo = np.array([L], np.uint8)
    info = np.zeros(1, np.int32)
    wide = np.empty(n, np.int64)
    cuts = np.empty(n + 1, np.int64)
    solve = y.shape[0] == n
    for b in range(bounds.shape[0] - 1):
        i0 = bounds[b]
        i1 = bounds[b + 1]
        m = np.array([i1 - i0], np.int32)
        n_levels, _ = _levels(start, i0, i1, cuts)
        for lv in range(n_levels):
            # W: the rows that start before cuts[lv + 1] (ascending); x (C order f x g,
            # the Fortran g x f matrix M[W, c0:i0]), its first d columns solved against
            # L[c0:c1, c0:c1]
            c0 = cuts[lv]
            c1 = cuts[lv + 1]
            n_w = 0
            for i in range(i0, i1):
                if start[i] < c1:
                    wide[n_w] = i
                    n_w += 1
            d = c1 - c0
            e = i0 - c1
            x = np.empty((d + e, n_w))
            for c in range(d + e):
                src = a[c0 + c]
                for q in range(n_w):
                    x[c, q] = src[wide[q]]
            _trsm(trsm, R, L, T, N, n_w, d, 1.0, a[c0:, c0:], n, x, n_w)
            if e > 0:
                # M[W, c1:i0] -= X L[c1:i0, c0:c1]^T (L[c1:i0, c0:c1] starts at a[c0, c1])
                _gemm(gemm, N, T, n_w, e, d, -1.0, x, n_w, a[c0:, c1:], n, 1.0, x[d:], n_w)
            # M[W, W] -= X X^T (the lower triangle of the Fortran g x g xx: a's upper
            # triangle at the rows and columns W)
            xx = np.empty((n_w, n_w))
            _syrk(syrk, L, N, n_w, d, 1.0, x, n_w, 0.0, xx, n_w)
            for q in range(n_w):
                row = a[wide[q]]
                for p in range(q, n_w):
                    row[wide[p]] -= xx[q, p]
            for c in range(d + e):
                dst = a[c0 + c]
                for q in range(n_w):
                    dst[wide[q]] = x[c, q]
            if solve:
                # y[W] -= L[W, c0:c1] y[c0:c1] (those columns of L are final)
                acc = np.zeros(n_w)
                for c in range(d):
                    xc = x[c]
                    yc = y[c0 + c]
                    for q in range(n_w):
                        acc[q] += xc[q] * yc
                for q in range(n_w):
                    y[wide[q]] -= acc[q]
        s = cuts[n_levels]
        if i0 > s:
            # M[r, c] is a[c, r]: the block M[i0:, s:] starts at a[s, i0] (leading dim n)
            _trsm(trsm, R, L, T, N, i1 - i0, i0 - s, 1.0, a[s:, s:], n, a[s:, i0:], n)
            _syrk(syrk, L, N, i1 - i0, i0 - s, -1.0, a[s:, i0:], n, 1.0, a[i0:, i0:], n)
            if solve:
                # y[I] -= L[I, s:i0] y[s:i0] (L[I, c] is a[c, i0:i1])
                yi = y[i0:i1]
                for c in range(s, i0):
                    lc = a[c, i0:i1]
                    yc = y[c]
                    for q in range(i1 - i0):
                        yi[q] -= lc[q] * yc
        potrf(uplo.ctypes, m.ctypes, a[i0:, i0:].ctypes, ld.ctypes, info.ctypes)
        if info[0] != 0:
            return i0 + info[0]
        if solve:
            # y[I] <- L[I, I]^-1 y[I] (L[j, i] is a[i, j])
            for i in range(i0, i1):
                row = a[i]
                yi = y[i] / row[i]
                y[i] = yi
                for j in range(i + 1, i1):
                    y[j] -= row[j] * yi
    return 0


@numba.njit(cache=True, nogil=True)
@no_type_check
def _copy_runs(src, dst, runs, n_runs, to_runs):
    # dst[off:off + len] <- src[r0:r1] for each run (r0, r1, off) (or back, `to_runs`)
    for p in range(n_runs):
        r0 = runs[p, 0]
        r1 = runs[p, 1]
        o = runs[p, 2]
        if to_runs:
            dst[r0:r1] = src[o : o + r1 - r0]
        else:
            dst[o : o + r1 - r0] = src[r0:r1]


@numba.njit(cache=True, nogil=True)
@no_type_check
def envelope_inverse(trsm, symm, gemm, trtri, lauum, a, start, bounds):
    # The selected inverse: from the factor of `envelope_cholesky` (same `start`, or one
    # that starts no later anywhere; any `bounds`), Z = A^-1 in place on the envelope,
    # exact there (and on the diagonal blocks' upper triangles; the rest of the upper
    # triangle of `a`, C order, keeps the factor's zeros; its lower triangle is
    # overwritten). Takahashi's recurrence by block columns J of L (last first), over the
    # rows R of the envelope below J (every i >= j1 with start[i] < j1, gathered from their
    # runs of consecutive rows): Lh = L[R, J] L_JJ^-1, Z[R, J] = -Z[R, R] Lh,
    # Z[J, J] = (L_JJ L_JJ^T)^-1 - Z[R, J]^T Lh. Z[R, R] is needed only where both rows are
    # in R, which the envelope holds (the structure is closed: start[i] < j1 <= i'), and
    # was formed by the later block columns. Multiply-adds: sum_J |R|^2 |J| (symm) +
    # |R| |J|^2 (gemm, trsm) against n^3 / 3 for LAPACK's potri; the copies in and out
    # of R, sum_J |R|^2 / 2 + 2 |R| |J|.
    n = a.shape[0]
    n_blocks = bounds.shape[0] - 1
    ld = np.array([n], np.int32)
    ch = np.array([ord("R"), ord("L"), ord("N")], np.uint8)
    info = np.zeros(1, np.int32)
    rows = np.empty(n, np.int64)
    runs = np.empty((n, 3), np.int64)  # (first row, end row, position in R)
    r_most = 0
    for jb in range(n_blocks):
        r = 0
        for i in range(bounds[jb + 1], n):
            r += start[i] < bounds[jb + 1]
        r_most = max(r_most, r)
    g_buffer = np.empty(r_most * r_most)
    for jb in range(n_blocks - 1, -1, -1):
        j0 = bounds[jb]
        j1 = bounds[jb + 1]
        mj = j1 - j0
        m = np.array([mj], np.int32)
        r = 0
        n_runs = 0
        for i in range(j1, n):
            if start[i] < j1:
                if n_runs > 0 and runs[n_runs - 1, 1] == i:
                    runs[n_runs - 1, 1] = i + 1
                else:
                    runs[n_runs, 0] = i
                    runs[n_runs, 1] = i + 1
                    runs[n_runs, 2] = r
                    n_runs += 1
                rows[r] = i
                r += 1
        # lh, t: C order |J| x |R| (the Fortran |R| x |J| matrices, leading dim |R|)
        lh = np.empty((mj, r))
        t = np.empty((mj, r))
        if r > 0:
            # Lh = L[R, J] L_JJ^-1 (L[R, J] = M[R, J]: rows J of `a` at the columns R)
            for c in range(mj):
                _copy_runs(a[j0 + c], lh[c], runs, n_runs, False)
            _trsm(trsm, ord("R"), ord("L"), ord("N"), ord("N"), r, mj, 1.0, a[j0:, j0:], n, lh, r)
            # g (C order |R| x |R|, upper triangle; the Fortran lower one) <- Z[R, R]:
            # g[l, k] = a[R_l, R_k] for k >= l
            g = g_buffer[: r * r].reshape((r, r))
            p = 0
            for q in range(r):
                while runs[p, 2] + runs[p, 1] - runs[p, 0] <= q:
                    p += 1
                # (row R_q from column R_q on: the rest of its run, then the later runs)
                src = a[rows[q]]
                g[q, q : runs[p, 2] + runs[p, 1] - runs[p, 0]] = src[rows[q] : runs[p, 1]]
                _copy_runs(src, g[q], runs[p + 1 :], n_runs - p - 1, False)
            # T = -Z[R, R] Lh
            _symm(symm, ord("L"), ord("L"), r, mj, -1.0, g, r, lh, r, 0.0, t, r)
        # (L_JJ L_JJ^T)^-1 in place: L_JJ^-1 (trtri), then L_JJ^-T L_JJ^-1 (lauum)
        trtri(ch[1:].ctypes, ch[2:].ctypes, m.ctypes, a[j0:, j0:].ctypes, ld.ctypes, info.ctypes)
        if info[0] != 0:
            return j0 + info[0]
        lauum(ch[1:].ctypes, m.ctypes, a[j0:, j0:].ctypes, ld.ctypes, info.ctypes)
        if r == 0:
            continue
        # Z_JJ -= T^T Lh (gj: Fortran |J| x |J|), on M[J, J]'s lower triangle, the upper
        # triangle of a[J, J]; then Z[R, J] = T into rows J of `a` at the columns R
        gj = np.empty((mj, mj))
        _gemm(gemm, ord("T"), ord("N"), mj, mj, r, 1.0, t, r, lh, r, 0.0, gj, mj)
        for c in range(mj):
            row = a[j0 + c]
            gc = gj[c]
            for d in range(c, mj):
                row[j0 + d] -= gc[d]
            _copy_runs(t[c], row, runs, n_runs, True)
    return 0


def envelope_bounds(
    start,
    split: int | None = None,
    nb: int | None = None,
    max_cost: float | None = ENVELOPE_MAX_COST,
):
    """Block boundaries for `envelope_cholesky` (`envelope_inverse` with `max_cost`
    None): blocks of `nb` rows from 0 and from `split` (where the linear-light rows begin:
    those are dense, and a block that straddled them would be as wide), or one block when
    the envelope's factorisation would cost more than `max_cost` of the dense one
    (`nb`: `ENVELOPE_BLOCK` unless given)."""
    n = start.shape[0]
    split = n if split is None else split
    nb = ENVELOPE_BLOCK if nb is None else nb
    bounds = np.unique(np.concatenate([np.arange(0, split, nb), np.arange(split, n, nb), [n]]))
    if max_cost is not None and bounds.shape[0] > 2:
        cuts = np.empty(n + 1, np.int64)
        cost = sum(
            _levels(start, bounds[b], bounds[b + 1], cuts)[1] for b in range(bounds.shape[0] - 1)
        )
        if cost > max_cost * n**3 / 6:
            bounds = np.array([0, n])
    return bounds.astype(np.int64)


def cholesky_envelope(a, scale, start=None, split=None, nb=None, y=None):
    """`jacobi_envelope` (from `start`, the rows of the structure's first non-zeros per
    column, or the diagonal; updated in place) and the Cholesky factor (upper, of the
    C-order `a`; its lower triangle untouched) by `envelope_cholesky` on
    `envelope_bounds`; LAPACK's info. With `scale` None, `a` is neither scaled nor
    scanned: `start` must then hold its envelope (no non-zero of the upper triangle above
    `start[j]` in column `j`). With `y` (float64, length n; only with `scale` None, as the
    scale is found here), also `U^T y' = y` in place (the forward half of
    `envelope_solve`)."""
    if scale is not None and y is not None:
        raise ValueError("cholesky_envelope solves y only for an unscaled a (scale None)")
    n = a.shape[0]
    start = np.arange(n) if start is None else start
    if scale is not None:
        jacobi_envelope(a, scale, start)
    bounds = envelope_bounds(start, split, nb)
    y = np.empty(0) if y is None else y
    return envelope_cholesky(_TRSM, _SYRK, _GEMM, _POTRF, a, start, bounds, y)


def inverse_envelope(u, start, split=None, nb=None):
    """`Z = A^-1` on the envelope of the factor `u` of `cholesky_envelope` (in place; the
    same `start` and `split`), by `envelope_inverse` on blocks of `nb` rows
    (`INVERSE_BLOCK` unless given)."""
    nb = INVERSE_BLOCK if nb is None else nb
    bounds = envelope_bounds(start, split, nb, max_cost=None)
    return envelope_inverse(_TRSM, _SYMM, _GEMM, _TRTRI, _LAUUM, u, start, bounds)


serialise_compilation(globals())
