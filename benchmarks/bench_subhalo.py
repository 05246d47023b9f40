"""The subhalo scan's cells per hour, in one run: one compiled fit after another (the
default on a CPU), every cell's fit in one vectorised program (`route="vmap"`, the default
on an accelerator), and a Dask `LocalCluster` of 2 one-thread workers.

The lens: SIE + shear (theta_E 1.2"), a Sersic source, an 80x80 grid at 0.05" (mask: the
annulus 0.5-1.9"), HST-like noise, a 1e10 Msun pseudo-Jaffe subhalo on the upper arc; a
parametric source (`GaussianLikelihood`, Levenberg-Marquardt); a 3x3 grid of cells (9
cells). Each route runs the scan twice and times the second (compiled programs kept),
`--repeats` times; medians. The 1-minute load average is printed beside.

Run with `nox -s bench` or `python benchmarks/bench_subhalo.py [--repeats N] [--no-dask]`.
"""

import argparse
import os
import statistics
import time

import jax

jax.config.update("jax_enable_x64", True)

import numpy as np  # noqa: E402

import equilens as el  # noqa: E402
from equilens import light, mass  # noqa: E402
from equilens.subhalo import Subhalo, subhalo_scan  # noqa: E402

LC = el.LensCosmology(0.222, 0.609)


def lens() -> tuple[el.Objective, el.FitResult]:
    grid = el.Grid((80, 80), pixel_scale=0.05)
    psf = el.GaussianPSF(fwhm=0.1, pixel_scale=0.05)
    macro = mass.SIE(theta_E=1.2, e1=0.05, e2=-0.03) + mass.ExternalShear(0.02, 0.01)
    src = light.Sersic(amp=20.0, R_sersic=0.15, n_sersic=1.0, center_x=0.05, e1=0.1)
    sub = Subhalo(
        log10_mass=10.0,
        cell_x=0.0,
        cell_y=1.2,
        half=0.3,
        host_theta_E=1.2,
        cosmology=LC,
        kind="pseudo_jaffe",
    )
    truth = el.LensSystem(mass=macro + sub.profile(), source=src)
    r = np.hypot(np.asarray(grid.x), np.asarray(grid.y))
    data = el.simulate(
        jax.random.key(1),
        truth,
        grid,
        psf,
        exposure_time=2000.0,
        sky_level=1.0,
        mask=(r > 0.5) & (r < 1.9),
    )
    objective = el.Objective(el.GaussianLikelihood(data))
    smooth = el.fit(objective, el.LensSystem(mass=macro, source=src), covariance=False)
    return objective, smooth


def timed(
    objective, smooth, repeats: int, grid: int = 3, **kw
) -> tuple[float, int, el.SubhaloScan]:
    # the grid's 9 cells only: no refinement (9 cells more) and no polishing fit (one more)
    kw = {"refine": 0, "polish": 0, **kw}
    scan = subhalo_scan(objective, smooth, LC, grid=grid, kind="pseudo_jaffe", progress=False, **kw)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        scan = subhalo_scan(
            objective, smooth, LC, grid=grid, kind="pseudo_jaffe", progress=False, **kw
        )
        times.append(time.perf_counter() - t)
    return statistics.median(times), len(scan.status), scan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-dask", action="store_true")
    parser.add_argument("--grid", type=int, default=3, help="cells per side (default 3)")
    args = parser.parse_args()
    objective, smooth = lens()
    n_cells = args.grid**2
    print(
        f"subhalo scan, {n_cells} cells of an 80x80 lens; {os.cpu_count()} CPUs, {jax.devices()[0]}"
    )
    rows = []
    for name, kw in (("loop", {"route": "loop"}), ("vmap", {"route": "vmap"})):
        t, n, scan = timed(objective, smooth, args.repeats, args.grid, **kw)
        rows.append((name, t, n, scan))
    if not args.no_dask:
        from distributed import Client, LocalCluster

        with LocalCluster(n_workers=2, threads_per_worker=1, processes=True) as cluster:
            with Client(cluster) as client:
                t, n, scan = timed(objective, smooth, args.repeats, args.grid, client=client)
                rows.append(("dask, 2 workers x 1 thread", t, n, scan))
    base = rows[0][1]
    for name, t, n, scan in rows:
        print(
            f"  {name:28s} {t:7.1f} s for {n} cells: {3600 * n / t:7.0f} cells/hour "
            f"({t / base:.2f}x the loop); best Delta log E {scan.best['delta_log_evidence']:.1f}"
        )
    print(f"  load average (1 min) {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
