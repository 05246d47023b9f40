"""Fitting benchmark: wall time and steps to fit a simulated 100x100 lens from a generic
start, per solver; a batch of 8 starts by `fit_batch` on each route against a loop of
`fit` calls; and the value-and-gradient throughput of a batch of 64 models.

Lens: SIE + external shear, Sersic lens light, Sersic source (amplitudes solved linearly,
17 free parameters); 100x100 pixels at 0.05", 2.5" circular mask, 21x21 pixelated PSF,
float64. For each solver: the first call (compile + fit) and the median of repeated fits
from the same start (compiled); the number of steps and the reduced chi2 reached. The batch
part compares a Python loop of single value-and-gradient calls with one `vmap`-ed call over
64 models (per model), in the same run.

Run with `nox -s bench` or `python benchmarks/bench_fit.py [--repeats N]`.
"""

import argparse
import statistics
import time

import jax

jax.config.update("jax_enable_x64", True)

import equinox as eqx  # noqa: E402
import numpy as np  # noqa: E402

import equilens as el  # noqa: E402
from equilens import light, mass  # noqa: E402

SOLVERS = {"lm": 300, "bfgs": 1000, "nonlinear-cg": 2000, "lbfgs": 1000, "adam": 3000}


def setup():
    truth = el.LensSystem(
        mass=mass.SIE(theta_E=1.2, e1=0.1, e2=-0.05, center_x=0.02, center_y=-0.01)
        + mass.ExternalShear(0.03, -0.01),
        lens_light=light.Sersic(amp=8.0, R_sersic=0.9, n_sersic=3.5, e1=0.05, e2=0.02),
        source=light.Sersic(amp=20.0, R_sersic=0.15, n_sersic=1.3, e1=0.1, center_x=0.05),
    )
    grid = el.Grid((100, 100), 0.05)
    k = np.asarray(el.GaussianPSF(fwhm=0.12, pixel_scale=0.05).kernel())
    pad = (21 - k.shape[0]) // 2
    psf = el.PixelPSF(np.pad(k, pad))
    data = el.simulate(
        jax.random.key(0),
        truth,
        grid,
        psf,
        exposure_time=2000.0,
        sky_level=1.0,
        mask=grid.circular_mask(2.5),
    )
    start = el.LensSystem(
        mass=mass.SIE(theta_E=1.0) + mass.ExternalShear(0.0, 0.0),
        lens_light=light.Sersic(amp=1.0, R_sersic=0.5, n_sersic=4.0),
        source=light.Sersic(amp=1.0, R_sersic=0.2, n_sersic=1.0),
    )
    return truth, data, start


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    jax.block_until_ready(out)
    return time.perf_counter() - t0, out


def main(repeats: int) -> None:
    truth, data, start = setup()
    obj = el.Objective(el.GaussianLikelihood(data))
    print(f"equilens fit benchmark: {data.shape} pixels, {int(data.mask.sum())} in the mask")
    print(f"{'solver':>14} {'first call':>11} {'fit (median)':>13} {'steps':>6} {'red. chi2':>10}")
    for name, steps in SOLVERS.items():
        first, r = timed(lambda n=name, s=steps: el.fit(obj, start, n, max_steps=s, throw=False))
        times = [
            timed(lambda n=name, s=steps: el.fit(obj, start, n, max_steps=s, throw=False))[0]
            for _ in range(repeats)
        ]
        te = float(r.model.mass.components[0].theta_E)
        print(
            f"{name:>14} {first:>10.2f}s {statistics.median(times):>12.3f}s "
            f"{int(r.num_steps):>6} {float(r.reduced_chi2):>10.4f}  theta_E={te:.4f} "
            f"({r.message()[:40] or 'ok'})"
        )

    # 8 starts (theta_E 0.9 .. 1.5), LM, 100 steps, no covariance: a loop of compiled
    # `fit` calls against `fit_batch` on each route (issue 46: the batch <= 1.1x the loop)
    thetas = np.linspace(0.9, 1.5, 8)
    starts = [
        eqx.tree_at(lambda s: s.mass.components[0].theta_E, start, np.float64(t)) for t in thetas
    ]
    stacked = jax.tree.map(lambda *x: np.stack(x), *starts)

    def loop():
        return [el.fit(obj, s, "lm", max_steps=100, throw=False, covariance=False) for s in starts]

    def batched(route):
        return el.fit_batch(obj, stacked, "lm", max_steps=100, covariance=False, route=route)

    first_loop = timed(loop)[0]
    first = {r: timed(lambda r=r: batched(r))[0] for r in ("vmap", "loop")}
    t_loop = statistics.median(timed(loop)[0] for _ in range(repeats))
    t_batch = {
        r: statistics.median(timed(lambda r=r: batched(r))[0] for _ in range(repeats))
        for r in ("vmap", "loop")
    }
    auto = el.solve.batch_route()
    print(
        f"8 starts, LM, 100 steps: loop of fit {t_loop:.2f} s (first {first_loop:.1f} s); "
        f"fit_batch route='vmap' {t_batch['vmap']:.2f} s ({t_batch['vmap'] / t_loop:.2f}x the "
        f"loop; first {first['vmap']:.1f} s), route='loop' {t_batch['loop']:.2f} s "
        f"({t_batch['loop'] / t_loop:.2f}x; first {first['loop']:.1f} s); 'auto' is "
        f"{auto!r} on this {jax.default_backend()}"
    )

    # value and gradient of the objective: one model per call vs 64 in one vmap
    param = el.objective.Parametrisation.build(
        truth, el.objective._params.linear_leaves(truth, obj)
    )
    raw = param.to_raw(truth)

    @eqx.filter_jit
    def vg(r):
        return jax.value_and_grad(lambda q: obj(param.to_model(q, truth)))(r)

    batch = jax.tree.map(
        lambda x: x + 1e-3 * jax.random.normal(jax.random.key(1), (64, *x.shape), x.dtype), raw
    )
    vg_batch = eqx.filter_jit(eqx.filter_vmap(vg))
    timed(lambda: vg(raw))
    timed(lambda: vg_batch(batch))
    single = statistics.median(timed(lambda: vg(raw))[0] for _ in range(20 * repeats))
    loop = statistics.median(
        timed(lambda: [vg(jax.tree.map(lambda x, i=i: x[i], batch)) for i in range(64)])[0]
        for _ in range(repeats)
    )
    vmapped = statistics.median(timed(lambda: vg_batch(batch))[0] for _ in range(repeats))
    print(
        f"value-and-gradient (17 parameters, amplitudes solved): {1e3 * single:.2f} ms per "
        f"call; 64 models: loop {1e3 * loop / 64:.2f} ms/model, vmap {1e3 * vmapped / 64:.2f} "
        f"ms/model (vmap/loop throughput ratio {loop / vmapped:.2f}x)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    main(parser.parse_args().repeats)
