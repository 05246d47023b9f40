"""Nested sampling (nautilus) of an `Objective`'s posterior and evidence, its likelihood
evaluated by the Numba backend on every CPU core (or by JAX where that is faster:
`equilens.numba.log_density`).

Nested sampling integrates the likelihood over a normalised prior, so the objective is
split in two: its prior terms (`GaussianPrior`, `UniformPrior`) become the prior
transform from nautilus's unit cube, every other term the log-likelihood
`-sum_i weights[i] * terms[i](model)`. A free parameter without a prior term gets a
uniform prior on its bounds (the class bounds, `bounds=`, or `box_width` times the start
fit's error around it), which must then be finite. The log-evidence is that of the data
under this prior: `log Z = log integral L(theta) pi(theta) dtheta`, with the likelihood's
normalisation (`-chi2/2 - sum log(sigma sqrt(2 pi))` for a Gaussian likelihood), so two
models' `log_evidence` differences are log Bayes factors.
"""

import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree
from jaxtyping import Float, PyTree

from ..objective import Objective, Parametrisation
from ..terms import GaussianPrior, UniformPrior
from ._result import FitResult
from ._sample import QUANTILES, format_summary, parameter_summary


class NestedPosterior(eqx.Module):
    """Weighted posterior points and the evidence, from `equilens.nested_sample`.

    **Fields:**

    - `points`: `(n, n_params)` physical values, ordered and named as `names` (the names
      and order of `FitResult.table()`).
    - `log_weights`: `(n,)` normalised log importance weights (`logsumexp = 0`).
    - `log_likelihood`: `(n,)` the log-likelihood at each point (the objective's
      non-prior terms, negated).
    - `log_evidence`, `log_evidence_error`: `log Z` (natural log) and its statistical
      error, `1 / sqrt(n_eff)` (nautilus's importance-sampling estimate; it does not
      include a bias from bounds that cut the likelihood, which nautilus keeps below
      its statistical error in its tests).
    - `n_eff`: the effective sample size of the weighted points (Kish).
    - `n_likelihood`: likelihood evaluations used.
    - `box`: `(n_params, 2)` each parameter's prior support (`-inf`/`inf` for an
      untruncated Gaussian prior).
    - `template`, `parametrisation`: the start model and its free parameters (`model`
      puts a point back into a model).
    - `names`, `backend` (static): the parameter names and the likelihood's backend
      ("numba" or "jax").
    """

    points: Float[np.ndarray, "n n_params"]
    log_weights: Float[np.ndarray, " n"]
    log_likelihood: Float[np.ndarray, " n"]
    log_evidence: float
    log_evidence_error: float
    n_eff: float
    n_likelihood: int
    box: Float[np.ndarray, "n_params 2"]
    template: PyTree[Any]
    parametrisation: Parametrisation
    names: tuple[str, ...] = eqx.field(static=True)
    backend: str = eqx.field(static=True)

    @property
    def weights(self) -> Float[np.ndarray, " n"]:
        return np.exp(self.log_weights)

    def mean(self) -> Float[np.ndarray, " n_params"]:
        return self.weights @ self.points

    def covariance(self) -> Float[np.ndarray, "n_params n_params"]:
        w = self.weights
        d = self.points - self.mean()
        # the unbiased weighted covariance (reliability weights)
        return (d.T * w) @ d / (1.0 - np.sum(w**2))

    def std(self) -> Float[np.ndarray, " n_params"]:
        return np.sqrt(np.diagonal(self.covariance()))

    def quantiles(self, q: tuple[float, ...] = QUANTILES) -> Float[np.ndarray, "n_q n_params"]:
        """Weighted quantiles of each parameter (the inverse of the weighted empirical
        distribution, linearly interpolated between points)."""
        out = np.empty((len(q), self.points.shape[1]))
        for i in range(self.points.shape[1]):
            order = np.argsort(self.points[:, i])
            x, w = self.points[order, i], self.weights[order]
            cdf = np.cumsum(w) - 0.5 * w
            out[:, i] = np.interp(q, cdf, x)
        return out

    def draws(self, n: int | None = None, seed: int = 0) -> Float[np.ndarray, "m n_params"]:
        """`n` equal-weight draws (default `round(n_eff)`), resampled with the weights
        (systematic resampling)."""
        n = max(1, round(self.n_eff)) if n is None else int(n)
        if n < 1:
            raise ValueError(f"draws: n must be >= 1, got {n}")
        u = (np.random.default_rng(seed).random() + np.arange(n)) / n
        idx = np.searchsorted(np.cumsum(self.weights), u)
        return self.points[np.minimum(idx, len(self.points) - 1)]

    def model(self, index: int) -> PyTree[Any]:
        """Point `index` as a model (the template with its free leaves set; linearly solved
        amplitudes as in the template)."""
        _, unravel = ravel_pytree(self.parametrisation.values(self.template))
        values = unravel(jnp.asarray(self.points[index]))
        return self.parametrisation.with_values(values, self.template)

    def to_dict(self) -> dict[str, Any]:
        """Per parameter: posterior `mean`, `std`, the 16/50/84% quantiles (`p16`, `p50`,
        `p84`) and the prior support (`prior`: `[lower, upper]`); plus `log_evidence`,
        `log_evidence_error`, `n_eff` and the likelihood calls. Plain Python numbers."""
        params = parameter_summary(self.names, self.mean(), self.std(), self.quantiles())
        for name, (lo, hi) in zip(self.names, self.box, strict=True):
            params[name]["prior"] = [float(lo), float(hi)]
        return {
            "parameters": params,
            "log_evidence": float(self.log_evidence),
            "log_evidence_error": float(self.log_evidence_error),
            "n_eff": float(self.n_eff),
            "likelihood_calls": int(self.n_likelihood),
            "sampler": "nautilus",
        }

    def summary(self) -> str:
        """One line per parameter (mean, standard deviation, 16/50/84% quantiles), then
        the log-evidence with its error."""
        d = self.to_dict()
        return format_summary(
            d["parameters"],
            f"log Z = {d['log_evidence']:.3f} +- {d['log_evidence_error']:.3f} (nautilus, "
            f"{d['n_eff']:.0f} effective samples, {d['likelihood_calls']} likelihood calls "
            f"on {self.backend})",
        )

    def to_arviz(self, n: int | None = None, seed: int = 0) -> Any:
        """`draws(n, seed)` as ArviZ data (one chain; `InferenceData` with arviz < 1, its
        `DataTree` with arviz >= 1), the log-evidence and its error in the posterior
        group's attributes. Needs `arviz`."""
        import arviz as az

        draws = self.draws(n, seed)
        posterior = {name: draws[None, :, i] for i, name in enumerate(self.names)}
        attrs = {
            "log_evidence": float(self.log_evidence),
            "log_evidence_error": float(self.log_evidence_error),
            "sampler": "nautilus",
        }
        if int(az.__version__.split(".")[0]) >= 1:
            return az.from_dict({"posterior": posterior}, attrs={"posterior": attrs})
        return az.from_dict(posterior=posterior, posterior_attrs=attrs)

    def corner(self, truths: Any = None, **kwargs: Any) -> Any:
        """A weighted corner plot of the points (`corner.corner`, which must be
        installed), labelled with `names`. Returns the matplotlib figure."""
        import corner

        truths = None if truths is None else np.asarray(truths)
        return corner.corner(
            self.points, weights=self.weights, labels=list(self.names), truths=truths, **kwargs
        )


