"""Multi-plane lensing with many halos: the image of one lens on JAX and Numba, and a batch
of realisations simulated in one vmapped call, in one run.

The lens: an SIE + shear at z = 0.5 and N truncated NFW halos (N = 1, 10, 100, 1,000) spread
over 10 planes from z = 0.1 to 1.3 (source at 1.5), masses of about 1e7-1e10 Msun (Rs
0.01-0.1", alpha_Rs 1e-4-1e-2"), positions uniform in a 6" square; a Sersic source; a
100x100 grid at 0.05" (supersampling 2), Gaussian PSF of 0.1"; float64.

- Image: `LensSystem.image` (jitted) against `equilens.numba.image` on 1 and 2 Numba
  threads, the calls alternating; medians.
- Batch: 1,024 realisations of 10 and of 100 halos each (the same planes; `MultiPlane.stack`)
  simulated with noise by one `equilens.simulate_batch` call (vmapped in blocks of 64,
  which bounds memory) on a 64x64 grid at 0.05": images per second, compilation excluded.

Run with `nox -s bench` or `python benchmarks/bench_multiplane.py [--repeats N]`.
"""

import argparse
import os
import time

import jax

jax.config.update("jax_enable_x64", True)

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_forward import median_time  # noqa: E402
from bench_numba import alternate  # noqa: E402

import equilens as el  # noqa: E402
import equilens.numba as enb  # noqa: E402
from equilens import light, mass  # noqa: E402

PLANES = np.round(np.linspace(0.1, 1.3, 10), 3)
MAIN = mass.SIE(theta_E=1.2, e1=0.1, e2=-0.05) + mass.ExternalShear(0.03, -0.01)
SOURCE = light.Sersic(amp=20.0, R_sersic=0.15, n_sersic=1.3, center_x=0.05)


def halos(n: int, seed: int) -> tuple[list, list[float]]:
    rng = np.random.default_rng(seed)
    out = [
        mass.TNFW(
            Rs=10 ** rng.uniform(-2, -1),
            alpha_Rs=10 ** rng.uniform(-4, -2),
            r_trunc=10 ** rng.uniform(-1, 0),
            center_x=rng.uniform(-3, 3),
            center_y=rng.uniform(-3, 3),
        )
        for _ in range(n)
    ]
    # (every plane has at least one halo when n >= 10, so that realisations share planes)
    zs = [float(PLANES[i % len(PLANES)]) for i in range(n)]
    return out, zs


def lens(n: int, seed: int = 0) -> mass.MultiPlane:
    hs, zs = halos(n, seed)
    return mass.MultiPlane([MAIN, *hs], [0.5, *zs], 1.5)


def bench_image(repeats: int) -> None:
    grid = el.Grid((100, 100), 0.05, supersampling=2)
    psf = el.GaussianPSF(0.1, 0.05)
    print('image of one lens, 100x100 at 0.05" (supersampling 2), milliseconds (median):')
    print(f"{'halos':>6} {'JAX':>9} {'Numba 1':>9} {'Numba 2':>9} {'JAX/N2':>7}  compile")
    for n in (1, 10, 100, 1000):
        system = el.LensSystem(mass=lens(n), source=SOURCE)
        image = eqx.filter_jit(lambda s: s.image(grid, psf))
        t0 = time.perf_counter()
        image(system).block_until_ready()
        compile_s = time.perf_counter() - t0
        jax_im = np.asarray(image(system))
        nb_im = enb.image(system, grid, psf)
        err = float(np.max(np.abs(nb_im - jax_im)) / np.max(np.abs(jax_im)))
        assert err < 1e-10, err
        t = alternate(
            lambda s=system, f=image: f(s).block_until_ready(),
            lambda s=system: enb.image(s, grid, psf),
            repeats if n < 1000 else max(3, repeats // 4),
        )
        print(
            f"{n:>6} {1e3 * t['jax']:>9.2f} {1e3 * t['numba_1']:>9.2f} "
            f"{1e3 * t['numba_2']:>9.2f} {t['jax'] / t['numba_2']:>7.2f}  {compile_s:.1f} s"
        )


def bench_batch(repeats: int) -> None:
    grid = el.Grid((64, 64), 0.05)
    psf = el.GaussianPSF(0.1, 0.05)
    n_real = 1024
    print(f"\n{n_real} realisations simulated in one call (64x64, vmapped in blocks of 64):")
    for n in (10, 100):
        batch = mass.MultiPlane.stack([lens(n, seed) for seed in range(n_real)])

        def system(m):
            return el.LensSystem(mass=m, source=SOURCE)

        def run(b):
            data, _ = el.simulate_batch(
                jax.random.key(0), system, b, grid, psf, exposure_time=1000.0, sky_level=1.0
            )
            return data.block_until_ready()

        t0 = time.perf_counter()
        out = run(batch)
        compile_s = time.perf_counter() - t0
        assert out.shape == (n_real, 64, 64) and bool(jnp.all(jnp.isfinite(out)))
        t = median_time(lambda b=batch: run(b), max(1, repeats // 10))
        print(
            f"  {n:>4} halos each: {t:.2f} s, {n_real / t:.0f} images/s "
            f"(first call with compilation {compile_s:.1f} s)"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs, jax {jax.__version__}")
    bench_image(args.repeats)
    bench_batch(args.repeats)


if __name__ == "__main__":
    main()
