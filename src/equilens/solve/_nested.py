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
import pickle
import sys
import time
import warnings
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree
from jaxtyping import Float, PyTree

from ..objective import Objective, Parametrisation
from ..terms import GaussianPrior, UniformPrior
from ._parametrise import parametrisation
from ._result import FitResult
from ._sample import (
    QUANTILES,
    SamplingInterrupted,
    format_summary,
    parameter_summary,
    stop_on_sigint,
)
from ._workers import DensityPool, _usable_cores


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
    - `status` (static): `"finished"` (nautilus reached `n_eff` with the live set's
      evidence below `f_live`) or `"interrupted"` (Ctrl-C: the points so far, carried by
      `NestedInterrupted`; before the exploration ended they are not a posterior).
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
    status: str = eqx.field(static=True, default="finished")

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
            "status": self.status,
        }

    def summary(self) -> str:
        """One line per parameter (mean, standard deviation, 16/50/84% quantiles), then
        the log-evidence with its error."""
        d = self.to_dict()
        return format_summary(
            d["parameters"],
            f"log Z = {d['log_evidence']:.3f} +- {d['log_evidence_error']:.3f} (nautilus, "
            f"{d['n_eff']:.0f} effective samples, {d['likelihood_calls']} likelihood calls "
            f"on {self.backend}{'' if self.status == 'finished' else ', ' + self.status})",
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


class NestedInterrupted(SamplingInterrupted):
    """Ctrl-C during `equilens.nested_sample`: a `SamplingInterrupted` (a
    `KeyboardInterrupt`) that carries the sampler's points so far as `posterior` (a
    `NestedPosterior` with `status "interrupted"`; None when no batch had finished)."""

    def __init__(self, posterior: "NestedPosterior | None"):
        SamplingInterrupted.__init__(self, posterior, "nested sampling interrupted")


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
    intervals: Mapping[str, tuple[float, float]] | None = None,
    n_live: int = 1000,
    n_eff: int = 10000,
    f_live: float = 0.01,
    n_networks: int = 4,
    seed: int = 0,
    backend: str = "auto",
    threads: int | None = None,
    processes: int | None = None,
    progress: bool = False,
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
    - `intervals`: `{name: (lower, upper)}` (physical values; the names of
      `FitResult.table()`): a uniform prior on that interval, inside the bounds (before
      `box_width`, which then leaves it as it is); a parameter with a prior term keeps
      that prior. The same intervals give two models compared by their evidence the
      same priors on the parameters they share.
    - `n_live`, `n_eff`, `f_live`, `n_networks`: nautilus's live points, the effective
      sample size to reach, the live-set evidence fraction at which exploration stops and
      the neural networks per bound.
    - `seed`: nautilus's random seed (runs are reproducible with the same seed and
      threads).
    - `backend`: "auto", "numba" or "jax" (`equilens.numba.log_density`).
    - `processes`: worker processes evaluating nautilus's batches of points in parallel
      (`equilens.solve._workers.DensityPool`: each a fresh interpreter holding the
      likelihood, a share of each batch per process). Default: one per usable CPU core
      when the likelihood runs on Numba, none (1: in this process) on JAX. They start in
      a few seconds and are stopped when the call returns or is interrupted.
    - `threads`: Numba threads per likelihood call: in each worker process (default 1),
      or in this process with `processes=1` (default: Numba's current setting, all
      cores; restored afterwards).
    - `progress`: print a line every `PROGRESS_EVERY` seconds to standard error: the phase
      (exploring, sampling), likelihood calls and their rate, log Z so far and an estimate
      of the time left (see `_Progress`). `verbose`: nautilus's own status table.

    Ctrl-C raises `NestedInterrupted` (a `KeyboardInterrupt`) carrying the points so far.

    Returns a `NestedPosterior` (weighted points, `log_evidence` and its error). Needs
    `nautilus-sampler` (`pip install equilens[sampling]`).
    """
    from nautilus import Sampler

    from ..numba._terms import density

    if not isinstance(objective, Objective):
        raise TypeError(f"objective must be an equilens Objective, got {type(objective)}")
    for name, value, minimum in (("n_live", n_live, 10), ("n_eff", n_eff, 1), ("seed", seed, 0)):
        if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < minimum:
            raise ValueError(
                f"nested_sample: {name} must be an integer >= {minimum}, got {value!r}"
            )
    if not 0.0 < float(f_live) < 1.0:
        raise ValueError(f"nested_sample: f_live must be in (0, 1), got {f_live}")
    for name, value in (("threads", threads), ("processes", processes)):
        if value is not None and (
            not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 1
        ):
            raise ValueError(f"nested_sample: {name} must be a positive integer, got {value!r}")

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

    given = np.zeros(n, bool)
    for name, (lo, hi) in (intervals or {}).items():
        if name not in names:
            raise ValueError(f"nested_sample: intervals names {name!r}, not a free parameter")
        k = names.index(name)
        if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
            raise ValueError(
                f"nested_sample: the interval of {name} must be finite with lower < upper, "
                f"got ({lo}, {hi})"
            )
        if has_prior[k]:
            continue  # (its prior term is its prior)
        box[k] = (max(box[k, 0], lo), min(box[k, 1], hi))
        if not box[k, 0] < box[k, 1]:
            raise ValueError(f"nested_sample: the interval of {name} is outside its bounds")
        given[k] = True

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
        no_prior = ~has_prior & ~given
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
    auto = processes is None
    if processes is None:
        processes = _usable_cores() if dens.backend == "numba" else 1

    def log_likelihood(points: np.ndarray) -> np.ndarray:
        if workers is not None:
            return workers(points)
        return np.array([dens.f(v) for v in np.atleast_2d(points)], np.float64)

    cov = None
    if fitted and tuple(start.names) == names:
        cov = np.asarray(start.covariance, np.float64)
    report = _Progress(prior, cov, v0, n_eff, f_live) if progress else None
    sampler: Any = Sampler(
        prior,
        log_likelihood,
        n_dim=n,
        n_live=int(n_live),
        n_networks=int(n_networks),
        vectorized=True,
        seed=int(seed),
    )

    # (the workers last: nothing between their start and the `try` that stops them)
    workers = None
    if processes > 1:
        try:
            workers = DensityPool(
                like_objective, template, param, dens.backend, processes, threads or 1
            )
        except (RuntimeError, OSError, TypeError, AttributeError, pickle.PicklingError) as err:
            if not auto:
                raise
            warnings.warn(
                f"nested_sample: the likelihood is evaluated in this process, as worker "
                f"processes could not hold it ({str(err).strip().splitlines()[-1]})",
                stacklevel=2,
            )

    def run() -> None:
        if verbose:  # (nautilus's own table, in one call)
            sampler.run(f_live=float(f_live), n_eff=int(n_eff), verbose=True)
            return
        # in slices of SLICE seconds (nautilus resumes where it stopped): between two, a
        # line of progress when one is due, and the end of the run after a Ctrl-C, which
        # only sets a flag while a batch is evaluated (interrupted inside one, nautilus's
        # state is no posterior)
        with stop_on_sigint("this batch of nested sampling") as stop:
            last = time.perf_counter()
            while not sampler.run(f_live=float(f_live), n_eff=int(n_eff), timeout=SLICE):
                if stop.is_set():
                    raise KeyboardInterrupt
                if report is not None and time.perf_counter() - last >= PROGRESS_EVERY:
                    report(sampler)
                    last = time.perf_counter()
        if stop.is_set():
            raise KeyboardInterrupt

    def result(status: str) -> NestedPosterior:
        points, log_w, log_l = sampler.posterior()
        w = np.exp(log_w)
        return NestedPosterior(
            points=np.asarray(points, np.float64),
            log_weights=np.asarray(log_w, np.float64),
            log_likelihood=np.asarray(log_l, np.float64),
            log_evidence=float(sampler.log_z),
            log_evidence_error=float(1.0 / math.sqrt(max(float(sampler.n_eff), 1.0))),
            n_eff=float(1.0 / np.sum(w**2)),
            n_likelihood=int(sampler.n_like),
            box=box,
            template=template,
            parametrisation=param,
            names=names,
            backend=dens.backend,
            status=status,
        )

    try:
        if threads is not None and dens.backend == "numba" and workers is None:
            import numba

            before = numba.get_num_threads()
            numba.set_num_threads(threads)  # (a ValueError above NUMBA_NUM_THREADS)
            try:
                run()
            finally:
                numba.set_num_threads(before)
        else:
            run()
    except KeyboardInterrupt:
        kept = None
        if sampler.n_like > 0:
            try:
                kept = result("interrupted")
            except Exception:  # (nothing usable yet: no finished shell)
                kept = None
        raise NestedInterrupted(kept) from None
    finally:
        if workers is not None:
            workers.close()
    if report is not None:
        report(sampler, done=True)
    return result("finished")


#: Seconds between two lines of `nested_sample`'s progress.
PROGRESS_EVERY = 10.0
#: Seconds of nautilus's run between two checks for progress and Ctrl-C.
SLICE = 1.0


class _Progress:
    """`nested_sample`'s progress lines (standard error): the phase, likelihood calls and
    their rate, the log-evidence so far and an estimate of the time left.

    While nautilus explores, the estimate compares the log-volume (in the prior's unit
    cube) of its newest bound with that at which the exploration ends for a Gaussian
    posterior with the start fit's covariance: the live set's evidence fraction is
    `f_live` when the bound is the ellipsoid `chi2 <= chi2_d^-1(f_live)` (d parameters),
    and each bound costs about the same calls and shrinks the volume by about the same
    factor. While it samples, the rate at which the effective sample size grows. Without
    a fit's covariance only the sampling phase has an estimate."""

    def __init__(
        self, prior: _Prior, cov: np.ndarray | None, x: np.ndarray, n_eff: int, f_live: float
    ):
        self.time = time.perf_counter
        self.t0 = self.time()
        self.n_eff = n_eff
        self.target_log_v = None
        self.sampling_since: tuple[float, float] | None = None
        if cov is not None and np.all(np.isfinite(cov)):
            from scipy.special import gammaln
            from scipy.stats import chi2

            # the prior's unit cube: uniform dimensions scaled by their span, Gaussian
            # ones by the transform's slope at the fit's value
            slope = np.where(
                prior.gauss,
                np.exp(-0.5 * ((x - prior.mean) / prior.sigma) ** 2)
                / (math.sqrt(2 * math.pi) * prior.sigma * (prior.c_hi - prior.c_lo)),
                1.0 / np.where(prior.flat_span > 0, prior.flat_span, 1.0),
            )
            sign, logdet = np.linalg.slogdet(cov * np.outer(slope, slope))
            d = cov.shape[0]
            if sign > 0:
                r2 = float(chi2.ppf(f_live, d))
                log_ball = 0.5 * d * math.log(math.pi) - float(gammaln(0.5 * d + 1))
                self.target_log_v = min(log_ball + 0.5 * d * math.log(r2) + 0.5 * logdet, -1e-3)

    def __call__(self, sampler: Any, done: bool = False) -> None:
        elapsed = self.time() - self.t0
        calls = int(sampler.n_like)
        rate = calls / max(elapsed, 1e-9)
        log_z = float(sampler.log_z) if calls else float("nan")
        if done:
            line = (
                f"finished: {calls:,} likelihood calls in {_duration(elapsed)}, "
                f"{float(sampler.n_eff):,.0f} effective samples, log Z {log_z:.3f}"
            )
        elif not sampler.explored:
            log_v = float(sampler.bounds[-1].log_v) if sampler.bounds else 0.0
            left = ""
            if self.target_log_v is not None and log_v < 0:
                frac = min(log_v / self.target_log_v, 1.0)
                left = (
                    f", about {_duration(elapsed * (1 - frac) / max(frac, 1e-3))} of "
                    "exploration left"
                )
            line = (
                f"exploring: {len(sampler.bounds)} bounds, log-volume {log_v:.1f}"
                + (f" of about {self.target_log_v:.1f}" if self.target_log_v is not None else "")
                + f", {calls:,} calls ({rate:.0f}/s), log Z {log_z:.2f}{left}"
            )
        else:
            n_eff_now = float(sampler.n_eff)
            if self.sampling_since is None:
                self.sampling_since = (elapsed, n_eff_now)
            t1, n1 = self.sampling_since
            gain = (n_eff_now - n1) / max(elapsed - t1, 1e-9)
            left = (
                f", about {_duration((self.n_eff - n_eff_now) / gain)} left"
                if gain > 0 and elapsed > t1
                else ""
            )
            line = (
                f"sampling: {n_eff_now:,.0f} of {self.n_eff:,} effective samples, "
                f"{calls:,} calls ({rate:.0f}/s), log Z {log_z:.3f}{left}"
            )
        print(f"  nested: {line}", file=sys.stderr, flush=True)


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    if seconds < 100:
        return f"{seconds:.0f} s"
    if seconds < 6000:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
