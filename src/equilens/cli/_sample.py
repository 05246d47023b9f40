"""`equilens sample`: a fit, then the posterior drawn by NUTS or nested sampling, for one
image or several bands jointly (`equilens.cli` parses the options and calls `run_sample`)."""

import json
import os
import sys
import time
from typing import Any

from .._files import atomic_path
from ._parametric import parametric_fit
from ._source import _pixelized_stage, default_mesh, make_mesh, make_regularization


def run_sample(
    data,
    json_path: str,
    mass: str,
    lens_light: str | None,
    source: str,
    *,
    n_chains: int = 4,
    n_warmup: int = 500,
    n_samples: int | None = None,
    seed: int = 0,
    solver: str = "lm",
    max_steps: int | None = None,
    positions=None,
    positions_sigma: float | None = None,
    title: str = "",
    sampler: str = "auto",
    n_live: int = 300,
    n_networks: int = 2,
    prior_width: float = 10.0,
    mesh: str | None = None,
    regularization: str = "constant",
    strength: float | None = None,
    max_tree_depth: int | None = None,
    partial: Any = None,
    power_law: bool = False,
) -> dict[str, str]:
    """Fits `data` (an `Imaging`, or a `MultiBandImaging` whose bands are fitted and
    sampled jointly) as `equilens fit` does, then samples the posterior over the same
    objective (for `source="pixelized"`: the mass's parameters with the source
    marginalised, the `LogEvidence` the likelihood, the regularization held at its fitted
    strength and the lens light as fitted): `sampler="auto"` picks one (`choose_sampler`),
    `sampler="nuts"` samples with NUTS (`equilens.sample`,
    started from the fit; `n_samples` draws per chain, default 1000; `max_tree_depth`
    default 10, 6 for a pixelized source) or `"nested"` with nautilus
    (`equilens.nested_sample` on the Numba likelihood, a uniform prior on the fit +-
    `prior_width` of its errors inside the class bounds, `n_live` live points and
    `n_networks` networks per bound; `n_samples` effective samples, default 4000; one
    worker process per core, progress every 10 s). Writes the JSON (the fit under `fit`,
    the posterior under `posterior`: per parameter `mean`, `std`, `p16`, `p50`, `p84`
    (NUTS: `ess`, `rhat`; nested: the prior interval), nested: `log_evidence` and its
    error), the draws as NetCDF (`.nc`, ArviZ) and a corner plot (`_corner.png`) beside
    it. The status is `"successful"` when NUTS's R-hat are all below 1.01 with no
    divergent transitions, or nested sampling reached its effective sample size."""
    import jax
    import matplotlib

    matplotlib.use("Agg")

    from ..data import MultiBandImaging
    from ..solve import SamplingInterrupted, nested_sample, sample

    bands = isinstance(data, MultiBandImaging)
    imaging = data.bands[0] if bands else data
    pixelized = source == "pixelized"
    if pixelized and mesh is None:
        mesh = default_mesh(imaging)
    pix_mesh = make_mesh(mesh, imaging) if mesh is not None and pixelized else None
    pix_reg = make_regularization(regularization, strength) if pixelized else None
    if sampler not in ("auto", "nuts", "nested"):
        raise ValueError(f"--sampler must be auto, nuts or nested, got {sampler!r}")
    why = ""
    if sampler == "auto":
        sampler, why = choose_sampler()
    nested = sampler == "nested"
    if n_samples is None:
        n_samples = 4000 if nested else 1000
    t0 = time.perf_counter()
    how = (
        f"nautilus with {n_live} live points to {n_samples} effective samples"
        if nested
        else f"{n_chains} NUTS chains of {n_warmup} warm-up + {n_samples} draws"
    )
    print(
        f"equilens: sampling {mass} mass, {lens_light or 'no'} lens light, {source} source "
        f"on {_describe(data)}: a fit, then {how}" + (f" ({why})" if why else "")
    )
    progress = sys.stderr.isatty()
    if bands:
        result, objective, free = _fit_bands(
            data,
            mass,
            lens_light,
            source,
            solver=solver,
            max_steps=max_steps,
            positions=positions,
            positions_sigma=positions_sigma,
            pix_mesh=pix_mesh,
            pix_reg=pix_reg,
            pix_label=f"{mesh} mesh, {regularization} regularization",
            strength=strength,
            progress=progress,
            partial=partial,
        )
    else:
        result, objective, free = _fit_one(
            imaging,
            mass,
            lens_light,
            source,
            solver=solver,
            max_steps=max_steps,
            positions=positions,
            positions_sigma=positions_sigma,
            pix_mesh=pix_mesh,
            pix_reg=pix_reg,
            pix_label=f"{mesh} mesh, {regularization} regularization",
            strength=strength,
            progress=progress,
            partial=partial,
            power_law=power_law,
        )
    names = data.names if bands else None
    print(result.table())
    folder = os.path.dirname(os.path.abspath(json_path))
    os.makedirs(folder, exist_ok=True)
    base = os.path.splitext(json_path)[0]
    out = {"json": json_path, "netcdf": base + ".nc", "corner": base + "_corner.png"}
    try:
        if nested:
            post: Any = nested_sample(
                objective,
                result,
                free=free,
                box_width=prior_width,
                n_live=n_live,
                n_networks=n_networks,
                n_eff=n_samples,
                seed=seed,
                progress=True,
            )
        else:
            post = sample(
                jax.random.key(seed),
                objective,
                result,
                free=free,
                n_chains=n_chains,
                n_warmup=n_warmup,
                n_samples=n_samples,
                max_tree_depth=(6 if pixelized else 10)
                if max_tree_depth is None
                else max_tree_depth,
                progress=True,
            )
    except SamplingInterrupted as stop:
        # Ctrl-C: the draws so far written (marked), then the interruption goes on
        if stop.posterior is not None and partial is not None:
            _write_posterior(stop.posterior, result, out, title, names)
            partial.stage = "nested sampling" if nested else "NUTS"
            partial.written = json_path
        raise
    print(post.summary())
    summary = _write_posterior(post, result, out, title, names)
    print(
        f"  result: {json_path}\n  draws: {out['netcdf']}\n  corner plot: {out['corner']}\n"
        f"  wall time {time.perf_counter() - t0:.1f} s"
    )
    if nested:
        reached = summary["n_eff"] >= 0.9 * n_samples
        out["status"] = (
            "successful"
            if reached
            else f"not converged: {summary['n_eff']:.0f} effective samples of {n_samples}"
        )
        return out
    rhat = [p["rhat"] for p in summary["parameters"].values() if p["rhat"] is not None]
    converged = summary["divergent"] == 0 and all(r < 1.01 for r in rhat)
    out["status"] = (
        "successful"
        if converged
        else f"not converged: max R-hat {max(rhat, default=float('nan')):.4f}, "
        f"{summary['divergent']} divergent transitions (run longer chains)"
    )
    return out


