"""The inversion's formulas that both backends evaluate, written once for an array
namespace `xp` (`jax.numpy` in `equilens.terms.LogEvidence`, NumPy in the Numba backend's
`equilens.numba.invert`): a change here changes both, and the parity tests
(tests/test_numba.py, 1e-10) hold them together.
"""

import math
from collections.abc import Callable
from typing import Any

#: Accelerated projected-gradient iterations of the positive-only solve (both backends).
NONNEG_ITERATIONS = 500

#: `loop(n, body, init)`: `body(i, carry)` applied for `i` in `range(n)` (`jax.lax.fori_loop`
#: from 0 in JAX, `python_loop` on the host).
Loop = Callable[[int, Callable[[int, Any], Any], Any], Any]


def python_loop(n: int, body: Callable[[int, Any], Any], init: Any) -> Any:
    """The host's `Loop`: `body` applied `n` times in Python."""
    carry = init
    for i in range(n):
        carry = body(i, carry)
    return carry


def jacobi_scaling(xp, a, b, degenerate: float = 1.0) -> tuple[Any, Any, Any]:
    """The symmetric Jacobi scaling of `a x = b`: `S a S`, `S b` and `S = diag(a)^(-1/2)`
    (`degenerate` where the diagonal is not positive: 1 for the inversion, 0 for the
    linear light's normal equations, whose empty basis image then gets no amplitude)."""
    d = xp.diagonal(a)
    scale = xp.where(d > 0, 1.0 / xp.sqrt(xp.where(d > 0, d, 1.0)), degenerate)
    return a * scale[:, None] * scale[None, :], b * scale, scale


def projected_gradient(xp, a, b, constrained, loop: Loop):
    """FISTA (`NONNEG_ITERATIONS` accelerated projected-gradient steps) on
    `0.5 x^T a x - b^T x` with `x >= 0` where `constrained`, from the projection of `b`:
    the active set of the positive-only solve. `a` has a unit diagonal (Jacobi-scaled), so
    its largest eigenvalue is at most its largest absolute row sum (the step's inverse)."""
    step = 1.0 / xp.max(xp.sum(xp.abs(a), axis=1))

    def project(x):
        return xp.where(constrained, xp.maximum(x, 0.0), x)

    def body(_, carry):
        x, z, t = carry
        x_new = project(z - step * (a @ z - b))
        t_new = 0.5 * (1.0 + xp.sqrt(1.0 + 4.0 * t * t))
        z_new = x_new + ((t - 1.0) / t_new) * (x_new - x)
        return x_new, z_new, t_new

    x0 = project(b)
    x, _, _ = loop(NONNEG_ITERATIONS, body, (x0, x0, xp.ones((), a.dtype)))
    return x


def source_signal(xp, total, cover):
    """The adapt image's brightness per source pixel, scaled to a peak of 1: `total / cover`
    where `cover > 0` (`total`, `cover`: the mapping's transpose applied to the adapt image
    and to ones), 0 elsewhere; all zeros when no source pixel is bright. (Floored divisions,
    so that the derivative stays finite where a division is masked.)"""
    lit = cover > 0
    signal = xp.where(lit, total / xp.where(lit, cover, 1.0), 0.0)
    peak = xp.max(signal)
    return xp.where(peak > 0, signal / xp.where(peak > 0, peak, 1.0), 0.0)


def noise_normalisation(xp, noise):
    """`sum log(2 pi sigma^2)` over the mask pixels' `noise`."""
    return xp.sum(2.0 * xp.log(noise)) + math.log(2 * math.pi) * noise.shape[0]


def log_evidence(fit, log_det_curvature, log_det_regularization, normalisation):
    """`-(chi2 + s^T H s + log det(F + H) - log det H + sum log 2 pi sigma^2) / 2`, with
    `fit = chi2 + s^T H s`."""
    return -0.5 * (fit + log_det_curvature - log_det_regularization + normalisation)


def gp_precision(xp, coefficient, kernel_inverse, log_det_kernel):
    """A Gaussian-process prior's `H = coefficient K^-1` (symmetrised) and
    `log det H = n log coefficient - log det K`, from `K^-1` and `log det K`."""
    n = kernel_inverse.shape[0]
    h = coefficient * (0.5 * (kernel_inverse + kernel_inverse.T))
    return h, n * xp.log(coefficient) - log_det_kernel
