"""Numba backend vs JAX backend, through the calls a user writes, in one run.

Model: SIE + external shear, Sersic lens light, Sersic source (as bench_forward.py), 21x21
pixelated PSF, 0.05" pixels, float64; images of 50x50 to 400x400 pixels.

- JAX: `jax.jit(lambda s: s.image(grid, psf))(system)` (compiled once per shape; the
  compile time is printed), with the PSF as a `PixelPSF` (the README's call) and as a
  prepared `FFTConvolution` (what fits use).
- Numba: `equilens.numba.image(system, grid, psf)` (no compilation per shape), on 1 and 2
  threads (`numba.set_num_threads`).
- The Gaussian likelihood `objective(model)` (jitted) against
  `equilens.numba.value(objective, model)`, amplitudes fitted and solved linearly.
- The pixelized log-evidence on bench_pixelized.py's data (100x100, 9,504 mask pixels,
  21x21 PSF; a 32x32 rectangular mesh and a ~1,000-node Delaunay mesh, constant
  regularization): `LogEvidence(data)(system)` jitted (its "auto" route on a CPU: the
  sparse host kernels) against `equilens.numba.value(term, system)`, at 1 and 2 threads;
  and from 50x50 to 400x400 images of the same field (a 32x32 mesh).

Medians of many calls; the machine's load average is printed with them. Ratios > 1 mean
the Numba backend is faster. Run with `nox -s bench` or
`python benchmarks/bench_numba.py [--repeats N]`.
"""

import argparse
import os
import statistics
import time

import jax

jax.config.update("jax_enable_x64", True)

import numba  # noqa: E402
import numpy as np  # noqa: E402
from bench_forward import median_time  # noqa: E402

import equilens as el  # noqa: E402
import equilens.numba as enb  # noqa: E402
from equilens import light, mass  # noqa: E402

SIZES = (50, 100, 200, 400)


def setup(n: int):
    system = el.LensSystem(
        mass=mass.SIE(theta_E=1.2, e1=0.1, e2=-0.05, center_x=0.02, center_y=-0.01)
        + mass.ExternalShear(gamma1=0.03, gamma2=-0.01),
        lens_light=light.Sersic(
            amp=8.0, R_sersic=0.9, n_sersic=3.5, e1=0.05, e2=0.02, center_x=0.02, center_y=-0.01
        ),
        source=light.Sersic(
            amp=20.0, R_sersic=0.15, n_sersic=1.3, e1=0.1, e2=0.1, center_x=0.05, center_y=0.03
        ),
    )
    k = np.asarray(el.GaussianPSF(fwhm=0.12, pixel_scale=0.05).kernel())
    pad = (21 - k.shape[0]) // 2
    psf = el.PixelPSF(np.pad(k, pad))
    return system, el.Grid((n, n), 0.05), psf


def bench_size(n: int, repeats: int) -> dict[str, float]:
    system, grid, psf = setup(n)
    conv = psf.fft_operator(grid.shape)
    out = {}
    jit_psf = jax.jit(lambda s, p: s.image(grid, p))
    t0 = time.perf_counter()
    ref = np.asarray(jit_psf(system, psf))
    out["jax_compile"] = time.perf_counter() - t0
    out["jax_psf"] = median_time(lambda: jit_psf(system, psf).block_until_ready(), repeats)
    jit_conv = jax.jit(lambda s, c: s.image(grid, c))
    jit_conv(system, conv).block_until_ready()
    out["jax_conv"] = median_time(lambda: jit_conv(system, conv).block_until_ready(), repeats)
    got = enb.image(system, grid, psf)
    out["max_rel_diff"] = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
    before = numba.get_num_threads()
    try:
        for threads in (1, 2):
            numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
            enb.image(system, grid, psf)
            out[f"numba_{threads}"] = median_time(lambda: enb.image(system, grid, psf), repeats)
    finally:
        numba.set_num_threads(before)
    return out


