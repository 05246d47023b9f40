"""Brightness-adaptive regularization benchmark: `log det H` by the entries' envelope on the
host against the dense factorisation.

`AdaptiveBrightness`'s `H` has a 5-point pattern (bandwidth N on an N x N mesh), but its
log det (the evidence's `log det H`) and, in the gradient, `H^-1` came from the dense
`N^2 x N^2` matrix; on a route that solves on the host (the CPU's "sparse" route) they now
come from its envelope (`equilens.numba._host_linalg.host_entries_logdet`). The
log-evidence and its value-and-gradient (mass parameters and the three regularization
parameters) of brightness-adaptive meshes of 32x32 and 40x40 nodes on `bench_pixelized`'s
data (100x100 pixels at 0.05", a 3" mask, 21x21 PSF, an SIE and a Sersic source, float64,
route "auto"), each with the new log det and with the dense one (`factored_logdet = False`,
the path before), the two calls alternating; medians and their ratio, and the two
log-evidences (equal to round-off).

Run with `nox -s bench` or `python benchmarks/bench_regularization.py [--repeats N]
[--cores all]`.
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
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--cores", default="one", help="'one' (default) or 'all'")
    args = parser.parse_args()
    pinned = _pin(args.cores)

    import equinox as eqx
    import jax

    jax.config.update("jax_enable_x64", True)
    import equilens as el

    class DenseLogDet(el.AdaptiveBrightness):
        """The path before: `log det H` (and `H^-1`) from the dense matrix."""

        factored_logdet = False

    lens, data, _ = dataset()
    term = el.LogEvidence(data)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"device: {jax.devices()[0].device_kind} ({pinned}); load {load:.2f}; "
        f"median of {args.repeats}, the two log dets alternating"
    )

    def where(s):
        r = s.source.regularization
        return (
            s.mass.theta_E,
            s.mass.e1,
            s.mass.e2,
            r.inner_coefficient,
            r.outer_coefficient,
            r.signal_scale,
        )

    def value(params, system):
        return term(eqx.tree_at(where, system, tuple(params)))

    f = jax.jit(value)
    g = jax.jit(jax.value_and_grad(value))
    params = tuple(jax.numpy.asarray(v) for v in (1.2, 0.0, 0.0, 1e-2, 1.0, 1.0))

    def paired(fn, a, b):
        """Medians of `fn(*a)` and `fn(*b)`, called alternately after warm-up calls."""
        outs = [jax.block_until_ready(fn(*x)) for x in (a, b)]
        for _ in range(args.warmup):
            for x in (a, b):
                jax.block_until_ready(fn(*x))
        times: list[list[float]] = [[], []]
        for _ in range(args.repeats):
            for k, x in enumerate((a, b)):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(*x))
                times[k].append(time.perf_counter() - t0)
        return outs, [statistics.median(t) for t in times]

    print(f"{'mesh':<16}{'log E (host)':>14}{'log E (dense)':>15}{'value':>22}{'val+grad':>24}")
    for n in (32, 40):
        mesh = el.AdaptiveRectangularMesh((n, n), weight_floor=0.1)
        systems = [
            el.LensSystem(mass=lens, source=el.PixelizedSource(mesh, reg(1e-2, 1.0, 1.0)))
            for reg in (el.AdaptiveBrightness, DenseLogDet)
        ]
        (v_host, v_dense), (tv_host, tv_dense) = paired(
            f, (params, systems[0]), (params, systems[1])
        )
        _, (tg_host, tg_dense) = paired(g, (params, systems[0]), (params, systems[1]))
        print(
            f"{n}x{n} brightness{-float(v_host):>14.4f}{-float(v_dense):>15.4f}"
            f"{tv_host * 1e3:>8.1f} / {tv_dense * 1e3:.1f} ms {tv_dense / tv_host:.2f}x"
            f"{tg_host * 1e3:>8.1f} / {tg_dense * 1e3:.1f} ms {tg_dense / tg_host:.2f}x"
        )


if __name__ == "__main__":
    main()