def choose_sampler() -> tuple[str, str]:
    """`equilens sample --sampler auto`'s choice and why: nested sampling (nautilus on
    the Numba likelihood, one worker process per core) when JAX runs on the CPU and Numba
    and nautilus are installed; NUTS (gradients on the device) on an accelerator."""
    import importlib.util

    import jax

    from ..numba._runtime import numba_available

    if jax.default_backend() != "cpu":
        return "nuts", f"auto: NUTS on the {jax.default_backend()}"
    if not numba_available() or importlib.util.find_spec("nautilus") is None:
        return "nuts", "auto: NUTS, as Numba or nautilus is not installed"
    from ..solve._workers import _usable_cores

    n = _usable_cores()
    return "nested", f"auto: on a CPU, nested sampling on {n} core{'s' * (n > 1)}"


def _write_posterior(
    post: Any, result: Any, out: dict[str, str], title: str, band_names: Any = None
) -> dict:
    """The posterior's NetCDF draws, corner plot and JSON (with the fit) at `out`'s paths;
    returns the posterior's summary dict."""
    import matplotlib.pyplot as plt

    from ..solve import result_to_dict

    with atomic_path(out["netcdf"]) as tmp:
        post.to_arviz().to_netcdf(tmp)
    fig = post.corner(truths=list(map(float, result.values)))
    if title:
        fig.suptitle(title)
    with atomic_path(out["corner"]) as tmp:
        fig.savefig(tmp, dpi=80)
    plt.close(fig)
    summary = post.to_dict()
    with atomic_path(out["json"]) as tmp, open(tmp, "w") as f:
        json.dump({"fit": result_to_dict(result, band_names), "posterior": summary}, f, indent=2)
    return summary


def _describe(data) -> str:
    """The data in words: `80x80 pixels (4548 in the mask)`, or the bands'."""
    from ..data import MultiBandImaging

    def one(b) -> str:
        return f"{b.shape[0]}x{b.shape[1]} pixels ({int(b.mask.sum())} in the mask)"

    if isinstance(data, MultiBandImaging):
        return f"{len(data)} bands: " + ", ".join(
            f"{n} {one(b)}" for n, b in zip(data.names, data.bands, strict=True)
        )
    return one(data)


def _covariance_or_raise(result) -> None:
    import numpy as np

    if not np.all(np.isfinite(np.asarray(result.errors))):
        raise ValueError(
            "equilens sample: the pixelized fit has no covariance (its Hessian is not "
            "positive definite even smoothed), so the samplers have no scale to start "
            "from; try another --mesh or --regularization-strength"
        )


