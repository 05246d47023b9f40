"""Sampling benchmark: effective samples of the Einstein radius per second of wall time,
for NUTS (`equilens.sample`: blackjax on JAX, the chains vmapped; one after another for
the pixelized evidence on a CPU, `chain_method="auto"`), nested sampling
(`equilens.nested_sample`: nautilus on the Numba likelihood in 1 and 2 worker processes)
and, when installed, lenstronomy's emcee on its own likelihood of the same data; then the
nested likelihood's throughput in 1 and 2 threads and processes (`throughput`); in one
run, on the same machine, float64.

- Parametric: bench_fit's 100x100 lens (SIE + shear, Sersic lens light and source, 19
  non-linear parameters, amplitudes solved linearly; 2.5" mask, 21x21 PSF).
- Pixelized: a 60x60 lens at 0.08" (SIE + shear, 7 non-linear parameters) whose source
  is marginalised by `LogEvidence` (20x20 rectangular mesh, constant regularization
  held fixed): the chains sample the mass with the source solved at every step.
- `--only command`: `equilens sample` with its defaults, as a user runs it (a subprocess;
  the fit included), on issue 46's lens: 80x80 pixels at 0.05", a 1.9" mask (4,548
  pixels), SIE + shear, Sersic lens light and source simulated (`issue_lens`); the CLI
  fits an MGE lens light (17 parameters) and picks nested sampling on a CPU.
- `--only lens-light`: NUTS on the same lens with a Sersic and with an MGE lens light
  (the CLI's default: non-negative amplitudes solved inside every gradient), each from
  its own `fit_lens`.

Every sampler starts from the same fit (LM; BFGS for the evidence); the wall time
includes warm-up (NUTS's window adaptation, emcee's burn-in, nautilus's exploration) and
compilation, which a user pays too. The effective sample size of theta_E: NUTS, bulk ESS
over its chains; nested, the Kish size of the importance weights; emcee, blackjax's bulk
ESS over the walkers (which are correlated, so this is optimistic for emcee). Nested
sampling's prior: the fit +- 10 Laplace errors. The load average is printed; run with
`nox -s bench` or
`python benchmarks/bench_sampling.py [--quick] [--only parametric|pixelized|throughput]`.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

import jax

jax.config.update("jax_enable_x64", True)

import numpy as np  # noqa: E402
from bench_fit import setup as parametric_setup  # noqa: E402

import equilens as el  # noqa: E402
from equilens import light, mass  # noqa: E402

THETA_E = "mass.components[0].theta_E"


def pixelized_setup():
    lens = mass.SIE(theta_E=1.2, e1=0.08, e2=-0.04) + mass.ExternalShear(0.02, -0.01)
    truth = el.LensSystem(
        mass=lens,
        source=light.Sersic(amp=15.0, R_sersic=0.2, n_sersic=1.2, e1=0.1, center_x=0.05),
    )
    grid = el.Grid((60, 60), 0.08)
    psf = el.GaussianPSF(fwhm=0.12, pixel_scale=0.08)
    data = el.simulate(
        jax.random.key(1), truth, grid, psf, exposure_time=2000.0, sky_level=1.0,
        mask=grid.circular_mask(2.2),
    )  # fmt: skip
    start = el.LensSystem(
        mass=mass.SIE(theta_E=1.1) + mass.ExternalShear(0.0, 0.0),
        source=el.PixelizedSource(el.RectangularMesh((20, 20)), el.ConstantRegularization(1.0)),
    )
    free = el.select(start, lambda s: s.mass)
    return data, el.Objective(el.LogEvidence(data)), start, free


def issue_lens():
    """Issue 46's lens: 80x80 pixels at 0.05", a 1.9" mask (4,548 pixels), a Gaussian
    PSF of 0.1" FWHM; SIE + shear, a Sersic lens light and a Sersic source."""
    truth = el.LensSystem(
        mass=mass.SIE(theta_E=1.1, e1=0.1, e2=-0.05) + mass.ExternalShear(0.03, 0.01),
        lens_light=light.Sersic(amp=8.0, R_sersic=0.6, n_sersic=3.5, e1=0.05, e2=0.02),
        source=light.Sersic(
            amp=4.0, R_sersic=0.15, n_sersic=1.3, e1=0.1, center_x=0.05, center_y=-0.03
        ),
    )
    grid = el.Grid((80, 80), 0.05)
    psf = el.GaussianPSF(fwhm=0.1, pixel_scale=0.05)
    data = el.simulate(
        jax.random.key(3), truth, grid, psf, exposure_time=1500.0, sky_level=0.5,
        mask=grid.circular_mask(1.9),
    )  # fmt: skip
    return data, psf


