"""Posterior sampling with the No-U-Turn Sampler (blackjax): many chains vmapped on
device over an `Objective`'s free parameters, started from a fit.

The target is `exp(-objective(model))` over the physical values of the free parameters:
the objective is the negative log posterior (the likelihood terms plus any prior terms),
so parameters without a prior term get a flat prior inside their bounds (the class
bounds, `bounds=`, or a `UniformPrior`'s interval). The chains move in the unconstrained
coordinates a fit uses (`Parametrisation`: a bounded parameter through a logistic or
exponential map), with the log-Jacobian of that map added, so the draws are of the
physical posterior. Amplitudes that the objective solves linearly are not sampled: each
draw's amplitudes are the best fit for its non-linear parameters (profiled), as in
PyAutoLens and lenstronomy.
"""

import contextlib
import math
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray, PyTree

from .._sharding import check_mesh, lapack_batches_deadlock, replicate, shard, split_grids
from ..objective import Objective, Parametrisation
from ..objective._params import _log_abs_slope
from ..terms import LogEvidence
from ._parametrise import parametrisation
from ._result import FitResult

#: the quantiles `Posterior.summary` and `Posterior.to_dict` report (median and the
#: central 68% interval)
QUANTILES = (0.16, 0.5, 0.84)

#: `sample` makes its draws in this many chunks (fewer when there are fewer draws): the
#: points where it reports progress and where a Ctrl-C ends the run with the draws so far
DRAW_CHUNKS = 20

#: seconds between two lines of `sample(progress=True)`
PROGRESS_EVERY = 10.0


class SamplingInterrupted(KeyboardInterrupt):
    """Ctrl-C during `equilens.sample` or `equilens.nested_sample`: a `KeyboardInterrupt`
    that carries the draws so far as `posterior` (a `Posterior` or `NestedPosterior` with
    `status` "interrupted"; None when there were none yet)."""

    def __init__(self, posterior: Any, message: str = "sampling interrupted"):
        KeyboardInterrupt.__init__(self, message)
        self.posterior = posterior


@contextlib.contextmanager
def stop_on_sigint(what: str) -> Iterator[threading.Event]:
    """While the block runs (in the main thread), a first Ctrl-C only sets the yielded
    event, saying `stopping after {what}` on stderr, for the caller to end its run at the
    next safe point; a second Ctrl-C raises `KeyboardInterrupt` at once. The previous
    SIGINT handler is restored on exit."""
    stop = threading.Event()

    def on_sigint(signum: int, frame: Any) -> None:
        if stop.is_set():
            raise KeyboardInterrupt  # (a second Ctrl-C: at once)
        stop.set()
        print(
            f"  stopping after {what} (Ctrl-C again to stop at once)",
            file=sys.stderr,
            flush=True,
        )

    main = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGINT, on_sigint) if main else None
    try:
        yield stop
    finally:
        if main:
            signal.signal(signal.SIGINT, before)


