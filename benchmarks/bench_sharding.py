"""Throughput against device count: the same work on meshes of 1, 2 and 4 devices, in one
run (`equilens.shard`, `fit_batch(mesh=)`), float64.

- 4-band fit: value and gradient of bench_multiband's joint `MultiBandTerm` (a 100x100
  band and three 50x50 bands), each band's pixel rows split over the devices.
- 400x400 pixelized evidence: value and gradient of `LogEvidence` (dense route, 24x24
  rectangular source mesh, constant regularization) on a 400x400 image at 0.05" with a 4"
  mask, the mapping's image-pixel rows split.
- 256 multi-start fits: `fit_batch` of 256 starts (10 Levenberg-Marquardt steps each) on
  a 60x60 image, the batch axis split (with jaxlib 0.10, one start per CPU device at a
  time: see `equilens.shard`'s docs on that jaxlib's LAPACK deadlock).

Without an accelerator the devices are XLA's virtual CPU devices
(`--xla_force_host_platform_device_count=4`, set here unless XLA_FLAGS names a count):
they share the machine's cores, so on a 2-core machine splitting cannot beat one device
that already uses both cores; the numbers say what the partitioning costs there (and on a
multi-GPU node, what it gains). Medians, with the load average. Run with `nox -s bench` or
`python benchmarks/bench_sharding.py [--repeats N]`.
"""

import argparse
import os
import time

if "device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    )

import jax

jax.config.update("jax_enable_x64", True)

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from bench_forward import median_time  # noqa: E402
from bench_multiband import setup as multiband_setup  # noqa: E402

import equilens as el  # noqa: E402
from equilens import light, mass  # noqa: E402

DEVICES = [n for n in (1, 2, 4) if n <= len(jax.devices())]


def _lens(lens_light=True):
    return el.LensSystem(
        mass=mass.SIE(theta_E=1.2, e1=0.1, e2=-0.05) + mass.ExternalShear(0.03, -0.01),
        lens_light=light.Sersic(amp=4.0, R_sersic=0.8, n_sersic=3.5) if lens_light else None,
        source=light.Sersic(amp=12.0, R_sersic=0.15, n_sersic=1.3, center_x=0.05),
    )


def _simulate(side, scale, radius, seed=0):
    grid = el.Grid((side, side), scale)
    psf = el.GaussianPSF(fwhm=0.12, pixel_scale=scale)
    return el.simulate(
        jax.random.key(seed), _lens(), grid, psf, exposure_time=1000.0, sky_level=1.0,
        mask=grid.circular_mask(radius),
    )  # fmt: skip


def _per_device(label, term, model, repeats):
    grad = eqx.filter_jit(eqx.filter_value_and_grad(lambda m, t: t(m)))
    base = None
    v_ref = None
    for n in DEVICES:
        sharded = el.shard(term, el.device_mesh(n))
        t0 = time.perf_counter()
        v, _ = jax.block_until_ready(grad(model, sharded))
        compile_s = time.perf_counter() - t0
        t = median_time(lambda s=sharded: jax.block_until_ready(grad(model, s)), repeats)
        base = t if base is None else base
        v_ref = float(v) if v_ref is None else v_ref
        print(f"  {label:<28} {n} device(s) {1e3 * t:9.2f} ms  (1-device time / this "
              f"{base / t:.2f}; compile {compile_s:.1f} s; value rel. diff "
              f"{abs(float(v) / v_ref - 1):.1e})")  # fmt: skip


def main(repeats: int) -> None:
    print(f"bench_sharding: {len(jax.devices())} {jax.devices()[0].platform} devices, "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; medians of "
          f"{repeats} calls")  # fmt: skip

    data, model = multiband_setup()
    _per_device("4-band value+gradient", el.MultiBandTerm.build(data), model, repeats)

    big = _simulate(400, 0.05, 4.0)
    pixelized = el.LensSystem(
        mass=_lens().mass,
        lens_light=light.Sersic(amp=1.0, R_sersic=0.8, n_sersic=3.5),
        source=el.PixelizedSource(el.RectangularMesh((24, 24)), el.ConstantRegularization(1.0)),
    )
    evidence = el.LogEvidence(big, route="dense")
    label = f"400x400 evidence ({evidence.n_data} px)"
    _per_device(label, evidence, pixelized, max(3, repeats // 10))

    small = _simulate(60, 0.05, 1.4)
    objective = el.Objective(el.GaussianLikelihood(small))
    key = jax.random.key(1)
    start = _lens()
    starts = jax.tree.map(
        lambda x: x * (1 + 0.02 * jax.random.normal(key, (256, *jnp.shape(x)), x.dtype)),
        start,
    )
    base = None
    for n in DEVICES:
        mesh = el.device_mesh(n)
        el.fit_batch(objective, starts, "lm", max_steps=10, mesh=mesh)  # compiles
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            out = el.fit_batch(objective, starts, "lm", max_steps=10, mesh=mesh)
            jax.block_until_ready(out.value)
            times.append(time.perf_counter() - t0)
        t = sorted(times)[1]
        base = t if base is None else base
        print(f"  {'256 multi-start fits':<28} {n} device(s) {t:9.2f} s   (1-device time / "
              f"this {base / t:.2f}; {256 / t:.0f} fits/s)")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    main(parser.parse_args().repeats)