def run_command() -> None:
    """`equilens sample` with its defaults on `issue_lens`, in a subprocess: the whole
    command's wall time, the fit's stages and nested sampling's own line."""
    from astropy.io import fits

    data, psf = issue_lens()
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for name, arr in (("image", data.data), ("noise", data.noise_map), ("psf", psf.kernel())):
            paths[name] = os.path.join(tmp, f"{name}.fits")
            fits.PrimaryHDU(np.asarray(arr)).writeto(paths[name])
        argv = [
            paths["image"], "--noise-map", paths["noise"], "--psf", paths["psf"],
            "--pixel-scale", "0.05", "--mask-radius", "1.9", "--json",
            os.path.join(tmp, "out.json"),
        ]  # fmt: skip
        code = "import sys; from equilens.cli import main; sys.exit(main(sys.argv[1:]))"
        t0 = time.perf_counter()
        out = subprocess.run(
            [sys.executable, "-c", code, "sample", *argv], capture_output=True, text=True
        )
        wall = time.perf_counter() - t0
    print(f"equilens sample, defaults, issue 46's lens (80x80, 4,548 pixels): {wall:.1f} s")
    for line in (out.stdout + out.stderr).splitlines():
        if re.search(r"stage \d|nested: finished|^log Z|theta_E", line):
            print("  " + line.strip())
    if out.returncode != 0:
        print(f"  exit status {out.returncode}:\n{out.stderr[-2000:]}")


def run_lens_light(quick: bool) -> None:
    """NUTS on `issue_lens` with a Sersic and with an MGE lens light (4 chains, one after
    another or vmapped as `chain_method="auto"` picks), each from its own fit."""
    from equilens.solve import fit_lens

    data, _ = issue_lens()
    row = Rows()
    for lens_light in ("sersic", "mge"):
        result = fit_lens(data, "sie+shear", lens_light, "sersic", log=None)
        objective = el.Objective(el.GaussianLikelihood(data, nonnegative=True))
        row(
            f"NUTS, {lens_light} lens light",
            run_nuts(objective, result, None, 4, *((50, 50) if quick else (200, 300))),
        )


def run_nuts(objective, result, free, chains, warmup, draws, depth=10):
    t0 = time.perf_counter()
    post = el.sample(
        jax.random.key(0), objective, result, free=free, n_chains=chains, n_warmup=warmup,
        n_samples=draws, max_tree_depth=depth,
    )  # fmt: skip
    jax.block_until_ready(post.samples)
    wall = time.perf_counter() - t0
    k = post.names.index(THETA_E)
    ess = float(post.ess()[k])
    rhat = float(post.rhat()[k])
    steps = float(np.mean(np.asarray(post.tree_steps)))
    return wall, ess, f"R-hat {rhat:.3f}, {steps:.0f} leapfrog steps/draw"


def run_nested(objective, result, free, processes, n_eff):
    t0 = time.perf_counter()
    post = el.nested_sample(
        objective, result, free=free, box_width=10.0, n_live=1000, n_eff=n_eff,
        n_networks=2, processes=processes, threads=1, seed=0,
    )  # fmt: skip
    wall = time.perf_counter() - t0
    return (
        wall,
        post.n_eff,
        f"{post.n_likelihood} calls on {post.backend}, log Z {post.log_evidence:.2f}",
    )