class Posterior(eqx.Module):
    """Posterior draws of a model's free parameters, from `equilens.sample`.

    **Fields:**

    - `samples`: `(chains, draws, n_params)` physical values, ordered and named as
      `names` (the names and order of `FitResult.table()`).
    - `log_posterior`: `(chains, draws)` minus the objective at each draw (the log
      posterior density of the physical values, up to the evidence).
    - `divergent`, `acceptance`, `tree_steps`: the NUTS diagnostics of each draw
      (divergent transition, mean Metropolis acceptance, leapfrog steps).
    - `step_size`: `(chains,)` the step size window adaptation chose.
    - `template`, `parametrisation`: the start model and its free parameters (`model`
      puts a draw back into a model).
    - `names` (static); `status` (static): "finished", or "interrupted" for the draws
      made before a Ctrl-C (`SamplingInterrupted`).

    Convergence: `rhat()` (rank-normalised split R-hat, Vehtari et al. 2021; below 1.01
    for converged chains) and `ess()` (bulk effective sample size) per parameter;
    `summary()` prints them with the mean, standard deviation and 16/50/84% quantiles.
    `to_arviz()` gives an ArviZ `InferenceData` (needs `arviz`), `corner()` a corner plot
    (needs `corner`).
    """

    samples: Float[Array, "chains draws n_params"]
    log_posterior: Float[Array, "chains draws"]
    divergent: Bool[Array, "chains draws"]
    acceptance: Float[Array, "chains draws"]
    tree_steps: Int[Array, "chains draws"]
    step_size: Float[Array, " chains"]
    template: PyTree[Any]
    parametrisation: Parametrisation
    names: tuple[str, ...] = eqx.field(static=True)
    status: str = eqx.field(static=True, default="finished")

    @property
    def n_chains(self) -> int:
        return int(self.samples.shape[0])

    @property
    def n_draws(self) -> int:
        return int(self.samples.shape[1])

    def flat(self) -> Float[Array, "n n_params"]:
        """All chains' draws stacked: `(chains * draws, n_params)`."""
        return self.samples.reshape(-1, self.samples.shape[-1])

    def mean(self) -> Float[Array, " n_params"]:
        return jnp.mean(self.flat(), axis=0)

    def std(self) -> Float[Array, " n_params"]:
        return jnp.std(self.flat(), axis=0, ddof=1)

    def covariance(self) -> Float[Array, "n_params n_params"]:
        return jnp.atleast_2d(jnp.cov(self.flat(), rowvar=False))

    def quantiles(self, q: tuple[float, ...] = QUANTILES) -> Float[Array, "n_q n_params"]:
        return jnp.quantile(self.flat(), jnp.asarray(q, self.samples.dtype), axis=0)

    def rhat(self) -> Float[Array, " n_params"]:
        """Rank-normalised split R-hat of each parameter (`blackjax.diagnostics.rhat`);
        needs at least 2 chains and 4 draws."""
        from blackjax.diagnostics import rhat

        if self.n_chains < 2 or self.n_draws < 4:
            raise ValueError("rhat needs at least 2 chains of at least 4 draws")
        with _blackjax_promotion():
            return jnp.stack([rhat(self.samples[..., i]) for i in range(len(self.names))])

    def ess(self) -> Float[Array, " n_params"]:
        """Bulk effective sample size of each parameter, over all chains
        (`blackjax.diagnostics.ess_bulk`)."""
        from blackjax.diagnostics import ess_bulk

        with _blackjax_promotion():
            return jnp.stack([ess_bulk(self.samples[..., i]) for i in range(len(self.names))])

    def model(self, chain: int, draw: int) -> PyTree[Any]:
        """Draw `draw` of chain `chain` as a model (the template with its free leaves
        set; linearly solved amplitudes as in the template)."""
        _, unravel = ravel_pytree(self.parametrisation.values(self.template))
        values = unravel(self.samples[chain, draw])
        return self.parametrisation.with_values(values, self.template)

    def to_dict(self) -> dict[str, Any]:
        """Per parameter: posterior `mean`, `std`, the 16/50/84% quantiles (`p16`, `p50`,
        `p84`), `ess` and `rhat` (None with one chain); plus the chains, draws and the
        number of divergent transitions. Plain Python numbers (JSON-ready)."""
        ess = np.asarray(self.ess())
        rhat = np.asarray(self.rhat()) if self.n_chains > 1 else None
        params = parameter_summary(self.names, self.mean(), self.std(), self.quantiles())
        for i, name in enumerate(self.names):
            params[name]["ess"] = float(ess[i])
            params[name]["rhat"] = None if rhat is None else float(rhat[i])
        return {
            "parameters": params,
            "chains": self.n_chains,
            "draws": self.n_draws,
            "divergent": int(np.sum(np.asarray(self.divergent))),
            "sampler": "nuts",
            "status": self.status,
        }

    def summary(self) -> str:
        """One line per parameter: mean, standard deviation, 16/50/84% quantiles, bulk
        ESS and R-hat; then the divergent transitions."""
        d = self.to_dict()
        return format_summary(
            d["parameters"],
            f"{d['chains']} chains x {d['draws']} draws (NUTS), "
            f"{d['divergent']} divergent transitions"
            + ("" if self.status == "finished" else f" ({self.status})"),
        )

    def to_arviz(self) -> Any:
        """The draws as ArviZ data (`arviz.InferenceData` with arviz < 1, its `DataTree`
        with arviz >= 1): group `posterior` (one variable per parameter, named as
        `names`, dims `chain` and `draw`) and `sample_stats` (`lp`, `diverging`,
        `acceptance_rate`, `step_size`, `n_steps`). Needs `arviz`."""
        import arviz as az

        posterior = {n: np.asarray(self.samples[..., i]) for i, n in enumerate(self.names)}
        stats = {
            "lp": np.asarray(self.log_posterior),
            "diverging": np.asarray(self.divergent),
            "acceptance_rate": np.asarray(self.acceptance),
            "n_steps": np.asarray(self.tree_steps),
            "step_size": np.broadcast_to(
                np.asarray(self.step_size)[:, None], self.log_posterior.shape
            ),
        }
        if int(az.__version__.split(".")[0]) >= 1:
            return az.from_dict({"posterior": posterior, "sample_stats": stats})
        return az.from_dict(posterior=posterior, sample_stats=stats)

    def corner(self, truths: Any = None, **kwargs: Any) -> Any:
        """A corner plot of all chains' draws (`corner.corner`, which must be installed),
        labelled with `names`; `truths` (values ordered as `names`) and `kwargs` go to
        `corner.corner`. Returns the matplotlib figure."""
        import corner

        truths = None if truths is None else np.asarray(truths)
        return corner.corner(
            np.asarray(self.flat()), labels=list(self.names), truths=truths, **kwargs
        )


