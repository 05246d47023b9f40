"""How far the scan's evidence estimates are from the truth on rough integrands of known
integral (issue 50: which estimate the subhalo scan should use).

A pixelized source's log-evidence is rough on scales below its errors, and a fit stops in
one of the roughness's dips. This script builds integrands with the same trait and a known
integral, in `k` = 7 (the Jackpot's smooth model) and 10 (a cell: 3 more) dimensions:

    F(z) = |u|^2 / 2 + r(u),   u = L^-1 (z - c),

`L` a random correlated scale (errors spread over 4 decades), `r` a random field of
standard deviation `a` and correlation length `ell` (in sigma; 300 random Fourier
features). The integral is `log |det L| + (k / 2) log 2 pi + log <exp(-r)>` over `u ~ N(0,
I)`, the last term by Monte Carlo (400,000 draws: an error below 0.01 here). The "fit" is
BFGS from 0.3 sigma off the centre: it stops in a dip of `r`. From there, as
`laplace_evidence(smoothed=True)` does:

- **differences** (the scan's): the Hessian from central differences of the values over
  1-sigma steps, the steps from the previous round's errors (`smoothed_value_hessian`),
  1 to 3 rounds of `2 k^2 + 1` values;
- **importance** (`smoothing="importance"`): one round of those differences, then 2 or 3
  rounds of adaptive importance sampling (`importance_evidence`);
- **regression** (a trial, not in the library): a quadratic fitted by least squares to
  the values at `3 (k + 1)(k + 2) / 2` points a round drawn from a Gaussian (the first from
  the local curvature's diagonal, widened 2 times in variance; the next from the last fit),
  2 rounds, and the Gaussian integral of the last fit.

    python validation/evidence_estimators.py [--lenses 6] [--k 7,10]

Prints, for each roughness, each estimate's mean and spread about the truth. What it found
(docs/subhalo.md) is about the estimates on this kind of integrand; the pixelized
evidence's own structure is measured on the Jackpot there.
"""

import argparse
import math

import jax
import numpy as np
from scipy.optimize import minimize
from scipy.special import logsumexp

jax.config.update("jax_enable_x64", True)

from equilens.solve._covariance import smoothed_value_hessian  # noqa: E402
from equilens.solve._importance import importance_evidence  # noqa: E402

#: (a, ell): the random field's standard deviation and correlation length (sigma)
ROUGHNESS = ((0.15, 0.4), (0.25, 0.4), (0.5, 0.8))
FEATURES = 300
TRUTH_DRAWS = 400_000


def integrand(k: int, a: float, ell: float, seed: int):
    """`(F, its Hessian, the fitted optimum, log integral exp(-F))` of one integrand."""
    rng = np.random.default_rng(seed)
    g = rng.normal(size=(k, k))
    scale = np.exp(rng.uniform(-2, 2, k))[:, None]
    chol = np.linalg.cholesky(g @ g.T / k + 0.2 * np.eye(k)) * scale
    centre = rng.normal(size=k)
    omega = rng.normal(size=(FEATURES, k)) / ell
    phase = rng.uniform(0, 2 * np.pi, FEATURES)
    amp = a * math.sqrt(2.0 / FEATURES)
    inv = np.linalg.inv(chol)

    def f(z):
        u = (np.atleast_2d(z) - centre) @ inv.T
        return 0.5 * np.sum(u * u, 1) + amp * np.cos(u @ omega.T + phase).sum(1)

    def grad(z):
        u = (np.asarray(z) - centre) @ inv.T
        return (u - amp * (np.sin(u @ omega.T + phase) @ omega)) @ inv

    def hess(z):
        u = (np.asarray(z) - centre) @ inv.T
        return inv.T @ (np.eye(k) - amp * (omega.T * np.cos(u @ omega.T + phase)) @ omega) @ inv

    draws = np.random.default_rng(seed + 1).standard_normal((TRUTH_DRAWS, k))
    r = np.concatenate([amp * np.cos(d @ omega.T + phase).sum(1) for d in np.array_split(draws, 8)])
    truth = (
        math.log(abs(np.linalg.det(chol)))
        + 0.5 * k * math.log(2 * math.pi)
        + float(logsumexp(-r))
        - math.log(TRUTH_DRAWS)
    )
    start = centre + chol @ (0.3 * rng.standard_normal(k))
    fit = minimize(lambda z: f(z)[0], start, jac=grad, method="BFGS", options={"gtol": 1e-8})
    return f, hess, fit.x, truth


