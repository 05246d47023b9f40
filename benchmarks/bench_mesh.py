"""Source-mesh benchmark: what adapting the mesh to the source's brightness costs.

The log-evidence and its value-and-gradient (mass parameters and regularization strength)
of a 32x32 `AdaptiveRectangularMesh`, unweighted (the nodes at quantiles of the traced
pixels) and weighted by the brightness (`weight_floor=0.1`: the weighted quantiles of
`equilens.source._mesh.weighted_quantile`), on `bench_pixelized`'s data (100x100 pixels at
0.05", a 3" mask, 21x21 PSF, an SIE and a Sersic source, float64), the route "auto" (the
sparse Numba kernels on a CPU). Medians of repeated calls after warm-up calls, in one run,
and their ratio; the log-evidence of each (the brightness estimate: the data).

Run with `nox -s bench` or `python benchmarks/bench_mesh.py [--repeats N] [--cores all]`.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_pixelized import _pin, dataset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--cores", default="one", help="'one' (default) or 'all'")
    args = parser.parse_args()
    pinned = _pin(args.cores)

    import equinox as eqx
    import jax

    jax.config.update("jax_enable_x64", True)
    import equilens as el

    lens, data, _ = dataset()
    term = el.LogEvidence(data)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"device: {jax.devices()[0].device_kind} ({pinned}); load {load:.2f}; "
        f"median of {args.repeats}"
    )

    def where(s):
        return (s.mass.theta_E, s.mass.e1, s.mass.e2, s.source.regularization.coefficient)

    def value(params, system):
        return term(eqx.tree_at(where, system, tuple(params)))

    f = jax.jit(value)
    g = jax.jit(jax.value_and_grad(value))
    params = tuple(jax.numpy.asarray(v) for v in (1.2, 0.0, 0.0, 1e-3))

    def timed(fn, *a):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*a))
        first = time.perf_counter() - t0
        for _ in range(args.warmup):
            jax.block_until_ready(fn(*a))
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*a))
            times.append(time.perf_counter() - t0)
        return out, first, statistics.median(times)

    meshes = {
        "adaptive 32x32": el.AdaptiveRectangularMesh((32, 32)),
        "brightness 32x32": el.AdaptiveRectangularMesh((32, 32), weight_floor=0.1),
    }
    print(f"{'mesh':<18}{'log E':>12}{'value':>10}{'compile':>9}{'val+grad':>10}{'compile':>9}")
    medians = {}
    for name, mesh in meshes.items():
        system = el.LensSystem(
            mass=lens, source=el.PixelizedSource(mesh, el.ConstantRegularization(1e-3))
        )
        out, first_v, med_v = timed(f, params, system)
        _, first_g, med_g = timed(g, params, system)
        medians[name] = (med_v, med_g)
        print(
            f"{name:<18}{-float(out):>12.1f}{med_v * 1e3:>8.1f}ms{first_v:>8.1f}s"
            f"{med_g * 1e3:>8.1f}ms{first_g:>8.1f}s"
        )
    (v0, g0), (v1, g1) = medians.values()
    print(f"brightness / adaptive: value {v1 / v0:.2f}x, value and gradient {g1 / g0:.2f}x")


if __name__ == "__main__":
    main()