def alternate(jax_call, numba_call, repeats: int) -> dict[str, float]:
    """Median seconds of `jax_call()` and of `numba_call()` on 1 and 2 Numba threads, the
    calls alternating (so that changes of the machine's load hit all three alike); Numba's
    thread count is restored afterwards."""
    times = {"jax": [], "numba_1": [], "numba_2": []}
    before = numba.get_num_threads()
    try:
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax_call()
            times["jax"].append(time.perf_counter() - t0)
            for threads in (1, 2):
                numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
                t0 = time.perf_counter()
                numba_call()
                times[f"numba_{threads}"].append(time.perf_counter() - t0)
    finally:
        numba.set_num_threads(before)
    return {k: statistics.median(v) for k, v in times.items()}


def bench_likelihood(repeats: int) -> dict[str, float]:
    """`objective(model)` (jitted, JAX) against `equilens.numba.value(objective, model)`
    for a Gaussian likelihood on the 100x100 problem, amplitudes fitted and solved.
    The calls of the backends alternate, so that load changes hit both alike."""
    import equinox as eqx

    system, grid, psf = setup(100)
    data = el.simulate(jax.random.key(0), system, grid, psf, exposure_time=1000.0, sky_level=1.0)
    out = {}
    for linear in (False, True):
        objective = el.Objective(el.GaussianLikelihood(data, linear=linear))
        arrays, static = eqx.partition((objective, system), eqx.is_array)
        fn = jax.jit(lambda a, static=static: (lambda o, m: o(m))(*eqx.combine(a, static)))
        ref = float(fn(arrays))
        assert abs(enb.value(objective, system) - ref) < 1e-9 * abs(ref)
        times = alternate(
            lambda fn=fn, arrays=arrays: fn(arrays).block_until_ready(),
            lambda objective=objective: enb.value(objective, system),
            repeats,
        )
        for key, t in times.items():
            out[f"{key}_{'linear' if linear else 'fitted'}"] = t
    return out


def bench_evidence(repeats: int) -> dict[str, dict[str, float]]:
    """The pixelized log-evidence, JAX (jitted) against the Numba backend, per mesh; the
    calls alternate between the backends."""
    from bench_pixelized import dataset

    lens, data, _ = dataset()
    term = el.LogEvidence(data)
    meshes = {
        "rectangular 32x32": el.RectangularMesh((32, 32)),
        "delaunay ~1000": el.DelaunayMesh.from_mask(data.grid, np.asarray(data.mask), 1000),
    }
    fn = jax.jit(lambda t, s: t(s))
    out = {}
    for name, mesh in meshes.items():
        system = el.LensSystem(
            mass=lens, source=el.PixelizedSource(mesh, el.ConstantRegularization(1e-3))
        )
        ref = float(fn(term, system))
        got = enb.value(term, system)
        out[name] = alternate(
            lambda term=term, system=system: fn(term, system).block_until_ready(),
            lambda term=term, system=system: enb.value(term, system),
            repeats,
        )
        out[name]["rel_diff"] = abs(got - ref) / abs(ref)
    return out


