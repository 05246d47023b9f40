"""Numba kernels of image formation: sub-pixel binning and direct PSF convolution.

Private; marked `no_type_check` (see `_mass_kernels`).
"""

from typing import no_type_check

import numba
import numpy as np

from ._compile_lock import serialise_compilation

_PARALLEL = {"cache": True, "nogil": True, "parallel": True, "error_model": "numpy"}


@numba.njit(**_PARALLEL)
@no_type_check
def bin_mean(sub, s):
    """The mean over each `s x s` block of `sub` (`(ny s, nx s)` -> `(ny, nx)`)."""
    ny, nx = sub.shape[0] // s, sub.shape[1] // s
    out = np.empty((ny, nx))
    inv = 1.0 / (s * s)
    for i in numba.prange(ny):
        for j in range(nx):
            total = 0.0
            for a in range(s):
                for b in range(s):
                    total += sub[i * s + a, j * s + b]
            out[i, j] = total * inv
    return out


@numba.njit(**_PARALLEL)
@no_type_check
def convolve_same(image, kernel):
    """'Same'-size linear convolution with zero padding (as `scipy.signal.convolve2d`
    with `mode="same"` for odd kernels), by direct summation, rows in parallel."""
    ny, nx = image.shape
    ky, kx = kernel.shape
    oy, ox = ky // 2, kx // 2
    out = np.zeros((ny, nx))
    for i in numba.prange(ny):
        for a in range(ky):
            r = i + oy - a
            if r < 0 or r >= ny:
                continue
            for b in range(kx):
                w = kernel[a, b]
                shift = ox - b
                lo = max(0, -shift)
                hi = min(nx, nx - shift)
                for j in range(lo, hi):
                    out[i, j] += w * image[r, j + shift]
    return out


serialise_compilation(globals())
