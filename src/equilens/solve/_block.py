"""The integral of a Laplace evidence's integrand over a block of its parameters by
importance sampling, for a block the data may leave flat or bound on one side only (a
subhalo the data do not want: `laplace_evidence(block=...)`).

The Laplace approximation integrates `exp(-F)` as the Gaussian of `F`'s curvature at the
mode. Along a direction the likelihood leaves flat, the integrand is the prior's own
density, and its integral the prior's mass, 1; but a rough objective (a pixelized
source's evidence) shows curvature there on the scale of its roughness, and a curvature
estimated on that scale is a Gaussian far narrower than the prior: an Occam penalty for a
parameter the data do not constrain at all (a Jackpot cell's subhalo, 2026-12-06: the
Laplace approximation -8.2 against nested sampling's +0.2, docs/subhalo.md). A
likelihood that bounds a parameter on one side (a subhalo's mass, below a limit) is no
Gaussian either.

Here the integrand is taken on the slice through the mode `z*` along the block (the other
parameters held at `z*`), by importance sampling from a defensive mixture: the block's
Gaussian of the Laplace approximation (the Hessian's block, its conditional curvature)
and the block's prior (logistic in the unconstrained coordinate of a two-sided bound).
The ratio of that integral to the Gaussian's on the same slice corrects the Laplace
approximation for the block's shape:

    log E = log E_Laplace + log (I_slice / I_Gaussian).

Where the integrand is the Gaussian, the ratio is 1 (to the sampling's error); where the
block is flat, the prior's samples carry it and the correction restores the prior's mass.
The slice holds the other parameters where the mode has them: where the block couples to
them (a subhalo's mass traded against the host's Einstein radius), the slice's integrand
away from the mode is the lower one, not the profile's, and the correction errs low.
"""

import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
from jaxtyping import Float

#: The points of a block's importance sampling (`block_integral`).
BLOCK_SAMPLES = 256
#: The share of those points drawn from the block's Laplace Gaussian (the rest from its
#: prior).
GAUSSIAN_SHARE = 0.5


class BlockIntegral(NamedTuple):
    """`block_integral`'s outcome: `log_ratio`, the log of the slice's integral over the
    Gaussian's; `error`, its standard error (the weights' spread within each component's
    points, relative to their mean); `effective`, Kish's effective number of
    weighted points."""

    log_ratio: float
    error: float
    effective: float


def _log_logistic(z: np.ndarray) -> np.ndarray:
    """The log density of the standard logistic distribution (a uniform prior over a
    two-sided bound, in its logit), summed over the last axis."""
    return np.sum(-np.logaddexp(0.0, z) - np.logaddexp(0.0, -z), axis=-1)


def block_integral(
    values: Callable[[np.ndarray], np.ndarray],
    z: Float[np.ndarray, " n"],
    hess: Float[np.ndarray, "n n"],
    block: list[int],
    samples: int = BLOCK_SAMPLES,
    seed: int = 0,
) -> BlockIntegral:
    """The integral of `exp(-(F - F(z)))` over the parameters `block` (indices into `z`,
    each with a two-sided bound: its prior is the logistic density in `z`) with the others
    held at `z`, over the integral of the Gaussian of `hess`'s block (positive definite)
    on the same slice (module docstring); `values` gives `F` at the rows of an array of
    points (`inf` where it cannot be evaluated). `samples` points, `GAUSSIAN_SHARE` of
    them from that Gaussian, the rest from the prior, drawn by a generator seeded with
    `seed` (the same points for every call: reproducible)."""
    z = np.asarray(z, np.float64)
    idx = np.asarray(block, np.int64)
    k = idx.size
    if k == 0 or samples < 2:
        raise ValueError(f"block_integral needs a block and samples >= 2, got {k}, {samples}")
    hb = np.asarray(hess, np.float64)[np.ix_(idx, idx)]
    hb = 0.5 * (hb + hb.T)
    w, v = np.linalg.eigh(hb)
    if not np.all(w > 0):
        raise ValueError("block_integral: the Hessian's block is not positive definite")
    root = v / np.sqrt(w)[None, :]  # (root @ root.T = hb^-1)
    log_gauss_norm = 0.5 * k * math.log(2.0 * math.pi) - 0.5 * float(np.sum(np.log(w)))
    rng = np.random.default_rng(seed)
    m = round(samples * GAUSSIAN_SHARE)
    near = z[idx][None, :] + rng.standard_normal((m, k)) @ root.T
    u = rng.uniform(size=(samples - m, k))
    wide = np.log(u) - np.log1p(-u)
    at = np.concatenate([near, wide])
    d = at - z[idx][None, :]
    log_q_gauss = -0.5 * np.einsum("ij,jk,ik->i", d, hb, d) - log_gauss_norm
    log_q = np.logaddexp(
        math.log(GAUSSIAN_SHARE) + log_q_gauss,
        math.log(1.0 - GAUSSIAN_SHARE) + _log_logistic(at),
    )
    points = np.tile(z, (samples + 1, 1))
    points[1:, idx] = at
    f = np.asarray(values(points), np.float64)
    f0 = f[0]
    if not math.isfinite(f0):
        raise ValueError("block_integral: the objective is not finite at the mode")
    with np.errstate(invalid="ignore"):
        log_w = np.where(np.isfinite(f[1:]), -(f[1:] - f0) - log_q, -np.inf)
    log_i = float(np.logaddexp.reduce(log_w)) - math.log(samples)
    top = float(np.max(log_w))
    wt = np.exp(log_w - top)
    mean = float(np.mean(wt))
    # (the points drawn from each component are a stratum: the estimate's variance is the
    # sum of the strata's, which vanishes where the weights are constant in each, e.g. a
    # Gaussian block's, the prior's points then weighing nothing)
    spread = m * float(np.var(wt[:m])) + (samples - m) * float(np.var(wt[m:]))
    error = math.sqrt(spread) / samples / mean if mean > 0 else math.inf
    effective = float(np.sum(wt) ** 2 / np.sum(wt**2)) if mean > 0 else 0.0
    return BlockIntegral(log_i - log_gauss_norm, error, effective)