def run_emcee(data, result, walkers_per_param, burn, run):
    """lenstronomy's FittingSequence MCMC (emcee) on the parametric problem, started at
    the equilens fit (its values in lenstronomy's conventions, sigma from the fit's
    errors)."""
    try:
        from lenstronomy.Workflow.fitting_sequence import FittingSequence
    except ImportError:
        return None
    grid = data.grid
    n = grid.shape[0]
    scale = grid.pixel_scale
    half = (n - 1) / 2 * scale
    kwargs_data = {
        "image_data": np.asarray(data.data),
        "noise_map": np.where(np.asarray(data.mask), np.asarray(data.noise_map), 1e10),
        "ra_at_xy_0": -half,
        "dec_at_xy_0": -half,
        "transform_pix2angle": np.array([[scale, 0.0], [0.0, scale]]),
    }
    kwargs_psf = {"psf_type": "PIXEL", "kernel_point_source": np.asarray(data.psf.kernel())}
    kwargs_model = {
        "lens_model_list": ["SIE", "SHEAR"],
        "source_light_model_list": ["SERSIC_ELLIPSE"],
        "lens_light_model_list": ["SERSIC_ELLIPSE"],
    }
    m = result.model
    sie, shear = m.mass.components
    ll, src = m.lens_light, m.source

    def f(x):
        return float(np.asarray(x))

    lens = [
        {"theta_E": f(sie.theta_E), "e1": f(sie.e1), "e2": f(sie.e2),
         "center_x": f(sie.center_x), "center_y": f(sie.center_y)},
        {"gamma1": f(shear.gamma1), "gamma2": f(shear.gamma2), "ra_0": 0.0, "dec_0": 0.0},
    ]  # fmt: skip

    def sersic(p):
        return {
            "amp": f(p.amp), "R_sersic": f(p.R_sersic), "n_sersic": f(p.n_sersic),
            "e1": f(p.e1), "e2": f(p.e2), "center_x": f(p.center_x), "center_y": f(p.center_y),
        }  # fmt: skip

    err = dict(zip(result.names, np.asarray(result.errors), strict=True))

    def sig(prefix, keys):
        return {k: max(err.get(f"{prefix}.{k}", 0.01), 1e-4) for k in keys}

    mass_keys = ["theta_E", "e1", "e2", "center_x", "center_y"]
    light_keys = ["R_sersic", "n_sersic", "e1", "e2", "center_x", "center_y"]
    big = {"theta_E": 10, "e1": 0.6, "e2": 0.6, "center_x": 10, "center_y": 10}
    light_lower = {"R_sersic": 0.001, "n_sersic": 0.3, "e1": -0.6, "e2": -0.6, "center_x": -10,
                   "center_y": -10}  # fmt: skip
    light_upper = {"R_sersic": 10, "n_sersic": 10, "e1": 0.6, "e2": 0.6, "center_x": 10,
                   "center_y": 10}  # fmt: skip
    kwargs_params = {
        "lens_model": [
            lens,
            [sig("mass.components[0]", mass_keys), sig("mass.components[1]", ["gamma1", "gamma2"])],
            [{}, {"ra_0": 0.0, "dec_0": 0.0}],
            [{k: -v for k, v in big.items()}, {"gamma1": -0.5, "gamma2": -0.5}],
            [big, {"gamma1": 0.5, "gamma2": 0.5}],
        ],
        "source_model": [
            [sersic(src)], [sig("source", light_keys)], [{}],
            [light_lower], [light_upper],
        ],
        "lens_light_model": [
            [sersic(ll)], [sig("lens_light", light_keys)], [{}],
            [light_lower], [light_upper],
        ],
    }  # fmt: skip
    fitting = FittingSequence(
        {"multi_band_list": [[kwargs_data, kwargs_psf, {"supersampling_factor": 1}]],
         "multi_band_type": "single-band"},
        kwargs_model,
        {"linear_solver": True},
        {"check_bounds": True, "image_likelihood_mask_list": [np.asarray(data.mask)]},
        kwargs_params,
    )  # fmt: skip
    t0 = time.perf_counter()
    out = fitting.fit_sequence(
        [["emcee", {"n_burn": burn, "n_run": run, "walkerRatio": walkers_per_param,
                   "sigma_scale": 1.0, "progress": False}]]
    )  # fmt: skip
    wall = time.perf_counter() - t0
    _, chain, names, _ = out[0]
    k = names.index("theta_E_lens0")
    n_walkers = walkers_per_param * chain.shape[1]
    # emcee's flat chain is step-major: (steps, walkers)
    theta = chain[:, k].reshape(run, n_walkers).T
    ess = bulk_ess(theta)
    return wall, ess, f"{n_walkers} walkers x {run} steps after {burn} burn-in"