def _fit_one(
    imaging,
    mass: str,
    lens_light: str | None,
    source: str,
    *,
    solver: str,
    max_steps: int | None,
    positions,
    positions_sigma: float | None,
    pix_mesh,
    pix_reg,
    pix_label: str,
    strength: float | None,
    progress: bool,
    partial,
    power_law: bool = False,
) -> tuple[Any, Any, Any]:
    """One image fitted as `equilens fit` fits it; returns the result, the objective the
    samplers draw from and the free parameters (None: all of the result's)."""
    from ..objective import Objective, select
    from ..solve import fit_lens, threshold_term
    from ..solve._pipeline import _positions_term
    from ..solve._pixelized import _evidence_fit
    from ..terms import GaussianLikelihood, LogEvidence

    minima: list = []
    result = parametric_fit(
        fit_lens,
        imaging,
        mass,
        lens_light,
        source,
        pixelized=pix_mesh is not None,
        solver=solver,
        max_steps=max_steps,
        positions=positions,
        positions_sigma=positions_sigma,
        progress=progress,
        partial=partial,
        minima=minima if pix_mesh is not None else None,
    )
    if pix_mesh is None:
        terms: list = [GaussianLikelihood(imaging, nonnegative=True)]
        if positions is not None:
            terms.append(_positions_term(positions, positions_sigma, imaging.pixel_scale))
        return result, Objective(terms), None
    print(f"  pixelized source: {pix_label}")
    parametric = result
    result, inversion, _, held = _pixelized_stage(
        imaging,
        result,
        pix_mesh,
        pix_reg,
        strength,
        solver,
        max_steps,
        positions,
        progress,
        power_law,
        alternatives=minima,
    )
    # the sampled parameters: the mass, the source marginalised by the evidence (and the
    # images held together as in the fit); the regularization held as fitted, with the
    # brightness estimate it was fitted to (an AdaptiveBrightness's adapt image)
    terms = [LogEvidence(imaging, adapt_image=inversion.adapt_image)]
    if held is not None:
        terms.append(threshold_term(parametric.model, held))  # fit_pixelized's own guard
    objective = Objective(terms)
    free = select(result.model, lambda s: s.mass)
    if strength is None:
        # the strength was fitted too: the mass alone again (from the optimum: a few
        # steps), for the chains' start, the names and the covariance
        result = _evidence_fit(objective, result.model, free, "bfgs", 1000, progress)
    _covariance_or_raise(result)
    return result, objective, free


def _fit_bands(
    data,
    mass: str,
    lens_light: str | None,
    source: str,
    *,
    solver: str,
    max_steps: int | None,
    positions,
    positions_sigma: float | None,
    pix_mesh,
    pix_reg,
    pix_label: str,
    strength: float | None,
    progress: bool,
    partial,
) -> tuple[Any, Any, Any]:
    """Several bands fitted jointly as `equilens fit --band ...` fits them (one mass, the
    light shared in shape with per-band amplitudes; a pixelized source per band on one
    mesh); returns the result, the joint objective the samplers draw from and the free
    parameters (None: all of the result's)."""
    from ..objective import Objective, select
    from ..solve import auto_positions, fit_multiband, fit_multiband_pixelized, threshold_term
    from ..solve._pipeline import _positions_term
    from ..solve._pixelized import _evidence_fit
    from ..terms import GaussianLikelihood, LogEvidence, MultiBandTerm

    if partial is not None:
        partial.band_names = data.names
    result = parametric_fit(
        fit_multiband,
        data,
        mass,
        lens_light,
        source,
        pixelized=pix_mesh is not None,
        solver=solver,
        max_steps=max_steps,
        positions=positions,
        positions_sigma=positions_sigma,
        progress=progress,
        partial=partial,
    )
    first = data.bands[0]
    if pix_mesh is None:
        terms: list = [MultiBandTerm.build(data, GaussianLikelihood, nonnegative=True)]
        if positions is not None:
            terms.append(_positions_term(positions, positions_sigma, first.pixel_scale))
        return result, Objective(terms), None
    print(f"  pixelized source in every band: {pix_label}")
    held = positions if positions is not None else auto_positions(first, result.model.band(0))
    parametric = result
    result, _, _ = fit_multiband_pixelized(
        data,
        result.model,
        pix_mesh,
        pix_reg,
        solver=None if solver == "lm" else solver,
        fit_strength=strength is None,
        max_steps=1000 if max_steps is None else max_steps,
        positions=held,
        progress=progress,
    )
    # the mass sampled, each band's source marginalised by its evidence, the strengths
    # held as fitted; the images held together as in the fit
    terms = [MultiBandTerm([LogEvidence(b) for b in data.bands], data.names)]
    if held is not None:
        terms.append(threshold_term(parametric.model.band(0), held))
    objective = Objective(terms)
    free = select(result.model, lambda m: m.mass)
    if strength is None:
        result = _evidence_fit(objective, result.model, free, "bfgs", 1000, progress)
    _covariance_or_raise(result)
    return result, objective, free