def laplace(f_min: float, hessian: np.ndarray) -> float:
    """The Laplace approximation from `F` at the optimum and a Hessian (NaN when it is not
    positive definite)."""
    w = np.linalg.eigvalsh(0.5 * (hessian + hessian.T))
    if w.min() <= 0:
        return math.nan
    k = w.shape[0]
    return -f_min + 0.5 * k * math.log(2 * math.pi) - 0.5 * float(np.sum(np.log(w)))


def regression(f, z0: np.ndarray, curvature: np.ndarray, rounds: int = 2) -> float:
    """The trial estimate (module docstring): the Gaussian integral of the quadratic
    fitted to the values of the last round (NaN when no fit was positive definite)."""
    k = z0.shape[0]
    n = 2 * math.ceil(1.5 * (k + 1) * (k + 2) / 2)
    i, j = np.triu_indices(k)
    rng = np.random.default_rng(7)
    mean, cov = z0, np.diag(2.0 / np.abs(curvature))
    out = math.nan
    for _ in range(rounds):
        chol = np.linalg.cholesky(0.5 * (cov + cov.T))
        u = rng.standard_normal((n // 2, k))
        u = np.concatenate([u, -u])
        design = np.concatenate(
            [np.ones((n, 1)), u, u[:, i] * u[:, j] * np.where(i == j, 0.5, 1.0)], axis=1
        )
        coef = np.linalg.lstsq(design, f(mean + u @ chol.T), rcond=None)[0]
        c, g = coef[0], coef[1 : 1 + k]
        a = np.zeros((k, k))
        a[i, j] = a[j, i] = coef[1 + k :]
        w, v = np.linalg.eigh(a)
        if w.min() <= 0:
            cov = 4.0 * cov
            continue
        a_inv = (v / w) @ v.T
        out = (
            -c
            + 0.5 * float(g @ a_inv @ g)
            + 0.5 * k * math.log(2 * math.pi)
            - 0.5 * float(np.sum(np.log(w)))
            + float(np.sum(np.log(np.diagonal(chol))))
        )
        mean = mean + chol @ np.clip(-a_inv @ g, -1.0, 1.0)
        cov = chol @ a_inv @ chol.T
    return out


def estimates(k: int, a: float, ell: float, seed: int) -> dict[str, float]:
    """Each estimate minus the truth, on one integrand."""
    f, hess, z, truth = integrand(k, a, ell, seed)
    h = hess(z)
    f_min = float(f(z)[0])
    values = lambda p: f(np.asarray(p))
    out = {}
    for rounds in (1, 2, 3):
        hs, _, _ = smoothed_value_hessian(
            lambda p: f(np.asarray(p))[0], z, np.diagonal(h), rounds=rounds, values=values
        )
        out[f"differences, {rounds} round{'s' if rounds > 1 else ''}"] = laplace(f_min, hs)
        if rounds == 1:
            first = hs
    for rounds in (2, 3):
        ie = importance_evidence(values, z, first, rounds=rounds)
        out[f"importance, 1 + {rounds} rounds"] = ie.log_evidence
    out["regression (trial), 2 rounds"] = regression(f, z, np.diagonal(h))
    return {name: v - truth for name, v in out.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lenses", type=int, default=6, help="integrands per roughness")
    parser.add_argument("--k", default="7,10", help="dimensions, comma-separated")
    args = parser.parse_args()
    for k in (int(v) for v in args.k.split(",")):
        for a, ell in ROUGHNESS:
            rows = [estimates(k, a, ell, 1000 * k + s) for s in range(args.lenses)]
            print(f"k = {k}, a = {a}, ell = {ell} sigma: estimate - truth, mean +- spread")
            for name in rows[0]:
                e = np.array([r[name] for r in rows])
                ok = np.isfinite(e)
                shown = f"{np.mean(e[ok]):+6.2f} +- {np.std(e[ok]):.2f}" if ok.any() else "   -"
                failed = f" ({np.sum(~ok)} not positive definite)" if (~ok).any() else ""
                print(f"  {name:32s} {shown}{failed}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
