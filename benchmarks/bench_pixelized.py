"""Pixelized-source benchmark: the log-evidence and its gradient, per mesh and route.

Data: 100x100 pixels at 0.05", 3" circular mask (9,504 pixels), 21x21 pixelated Gaussian PSF,
an isothermal lens (theta_E = 1.2") and a Sersic source with noise, float64. Source: a 32x32
`RectangularMesh` and a ~1,000-node `DelaunayMesh`, constant regularization. For each mesh
and each route of the curvature matrix ("dense", "w_tilde", "sparse"): the first call
(compile + run) and, after a few untimed warm-up calls, the median of repeated calls of
the log-evidence and of its value-and-gradient with respect to the mass parameters and
the regularization strength, and the compiled computation's memory (XLA's temporaries +
arguments + outputs).

By default the process is pinned to one CPU core (`--cores all` to use every core; on a GPU
machine the device does the work). PyAutoLens's log-evidence on the same arrays (same mask,
PSF, noise, lens and a 32x32 rectangular mesh, no sub-gridding) is timed in the same run
when `AUTOLENS_PYTHON` names a Python (>= 3.12) with `autolens` and `numba` installed
(`benchmarks/autolens_evidence.py`); both its dense "mapping" path and its numba "sparse"
path, and the ratio to equilens is printed.

Run with `nox -s bench` or `python benchmarks/bench_pixelized.py [--repeats N] [--warmup N]`.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

#: Warm-up calls stop once they took this long (the slow routes need none).
WARMUP_SECONDS = 5.0


def _pin(cores: str) -> str:
    if cores == "all" or not hasattr(os, "sched_setaffinity"):
        return "all cores"
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    return "one core"


def dataset():
    """The benchmark's lens (an SIE), simulated `Imaging` and 21x21 PSF kernel (NumPy)."""
    import jax
    import numpy as np

    import equilens as el
    from equilens import light, mass

    lens = mass.SIE(theta_E=1.2, e1=0.0, e2=0.0)
    truth = el.LensSystem(
        mass=lens,
        source=light.Sersic(amp=20.0, R_sersic=0.15, n_sersic=1.3, e1=0.1, center_x=0.05),
    )
    grid = el.Grid((100, 100), 0.05)
    k = np.asarray(el.GaussianPSF(fwhm=0.12, pixel_scale=0.05, truncation=8.0).kernel())
    pad = (21 - k.shape[0]) // 2
    kernel = np.pad(k, pad) if pad > 0 else k[-pad : k.shape[0] + pad, -pad : k.shape[1] + pad]
    psf = el.PixelPSF(kernel)
    mask = grid.circular_mask(3.0)
    data = el.simulate(
        jax.random.key(0), truth, grid, psf, exposure_time=2000.0, sky_level=1.0, mask=mask
    )
    return lens, data, kernel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--warmup", type=int, default=3, help="untimed calls after the first (both libraries)"
    )
    parser.add_argument("--cores", choices=["one", "all"], default="one")
    args = parser.parse_args()
    pinned = _pin(args.cores)  # before JAX starts its thread pools

    import jax

    jax.config.update("jax_enable_x64", True)
    import equinox as eqx
    import numpy as np

    import equilens as el

    lens, data, kernel = dataset()
    grid, mask = data.grid, np.asarray(data.mask)
    print(
        f"device: {jax.devices()[0].device_kind} ({pinned}); {int(mask.sum())} pixels in the "
        f"mask, PSF {kernel.shape[0]}x{kernel.shape[1]}, float64, median of {args.repeats}"
    )
    meshes = {
        "rectangular 32x32": el.RectangularMesh((32, 32)),
        "delaunay": el.DelaunayMesh.from_mask(grid, mask, 1000),
    }
    terms = {}
    # (sparse first: the other routes' gigabyte-sized programs leave the allocator in a
    # state that slows the next small one down by 10-30%)
    routes = ("sparse", "dense", "w_tilde")
    for route in routes:
        t0 = time.perf_counter()
        terms[route] = el.LogEvidence(data, route=route)
        terms[route + "_setup"] = time.perf_counter() - t0

    def where(s):
        return (s.mass.theta_E, s.mass.e1, s.mass.e2, s.source.regularization.coefficient)

    def value(term, params, system):
        return term(eqx.tree_at(where, system, tuple(params)))

    def timed(fn, *a):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*a))
        first = time.perf_counter() - t0
        # (the first calls after compiling run up to 40% slower on this route: allocator,
        # caches; a fit makes thousands of calls, so the steady state is timed)
        spent = 0.0
        for _ in range(args.warmup):
            if spent > WARMUP_SECONDS:
                break
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*a))
            spent += time.perf_counter() - t0
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*a))
            times.append(time.perf_counter() - t0)
        return first, statistics.median(times)

    def memory(fn, *a):
        stats = fn.lower(*a).compile().memory_analysis()
        if stats is None:
            return float("nan")
        total = stats.temp_size_in_bytes + stats.argument_size_in_bytes + stats.output_size_in_bytes
        return total / 2**20

    print(
        f"precomputed once per dataset: w-tilde table {terms['w_tilde_setup']:.2f} s, sparse "
        f"tiles {terms['sparse_setup']:.2f} s"
    )
    print(
        f"{'mesh':<20}{'route':<9}{'n_src':>6}{'value':>10}{'compile':>9}{'val+grad':>10}"
        f"{'compile':>9}{'memory':>10}"
    )
    results = {}
    for name, mesh in meshes.items():
        system = el.LensSystem(
            mass=lens, source=el.PixelizedSource(mesh, el.ConstantRegularization(1e-3))
        )
        params = tuple(jax.numpy.asarray(v) for v in (1.2, 0.0, 0.0, 1e-3))
        for route in routes:
            term = terms[route]
            f = jax.jit(value)
            g = jax.jit(jax.value_and_grad(value, argnums=1))
            first_v, med_v = timed(f, term, params, system)
            first_g, med_g = timed(g, term, params, system)
            mem = max(memory(f, term, params, system), memory(g, term, params, system))
            results[(name, route)] = (med_v, med_g)
            print(
                f"{name:<20}{route:<9}{mesh.n_pixels:>6}{med_v * 1e3:>8.1f}ms"
                f"{first_v:>8.1f}s{med_g * 1e3:>8.1f}ms{first_g:>8.1f}s{mem:>8.0f}MiB"
            )
        best = min(routes, key=lambda r: results[(name, r)][0])
        ratios = ", ".join(
            f"{r}/{best} {results[(name, r)][0] / results[(name, best)][0]:.1f}x"
            f" ({results[(name, r)][1] / results[(name, best)][1]:.1f}x with gradient)"
            for r in routes
            if r != best
        )
        print(f"  {name}: fastest route {best}; {ratios}")

    python = os.environ.get("AUTOLENS_PYTHON")
    if not python:
        print(
            "PyAutoLens: not run (set AUTOLENS_PYTHON to a Python >= 3.12 with autolens and "
            "numba installed)"
        )
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "arrays.npz")
        np.savez(
            path,
            data=np.asarray(data.data),
            noise_map=np.asarray(data.noise_map),
            psf=kernel,
            mask=mask,
            pixel_scale=0.05,
            theta_E=1.2,
            rect_shape=np.array([32, 32]),
            repeats=args.repeats,
            warmup=args.warmup,
        )
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "autolens_evidence.py")
        run = subprocess.run(
            [python, script, path], capture_output=True, text=True, timeout=3600, check=False
        )
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("{")]
    if run.returncode != 0 or not lines:
        tail = (run.stderr or run.stdout).strip().splitlines()[-1:] or ["no output"]
        print(f"PyAutoLens: could not run ({tail[0]})")
        return
    al = json.loads(lines[-1])
    ours = min(results[("rectangular 32x32", r)][0] for r in routes)
    print(f"PyAutoLens {al['version']}, rectangular 32x32, same arrays ({pinned}):")
    # ("/matched": PyAutoLens's positive-negative solve without border relocation, the
    # problem equilens solves; without: its defaults, a positive-only solve)
    for path_name in ("mapping", "mapping/matched", "sparse", "sparse/matched"):
        if path_name in al:
            t = al[path_name]["median_s"]
            print(
                f"  {path_name:<16} log-evidence {t * 1e3:8.1f} ms (first call "
                f"{al[path_name]['first_s']:.1f} s, value {al[path_name]['log_evidence']:.4f}); "
                f"equilens best route {ours * 1e3:.1f} ms: PyAutoLens/equilens = {t / ours:.2f}"
            )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