def parameter_summary(
    names: tuple[str, ...], mean: Any, std: Any, quantiles: Any
) -> dict[str, dict[str, Any]]:
    """`{name: {"mean", "std", "p16", "p50", "p84"}}` as plain floats (`quantiles` rows
    at `QUANTILES`)."""
    mean, std, quant = np.asarray(mean), np.asarray(std), np.asarray(quantiles)
    return {
        name: {
            "mean": float(mean[i]),
            "std": float(std[i]),
            **{f"p{round(100 * q)}": float(quant[k, i]) for k, q in enumerate(QUANTILES)},
        }
        for i, name in enumerate(names)
    }


def format_summary(params: dict[str, dict[str, Any]], footer: str) -> str:
    """A table of `parameter_summary`'s values (with `ess` and `r_hat` columns when the
    entries have them), one line per parameter, then `footer`."""
    width = max(len(n) for n in params)
    extra = [k for k in ("ess", "rhat") if all(k in p for p in params.values())]
    head = ["mean", "std", "16%", "50%", "84%", *(("r_hat" if k == "rhat" else k) for k in extra)]
    lines = [f"{'parameter':<{width}}" + "".join(f"{h:>13}" for h in head)]
    for name, p in params.items():
        cells = "".join(f"{p[k]:>13.6g}" for k in ("mean", "std", "p16", "p50", "p84"))
        if "ess" in extra:
            cells += f"{p['ess']:>13.0f}"
        if "rhat" in extra:
            cells += f"{'-' if p['rhat'] is None else format(p['rhat'], '.4f'):>13}"
        lines.append(f"{name:<{width}}" + cells)
    lines.append(footer)
    return "\n".join(lines)


@contextlib.contextmanager
def _blackjax_promotion() -> Iterator[None]:
    """blackjax relies on NumPy's implicit dtype and rank promotion (its adaptation
    schedule mixes Python ints and booleans): allowed while it traces, whatever the
    user's `jax_numpy_dtype_promotion` / `jax_numpy_rank_promotion` say."""
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
        yield


