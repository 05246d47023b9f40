"""`importance_evidence`: the integral of `exp(-F(z))` by adaptive importance sampling
from Gaussians fitted to its values.

For objectives rough on scales below their errors, where the Laplace approximation is
unreliable: a pixelized source's log-evidence changes its mapping whenever a traced pixel
crosses a cell of the mesh; on the subhalo suite's lens 2 its values scatter by about 1.3
(root mean square) about a quadratic over the 1-sigma region. A Laplace approximation
takes `F` at the fitted optimum, where a fit on a rough objective stops in one of its
dips, and central differences about that dip: each diagonal entry of the Hessian gains
twice the dip's depth (in units of the steps), so the curvature comes out too large
(there by 2 to 10 times in variance) and the evidence moves with the steps. The integral
itself is well defined, and importance sampling estimates it with an error that falls as
one over the square root of the number of values:

    E = integral exp(-F(z)) dz ~ (1 / N) sum_i exp(-F(z_i)) / q(z_i),   z_i ~ q,

with `q` close to `exp(-F) / E`. Each round draws from a Gaussian; the next one comes
from a regression of the round's values on a quadratic with one curvature per axis of
the current Gaussian, each shrunk toward the curvature common to all axes (one
coefficient, well determined however rough `F` is: `_next_proposal`), and is widened by
`IMPORTANCE_WIDEN` (a proposal wider than the integrand costs only efficiency, a
narrower one the estimate's variance). The estimate weighs every point by the mixture of
all the rounds' Gaussians (the balance heuristic of adaptive multiple importance
sampling, Cornuet et al. 2012, arXiv:0907.1254). The points are antithetic pairs of
standard normal draws from a fixed seed: the same call gives the same value.

The error (`ImportanceEvidence.error`, from the weights' scatter) is itself an estimate:
where few points carry the weight (`effective` of a few tens or less: an integrand far
from any Gaussian) it can fall short of the true error; nested sampling is then the
reference (`equilens.nested_sample`).
"""

import math
from collections.abc import Callable

import numpy as np
from scipy.special import logsumexp

#: The draws' seed: the same points (in whitened units) every call.
IMPORTANCE_SEED = 20101
#: Each round's Gaussian is the regression's (`_next_proposal`) widened by this in variance
#: (a margin: an importance density narrower than the integrand has a large variance).
IMPORTANCE_WIDEN = 1.3


class ImportanceEvidence:
    """The outcome of `importance_evidence`: `log_evidence` (natural log of the integral of
    `exp(-F)`), `error` (its standard error, from the weights' scatter), `mean` and
    `covariance` (the weighted moments of `z`), `effective` (the effective number of
    samples, Kish's, of all rounds together), `values` (how many `F` were evaluated),
    `invalid` (how many were not finite: weight zero)."""

    __slots__ = ("covariance", "effective", "error", "invalid", "log_evidence", "mean", "values")

    def __init__(self, log_evidence, error, mean, covariance, effective, values, invalid):
        self.log_evidence = log_evidence
        self.error = error
        self.mean = mean
        self.covariance = covariance
        self.effective = effective
        self.values = values
        self.invalid = invalid


def _first_covariance(hessian: np.ndarray) -> np.ndarray:
    """The inverse of `hessian` with its eigenvalues' magnitudes (floored at 1e-12 of the
    largest), or of its diagonal's where it is not finite."""
    h = np.asarray(hessian, np.float64)
    if not np.all(np.isfinite(h)):
        d = np.abs(np.diagonal(h))
        d = np.where(np.isfinite(d) & (d > 0), d, 1e6)
        return np.diag(1.0 / d)
    w, v = np.linalg.eigh(0.5 * (h + h.T))
    w = np.abs(w)
    w = np.maximum(w, 1e-12 * max(float(w.max()), 1e-300))
    return (v / w[None, :]) @ v.T


def _log_normal(z: np.ndarray, mean: np.ndarray, chol: np.ndarray) -> np.ndarray:
    """`log N(z; mean, chol chol^T)` at the rows of `z`."""
    u = np.linalg.solve(chol, (z - mean[None, :]).T)
    k = z.shape[1]
    log_det = 2.0 * float(np.sum(np.log(np.abs(np.diagonal(chol)))))
    return -0.5 * np.sum(u * u, axis=0) - 0.5 * (k * math.log(2 * math.pi) + log_det)


def _cholesky(cov: np.ndarray) -> np.ndarray:
    cov = 0.5 * (cov + cov.T)
    jitter = 0.0
    scale = float(np.max(np.abs(np.diagonal(cov))))
    for _ in range(8):
        try:
            return np.linalg.cholesky(cov + jitter * np.eye(cov.shape[0]))
        except np.linalg.LinAlgError:
            jitter = max(10 * jitter, 1e-12 * scale)
    raise np.linalg.LinAlgError("importance_evidence: the proposal's covariance is not positive")