class _Prior:
    """The prior transform from the unit cube: element `k` uniform on `box[k]` where
    `sigma[k]` is NaN, else normal `N(mean[k], sigma[k]^2)` truncated to `box[k]`."""

    def __init__(self, box: np.ndarray, mean: np.ndarray, sigma: np.ndarray):
        from scipy.special import ndtr

        self.lo, self.hi = box[:, 0], box[:, 1]
        self.gauss = np.isfinite(sigma)
        self.mean, self.sigma = np.where(self.gauss, mean, 0.0), np.where(self.gauss, sigma, 1.0)
        # the standard normal's CDF at the truncation points
        self.c_lo = np.where(self.gauss, ndtr((self.lo - self.mean) / self.sigma), 0.0)
        self.c_hi = np.where(self.gauss, ndtr((self.hi - self.mean) / self.sigma), 1.0)
        if np.any(self.gauss & (self.c_hi - self.c_lo < 1e-12)):
            raise ValueError("nested_sample: a Gaussian prior lies outside its parameter's bounds")
        uniform = ~self.gauss
        self.flat_lo, self.flat_span = np.zeros_like(self.lo), np.zeros_like(self.lo)
        self.flat_lo[uniform] = self.lo[uniform]
        self.flat_span[uniform] = self.hi[uniform] - self.lo[uniform]

    def __call__(self, u: np.ndarray) -> np.ndarray:
        from scipy.special import ndtri

        c = self.c_lo + u * (self.c_hi - self.c_lo)
        gauss = self.mean + self.sigma * ndtri(np.clip(c, 1e-300, 1.0 - 1e-16))
        flat = self.flat_lo + u * self.flat_span
        return np.clip(np.where(self.gauss, gauss, flat), self.lo, self.hi)


