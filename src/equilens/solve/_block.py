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

Here the integrand is taken along the block by importance sampling from a defensive
mixture: the block's Gaussian of the Laplace approximation (its marginal curvature, the
Schur complement of the other parameters' block of the Hessian) and the block's prior
(logistic in the unconstrained coordinate of a two-sided bound). At each point `b` of the
block, the other parameters are where the integrand's maximum over them is to be found,
the profile `F(b, x(b))`: the Laplace approximation of the integral over them, with their
curvature held, is `exp(-F(b, x(b)))` times a volume that is the approximation's own.
Each place the others are tried bounds that maximum from below, and the best is taken:
the others held at the mode (the slice through it); moved along the Gaussian's
conditional mode, `x(b) = x* + C_xb C_bb^-1 (b - b*)` (`C` the approximation's
covariance: a subhalo's mass traded against the host's Einstein radius, as the mode's
curvature couples them); and at the caller's `anchors` (a subhalo's cell: the smooth
model's parameters, the maximum where the subhalo is too light to matter, which the
conditional mode, linear in the log of its mass, overshoots), or on the line from such
an anchor through the mode, as far along it as the caller's `response` says (the macro
model's response to a light subhalo is linear in its mass: the anchor where the subhalo
is light, the mode at the mode's mass). The ratio of that integral to the block's
Gaussian's corrects the Laplace approximation for the block's shape:

    log E = log E_Laplace + log (I_block / I_Gaussian).

Where the integrand is the Gaussian, the ratio is 1 (to the sampling's error: the
conditional mode is then the maximum); where the block is flat, the prior's samples carry
it and the correction restores the prior's mass. Where the others' true answer to the
block is none of the places tried (far from the mode, or at a mode the fit missed), each
falls short of the maximum and the correction errs low: a lower bound of the profile's
integral.
"""

import math
from collections.abc import Callable, Sequence
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
    follow: bool = True,
    anchors: Sequence[Float[np.ndarray, " n"]] = (),
    response: Callable[[np.ndarray], np.ndarray] | None = None,
) -> BlockIntegral:
    """The integral of `exp(-(F - F(z)))` over the parameters `block` (indices into `z`,
    each with a two-sided bound: its prior is the logistic density in `z`), the others
    at the best of the mode, the Gaussian's conditional mode (not with `follow=False`)
    and the `anchors` below, over the integral of the block's Gaussian of `hess`
    (positive definite; its marginal curvature, or with `follow=False` its block), module
    docstring. `values` gives `F` at the rows of an array of points (`inf` where it cannot
    be evaluated). `samples` points of the block, `GAUSSIAN_SHARE` of them from that
    Gaussian, the rest from the prior, drawn by a generator seeded with `seed` (the same
    points for every call: reproducible). `anchors`: points (as `z`) whose other
    parameters are tried at every point of the block too (a subhalo's cell: the smooth
    model's, where the subhalo is too light to matter); with `response` (the block's
    points in `z`, rows, to the size of the others' response to the block relative to
    the mode's: 1 at the mode), on the line from each anchor through the mode instead,
    `anchor + response (z - anchor)` (a subhalo's mass over the mode's: the anchor where
    it is light, the mode at its mass). `F` is evaluated once a point for each place the
    others are tried."""
    z = np.asarray(z, np.float64)
    idx = np.asarray(block, np.int64)
    k = idx.size
    if k == 0 or samples < 2:
        raise ValueError(f"block_integral needs a block and samples >= 2, got {k}, {samples}")
    h = np.asarray(hess, np.float64)
    h = 0.5 * (h + h.T)
    others = np.setdiff1d(np.arange(z.size), idx)
    gain = None
    if follow and others.size:
        wh, vh = np.linalg.eigh(h)
        if not np.all(wh > 0):
            raise ValueError("block_integral: the Hessian is not positive definite")
        cov = (vh / wh[None, :]) @ vh.T
        hb = np.linalg.inv(cov[np.ix_(idx, idx)])
        # (the others' conditional mode per unit of the block: C_xb C_bb^-1)
        gain = cov[np.ix_(others, idx)] @ hb
    else:
        hb = h[np.ix_(idx, idx)]
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
    held = np.tile(z, (samples, 1))
    held[:, idx] = at
    tried = [held]
    if gain is not None:
        moved = held.copy()
        moved[:, others] += d @ gain.T
        tried.append(moved)
    t = None if response is None else np.asarray(response(at), np.float64).reshape(samples, 1)
    for a in anchors:
        a = np.asarray(a, np.float64)
        if a.shape != z.shape:
            raise ValueError(f"block_integral: an anchor has shape {a.shape}, not {z.shape}")
        there = np.tile(a, (samples, 1))
        if t is not None:
            there += t * (z - a)[None, :]
        there[:, idx] = at
        tried.append(there)
    f = np.asarray(values(np.concatenate([z[None, :], *tried])), np.float64)
    f0 = f[0]
    if not math.isfinite(f0):
        raise ValueError("block_integral: the objective is not finite at the mode")
    with np.errstate(invalid="ignore"):
        f = np.where(np.isfinite(f[1:]), f[1:], np.inf).reshape(len(tried), samples)
        # (each point's best place of the others: a lower bound of their maximum)
        f = np.min(f, axis=0)
        log_w = np.where(np.isfinite(f), -(f - f0) - log_q, -np.inf)
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