def _next_proposal(z, f, mean, chol) -> tuple[np.ndarray, np.ndarray]:
    """The next round's Gaussian from this round's values: `F` regressed on `c + g . u +
    sum_i a_i u_i^2 / 2` in this proposal's whitened units `u` (`2 k + 1` coefficients
    from as many values as a round has), each `a_i` shrunk toward the common curvature
    of `c + g . u + a |u|^2 / 2` (one coefficient: well determined however rough `F`) by
    their errors, with a prior spread of half of it (and kept within a factor of 4 of
    it); each axis rescaled by `1 / a_i`, the centre moved to the fit's minimum (at most
    1 sigma an axis), and widened by `IMPORTANCE_WIDEN`. Twice as wide (in sigma) where
    the common curvature is not positive.
    The weights' moments are no guide here: a proposal that misses the integrand's
    width by a factor of 2 in 10 dimensions leaves a handful of points carrying the
    weight."""
    k = z.shape[1]
    ok = np.isfinite(f)
    u = np.linalg.solve(chol, (z[ok] - mean[None, :]).T).T
    x = np.concatenate([np.ones((u.shape[0], 1)), u, 0.5 * u * u], axis=1)
    if u.shape[0] < 2 * x.shape[1]:
        return mean, 4.0 * chol @ chol.T
    y = f[ok]
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    resid = y - x @ coef
    noise = float(resid @ resid) / max(y.shape[0] - x.shape[1], 1)
    err = np.sqrt(np.maximum(np.diagonal(np.linalg.pinv(x.T @ x))[1 + k :] * noise, 1e-300))
    # one curvature for every axis (its error far smaller), and each axis's own shrunk
    # toward it by their errors (a prior spread of half that common curvature)
    xs = np.concatenate([x[:, : 1 + k], np.sum(x[:, 1 + k :], axis=1, keepdims=True)], axis=1)
    common = float(np.linalg.lstsq(xs, y, rcond=None)[0][-1])
    if not common > 0:
        return mean, 4.0 * chol @ chol.T
    tau = 0.5 * common
    a = (coef[1 + k :] / err**2 + common / tau**2) / (1.0 / err**2 + 1.0 / tau**2)
    g = coef[1 : 1 + k]
    a = np.clip(a, common / 4.0, 4.0 * common)
    shift = np.clip(-g / a, -1.0, 1.0)
    scaled = chol / np.sqrt(a)[None, :]
    return mean + chol @ shift, IMPORTANCE_WIDEN * scaled @ scaled.T


def importance_evidence(
    values: Callable[[np.ndarray], np.ndarray],
    z0: np.ndarray,
    hessian: np.ndarray,
    *,
    rounds: int = 3,
    size: int | None = None,
) -> ImportanceEvidence:
    """`log integral exp(-F(z)) dz` (module docstring) with `values` giving `F` at each row
    of an array of points, from `z0` (a fitted optimum) and an estimate of `F`'s Hessian
    there (the first proposal: the inverse of its eigenvalues' magnitudes; off by a factor
    of 2 in the errors is fine, the rounds correct it);
    `rounds` rounds of `size` values each (default `max(2 k^2 + 2, 64)` for `k`
    parameters: as many as `smoothed_value_hessian`'s central differences take a round)."""
    z0 = np.asarray(z0, np.float64)
    k = z0.shape[0]
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    n = int(size) if size is not None else max(2 * k * k + 2, 64)
    if n < 2:
        raise ValueError(f"size must be >= 2, got {size}")
    half = (n + 1) // 2
    rng = np.random.default_rng(IMPORTANCE_SEED)
    mean, cov = z0, _first_covariance(hessian)
    proposals: list[tuple[np.ndarray, np.ndarray]] = []
    points: list[np.ndarray] = []
    minus_f: list[np.ndarray] = []
    for r in range(rounds):
        chol = _cholesky(cov)
        u = rng.standard_normal((half, k))
        z = mean[None, :] + np.concatenate([u, -u])[:n] @ chol.T
        f = np.asarray(values(z), np.float64)
        proposals.append((mean, chol))
        points.append(z)
        minus_f.append(np.where(np.isfinite(f), -f, -np.inf))
        if r + 1 < rounds:
            mean, cov = _next_proposal(z, f, mean, chol)
    zz, mf = np.concatenate(points), np.concatenate(minus_f)
    total = zz.shape[0]
    # the balance heuristic: every point weighed by the mixture of all the proposals
    log_q = np.asarray(logsumexp(np.stack([_log_normal(zz, m, c) for m, c in proposals]), axis=0))
    log_w = mf - (log_q - math.log(len(proposals)))
    log_sum = float(np.asarray(logsumexp(log_w)))
    log_e = log_sum - math.log(total)
    w = np.exp(log_w - log_e)  # the weights over their mean
    p = np.exp(log_w - log_sum)
    mean_w = p @ zz
    d = zz - mean_w[None, :]
    return ImportanceEvidence(
        log_evidence=log_e,
        error=float(np.std(w, ddof=1) / math.sqrt(total)),
        mean=mean_w,
        covariance=(d * p[:, None]).T @ d,
        effective=1.0 / float(np.sum(p * p)),
        values=total,
        invalid=int(np.sum(~np.isfinite(mf))),
    )