def bench_laplace(repeats: int) -> dict[str, dict[str, float]]:
    """`laplace_evidence(smoothed=True)` (the subhalo scan's evidence of a cell) over the
    SIE's 5 parameters on bench_pixelized.py's data, an MGE lens light of 8 Gaussians held
    (solved linearly), constant regularization, on a 32x32 rectangular mesh and on the
    scan's brightness-adaptive one (`AdaptiveRectangularMesh(weight_floor=0.1)`, the
    noiseless image as adapt image); its values from JAX (`backend="jax"`) against the
    Numba backend on one thread, the calls alternating. Seconds per evidence and the
    evidences' difference."""
    import equinox as eqx
    import jax.numpy as jnp
    from bench_pixelized import dataset

    from equilens.solve import laplace_evidence

    lens, data, _ = dataset()
    adapt = np.asarray(
        el.LensSystem(
            mass=lens, source=light.Sersic(amp=20.0, R_sersic=0.15, n_sersic=1.3, e1=0.1)
        ).image(data.grid)
    )
    mge = light.MGE(amp=jnp.ones(8), sigma=jnp.geomspace(0.02, 3.0, 8), e1=0.1)
    meshes = {
        "rectangular 32x32": (el.RectangularMesh((32, 32)), el.LogEvidence(data)),
        "brightness 32x32": (
            el.AdaptiveRectangularMesh((32, 32), weight_floor=0.1),
            el.LogEvidence(data, adapt_image=adapt),
        ),
    }
    out = {}
    before = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        for name, (mesh, term) in meshes.items():
            objective = el.Objective(term)
            system = el.LensSystem(
                mass=lens,
                lens_light=mge,
                source=el.PixelizedSource(mesh, el.ConstantRegularization(1e-3)),
            )
            free = eqx.tree_at(
                lambda s: s.mass,
                jax.tree.map(lambda _: False, system),
                replace_fn=lambda m: jax.tree.map(lambda _: True, m),
            )
            times: dict[str, list[float]] = {"jax": [], "numba": []}
            got = {}
            for _ in range(repeats + 1):  # (the first of each compiles: not timed)
                for backend in ("jax", "numba"):
                    t0 = time.perf_counter()
                    got[backend] = laplace_evidence(
                        objective, system, free=free, smoothed=True, backend=backend
                    )
                    times[backend].append(time.perf_counter() - t0)
            out[name] = {k: statistics.median(v[1:]) for k, v in times.items()}
            out[name]["diff"] = abs(got["numba"].log_evidence - got["jax"].log_evidence)
            out[name]["parameters"] = len(got["jax"].names)
    finally:
        numba.set_num_threads(before)
    return out