def bulk_ess(chains: np.ndarray) -> float:
    """Bulk ESS of `(chains, draws)` (blackjax's, as `Posterior.ess`)."""
    from blackjax.diagnostics import ess_bulk

    from equilens.solve._sample import _blackjax_promotion

    with _blackjax_promotion():
        return float(ess_bulk(jax.numpy.asarray(chains)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="shorter runs (a smoke test)")
    parser.add_argument(
        "--repeats", type=int, default=1, help="(nox -s bench's shared option: each run is once)"
    )
    parser.add_argument(
        "--only",
        choices=["parametric", "pixelized", "throughput", "command", "lens-light"],
        help="run one of the problems, or the likelihood throughput alone",
    )
    parser.add_argument(
        "--processes",
        default="1,2",
        help="throughput: the comma-separated counts of worker processes (and of Numba "
        "threads in this process, unless --threads) to time (default 1,2; e.g. 1,2,4,8,16 "
        "on a many-core machine)",
    )
    parser.add_argument(
        "--threads", default=None, help="throughput: Numba thread counts (default: --processes)"
    )
    args = parser.parse_args()
    q = args.quick
    load = os.getloadavg()[0]
    print(f"device: {jax.devices()[0].device_kind}, load average {load:.2f}, float64")

    if args.only in (None, "parametric"):
        _, data, start = parametric_setup()
        objective = el.Objective(el.GaussianLikelihood(data))
        result = el.fit(objective, start, "lm", max_steps=300)
        print(f"parametric 100x100: {result.n_free} parameters, fit: {result.message()}")
        row = Rows()
        row(
            "NUTS, 4 chains",
            run_nuts(objective, result, None, 4, *((100, 100) if q else (200, 300))),
        )
        for processes in (1, 2):
            row(
                f"nested, {processes} process(es)",
                run_nested(objective, result, None, processes, 500 if q else 2000),
            )
        emcee = run_emcee(data, result, 4, *((50, 50) if q else (500, 500)))
        if emcee is not None:
            row("lenstronomy emcee", emcee)

    if args.only in (None, "pixelized"):
        data, objective, start, free = pixelized_setup()
        result = el.fit(objective, start, "bfgs", free=free, max_steps=500)
        print(f"pixelized 60x60 (20x20 mesh): {result.n_free} parameters, fit: {result.message()}")
        row = Rows()
        # (trees capped at 64 steps: the evidence is smooth only piecewise, docs/sampling.md)
        nuts = run_nuts(objective, result, free, 4, *((50, 50) if q else (150, 200)), depth=6)
        row("NUTS, 4 chains", nuts)
        for processes in (1, 2):
            row(
                f"nested, {processes} process(es)",
                run_nested(objective, result, free, processes, 300 if q else 1000),
            )
    if args.only in (None, "lens-light"):
        run_lens_light(q)
    if args.only in (None, "command"):
        run_command()
    if args.only in (None, "throughput"):
        counts = [int(n) for n in args.processes.split(",")]
        threads = counts if args.threads is None else [int(n) for n in args.threads.split(",")]
        throughput(100 if q else 400, threads, counts)
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")


def throughput(n_points: int, threads=(1, 2), processes=(1, 2)) -> None:
    """Nested sampling's likelihood throughput (points per second over one batch of
    `n_points`, as nautilus hands them over) on bench_fit's 100x100 lens with the CLI's
    default model (SIE + shear, a 20-Gaussian MGE lens light and a Sersic source, the
    amplitudes non-negative; 17 parameters): in this process with each count of Numba
    `threads`, and in each count of worker `processes` of one thread (`nested_sample`'s
    default on a CPU: one per core). Each median of 3."""
    from equilens.numba._terms import density
    from equilens.solve._parametrise import parametrisation
    from equilens.solve._start import start_model
    from equilens.solve._workers import DensityPool

    _, data, _ = parametric_setup()
    objective = el.Objective(el.GaussianLikelihood(data, nonnegative=True))
    start = start_model(data, "sie+shear", "mge", "sersic")
    param = parametrisation(objective, start, None, None)
    here = density(objective, start, param, "numba")
    rng = np.random.default_rng(0)
    points = here.x0 + 1e-3 * rng.standard_normal((n_points, here.x0.size))

    def rate(evaluate) -> float:
        evaluate(points[:4])
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            evaluate(points)
            times.append(time.perf_counter() - t0)
        return n_points / float(np.median(times))

    import numba

    rows = {}
    before = numba.get_num_threads()
    for n in threads:
        if n > numba.config.NUMBA_NUM_THREADS:
            continue
        numba.set_num_threads(n)
        rows[f"this process, {n} Numba thread(s)"] = rate(lambda p: [here.f(v) for v in p])
    numba.set_num_threads(before)
    for n in processes:
        with DensityPool(objective, start, param, "numba", n) as pool:
            rows[f"{n} worker process(es), 1 thread each"] = rate(pool)
    base = next(iter(rows.values()))
    print(
        f"likelihood throughput, 100x100 lens, MGE lens light, {n_points} points, "
        f"{os.cpu_count()} cores"
    )
    print(f"  {'evaluated in':<40}{'points/s':>10}{'x first row':>12}")
    for name, r in rows.items():
        print(f"  {name:<40}{r:10.1f}{r / base:12.2f}")


class Rows:
    """Prints one table row per sampler as it finishes; the first row (NUTS) is the
    reference of the last column."""

    def __init__(self):
        self.base_rate = None
        print(f"  {'sampler':<24}{'wall s':>9}{'ESS(theta_E)':>14}{'ESS/s':>9}{'/ NUTS':>8}  notes")

    def __call__(self, name, result):
        wall, ess, note = result
        rate = ess / wall
        self.base_rate = self.base_rate or rate
        ratio = rate / self.base_rate
        print(f"  {name:<24}{wall:9.1f}{ess:14.0f}{rate:9.2f}{ratio:8.2f}  {note}", flush=True)


if __name__ == "__main__":
    main()
