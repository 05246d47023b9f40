"""One solver step's cost on the demo's lens: the Jacobian of the whitened residuals that
each Levenberg-Marquardt step of `equilens demo` computes (forward mode, one tangent per
free parameter), on the shipped HST image of SDSS J0946+1006 (128x140 pixels, 7,516 in
the 3" mask, 2x2 supersampling, 21x21 PSF), with the CLI's default model (SIE + shear,
20-Gaussian MGE lens light and Sersic source, amplitudes solved non-negative).

Two free sets: the search's (mass and source, 13 parameters, the lens light held as the
first stage fitted it) and the last stage's (all 17 non-linear parameters); and the
residuals alone. Medians of `--repeats` calls after the compilation, float64.

Run with `python benchmarks/bench_step.py [--repeats N]` (part of `nox -s bench`).
"""

import argparse
import os
import statistics
import time

import jax

jax.config.update("jax_enable_x64", True)

import equinox as eqx  # noqa: E402

import equilens as el  # noqa: E402
from equilens.cli import demo_imaging  # noqa: E402
from equilens.objective import Parametrisation  # noqa: E402
from equilens.objective._params import linear_leaves  # noqa: E402
from equilens.solve import start_model  # noqa: E402


def setup():
    imaging = demo_imaging()
    model = start_model(imaging, "sie+shear", "mge", "sersic")
    objective = el.Objective(el.GaussianLikelihood(imaging, nonnegative=True))
    return imaging, model, objective


def median_time(fn, repeats: int) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(repeats: int) -> None:
    imaging, model, objective = setup()
    print(
        f"equilens step benchmark: the demo's lens, {imaging.shape} pixels, "
        f"{int(imaging.mask.sum())} in the mask, supersampling {imaging.grid.supersampling}; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    linear = linear_leaves(model, objective)
    rows = {
        "search (mass + source)": el.select(model, lambda s: (s.mass, s.source)),
        "all free": None,
    }
    for label, free in rows.items():
        param = Parametrisation.build(model, linear, free=free)
        raw = param.to_raw(model)

        def residuals(r, param=param):
            return objective.residuals(param.to_model(r, model))

        jac = eqx.filter_jit(jax.jacfwd(residuals))
        res = eqx.filter_jit(residuals)
        t_jac = median_time(lambda j=jac, r=raw: j(r), repeats)
        t_res = median_time(lambda f=res, r=raw: f(r), repeats)
        print(
            f"  {label:<24} {param.n_free:>2} parameters: Jacobian {1e3 * t_jac:7.1f} ms, "
            f"residuals {1e3 * t_res:6.1f} ms"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    main(parser.parse_args().repeats)