def bench_evidence_sizes(repeats: int) -> dict[int, dict[str, float]]:
    """The pixelized log-evidence (32x32 rectangular mesh) from 50x50 to 400x400 images of
    the same 5" field (pixels of 5"/n, a 3" mask, a 21x21 PSF of FWHM 2.4 pixels):
    JAX (jitted) against the Numba backend at 1 and 2 threads."""
    out = {}
    lens = mass.SIE(theta_E=1.2, e1=0.0, e2=0.0)
    truth = el.LensSystem(
        mass=lens,
        source=light.Sersic(amp=20.0, R_sersic=0.15, n_sersic=1.3, e1=0.1, center_x=0.05),
    )
    fn = jax.jit(lambda t, s: t(s))
    for n in SIZES:
        ps = 5.0 / n
        grid = el.Grid((n, n), ps)
        k = np.asarray(el.GaussianPSF(fwhm=2.4 * ps, pixel_scale=ps, truncation=8.0).kernel())
        pad = (21 - k.shape[0]) // 2
        kernel = np.pad(k, pad) if pad > 0 else k[-pad : k.shape[0] + pad, -pad : k.shape[1] + pad]
        data = el.simulate(
            jax.random.key(0),
            truth,
            grid,
            el.PixelPSF(kernel),
            exposure_time=2000.0,
            sky_level=1.0,
            mask=grid.circular_mask(3.0),
        )
        term = el.LogEvidence(data)
        system = el.LensSystem(
            mass=lens,
            source=el.PixelizedSource(
                el.RectangularMesh((32, 32)), el.ConstantRegularization(1e-3)
            ),
        )
        ref = float(fn(term, system))
        got = enb.value(term, system)
        out[n] = alternate(
            lambda term=term, system=system: fn(term, system).block_until_ready(),
            lambda term=term, system=system: enb.value(term, system),
            max(3, repeats * 100 // n),
        )
        out[n]["mask"] = int(np.asarray(data.mask).sum())
        out[n]["rel_diff"] = abs(got - ref) / abs(ref)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=100)
    args = parser.parse_args()
    t0 = time.perf_counter()
    system, grid, psf = setup(20)
    enb.image(system, grid, psf)  # compiles (or loads from Numba's cache) every kernel used
    first = time.perf_counter() - t0
    print(
        f"Numba vs JAX backend: SIE + shear, 2 Sersics, 21x21 PSF, float64; jax {jax.__version__},"
        f" numba {numba.__version__}, {os.cpu_count()} CPU cores, "
        f"load average {os.getloadavg()[0]:.2f}; Numba's first call {first:.1f} s"
    )
    print(
        "  pixels    JAX(PixelPSF)  JAX(FFTConv)  Numba 1 thr  Numba 2 thr  "
        "2thr/1thr  Numba2/JAX(PSF)  Numba2/JAX(FFT)  JAX compile  max rel diff"
    )
    ms = 1e3
    for n in SIZES:
        r = bench_size(n, max(10, args.repeats * 100 // n))
        print(
            f"  {n:3d}x{n:<3d}  {r['jax_psf'] * ms:11.3f}ms {r['jax_conv'] * ms:11.3f}ms "
            f"{r['numba_1'] * ms:10.3f}ms {r['numba_2'] * ms:10.3f}ms "
            f"{r['numba_1'] / r['numba_2']:9.2f}x {r['jax_psf'] / r['numba_2']:14.2f}x "
            f"{r['jax_conv'] / r['numba_2']:15.2f}x {r['jax_compile']:10.2f}s "
            f"{r['max_rel_diff']:12.1e}"
        )
    r = bench_likelihood(max(50, args.repeats * 3))
    print("  Gaussian likelihood objective(model), 100x100 (JAX jitted vs equilens.numba.value):")
    for kind in ("fitted", "linear"):
        j, n1, n2 = (r[f"{k}_{kind}"] for k in ("jax", "numba_1", "numba_2"))
        print(
            f"    amplitudes {kind:6s}  JAX {j * ms:7.3f} ms  Numba 1 thr {n1 * ms:7.3f} ms  "
            f"2 thr {n2 * ms:7.3f} ms  Numba(2)/JAX {n2 / j:5.2f}x  2thr/1thr {n1 / n2:5.2f}x"
        )
    print(
        "  Pixelized log-evidence, bench_pixelized.py's data (JAX jitted vs equilens.numba.value):"
    )
    for name, r in bench_evidence(max(10, args.repeats // 5)).items():
        j, n1, n2 = r["jax"], r["numba_1"], r["numba_2"]
        print(
            f"    {name:<18} JAX {j * ms:7.1f} ms  Numba 1 thr {n1 * ms:7.1f} ms  "
            f"2 thr {n2 * ms:7.1f} ms  Numba(2)/JAX {n2 / j:5.2f}x  2thr/1thr {n1 / n2:5.2f}x  "
            f"rel diff {r['rel_diff']:.1e}"
        )
    print(
        "  Laplace evidence of a pixelized model (smoothed: central differences of its "
        "values), the values by JAX vs Numba (1 thread):"
    )
    for name, r in bench_laplace(max(2, args.repeats // 30)).items():
        print(
            f"    {name:<18} {r['parameters']:.0f} parameters  JAX {r['jax']:6.1f} s  "
            f"Numba {r['numba']:6.1f} s  JAX/Numba {r['jax'] / r['numba']:5.2f}x  "
            f"|diff| {r['diff']:.1e}"
        )
    print('  Pixelized log-evidence by image size (5" field, 3" mask, 32x32 rectangular mesh):')
    for n, r in bench_evidence_sizes(max(3, args.repeats // 10)).items():
        j, n1, n2 = r["jax"], r["numba_1"], r["numba_2"]
        print(
            f"    {n:3d}x{n:<3d} {r['mask']:7d} pixels  JAX {j * ms:8.1f} ms  Numba 1 thr "
            f"{n1 * ms:8.1f} ms  2 thr {n2 * ms:8.1f} ms  Numba(2)/JAX {n2 / j:5.2f}x  "
            f"2thr/1thr {n1 / n2:5.2f}x  rel diff {r['rel_diff']:.1e}"
        )
    print(f"  (load average after the run: {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