def _positive_int(name: str, value: Any, minimum: int) -> int:
    if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"sample: {name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _raw_covariance(start: FitResult, param: Parametrisation, raw0: tuple) -> np.ndarray | None:
    """The start fit's Laplace covariance in the unconstrained coordinates (the physical
    covariance divided by the map's slopes), or None when it is missing or not positive
    definite."""
    cov = np.asarray(start.covariance, dtype=np.float64)
    if cov.ndim != 2 or not np.all(np.isfinite(cov)):
        return None
    bounds = [b for f, b in zip(param.free, param.bounds, strict=True) if f]
    slope = np.concatenate(
        [
            np.ravel(np.exp(np.asarray(_log_abs_slope(r, b))))
            for r, b in zip(raw0, bounds, strict=True)
        ]
    )
    if slope.shape[0] != cov.shape[0] or not np.all(slope > 0):
        return None
    raw_cov = cov / np.outer(slope, slope)
    try:
        np.linalg.cholesky(raw_cov)
    except np.linalg.LinAlgError:
        return None
    return raw_cov


def sample(
    key: PRNGKeyArray,
    objective: Objective,
    start: FitResult | PyTree[Any],
    *,
    n_chains: int = 4,
    n_warmup: int = 500,
    n_samples: int = 1000,
    free: Any = None,
    bounds: Any = None,
    target_acceptance: float = 0.8,
    max_tree_depth: int = 10,
    spread: float = 1.0,
    dense_mass: bool = True,
    chain_method: str = "auto",
    mesh: Mesh | None = None,
    progress: bool = False,
) -> Posterior:
    """Samples the posterior `exp(-objective(model))` over the free parameters with the
    No-U-Turn Sampler (`blackjax.nuts`), `n_chains` chains vmapped in one program.

    **Arguments:**

    - `key`: a JAX random key.
    - `objective`: the `Objective` (its likelihood terms and prior terms; parameters
      without a prior get a flat prior inside their bounds).
    - `start`: a `FitResult` (recommended: chains start around its best fit, drawn from
      its Laplace covariance scaled by `spread`, which also seeds the mass matrix) or a
      model (chains start at it, jittered by 1e-3 in the unconstrained coordinates).
    - `n_chains`, `n_warmup`, `n_samples`: chains, window-adaptation steps (step size and
      diagonal mass matrix, `blackjax.window_adaptation`) and kept draws per chain.
    - `free`, `bounds`: as for `equilens.fit` (the same parameters and intervals).
    - `target_acceptance`: the step-size adaptation's target; `max_tree_depth`: NUTS's
      (at most `2**max_tree_depth` leapfrog steps per draw).
    - `dense_mass`: adapt a dense mass matrix (default; lens parameters are strongly
      correlated, e.g. a Sersic index with its radius) rather than a diagonal one. Seeded
      with the start fit's covariance when there is one.
    - `chain_method`: "vectorized" (the chains vmapped: one program steps all chains
      together), "sequential" (`lax.map`: one chain after another, each at its own pace)
      or "auto" (default): sequential for an objective with a `LogEvidence` term on a CPU
      (its sparse solve runs on the host once per chain even under `vmap`, and the batched
      program is slower: the value and gradient of 4 chains vmapped took 100 ms, of one
      chain 6.4 ms, at 60x60 pixels and a 20x20 mesh), vectorized otherwise.
    - `mesh`: a one-axis `jax.sharding.Mesh` (`equilens.device_mesh()`) to split the
      chains over (`n_chains` a multiple of its device count; the objective replicated).
      With jaxlib 0.10 on several CPU devices, one chain per device (that jaxlib's
      batched LAPACK kernels deadlock there: see `equilens.shard`).

    - `progress`: print a line after the warm-up and then every `PROGRESS_EVERY` seconds
      (draws per chain so far, their rate, an estimate of the time left).

    The draws are made in `DRAW_CHUNKS` chunks, one compiled program reused for each (the
    warm-up is one program before them). Ctrl-C while the draws are made ends the run
    after the chunk in progress (a second Ctrl-C: at once) with `SamplingInterrupted`, a
    `KeyboardInterrupt` carrying the draws so far (`posterior`, status "interrupted";
    None when the warm-up had not finished).

    Returns a `Posterior` (physical values, `(chains, draws, n_params)`). Needs
    `blackjax` (`pip install equilens[sampling]`). Check `Posterior.rhat()` (< 1.01) and
    the divergent transitions before trusting the draws.
    """
    import blackjax
    from blackjax.adaptation.base import get_filter_adapt_info_fn

    if not isinstance(objective, Objective):
        raise TypeError(f"objective must be an equilens Objective, got {type(objective)}")
    n_chains = _positive_int("n_chains", n_chains, 1)
    n_warmup = _positive_int("n_warmup", n_warmup, 0)
    n_samples = _positive_int("n_samples", n_samples, 1)
    max_tree_depth = _positive_int("max_tree_depth", max_tree_depth, 1)
    if not 0.0 < float(target_acceptance) < 1.0:
        raise ValueError(f"sample: target_acceptance must be in (0, 1), got {target_acceptance}")
    if not (math.isfinite(float(spread)) and float(spread) > 0.0):
        raise ValueError(f"sample: spread must be positive, got {spread}")
    if chain_method not in ("auto", "vectorized", "sequential"):
        raise ValueError(
            "sample: chain_method must be 'auto', 'vectorized' or 'sequential', got "
            f"{chain_method!r}"
        )
    if chain_method == "auto":
        evidence = any(isinstance(t, LogEvidence) for t in objective.terms)
        on_cpu = jax.default_backend() == "cpu"
        chain_method = "sequential" if evidence and on_cpu and mesh is None else "vectorized"
    if chain_method == "sequential" and mesh is not None:
        raise ValueError(
            "sample(mesh=): the chains split over devices need chain_method='vectorized'"
        )

    fitted = isinstance(start, FitResult)
    template = start.model if fitted else start
    param = parametrisation(objective, template, free, bounds)
    if param.n_free == 0:
        raise ValueError("sample: no free parameters (`free` selects no floating-point leaf)")
    names = param.paths(template)
    raw0 = param.to_raw(template)
    z0, unravel = ravel_pytree(raw0)
    dtype = z0.dtype

    raw_cov = None
    if fitted and tuple(start.names) == names:
        raw_cov = _raw_covariance(start, param, raw0)
    key_init, key_run = jax.random.split(key)
    eps = jax.random.normal(key_init, (n_chains, z0.shape[0]), dtype)
    if raw_cov is None:
        positions = z0[None] + 1e-3 * eps * jnp.maximum(1.0, jnp.abs(z0))[None]
        inverse_mass = None
    else:
        chol = jnp.asarray(np.linalg.cholesky(raw_cov), dtype)
        positions = z0[None] + float(spread) * eps @ chol.T
        inverse_mass = jnp.asarray(raw_cov if dense_mass else np.diagonal(raw_cov), dtype)

    def log_density(z, obj):
        raw = unravel(z)
        lp = -obj(param.to_model(raw, template)) + param.log_jacobian(raw)
        return jnp.where(jnp.isfinite(lp), lp, -jnp.inf)

    def over_chains(fn, *args):
        if chain_method == "sequential":
            return jax.lax.map(lambda a: fn(*a), args)
        return jax.vmap(fn)(*args)

    @eqx.filter_jit
    def warm(obj, keys, positions, inverse_mass):
        def chain(k, z):
            warmup: Any = blackjax.window_adaptation(
                blackjax.nuts,
                lambda z: log_density(z, obj),
                is_mass_matrix_diagonal=not dense_mass,
                initial_inverse_mass_matrix=inverse_mass,
                target_acceptance_rate=target_acceptance,
                max_num_doublings=max_tree_depth,
                adaptation_info_fn=get_filter_adapt_info_fn(),
            )
            (state, params), _ = warmup.run(k, z, num_steps=n_warmup)
            return state, params["step_size"], params["inverse_mass_matrix"]

        return over_chains(chain, keys, positions)

    @eqx.filter_jit
    def draw(obj, states, step_size, inverse_mass, keys):
        def chain(s, eps, m, ks):
            kernel: Any = blackjax.nuts(
                lambda z: log_density(z, obj),
                step_size=eps,
                inverse_mass_matrix=m,
                max_num_doublings=max_tree_depth,
            )

            def step(s, kk):
                s, info = kernel.step(kk, s)
                raw = unravel(s.position)
                phys = ravel_pytree(param.values(param.to_model(raw, template)))[0]
                lp = s.logdensity - param.log_jacobian(raw)
                return s, (
                    phys,
                    lp,
                    info.is_divergent,
                    info.acceptance_rate,
                    info.num_integration_steps,
                )

            return jax.lax.scan(step, s, ks)

        return over_chains(chain, states, step_size, inverse_mass, keys)

    keys = jax.random.split(key_run, n_chains)
    if mesh is not None:
        if split_grids(objective):
            raise ValueError(
                "sample(mesh=): the objective's pixels are already split over devices; "
                "chains are split along their own axis: pass the objective unsharded"
            )
        n_dev = mesh.shape[check_mesh(mesh, None)]
        if n_chains % n_dev:
            raise ValueError(
                f"sample(mesh=): n_chains ({n_chains}) must be a multiple of the mesh's "
                f"{n_dev} devices"
            )
        if n_chains > n_dev and lapack_batches_deadlock(mesh):
            raise ValueError(
                f"sample(mesh=): {n_chains // n_dev} chains per CPU device with jaxlib 0.10, "
                "whose batched LAPACK kernels deadlock on several CPU devices (equilens.shard "
                f"docs): use n_chains={n_dev}, one device, or jaxlib >= 0.11 (Python >= 3.12)"
            )
        objective = replicate(objective, mesh)
        keys, positions = shard((keys, positions), mesh, batch=True)
        inverse_mass = replicate(inverse_mass, mesh)
    # the draws' keys, made up front: chunks draw the same chains as one long scan would;
    # the draws per chain rounded up to whole chunks, the extra ones dropped
    n_chunks = min(DRAW_CHUNKS, n_samples)
    chunk = -(-n_samples // n_chunks)
    pairs = jax.vmap(jax.random.split)(keys)
    k_warm, k_draw = pairs[:, 0], pairs[:, 1]
    draw_keys = jax.vmap(lambda k: jax.random.split(k, chunk * n_chunks))(k_draw)
    if mesh is not None:
        draw_keys = shard(draw_keys, mesh, batch=True)

    def result(traces: list, step_size: Any, status: str) -> Posterior:
        phys, lp, div, acc, steps = (
            jnp.concatenate([t[i] for t in traces], axis=1)[:, :n_samples] for i in range(5)
        )
        return Posterior(
            samples=phys,
            log_posterior=lp,
            divergent=div,
            acceptance=acc,
            tree_steps=steps,
            step_size=step_size,
            template=template,
            parametrisation=param,
            names=names,
            status=status,
        )

    traces: list = []
    step_size = None
    with stop_on_sigint("this chunk of NUTS draws") as stop:
        t0 = time.perf_counter()
        with _blackjax_promotion():
            states, step_size, inverse_mass = warm(objective, k_warm, positions, inverse_mass)
            jax.block_until_ready(step_size)
        if progress:
            print(
                f"  NUTS: warm-up of {n_warmup} steps per chain done in "
                f"{time.perf_counter() - t0:.0f} s; {n_samples} draws per chain in "
                f"{n_chunks} chunks",
                flush=True,
            )
        t0 = last = time.perf_counter()
        for i in range(n_chunks):
            if stop.is_set():
                break
            with _blackjax_promotion():
                states, trace = draw(
                    objective,
                    states,
                    step_size,
                    inverse_mass,
                    draw_keys[:, i * chunk : (i + 1) * chunk],
                )
                jax.block_until_ready(trace)
            traces.append(trace)
            now = time.perf_counter()
            if progress and (now - last >= PROGRESS_EVERY or i + 1 == n_chunks):
                done = min((i + 1) * chunk, n_samples)
                rate = done / (now - t0)
                print(
                    f"  NUTS: {done}/{n_samples} draws per chain ({n_chains} chains), "
                    f"{rate:.1f} draws/s per chain, about "
                    f"{(n_samples - done) / rate:.0f} s left",
                    flush=True,
                )
                last = now
    if stop.is_set():
        raise SamplingInterrupted(
            result(traces, step_size, "interrupted") if traces and step_size is not None else None
        )
    return result(traces, step_size, "finished")
