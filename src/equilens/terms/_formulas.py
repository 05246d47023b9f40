"""The terms' formulas that both backends evaluate, written once for an array namespace
`xp` (`jax.numpy` in the terms' methods, NumPy in the Numba backend's
`equilens.numba.value`): a change here changes both, and the parity tests
(tests/test_numba.py) hold them together.
"""

import math


def gaussian_normalisation(log_sigma_sum, n):
    """`sum log(sigma sqrt(2 pi))` over `n` Gaussian residuals, from `sum log sigma`."""
    return log_sigma_sum + 0.5 * math.log(2 * math.pi) * n


def poisson_deviance(xp, model, data, background, exposure_time, gammaln):
    """`sum [lam - c log lam + log Gamma(c + 1)]` with counts `c = (data + background) t`
    (floored at 0) and `lam = (model + background) t` (floored at the dtype's smallest
    normal number); `gammaln` is the namespace's log-Gamma."""
    c = xp.maximum((data + background) * exposure_time, 0.0)
    lam = xp.maximum((model + background) * exposure_time, xp.finfo(model.dtype).tiny)
    return xp.sum(lam - c * xp.log(lam) + gammaln(c + 1))


def threshold_excess(xp, bx, by, threshold, sigma):
    """`PositionsThreshold`'s residuals: for images traced to `(bx, by)`, how far beyond
    `threshold` each lies from their mean, over `sigma` (zero inside, with a zero
    gradient; the square root only sees values `>= threshold^2 > 0`)."""
    d2 = (bx - xp.mean(bx)) ** 2 + (by - xp.mean(by)) ** 2
    t2 = threshold * threshold
    return (xp.sqrt(xp.where(d2 > t2, d2, t2)) - threshold) / sigma


def standardised(xp, value, mean, sigma):
    """`(value - mean) / sigma`, flattened: a `GaussianPrior`'s residuals. A `sigma` of
    fewer entries than the parameter is refused (a `ValueError`): the prior's
    normalisation counts `sigma`'s entries, one per element of the parameter."""
    n, k = math.prod(xp.shape(value)), math.prod(xp.shape(sigma))
    if k != n:
        raise ValueError(
            f"GaussianPrior: the parameter has {n} elements but sigma has {k}: give one "
            f"sigma per element (e.g. jnp.full({n}, sigma)), which the prior's "
            "normalisation counts"
        )
    return xp.reshape((value - mean) / sigma, (-1,))


def log_volume(xp, lower, upper):
    """`sum log(upper - lower)`: a `UniformPrior`'s value inside its box."""
    return xp.sum(xp.log(upper - lower))


#: `LogisticPrior`'s constant per element: `-log(s (1 - s))` at its minimum, `s = 1/2`.
LOGISTIC_CONSTANT = 2.0 * math.log(2.0)


def logistic_residuals(xp, theta, lower, upper):
    """`LogisticPrior`'s residuals `2 sign(z) sqrt(log cosh(z / 2))`, `z = logit((theta -
    lower) / (upper - lower))`, flattened: `0.5 r^2 + LOGISTIC_CONSTANT = -log(s (1 - s))`,
    `s = sigmoid(z)`. Near `z = 0`, `log cosh(w) / (w^2 / 2)` by its series (smooth there,
    finite gradient)."""
    theta = xp.reshape(theta, (-1,))
    z = xp.log(theta - lower) - xp.log(upper - theta)
    w = 0.5 * z
    small = xp.abs(w) < 1e-3
    safe = xp.where(small, 1.0, w)
    a = xp.abs(safe)
    log_cosh = a + xp.log1p(xp.exp(-2 * a)) - math.log(2.0)
    ratio = xp.where(small, 1.0 - w * w / 6.0, log_cosh / (0.5 * safe * safe))
    return z / math.sqrt(2.0) * xp.sqrt(ratio)
