"""Numba kernels of the linear light's non-negative solve: the Lawson-Hanson active set
of `equilens.terms._imaging._nnls` (same algorithm, order and tolerances) on the
few-by-few Jacobi-scaled normal equations. As NumPy calls, its 20-60 small solves per
likelihood cost about 2 ms, a fifth of a 4,500-pixel MGE likelihood; compiled, a few
microseconds. Private; marked `no_type_check` (see `_mass_kernels`).
"""

import math
from typing import no_type_check

import numba
import numpy as np

from ._compile_lock import serialise_compilation

_OPTIONS = {"cache": True, "nogil": True, "error_model": "numpy"}


@numba.njit(**_OPTIONS)
@no_type_check
def cholesky_solve(g, h):
    """`g^-1 h` for a symmetric `g` by Cholesky; all NaN when `g` is not positive
    definite (as `equilens.numba._terms._cholesky_solve`)."""
    k = h.size
    low = np.zeros((k, k))
    for j in range(k):
        d = g[j, j]
        for m in range(j):
            d -= low[j, m] * low[j, m]
        if not d > 0.0:
            return np.full(k, np.nan)
        low[j, j] = math.sqrt(d)
        for i in range(j + 1, k):
            t = g[i, j]
            for m in range(j):
                t -= low[i, m] * low[j, m]
            low[i, j] = t / low[j, j]
    z = np.empty(k)
    for i in range(k):
        t = h[i]
        for m in range(i):
            t -= low[i, m] * z[m]
        z[i] = t / low[i, i]
    x = np.empty(k)
    for i in range(k - 1, -1, -1):
        t = z[i]
        for m in range(i + 1, k):
            t -= low[m, i] * x[m]
        x[i] = t / low[i, i]
    return x


@numba.njit(**_OPTIONS)
@no_type_check
def solve_on(g, h, on):
    """The least-squares solution with the amplitudes outside `on` held at zero."""
    k = h.size
    gp = np.zeros((k, k))
    rhs = np.zeros(k)
    for i in range(k):
        gp[i, i] = 1.0
        if on[i]:
            rhs[i] = h[i]
            for j in range(k):
                if on[j]:
                    gp[i, j] = g[i, j]
    x = cholesky_solve(gp, rhs)
    for i in range(k):
        if not on[i]:
            x[i] = 0.0
    return x


@numba.njit(**_OPTIONS)
@no_type_check
def nnls(g, h):
    """argmin 0.5 x^T g x - h^T x subject to x >= 0 (Lawson-Hanson; at most 3k steps)."""
    k = h.size
    top = 0.0
    for i in range(k):
        top = max(top, abs(h[i]))
    tol = 10 * np.finfo(np.float64).eps * k * (1.0 + top)
    max_iter = 3 * k
    x = np.zeros(k)
    on = np.zeros(k, dtype=np.bool_)
    it = 0
    while it < max_iter:
        grad = h - g @ x
        pick, best = -1, -np.inf
        for i in range(k):
            if not on[i] and grad[i] > tol and pick < 0:
                pick = i
            if not on[i] and grad[i] > best:
                best = grad[i]
        if pick < 0:
            break
        # (the first largest gradient among the inactive amplitudes: np.argmax's order)
        for i in range(k):
            if not on[i] and grad[i] == best:
                on[i] = True
                break
        s = solve_on(g, h, on)
        while it < max_iter:
            alpha, blocked = np.inf, False
            for i in range(k):
                if on[i] and s[i] <= 0:
                    blocked = True
                    denom = x[i] - s[i]
                    if denom > 0:
                        alpha = min(alpha, x[i] / denom)
            if not blocked:
                break
            alpha = min(max(alpha, 0.0), 1.0)
            for i in range(k):
                x[i] = x[i] + alpha * (s[i] - x[i])
                on[i] = on[i] and x[i] > tol
                if not on[i]:
                    x[i] = 0.0
            s = solve_on(g, h, on)
            it += 1
        x = s
        it += 1
    return x


serialise_compilation(globals())