def _prior_rows(term: Any, template: Any, param: Parametrisation, v0: np.ndarray) -> np.ndarray:
    """Which element of the free-parameter vector each element of `term.where(model)` is
    (-1 for a fixed parameter). Raises if the prior is on something other than
    parameters (a derived quantity)."""
    _, unravel = ravel_pytree(param.values(template))

    def picked(v):
        model = param.with_values(unravel(v), template)
        return jnp.concatenate([jnp.ravel(x) for x in jax.tree.leaves(term.where(model))])

    jac = np.asarray(jax.jacobian(picked)(jnp.asarray(v0)))
    rows = np.full(jac.shape[0], -1)
    for r, row in enumerate(jac):
        nz = np.flatnonzero(row)
        if len(nz) > 1 or (len(nz) == 1 and row[nz[0]] != 1.0):
            raise ValueError(
                f"nested_sample: the {type(term).__name__} picks a function of the "
                "parameters, not parameters; nested sampling needs priors on parameters"
            )
        if len(nz) == 1:
            rows[r] = nz[0]
    return rows


def nested_sample(
    objective: Objective,
    start: FitResult | PyTree[Any],
    *,
    free: Any = None,
    bounds: Any = None,
    box_width: float | None = None,
    n_live: int = 1000,
    n_eff: int = 10000,
    f_live: float = 0.01,
    n_networks: int = 4,
    seed: int = 0,
    backend: str = "auto",
    threads: int | None = None,
    verbose: bool = False,
) -> NestedPosterior:
    """Samples the posterior of the free parameters and computes the evidence with the
    nested sampler nautilus (Lange 2023), the likelihood evaluated on the host by
    `equilens.numba.log_density` (Numba on every CPU core; JAX for large images or on an
    accelerator: `backend`).

    **Arguments:**

    - `objective`: the `Objective`. Its `GaussianPrior` and `UniformPrior` terms (weight
      1, on parameters, not on functions of them) are the prior (a Gaussian prior on a
      bounded parameter truncated to the bounds and renormalised; a prior on a parameter
      that is not free is a constant and is left out); every other term, with its weight,
      is the negative log-likelihood.
    - `start`: a `FitResult` or a model: the template (fixed parameters, structure,
      linearly solved amplitudes' layout). Nested sampling does not start from it.
    - `free`, `bounds`: as for `equilens.fit` (the same parameters and intervals).
    - `box_width`: with a `FitResult` start, each free parameter without a prior term
      gets a uniform prior on the fit's value +- `box_width` times its Laplace error,
      inside its bounds (a data-driven prior, like PyAutoLens's prior passing: state it
      when you quote the evidence). Without it, such a parameter's bounds must be finite
      (`bounds=` or a `UniformPrior`); a `ValueError` names those that are not.
    - `n_live`, `n_eff`, `f_live`, `n_networks`: nautilus's live points, the effective
      sample size to reach, the live-set evidence fraction at which exploration stops and
      the neural networks per bound.
    - `seed`: nautilus's random seed (runs are reproducible with the same seed and
      threads).
    - `backend`: "auto", "numba" or "jax" (`equilens.numba.log_density`).
    - `threads`: Numba threads for the likelihood during this call (default: Numba's
      current setting, all cores); restored afterwards.

    Returns a `NestedPosterior` (weighted points, `log_evidence` and its error). Needs
    `nautilus-sampler` (`pip install equilens[sampling]`).
    """
    from nautilus import Sampler

    from ..numba._terms import density
    from ._fit import parametrisation

    if not isinstance(objective, Objective):
        raise TypeError(f"objective must be an equilens Objective, got {type(objective)}")
    for name, value, minimum in (("n_live", n_live, 10), ("n_eff", n_eff, 1), ("seed", seed, 0)):
        if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < minimum:
            raise ValueError(
                f"nested_sample: {name} must be an integer >= {minimum}, got {value!r}"
            )
    if not 0.0 < float(f_live) < 1.0:
        raise ValueError(f"nested_sample: f_live must be in (0, 1), got {f_live}")
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ValueError(f"nested_sample: threads must be a positive integer, got {threads!r}")

    fitted = isinstance(start, FitResult)
    template = start.model if fitted else start
    weights = np.asarray(objective.weights)
    priors = [t for t in objective.terms if isinstance(t, GaussianPrior | UniformPrior)]
    likelihood = [
        (t, w)
        for t, w in zip(objective.terms, weights, strict=True)
        if not isinstance(t, GaussianPrior | UniformPrior)
    ]
    for t, w in zip(objective.terms, weights, strict=True):
        if isinstance(t, GaussianPrior | UniformPrior) and w != 1.0:
            raise ValueError(
                f"nested_sample: a {type(t).__name__} with weight {w} is not a normalised "
                "prior: give prior terms weight 1"
            )
    if not likelihood:
        raise ValueError("nested_sample: the objective has no likelihood term (only priors)")
    like_objective = Objective([t for t, _ in likelihood], [float(w) for _, w in likelihood])

    # the fit's parameters (with the uniform priors' intervals as bounds), so the names and
    # order are FitResult's
    param = parametrisation(objective, template, free, bounds)
    if param.n_free == 0:
        raise ValueError("nested_sample: no free parameters (`free` selects no leaf)")
    names = param.paths(template)
    v0 = np.asarray(ravel_pytree(param.values(template))[0], np.float64)
    n = v0.size
    box = np.array(
        [
            b if b is not None else (-math.inf, math.inf)
            for leaf, f, b in zip(jax.tree.leaves(template), param.free, param.bounds, strict=True)
            if f
            for _ in range(int(np.size(leaf)))
        ],
        dtype=np.float64,
    ).reshape(n, 2)

    mean, sigma = np.full(n, np.nan), np.full(n, np.nan)
    has_prior = np.zeros(n, bool)
    for t in priors:
        rows = _prior_rows(t, template, param, v0)
        if isinstance(t, GaussianPrior):
            shape = rows.shape
            m = np.broadcast_to(np.asarray(t.mean, np.float64), shape)
            s = np.broadcast_to(np.asarray(t.sigma, np.float64), shape)
            for r, k in enumerate(rows):
                if k < 0:
                    continue
                if has_prior[k]:
                    raise ValueError(f"nested_sample: {names[k]} has two prior terms")
                mean[k], sigma[k], has_prior[k] = m[r], s[r], True
        else:
            lo = np.broadcast_to(np.asarray(t.lower, np.float64), rows.shape)
            hi = np.broadcast_to(np.asarray(t.upper, np.float64), rows.shape)
            for r, k in enumerate(rows):
                if k < 0:
                    continue
                if has_prior[k]:
                    raise ValueError(f"nested_sample: {names[k]} has two prior terms")
                box[k] = (max(box[k, 0], lo[r]), min(box[k, 1], hi[r]))
                has_prior[k] = True

    if box_width is not None:
        if not fitted:
            raise ValueError("nested_sample: box_width needs a FitResult start (its errors)")
        if not (math.isfinite(float(box_width)) and float(box_width) > 0):
            raise ValueError(f"nested_sample: box_width must be positive, got {box_width}")
        if tuple(start.names) != names:
            raise ValueError("nested_sample: box_width needs the fit's own free parameters")
        err = np.asarray(start.errors, np.float64)
        if not np.all(np.isfinite(err) & (err > 0)):
            raise ValueError(
                "nested_sample: box_width needs the fit's errors, which are missing (its "
                "covariance failed): give bounds instead"
            )
        width = float(box_width) * err
        no_prior = ~has_prior
        box[no_prior, 0] = np.maximum(box[no_prior, 0], v0[no_prior] - width[no_prior])
        box[no_prior, 1] = np.minimum(box[no_prior, 1], v0[no_prior] + width[no_prior])
    unbounded = [
        names[k] for k in range(n) if np.isnan(sigma[k]) and not np.all(np.isfinite(box[k]))
    ]
    if unbounded:
        raise ValueError(
            "nested_sample: a uniform prior needs finite bounds, and these parameters have "
            f"none: {', '.join(unbounded)}. Pass bounds={{where: (lower, upper)}}, a "
            "UniformPrior or GaussianPrior term, or box_width with a fit"
        )

    # the likelihood over the same parameters (the uniform priors' bounds apply there too)
    dens = density(like_objective, template, param, backend)
    prior = _Prior(box, mean, sigma)

    def run() -> Any:
        sampler = Sampler(
            prior,
            dens.f,
            n_dim=n,
            n_live=int(n_live),
            n_networks=int(n_networks),
            seed=int(seed),
        )
        sampler.run(f_live=float(f_live), n_eff=int(n_eff), verbose=verbose)
        return sampler

    if threads is not None and dens.backend == "numba":
        import numba

        before = numba.get_num_threads()
        numba.set_num_threads(threads)  # (a ValueError above NUMBA_NUM_THREADS)
        try:
            sampler = run()
        finally:
            numba.set_num_threads(before)
    else:
        sampler = run()
    points, log_w, log_l = sampler.posterior()
    w = np.exp(log_w)
    n_eff_kish = float(1.0 / np.sum(w**2))
    return NestedPosterior(
        points=np.asarray(points, np.float64),
        log_weights=np.asarray(log_w, np.float64),
        log_likelihood=np.asarray(log_l, np.float64),
        log_evidence=float(sampler.log_z),
        log_evidence_error=float(1.0 / math.sqrt(max(float(sampler.n_eff), 1.0))),
        n_eff=n_eff_kish,
        n_likelihood=int(sampler.n_like),
        box=box,
        template=template,
        parametrisation=param,
        names=names,
        backend=dens.backend,
    )
